"""`ballonet train --model hf:DIR`: a Hugging Face causal LM from a local folder, unmodified,
trained on Ballonet's plans with the remap (`integrations.hf`).

DIR holds a `config.json` and, optionally, weights (`model.safetensors`, or shards with
their index): without weights, the model is initialised from `seed`, the same on every
rank. Pickled weights (`pytorch_model.bin`) are refused, never unpickled. Nothing is
downloaded. The model keeps its class, state dict and blocks (so FSDP2
shards `model.model.layers` block by block); it gains one method, `loss`, with the
signature of `ballonet.training.parallelism.model.Transformer.loss`.

Activation recomputation (`--recompute`) checkpoints the model's own modules in place,
as `cost.memory.activation_bytes` prices it: "full" every decoder layer (its input kept;
the whole layer, remaps and rings included, run again in the backward), "selective"
every layer's `mlp` (its input kept; its projections and activation run again). The MLP's
input is the normed hidden state, which the model's layer computes outside `mlp`: so a
layer keeps `hidden` elements a token more than the cost model's "selective" (which
reruns the norm too, as `ballonet.llama` does): 8.5% of what that frees, on llama-7b.
The recomputation runs inside the plan context of the forward (`hf.recompute_context`).
With tensor parallelism (`training.parallelism.tensor_parallel.parallelize_hf`) the `mlp`'s input is
gathered by a hook outside its checkpoint: "selective" keeps that gathered input whole and
reruns no collective (the built-in model's "selective" reruns the gather instead).
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import sys
import typing
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from ballonet import runtime, user_files
from ballonet.errors import InputError
from ballonet.paths import read_json_object
from ballonet.plan import Plan
from ballonet.runtime.remapping import remap
from ballonet.specs import ModelSpec
from ballonet.training.data.loader import IGNORE_INDEX
from ballonet.training.parallelism.parallel import local_box, transformer_blocks

PREFIX = "hf:"
CONFIG = "config.json"
WEIGHTS = ("model.safetensors", "model.safetensors.index.json")
PICKLED = ("pytorch_model.bin", "pytorch_model.bin.index.json")
"""Pickled weights, never loaded (unpickling a file from elsewhere can run code)."""
RECOMPUTE = ("none", "selective", "full")


def is_hf(name: str) -> bool:
    return name.startswith(PREFIX)


def _folder(name: str) -> Path:
    folder = Path(name[len(PREFIX):] if is_hf(name) else name)
    if not folder.is_dir():
        raise InputError(f"--model {name}: {folder} is not a folder (hf:DIR needs a Hugging Face model folder)")
    if not os.path.lexists(folder / CONFIG):
        raise InputError(f"{folder}: no {CONFIG} in this folder (hf:DIR needs a Hugging Face model folder)")
    return folder


def _read_config(folder: Path) -> dict:
    """config.json, and every file transformers would read checked through `user_files`
    (regular files inside the folder); a config naming custom code (`auto_map`) is refused
    before transformers sees it: Ballonet never runs code from a model folder."""
    config = read_json_object(folder / CONFIG, "a JSON model config", folder=folder)
    if "auto_map" in config:
        raise InputError(f"{folder / CONFIG}: names custom code (auto_map), which Ballonet never runs; use a model "
                         "type transformers ships")
    shards: list[str] = []
    if os.path.lexists(folder / WEIGHTS[1]):
        index = user_files.read_json(folder / WEIGHTS[1], "json", folder, what="a safetensors index")
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) and f and "/" not in f and f != ".."
                                                        for f in weight_map.values()):
            raise InputError(f"{folder / WEIGHTS[1]}: not a safetensors index (no weight_map of file names)")
        shards = sorted(set(weight_map.values()))
    for name in (CONFIG, "generation_config.json", *WEIGHTS, *PICKLED, *shards):
        if os.path.lexists(folder / name) or name in shards:
            user_files.check(folder / name, "data", folder, what="a model file")
    return config


@contextlib.contextmanager
def _no_prompt():
    """transformers' calls with an empty standard input (no question ever reaches the
    user), its warnings, load report and progress bars off (a refusal is one line)."""
    from transformers.utils import logging

    stdin, verbosity, bars = sys.stdin, logging.get_verbosity(), logging.is_progress_bar_enabled()
    sys.stdin = io.StringIO("")
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        sys.stdin = stdin
        logging.set_verbosity(verbosity)
        if bars:
            logging.enable_progress_bar()


def config_dict(name: str) -> dict:
    """The config.json of `hf:DIR`, as a dict."""
    return _read_config(_folder(name))


def model_spec(name: str) -> ModelSpec:
    """The planner's and cost model's view of the model in `hf:DIR` (from config.json
    alone; transformers is not imported). Its name is the config file's path."""
    path = _folder(name) / CONFIG
    config = _read_config(path.parent)
    keys = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")
    missing = [k for k in keys if not isinstance(config.get(k), int)]
    if missing:
        raise InputError(f"{path}: no integer {', '.join(missing)} (a decoder-only causal LM config has them)")
    return ModelSpec(name=str(path), num_layers=config["num_hidden_layers"], hidden=config["hidden_size"],
                     num_heads=config["num_attention_heads"],
                     num_kv_heads=config["num_attention_heads"] if config.get("num_key_value_heads") is None
                     else config["num_key_value_heads"],
                     ffn_hidden=config["intermediate_size"], vocab_size=config["vocab_size"])


