"""What a run writes besides checkpoints (issues 47.4, 50.5): the JSON log is appended to
only when it is this run's (from the flags or a --config file, fresh or on --resume),
every record carries time, step_time_s and eta_s, the printed line says step N/total,
elapsed and time left, --profile-steps writes a torch.profiler trace, and --wandb
without its package is one line. One process, tiny runs of a few steps."""

import datetime
import json

import pytest

from ballonet import cli

RUN = ["train", "--steps", "3", "--global-tokens", "512", "--max-doc-tokens", "256"]


def _err_line(capsys) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    return lines[0]


def test_the_json_log_is_only_this_runs_and_its_records_say_when(tmp_path, capsys):
    log, ck = tmp_path / "log.jsonl", tmp_path / "ck"
    assert cli.main([*RUN, "--json-log", str(log), "--checkpoint-dir", str(ck), "--checkpoint-every", "2",
                     "--profile-steps", "2:3"]) == 0
    out = capsys.readouterr().out
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert datetime.datetime.fromisoformat(r["time"]).tzinfo is not None
        assert r["step_time_s"] > 0 and r["eta_s"] >= 0
    assert records[-1]["eta_s"] == 0 and records[0]["eta_s"] > 0
    assert "step 1/3  elapsed 0:00:" in out and "  left 0:00:" in out
    trace = json.loads((tmp_path / "profile-steps-2-3.json").read_text())  # beside the log
    assert trace["traceEvents"]

    # Resumed from step 2 with more steps: the same run, its log cut back to step 2 and appended to.
    assert cli.main([*RUN, "--steps", "4", "--json-log", str(log), "--checkpoint-dir", str(ck), "--resume-from",
                     "2"]) == 0
    capsys.readouterr()
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [1, 2, 3, 4]

    # Files that are not this run's log: refused in one line, left as they were (from a --config file too).
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    other_run = tmp_path / "other.jsonl"
    other_run.write_text(log.read_text())
    config = tmp_path / "run.toml"
    config.write_text(f'json_log = "{notes}"\n')
    for argv, path in [(["--json-log", str(notes)], notes), (["--config", str(config)], notes),
                       (["--json-log", str(other_run), "--lr", "1e-3"], other_run),
                       (["--json-log", str(other_run), "--checkpoint-dir", str(ck), "--resume", "--steps", "5",
                         "--seed", "9"], other_run)]:
        before = path.read_text()
        assert cli.main([*RUN, *argv]) == 2, argv
        assert "is not the JSON log of this run" in _err_line(capsys)
        assert path.read_text() == before


def test_wandb_without_its_package_is_one_line(tmp_path, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    assert cli.main([*RUN, "--wandb", "proj"]) == 2
    assert "--wandb needs the wandb package (pip install 'ballonet[wandb]')" in _err_line(capsys)


@pytest.mark.parametrize("flag", ["--json-log"])
def test_a_log_that_is_a_symlink_is_refused(tmp_path, capsys, flag):
    target = tmp_path / "target.jsonl"
    target.write_text("")
    link = tmp_path / "link.jsonl"
    link.symlink_to(target)
    assert cli.main([*RUN, flag, str(link)]) == 2
    _err_line(capsys)


def test_two_ranks_started_with_different_lr_fail_together_before_the_first_step(tmp_path):
    """Issue 47.5: two ranks started by hand (torchrun's environment, no launcher), one
    with another --lr, trained on (loss 9.39 against 5.56). Now both stop before the first
    step, each with the same one line naming the setting, exit 2."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank, lr in enumerate(["3e-3", "1e-2"]):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, "-m", "ballonet", *RUN, "--lr", lr, "--timeout-minutes", "2"],
                                      env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    results = [p.communicate(timeout=300) for p in procs]  # hang guard: the runs end in seconds
    for p, (out, err) in zip(procs, results):
        lines = [line for line in err.splitlines() if line.strip()]
        assert p.returncode == 2 and len(lines) == 1, (p.returncode, err[-2000:])
        assert "ranks disagree on the run's settings: --lr (ranks [0] | [1]" in lines[0], lines
        assert "step 1/" not in out


def test_json_output_is_strict_a_non_finite_result_is_one_line(capsys, monkeypatch):
    """Issue 47.6: huge or tiny profile values wrote Infinity/NaN into JSON output. The
    readers refuse such profiles (test_user_files.py); every writer is strict too: a cost
    that comes out infinite (forced here) is one line, exit 2, no Infinity printed."""
    import dataclasses

    from ballonet.cli import cost as cost_cli

    real = cost_cli.sequence_cost

    def infinite(*args, **kwargs):
        return dataclasses.replace(real(*args, **kwargs), attention_time_s=float("inf"))

    monkeypatch.setattr(cost_cli, "sequence_cost", infinite)
    assert cli.main(["cost", "--length", "4096", "--json"]) == 2
    captured = capsys.readouterr()
    assert "Infinity" not in captured.out
    assert "a number JSON cannot hold" in _err_line_of(captured.err)


def _err_line_of(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    return lines[0]


def test_a_log_line_is_appended_whole_or_not_at_all(tmp_path, monkeypatch):
    import errno
    import os

    from ballonet.training import logs

    path = tmp_path / "log.jsonl"
    logs.append_whole(str(path), b'{"step": 1}\n')
    real_write = os.write

    def full_disk(fd, data):  # half the line goes out, then the disk is full
        if len(data) > 4:
            return real_write(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full_disk)
    with pytest.raises(OSError):
        logs.append_whole(str(path), b'{"step": 2, "loss": 5.5}\n')
    assert path.read_bytes() == b'{"step": 1}\n'  # cut back to the last whole line
    with pytest.raises(OSError):
        logs.append_whole(str(tmp_path / "new.jsonl"), b'{"step": 1}\n')
    assert not (tmp_path / "new.jsonl").exists()  # a log this call made is removed
