"""The cases of the bad-input sweep (`bench/fuzz.py`, machinery in `sweep.py`): bad
command lines and files by kind, then the classes of issue 33 (`ISSUE_33`): hostile
checkpoints and corpora, size budgets, late failures, tracebacks, silent wrong answers,
a dead peer. A hostile payload, if it ran, would create the file PWNED in the case's
folder, which the sweep reports as left behind."""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil

import numpy as np
from sweep import CORPUS_TRAIN, RESUME, Case, case

TOML_OK = '[[node_groups]]\ngpu = "h200"\nnum_nodes = 2\n'
_TRAIN = ["train", "--steps", "1", "--global-tokens", "512"]
PWNED = "touch PWNED"


def _npy(array) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.asarray(array))
    return buf.getvalue()


def _toml_case(name: str, text, **kw) -> Case:
    """`cost` with the cluster file c.toml holding `text`."""
    return case(name, "cost", "--length", "10", "--cluster", "c.toml", files=[("c.toml", text)], **kw)


GENERAL: list[Case] = [
    # argparse
    case("no subcommand"),
    case("unknown subcommand", "fly"),
    case("unknown flag", "cost", "--length", "10", "--colour"),
    case("missing required flag", "cost"),
    case("negative integer flag", "cost", "--length", "-3"),
    case("non-integer flag", "cost", "--length", "2.5"),
    case("zero --steps", "simulate", "--steps", "0"),
    case("zero --nodes", "plan", "--nodes", "0"),
    case("zero --tp", "cost", "--length", "10", "--tp", "0"),
    case("--workload with --lengths", "plan", "--workload", "wlbllm", "--lengths", "x.txt"),
    # presets and specs
    case("unknown model", "cost", "--length", "10", "--model", "gpt-9"),
    case("unknown cluster", "cost", "--length", "10", "--cluster", "dgx"),
    case("tp above the heads", "cost", "--length", "10", "--tp", "64"),
    case("tp not dividing the heads", "cost", "--length", "10", "--tp", "3"),
    case("tp above the GPUs of a node", "plan", "--cluster", "cpu", "--tp", "4"),
    case("cost: tp above the GPUs of a node", "cost", "--length", "10", "--tp", "16"),
    case("unknown planner", "plan", "--planner", "magic"),
    case("unknown planner in a list", "simulate", "--planners", "zeppelin,magic"),
    case("empty planner list", "simulate", "--planners", ","),
    case("unknown workload", "plan", "--workload", "nosuch"),
    # cluster TOML
    case("cluster file missing", "cost", "--length", "10", "--cluster", "missing.toml"),
    case("cluster file is a folder", "cost", "--length", "10", "--cluster", "c.toml", files=[("c.toml/", "")]),
    _toml_case("cluster TOML malformed", "[[node_groups]\n"),
    _toml_case("cluster TOML binary", bytes(range(256)) * 4),
    _toml_case("cluster TOML gpu = 5", "[[node_groups]]\ngpu = 5\n"),
    _toml_case("cluster TOML node_groups = [1, 2]", "node_groups = [1, 2]\n"),
    _toml_case('cluster TOML nic_gbps = "fast"', TOML_OK + 'nic_gbps = "fast"\n'),
    _toml_case("cluster TOML num_nodes = 2.5", '[[node_groups]]\ngpu = "h200"\nnum_nodes = 2.5\n'),
    _toml_case("cluster TOML unknown GPU", '[[node_groups]]\ngpu = "z80"\n'),
    _toml_case("cluster TOML unknown field", TOML_OK + "colour = 1\n"),
    _toml_case("cluster TOML name = [1]", "name = [1]\n" + TOML_OK),
    _toml_case("cluster TOML intra_link_bw = true", TOML_OK + "intra_link_bw = true\n"),
    # length files
    case("lengths file missing", "plan", "--lengths", "missing.txt"),
    case("lengths file empty", "plan", "--lengths", "l.txt", files=[("l.txt", "")]),
    case("lengths file with a word", "plan", "--lengths", "l.txt", files=[("l.txt", "10\nabc\n")]),
    case("lengths file with 0", "plan", "--lengths", "l.txt", files=[("l.txt", "10\n0\n")]),
    case("lengths file not UTF-8", "plan", "--lengths", "l.txt", files=[("l.txt", b"\xff\xfe\x00\x01")]),
    case("lengths .json not a list", "plan", "--lengths", "l.json", files=[("l.json", '{"a": 1}')]),
    case("lengths .json malformed", "plan", "--lengths", "l.json", files=[("l.json", "[1, 2")]),
    case("lengths .jsonl bad row", "plan", "--lengths", "l.jsonl", files=[("l.jsonl", '{"length": 3}\n[1]\n')]),
    case("lengths .npy uint64 above 2^63", "plan", "--lengths", "l.npy",
          files=[("l.npy", _npy(np.array([5, 2**63 + 5], dtype=np.uint64)))]),
    case("lengths .npy 2-D", "plan", "--lengths", "l.npy", files=[("l.npy", _npy(np.ones((2, 2), dtype=np.int64)))]),
    case("lengths .npy 2.5", "plan", "--lengths", "l.npy", files=[("l.npy", _npy(np.array([2.5])))]),
    case("lengths .npy not numpy", "plan", "--lengths", "l.npy", files=[("l.npy", "not numpy")]),
    case("lengths file is a folder", "plan", "--lengths", "l.txt", files=[("l.txt/", "")]),
    case("workload file with a word", "simulate", "--workload", "w.txt", files=[("w.txt", "abc\n")]),
    case("document larger than any GPU", "plan", "--lengths", "l.txt", files=[("l.txt", "1000000000\n")]),
    # output paths
    case("plan --out a folder", "plan", "--out", "d", files=[("d/", "")]),
    case("plan --out in a missing folder", "plan", "--out", "nodir/p.json"),
    case("simulate --trace in a missing folder", "simulate", "--planners", "zeppelin", "--trace", "nodir/t.json"),
    case("simulate --trace a folder", "simulate", "--planners", "zeppelin", "--trace", "d", files=[("d/", "")]),
    case("simulate --plot in a missing folder", "simulate", "--planners", "zeppelin", "--plot", "nodir/x.png"),
    case("simulate --plot a folder", "simulate", "--planners", "zeppelin", "--plot", "d", files=[("d/", "")]),
    case("simulate --plot unknown format", "simulate", "--planners", "zeppelin", "--plot", "x.zzz"),
    # valid look-alikes: a local folder or file named like a preset
    case("folder named like a cluster preset", "cost", "--length", "10", "--cluster", "h200-8nic",
          files=[("h200-8nic/", "")], exit_code=0),
    case("folder named like a workload preset", "plan", "--workload", "wlbllm", "--nodes", "1", "--json",
          files=[("wlbllm/", "")], exit_code=0),
    # train: launch flags and inputs
    case("train --nproc 0", *_TRAIN, "--nproc", "0"),
    case("train --nproc -1", *_TRAIN, "--nproc", "-1"),
    case("train --max-restarts -1", *_TRAIN, "--nproc", "2", "--max-restarts", "-1"),
    case("train unknown model", *_TRAIN, "--model", "gpt-9"),
    case("train unknown planner", *_TRAIN, "--planner", "magic"),
    case("train corpus missing", *_TRAIN, "--corpus", "missing.jsonl"),
    case("train corpus empty folder", *_TRAIN, "--corpus", "d", files=[("d/", "")]),
    case("train corpus bad JSONL line", *_TRAIN, "--corpus", "c.jsonl",
          files=[("c.jsonl", '{"text": "fine"}\nnot json\n')]),
    case("train --global-tokens below the ranks", *_TRAIN, "--nproc", "4", "--global-tokens", "3"),
    case("train --global-tokens 0", *_TRAIN, "--global-tokens", "0"),
    case("train --steps 0", *_TRAIN, "--steps", "0"),
    case("train --lr 0", *_TRAIN, "--lr", "0"),
    case("train cluster TOML gpu = 5", *_TRAIN, "--cluster", "c.toml",
          files=[("c.toml", "[[node_groups]]\ngpu = 5\n")]),
    case("train --max-doc-tokens 0", *_TRAIN, "--max-doc-tokens", "0", owner="D"),
    case("train --weight-decay -1", *_TRAIN, "--weight-decay", "-1", owner="D"),
    case("train --seed -1", *_TRAIN, "--seed", "-1", owner="D"),
    case("train --json-log a folder", *_TRAIN, "--json-log", "d", files=[("d/", "")]),
    case("train --json-log in a missing folder", *_TRAIN, "--json-log", "nodir/log.jsonl"),
    case("train --checkpoint-dir a file", *_TRAIN, "--checkpoint-dir", "f", "--checkpoint-every", "1",
          files=[("f", "x")]),
    case("train --resume corrupt checkpoint", *_TRAIN, "--checkpoint-dir", "ck", "--resume",
          files=[("ck/", ""), ("ck/checkpoint.pt", b"\x00garbage")], owner="D", slow=True),
    case("train --global-tokens 8M (budget)", *_TRAIN, "--global-tokens", "8000000", owner="D", slow=True),
    case("train --nproc 2, a rank's own error (corrupt checkpoint)", *_TRAIN, "--nproc", "2",
          "--checkpoint-dir", "ck", "--resume", files=[("ck/", ""), ("ck/checkpoint.pt", b"\x00garbage")],
          owner="D", slow=True),
]
"""Bad command lines and files by kind (issue 16 and before)."""


