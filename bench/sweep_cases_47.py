"""Issue 47's cases of the bad-input sweep (`bench/fuzz.py`; machinery in `sweep.py`), by
class (`CLASSES`): code run from a folder, files outside what was asked read or replaced,
hangs and memory blow-ups, tracebacks, silent wrong answers, a full disk. Every case must
end within 20 s and under 1.5 GB (`sweep.MAX_SECONDS`, `MAX_RSS_MB`), with the expected
exit code and one line naming the file; a payload that ran leaves PWNED; a guarded file
must be byte for byte the same after the run. The issue's own reproductions are marked
"(issue)"; the others are this sweep's own."""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import socket

import numpy as np
from sweep import CORPUS_TRAIN, RESUME, Case, case
from sweep_cases import _hf_config

CLASSES = {"code": "code runs from a folder", "outside": "files outside what was asked read or replaced",
           "hang": "hangs and memory blow-ups (20 s, 1.5 GB)", "traceback": "tracebacks",
           "silent": "silent wrong answers", "disk": "a full disk"}
STEP = os.path.join("ck", f"step-{2:08d}")
TRAIN = ("train", "--steps", "1", "--global-tokens", "256")
EXPORT = ("export", "--checkpoint", "ck", "--out", "out")
PROFILE = None  # the cpu profile's JSON, made when first asked (bench imports stay light)
DEEP_JSON, BIG_JSON = "[" * 100_000 + "]" * 100_000, "1" * 5000
DEEP_TOML, BIG_TOML = "x = " + "[" * 5000 + "]" * 5000 + "\n", "x = " + "1" * 5000 + "\n"
PAYLOAD_PY = "import pathlib\npathlib.Path('PWNED').touch()\n"


def c(klass: str, name: str, *argv, **kw) -> Case:
    return case(name, *argv, klass=klass, slow=True, **kw)


def _profile(**change) -> str:
    global PROFILE
    if PROFILE is None:
        from ballonet.cost import hardware

        PROFILE = json.loads(hardware.profile("cpu").to_json())
    d = json.loads(json.dumps(PROFILE))
    for key, value in change.items():
        where = d
        *parents, last = key.split(".")
        for p in parents:
            where = where[p]
        where[last] = value
    return json.dumps(d)


def _npy(array) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.asarray(array))
    return buf.getvalue()


def _npy_header(shape, descr="<i8", tail=b"\0" * 16) -> bytes:
    from numpy.lib import format as npy

    buf = io.BytesIO()
    npy.write_array_header_1_0(buf, {"descr": descr, "fortran_order": False, "shape": shape})
    return buf.getvalue() + tail


# ---- edits of the case's folder ---------------------------------------------------------------


def _outside(folder: str) -> str:
    """A folder beside what the case names (outside/), with a secret file in it."""
    out = os.path.join(folder, "outside")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "secret.txt"), "w") as f:
        f.write("not yours\n")
    return out


def fifo(rel: str):
    def edit(folder: str) -> None:
        path = os.path.join(folder, rel)
        if os.path.lexists(path):
            shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.remove(path)
        os.mkfifo(path)
    return edit


def link(rel: str, target: str):
    """rel becomes a symlink to target (absolute, or relative to the case's folder; "OUT"
    moves rel's own content to outside/ first and links to it)."""
    def edit(folder: str) -> None:
        path = os.path.join(folder, rel)
        out = _outside(folder)
        if target == "OUT":
            dest = os.path.join(out, os.path.basename(rel))
            shutil.move(path, dest)
        else:
            dest = target if os.path.isabs(target) else os.path.join(folder, target)
            if os.path.lexists(path):
                shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.remove(path)
        os.symlink(dest, path)
    return edit


