"""Hostile files the other security tests do not reach (issue: hostile-input audit): figures
in a cluster or model file that overflow the cost model, a lease that cannot be read, a
crafted RNG state, chunk lists and stored items of a checkpoint built to hang or allocate,
a model folder's config that transformers refuses in its own words, a shard that shrinks
while memory-mapped, a link swapped in between a check and an open. Each is one line
naming the file (an `InputError`), promptly, and nothing is allocated or run."""

from __future__ import annotations

import math
import re

import pytest

from ballonet import specs
from ballonet.errors import InputError

GROUP = '[[node_groups]]\ngpu = "h200"\nnum_nodes = 2\n'


def _refused(read, match: str) -> str:
    """The one-line InputError `read()` raises, which says `match` (a plain string)."""
    with pytest.raises(InputError, match=re.escape(match)) as e:
        read()
    assert "\n" not in str(e.value)
    return str(e.value)


# ---- cluster and model files -------------------------------------------------------------


@pytest.mark.parametrize("line", ["nic_gbps = 5e-324", "intra_link_bw = 5e-324", "memory_gb = 1e308",
                                  "nic_gbps = 1e308", "intra_link_bw = 1e308", "memory_gb = 1e-300"])
def test_a_cluster_file_s_figures_lie_in_what_a_step_can_be_priced_with(tmp_path, line):
    """memory_gb = 1e308 overflowed the plan's memory check (OverflowError); a bandwidth of
    5e-324 priced every step at Infinity (simulate printed inf and nan)."""
    path = tmp_path / "c.toml"
    path.write_text(GROUP + line + "\n")
    message = _refused(lambda: specs.cluster_from_toml(str(path)), "must lie in")
    assert str(path) in message and line.split()[0] in message


@pytest.mark.parametrize("text", ["base = [1]\n", "[base]\nx = 1\n", 'base = "tiny"\nname = 5\n'])
def test_a_model_file_s_base_and_name_are_strings(tmp_path, text):
    """base = [1] was a TypeError (unhashable) traceback; name = 5 named the model 5."""
    path = tmp_path / "m.toml"
    path.write_text(text)
    assert "must be a string" in _refused(lambda: specs.model_from_toml(str(path)), str(path))


def test_a_config_file_gives_each_setting_once(tmp_path):
    """`global-tokens` and `global_tokens` in one file: the later one won, silently."""
    from ballonet.training.config import TrainConfig
    from ballonet.training.config_file import read_config_file

    path = tmp_path / "run.toml"
    path.write_text("global-tokens = 256\nglobal_tokens = 512\n")
    assert "given twice" in _refused(lambda: read_config_file(str(path), TrainConfig), str(path))


# ---- the lease ---------------------------------------------------------------------------


def test_a_lease_that_cannot_be_read_or_says_more_is_one_line(tmp_path):
    """A regular file whose read fails (/proc/self/mem: EIO) was an OSError traceback on
    every rank; a lease of `lent` followed by more than 64 bytes read as `lent`."""
    from ballonet.training.jobs.lease import read_lease

    _refused(lambda: read_lease("/proc/self/mem"), "--lease /proc/self/mem: cannot read it")
    path = tmp_path / "lease"
    path.write_text("lent" + " " * 60 + "reclaimed")
    _refused(lambda: read_lease(str(path)), "over 64 bytes")
    path.write_text("lent" + " " * 60)  # 64 bytes: still a lease
    assert read_lease(str(path)) == "lent"


# ---- checkpoints -------------------------------------------------------------------------


def _chunked(size: tuple[int, ...], boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]):
    """DCP metadata of one float32 tensor `x` of `size` in the chunks `boxes` (offsets,
    sizes), each chunk's bytes stored (at one place: only the lengths are checked)."""
    import torch
    from torch.distributed.checkpoint import metadata as dcp_metadata
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    chunks = [dcp_metadata.ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(n)) for o, n in boxes]
    item = dcp_metadata.TensorStorageMetadata(properties=dcp_metadata.TensorProperties(dtype=torch.float32),
                                              size=torch.Size(size), chunks=chunks)
    storage = {dcp_metadata.MetadataIndex("x", torch.Size(o)): _StorageInfo("data.distcp", 0, 4 * math.prod(n))
               for o, n in boxes}
    return dcp_metadata.Metadata(state_dict_metadata={"x": item}, storage_data=storage)


