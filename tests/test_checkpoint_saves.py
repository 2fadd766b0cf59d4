"""Saves that count when written and fail in words (issues 47.7, 50.2).

A full disk during a save, synchronous or in the background: one line saying the disk is
full, at the step boundary after the failure (not when training ends), no `.tmp-` folder
left, `latest` still naming the last complete checkpoint. The full disk is made two ways:
simulated (DCP's storage writer raises ENOSPC for the second save: runs everywhere), and a
real one, a 2 MiB tmpfs (only where this process may mount one: root; skipped elsewhere,
and the simulated case stands). An async save is published as soon as every rank has
written it: a run killed two steps after one began resumes from it; `--resume-from STEP`
picks an older one.
"""

import errno
import json
import os
import subprocess
import sys
from unittest import mock

import pytest

import ballonet
from ballonet.training.checkpoints import checkpoint, safe_dcp
from ballonet.training.config import TrainConfig
from ballonet.training.loop import train

BASE = dict(model="tiny", global_tokens=512, max_doc_tokens=256, keep_checkpoints=1)


def _every(async_checkpoint: bool) -> int:
    """Steps between saves: the second save fails. A background save's failure is found by
    the first poll after it is written, which a loaded machine may delay by a few steps;
    before the next save (which would wait for it) it must be."""
    return 6 if async_checkpoint else 2


def _full_disk_at(step: int):
    """SafeWriter.write_data raising ENOSPC for the checkpoint of `step` (in DCP's
    background thread too)."""
    write_data = safe_dcp.SafeWriter.write_data

    def failing(self, *args, **kwargs):
        if f"step-{step:08d}" in str(self.path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return write_data(self, *args, **kwargs)
    return mock.patch.object(safe_dcp.SafeWriter, "write_data", failing)


def _check_full_disk_run(ck, log, async_checkpoint: bool) -> None:
    every = _every(async_checkpoint)
    with pytest.raises(ballonet.InputError) as e:
        train(TrainConfig(**BASE, steps=3 * every + 2, checkpoint_every=every, checkpoint_dir=str(ck),
                          json_log=str(log), async_checkpoint=async_checkpoint))
    message = str(e.value)
    assert "\n" not in message and f"cannot write the checkpoint of step {2 * every}" in message, message
    assert "No space left on device" in message, message
    assert sorted(os.listdir(ck)) == ["config.toml", "latest", f"step-{every:08d}"]  # no .tmp- folder
    assert (ck / "latest").read_text() == f"step-{every:08d}"
    steps = [json.loads(line)["step"] for line in log.read_text().splitlines()]
    assert steps[-1] < 3 * every, steps  # said before the next save began, not at it nor after the last step


@pytest.mark.parametrize("async_checkpoint", [False, True], ids=["sync", "async"])
def test_a_full_disk_is_one_line_promptly_and_leaves_the_last_checkpoint(tmp_path, async_checkpoint):
    with _full_disk_at(2 * _every(async_checkpoint)):
        _check_full_disk_run(tmp_path / "ck", tmp_path / "log.jsonl", async_checkpoint)


def _mount_tmpfs(folder, size: str) -> bool:
    if os.geteuid() != 0:
        return False
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True,
                       check=False)
    return r.returncode == 0


def test_a_real_full_disk_on_a_tmpfs(tmp_path, monkeypatch):
    """A checkpoint of the tiny model takes 1.7 MiB: on 2 MiB the second cannot be written
    while the first is kept. The free-space check before training is what would refuse
    this folder first; it is switched off to reach the save."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if not _mount_tmpfs(disk, "2m"):
        pytest.skip("cannot mount a tmpfs here (not root, or not allowed); the simulated full disk stands")
    monkeypatch.setattr(checkpoint, "check_folder", lambda *args, **kwargs: None)
    try:
        for async_checkpoint in (False, True):
            ck = disk / f"ck{int(async_checkpoint)}"
            _check_full_disk_run(ck, tmp_path / f"log{int(async_checkpoint)}.jsonl", async_checkpoint)
            subprocess.run(["rm", "-rf", str(ck)], check=True)
    finally:
        subprocess.run(["umount", str(disk)], check=False)


def test_an_async_save_counts_as_soon_as_written_and_resume_from_picks_a_step(tmp_path, capsys):
    """Killed (SIGKILL, `BALLONET_FAULT`) as step 6 begins, two steps after the async save
    of step 3 began: `latest` names step 3 (it named nothing before: the save was published
    only when the next one began), and --resume goes on from it; --resume-from 3 after a
    finished run of 6 steps resumes from step 3 too; a step with no checkpoint is one line."""
    from ballonet import cli

    ck, log = tmp_path / "ck", tmp_path / "log.jsonl"
    # Steps of 4096 tokens (~0.5 s each here): the tiny model's save is written within one.
    args = ["train", "--global-tokens", "4096", "--max-doc-tokens", "1024", "--steps", "6", "--checkpoint-every", "3",
            "--checkpoint-dir", str(ck), "--async-checkpoint", "--json-log", str(log)]
    env = dict(os.environ, OMP_NUM_THREADS="1", BALLONET_FAULT="6:0")
    killed = subprocess.run([sys.executable, "-m", "ballonet", *args], env=env, capture_output=True, text=True,
                            timeout=300, check=False)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert (ck / "latest").read_text() == "step-00000003"
    assert cli.main([*args, "--resume"]) == 0
    assert "resumed from step 3" in capsys.readouterr().out
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [1, 2, 3, 4, 5, 6]
    assert (ck / "latest").read_text() == "step-00000006"
    assert cli.main([*args, "--resume-from", "3"]) == 0
    assert "resumed from step 3" in capsys.readouterr().out
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [1, 2, 3, 4, 5, 6]
    assert cli.main([*args, "--resume-from", "5"]) == 2
    assert "holds no complete checkpoint of that step" in capsys.readouterr().err