# ---- hostile files (issue 33, classes 1 and 2) ---------------------------------------------


def _short(text: str) -> bytes:
    data = text.encode()
    return pickle.SHORT_BINUNICODE + bytes([len(data)]) + data


DOTTED = (pickle.PROTO + bytes([4]) + _short("torch.distributed.checkpoint.metadata") + _short("os.system")
          + pickle.STACK_GLOBAL + _short(PWNED) + pickle.TUPLE1 + pickle.REDUCE + pickle.STOP)
"""Issue 33's payload: a protocol-4 global naming DCP's metadata module and the dotted name
`os.system`, which resolves through that module's `os` attribute."""


class _Reduce:
    def __reduce__(self):
        return os.system, (PWNED,)


REDUCE = pickle.dumps(_Reduce(), protocol=2)
"""A plain `__reduce__` payload."""
STEP = os.path.join("ck", f"step-{2:08d}")


def _plant(name: str, payload: bytes):
    def edit(folder: str) -> None:
        with open(os.path.join(folder, STEP, name), "wb") as f:
            f.write(payload)
    return edit


class _MetadataUnpickler(pickle.Unpickler):
    """DCP metadata in any pickle protocol, its globals limited to what that metadata holds
    (`safe_dcp.SAFE_GLOBALS`, torch's dtypes, layouts (by name: `_get_layout`), memory
    formats and `torch.Size`, an OrderedDict): for a metadata file an older Ballonet wrote, which `read_safe_metadata`
    (one protocol) refuses."""

    def find_class(self, module: str, name: str):
        import collections

        import torch

        from ballonet.training.checkpoints.safe_dcp import SAFE_GLOBALS

        allowed = {(g.__module__, g.__qualname__): g for g in (*SAFE_GLOBALS, torch.Size, collections.OrderedDict,
                                                               torch.serialization._get_layout)}
        if (module, name) in allowed:
            return allowed[module, name]
        value = getattr(torch, name, None) if module == "torch" else None
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            return value
        raise pickle.UnpicklingError(f"{module}.{name} is not in DCP metadata's allowed globals")


