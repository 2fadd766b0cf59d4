"""Hostile files: a crafted checkpoint never runs code, a crafted corpus never reads
outside its folder. Each refusal is one line naming the file and the field, exit 2,
and leaves no side effect (each payload would create a marker file)."""

import json
import os
import pickle
import shutil
import subprocess
import sys

import numpy as np
import pytest

import ballonet
from ballonet import cli
from ballonet.training.checkpoints import safe_dcp
from ballonet.training.data.corpus import from_prepared, load_corpus
from ballonet.training.loop import TrainConfig, train

TRAIN = ["train", "--steps", "3", "--global-tokens", "512", "--max-doc-tokens", "256"]
ITEMS = "every stored item"


def _short(text: str) -> bytes:
    data = text.encode()
    return pickle.SHORT_BINUNICODE + bytes([len(data)]) + data


def dotted_payload(command: str, protocol: int = 4) -> bytes:
    """The issue's pickle: a global naming DCP's own metadata module (allowed module-wide by
    the old unpickler) and the dotted name `os.system`, which resolves through that module's
    `os` attribute."""
    module, name = "torch.distributed.checkpoint.metadata", "os.system"
    if protocol >= 4:
        return (pickle.PROTO + bytes([protocol]) + _short(module) + _short(name) + pickle.STACK_GLOBAL
                + _short(command) + pickle.TUPLE1 + pickle.REDUCE + pickle.STOP)
    return (pickle.PROTO + bytes([protocol]) + pickle.GLOBAL + f"{module}\n{name}\n".encode()
            + pickle.BINUNICODE + len(command).to_bytes(4, "little") + command.encode()
            + pickle.TUPLE1 + pickle.REDUCE + pickle.STOP)


class _Payload:
    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def reduce_payload(command: str, protocol: int) -> bytes:
    return pickle.dumps(_Payload(command), protocol=protocol)


@pytest.fixture(scope="module")
def clean_checkpoint(tmp_path_factory):
    """A finished checkpoint of 2 steps (one process), copied afresh by each case."""
    folder = tmp_path_factory.mktemp("clean") / "ck"
    train(TrainConfig(model="tiny", global_tokens=512, max_doc_tokens=256, steps=2, checkpoint_dir=str(folder),
                      checkpoint_every=2))
    return folder


