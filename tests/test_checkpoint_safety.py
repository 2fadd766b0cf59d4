"""Crafted checkpoints (issue 47.3): every tensor of DCP's `.metadata` checked against the
model the run builds (or the one `ballonet.json` records, for export) before anything is
allocated; `ballonet.json`'s fields typed and bounded; a far step refused in one line. Each
case through the command line: exit 2, one line naming the file, nothing written."""

import base64
import io
import json
import pickle
import resource
import shutil
import zipfile

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

from ballonet import cli
from ballonet.training.config import TrainConfig
from ballonet.training.loop import train

pytest.importorskip("transformers")

TRAIN = ["train", "--steps", "3", "--global-tokens", "512", "--max-doc-tokens", "256"]
EMBED = "model.embed.weight"


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    folder = tmp_path_factory.mktemp("clean") / "ck"
    train(TrainConfig(model="tiny", global_tokens=512, max_doc_tokens=256, steps=2, checkpoint_dir=str(folder)))
    return folder


def _copy(clean, tmp_path, name):
    ck = tmp_path / name
    shutil.copytree(clean, ck)
    return ck, ck / "step-00000002"


def _metadata(step):
    return pickle.loads((step / ".metadata").read_bytes())  # our own clean file


def _craft(change):
    def apply(step):
        md = _metadata(step)
        change(md)
        (step / ".metadata").write_bytes(pickle.dumps(md, protocol=2))
    return apply


def _set(field, value):
    return _craft(lambda md: setattr(md.state_dict_metadata[EMBED], field, value))


def _swap(md):
    keys = {k.fqn: k for k in md.storage_data}
    a, b = keys[EMBED], keys["model.norm.weight"]
    md.storage_data[a], md.storage_data[b] = md.storage_data[b], md.storage_data[a]


def _chunk(offsets, sizes):
    return ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))


def _properties(dtype):
    def change(md):
        md.state_dict_metadata[EMBED].properties.dtype = dtype
    return _craft(change)


def _raw(data: bytes):
    def apply(step):
        (step / ".metadata").write_bytes(data)
    return apply


def _meta(**fields):
    def apply(step):
        meta = json.loads((step / "ballonet.json").read_text())
        for key, value in fields.items():
            if key.startswith("model_"):
                meta["model"][key[len("model_"):]] = value
            else:
                meta[key] = value
        (step / "ballonet.json").write_text(json.dumps(meta))
    return apply


BYTEARRAY = (pickle.PROTO + bytes([2]) + pickle.GLOBAL + b"builtins\nbytearray\n" + pickle.BININT
             + (2**31 - 1).to_bytes(4, "little") + pickle.TUPLE1 + pickle.REDUCE + pickle.STOP)
"""The issue's 40-byte `.metadata`: `bytearray(2**31 - 1)` (the issue: 3e9), which torch's weights-only unpickler runs."""


def _stored_item(pickled: bytes, pad: int = 70_000):
    """The embedding's stored item replaced by `torch.save`'s zip of a tensor with its pickle
    swapped for `pickled` (padded past the item's size), appended to the data file."""
    def apply(step):
        saved = io.BytesIO()
        torch.save(torch.zeros(4), saved)
        with zipfile.ZipFile(saved) as src, zipfile.ZipFile(blob := io.BytesIO(), "w") as out:
            for info in src.infolist():
                out.writestr(info.filename, pickled if info.filename.endswith("data.pkl") else src.read(info))
            out.writestr(src.infolist()[0].filename.split("/")[0] + "/pad", bytes(pad))
        data = next(step.glob("*.distcp"))
        offset = data.stat().st_size
        data.write_bytes(data.read_bytes() + blob.getvalue())
        md = _metadata(step)
        for index, info in md.storage_data.items():
            if index.fqn == EMBED:
                md.storage_data[index] = _StorageInfo(info.relative_path, offset, len(blob.getvalue()))
        (step / ".metadata").write_bytes(pickle.dumps(md, protocol=2))
    return apply


def _transformed(md):
    index = next(i for i in md.storage_data if i.fqn == EMBED)
    md.storage_data[index].transform_descriptors = ["stream.zstd"]