def write(rel: str, data: str | bytes):
    def edit(folder: str) -> None:
        with open(os.path.join(folder, rel), "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
    return edit


def sparse(rel: str, size: int):
    def edit(folder: str) -> None:
        with open(os.path.join(folder, rel), "wb") as f:
            f.truncate(size)
    return edit


def sock(rel: str):
    def edit(folder: str) -> None:
        s = socket.socket(socket.AF_UNIX)
        s.bind(os.path.join(folder, rel))
        s.close()
    return edit


def json_edit(rel: str, change):
    def edit(folder: str) -> None:
        path = os.path.join(folder, rel)
        with open(path) as f:
            d = json.load(f)
        change(d)
        with open(path, "w") as f:
            json.dump(d, f)
    return edit


def raw_json_field(rel: str, key: str, text: str):
    """Set field `key` of the JSON object in rel to the raw JSON `text` (deep, huge, NaN)."""
    def edit(folder: str) -> None:
        path = os.path.join(folder, rel)
        with open(path) as f:
            body = f.read().rstrip()
        with open(path, "w") as f:
            f.write(body[:-1] + f', "{key}": {text}}}')
    return edit


def both(*edits):
    def edit(folder: str) -> None:
        for e in edits:
            e(folder)
    return edit


def dcp_metadata(change):
    """Rewrite the clean checkpoint's .metadata (protocol 2, as Ballonet writes it) after
    `change(metadata)`."""
    def edit(folder: str) -> None:
        import torch

        from ballonet.training.checkpoints.safe_dcp import METADATA_PROTOCOL, read_safe_metadata

        step = os.path.join(folder, STEP)
        metadata = read_safe_metadata(os.path.join(step, ".metadata"), step)
        change(metadata, torch)
        with open(os.path.join(step, ".metadata"), "wb") as f:
            f.write(pickle.dumps(metadata, protocol=METADATA_PROTOCOL))
    return edit


def _embedding(metadata):
    return metadata.state_dict_metadata["model.embed.weight"] if "model.embed.weight" in \
        metadata.state_dict_metadata else next(v for k, v in metadata.state_dict_metadata.items()
                                               if k.startswith("model.") and hasattr(v, "chunks"))


def _set(obj, name, value):
    object.__setattr__(obj, name, value)


def custom_code_folder(model_type: str = "pwned-model"):
    config = {**json.loads(_hf_config()), "model_type": model_type,
              "auto_map": {"AutoConfig": "pwn.Config", "AutoModelForCausalLM": "pwn.Model"}}
    return [("m/", ""), ("m/config.json", json.dumps(config)), ("m/pwn.py", PAYLOAD_PY),
            ("m/configuration_pwn.py", PAYLOAD_PY)]


def _absent(*names):
    def check(folder: str) -> str | None:
        present = [n for n in names if os.path.lexists(os.path.join(folder, n))]
        return f"{present[0]} left in place" if present else None
    return check


HF = [("m/", ""), ("m/config.json", _hf_config())]
SECRET = ("outside/secret.txt",)

# ---- the cases ---------------------------------------------------------------------------------

CODE = [
    c("code", "(issue) custom-code HF folder, y on stdin", *TRAIN, "--model", "hf:m", files=custom_code_folder(),
      stdin="y\ny\ny\n", expect="auto_map"),
    c("code", "custom-code HF folder with a known model_type", *TRAIN, "--model", "hf:m",
      files=custom_code_folder("llama"), stdin="y\n", expect="auto_map"),
    c("code", "custom code named in --config (model = hf:m)", "train", "--config", "run.toml",
      files=[*custom_code_folder(), ("run.toml", 'model = "hf:m"\nsteps = 1\nglobal_tokens = 256\n')], stdin="y\n",
      expect="auto_map"),
    c("code", "HF folder: unknown model_type and a .py, no auto_map", *TRAIN, "--model", "hf:m",
      files=[("m/", ""), ("m/config.json", json.dumps({**json.loads(_hf_config()), "model_type": "pwned-model"})),
             ("m/modeling_pwned.py", PAYLOAD_PY)], stdin="y\n", expect="transformers cannot read it"),
    c("code", "HF folder: pickled pytorch_model.bin payload only", *TRAIN, "--model", "hf:m",
      files=[*HF, ("m/pytorch_model.bin", pickle.dumps(os.system))], expect="pickled weights are not loaded"),
    c("code", ".metadata calls bytearray(3e9) (40 bytes)", *RESUME, base="checkpoint",
      edit=write(os.path.join(STEP, ".metadata"), b"\x80\x02c__builtin__\nbytearray\nJ\x00^\xd0\xb2\x85R."),
      expect="bytearray"),
    c("code", ".metadata names builtins.eval", *RESUME, base="checkpoint",
      edit=write(os.path.join(STEP, ".metadata"), b"\x80\x02cbuiltins\neval\nX\x0b\x00\x00\x00touch PWNED\x85R."),
      expect="eval"),
    c("code", "export of a .metadata calling bytearray", *EXPORT, base="checkpoint",
      edit=write(os.path.join(STEP, ".metadata"), b"\x80\x02c__builtin__\nbytearray\nJ\x00^\xd0\xb2\x85R."),
      expect="bytearray"),
    c("code", "lengths .npy of pickled objects", "plan", "--lengths", "l.npy",
      files=[("l.npy", _npy_header((1,), "|O", pickle.dumps([os.system])))], expect="Python objects"),
    c("code", "prepared index.npy of pickled objects", *CORPUS_TRAIN, base="corpus",
      edit=write("corpus/index.npy", _npy_header((1, 5), "|O", pickle.dumps([os.system]))), expect="index.npy"),
    c("code", "./ballonet package in the working folder, 2 ranks", "train", "--nproc", "2", "--steps", "1",
      "--global-tokens", "256", files=[("ballonet/", ""), ("ballonet/__init__.py", PAYLOAD_PY),
                                       ("ballonet/__main__.py", PAYLOAD_PY)], exit_code=0),
]

OUTSIDE = [
    c("outside", "(issue) text corpus: a file links out", *TRAIN, "--corpus", "texts",
      files=[("texts/", ""), ("texts/a.txt", "hello world")], edit=link("texts/b.txt", "outside/secret.txt"),
      expect="symbolic link out of", guard=SECRET),
    c("outside", "(issue) prepare: a text file links out", "prepare", "--data", "texts", "--out", "c",
      files=[("texts/", ""), ("texts/a.txt", "hello world")], edit=link("texts/b.txt", "outside/secret.txt"),
      expect="symbolic link out of"),
    c("outside", "text corpus: a link to /etc/hostname", *TRAIN, "--corpus", "texts",
      files=[("texts/", ""), ("texts/a.txt", "hello")], edit=link("texts/b.txt", "/etc/hostname"),
      expect="symbolic link out of"),
    c("outside", "text corpus: a dangling link", *TRAIN, "--corpus", "texts",
      files=[("texts/", ""), ("texts/a.txt", "hello")], edit=link("texts/b.txt", "outside/none.txt"),
      expect="symbolic link"),
    c("outside", "text corpus: a looping link", *TRAIN, "--corpus", "texts",
      files=[("texts/", ""), ("texts/a.txt", "hello")], edit=link("texts/b.txt", "texts/b.txt"),
      expect="symbolic link"),
    c("outside", "text corpus: a link inside the folder (valid)", *TRAIN, "--corpus", "texts",
      files=[("texts/", ""), ("texts/a.txt", "hello world " * 30)], edit=link("texts/b.txt", "texts/a.txt"),
      exit_code=0),
    c("outside", "the corpus folder named is itself a link (valid)", *TRAIN, "--corpus", "named",
      files=[("texts/", ""), ("texts/a.txt", "hello world " * 30)], edit=link("named", "texts"), exit_code=0),
    c("outside", "(issue) prepared corpus: index.npy links out", *CORPUS_TRAIN, base="corpus",
      edit=link("corpus/index.npy", "OUT"), expect="symbolic link out of"),
    c("outside", "prepared corpus: manifest.json links out", *CORPUS_TRAIN, base="corpus",
      edit=link("corpus/manifest.json", "OUT"), expect="symbolic link out of"),
    c("outside", "(issue) checkpoint: .metadata links out", *RESUME, base="checkpoint",
      edit=link(os.path.join(STEP, ".metadata"), "OUT"), expect="symbolic link out of"),
    c("outside", "(issue) checkpoint: step-N links out", *RESUME, base="checkpoint", edit=link(STEP, "OUT"),
      expect="symbolic link out of"),
    c("outside", "checkpoint: latest links out", *RESUME, base="checkpoint", edit=link("ck/latest", "OUT"),
      expect="symbolic link out of"),
    c("outside", "checkpoint: ballonet.json links out", *RESUME, base="checkpoint",
      edit=link(os.path.join(STEP, "ballonet.json"), "OUT"), expect="symbolic link out of"),
    c("outside", "export: step-N links out", *EXPORT, base="checkpoint", edit=link(STEP, "OUT"),
      expect="symbolic link out of"),
    c("outside", "(issue) checkpoint: a .tmp- link to a folder outside (removed as a link)", *RESUME,
      base="checkpoint", edit=lambda f: (_outside(f), os.symlink(os.path.join(f, "outside"), os.path.join(f, "ck",
                                                                                                   ".tmp-x"))),
      exit_code=0, guard=("outside", "outside/secret.txt")),
    c("outside", "(issue) HF folder: model.safetensors links out", *TRAIN, "--model", "hf:m", files=HF,
      edit=link("m/model.safetensors", "outside/secret.txt"), expect="symbolic link out of"),
    c("outside", "HF folder: config.json links out", *TRAIN, "--model", "hf:m", files=HF,
      edit=link("m/config.json", "OUT"), expect="symbolic link out of"),
    c("outside", "prepare --tokenizer folder: tokenizer.json links out", "prepare", "--data", "d.jsonl", "--out",
      "c", "--tokenizer", "tok", files=[("d.jsonl", '{"text": "hi"}\n'), ("tok/", "")],
      edit=link("tok/tokenizer.json", "outside/secret.txt"), expect="symbolic link out of"),
    # issue47b's: --json-log and export --out never delete or replace what the run did not make
    c("outside", "(issue) --json-log a file of other content", *TRAIN, "--json-log", "notes.txt",
      files=[("notes.txt", "my notes\n")], expect="notes.txt", guard=("notes.txt",)),
    c("outside", "(issue) --json-log from a --config file", "train", "--config", "run.toml",
      files=[("notes.txt", "my notes\n"), ("run.toml", 'json_log = "notes.txt"\nsteps = 1\nglobal_tokens = 256\n')],
      expect="notes.txt", guard=("notes.txt",)),
    c("outside", "(issue) --json-log on --resume names a foreign file", *RESUME, "--json-log", "notes.txt",
      base="checkpoint", files=[("notes.txt", "my notes\n")], expect="notes.txt", guard=("notes.txt",)),
    c("outside", "--json-log a symlink to a file outside", *TRAIN, "--json-log", "log.jsonl",
      edit=link("log.jsonl", "outside/secret.txt"), expect="log.jsonl", guard=SECRET),
    c("outside", "(issue) export --out a folder of other files", *EXPORT, base="checkpoint",
      files=[("out/", ""), ("out/thesis.tex", "mine")], expect="out", guard=("out/thesis.tex", "out")),
    c("outside", "(issue) export --out a symlink to a folder outside", *EXPORT, base="checkpoint",
      edit=lambda f: (_outside(f), os.symlink(os.path.join(f, "outside"), os.path.join(f, "out"))), expect="out",
      guard=("outside", "outside/secret.txt")),
]

HANG = [
    *[c("hang", f"(issue) a FIFO as {what}", *argv, base=base, files=files, edit=fifo(rel), expect=expect)
      for what, argv, base, files, rel, expect in [
          (".metadata", RESUME, "checkpoint", (), os.path.join(STEP, ".metadata"), ".metadata"),
          ("latest", RESUME, "checkpoint", (), "ck/latest", "latest"),
          ("ballonet.json", RESUME, "checkpoint", (), os.path.join(STEP, "ballonet.json"), "ballonet.json"),
          ("--config", ("train", "--config", "run.toml"), None, (), "run.toml", "run.toml"),
          ("--model hf:DIR config.json", (*TRAIN, "--model", "hf:m"), None, (("m/", ""),), "m/config.json",
           "config.json"),
          ("--calibration", ("cost", "--length", "10", "--cluster", "cpu", "--calibration", "p.json"), None, (),
           "p.json", "p.json"),
          ("--lengths .txt", ("plan", "--lengths", "l.txt"), None, (), "l.txt", "l.txt"),
          ("--lengths .npy", ("plan", "--lengths", "l.npy"), None, (), "l.npy", "l.npy"),
          ("--cluster TOML", ("cost", "--length", "10", "--cluster", "c.toml"), None, (), "c.toml", "c.toml"),
          ("--model TOML", ("cost", "--length", "10", "--model", "m.toml"), None, (), "m.toml", "m.toml"),
          ("--corpus .jsonl", (*TRAIN, "--corpus", "c.jsonl"), None, (), "c.jsonl", "c.jsonl"),
          ("prepare --data", ("prepare", "--data", "d.jsonl", "--out", "c"), None, (), "d.jsonl", "d.jsonl"),
          ("prepare --tokenizer", ("prepare", "--data", "d.jsonl", "--out", "c", "--tokenizer", "t.json"), None,
           (("d.jsonl", '{"text": "hi"}\n'),), "t.json", "t.json"),
          ("a prepared manifest.json", CORPUS_TRAIN, "corpus", (), "corpus/manifest.json", "manifest.json"),
          ("a prepared index.npy", CORPUS_TRAIN, "corpus", (), "corpus/index.npy", "index.npy"),
          ("a text corpus document", (*TRAIN, "--corpus", "texts"), None, (("texts/", ""), ("texts/a.txt", "hi")),
           "texts/b.txt", "b.txt"),
          ("HF model.safetensors", (*TRAIN, "--model", "hf:m"), None, HF, "m/model.safetensors",
           "model.safetensors"),
          ("export's .metadata", EXPORT, "checkpoint", (), os.path.join(STEP, ".metadata"), ".metadata"),
      ]],
    *[c("hang", f"(issue) /dev/zero as {what}", *argv, edit=link(rel, "/dev/zero"), files=files, expect=rel)
      for what, argv, rel, files in [
          ("--config", ("train", "--config", "run.toml"), "run.toml", ()),
          ("--calibration", ("cost", "--length", "10", "--cluster", "cpu", "--calibration", "p.json"), "p.json", ()),
          ("--lengths .json", ("plan", "--lengths", "l.json"), "l.json", ()),
          ("--cluster TOML", ("cost", "--length", "10", "--cluster", "c.toml"), "c.toml", ()),
          ("--corpus .jsonl", (*TRAIN, "--corpus", "c.jsonl"), "c.jsonl", ()),
          ("prepare --data", ("prepare", "--data", "d.jsonl", "--out", "c"), "d.jsonl", ()),
          ("--model hf:DIR config.json", (*TRAIN, "--model", "hf:m"), "m/config.json", (("m/", ""),)),
      ]],
    c("hang", "/dev/zero linked as a checkpoint's .metadata", *RESUME, base="checkpoint",
      edit=link(os.path.join(STEP, ".metadata"), "/dev/zero"), expect="symbolic link out of"),
    c("hang", "a socket as --lengths", "plan", "--lengths", "l.txt", edit=sock("l.txt"), expect="socket"),
    c("hang", "a 2 GiB sparse lengths file", "plan", "--lengths", "l.txt", edit=sparse("l.txt", 2 << 30),
      expect="over the"),
    c("hang", "a 300 MiB sparse .metadata", *RESUME, base="checkpoint",
      edit=sparse(os.path.join(STEP, ".metadata"), 300 << 20), expect="over the"),
    c("hang", "a 1 MiB latest", *RESUME, base="checkpoint", edit=sparse("ck/latest", 1 << 20), expect="over the"),
    c("hang", "a 2 MiB --config of one comment", "train", "--config", "run.toml",
      files=[("run.toml", "#" * (2 << 20))], expect="over the"),
    c("hang", "a .npy lengths file whose header claims 10^12 elements", "plan", "--lengths", "l.npy",
      files=[("l.npy", _npy_header((10**12,)))], expect="header says"),
    c("hang", "an index.npy whose header claims 10^11 rows", *CORPUS_TRAIN, base="corpus",
      edit=write("corpus/index.npy", _npy_header((10**11, 5))), expect="header says"),
    c("hang", "(issue) a jsonl length of 2e8 trains one step", *TRAIN, "--corpus", "c.jsonl",
      files=[("c.jsonl", '{"length": 200000000}\n')], exit_code=0),
    c("hang", "a lengths file of 2e8 as a corpus trains one step", *TRAIN, "--corpus", "l.txt",
      files=[("l.txt", "200000000\n")], exit_code=0),
    c("hang", "a jsonl input_ids id of 1e9 (a 1e9 vocabulary)", *TRAIN, "--corpus", "c.jsonl",
      files=[("c.jsonl", '{"input_ids": [1000000000]}\n')], expect="vocab"),
    c("hang", "(issue) ballonet.json step 1e12 (issue47b: the schedule in O(1))", *RESUME, base="checkpoint",
      edit=json_edit(os.path.join(STEP, "ballonet.json"), lambda d: d.__setitem__("step", 10**12)), expect="step"),
    c("hang", "a 200 MB lengths line of NULs", "plan", "--lengths", "l.txt", edit=sparse("l.txt", 200 << 20),
      expect="l.txt:1"),
]


def _deep(what: str, argv, rel: str, body: str, files=(), base=None) -> list[Case]:
    """Two cases: the file `rel` holding `body` with deep nesting, and with 5000 digits."""
    return [c("traceback", f"{what}: {label}", *argv, files=files, base=base, edit=write(rel, body % text),
              expect=rel.split("/")[-1])
            for label, text in (("deep nesting", DEEP_JSON), ("5000 digits", BIG_JSON))]


TRACEBACK = [
    *_deep("(issue) lengths .json", ("plan", "--lengths", "l.json"), "l.json", "[%s]"),
    *_deep("(issue) lengths .jsonl", ("plan", "--lengths", "l.jsonl"), "l.jsonl", '{"length": %s}\n'),
    *_deep("(issue) corpus .jsonl", (*TRAIN, "--corpus", "c.jsonl"), "c.jsonl", '{"input_ids": [%s]}\n'),
    *_deep("(issue) prepare .jsonl", ("prepare", "--data", "d.jsonl", "--out", "c"), "d.jsonl", '{"text": %s}\n'),
    *_deep("(issue) calibration profile", ("cost", "--length", "10", "--cluster", "cpu", "--calibration", "p.json"),
           "p.json", '{"schema": %s}'),
    *_deep("(issue) HF config.json", (*TRAIN, "--model", "hf:m"), "m/config.json", '{"vocab_size": %s}',
           files=[("m/", "")]),
    *_deep("(issue) prepared manifest.json", CORPUS_TRAIN, "corpus/manifest.json", '{"format": %s}',
           base="corpus"),
    *_deep("checkpoint ballonet.json", RESUME, os.path.join(STEP, "ballonet.json"), '{"step": %s}',
           base="checkpoint"),
    *[c("traceback", f"(issue) {what} TOML: {label}", *argv, files=[(rel, text)], expect=rel)
      for what, argv, rel in [("cluster", ("cost", "--length", "10", "--cluster", "c.toml"), "c.toml"),
                              ("model", ("cost", "--length", "10", "--model", "m.toml"), "m.toml"),
                              ("--config", ("train", "--config", "run.toml"), "run.toml")]
      for label, text in (("deep nesting", DEEP_TOML), ("5000 digits", BIG_TOML), ("inf", "x = inf\n"))],
    c("traceback", "(issue) profile: a zero efficiency", "cost", "--length", "10", "--cluster", "cpu",
      "--calibration", "p.json", edit=lambda f: write("p.json", _profile(p2p_efficiency=0))(f), expect="p2p_efficiency"),
    c("traceback", "(issue) profile: assumptions not a list", "cost", "--length", "10", "--cluster", "cpu",
      "--calibration", "p.json", edit=lambda f: write("p.json", _profile(assumptions=5))(f), expect="assumptions"),
    c("traceback", "profile: a NaN literal", "cost", "--length", "10", "--cluster", "cpu", "--calibration", "p.json",
      edit=lambda f: write("p.json", _profile().replace('"p2p_efficiency": ', '"p2p_efficiency": NaN, "x": '))(f),
      expect="p.json"),
    c("traceback", "(issue) a corpus folder with a dangling link", "prepare", "--data", "texts", "--out", "c",
      files=[("texts/", ""), ("texts/a.txt", "hi")], edit=link("texts/b.txt", "texts/none"), expect="b.txt"),
    c("traceback", "(issue) a uint64 prepared corpus (ids wrap negative)", *CORPUS_TRAIN, base="corpus",
      edit=json_edit("corpus/manifest.json", lambda d: d.__setitem__("dtype", "uint64")), expect="field 'dtype'"),
    c("traceback", "manifest num_tokens 1e400", *CORPUS_TRAIN, base="corpus",
      edit=raw_json_field("corpus/manifest.json", "max_token_id", "1e400"), expect="manifest.json"),
    c("traceback", "(issue) --seed of 30 digits", *TRAIN, "--seed", "9" * 30, expect="--seed"),
    c("traceback", "(issue) --timeout-minutes of 30 digits", *TRAIN, "--timeout-minutes", "9" * 30,
      expect="--timeout-minutes"),
    c("traceback", "(issue) --max-length of 30 digits", "simulate", "--planners", "zeppelin", "--max-length", "9" * 30,
      expect="--max-length"),
    c("traceback", "a lengths .txt line of 5000 digits", "plan", "--lengths", "l.txt", files=[("l.txt", BIG_JSON)],
      expect="l.txt:1"),
    c("traceback", "a lengths .npy of 0 bytes after its header", "plan", "--lengths", "l.npy",
      files=[("l.npy", _npy_header((4,), tail=b""))], expect="l.npy"),
    c("traceback", "a tokenizer.json of deep nesting", "prepare", "--data", "d.jsonl", "--out", "c", "--tokenizer",
      "t.json", files=[("d.jsonl", '{"text": "hi"}\n'), ("t.json", DEEP_JSON)], expect="t.json"),
    # issue47b's: crafted DCP metadata in export
    c("traceback", "(issue) export: a tensor size of 1e12", *EXPORT, base="checkpoint",
      edit=dcp_metadata(lambda m, torch: _set(_embedding(m), "size", torch.Size([10**12, 64]))),
      expect="checkpoint's metadata"),
    c("traceback", "(issue) export: a negative tensor size", *EXPORT, base="checkpoint",
      edit=dcp_metadata(lambda m, torch: _set(_embedding(m), "size", torch.Size([-5, 64]))),
      expect="checkpoint's metadata"),
    c("traceback", "(issue) export: a qint8 tensor", *EXPORT, base="checkpoint",
      edit=dcp_metadata(lambda m, torch: _set(_embedding(m).properties, "dtype", torch.qint8)),
      expect="checkpoint's metadata"),
]

SILENT = [
    c("silent", "(issue) a prepared corpus without its manifest", *CORPUS_TRAIN, base="corpus",
      edit=lambda f: os.remove(os.path.join(f, "corpus", "manifest.json")), expect="manifest"),
    c("silent", "(issue) HF weights under other names", *TRAIN, "--model", "hf:m", files=HF,
      edit=lambda f: _wrong_names(f), expect="the weights have no tensor"),
    c("silent", "(issue) HF model.safetensors a folder", *TRAIN, "--model", "hf:m",
      files=[*HF, ("m/model.safetensors/", "")], expect="model.safetensors"),
    c("silent", "(issue) profile 1e-300 efficiency (Infinity in JSON)", "cost", "--length", "10", "--cluster", "cpu",
      "--json", "--calibration", "p.json", edit=lambda f: write("p.json", _profile(nic_efficiency=1e-300))(f),
      expect="nic_efficiency"),
    c("silent", "(issue) profile memory_bw 1e300", "cost", "--length", "10", "--cluster", "cpu", "--json",
      "--calibration", "p.json", edit=lambda f: write("p.json", _profile(memory_bw=1e300))(f), expect="memory_bw"),
    c("silent", "profile collective efficiency 0", "cost", "--length", "10", "--cluster", "cpu", "--json",
      "--calibration", "p.json", edit=lambda f: write("p.json", _profile(**{"collective_efficiency.all_gather": 0}))(f),
      expect="all_gather"),
    # issue47b's
    c("silent", "(issue) a checkpoint past --steps", "train", "--steps", "1", "--global-tokens", "512",
      "--max-doc-tokens", "256", "--checkpoint-dir", "ck", "--resume", base="checkpoint", expect="--steps"),
    c("silent", "(issue) --warmup-steps over --steps", *TRAIN, "--warmup-steps", "5", expect="--warmup-steps"),
    c("silent", "(issue) --async-checkpoint without --checkpoint-dir", *TRAIN, "--async-checkpoint",
      expect="--async-checkpoint"),
    c("silent", "(issue) --gpus-per-node without --nproc", *TRAIN, "--gpus-per-node", "2", expect="--gpus-per-node"),
    c("silent", "(issue) export: ballonet.json vocab_size -5", *EXPORT, base="checkpoint",
      edit=json_edit(os.path.join(STEP, "ballonet.json"), lambda d: d["model"].__setitem__("vocab_size", -5)),
      expect="vocab_size"),
    c("silent", "(issue) export: a tensor with no chunks", *EXPORT, base="checkpoint",
      edit=dcp_metadata(lambda m, torch: _set(_embedding(m), "chunks", [])), expect="checkpoint's metadata"),
    c("silent", "(issue) export: a bool dtype lie", *EXPORT, base="checkpoint",
      edit=dcp_metadata(lambda m, torch: _set(_embedding(m).properties, "dtype", torch.bool)),
      expect="checkpoint's metadata"),
    c("silent", "(issue) export --out an earlier export: no stale pytorch_model.bin", *EXPORT, base="checkpoint",
      edit=lambda f: (os.makedirs(os.path.join(f, "out")), _export_marker(f)), exit_code=0,
      after=_absent("out/pytorch_model.bin")),
]

DISK = [
    c("disk", "(issue) export --out on a full disk", "export", "--checkpoint", "ck", "--out", "disk/out",
      base="checkpoint", disk="full", expect="disk"),
    c("disk", "prepare --out on a full disk", "prepare", "--data", "d.jsonl", "--out", "disk/c",
      files=[("d.jsonl", '{"text": "hello"}\n')], disk="full", expect="free on its disk"),
    c("disk", "train --json-log on a full disk", *TRAIN, "--json-log", "disk/log.jsonl", disk="full",
      expect="No space left"),
]


def _wrong_names(folder: str) -> None:
    import torch
    from safetensors.torch import save_file

    config = json.loads(_hf_config())
    h, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    save_file({"wrong.embed.weight": torch.zeros(v, h), "wrong.mlp.weight": torch.zeros(f, h)},
              os.path.join(folder, "m", "model.safetensors"), metadata={"format": "pt"})


def _export_marker(folder: str) -> None:
    """out/ as an earlier `ballonet export` left it, with a stale pickled weights file."""
    import subprocess
    import sys

    from sweep import _env

    os.rmdir(os.path.join(folder, "out"))
    subprocess.run([sys.executable, "-m", "ballonet", *EXPORT], cwd=folder, env=_env(), check=True,
                   capture_output=True)
    with open(os.path.join(folder, "out", "pytorch_model.bin"), "wb") as f:
        f.write(b"stale")


ISSUE_47: list[Case] = CODE + OUTSIDE + HANG + TRACEBACK + SILENT + DISK
"""Issue 47's classes: every case ends within 20 s, under 1.5 GB."""