def _plant_items(payload: bytes):
    """The payload at the start of every stored item of the data files (each as long as
    it), where the metadata says each item lies, the files' sizes kept: whichever item is
    read first is a payload."""
    def edit(folder: str) -> None:
        from ballonet.errors import InputError
        from ballonet.training.checkpoints.checkpoint import read_safe_metadata

        step = os.path.join(folder, STEP)
        try:
            metadata = read_safe_metadata(os.path.join(step, ".metadata"), step)
        except InputError:  # written by an older ballonet (--source), perhaps in another pickle protocol
            with open(os.path.join(step, ".metadata"), "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        for info in metadata.storage_data.values():
            if info.length >= len(payload):
                with open(os.path.join(step, info.relative_path), "r+b") as f:
                    f.seek(info.offset)
                    f.write(payload)
    return edit


def _meta(**change):
    def edit(folder: str) -> None:
        path = os.path.join(folder, STEP, "ballonet.json")
        with open(path) as f:
            meta = json.load(f)
        for key, value in change.items():
            if key.startswith("loader."):
                meta["loader"][key.split(".", 1)[1]] = value
            else:
                meta[key] = value
        with open(path, "w") as f:
            json.dump(meta, f)
    return edit


def _manifest(**change):
    def edit(folder: str) -> None:
        path = os.path.join(folder, "corpus", "manifest.json")
        with open(path) as f:
            manifest = json.load(f)
        if "file" in change:  # the first shard, copied beside the corpus as x.bin
            shutil.copy(os.path.join(folder, "corpus", manifest["shards"][0]["file"]), os.path.join(folder, "x.bin"))
            name = change.pop("file")
            if name == "link.bin":
                os.symlink(os.path.join("..", "x.bin"), os.path.join(folder, "corpus", "link.bin"))
            manifest["shards"][0]["file"] = os.path.join(folder, "x.bin") if name == "ABSOLUTE" else name
        manifest.update(change)
        with open(path, "w") as f:
            json.dump(manifest, f)
    return edit


def _index(edit_rows):
    def edit(folder: str) -> None:
        path = os.path.join(folder, "corpus", "index.npy")
        index = np.load(path)
        edit_rows(index)
        np.save(path, index)
    return edit


def _empty_index(folder: str) -> None:
    open(os.path.join(folder, "corpus", "index.npy"), "wb").close()


def _fifo(folder: str) -> None:
    """A file that is not a regular file, inside the case's folder: code that replaces its
    output atomically would replace it (as it would /dev/null, run as root)."""
    os.mkfifo(os.path.join(folder, "p.fifo"))


def _hf_config() -> str:
    return json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
                       "intermediate_size": 176, "num_attention_heads": 4, "num_key_value_heads": 2,
                       "num_hidden_layers": 2, "vocab_size": 256, "max_position_embeddings": 4096,
                       "tie_word_embeddings": False})