CASES = [
    ("sizes as strings", _set("size", ("256", "64")), "has size"),
    ("a negative size", _set("size", torch.Size([-1, 64])), "has size"),
    ("a size of 1e12", _set("size", torch.Size([10**12, 64])), "has size"),
    ("qint8", _properties(torch.qint8), "calls 'torch qint8'"),
    ("a bool embedding", _properties(torch.bool), "calls 'torch bool'"),
    ("a float16 lie", _properties(torch.float16), "torch.float16 [256, 64] in the checkpoint, torch.float32"),
    ("an empty chunk list", _set("chunks", []), "has no chunks"),
    ("overlapping chunks", _set("chunks", [_chunk([0, 0], [256, 64]), _chunk([0, 0], [128, 64])]), "overlapping"),
    ("a half-covered tensor", _set("chunks", [_chunk([0, 0], [128, 64])]), "hold 8192 of its 16384"),
    ("a chunk offset out of range", _set("chunks", [_chunk([1, 0], [256, 64])]), "outside its size"),
    ("swapped storage", _craft(_swap), "too few stored bytes"),
    ("bytearray(3e9)", _raw(BYTEARRAY), "calls 'builtins bytearray'"),
    ("a tensor of another model", _craft(lambda md: md.state_dict_metadata.pop("model.norm.weight")),
     "no tensor 'model.norm.weight'"),
    # torch's weights-only unpickler runs bytearray(2**31 - 1): 2.3 GB, then an export traceback
    ("a stored tensor calling bytearray(2**31 - 1)", _stored_item(BYTEARRAY), "calls 'builtins bytearray'"),
    ("a stored item compressed (zstd)", _craft(_transformed), "stored through transforms ['stream.zstd']"),
]
EXPORT_ONLY = [
    ("a negative vocab_size", _meta(model_vocab_size=-5), "field 'model.vocab_size'"),
    ("a string hidden", _meta(model_hidden="64"), "field 'model.hidden'"),
    ("another shape recorded", _meta(model_num_layers=3), "no tensor 'model.layers.2"),
]


def _one_line(capsys) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    return lines[0]


def test_crafted_checkpoints_are_refused_by_export_before_anything_is_allocated(clean, tmp_path, capsys):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for i, (what, craft, message) in enumerate(CASES + EXPORT_ONLY):
        ck, step = _copy(clean, tmp_path, f"ck{i}")
        craft(step)
        out = tmp_path / f"out{i}"
        assert cli.main(["export", "--checkpoint", str(ck), "--out", str(out)]) == 2, what
        line = _one_line(capsys)
        assert message in line and str(ck) in line, (what, line)
        assert not out.exists() and not list(tmp_path.glob(".out*")), what  # nothing written, no temporary folder
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before  # KiB on Linux
    assert grown < 500 * 1024, f"the refusals allocated {grown} KiB"  # bytearray(3e9) would be 2.9e6 KiB


def test_crafted_checkpoints_and_a_far_step_are_refused_on_resume(clean, tmp_path, capsys):
    """Through `ballonet train --resume` (3 steps), a few of the cases above, and the far
    step: 1e12 in `ballonet.json` (it hung, stepping the LR scheduler) and a step past
    --steps (it trained nothing, exit 0)."""
    cases = [CASES[2], CASES[6], CASES[11], CASES[12],
             ("a step of 1e12", _meta(step=10**12), "at step 1000000000000, past --steps 3"),
             ("a step past --steps", _meta(step=4), "at step 4, past --steps 3"),
             ("an RNG state torch refuses", _meta(rng=[base64.b64encode(bytes([255]) * 5056).decode()]),
              "field 'rng' holds no RNG state torch takes (Invalid mt19937 state)")]
    for i, (what, craft, message) in enumerate(cases):
        ck, step = _copy(clean, tmp_path, f"ck{i}")
        craft(step)
        assert cli.main([*TRAIN, "--checkpoint-dir", str(ck), "--resume"]) == 2, what
        line = _one_line(capsys)
        assert message in line and "Traceback" not in line, (what, line)
        assert sorted(p.name for p in ck.iterdir()) == ["config.toml", "latest", "step-00000002"], what