@pytest.mark.timeout(60)  # a hang guard: the pairwise check took 30 s for 8000 chunks, 190 s for 20000
def test_a_checkpoint_of_twenty_thousand_chunks_is_checked_promptly_and_exactly():
    import torch

    from ballonet.training.checkpoints.safe_dcp import check_tensors

    def check(size, boxes):
        check_tensors(_chunked(size, boxes), {"x": (torch.Size(size), torch.float32)}, "ck", scope=("x",))

    n = 20_000
    check((n,), [((i,), (1,)) for i in range(n)])
    check((100, 200), [((r, c), (1, 200 // 4)) for r in range(100) for c in range(0, 200, 50)])  # a 2-D grid
    check((0, 64), [((0, 0), (0, 64))])  # an empty tensor
    overlapping = [((n,), [((i,), (1,)) for i in range(n)] + [((5,), (1,))]),  # one chunk twice
                   ((3,), [((0,), (2,)), ((1,), (1,))]),  # the volumes add up: one element twice, one never
                   ((2, 2), [((0, 0), (1, 2)), ((0, 0), (1, 2))])]
    for size, boxes in overlapping:
        with pytest.raises(InputError, match="overlapping chunks"):
            check(size, boxes)
    with pytest.raises(InputError, match="hold 19999 of its 20000"):
        check((n,), [((i,), (1,)) for i in range(1, n)])


# ---- Hugging Face model folders ----------------------------------------------------------

HF_CONFIG = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
             "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256}


@pytest.mark.parametrize("change, message", [
    ({"rope_scaling": 5}, "transformers cannot read it (Validation error for field 'rope_parameters': TypeError"),
    ({"model_type": ["llama"]}, "transformers cannot read it (unhashable type: 'list')"),
    ({"head_dim": 0}, "cannot build a causal LM from it (0.0 cannot be raised to a negative power)"),
    ({"model_type": "bert"}, "BertLMHeadModel has no decoder layers at model.layers or model.model.layers"),
], ids=["rope_scaling 5", "model_type a list", "head_dim 0", "an encoder"])
def test_a_model_config_transformers_refuses_in_its_own_words_is_one_line(tmp_path, change, message):
    """Each was a traceback: huggingface_hub's StrictDataclassFieldValidationError, a
    TypeError, a ZeroDivisionError building the rotary embedding, and the ValueError of
    FSDP's sharding finding no decoder layers."""
    import json

    import torch

    from ballonet.integrations import hf_model

    pytest.importorskip("transformers")
    (tmp_path / "config.json").write_text(json.dumps({**HF_CONFIG, **change}))
    _refused(lambda: hf_model.build_model(f"hf:{tmp_path}", 0, torch.device("cpu")), message)


# ---- corpora -----------------------------------------------------------------------------


def test_a_prepared_shard_that_shrinks_while_in_use_is_one_line(tmp_path):
    """Its shards were memory-mapped: truncated under a running corpus, the next read of a
    page past the new end killed the process with SIGBUS (exit 135, no message)."""
    import json
    import os
    import subprocess
    import sys

    from ballonet.training.data import prepare

    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": f"document {i} " + "abc" * 2000}) + "\n" for i in range(4)))
    prepare.prepare(prepare.PrepareConfig(data=str(data), out=str(tmp_path / "corpus")))
    script = ("import os, sys\n"
              "from ballonet.errors import InputError\n"
              "from ballonet.training.data.corpus import from_prepared\n"
              "corpus = from_prepared(sys.argv[1])\n"
              "corpus.tokens(0)\n"
              "os.truncate(os.path.join(sys.argv[1], 'tokens-00000.bin'), 100)\n"
              "try:\n"
              "    corpus.tokens(3)\n"
              "except InputError as e:\n"
              "    print(e)\n")
    r = subprocess.run([sys.executable, "-c", script, str(tmp_path / "corpus")], capture_output=True, text=True,
                       timeout=120, check=False, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0 and "tokens-00000.bin: changed while in use" in r.stdout, (r.returncode, r.stderr[-300:])


def test_a_lone_surrogate_in_a_jsonl_corpus_is_its_bytes_as_prepare_writes_them(tmp_path):
    """JSON's "\\ud800" decodes to a str UTF-8 cannot encode: `train --corpus` raised
    UnicodeEncodeError (a traceback), where `ballonet prepare` wrote its 3 bytes."""
    from ballonet.training.data import prepare
    from ballonet.training.data.corpus import from_prepared, load_corpus

    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "\\ud800abc"}\n')
    prepare.prepare(prepare.PrepareConfig(data=str(path), out=str(tmp_path / "corpus")))
    tokens = load_corpus(str(path)).tokens(0)
    assert tokens.tolist() == [0xED, 0xA0, 0x80, *b"abc"]
    assert tokens.tolist() == from_prepared(tmp_path / "corpus").tokens(0).tolist()


# ---- the one door ------------------------------------------------------------------------


def test_a_folder_swapped_for_a_link_out_between_the_check_and_the_open_is_refused(tmp_path, monkeypatch):
    """The symlink policy was checked on the path, then the path resolved again and opened:
    a folder on the way swapped for a link out in between (O_NOFOLLOW guards only the last
    name) opened the file outside the user's folder."""
    import os

    from ballonet import user_files

    folder, outside = tmp_path / "corpus", tmp_path / "outside"
    (folder / "sub").mkdir(parents=True)
    (folder / "sub" / "doc.txt").write_text("mine")
    outside.mkdir()
    (outside / "doc.txt").write_text("secret")
    real_open = os.open

    def racing_open(path, flags, *args, **kwargs):
        if str(path).endswith("doc.txt") and not os.path.islink(folder / "sub"):
            os.rename(folder / "sub", tmp_path / "moved")
            os.symlink(outside, folder / "sub")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", racing_open)
    _refused(lambda: user_files.read_bytes(folder / "sub" / "doc.txt", "document", folder), "a symbolic link out of")


def test_export_reads_no_folder_a_checkpoint_s_config_names_but_a_prepared_corpus(tmp_path, capsys):
    """The checkpoint's config.toml names the corpus its run trained on, whose tokenizer
    export copies: any folder it named (a stranger's checkpoint: `corpus = "/home/you/x"`)
    had its tokenizer.json, vocab.json, merges.txt, ... copied into the export."""
    from ballonet import cli
    from ballonet.training.config import TrainConfig
    from ballonet.training.loop import train

    pytest.importorskip("transformers")
    ck = tmp_path / "ck"
    train(TrainConfig(model="tiny", global_tokens=256, max_doc_tokens=128, steps=1, checkpoint_dir=str(ck),
                      checkpoint_every=1))
    named = tmp_path / "yours"
    named.mkdir()
    for name in ("tokenizer.json", "vocab.json", "merges.txt"):
        (named / name).write_text(f"your {name}")
    config = ck / "config.toml"
    config.write_text(config.read_text().replace('corpus = "stdlib"', f'corpus = "{named}"'))
    assert f'corpus = "{named}"' in config.read_text()
    assert cli.main(["export", "--checkpoint", str(ck), "--out", str(tmp_path / "out")]) == 0
    capsys.readouterr()
    assert not {"tokenizer.json", "vocab.json", "merges.txt"} & {p.name for p in (tmp_path / "out").iterdir()}


@pytest.mark.timeout(120)  # a hang guard: DCP's own open of a FIFO blocked for ever
def test_a_checkpoint_data_file_swapped_for_a_fifo_after_its_check_is_one_line(tmp_path, monkeypatch, capsys):
    import os

    from ballonet import cli
    from ballonet.training.checkpoints import safe_dcp
    from ballonet.training.config import TrainConfig
    from ballonet.training.loop import train

    pytest.importorskip("transformers")
    ck = tmp_path / "ck"
    train(TrainConfig(model="tiny", global_tokens=256, max_doc_tokens=128, steps=1, checkpoint_dir=str(ck),
                      checkpoint_every=1))
    read_metadata = safe_dcp.SafeReader.read_metadata

    def read_then_swap(reader):  # DCP's last look at the metadata before it opens the data files
        metadata = read_metadata(reader)
        for data in {info.relative_path for info in metadata.storage_data.values()}:
            os.remove(os.path.join(reader.path, data))
            os.mkfifo(os.path.join(reader.path, data))
        return metadata

    monkeypatch.setattr(safe_dcp.SafeReader, "read_metadata", read_then_swap)
    assert cli.main(["export", "--checkpoint", str(ck), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is a named pipe (FIFO)" in err[0], err
    assert not (tmp_path / "out").exists()


def test_a_tokenizer_whose_ids_pass_its_vocabulary_count_is_prepared_or_refused(tmp_path):
    """A WordLevel vocabulary {a: 0, [UNK]: 1, b: 1000} counts 3 tokens: prepare chose uint8
    shards and numpy raised OverflowError (a traceback) on id 1000. Its ids now size the
    vocabulary (1001); an id no vocabulary holds (a post-processor's special token) is one
    line naming the tokenizer file."""
    pytest.importorskip("tokenizers")
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    from ballonet.training.data import prepare
    from ballonet.training.data.corpus import from_prepared

    data = tmp_path / "docs.jsonl"
    data.write_text(json.dumps({"text": "a b a"}) + "\n")
    sparse = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1, "b": 1000}, unk_token="[UNK]"))
    sparse.pre_tokenizer = pre_tokenizers.Whitespace()
    (tmp_path / "sparse.json").write_text(sparse.to_str())
    manifest = prepare.prepare(prepare.PrepareConfig(data=str(data), out=str(tmp_path / "out"),
                                                     tokenizer=str(tmp_path / "sparse.json")))
    assert (manifest["vocab_size"], manifest["dtype"]) == (1001, "uint16")
    assert from_prepared(tmp_path / "out").tokens(0).tolist() == [0, 1000, 0]
    sparse.post_processor = processors.TemplateProcessing(single="[BOS] $A", special_tokens=[("[BOS]", 5000)])
    (tmp_path / "bos.json").write_text(sparse.to_str())
    _refused(lambda: prepare.prepare(prepare.PrepareConfig(data=str(data), out=str(tmp_path / "out2"),
                                                           tokenizer=str(tmp_path / "bos.json"))),
             "bos.json: the tokenizer gives token id 5000, beyond its vocabulary of 1001")
    assert not (tmp_path / "out2").exists()


def test_an_export_s_record_deletes_only_files_an_export_writes(tmp_path, capsys):
    """`--out` holding `ballonet-export.json` is an earlier export, replaced without
    --overwrite, and the files its record lists went with it: a record listing `notes.txt`
    (or `../x`, `[1]`) had the user's notes deleted."""
    import json

    from ballonet import cli
    from ballonet.training.config import TrainConfig
    from ballonet.training.loop import train

    pytest.importorskip("transformers")
    ck, out = tmp_path / "ck", tmp_path / "out"
    train(TrainConfig(model="tiny", global_tokens=256, max_doc_tokens=128, steps=1, checkpoint_dir=str(ck),
                      checkpoint_every=1))
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "ballonet-export.json").write_text(json.dumps({"files": ["notes.txt", [1], "../x", "config.json"]}))
    assert cli.main(["export", "--checkpoint", str(ck), "--out", str(out)]) == 0
    capsys.readouterr()
    assert (out / "notes.txt").read_text() == "mine" and (out / "model.safetensors").exists()


@pytest.mark.parametrize("kv", [0, False])
def test_a_model_config_of_zero_kv_heads_is_refused_not_read_as_full_attention(tmp_path, kv):
    """`num_key_value_heads: 0` was taken as absent (`or`): planned as 4 KV heads, silently."""
    import json

    from ballonet.integrations import hf_model

    (tmp_path / "config.json").write_text(json.dumps({**HF_CONFIG, "num_key_value_heads": kv}))
    _refused(lambda: hf_model.model_spec(f"hf:{tmp_path}"), f"num_kv_heads must be a positive integer, got {kv}")
