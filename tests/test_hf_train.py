"""`ballonet train --model hf:DIR` on a prepared corpus: an unmodified Hugging Face Llama,
trained with the remap on 4 gloo ranks (two emulated nodes: rings, remap and routing
across them) and, by the recomputation test, on 2, against the same run in one process.

Reference: `train` in this process (one rank: no remap, no ring, no gradient exchange).
Losses of 3 steps (each after the optimizer steps before it) and the parameters after them
must agree within 1e-4 relative. With activation recomputation, 2 ranks must agree with
their run without recomputation and with one process within 1e-5, and rerun what they
recompute (counted). The corpus is tokenized at test time with a small BPE (`text_sources.train_tokenizer`).
"""

import dataclasses
import json
from unittest import mock

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

import torch
from transformers import LlamaConfig

from ballonet.cli import main
from ballonet.errors import InputError
from ballonet.integrations import hf_model
from ballonet.training import loop
from ballonet.training.config import TrainConfig
from ballonet.training.data.prepare import PrepareConfig, prepare
from tests.distributed import run_ranks
from tests.text_sources import train_tokenizer, write_sources

RTOL = 1e-4
RECOMPUTE_RTOL = 1e-5
PLANNERS = ("zeppelin", "te_cp", "packed_dp")
STEPS = 3


NUM_LAYERS = 2


def llama_folder(path, vocab_size: int, weights: bool = False):
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=176,
                         vocab_size=vocab_size, num_hidden_layers=NUM_LAYERS, tie_word_embeddings=False)
    path.mkdir()
    if weights:
        from transformers import LlamaForCausalLM

        torch.manual_seed(7)
        LlamaForCausalLM(config).save_pretrained(path)
    else:
        config.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """(model folder, prepared corpus folder)."""
    tmp = tmp_path_factory.mktemp("hf_train")
    tokenizer = train_tokenizer(tmp)
    source = write_sources(tmp)["jsonl"]
    prepare(PrepareConfig(data=str(source), out=str(tmp / "corpus"), tokenizer=str(tokenizer), text_column="body"))
    return llama_folder(tmp / "llama", vocab_size=640, weights=True), tmp / "corpus"


def config(model, corpus, planner: str) -> TrainConfig:
    return TrainConfig(model=f"hf:{model}", corpus=str(corpus), planner=planner, steps=STEPS, global_tokens=1536,
                       max_doc_tokens=1024, lr=1e-3, log_every=100)


def _parameters(model) -> dict:
    """Full parameters as numpy (tensors would cross processes as shared memory that dies
    with the rank)."""
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu().numpy().copy()
            for n, p in model.named_parameters()}


def _run(config: TrainConfig) -> tuple[list[float], dict]:
    """Losses, and the full parameters."""
    records, model = loop.train_model(config)
    return [r["loss"] for r in records], _parameters(model)


def _train_ranks(rank: int, world_size: int, configs: list[TrainConfig]) -> list:
    return [_run(c) for c in configs]


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [4])  # 2 ranks: `test_hf_recompute_trains_like_no_recompute`
def test_hf_model_trains_like_one_process(job, world_size):
    model, corpus = job
    configs = [config(model, corpus, p) for p in PLANNERS]
    distributed = run_ranks(world_size, _train_ranks, configs, timeout=900)[0]
    for planner, cfg, (losses, params) in zip(PLANNERS, configs, distributed):
        ref_losses, ref_params = _run(cfg)
        assert len(losses) == len(ref_losses) == STEPS
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
        assert worst <= RTOL, f"{planner} on {world_size} ranks: losses {losses} vs one process {ref_losses}"
        assert ref_losses[-1] < ref_losses[0], f"{planner}: the model did not learn: {ref_losses}"
        for name, ref in ref_params.items():
            error = float(np.linalg.norm(params[name] - ref) / np.linalg.norm(ref))
            assert error <= RTOL, f"{planner} on {world_size} ranks: {name} off by {error:.2e} relative"


def _relative_error(a: dict, b: dict) -> tuple[float, str]:
    """The largest relative difference between two parameter dicts, and its name."""
    return max((float(np.linalg.norm(a[n] - b[n]) / np.linalg.norm(b[n])), n) for n in b)


def _counted_runs(rank: int, world_size: int, configs: list[TrainConfig]) -> list:
    """Per config, every step planned as without recomputation: (losses, parameters, bytes
    sent per step, calls) where calls counts the
    forward calls of every layer's attention (its q projection) and MLP (its down
    projection), by pre-hooks: the recomputation stops right after its last saved tensor,
    before a forward hook of the module computing it would run."""
    out = []

    def as_without_recompute(*args, model, _plan=loop._plan, **kwargs):
        # Every mode's steps laid out as without recomputation (the planner prices a mode's
        # recomputation and may shift a ring's shares by a token), so their bytes compare.
        return _plan(*args, model=dataclasses.replace(model, recompute="none", recompute_layers=None), **kwargs)

    for cfg in configs:
        calls = {"attention": 0, "mlp": 0}
        with mock.patch.object(hf_model, "build_model", _counting(hf_model.build_model, calls)), \
                mock.patch.object(loop, "_plan", as_without_recompute):
            records, model = loop.train_model(cfg)
        out.append(([r["loss"] for r in records], _parameters(model), [r["bytes_sent"] for r in records], calls))
    return out


def _counting(build, calls: dict):
    """`build` whose model counts into `calls` (see `_counted_runs`)."""
    def count(name):
        return lambda *_: calls.update({name: calls[name] + 1})

    def counted(*args, **kwargs):
        model = build(*args, **kwargs)
        for layer in model.model.layers:
            layer.self_attn.q_proj.register_forward_pre_hook(count("attention"))
            layer.mlp.down_proj.register_forward_pre_hook(count("mlp"))
        return model

    return counted


