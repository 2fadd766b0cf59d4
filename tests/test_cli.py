import json
import subprocess
import sys

import pytest


def run(*args):
    return subprocess.run([sys.executable, "-m", "ballonet", *args], capture_output=True, text=True)


def test_cost_json_has_the_documented_keys():
    r = run("cost", "--model", "llama-7b", "--cluster", "a800-4nic", "--length", "8192", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    # Hand-computed: causal attention 2*4096*8192*8193, linear 404,750,336 FLOPs per token.
    assert d["attention_flops_fwd"] == 2 * 4096 * 8192 * 8193
    assert d["linear_flops_fwd"] == 404_750_336 * 8192
    assert d["attention_time_s"] > 0 and d["linear_time_s"] > 0
    assert d["breakeven_chunk_tokens"]["inter"] > d["breakeven_chunk_tokens"]["intra"] > 0


def test_cost_table_and_help():
    r = run("cost", "--length", "4096")
    assert r.returncode == 0 and "break-even" in r.stdout
    for cmd in ([], ["cost"], ["demo"]):
        assert run(*cmd, "--help").returncode == 0


@pytest.mark.parametrize(
    "args, message",
    [
        (["cost", "--length", "4096", "--model", "gpt-9"], "unknown model 'gpt-9'; presets: llama-3b"),
        (["cost", "--length", "4096", "--cluster", "dgx"], "unknown cluster 'dgx'"),
        (["cost", "--length", "-3"], "expected a positive integer, got '-3'"),
        (["cost", "--length", "2.5"], "expected a positive integer, got '2.5'"),
        (["cost", "--length", "10", "--cluster", "missing.toml"], "missing.toml: cannot read cluster file"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, message):
    r = run(*args)
    assert r.returncode == 2
    assert message in r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""
    assert len([line for line in r.stderr.splitlines() if "error" in line]) == 1
