"""`ballonet export`: a trained checkpoint loads in `transformers` with `from_pretrained`.

The built-in model becomes a `LlamaForCausalLM` whose logits equal the built-in model's
within 1e-4 in fp32, per document of a packed batch (the built-in model restarts
attention and positions at each document; Hugging Face runs each as its own sequence).
A Hugging Face model comes back as itself with the trained weights. Nothing is unpickled
on the way but with torch's weights-only loader and DCP's metadata classes: other
`torch.load` and `pickle` calls are made to fail during the export.
"""

import json
import os
import pickle
from unittest import mock

import pytest

pytest.importorskip("transformers")

import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM

import ballonet
from ballonet.cli import main
from ballonet.plan import Plan, Segment
from ballonet.training.config import TrainConfig
from ballonet.training.loop import train_model
from ballonet.training.parallelism.model import Transformer

BASE = dict(corpus="stdlib", global_tokens=1024, max_doc_tokens=512, lr=1e-2, steps=2, seed=5)


def _local_parameters(model) -> dict:
    """A one-rank FSDP2 model's parameters (each DTensor's local shard is all of it)."""
    return {n: (p.to_local() if hasattr(p, "to_local") else p).detach().clone() for n, p in model.named_parameters()}


def _export_without_pickle(*argv):
    """`ballonet export`, failing on any unpickling but torch's weights-only loads (DCP
    reads each tensor's bytes so) and the checkpoint module's metadata unpickler (DCP's
    own metadata classes only)."""
    torch_load = torch.load

    def weights_only_load(*args, **kwargs):
        assert kwargs.get("weights_only") is True, "export called torch.load without weights_only=True"
        return torch_load(*args, **kwargs)

    refuse = mock.Mock(side_effect=AssertionError("export unpickled something"))
    with mock.patch.object(torch, "load", weights_only_load), mock.patch.object(pickle, "load", refuse), \
            mock.patch.object(pickle, "loads", refuse):
        return main(["export", *argv])


def test_the_built_in_model_exports_as_llama_with_equal_logits(tmp_path, capsys):
    spec_file = tmp_path / "gqa.toml"  # 3 layers, 4 query heads over 2 KV heads, a wider vocabulary
    spec_file.write_text('base = "tiny"\nnum_layers = 3\nvocab_size = 300\n')
    ckpt = tmp_path / "ckpt"
    _, trained = train_model(TrainConfig(**BASE, model=str(spec_file), checkpoint_dir=str(ckpt)))
    capsys.readouterr()
    assert sorted(os.listdir(ckpt)) == ["config.toml", "latest", "step-00000002"]  # the final step, saved
    assert _export_without_pickle("--checkpoint", str(ckpt), "--out", str(tmp_path / "hf"), "--json") == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["step"], summary["kind"]) == (2, "ballonet")

    reference = Transformer(ballonet.model(str(spec_file)), seed=0)
    reference.load_state_dict(_local_parameters(trained))
    llama = LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert llama.config.vocab_size == 300 and llama.config.num_hidden_layers == 3
    lengths = (37, 200, 91)
    ids = torch.randint(0, 300, (sum(lengths),), generator=torch.Generator().manual_seed(0))
    plan = Plan(planner="ref", lengths=lengths, node_of_rank=(0,), nic_of_rank=(0,),
                attention=(tuple(Segment(d, 0, n) for d, n in enumerate(lengths)),))
    with torch.no_grad():
        ours = reference(ids, plan, 0)
        theirs = torch.cat([llama(doc[None]).logits[0] for doc in ids.split(lengths)])
    assert ours.abs().max() > 0.1  # trained logits, not zeros
    assert (ours - theirs).abs().max() <= 1e-4, (ours - theirs).abs().max()


def test_a_hugging_face_model_exports_as_itself_with_its_trained_weights(tmp_path):
    from transformers import LlamaConfig

    folder = tmp_path / "llama"  # a config alone: random weights from the seed, as `ballonet train` makes them
    LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=176, vocab_size=256,
                num_hidden_layers=2, tie_word_embeddings=False).save_pretrained(folder)
    ckpt = tmp_path / "ckpt"
    _, trained = train_model(TrainConfig(**BASE, model=f"hf:{folder}", checkpoint_dir=str(ckpt),
                                         checkpoint_every=1, keep_checkpoints=2))
    step1 = ckpt / "step-00000001"
    assert _export_without_pickle("--checkpoint", str(ckpt / "step-00000002"), "--out", str(tmp_path / "hf")) == 0
    assert _export_without_pickle("--checkpoint", str(step1), "--out", str(tmp_path / "hf1")) == 0
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    assert type(exported).__name__ == "LlamaForCausalLM"
    weights = _local_parameters(trained)
    for name, p in exported.named_parameters():
        assert torch.equal(p, weights[name]), name
    first = AutoModelForCausalLM.from_pretrained(tmp_path / "hf1", dtype=torch.float32)
    assert not torch.equal(first.lm_head.weight, exported.lm_head.weight)  # step 1's weights, not step 2's