@pytest.mark.slow
def test_hf_recompute_trains_like_no_recompute(job):
    """--recompute selective and full on 2 ranks (zeppelin: remap and rings) against the
    same run without recomputation and a one-process run: the recomputation runs in the
    backward (selective reruns every MLP, full every layer, its remaps and rings too)."""
    model, corpus = job
    modes = ("none", "selective", "full")
    configs = [dataclasses.replace(config(model, corpus, "zeppelin"), recompute=m) for m in modes]
    runs = dict(zip(modes, run_ranks(2, _counted_runs, configs, timeout=900)[0]))
    ref_losses, ref_params = _run(configs[0])
    losses, params, sent, calls = runs["none"]
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)) <= RECOMPUTE_RTOL, (losses, ref_losses)
    assert _relative_error(params, ref_params)[0] <= RECOMPUTE_RTOL, _relative_error(params, ref_params)
    assert min(sent) > 0, f"the plans move nothing: {sent}"
    once = STEPS * NUM_LAYERS
    assert calls == {"attention": once, "mlp": once}, calls
    reruns = {"selective": {"attention": once, "mlp": 2 * once}, "full": {"attention": 2 * once, "mlp": 2 * once}}
    for mode, expected in reruns.items():
        mode_losses, mode_params, _, mode_calls = runs[mode]
        assert mode_calls == expected, f"--recompute {mode}: calls {mode_calls}, expected {expected}"
        worst = max(abs(a - b) / abs(b) for a, b in zip(mode_losses, losses))
        assert worst <= RECOMPUTE_RTOL, f"--recompute {mode}: losses {mode_losses} vs {losses}"
        error, name = _relative_error(mode_params, params)
        assert error <= RECOMPUTE_RTOL, f"--recompute {mode}: {name} off by {error:.2e} relative"
        worst = max(abs(a - b) / abs(b) for a, b in zip(mode_losses, ref_losses))
        assert worst <= RECOMPUTE_RTOL, f"--recompute {mode}: losses {mode_losses} vs one process {ref_losses}"
        assert _relative_error(mode_params, ref_params)[0] <= RECOMPUTE_RTOL, mode
    # Full recomputation reruns the remaps and rings of the forward: more bytes, selective none.
    assert runs["selective"][2] == sent, (runs["selective"][2], sent)
    assert all(f > n for f, n in zip(runs["full"][2], sent)), (runs["full"][2], sent)


def run_train(capsys, *argv) -> tuple[int, str]:
    code = main(["train", *map(str, argv), "--steps", "1", "--global-tokens", "256"])
    return code, capsys.readouterr().err.strip()


def test_hf_bad_input_is_one_line_exit_2(job, tmp_path, capsys):
    _, corpus = job
    (tmp_path / "empty").mkdir()
    small = llama_folder(tmp_path / "small", vocab_size=300)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    cases = [(tmp_path / "empty", "empty: no config.json"), (tmp_path / "missing", "is not a folder"),
             (broken, "broken/config.json: not a JSON model config"),
             (small, "small/config.json' a vocabulary of 300")]
    for folder, message in cases:
        code, err = run_train(capsys, "--model", f"hf:{folder}", "--corpus", corpus)
        assert code == 2 and message in err and "\n" not in err, (folder, err)
    pickled = llama_folder(tmp_path / "pickled", vocab_size=600)
    (pickled / "pytorch_model.bin").write_bytes(b"not read: unpickling a file from elsewhere can run code")
    code, err = run_train(capsys, "--model", f"hf:{pickled}", "--corpus", corpus)
    assert code == 2 and "pickled/pytorch_model.bin: pickled weights are not loaded" in err and "\n" not in err, err
    model, _ = job
    for mode in ("linear", "auto"):
        code, err = run_train(capsys, "--model", f"hf:{model}", "--corpus", corpus, "--recompute", mode)
        assert code == 2 and f"--recompute {mode}: not for a Hugging Face model" in err and "\n" not in err, err
    manifest = json.loads((corpus / "manifest.json").read_text())
    assert manifest["vocab_size"] == 600  # the corpus's tokenizer is the larger one
    model = hf_model.build_model(f"hf:{small}", 0, torch.device("cpu"))
    for layer in model.model.layers:
        del layer.mlp  # a family whose MLP has another name
    with pytest.raises(InputError, match="^--recompute selective: LlamaDecoderLayer has no `mlp`"):
        hf_model.enable_recompute(model, "selective")


def test_hf_selective_recompute_of_the_first_layers(job):
    """`--recompute-layers 1` of 2: the first layer's MLP alone is checkpointed, and reruns
    once per step in a one-process run."""
    model, corpus = job
    built = hf_model.build_model(f"hf:{model}", 0, torch.device("cpu"))
    layers = built.model.layers
    assert hf_model.recomputed_modules(built, "selective", layers=1) == [layers[0].mlp]
    assert hf_model.recomputed_modules(built, "selective") == [layer.mlp for layer in layers]
    cfg = dataclasses.replace(config(model, corpus, "zeppelin"), steps=1, recompute="selective", recompute_layers=1)
    calls = _counted_runs(0, 1, [cfg])[0][3]
    assert calls == {"attention": NUM_LAYERS, "mlp": NUM_LAYERS + 1}, calls


def test_hf_model_without_weights_trains_from_the_cli(job, tmp_path, capsys):
    _, corpus = job
    folder = llama_folder(tmp_path / "fresh", vocab_size=640)
    code = main(["train", "--model", f"hf:{folder}", "--corpus", str(corpus), "--steps", "2",
                 "--global-tokens", "512"])
    assert code == 0, capsys.readouterr().err
    assert capsys.readouterr().out.count("loss ") == 2
