"""Big models: a rank builds the model on the meta device, splits it and materialises only
its own shards (`training.parallelism.build.build_sharded_model`).

* The weights are today's, seed for seed: the built-in model's every parameter equals the
  whole-model init (drawn again here as it was written before meta-device init: one
  generator, parameter order, N(0, 0.02) or ones), under FSDP2, HSDP-style replication and
  FSDP2 + tensor parallelism; a Hugging Face folder's weights, read per shard from
  safetensors (one file, an index of several, tied embeddings), equal transformers' own
  `from_pretrained`.
* A rank's peak memory while setting up is near its shard, not the whole model: on 4 gloo
  ranks a model of 400 MB (fp32) raises a rank's peak resident set (VmHWM, reset first)
  by less than half of it, where a quarter is the shard; building the model whole, in the
  same process, raises it by nearly all of it (the measurement sees what it should).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from distributed import run_ranks

import ballonet
from ballonet.training.parallelism import parallel
from ballonet.training.parallelism.build import build_sharded_model
from ballonet.training.config import TrainConfig
from ballonet.training.parallelism.model import Transformer

SEED = 7
CPU = torch.device("cpu")


def _todays_init(spec, seed: int) -> dict[str, torch.Tensor]:
    """The whole-model init as it was before meta-device init, written out again here."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(n, p.shape) for n, p in Transformer(spec, seed=seed).named_parameters()]
    return {n: torch.ones(s) if len(s) == 1 else torch.empty(s).normal_(0.0, 0.02, generator=gen) for n, s in shapes}


def _full(model) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters(remove_duplicate=False)}  # a tied weight under both names


def _hf_folders(tmp_path) -> dict[str, str]:
    from transformers import LlamaConfig, LlamaForCausalLM

    kw = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=176, vocab_size=256,
              num_hidden_layers=2)
    folders = {}
    for name, tie, shard_size in (("one file", False, "50GB"), ("an index", False, "40KB"), ("tied", True, "50GB")):
        torch.manual_seed(len(folders))
        folder = tmp_path / name.replace(" ", "_")
        LlamaForCausalLM(LlamaConfig(tie_word_embeddings=tie, **kw)).save_pretrained(folder, max_shard_size=shard_size)
        folders[name] = str(folder)
    assert (tmp_path / "an_index" / "model.safetensors.index.json").is_file()
    return folders


def _built(rank: int, world_size: int, folders: dict[str, str]) -> dict:
    from transformers import AutoModelForCausalLM

    out = {}
    for tp, shard in ((1, "full"), (1, "none"), (2, "full")):
        config = TrainConfig(model="tiny", seed=SEED, tp=tp, shard=shard)
        mesh = parallel.device_mesh(world_size, shard, CPU, tp)
        model = build_sharded_model(config, ballonet.model("tiny"), mesh, CPU)
        out[f"tiny tp={tp} shard={shard}"] = _differences(_full(model), _todays_init(ballonet.model("tiny"), SEED))
    for name, folder in folders.items():
        for tp in (1, 2):
            config = TrainConfig(model=f"hf:{folder}", seed=SEED, tp=tp)
            mesh = parallel.device_mesh(world_size, "full", CPU, tp)
            model = build_sharded_model(config, None, mesh, CPU)
            whole = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
            got = _full(model)
            if name == "tied" and tp == 1:  # tensor parallelism splits the two apart (as it did built whole)
                assert model.lm_head.weight is model.model.embed_tokens.weight, "the tie was lost"
            out[f"hf {name} tp={tp}"] = _differences(got, {n: p.detach() for n, p in whole.named_parameters(remove_duplicate=False)})
    return out


def _differences(got: dict, want: dict) -> list[str]:
    """The parameters missing, extra or not equal (compared in the rank: tensors do not
    travel back from a rank that has exited)."""
    assert want, "nothing to compare"
    return sorted(got.keys() ^ want.keys()) + [n for n in want if n in got and not torch.equal(got[n], want[n])]


@pytest.mark.slow
def test_sharded_init_gives_the_whole_models_weights(tmp_path):
    for rank, results in enumerate(run_ranks(2, _built, _hf_folders(tmp_path))):
        assert len(results) == 9 and all(differences == [] for differences in results.values()), (
            rank, {case: d for case, d in results.items() if d})


# ---- memory while setting up --------------------------------------------------------------