def test_export_refuses_bad_checkpoints_in_one_line(tmp_path, capsys):
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    ckpt = tmp_path / "ckpt"
    train_model(TrainConfig(**dict(BASE, steps=1), checkpoint_dir=str(ckpt)))
    (ckpt / "step-00000001" / ".metadata").write_bytes(pickle.dumps(Payload()))
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [(["--checkpoint", str(ckpt)], "not a checkpoint's metadata that is safe to load"),
             (["--checkpoint", str(empty)], "holds no checkpoint"),
             (["--checkpoint", str(tmp_path / "nothing")], "not a folder")]
    for args, message in cases:
        assert main(["export", *args, "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and any(m in err for m in message.split("|")), err
    assert not marker.exists() and not (tmp_path / "out" / "model.safetensors").exists()


def test_export_writes_a_whole_folder_with_its_tokenizer_and_never_over_foreign_files(tmp_path, capsys):
    """Issues 47.4 and 50.6, one trained run: the exported folder holds the corpus's
    tokenizer (AutoTokenizer loads it and encodes as the corpus's tokenizer does) and a
    generation config; a folder of other files is refused unless --overwrite, which
    replaces its stale weights and keeps the rest; a symlinked --out is refused; a full
    disk (simulated: the weights' writer raises ENOSPC) leaves --out as it was."""
    import errno

    pytest.importorskip("tokenizers")
    from transformers import AutoTokenizer, GenerationConfig

    from ballonet.training.data.prepare import PrepareConfig, prepare
    from tests.text_sources import train_tokenizer, write_sources

    (tmp_path / "tok").mkdir()
    tok_dir = train_tokenizer(tmp_path / "tok", vocab_size=300)
    corpus = tmp_path / "corpus"
    prepare(PrepareConfig(data=str(write_sources(tmp_path)["jsonl"]), out=str(corpus), tokenizer=str(tok_dir),
                          text_column="body"))
    ckpt = tmp_path / "ckpt"
    train_model(TrainConfig(**dict(BASE, steps=1, corpus=str(corpus)), vocab_size=300, checkpoint_dir=str(ckpt)))
    capsys.readouterr()

    out = tmp_path / "hf"
    assert main(["export", "--checkpoint", str(ckpt), "--out", str(out)]) == 0
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json", "ballonet-export.json"} == set(os.listdir(out))
    text = "def main():\n    return 0\n"
    loaded = AutoTokenizer.from_pretrained(out)
    import tokenizers

    assert loaded(text)["input_ids"] == tokenizers.Tokenizer.from_file(str(tok_dir / "tokenizer.json")).encode(
        text).ids
    GenerationConfig.from_pretrained(out)
    assert main(["export", "--checkpoint", str(ckpt), "--out", str(out)]) == 0  # an earlier export: replaced
    assert main(["export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "given"), "--tokenizer",
                 str(tok_dir / "tokenizer.json")]) == 0  # --tokenizer: the file given
    assert (tmp_path / "given" / "tokenizer.json").read_bytes() == (tok_dir / "tokenizer.json").read_bytes()
    os.mkfifo(tmp_path / "fifo")
    assert main(["export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "never"), "--tokenizer",
                 str(tmp_path / "fifo")]) == 2  # not a regular file: one line, at once, nothing written
    assert "named pipe" in capsys.readouterr().err and not (tmp_path / "never").exists()

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "README.md").write_text("mine")
    (foreign / "pytorch_model.bin").write_bytes(b"stale")
    assert main(["export", "--checkpoint", str(ckpt), "--out", str(foreign)]) == 2
    assert "holds files that no export wrote" in capsys.readouterr().err
    assert sorted(os.listdir(foreign)) == ["README.md", "pytorch_model.bin"]
    link = tmp_path / "link"
    link.symlink_to(foreign)
    assert main(["export", "--checkpoint", str(ckpt), "--out", str(link), "--overwrite"]) == 2
    assert "is a symlink" in capsys.readouterr().err

    from safetensors import torch as safetensors_torch

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    with mock.patch.object(safetensors_torch, "save_file", full_disk):
        assert main(["export", "--checkpoint", str(ckpt), "--out", str(foreign), "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "No space left on device" in err
    assert sorted(os.listdir(foreign)) == ["README.md", "pytorch_model.bin"]  # as it was
    assert not [n for n in os.listdir(tmp_path) if ".export-" in n]  # no temporary folder left

    assert main(["export", "--checkpoint", str(ckpt), "--out", str(foreign), "--overwrite"]) == 0
    names = set(os.listdir(foreign))
    assert "README.md" in names and "pytorch_model.bin" not in names and "model.safetensors" in names
    assert (foreign / "README.md").read_text() == "mine"
    AutoModelForCausalLM.from_pretrained(foreign)


def test_a_recorded_config_builds_only_a_model_type_transformers_ships():
    from ballonet.errors import InputError
    from ballonet.training.checkpoints import export

    config = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "auto_map": {"AutoConfig": "evil.Config"}}
    built = export._hf_config({"config": config}, "ck/ballonet.json")
    assert type(built).__name__ == "LlamaConfig" and built.hidden_size == 64 and not hasattr(built, "auto_map")
    with pytest.raises(InputError, match="model_type 'pwned-model' is not one transformers ships"):
        export._hf_config({"config": {**config, "model_type": "pwned-model"}}, "ck/ballonet.json")


def test_an_export_into_a_folder_that_does_not_exist_is_refused_before_any_work(tmp_path):
    """As every other output: a mistyped --out makes no tree of folders (it made every missing parent)."""
    from ballonet.errors import InputError
    from ballonet.training.checkpoints.export_folder import check_out

    with pytest.raises(InputError, match="does not exist"):
        check_out(str(tmp_path / "no" / "such" / "out"), overwrite=False)
    assert not (tmp_path / "no").exists()
    check_out(str(tmp_path / "out"), overwrite=False)