def _ck(name, edit, expect, **kw) -> Case:
    return case(name, *RESUME, base="checkpoint", edit=edit, expect=expect, issue=1, slow=True, **kw)


def _corpus(name, edit, expect, **kw) -> Case:
    return case(name, *CORPUS_TRAIN, base="corpus", edit=edit, expect=expect, issue=2, slow=True, **kw)


def _ck_meta(name, expect, issue, **change) -> Case:
    return case(name, *RESUME, base="checkpoint", edit=_meta(**change), expect=expect, issue=issue, slow=True)


def _cpu_profile() -> str:
    from ballonet.cost import hardware

    return hardware.profile("cpu").to_json()


ISSUE_33: list[Case] = [
    # 1. code in a checkpoint
    _ck("checkpoint .metadata: dotted global os.system (protocol 4)", _plant(".metadata", DOTTED), ".metadata"),
    _ck("checkpoint .metadata: plain __reduce__", _plant(".metadata", REDUCE), ".metadata"),
    _ck("checkpoint .distcp items: dotted global", _plant_items(DOTTED), "corrupt or foreign checkpoint"),
    _ck("checkpoint .distcp items: plain __reduce__", _plant_items(REDUCE), "corrupt or foreign checkpoint"),
    _ck("checkpoint ballonet.json: a pickle", _plant("ballonet.json", DOTTED), "ballonet.json"),
    _ck("checkpoint latest: a pickle", _plant(os.path.join("..", "latest"), DOTTED), "latest"),
    # 2. a corpus reading outside its folder, or ids beyond its vocabulary
    _corpus("corpus shard ../x.bin", _manifest(file="../x.bin"), "shards[0].file"),
    _corpus("corpus shard an absolute path", _manifest(file="ABSOLUTE"), "shards[0].file"),
    _corpus("corpus shard a symlink out", _manifest(file="link.bin"), "shards[0].file"),
    _corpus("corpus index offset past its shard", _index(lambda ix: ix.__setitem__((-1, 1), ix[-1, 1] + 10**6)),
            "column 1 (offset)"),
    _corpus("corpus vocab_size 0", _manifest(vocab_size=0), "field 'vocab_size'"),
    _corpus("corpus vocab_size 10, ids to 120", _manifest(vocab_size=10), "field 'vocab_size'"),
    _corpus("corpus dtype float32", _manifest(dtype="float32"), "field 'dtype'"),
    _corpus("corpus dtype int8 (negative ids)", _manifest(dtype="int8"), "field 'dtype'"),
    _corpus("corpus index.npy 0 bytes", _empty_index, "index.npy"),
    # 3. size budgets (hangs and memory blow-ups)
    case("plan --tokens-per-gpu 1e14", "plan", "--tokens-per-gpu", "100000000000000", issue=3,
         expect="the whole cluster can hold"),
    case("plan --nodes 1000000", "plan", "--nodes", "1000000", issue=3, expect="more than the 16384"),
    _toml_case("cluster TOML num_nodes = 100000000", '[[node_groups]]\ngpu = "h200"\nnum_nodes = 100000000\n',
               issue=3, expect="c.toml: cluster"),
    case("simulate --tokens-per-gpu 1e10", "simulate", "--tokens-per-gpu", "10000000000", issue=3,
         expect="the whole cluster can hold"),
    case("plan --lengths of 2^20 + 1 documents", "plan", "--lengths", "l.npy", issue=3, expect="documents",
         files=[("l.npy", _npy(np.ones((1 << 20) + 1, dtype=np.int64)))], slow=True),
    _ck_meta("checkpoint loader offset 1e12", "offset 1000000000000", 3, **{"loader.offset": 10**12}),
    # 4. late failures: output paths, plot formats and checkpoint folders checked first
    case("calibrate --out a folder", "calibrate", "--quick", "--out", "d", files=[("d/", "")], issue=4,
         expect="is a folder"),
    case("calibrate --out in a missing folder", "calibrate", "--quick", "--out", "nodir/p.json", issue=4,
         expect="does not exist"),
    case("calibrate --plot unknown format", "calibrate", "--quick", "--plot", "p.zzz", issue=4,
         expect="expected a file name ending"),
    case("calibrate --out a named pipe", "calibrate", "--quick", "--out", "p.fifo", edit=_fifo, issue=4,
         expect="not a regular file", slow=True),
    case("calibrate --out read-only", "calibrate", "--quick", "--out", "disk/p.json", disk="readonly", issue=4,
         expect="not writable", slow=True),
    case("calibrate --out full disk", "calibrate", "--quick", "--out", "disk/p.json", disk="full", issue=4,
         expect="free on its disk", slow=True),
    case("calibrate --plot read-only", "calibrate", "--quick", "--plot", "disk/p.png", disk="readonly", issue=4,
         expect="not writable", slow=True),
    case("train --checkpoint-dir read-only", *_TRAIN, "--checkpoint-dir", "disk/ck", "--checkpoint-every", "1",
         disk="readonly", issue=4, expect="not writable", slow=True),
    case("train --checkpoint-dir full disk", *_TRAIN, "--checkpoint-dir", "disk/ck", "--checkpoint-every", "1",
         disk="full", issue=4, expect="free on its disk", slow=True),
    # 5. tracebacks
    case("binary --calibration file", "cost", "--length", "10", "--calibration", "p.json",
         files=[("p.json", bytes(range(256)))], issue=5, expect="not UTF-8"),
    case("plan --lengths a 0-byte .npy", "plan", "--lengths", "l.npy", files=[("l.npy", b"")], issue=5,
         expect="l.npy"),
    case("prepare --out read-only", "prepare", "--data", "d.jsonl", "--out", "disk/c",
         files=[("d.jsonl", '{"text": "hello"}\n')], disk="readonly", issue=5, expect="not a writable folder",
         slow=True),
    case("prepare --out full disk", "prepare", "--data", "d.jsonl", "--out", "disk/c",
         files=[("d.jsonl", '{"text": "hello"}\n')], disk="full", issue=5, expect="free on its disk", slow=True),
    case("train --weight-decay nan", *_TRAIN, "--weight-decay", "nan", issue=5, expect="--weight-decay"),
    case("train a garbage model.safetensors", *_TRAIN, "--model", "hf:m",
         files=[("m/", ""), ("m/config.json", _hf_config()), ("m/model.safetensors", b"garbage")], issue=5,
         expect="cannot read its weights", slow=True),
    case("plan --json | head -c 300", "plan", "--json", "--nodes", "32", pipe="head -c 300", issue=5,
         expect="broken pipe", slow=True),
    # 6. silent wrong answers
    case("a cpu profile on an h800 cluster", "plan", "--cluster", "h800-8nic", "--calibration", "p.json",
         files=[("p.json", _cpu_profile())], issue=6, expect="does not have"),
    _toml_case("cluster TOML nic_gbps = inf", TOML_OK + "nic_gbps = inf\n", issue=6, expect="must be finite"),
    case("cost --length 1e21", "cost", "--length", "1" + "0" * 21, issue=6, expect="below 2^63"),
    case("train --lr inf", *_TRAIN, "--lr", "inf", issue=6, expect="--lr must be a finite number"),
    case("train --lr 1e30 (the loss turns NaN)", "train", "--steps", "4", "--global-tokens", "512", "--lr", "1e30",
         issue=6, expect="the loss is nan", slow=True),
    _ck_meta("checkpoint step -3", "field 'step'", 6, step=-3),
    # 7. a dead peer (the token-content digest of the plan check is runtime/comm.py's)
    case("train --nproc 2, rank 1 killed at step 2", "train", "--nproc", "2", "--steps", "4", "--global-tokens",
         "512", env=(("BALLONET_FAULT", "2:1"),), exit_code=1, issue=7, expect="rank 1 died (signal 9)", slow=True),
]
"""Issue 33's classes; class 8 (calibrate's threading) is measured by
`bench/calibration_threads.py`, not a bad input."""

SWEEP: list[Case] = GENERAL + ISSUE_33
