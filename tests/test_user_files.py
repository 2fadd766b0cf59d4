"""The one door for files a user names (issue 47, `ballonet.user_files`): every reader
refuses a FIFO, a device, a symlink out of its folder, deep nesting and huge integers in
one line naming the file, promptly; no code from a model folder; a `.metadata` asking for
a large allocation is refused before anything is allocated."""

import contextlib
import io
import json
import os
import pickle
import resource
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

from ballonet import cli, specs, user_files, workloads
from ballonet.calibration import profile
from ballonet.cost.profiles import PROFILES
from ballonet.errors import InputError
from ballonet.integrations import hf_model
from ballonet.training.checkpoints import folder as checkpoint_folder, safe_dcp
from ballonet.training.data import prepare
from ballonet.training.config_file import read_config_file
from ballonet.training.data.corpus import from_prepared, from_text_dir, load_corpus
from ballonet.training.loop import TrainConfig, train

HF_CONFIG = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
             "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256}


@contextlib.contextmanager
def deadline(seconds: int = 20):
    """A hang guard (a refusal takes milliseconds; 20 s is far beyond a loaded machine's)."""
    def stop(*_):
        raise TimeoutError(f"no answer within {seconds} s")
    previous = signal.signal(signal.SIGALRM, stop)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def refused(read, match: str | None = None, case: str = "") -> str:
    with deadline(), pytest.raises(InputError, match=match) as e:
        read()
        pytest.fail(f"{case}: not refused")
    assert "\n" not in str(e.value) and "Traceback" not in str(e.value)
    return str(e.value)


