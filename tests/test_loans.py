"""A day of loans, simulated: the schedule's changes, each priced by hand here, and the
tokens of the day; `ballonet simulate --loan-schedule` on the mixed preset."""

import json

import pytest

from ballonet import specs
from ballonet.cli import main
from ballonet.errors import InputError
from ballonet.simulation import loans


def test_changes_of_a_repeating_day():
    assert loans.LoanSchedule(lent=((20, 24), (0, 8))).changes() == [(8, "reclaimed"), (20, "lent")]
    assert loans.LoanSchedule(lent=((2, 6),)).changes() == [(2, "lent"), (6, "reclaimed")]
    assert loans.LoanSchedule(lent=((0, 24),)).changes() == [] and loans.LoanSchedule(lent=()).changes() == []
    for lent, message in [(((5, 3),), "not inside"), (((0, 25),), "not inside"),
                          (((0, 5), (4, 8)), "overlap at hour 4")]:
        with pytest.raises(InputError, match=message):
            loans.LoanSchedule(lent=lent)
    # A period whose tokens would overflow to inf, or vanish, and a schedule of thousands of spans:
    for hours, lent, message in [(1e308, ((0, 1e307),), "hours must be a number from"),
                                 (1e-300, (), "hours must be a number from"),
                                 (24.0, tuple((i / 100, (i + 0.5) / 100) for i in range(2000)), "2000 lent spans")]:
        with pytest.raises(InputError, match=message):
            loans.LoanSchedule(lent=lent, hours=hours)


def test_each_change_is_priced_and_the_day_counts_its_downtime():
    cluster = specs.cluster("h800+h20")
    own = cluster.without_loaned()
    model = specs.model("llama-7b")
    full_m = loans.Membership(cluster=cluster, step_s=4.0, plan_s=0.5)
    own_m = loans.Membership(cluster=own, step_s=5.0, plan_s=0.25)
    day = loans.day(loans.LoanSchedule(lent=((0, 8), (20, 24))), model, full_m, own_m, tokens_per_step=1000,
                    restart_s=60.0)
    reclaim, lend = day.transitions
    size = 12 * model.num_params
    h800_nics = 2 * 8 * 400e9 / 8  # 2 nodes of 8 NICs of 400 Gb/s
    h20_nics = 2 * 4 * 200e9 / 8
    assert (reclaim.hour, reclaim.to, lend.hour, lend.to) == (8, "reclaimed", 20, "lent")
    assert reclaim.step_in_flight_s == 2.0 and lend.step_in_flight_s == 2.5  # half a step of the members before
    assert reclaim.save_s == pytest.approx(size / (h800_nics + h20_nics))
    assert reclaim.load_s == pytest.approx(size / h800_nics) == lend.save_s
    assert reclaim.plan_s == 0.25 and lend.plan_s == 0.5 and reclaim.restart_s == 60.0
    assert reclaim.lender_wait_s == pytest.approx(2.0 + size / (h800_nics + h20_nics))
    lent_s, own_s = 12 * 3600 - lend.downtime_s, 12 * 3600 - reclaim.downtime_s
    assert day.tokens_with_loans == pytest.approx(1000 * (lent_s / 4.0 + own_s / 5.0))
    assert day.tokens_alone == pytest.approx(1000 * 24 * 3600 / 5.0)


def test_simulate_a_loan_schedule(tmp_path, capsys):
    path = tmp_path / "day.toml"
    path.write_text("lent = [[0, 8], [20, 24]]\n")
    # 8K tokens per GPU: at 4K the step is bound by FSDP's traffic over the H20 nodes' few
    # NICs and the loaned GPUs add nothing (1.5224 s against 1.5225 s on the H800s alone).
    assert main(["simulate", "--cluster", "h800+h20", "--loan-schedule", str(path), "--json",
                 "--tokens-per-gpu", "8192"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [(t["hour"], t["to"]) for t in out["transitions"]] == [(8, "reclaimed"), (20, "lent")]
    assert (out["full"]["gpus"], out["own"]["gpus"], out["tokens_per_step"]) == (32, 16, 32 * 8192)
    assert out["full"]["step_s"] < out["own"]["step_s"] and out["tokens_with_loans"] > out["tokens_alone"]
    for text, message in (("lent = 3\n", "lent must be a list of [start, end] hours"),
                          ("lent = [[0, 30]]\n", "not inside [0, 24)"), ("when = 1\n", "unknown field 'when'")):
        path.write_text(text)
        assert main(["simulate", "--cluster", "h800+h20", "--loan-schedule", str(path)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err
    path.write_text("lent = [[0, 8]]\n")
    assert main(["simulate", "--cluster", "h200-8nic", "--loan-schedule", str(path)]) == 2
    assert "cluster 'h200-8nic' has no node group with loaned = true" in capsys.readouterr().err
