"""Failures that come late or from outside (a disk that fills, a rank that dies, a loss
that turns NaN) are one line with the right exit code, and leave nothing half-written.
The command-line classes of issue 33 run in-process in `test_fuzz.py` (from
`bench/sweep_cases.py`); hostile files are `test_security.py`'s."""

import errno
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

import ballonet
from ballonet import cli, paths
from ballonet.training.checkpoints import checkpoint


def _full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_write_that_fails_is_one_line_naming_the_file_and_leaves_nothing(tmp_path):
    target = tmp_path / "out.json"

    def write(tmp):
        with open(tmp, "w") as f:
            f.write("partial")
        _full()

    with pytest.raises(ballonet.InputError, match=r"out\.json: cannot write \(No space left on device\)"):
        paths.write_atomic(str(target), write)
    assert list(tmp_path.iterdir()) == []


def test_outputs_are_checked_for_kind_and_room_before_any_work(tmp_path, monkeypatch):
    fifo = tmp_path / "p.fifo"
    os.mkfifo(fifo)
    with pytest.raises(ballonet.InputError, match="not a regular file"):
        paths.check_output(str(fifo), "--out")
    fifo.unlink()
    monkeypatch.setattr(paths.shutil, "disk_usage", lambda p: SimpleNamespace(free=4096))
    with pytest.raises(ballonet.InputError, match=r"--out .*p\.json: 0\.0 MiB free on its disk, 1\.0 MiB needed"):
        paths.check_output(str(tmp_path / "p.json"), "--out", min_free_bytes=1 << 20)
    with pytest.raises(ballonet.InputError, match="checkpoints of this model need"):
        checkpoint.check_folder(str(tmp_path / "ck"), num_params=10**6)


def test_a_checkpoint_save_on_a_full_disk_is_one_line_and_keeps_the_last_one(tmp_path, monkeypatch):
    from ballonet.training.loop import TrainConfig, train

    ck = tmp_path / "ck"
    train(TrainConfig(model="tiny", global_tokens=512, steps=1, checkpoint_dir=str(ck), checkpoint_every=1))
    monkeypatch.setattr(checkpoint.dcp, "save", _full)
    with pytest.raises(ballonet.InputError, match="cannot write the checkpoint of step 2 .*No space left") as e:
        train(TrainConfig(model="tiny", global_tokens=512, steps=2, checkpoint_dir=str(ck), checkpoint_every=1,
                          resume=True))
    assert "\n" not in str(e.value)
    assert sorted(os.listdir(ck)) == ["config.toml", "latest", "step-00000001"]  # no .tmp-step-00000002 left


def test_prepare_on_a_disk_that_fills_leaves_no_folder(tmp_path, monkeypatch):
    from ballonet.training.data import prepare

    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "hello"}\n')
    monkeypatch.setattr(prepare.np, "save", _full)
    with pytest.raises(ballonet.InputError, match=r"--out .*c: cannot write \(No space left on device\)"):
        prepare.prepare(prepare.PrepareConfig(data=str(data), out=str(tmp_path / "c")))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.jsonl"]


def test_a_loss_that_turns_nan_stops_training_naming_the_step(tmp_path, capsys):
    log = tmp_path / "log.jsonl"
    code = cli.main(["train", "--steps", "4", "--global-tokens", "512", "--lr", "1e30", "--json-log", str(log)])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "step 2: the loss is nan" in lines[0], lines
    assert len(log.read_text().splitlines()) == 1  # step 1 logged, the NaN step not


@pytest.mark.slow
def test_a_dead_rank_is_named_by_the_launcher_with_exit_1():
    r = subprocess.run([sys.executable, "-m", "ballonet", "train", "--nproc", "2", "--steps", "4", "--global-tokens",
                        "512"], capture_output=True, text=True, timeout=300, check=False,
                       env=dict(os.environ, OMP_NUM_THREADS="1", BALLONET_FAULT="2:1"))
    assert r.returncode == 1, r.stderr
    assert r.stderr.strip() == "ballonet train: error: rank 1 died (signal 9); the others stopped", r.stderr