BIG = dataclasses.replace(ballonet.model("tiny"), name="big", num_layers=24, hidden=512, num_heads=8, num_kv_heads=8,
                          ffn_hidden=2048, vocab_size=2048)
"""About 100M parameters (400 MB fp32), the largest 4 MB: 24 layers of 4.2M."""


def _peak_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # "5": the peak resident set starts again from now
        f.write("5")


def _setup_peaks(rank: int, world_size: int) -> dict:
    config = TrainConfig(model="tiny", seed=SEED)
    mesh = parallel.device_mesh(world_size, "full", CPU)
    torch.ones(1) @ torch.ones(1)  # the allocator and the first op's one-time costs, before the baseline
    _reset_peak()
    base = _peak_kib()
    model = build_sharded_model(config, BIG, mesh, CPU)
    sharded = _peak_kib() - base
    local = parallel.local_parameter_bytes(model)
    _reset_peak()
    base = _peak_kib()
    whole = Transformer(BIG, seed=SEED)  # the whole model, as every rank built it before
    built_whole = _peak_kib() - base
    return {"sharded_kib": sharded, "whole_kib": built_whole, "local_bytes": local,
            "model_bytes": sum(p.numel() * 4 for p in whole.parameters())}


@pytest.mark.slow
def test_a_ranks_peak_memory_while_setting_up_is_near_its_shard():
    for rank, r in enumerate(run_ranks(4, _setup_peaks)):
        model_kib = r["model_bytes"] / 1024
        assert 0.24 < r["local_bytes"] / r["model_bytes"] < 0.26, (rank, r)  # the shard: a quarter
        assert r["sharded_kib"] < 0.5 * model_kib, (rank, r)  # its shard and one whole parameter, not the model
        assert r["whole_kib"] > 0.9 * model_kib, (rank, r)  # the whole model is seen when it is built


def test_fewest_gpus_is_the_fewest_count_whose_share_fits():
    from ballonet.cost import hardware
    from ballonet.training.parallelism.parallel import fewest_gpus, rank_bytes

    h100 = hardware.gpu("h100").memory_bytes
    for name in ("llama-7b", "llama-30b"):
        m = dataclasses.replace(ballonet.model(name), dtype_bytes=2, recompute="full")
        n = fewest_gpus(m, h100, 8192)
        assert n is not None and rank_bytes(m, n, 8192) <= 0.9 * h100 < rank_bytes(m, n - 1, 8192), (name, n)
        # Only the fp32 weights, gradients and Adam's moments are sharded: 16 bytes a parameter.
        assert rank_bytes(m, 2, 8192) - rank_bytes(m, 4, 8192) == pytest.approx(m.num_params * 16 / 4)
    llama3 = dataclasses.replace(ballonet.model("llama3-8b"), dtype_bytes=2, recompute="full")
    assert fewest_gpus(llama3, h100, 1_000_000) is None  # the logits of a million tokens fit no count


def test_weights_that_do_not_match_the_model_are_one_line(tmp_path):
    import json

    from safetensors.torch import load_file, save_file

    from ballonet.errors import InputError
    from ballonet.integrations import hf_model

    folder = _hf_folders(tmp_path)["one file"]
    tensors = load_file(f"{folder}/model.safetensors")
    cases = {"no tensor 'lm_head.weight'": {k: v for k, v in tensors.items() if k != "lm_head.weight"},
             "has shape (256, 32), the model's (256, 64)": {**tensors, "lm_head.weight": tensors["lm_head.weight"][:, :32]}}
    for message, stored in cases.items():
        save_file({k: v.contiguous() for k, v in stored.items()}, f"{folder}/model.safetensors")
        model = hf_model.build_model(f"hf:{folder}", SEED, torch.device("meta")).to_empty(device=CPU)
        with pytest.raises(InputError, match=message.replace("(", r"\(").replace(")", r"\)")) as e:
            hf_model.load_shards(model, f"hf:{folder}")
        assert "\n" not in str(e.value)
    (tmp_path / "one_file" / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00garbage!")
    with pytest.raises(InputError, match="cannot read its weights"):
        hf_model.load_shards(model, f"hf:{folder}")
    (tmp_path / "one_file" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "../x"}}))
    with pytest.raises(InputError, match="field 'weight_map'"):
        hf_model.load_shards(model, f"hf:{folder}")
