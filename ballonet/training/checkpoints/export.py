"""`ballonet export`: a training checkpoint as a Hugging Face model folder (`config.json`
and `model.safetensors`) that `transformers` loads with `from_pretrained`.

The built-in model (`model.py`) becomes a `LlamaForCausalLM` with the same weights: its
RMSNorm, rotate-half RoPE (theta 10000, positions restarting at each document, as a
batch of one sequence is), SwiGLU and GQA are Llama's, so the logits agree (fp32,
tested). A Hugging Face model (`--model hf:DIR`) keeps its own config and weight names.

No pickle on the way: DCP's `.metadata` goes through torch's weights-only unpickler
(`safe_dcp.read_safe_metadata`: DCP's own metadata classes only), only the model's
tensors are read (`dcp.load` into tensors
shaped from that metadata; the optimizer's pickled items are never touched), and the
weights are written with safetensors.
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ballonet.errors import InputError
from ballonet.specs import ModelSpec
from ballonet.training.checkpoints import export_folder as output, folder, safe_dcp
from ballonet.training.parallelism.model import NORM_EPS, ROPE_THETA, Transformer

WEIGHTS = "model.safetensors"
CONFIG = "config.json"


def model_meta(spec: ModelSpec, hf_config: dict | None, context: int) -> dict:
    """What a checkpoint records of its model (`ballonet.json`'s "model"), for export:
    the built-in model's shape, or a Hugging Face model's config.json."""
    if hf_config is not None:
        return {"kind": "hf", "config": hf_config}
    fields = ("num_layers", "hidden", "num_heads", "num_kv_heads", "ffn_hidden", "vocab_size")
    return {"kind": "ballonet", "name": spec.name, **{f: getattr(spec, f) for f in fields},
            "max_position_embeddings": context}


def step_folder(path: str) -> str:
    """A `--checkpoint-dir` (its latest checkpoint) or one checkpoint's folder."""
    if not os.path.isdir(path):
        raise InputError(f"--checkpoint {path}: not a folder")
    if os.path.isfile(os.path.join(path, folder.META)):
        return path
    found = folder.latest(path)
    if found is None:
        raise InputError(f"--checkpoint {path}: holds no checkpoint (no {folder.LATEST!r} file and no "
                         f"{folder.META})")
    return found


MAX_DIM = 1 << 24
"""The largest dimension (vocabulary, hidden size, layers, ...) a recorded model may have."""


def _built_in_spec(model: dict, where: str) -> ModelSpec:
    """The built-in model `ballonet.json` records, each field an integer in range."""
    fields = ("num_layers", "hidden", "num_heads", "num_kv_heads", "ffn_hidden", "vocab_size",
              "max_position_embeddings")
    for f in fields:
        value = model.get(f)
        if type(value) is not int or not 1 <= value <= MAX_DIM:
            raise InputError(f"{where}: field 'model.{f}' must be an integer from 1 to {MAX_DIM}, got {value!r}")
    name = model.get("name")
    if not isinstance(name, str) or not name or len(name) > 200:
        raise InputError(f"{where}: field 'model.name' must be a model's name, got {name!r}")
    try:
        return ModelSpec(name=name, **{f: model[f] for f in fields[:-1]})
    except InputError as e:
        raise InputError(f"{where}: field 'model': {e}") from None


def _hf_config(model: dict, where: str):
    """The transformers config of a Hugging Face model `ballonet.json` records (its
    `model_type` one transformers knows: no code from anywhere)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING  # transformers' own types only

    config = model.get("config")
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise InputError(f"{where}: field 'model.config' must be a config.json object with a model_type")
    if config["model_type"] not in CONFIG_MAPPING:
        raise InputError(f"{where}: field 'model.config': model_type {config['model_type']!r} is not one "
                         "transformers ships (no code is loaded from anywhere)")
    rest = {k: v for k, v in config.items() if k not in ("model_type", "auto_map")}
    try:
        return CONFIG_MAPPING[config["model_type"]](**rest)
    except Exception as e:  # noqa: BLE001 - transformers' configs refuse with many exception types
        raise InputError(f"{where}: field 'model.config': transformers cannot build it ({_last_line(e)})") from None


def model_tensors(model: dict, where: str) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """{name: (size, dtype)} of the model `ballonet.json` records, as the checkpoint names
    its tensors ("model." + the parameter's name), from the model built on the meta device
    (nothing allocated)."""
    try:
        with torch.device("meta"):
            if model["kind"] == "ballonet":
                built = Transformer(_built_in_spec(model, where))
            else:
                from transformers import AutoModelForCausalLM

                built = AutoModelForCausalLM.from_config(_hf_config(model, where), trust_remote_code=False)
    except InputError:
        raise
    except Exception as e:  # noqa: BLE001 - an HF model class refusing its config
        raise InputError(f"{where}: field 'model': cannot build the recorded model ({_last_line(e)})") from None
    return {f"model.{name}": (t.shape, t.dtype) for name, t in built.state_dict().items()}


def read_model_state(path: str, model: dict) -> dict[str, torch.Tensor]:
    """The model's full (unsharded) tensors of checkpoint `path`, by parameter name; one
    process, any world size the checkpoint was saved on. Every tensor is checked against
    the model `model` (`ballonet.json`'s record: `model_tensors`) before any is allocated."""
    metadata = safe_dcp.read_safe_metadata(os.path.join(path, safe_dcp.DCP_METADATA), path)  # weights-only
    prefix = "model."
    expected = model_tensors(model, os.path.join(path, folder.META))
    tied = f"{prefix}lm_head.weight"
    if model["kind"] == "hf" and tied not in metadata.state_dict_metadata:
        expected.pop(tied, None)  # a tied head, not stored (the embedding's)
    safe_dcp.check_tensors(metadata, expected, path, scope=(prefix,))
    state = {name[len(prefix):]: torch.empty(size, dtype=dtype) for name, (size, dtype) in expected.items()}
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
            warnings.filterwarnings("ignore", message="Detected pickle protocol")  # the refusal says it
            dcp.load({"model": state}, storage_reader=safe_dcp.SafeReader(path),
                     planner=safe_dcp.SafeLoadPlanner(), no_dist=True)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP's own is not an Exception
        raise InputError(f"{path}: corrupt or foreign checkpoint ({safe_dcp.last_line(e)})") from None
    return state


def _last_line(e: BaseException) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return (lines[-1] if lines else type(e).__name__)[:300]


_LLAMA_NAMES = {"attention_norm": "input_layernorm", "wq": "self_attn.q_proj", "wk": "self_attn.k_proj",
                "wv": "self_attn.v_proj", "wo": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
                "w1": "mlp.gate_proj", "w3": "mlp.up_proj", "w2": "mlp.down_proj"}
"""A block's modules in `model.py` -> in transformers' `LlamaDecoderLayer`."""


def llama_name(name: str) -> str:
    """A built-in model's parameter name as `LlamaForCausalLM` names it."""
    top = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
           "head.weight": "lm_head.weight"}
    if name in top:
        return top[name]
    parts = name.split(".")  # layers.<i>.<module>.weight
    if len(parts) != 4 or parts[0] != "layers" or parts[2] not in _LLAMA_NAMES:
        raise InputError(f"parameter {name!r} is not one of the built-in model's")
    return f"model.layers.{parts[1]}.{_LLAMA_NAMES[parts[2]]}.{parts[3]}"


def llama_config(model: dict) -> dict:
    """config.json of the `LlamaForCausalLM` the built-in model `model` (`model_meta`) is."""
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=model["vocab_size"], hidden_size=model["hidden"],
                         intermediate_size=model["ffn_hidden"], num_hidden_layers=model["num_layers"],
                         num_attention_heads=model["num_heads"], num_key_value_heads=model["num_kv_heads"],
                         head_dim=model["hidden"] // model["num_heads"], hidden_act="silu", rms_norm_eps=NORM_EPS,
                         rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
                         max_position_embeddings=model["max_position_embeddings"], tie_word_embeddings=False,
                         attention_bias=False, mlp_bias=False, bos_token_id=None, eos_token_id=None,
                         architectures=["LlamaForCausalLM"], dtype="float32")
    return config.to_dict()


def export(checkpoint_path: str, out: str, *, overwrite: bool = False, tokenizer: str | None = None) -> dict:
    """Write `out/config.json`, `out/model.safetensors`, `out/generation_config.json` and
    the tokenizer's files (`tokenizer`, or those of the corpus the run trained on:
    `tokenizer_files`) from the checkpoint at `checkpoint_path` (`step_folder`), all at
    once (`output.replace_folder`); returns a summary (step, kind, parameters, files)."""
    try:
        from safetensors.torch import save_file
        import transformers  # noqa: F401 - the config's class
    except ImportError:
        raise InputError("ballonet export needs transformers and safetensors: pip install 'ballonet[hf]'") from None
    output.check_out(out, overwrite)
    path = step_folder(checkpoint_path)
    meta = folder.read_meta(path)
    model = meta.get("model")
    if not isinstance(model, dict) or model.get("kind") not in ("ballonet", "hf"):
        raise InputError(f"{os.path.join(path, folder.META)}: records no model (a checkpoint written before "
                         "export existed); train on from it with --resume to write one that does")
    sources = output.tokenizer_files(tokenizer, path)
    state = read_model_state(path, model)
    if model["kind"] == "ballonet":
        config, tensors = llama_config(model), {llama_name(n): t for n, t in state.items()}
    else:
        config, tensors = dict(model["config"]), dict(state)
        config.pop("auto_map", None)  # never code from anywhere
        if config.get("tie_word_embeddings") and "lm_head.weight" in tensors:
            del tensors["lm_head.weight"]  # the embedding's, tied again on loading
    contiguous = {name: t.contiguous() for name, t in sorted(tensors.items())}

    def write(folder: str) -> None:
        save_file(contiguous, os.path.join(folder, WEIGHTS), metadata={"format": "pt"})
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(os.path.join(folder, WEIGHTS), 0o666 & ~umask)  # safetensors creates its file private
        output.write_json(os.path.join(folder, CONFIG), config)
        output.write_json(os.path.join(folder, output.GENERATION), output.generation_config(config))
        output.copy_tokenizer(sources, folder, config)

    written = output.replace_folder(out, write, {"checkpoint": os.path.abspath(path), "step": meta.get("step")})
    return {"checkpoint": path, "step": meta.get("step"), "kind": model["kind"], "out": out,
            "num_parameters": sum(t.numel() for t in tensors.values()), "files": written}