class BallonetLoss:
    """Mixed into a Hugging Face causal LM's class: the loss the training loop calls."""

    def loss(self, input_ids: torch.Tensor, labels: torch.Tensor, plan: Plan, rank: int, group=None,
             counter: runtime.ByteCounter | None = None, outer_group=None, *, meta: runtime.StepMeta | None = None,
             content: tuple[bytes, bytes] | None = None, verify_plan: bool = True) -> torch.Tensor:
        """`Transformer.loss`: ids and labels [T_att] in the attention layout move to the
        linear layout in one all-to-all; the model runs there (positions from the step's
        metadata), its attention through the plan. Returns the sum of token
        cross-entropies. `meta`, `content`, `verify_plan` as in `Transformer.loss`."""
        from ballonet.integrations import hf

        with hf.plan_context(plan, rank, group, counter=counter, outer_group=outer_group, meta=meta) as step:
            if verify_plan:
                step.check(input_ids.device, content)
            else:
                step.checked.append(input_ids.device)
            meta = step.meta_on(input_ids.device)
            moved_T2 = remap(torch.stack([input_ids, labels], 1), plan, rank, "attention", "linear", group,
                             counter, verify_plan=False, move=meta.to_linear)
            # The class's own forward, not self(...): FSDP2 runs its hooks around `loss`.
            logits_TV = hf.linear_logits(super().forward, moved_T2[:, 0], meta.positions)
        loss = F.cross_entropy(logits_TV, moved_T2[:, 1], ignore_index=IGNORE_INDEX, reduction="sum")
        # Replicated over the TP group; a copy, as FSDP2 warns of a view returned from its module.
        return loss.to_local().clone() if isinstance(loss, DTensor) else loss


def recomputed_modules(model: nn.Module, recompute: str, layers: int | None = None) -> list[nn.Module]:
    """The modules `recompute` reruns in the backward: none, every decoder layer ("full")
    or every decoder layer's `mlp` ("selective"; of the first `layers` layers if given)."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE)}, got {recompute!r}")
    if recompute == "none":
        return []
    blocks = list(transformer_blocks(model))
    if recompute == "full":
        return blocks
    blocks = blocks[:layers]
    if not all(isinstance(getattr(block, "mlp", None), nn.Module) for block in blocks):
        raise InputError(f"--recompute selective: {type(blocks[0]).__name__} has no `mlp` module to recompute "
                         "(use full or none)")
    return [block.mlp for block in blocks]


def enable_recompute(model: nn.Module, recompute: str, layers: int | None = None) -> None:
    """Checkpoint the `recomputed_modules` of `model` in place: each one's `forward` runs
    under `torch.utils.checkpoint` (non-reentrant), its class, parameter names and hooks
    unchanged. Module hooks, FSDP2's among them, stay outside the checkpoint (as with
    torchtitan's checkpoint wrapper): the recomputation runs on the weights FSDP2 gathered
    for the layer's backward."""
    for module in recomputed_modules(model, recompute, layers):
        module.forward = functools.partial(_checkpointed, module.forward)


def _checkpointed(forward, *args, **kwargs):
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    from ballonet.integrations import hf

    return checkpoint(forward, *args, use_reentrant=False, context_fn=hf.recompute_context, **kwargs)


def has_weights(name: str) -> bool:
    """Whether `hf:DIR` holds safetensors weights (else it is initialised from the seed)."""
    folder = _folder(name)
    return any((folder / w).is_file() for w in WEIGHTS)


@contextlib.contextmanager
def _parameters_on_meta():
    """Modules built here register their parameters on the meta device; their buffers (the
    rotary embedding's inverse frequencies) stay real, computed as the model computes them."""
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        if param is not None and not param.is_meta:  # one already there (a tied weight) is kept as it is
            param = nn.Parameter(param.to("meta"), param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def _weight_files(folder: Path) -> dict[str, Path]:
    """Each tensor name of the folder's safetensors weights, and the file holding it."""
    index = folder / WEIGHTS[1]
    if not index.is_file():
        from safetensors import safe_open

        with safe_open(folder / WEIGHTS[0], framework="pt") as f:
            return {key: folder / WEIGHTS[0] for key in f.keys()}
    weight_map = read_json_object(index, "a safetensors index").get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) and "/" not in v and v not in ("", ".", "..")
                                                   for v in weight_map.values()):
        raise InputError(f"{index}: field 'weight_map' must map tensor names to file names in this folder")
    return {key: folder / file for key, file in weight_map.items()}