# ---- the folders, made once -------------------------------------------------------------


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A clean checkpoint, prepared corpus, text corpus, HF folder and tokenizer folder."""
    root = tmp_path_factory.mktemp("clean")
    train(TrainConfig(model="tiny", global_tokens=256, max_doc_tokens=128, steps=1, checkpoint_dir=str(root / "ck"),
                      checkpoint_every=1))
    data = root / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": f"document {i} " + "abc" * (i + 3)}) + "\n" for i in range(6)))
    prepare.prepare(prepare.PrepareConfig(data=str(data), out=str(root / "corpus")))
    (root / "texts").mkdir()
    for i in range(3):
        (root / "texts" / f"{i}.txt").write_text(f"text {i}")
    (root / "hf").mkdir()
    (root / "hf" / "config.json").write_text(json.dumps(HF_CONFIG))
    (root / "tok").mkdir()
    (root / "tok" / "tokenizer.json").write_text(_tokenizer_json())
    return root


def _tokenizer_json() -> str:
    from tokenizers import Tokenizer, models

    return Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).to_str()


@pytest.fixture
def folders(base, tmp_path):
    shutil.copytree(base, tmp_path / "f", symlinks=True)
    return tmp_path / "f"


def _step(f):
    return f / "ck" / "step-00000001"


# Each kind of folder and the file in it a reader reads: (folder, file, read(folder)).
FOLDER_FILES = {
    "checkpoint latest": ("ck", "latest", lambda f: checkpoint_folder.latest(str(f / "ck"))),
    "checkpoint ballonet.json": ("ck/step-00000001", "ballonet.json", lambda f: checkpoint_folder.read_meta(str(_step(f)))),
    "checkpoint .metadata": ("ck/step-00000001", ".metadata",
                             lambda f: safe_dcp.read_safe_metadata(str(_step(f) / ".metadata"), str(_step(f)))),
    "prepared manifest.json": ("corpus", "manifest.json", lambda f: from_prepared(f / "corpus")),
    "prepared index.npy": ("corpus", "index.npy", lambda f: from_prepared(f / "corpus")),
    "prepared shard": ("corpus", "tokens-00000.bin", lambda f: from_prepared(f / "corpus")),
    "text corpus file": ("texts", "1.txt", lambda f: from_text_dir(f / "texts")),
    "prepare's input folder": ("texts", "1.txt", lambda f: list(prepare.text_batches(str(f / "texts"), "text", 8))),
    "HF config.json": ("hf", "config.json", lambda f: hf_model.model_spec(f"hf:{f / 'hf'}")),
    "HF model.safetensors": ("hf", "model.safetensors", lambda f: hf_model.model_spec(f"hf:{f / 'hf'}")),
    "tokenizer folder": ("tok", "tokenizer.json", lambda f: prepare.load_tokenizer(str(f / "tok"))),
}


def test_every_folder_reads_clean(folders):
    for folder, name, read in FOLDER_FILES.values():
        read(folders)


@pytest.mark.parametrize("kind", ["fifo", "link out", "dangling link", "looping link", "folder"])
def test_each_kind_of_folder_refuses_a_file_that_is_not_a_regular_file_inside_it(folders, kind):
    outside = folders.parent / "outside"
    outside.mkdir()
    for case, (folder, name, read) in FOLDER_FILES.items():
        if kind == "folder" and folder == "texts":
            continue  # a subfolder of a text corpus holds more documents
        path = folders / folder / name
        keep = outside / f"{case}.keep"
        if os.path.lexists(path):
            os.replace(path, keep)
        if kind == "fifo":
            os.mkfifo(path)
        elif kind == "link out":
            shutil.copyfile(keep, outside / name) if keep.exists() else (outside / name).write_bytes(b"x")
            os.symlink(outside / name, path)
        elif kind == "dangling link":
            os.symlink(outside / "nothing", path)
        elif kind == "looping link":
            os.symlink(path, path)
        else:
            path.mkdir()
        message = refused(lambda: read(folders), case=case)
        assert name in message or case.startswith("checkpoint latest"), (case, message)
        path.rmdir() if kind == "folder" else os.remove(path)
        if keep.exists():
            os.replace(keep, path)
    assert not (folders / "PWNED").exists()


def test_a_step_folder_linked_from_outside_the_checkpoint_folder_is_refused(folders):
    step = _step(folders)
    moved = folders.parent / "elsewhere"
    shutil.move(step, moved)
    os.symlink(moved, step)
    refused(lambda: checkpoint_folder.latest(str(folders / "ck")), "symbolic link out of")


# ---- a file the user names: every reader ------------------------------------------------

PROFILE = json.loads(PROFILES["h100"].to_json())
# (file name, read(path)): each reader of a file named on the command line.
NAMED = {
    "lengths .txt": ("l.txt", workloads.load_lengths),
    "lengths .json": ("l.json", workloads.load_lengths),
    "lengths .npy": ("l.npy", workloads.load_lengths),
    "lengths .jsonl": ("l.jsonl", workloads.load_lengths),
    "corpus .jsonl": ("c.jsonl", load_corpus),
    "cluster TOML": ("c.toml", specs.cluster_from_toml),
    "model TOML": ("m.toml", specs.model_from_toml),
    "--config TOML": ("run.toml", lambda path: read_config_file(path, TrainConfig)),
    "--calibration": ("p.json", profile.load),
    "prepare --data .jsonl": ("d.jsonl", lambda p: list(prepare.text_batches(p, "text", 8))),
    "prepare --tokenizer": ("tokenizer.json", prepare.load_tokenizer),
}


@pytest.mark.parametrize("kind", ["fifo", "/dev/zero", "folder"])
def test_every_named_file_refuses_a_fifo_a_device_and_a_folder_promptly(tmp_path, kind):
    for case, (name, read) in NAMED.items():
        path = tmp_path / name
        if kind == "fifo":
            os.mkfifo(path)
        elif kind == "/dev/zero":
            os.symlink("/dev/zero", path)
        else:
            path.mkdir()
        message = refused(lambda: read(str(path)), case=case)
        assert str(path) in message, (case, message)
        path.rmdir() if kind == "folder" else os.remove(path)


DEEP_JSON, BIG_JSON = "[" * 100_000 + "]" * 100_000, "[" + "7" * 5000 + "]"
JSON_READERS = {
    "lengths .json": lambda t, p: (p / "l.json", lambda f: workloads.load_lengths(str(f)), t),
    "lengths .jsonl": lambda t, p: (p / "l.jsonl", lambda f: workloads.load_lengths(str(f)), '{"length": %s}' % t),
    "corpus .jsonl": lambda t, p: (p / "c.jsonl", lambda f: load_corpus(str(f)), '{"input_ids": %s}' % t),
    "profile": lambda t, p: (p / "p.json", lambda f: profile.load(str(f)), json.dumps(PROFILE)[:-1] + ', "machine": {"x": %s}}' % t),
    "HF config.json": lambda t, p: (p / "config.json", lambda f: hf_model.model_spec(f"hf:{f.parent}"),
                                    '{"vocab_size": %s}' % t),
    "manifest.json": lambda t, p: (p / "manifest.json", lambda f: from_prepared(f.parent), '{"shards": %s}' % t),
    "prepare .jsonl": lambda t, p: (p / "d.jsonl", lambda f: list(prepare.text_batches(str(f), "text", 8)),
                                    '{"text": %s}' % t),
}
TOML_READERS = {"cluster": specs.cluster_from_toml, "model": specs.model_from_toml, "--config": lambda path: read_config_file(path, TrainConfig)}


@pytest.mark.parametrize("text", [DEEP_JSON, BIG_JSON, "[1e999]", "[NaN]", "[99999999999999999999]"],
                         ids=["deep", "5000 digits", "1e999", "NaN", "over int64"])
def test_json_readers_bound_nesting_digits_and_range(tmp_path, text):
    for case, make in JSON_READERS.items():
        path, read, content = make(text, tmp_path)
        path.write_text(content)
        message = refused(lambda: read(path), case=case)
        assert str(path) in message and ("deep" in message or "digit" in message or "int64" in message
                                         or "finite" in message or "NaN" in message), (case, message)
        path.unlink()


@pytest.mark.parametrize("text", ["x = " + "[" * 5000 + "]" * 5000, "x = " + "7" * 5000, "x = inf", "x = nan",
                                  "x = 99999999999999999999"],
                         ids=["deep", "5000 digits", "inf", "nan", "over int64"])
def test_toml_readers_bound_nesting_digits_and_range(tmp_path, text):
    path = tmp_path / "f.toml"
    path.write_text(text + "\n")
    for case, read in TOML_READERS.items():
        message = refused(lambda: read(str(path)), case=case)
        assert str(path) in message, (case, message)


def test_a_size_cap_is_checked_before_reading(tmp_path, monkeypatch):
    path = tmp_path / "c.toml"
    with open(path, "wb") as f:
        f.truncate(user_files.LIMITS["toml"] + 1)  # sparse: nothing is written
    refused(lambda: specs.cluster_from_toml(str(path)), "over the")


# ---- code and allocations ----------------------------------------------------------------


def test_a_metadata_asking_for_3_gb_is_refused_before_anything_is_allocated(tmp_path):
    path = tmp_path / ".metadata"
    path.write_bytes(b"\x80\x02c__builtin__\nbytearray\nJ\x00^\xd0\xb2\x85R.")  # bytearray(3e9), 40 bytes
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    refused(lambda: safe_dcp.read_safe_metadata(str(path), str(tmp_path)), "bytearray")
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100_000  # KiB: nothing near 3 GB


def test_a_checkpoint_item_naming_a_global_is_refused_before_torch_load():
    plain, hostile = io.BytesIO(), io.BytesIO()
    torch.save({"lr": 0.1, "betas": (0.9, 0.95), "params": [0, 1]}, plain)
    torch.save(bytearray(8), hostile)
    plain.seek(0)
    hostile.seek(0)
    safe_dcp._check_plain_item(plain, "optimizer.param_groups")
    with pytest.raises(pickle.UnpicklingError, match="not a plain value"):
        safe_dcp._check_plain_item(hostile, "optimizer.param_groups")


def test_a_custom_code_model_folder_never_runs_even_with_y_on_stdin(tmp_path):
    folder = tmp_path / "custom"
    folder.mkdir()
    config = {**HF_CONFIG, "model_type": "pwned-model",
              "auto_map": {"AutoConfig": "pwn.Config", "AutoModelForCausalLM": "pwn.Model"}}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "pwn.py").write_text("import pathlib\npathlib.Path(__file__).with_name('PWNED').touch()\n")
    r = subprocess.run([sys.executable, "-m", "ballonet", "train", "--model", f"hf:{folder}", "--steps", "1",
                        "--global-tokens", "256"], input="y\ny\n", capture_output=True, text=True, cwd=tmp_path, check=False,
                       timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "auto_map" in lines[0], r.stderr
    assert not (folder / "PWNED").exists() and not (tmp_path / "PWNED").exists()


def test_transformers_is_never_asked_to_trust_code(tmp_path, monkeypatch):
    """Past the auto_map check (a folder with only a .py beside an unknown model_type),
    transformers refuses without a prompt: trust_remote_code=False and stdin empty."""
    pytest.importorskip("transformers")
    folder = tmp_path / "odd"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**HF_CONFIG, "model_type": "pwned-model"}))
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n"))
    refused(lambda: hf_model.build_model(f"hf:{folder}", 0, torch.device("cpu")), "transformers cannot read it")


# ---- end to end: one line, exit 2 --------------------------------------------------------


def test_the_command_line_says_one_line_and_exits_2(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    os.mkfifo("fifo.toml")
    os.mkfifo("l.json")
    (tmp_path / "deep.json").write_text(DEEP_JSON)
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text("hello")
    os.symlink("/etc/hostname", tmp_path / "texts" / "b.txt")
    for argv in (["cost", "--length", "10", "--cluster", "fifo.toml"], ["plan", "--lengths", "l.json"],
                 ["plan", "--lengths", "deep.json"], ["train", "--corpus", "texts", "--steps", "1"],
                 ["prepare", "--data", "texts", "--out", "out"]):
        with deadline():
            assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "Traceback" not in err[0], (argv, err)
    assert not (tmp_path / "out").exists()


def test_a_npy_lengths_file_and_a_jsonl_length_are_bounded(tmp_path):
    from ballonet.training.data.corpus import SYNTHETIC_BLOCK

    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"length": 200_000_000}) + "\n")
    corpus = load_corpus(str(path))
    with deadline(5):
        part = corpus.tokens_range(0, 150_000_000, 150_000_010)
    assert len(part) == 10 and part.dtype == np.int64
    # the slice is the same tokens as the block it lies in, drawn whole
    assert np.array_equal(corpus.tokens_range(0, 0, SYNTHETIC_BLOCK + 5)[SYNTHETIC_BLOCK:],
                          corpus.tokens_range(0, SYNTHETIC_BLOCK, SYNTHETIC_BLOCK + 5))


def test_a_npy_header_is_checked_against_the_file_before_numpy_allocates(tmp_path):
    from numpy.lib import format as npy

    for shape, descr, match in (((10**12,), "<i8", "header says"), ((1,), "|O", "Python objects")):
        path = tmp_path / "l.npy"
        with open(path, "wb") as f:
            npy.write_array_header_1_0(f, {"descr": descr, "fortran_order": False, "shape": shape})
            f.write(b"\0" * 16)
        refused(lambda: workloads.load_lengths(str(path)), match)


def test_an_integer_flag_over_int64_is_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["simulate", "--planners", "zeppelin", "--max-length", "9" * 30])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "below 2^63" in err[0], err
