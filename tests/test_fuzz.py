"""A slice of the fuzz in CI: the planner fuzz (`ballonet.planning.fuzz`) on a few
hundred calls, and `bench/fuzz.py`'s bad-input sweep (in-process through `cli.main`, plus
a few real subprocesses); the cases that need a base, a disk, a pipe or training ranks run
in the bench sweep only."""

import sys
from pathlib import Path

import pytest

from ballonet import PLANNERS, cli
from ballonet.cost import hardware
from ballonet.planning import fuzz as planner_fuzz

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # the sweep lives with its report
import sweep  # bench/sweep.py and bench/sweep_cases.py, once their folder is on the path
from sweep_cases import SWEEP

CI_CASES = [c for c in SWEEP if not c.slow]


def test_planner_fuzz_slice_has_no_invalid_plan_crash_or_hang():
    # timeout_s: a hang guard per planner call (each takes well under a second), not a speed claim.
    result = planner_fuzz.fuzz_planners(40, seed=7, timeout_s=60)
    assert result["failures"] == []
    assert set(planner_fuzz.VARIANTS) == set(PLANNERS) | {"zeppelin single"}
    for name in planner_fuzz.VARIANTS:
        counts = result["counts"][name]
        assert sum(counts.values()) == 40 and counts.get("ok", 0) > 0, (name, counts)


def test_random_cases_cover_the_ranges():
    import numpy as np

    rng = np.random.default_rng(0)
    cases = [planner_fuzz.random_case(rng) for _ in range(300)]
    gpus = {g.gpu for _, c, _ in cases for g in c.groups}
    assert gpus == set(hardware.GPUS)
    assert {m.tp for _, _, m in cases} == set(planner_fuzz.TP_CHOICES)
    assert any(len(c.groups) > 1 for _, c, _ in cases)
    lengths = [n for lens, _, _ in cases for n in lens]
    assert min(lengths) == 1 and max(lengths) > 100_000 and max(lengths) <= planner_fuzz.MAX_LENGTH


@pytest.mark.parametrize("case", CI_CASES, ids=[c.name for c in CI_CASES])
def test_bad_input_in_process(case, tmp_path, monkeypatch, capsys):
    sweep.make_files(str(tmp_path), case.files)
    before = sweep.listing(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    try:
        code = cli.main(list(case.argv))
    except SystemExit as e:  # argparse
        code = e.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == case.exit_code, err
    if case.exit_code == 2:
        assert len(lines) == 1 and lines[0].startswith("ballonet") and "Traceback" not in err, err
        assert case.expect in lines[0], err
    assert sweep.listing(str(tmp_path)) == before


@pytest.mark.parametrize("name", ["unknown flag", "cluster TOML gpu = 5", "simulate --plot a folder",
                                  "train --nproc 0", "plan --nodes 1000000", "cluster TOML nic_gbps = inf"])
def test_bad_input_subprocess(name):
    row = sweep.run_case(next(c for c in SWEEP if c.name == name))
    assert row["ok"], row
    assert row["exit_code"] == 2 and row["stderr_lines"] == 1 and not row["traceback"] and not row["left_behind"]


def test_a_closed_pipe_is_one_line_not_a_traceback():
    row = sweep.run_case(next(c for c in SWEEP if c.pipe))
    assert row["ok"] and sweep.outcome(row) == "ok", row