@torch.no_grad()
def load_shards(model: nn.Module, name: str) -> None:
    """Fill `model`'s parameters (sharded, materialised with `to_empty`) from the weights in
    `hf:DIR`, each rank reading only its own shard of each tensor (`safe_open(...).get_slice`)."""
    from safetensors import SafetensorError, safe_open

    folder = _folder(name)
    tied = getattr(model, "all_tied_weights_keys", None) or {}  # a tied weight untied (by --tp) reads its source
    try:
        files = _weight_files(folder)
        where = {key: (file, key) for key, file in files.items()}  # a parameter's file and stored name
        where.update({key: (files[source], source) for key, source in tied.items()
                      if key not in files and source in files})
        missing = [key for key, _ in model.named_parameters() if key not in where]
        if missing:
            raise InputError(f"{folder}: the weights have no tensor {missing[0]!r} ({len(missing)} of the model's "
                             "parameters missing)")
        handles: dict[Path, typing.Any] = {}
        with contextlib.ExitStack() as stack:
            for key, p in model.named_parameters():
                file, stored_name = where[key]
                if file not in handles:
                    handles[file] = stack.enter_context(safe_open(file, framework="pt"))
                stored = handles[file].get_slice(stored_name)
                if tuple(stored.get_shape()) != tuple(p.shape):
                    raise InputError(f"{file}: tensor {stored_name!r} has shape {tuple(stored.get_shape())}, "
                                     f"the model's {tuple(p.shape)}")
                local = p.to_local() if isinstance(p, DTensor) else p
                local.copy_(stored[local_box(p)])
    except (OSError, SafetensorError) as e:
        raise InputError(f"{folder}: cannot read its weights ({str(e).splitlines()[0][:200]})") from None


def _first_line(e: BaseException) -> str:
    """An exception's message in one line (a first line that ends with a colon, as the
    hub's validation errors do, with the line after it)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()] or [type(e).__name__]
    return (lines[0] + (f" {lines[1]}" if lines[0].endswith(":") and len(lines) > 1 else ""))[:200]


def build_model(name: str, seed: int, device: torch.device, recompute: str = "none",
                recompute_layers: int | None = None) -> torch.nn.Module:
    """The causal LM of `hf:DIR` with attn_implementation="ballonet", fp32, on `device`,
    with activation recomputation `recompute` (`enable_recompute`; "selective" on the first
    `recompute_layers` layers if given). On the meta device (`device` "meta") its parameters
    hold nothing until `load_shards` reads each rank's shards (`training.parallelism.build`)."""
    folder = _folder(name)
    try:
        from safetensors import SafetensorError
        from transformers import AutoConfig, AutoModelForCausalLM

        from ballonet.integrations import hf
    except ImportError:
        raise InputError("--model hf:DIR needs transformers: pip install 'ballonet[hf]'") from None
    _read_config(folder)
    try:
        with _no_prompt():
            config = AutoConfig.from_pretrained(folder, local_files_only=True, trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 - transformers refuses a config with many types (TypeError, hub's validation)
        raise InputError(f"{folder / CONFIG}: transformers cannot read it ({_first_line(e)})") from None
    kw = {"attn_implementation": hf.ATTENTION, "dtype": torch.float32}
    has_weights = any((folder / w).is_file() for w in WEIGHTS)
    pickled = [w for w in PICKLED if (folder / w).is_file()]
    if pickled and not has_weights:
        raise InputError(f"{folder / pickled[0]}: pickled weights are not loaded (unpickling can run code); "
                         "save them as model.safetensors (save_pretrained(..., safe_serialization=True))")
    try:
        with _no_prompt():
            missing: list[str] = []  # load_shards checks the meta path's tensors itself
            if device.type == "meta":
                with _parameters_on_meta():
                    model = AutoModelForCausalLM.from_config(config, trust_remote_code=False, **kw)
            elif has_weights:
                model, info = AutoModelForCausalLM.from_pretrained(
                    folder, config=config, local_files_only=True, use_safetensors=True,  # never a pickled .bin
                    trust_remote_code=False, output_loading_info=True, **kw)
                missing = sorted(info.get("missing_keys") or ())
            else:
                torch.manual_seed(seed)  # every rank draws the same weights
                model = AutoModelForCausalLM.from_config(config, trust_remote_code=False, **kw)
    except (Exception, SafetensorError) as e:  # noqa: BLE001 - a config transformers took may still fail to build
        raise InputError(f"{folder}: cannot build a causal LM from it ({_first_line(e)})") from None
    try:
        transformer_blocks(model)
    except ValueError:
        raise InputError(f"{folder}: {type(model).__name__} has no decoder layers at model.layers or "
                         "model.model.layers, which Ballonet shards and plans block by block") from None
    if has_weights and missing:  # transformers would initialise them at random, with only a warning
        raise InputError(f"{folder}: its weights lack {len(missing)} of the model's tensors ({missing[0]}, ...): "
                         "stored under other names, or absent")
    cls = type(model)
    model.__class__ = type(f"Ballonet{cls.__name__}", (BallonetLoss, cls), {})
    enable_recompute(model, recompute, recompute_layers)
    return model if device.type == "meta" else model.to(device)
