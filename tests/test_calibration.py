"""Calibration profiles: the file format, its refusals, `use`, and `ballonet calibrate`.

Speed figures are never asserted here (bench/fidelity.py compares predictions with
measured steps); these tests check the format, what is measured and where it goes.
"""

import json
import platform
import statistics

import pytest
import torch

import ballonet
from ballonet import calibration
from ballonet.cli import main
from ballonet.cost import hardware
from ballonet.cost.seconds import attention_seconds
from ballonet.errors import InputError
from tests.distributed import run_ranks
from tests.heap_accounting import mallinfo2


def _profile_dict() -> dict:
    return json.loads(hardware.profile("cpu").to_json())


def test_built_in_profile_round_trips_through_json():
    for name in hardware.GPUS:
        p = hardware.profile(name)
        assert calibration.from_dict(json.loads(p.to_json())) == p


@pytest.mark.parametrize("change, field", [
    (lambda d: d.update(schema=1), "'schema' must be 2, got 1"),  # before the elementwise and step terms
    (lambda d: d.update(schema=3), "'schema'"),
    (lambda d: d.pop("elementwise"), "'elementwise' is missing"),
    (lambda d: d.pop("optimizer_s_per_param"), "'optimizer_s_per_param' is missing"),
    (lambda d: d.update(framework_s_per_layer=-0.01), "'framework_s_per_layer' must not be negative"),
    (lambda d: d.update(memory_bw=0), "'memory_bw' must be positive"),
    (lambda d: d["elementwise"]["efficiency"].__setitem__(0, 1.5), "'elementwise'"),
    (lambda d: d.pop("linear"), "'linear' is missing"),
    (lambda d: d.pop("collective_efficiency"), "'collective_efficiency' is missing"),
    (lambda d: d.update(attention_launch_s=-1e-6), "'attention_launch_s' must not be negative"),
    (lambda d: d.update(p2p_latency_s="fast"), "'p2p_latency_s' must be a number"),
    (lambda d: d["attention_backward"]["efficiency"].__setitem__(0, -0.1), "'attention_backward.efficiency[0]'"),
    (lambda d: d["collective_efficiency"].pop("all_reduce"), "'collective_efficiency.all_reduce' is missing"),
    (lambda d: d.update(speed=3), "unknown field 'speed'"),
])
def test_bad_profiles_are_refused_naming_the_field(tmp_path, capsys, change, field):
    d = _profile_dict()
    change(d)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(d))
    with pytest.raises(InputError, match=field.replace("[", r"\[").replace("]", r"\]")):
        calibration.load(str(path))
    assert main(["cost", "--length", "1024", "--calibration", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(path) in err and "Traceback" not in err


def test_use_prices_one_gpu_type_inside_the_block_only():
    d = _profile_dict()
    d["attention_forward"] = {"tokens": [1], "efficiency": [0.5]}
    fast = calibration.from_dict(d)
    model = ballonet.model("tiny")
    cpu = hardware.gpu("cpu")
    before = attention_seconds(model, cpu, 1e9, 4096, launch_floor=True)
    with calibration.use(fast):
        assert hardware.profile("cpu") is fast and hardware.profile("h100") is not fast
        seconds = attention_seconds(model, cpu, 1e9, 4096, launch_floor=True)
        assert seconds == pytest.approx(1e9 / (0.5 * cpu.peak_flops))
    assert attention_seconds(model, cpu, 1e9, 4096, launch_floor=True) == before


def test_calibrate_quick_writes_a_profile_the_other_commands_read(tmp_path, capsys):
    out, fig = tmp_path / "cpu.json", tmp_path / "cpu.png"
    assert main(["calibrate", "--quick", "--out", str(out), "--plot", str(fig)]) == 0
    capsys.readouterr()
    p = calibration.load(str(out))
    assert p.gpu == "cpu" and p.versions["torch"] == torch.__version__ and p.machine["world_size"] == 1
    assert p.machine["threads_per_rank"] == 1 and any("thread(s) per rank" in a for a in p.assumptions)
    assert p.attention_forward.tokens == (64, 128, 256, 512) and p.attention_backward.tokens == p.attention_forward.tokens
    assert p.attention_forward.efficiency != p.attention_backward.efficiency  # timed separately
    assert any("one process" in a for a in p.assumptions) and p.overlap_slowdown == hardware.profile("cpu").overlap_slowdown
    assert fig.stat().st_size > 0
    args = ["--cluster", "cpu", "--model", "tiny"]
    assert main(["cost", *args, "--length", "512", "--json"]) == 0
    built_in = json.loads(capsys.readouterr().out)
    assert main(["cost", *args, "--length", "512", "--json", "--calibration", str(out)]) == 0
    measured = json.loads(capsys.readouterr().out)
    flops = measured["attention_flops_fwd"]
    assert measured["attention_time_s"] == pytest.approx(
        max(p.attention_launch_s, flops / (hardware.gpu("cpu").peak_flops * p.attention_forward.efficiency[-1])))
    assert measured["attention_time_s"] != built_in["attention_time_s"]
    assert main(["simulate", *args, "--nodes", "1", "--tokens-per-gpu", "1024", "--planners", "zeppelin",
                 "--json", "--calibration", str(out)]) == 0
    assert json.loads(capsys.readouterr().out)["results"][0]["step_time_s"] > 0
    assert main(["calibrate", "--max-length", "8"]) == 2 and "--max-length" in capsys.readouterr().err


TINY_ELEMENTWISE_BYTES = 3 * (2 * (4 * 64 + 2 * (64 + 32) + 3 * 176 + 6 * 64) * 4
                              + (2 * 64 * 4 + 256 * 8 + 2 * 256 * 4))
"""The tiny model's elementwise bytes a token, forward and backward (3x forward), fp32, by
hand: per layer (h=64, kv=32, ffn=176) 2 norms 4h, rotary 2(h+kv), silu*up 3 ffn, 2 adds 6h;
the loss (V=256) final norm 2h, fp32 cast 2V, log-softmax 2V."""


def test_calibrate_prices_gemms_elementwise_work_and_the_optimizer_from_its_timings():
    from ballonet.calibration import calibrate

    s = calibrate.quick(calibrate.Settings(gpu="cpu", model="tiny"))
    profile, raw = calibrate.run(s, torch.device("cpu"))
    peak = hardware.gpu("cpu").peak_flops
    gemm_flops = 3 * (2 * 2 * (64 * 128 + 64 * 64 + 3 * 64 * 176) + 2 * 256 * 64)  # 2 layers + head, a token
    rates = []
    for row, eff in zip(raw["linear"], profile.linear.efficiency):
        assert eff == pytest.approx(gemm_flops * row["tokens"] / (row["gemm_s"] * peak))
        assert row["elementwise_s"] >= 0.01 * row["model_s"] > 0  # the model's seconds beyond its GEMMs
        rates.append(TINY_ELEMENTWISE_BYTES * row["tokens"] / row["elementwise_s"])
    assert profile.memory_bw == max(hardware.profile("cpu").memory_bw, *rates)
    assert [e * profile.memory_bw for e in profile.elementwise.efficiency] == pytest.approx(rates)
    own = [r for r in raw["attention"] if r["model_shape"]]
    assert {(r["heads"], r["kv_heads"], r["head_dim"]) for r in own} == {(4, 2, 16)}  # the tiny model's heads
    assert len(raw["attention"]) > len(own)  # other shapes are timed, not priced
    assert list(profile.attention_forward.efficiency) == pytest.approx([r["forward_efficiency"] for r in own])
    assert list(profile.attention_backward.efficiency) == pytest.approx([r["backward_efficiency"] for r in own])
    step = raw["step"]
    assert step["local_params"] == ballonet.model("tiny").num_params  # one process holds them all
    assert profile.optimizer_s_per_param == pytest.approx(step["optimizer_s"] / step["local_params"])
    assert profile.framework_s_per_layer == hardware.profile("cpu").framework_s_per_layer  # no FSDP2 alone
    assert "fsdp_s" not in step and any("framework" in a and "one process" in a for a in profile.assumptions)


def _heap_keeps(numel: int) -> tuple[int, int] | None:
    """(bytes glibc mapped afresh for a tensor of `numel` floats, bytes free in its heap once
    the tensor is gone), from glibc's own accounting (`mallinfo2`, glibc 2.33+; None before).
    Its defaults map a block over 128 KiB afresh and unmap it when freed; with
    `setup_cpu_rank`'s settings the block comes from the heap and stays there, free. (Counting
    page faults when the block is taken again was flaky: any small allocation in between,
    from another thread or the interpreter, can split the freed block.)"""
    if mallinfo2() is None:
        return None
    before = mallinfo2().hblkhd
    t = torch.ones(numel)
    mapped = mallinfo2().hblkhd - before
    del t
    return mapped, mallinfo2().fordblks


def _calibrate_on_ranks(rank: int, world: int):
    from ballonet.calibration import calibrate
    from ballonet.training.jobs import host

    took = host.setup_cpu_rank()  # as `ballonet calibrate` and `ballonet train` run a CPU rank
    kept = _heap_keeps(6 << 20)  # 24 MiB
    s = calibrate.quick(calibrate.Settings(gpu="cpu", model="tiny"))
    profile, raw = calibrate.run(s, torch.device("cpu"))
    # median_rank on rows whose times differ by rank, then with rank 1 on another device type
    rows = [{"length": 64, "forward_s": 1.0 + rank, "backward_s": 2.0 * rank, "model_shape": True}]
    step = {"fsdp_extra_s": 0.1 * (1 - rank), "optimizer_s": 0.5 + rank, "local_params": 7}
    alike = calibrate.median_rank(rows, [{"model_s": 3.0 - rank}], step, "cpu")
    apart = calibrate.median_rank(rows, [{"model_s": 3.0 - rank}], step, f"device {rank}")
    return profile, raw, (took, torch.get_num_threads(), kept), alike, apart


@pytest.mark.slow
def test_calibrate_on_two_gloo_ranks_as_train_runs_them_measures_the_links_and_keeps_the_median_rank():
    results = run_ranks(2, _calibrate_on_ranks)
    (profile, raw, (took, threads, kept), alike, apart) = results[0]
    # Each rank runs as a training rank: one thread, and (glibc) freed memory stays in the heap.
    assert threads == 1
    if platform.libc_ver()[0] == "glibc":
        assert took
        if kept is not None:  # from the heap, not mapped afresh, and kept there once freed
            assert kept[0] == 0 and kept[1] >= 24 << 20, kept
    else:
        assert not took
    # Each timing the median over the ranks (of 2: their mean), counts and flags as measured;
    # ranks of another device type left out.
    assert raw["ranks"] == 2 and alike["ranks"] == 2 and apart["ranks"] == 1
    assert alike["attention"] == [{"length": 64, "forward_s": 1.5, "backward_s": 1.0, "model_shape": True}]
    assert alike["linear"] == [{"model_s": 2.5}] and apart["linear"] == [{"model_s": 3.0}]
    assert alike["step"] == {"fsdp_extra_s": 0.05, "optimizer_s": 1.0, "local_params": 7}
    assert apart["attention"] == [{"length": 64, "forward_s": 1.0, "backward_s": 0.0, "model_shape": True}]
    assert any("median of 2 ranks" in a for a in profile.assumptions)
    own = raw["per_rank"]  # the profile's figures are the ranks' medians
    assert [r["linear"][0]["tokens"] for r in own] == [64, 64] and raw["linear"][0]["efficiency"] == pytest.approx(
        statistics.median(r["linear"][0]["efficiency"] for r in own))
    assert profile.attention_forward.efficiency[0] == pytest.approx(
        statistics.median(r["attention"][0]["forward_efficiency"] for r in own))
    built_in = hardware.profile("cpu")
    assert [r["bytes"] for r in raw["comm"]["p2p"]] == [2**10, 2**16, 2**20]
    assert all(r["seconds"] > 0 for op in ("p2p", "all_to_all", "all_reduce") for r in raw["comm"][op])
    assert profile.p2p_efficiency != built_in.p2p_efficiency and profile.machine["world_size"] == 2
    assert profile.nic_latency_s == profile.p2p_latency_s
    o = raw["comm"]["overlap"]
    assert min(o.values()) > 0 and profile.overlap_slowdown == pytest.approx(
        max(0.0, o["compute_with_comm_s"] - o["compute_alone_s"]) / min(o["comm_alone_s"], o["compute_with_comm_s"]))
    assert set(profile.collective_efficiency) == set(calibration.COLLECTIVES)
    step = raw["step"]
    assert min(step["fsdp_s"], step["bare_s"]) > 0
    assert all(r["step"]["framework_s_per_layer"] == max(r["step"]["fsdp_extra_s"], 0) / 2 for r in own)  # 2 layers
    assert profile.framework_s_per_layer == pytest.approx(statistics.median(r["step"]["framework_s_per_layer"] for r in own))
    assert step["local_params"] < ballonet.model("tiny").num_params  # FSDP2 shards them over the 2 ranks
    assert profile.optimizer_s_per_param == pytest.approx(step["optimizer_s"] / step["local_params"])
    calibration.from_dict(json.loads(profile.to_json()))  # valid


def test_calibrate_compare_compares_with_the_built_in_profile(tmp_path, capsys):
    from ballonet.calibration.compare import compare

    lines, worst = compare(hardware.profile("h200"))
    assert worst == {"attention_forward": 0.0, "attention_backward": 0.0, "linear": 0.0, "elementwise": 0.0}
    path = tmp_path / "p.json"
    d = json.loads(hardware.profile("h200").to_json())
    d["linear"]["efficiency"] = [e / 2 for e in d["linear"]["efficiency"]]
    d["elementwise"]["efficiency"] = [e / 4 for e in d["elementwise"]["efficiency"]]
    d["optimizer_s_per_param"] = 3e-9
    path.write_text(json.dumps(d))
    assert main(["calibrate", "--compare", str(path)]) == 0
    out = capsys.readouterr().out
    assert "linear x2.00" in out and "elementwise x4.00" in out
    assert "| optimizer_s_per_param | 3e-09 |" in out
    assert main(["calibrate", "--compare", str(tmp_path / "missing.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ballonet calibrate: error:") and "missing.json" in err[0]


def test_curve_at_one_agrees_with_the_vector_form():
    curve = hardware.profile("h800").attention_forward
    xs = [0.0, 0.5, 1.0, 63.0, 64.0, 100.0, 4096.0, 5000.5, 131072.0, 1e7]
    vector = curve.at(xs)
    for x, v in zip(xs, vector):
        assert curve.at_one(x) == pytest.approx(float(v), rel=1e-12, abs=1e-15), x