def _copy(clean, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(clean, ck)
    return ck, ck / "step-00000002"


def _resume(ck, capsys) -> tuple[int, list[str]]:
    code = cli.main([*TRAIN, "--checkpoint-dir", str(ck), "--resume"])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    return code, lines


def test_metadata_unpickler_refuses_the_dotted_global_and_plain_reduce(clean_checkpoint, tmp_path):
    marker = tmp_path / "pwned"
    ck, step = _copy(clean_checkpoint, tmp_path)
    command = f"touch {marker}"
    for payload in (dotted_payload(command, 4), dotted_payload(command, 2), reduce_payload(command, 2),
                    reduce_payload(command, 4)):
        (step / ".metadata").write_bytes(payload)
        with pytest.raises(ballonet.InputError, match=r"\.metadata: not a checkpoint's metadata") as e:
            safe_dcp.read_safe_metadata(step / ".metadata", step)
        assert "\n" not in str(e.value)
        assert not marker.exists(), payload


def test_a_payload_in_any_file_of_a_checkpoint_is_one_line_exit_2_and_runs_nothing(clean_checkpoint, tmp_path,
                                                                                    capsys):
    marker = tmp_path / "pwned"
    command = f"touch {marker}"
    step_files = sorted(p.name for p in clean_checkpoint.joinpath("step-00000002").iterdir())
    assert {".metadata", "ballonet.json"} < set(step_files) and any(n.endswith(".distcp") for n in step_files)
    planted = [(".metadata", p) for p in (dotted_payload(command, 4), dotted_payload(command, 2),
                                          reduce_payload(command, 2), reduce_payload(command, 4))]
    planted += [(name, dotted_payload(command)) for name in step_files if name != ".metadata"]
    planted += [(name, reduce_payload(command, 2)) for name in step_files if name != ".metadata"]
    planted += [("../latest", dotted_payload(command))]
    # In place of every stored item (where the metadata says it lies), the files' sizes kept.
    planted += [(ITEMS, dotted_payload(command)), (ITEMS, reduce_payload(command, 2))]
    for name, payload in planted:
        case = tmp_path / f"case{len(list(tmp_path.iterdir()))}"
        case.mkdir()
        ck, step = _copy(clean_checkpoint, case)
        if name == ITEMS:
            for info in safe_dcp.read_safe_metadata(step / ".metadata", step).storage_data.values():
                if info.length >= len(payload):
                    with open(step / info.relative_path, "r+b") as f:
                        f.seek(info.offset)
                        f.write(payload)
        else:
            (step / name).write_bytes(payload)
        code, lines = _resume(ck, capsys)
        assert code == 2 and len(lines) == 1 and lines[0].startswith("ballonet train: error: "), (name, lines)
        # named where it was found: the metadata (its own payload, or a data file it no longer fits), the
        # item torch.load refused, ballonet.json or latest
        where = {"ballonet.json": "ballonet.json", "../latest": "latest", ITEMS: "corrupt or foreign checkpoint"}
        assert where.get(name, ".metadata: not a checkpoint's metadata") in lines[0], (name, lines)
        assert not marker.exists(), name


def test_the_issue_reproduction_through_the_real_command_line(clean_checkpoint, tmp_path):
    """`ballonet train --resume` on a checkpoint whose `.metadata` is the dotted payload."""
    marker = tmp_path / "pwned"
    ck, step = _copy(clean_checkpoint, tmp_path)
    (step / ".metadata").write_bytes(dotted_payload(f"touch {marker}"))
    r = subprocess.run([sys.executable, "-m", "ballonet", *TRAIN, "--checkpoint-dir", str(ck), "--resume"],
                       capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=300,
                       check=False)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert ".metadata" in r.stderr and "Traceback" not in r.stderr
    assert not marker.exists()


def test_metadata_storage_items_stay_inside_the_checkpoint_folder(clean_checkpoint, tmp_path):
    ck, step = _copy(clean_checkpoint, tmp_path)
    metadata = safe_dcp.read_safe_metadata(step / ".metadata", step)  # the clean one loads
    clean = (step / ".metadata").read_bytes()
    outside = tmp_path / "outside.bin"
    shutil.copy(next(step.glob("*.distcp")), outside)
    (step / "link.distcp").symlink_to(outside)
    index = next(iter(metadata.storage_data))
    for field, value, message in (("relative_path", "../outside.bin", "not a file name inside"),
                                  ("relative_path", str(outside), "not a file name inside"),
                                  ("relative_path", "link.distcp", "not a file name inside"),
                                  ("relative_path", "absent.distcp", "missing"),
                                  ("offset", 10**12, "outside"), ("length", -1, "outside")):
        bad = pickle.loads(clean)  # our own file
        setattr(bad.storage_data[index], field, value)
        (step / ".metadata").write_bytes(pickle.dumps(bad, protocol=2))
        with pytest.raises(ballonet.InputError, match=message):
            safe_dcp.read_safe_metadata(step / ".metadata", step)


@pytest.mark.timeout(120)  # a hang guard (0.84 s alone for all 8 cases): an offset of 1e12 once hung the loader
def test_checkpoint_fields_are_checked_before_anything_is_loaded(clean_checkpoint, tmp_path, capsys):
    """A step of -3 resumed at step -2; a loader offset of 1e12 hung the loader."""
    ck, step = _copy(clean_checkpoint, tmp_path)
    clean = json.loads((step / "ballonet.json").read_text())
    length = load_corpus("stdlib").lengths
    cases = [({"step": -3}, "field 'step' must be an integer from 1 to 9007199254740992, got -3"),
             ({"step": 2.5}, "field 'step'"),
             ({"world_size": 0}, "field 'world_size'"),
             ({"rng": [7]}, "field 'rng'"),
             ({"loader": dict(clean["loader"], offset=10**12)}, "loader state: offset 1000000000000"),
             ({"loader": dict(clean["loader"], offset=-1)}, "field 'loader.offset'"),
             ({"loader": dict(clean["loader"], position=len(length) + 5)}, "loader state: position"),
             ({"format": "ballonet-dcp-1"}, "earlier Ballonet")]
    for change, message in cases:
        (step / "ballonet.json").write_text(json.dumps({**clean, **change}))
        code, lines = _resume(ck, capsys)
        assert code == 2 and len(lines) == 1 and message in lines[0], (change, lines)


# ---- prepared corpora --------------------------------------------------------------------


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    from ballonet.training.data.prepare import PrepareConfig, prepare

    root = tmp_path_factory.mktemp("corpus")
    data = root / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": f"document {i} " + "abc" * (i + 3)}) + "\n" for i in range(6)))
    prepare(PrepareConfig(data=str(data), out=str(root / "clean")))
    return root / "clean"


def _corpus_copy(prepared, tmp_path):
    folder = tmp_path / "corpus"
    shutil.copytree(prepared, folder)
    return folder, json.loads((folder / "manifest.json").read_text())


def _edit(folder, manifest, **fields):
    (folder / "manifest.json").write_text(json.dumps({**manifest, **fields}))


def test_a_prepared_corpus_never_reads_outside_its_folder(prepared, tmp_path):
    """Shards named ../x.bin, /abs/x.bin or a symlink out were read and trained on."""
    folder, manifest = _corpus_copy(prepared, tmp_path)
    shard = folder / manifest["shards"][0]["file"]
    secret = tmp_path / "secret.bin"
    shutil.copy(shard, secret)  # the same size, so only the name can give it away
    (folder / "link.bin").symlink_to(secret)
    for name in ("../secret.bin", str(secret), "link.bin", "sub/tokens.bin", "..", ""):
        _edit(folder, manifest, shards=[{**manifest["shards"][0], "file": name}])
        with pytest.raises(ballonet.InputError, match=r"manifest\.json: field 'shards\[0\]\.file'") as e:
            from_prepared(folder)
        assert "\n" not in str(e.value)


def test_a_prepared_corpus_manifest_and_index_are_checked_field_by_field(prepared, tmp_path):
    folder, manifest = _corpus_copy(prepared, tmp_path)
    index = np.load(folder / "index.npy")
    largest = int(np.fromfile(folder / manifest["shards"][0]["file"], dtype=np.uint8).max())
    cases = [
        (dict(vocab_size=0), "field 'vocab_size'"),
        (dict(vocab_size=10), f"field 'vocab_size': 10, but token ids reach {largest}"),
        (dict(vocab_size=True), "field 'vocab_size'"),
        (dict(dtype="float32"), "field 'dtype'"),
        (dict(dtype="int8"), "field 'dtype'"),
        (dict(dtype="no-such-type"), "field 'dtype'"),
        (dict(shards="tokens-00000.bin"), "field 'shards'"),
        (dict(shards=[{"file": "tokens-00000.bin", "num_tokens": -5}]), "field 'shards[0].num_tokens'"),
        (dict(sources=[]), "field 'sources'"),
    ]
    for change, message in cases:
        _edit(folder, manifest, **change)
        with pytest.raises(ballonet.InputError, match="manifest.json") as e:
            from_prepared(folder)
        assert message in str(e.value) and "\n" not in str(e.value), (change, str(e.value))
    older = {k: v for k, v in manifest.items() if k != "max_token_id"}  # before prepare recorded it
    (folder / "manifest.json").write_text(json.dumps({**older, "vocab_size": 10}))
    with pytest.raises(ballonet.InputError, match=f"field 'vocab_size': 10, but token ids reach {largest}"):
        from_prepared(folder)
    _edit(folder, manifest)
    for column, value, message in ((1, int(index[-1, 1]) + 10**6, "column 1 (offset)"),
                                   (1, -1, "column 1 (offset)"),
                                   (0, 3, "column 0 (shard)"),
                                   (3, 9, "column 3 (source)")):
        bad = index.copy()
        bad[-1, column] = value
        np.save(folder / "index.npy", bad)
        with pytest.raises(ballonet.InputError, match="index.npy") as e:
            from_prepared(folder)
        assert message in str(e.value), str(e.value)
    (folder / "index.npy").write_bytes(b"")
    with pytest.raises(ballonet.InputError, match="index.npy"):
        from_prepared(folder)
    np.save(folder / "index.npy", index)
    from_prepared(folder)  # the clean corpus reads


def test_token_ids_above_the_vocabulary_are_refused_when_read(prepared, tmp_path):
    """A manifest claiming a smaller largest id than its shards hold: the read that meets
    the id says so (file and document), no IndexError in the embedding."""
    folder, manifest = _corpus_copy(prepared, tmp_path)
    shard = folder / manifest["shards"][0]["file"]
    data = bytearray(shard.read_bytes())
    data[0] = 250
    shard.write_bytes(bytes(data))
    _edit(folder, manifest, vocab_size=128, max_token_id=120)
    corpus = from_prepared(folder)
    with pytest.raises(ballonet.InputError, match=r"tokens-00000\.bin: token id 250 .* vocab_size 128"):
        corpus.tokens(0)


def test_training_on_a_traversing_corpus_exits_2_with_one_line(prepared, tmp_path, capsys):
    folder, manifest = _corpus_copy(prepared, tmp_path)
    shutil.copy(folder / manifest["shards"][0]["file"], tmp_path / "x.bin")
    _edit(folder, manifest, shards=[{**manifest["shards"][0], "file": "../x.bin"}])
    code = cli.main(["train", "--steps", "1", "--global-tokens", "64", "--corpus", str(folder)])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "shards[0].file" in lines[0], lines


def test_the_allow_list_is_exact_classes_never_a_module():
    assert all(isinstance(c, type) for c in safe_dcp.SAFE_GLOBALS)
