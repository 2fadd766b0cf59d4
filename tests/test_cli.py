import json
import re
import subprocess
import sys

import pytest


def run(*args):
    return subprocess.run([sys.executable, "-m", "ballonet", *args], capture_output=True, text=True, check=False)


def test_cost_json_has_the_documented_keys():
    r = run("cost", "--model", "llama-7b", "--cluster", "a800-4nic", "--length", "8192", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    # Hand-computed: causal attention 2*4096*8192*8193, linear 404,750,336 FLOPs per token.
    assert d["attention_flops_fwd"] == 2 * 4096 * 8192 * 8193
    assert d["linear_flops_fwd"] == 404_750_336 * 8192
    assert d["attention_time_s"] > 0 and d["linear_time_s"] > 0
    assert d["breakeven_chunk_tokens"]["inter"] > d["breakeven_chunk_tokens"]["intra"] > 0


def test_cost_nodes_shard_the_model_state_and_so_set_the_recomputation():
    """`cost --nodes`, as plan and simulate take it: the more GPUs the optimizer state is
    sharded over, the more memory is left for activations, and the less a document recomputes."""
    from ballonet import specs
    from ballonet.cost.memory import memory_cap

    def cost(nodes):
        r = run("cost", "--model", "llama-13b", "--cluster", "a800-4nic", "--nodes", str(nodes), "--length", "8192",
                "--json")
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)["recompute"]

    model, gpu = specs.model("llama-13b"), specs.cluster("a800-4nic").groups[0].gpu_type
    assert memory_cap(model, gpu, 8) < memory_cap(model, gpu, 128)
    assert (cost(1), cost(16)) == ("selective", "none")
    r = run("cost", "--cluster", "h800+h20", "--nodes", "3", "--length", "1000")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "--nodes 3" in r.stderr
def test_plan_cost_and_simulate_read_a_hugging_face_folder_as_train_does(tmp_path):
    """--model hf:DIR: the folder's config.json, as `train` reads it (it was read as a TOML path)."""
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "llama", "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 688, "num_hidden_layers": 2, "vocab_size": 1000}))
    r = run("plan", "--cluster", "cpu", "--model", f"hf:{tmp_path}", "--tokens-per-gpu", "2048", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["model"] == str(tmp_path / "config.json")
    r = run("cost", "--cluster", "cpu", "--model", f"hf:{tmp_path}", "--length", "4096", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["attention_flops_fwd"] == 2 * 256 * 4096 * 4097 * 1, r.stderr
    r = run("simulate", "--cluster", "cpu", "--model", f"hf:{tmp_path / 'none'}", "--tokens-per-gpu", "1024")
    assert r.returncode == 2 and "not a folder" in r.stderr and len(r.stderr.splitlines()) == 1


def test_an_error_naming_a_file_with_a_newline_is_still_one_line(tmp_path):
    import os

    corpus = tmp_path / "t"
    corpus.mkdir()
    os.mkfifo(corpus / "c\nd")
    r = run("train", "--corpus", str(corpus), "--steps", "1")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "c\\nd" in r.stderr, r.stderr


def test_a_lone_surrogate_in_a_jsonl_text_is_its_three_bytes(tmp_path):
    path = tmp_path / "s.jsonl"
    path.write_text('{"text": "\\ud800abc"}\n')
    from ballonet import workloads

    assert list(workloads.get(str(path)).lengths) == [6]


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


# ---- hardening (issue 16) --------------------------------------------------------------


def _main(argv, capsys):
    from ballonet import cli

    try:
        code = cli.main(argv)
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_argparse_errors_are_one_line_and_help_is_full(capsys):
    code, out, err = _main(["plan", "--nodes", "0"], capsys)
    assert code == 2 and out == ""
    assert err == "ballonet plan: error: argument --nodes: expected a positive integer, got '0' " \
                  "(see ballonet plan --help)\n"
    code, out, err = _main(["plan", "--help"], capsys)
    assert code == 0 and out.startswith("usage: ballonet plan") and "--lengths" in out and len(out.splitlines()) > 20


def test_output_paths_are_checked_before_any_work(tmp_path, monkeypatch, capsys):
    from ballonet.simulation import comparison

    def no_work(*args, **kwargs):
        raise AssertionError("the comparison ran before the output path was checked")

    monkeypatch.setattr(comparison, "compare", no_work)
    monkeypatch.setattr("ballonet.planning.plan_batch", no_work)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d").mkdir()
    for argv, message in [
        (["simulate", "--trace", "nodir/t.json"], "--trace nodir/t.zeppelin.json: folder 'nodir' does not exist"),
        (["simulate", "--planners", "zeppelin,te_cp", "--trace", "d/t.json", "--plot", "d"], "--plot d: is a folder"),
        (["simulate", "--plot", "x.zzz"], "--plot x.zzz: expected a file name ending in one of"),
        (["plan", "--out", "d"], "--out d: is a folder"),
    ]:
        code, out, err = _main(argv, capsys)
        assert code == 2 and message in err and len(err.splitlines()) == 1, (argv, err)
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["d"]


def test_plan_out_is_the_plan_written_whole(tmp_path, monkeypatch, capsys):
    import ballonet
    from ballonet.plan import Plan

    monkeypatch.chdir(tmp_path)
    (tmp_path / "lens.txt").write_text("300\n20\n4000\n7\n")
    code, _, err = _main(["plan", "--lengths", "lens.txt", "--cluster", "cpu", "--model", "tiny", "--out", "p.json"],
                         capsys)
    assert code == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lens.txt", "p.json"]  # no temporary file left
    reference = ballonet.plan_batch([300, 20, 4000, 7], ballonet.cluster("cpu"), ballonet.model("tiny"))
    assert Plan.from_json((tmp_path / "p.json").read_text()).digest == reference.digest


def _infeasible_setup(tmp_path, monkeypatch):
    """packed_dp cannot place a 120000-token document on an H800 with llama-13b (at most
    ~103.8K tokens per GPU); zeppelin and te_cp split it."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "big.txt").write_text("120000\n")
    return ["simulate", "--cluster", "h800-8nic", "--nodes", "4", "--model", "llama-13b", "--workload", "big.txt",
            "--tokens-per-gpu", "4096", "--planners", "zeppelin,packed_dp,te_cp"]


def test_an_infeasible_planner_is_a_row_and_the_rest_carry_on(tmp_path, monkeypatch, capsys):
    import ballonet
    from ballonet.errors import InfeasiblePlan

    argv = _infeasible_setup(tmp_path, monkeypatch)
    code, out, err = _main([*argv, "--json", "--trace", "t.json"], capsys)
    assert code == 0, err
    rows = {r["planner"]: r for r in json.loads(out)["results"]}
    cluster, model = ballonet.cluster("h800-8nic", num_nodes=4), ballonet.model("llama-13b")
    batch = ballonet.workloads.get("big.txt").sample_batch(4096 * cluster.num_ranks, (0, 0))
    with pytest.raises(InfeasiblePlan) as reason:
        ballonet.plan_batch(batch, cluster, model, "packed_dp")
    assert rows["packed_dp"]["feasible"] is False and rows["packed_dp"]["reason"] == str(reason.value)
    assert rows["packed_dp"]["step_time_s"] is None
    for name in ("zeppelin", "te_cp"):
        expected = ballonet.simulate(ballonet.plan_batch(batch, cluster, model, name), cluster, model).step_time_s
        assert rows[name]["feasible"] is True and rows[name]["step_time_s"] == pytest.approx(expected)
    assert rows["zeppelin"]["speedup_vs_te_cp"] == pytest.approx(rows["te_cp"]["step_time_s"]
                                                                 / rows["zeppelin"]["step_time_s"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.txt", "t.te_cp.json", "t.zeppelin.json"]
    assert "wrote 2 trace(s)" in err and "t.zeppelin.json, t.te_cp.json" in err  # named where they went
    code, out, err = _main(argv, capsys)
    assert code == 0 and "infeasible" in out and "packed_dp never splits" in out.replace("\n", " "), out


def test_simulate_names_its_outputs_and_a_piped_table_keeps_whole_names(tmp_path):
    r = subprocess.run([sys.executable, "-m", "ballonet", "simulate", "--cluster", "a800-4nic", "--nodes", "1",
                        "--model", "llama-3b", "--tokens-per-gpu", "4096", "--planners", "megatron_hcp,zeppelin",
                        "--plot", "steps.png", "--trace", "t.json"], capture_output=True, text=True, check=False,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "megatron_hcp" in r.stdout and "…" not in r.stdout  # stdout is a pipe here
    assert "t.megatron_hcp.json, t.zeppelin.json" in r.stderr and "steps.png" in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["steps.png", "t.megatron_hcp.json", "t.zeppelin.json"]


def test_the_step_plot_cuts_outliers_at_its_axis():
    from ballonet.cli.step_plot import OUTLIER, axis_top

    top, cut = axis_top([1.0, 1.2, 1.1, 9.0])  # median 1.15: 9.0 is over 2.5x it
    assert cut == [False, False, False, True] and top == pytest.approx(OUTLIER * 1.15 * 1.12)
    top, cut = axis_top([1.0, 1.2, 2.0])
    assert not any(cut) and top == pytest.approx(2.0 * 1.12)


def test_every_planner_infeasible_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    argv = _infeasible_setup(tmp_path, monkeypatch)
    code, out, err = _main([*argv[:argv.index("--planners")], "--planners", "packed_dp,flops_dp"], capsys)
    assert code == 2 and len(err.splitlines()) == 1 and "no planner can run the batch: packed_dp:" in err


def test_failed_rank_line_prefers_the_rank_s_own_message(tmp_path):
    from types import SimpleNamespace

    from ballonet.training.jobs.launch import _failure_line

    failures = {1: SimpleNamespace(exitcode=2, timestamp=10), 0: SimpleNamespace(exitcode=-15, timestamp=11)}
    (tmp_path / "1").write_text("ballonet train: error: the cause\n")
    assert _failure_line(failures, str(tmp_path)) == ("ballonet train: error: the cause", 2)
    (tmp_path / "1").unlink()
    assert _failure_line(failures, str(tmp_path)) == ("ballonet train: error: rank 1 failed (exit code 2)", 1)
    failures = {0: SimpleNamespace(exitcode=-9, timestamp=3)}
    assert _failure_line(failures, str(tmp_path)) == ("ballonet train: error: rank 0 died (signal 9); the others "
                                                      "stopped", 1)
    # A dead rank, and its peer that lost the connection in the same second: the death is the cause.
    failures = {0: SimpleNamespace(exitcode=1, timestamp=3), 1: SimpleNamespace(exitcode=-9, timestamp=3)}
    (tmp_path / "0").write_text("ballonet train: error: rank 0: Connection reset by peer\n")
    assert _failure_line(failures, str(tmp_path)) == ("ballonet train: error: rank 1 died (signal 9); the others "
                                                      "stopped", 1)
    # ... and the peer the agent stopped (SIGTERM) before it noticed, recorded in the same second.
    failures = {0: SimpleNamespace(exitcode=-15, timestamp=3), 1: SimpleNamespace(exitcode=-9, timestamp=3)}
    (tmp_path / "0").unlink()
    assert _failure_line(failures, str(tmp_path)) == ("ballonet train: error: rank 1 died (signal 9); the others "
                                                      "stopped", 1)


def test_a_rank_s_bad_input_under_nproc_is_its_one_line_and_exit_2(tmp_path):
    # --max-doc-tokens 0 passes the launcher's preflight and stops each rank in its loader
    # (once TrainConfig checks it, the launcher refuses it first: the same line and code).
    r = subprocess.run([sys.executable, "-m", "ballonet", "train", "--nproc", "2", "--steps", "1",
                        "--global-tokens", "256", "--max-doc-tokens", "0"], capture_output=True, text=True,
                       cwd=tmp_path, timeout=300, check=False)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("ballonet train: error: ") and "Traceback" not in r.stderr
    assert re.search(r"max.doc(ument)?.tokens", lines[0], re.IGNORECASE), lines[0]
    assert list(tmp_path.iterdir()) == []


# ---- a new user's slips (s9): each one line naming the flag, exit 2, nothing printed or written ----


@pytest.mark.parametrize(
    "argv, message",
    [
        (["cost", "--length", "4096", "--lenght", "5"],
         "ballonet cost: error: unrecognized arguments: --lenght 5; did you mean --length? (see ballonet cost --help)"),
        (["cost", "--length", "4096", "--len", "5", "--json"],
         "ballonet cost: error: unrecognized arguments: --len 5; did you mean --length?"),  # no abbreviation: `train` hands its flags to torchrun
        (["train", "--nproc", "2", "--npro", "2"], "ballonet train: error: unrecognized arguments: --npro 2; did you "
                                                   "mean --nproc?"),
        (["plan", "--check"], "unrecognized arguments: --check; did you mean --check-schedule?"),
        (["train", "--train-iters", "100", "--lr", "1e-3"],
         "unrecognized arguments: --train-iters 100; here, Megatron-LM's --train-iters is --steps"),
        (["train", "--training.seq_len=4096"], "here, torchtitan's --training.seq_len is --max-doc-tokens"),
        (["train", "--gradient_accumulation_steps", "4"],
         "here, HF Trainer's --gradient_accumulation_steps is --grad-accum"),
        (["plan", "--seed", "-1", "--json"], "ballonet plan: error: argument --seed: expected an integer from 0"),
        (["simulate", "--seed", "-1"], "ballonet simulate: error: argument --seed: expected an integer from 0"),
        (["demo", "--seed", "-1"], "ballonet demo: error: argument --seed: expected an integer from 0"),
        (["demo", "--tokens-per-gpu", "100000000"], "ballonet demo: error: --tokens-per-gpu 100000000: a batch of "
                                                    "3200000000 tokens, over the"),
        (["plan", "--lengths", "lens.txt", "--tokens-per-gpu", "8", "--json"],
         "--lengths is the batch itself, not sampled: --tokens-per-gpu does not apply"),
        (["plan", "--lengths", "lens.txt", "--seed", "3"], "--seed does not apply"),
        (["simulate", "--planners", "zeppelin,te_cp,zeppelin", "--json"],
         "--planners zeppelin,te_cp,zeppelin: names zeppelin more than once"),
        (["simulate", "--planners", "te_cp", "--no-remap", "--assume-homogeneous"],
         "--planners te_cp runs no zeppelin: --no-remap, --assume-homogeneous do not apply"),
        (["simulate", "--cluster", "h800+h20", "--loan-schedule", "day.toml", "--plot", "a.png", "--json"],
         "--loan-schedule prices zeppelin's plans alone, in a table: --plot does not apply"),
        (["simulate", "--cluster", "h800+h20", "--loan-schedule", "day.toml", "--planners", "te_cp", "--tune"],
         "--planners, --tune do not apply"),
        (["calibrate", "--compare", "p.json", "--out", "q.json", "--quick"],
         "--compare measures nothing, it prints a table: --out, --quick do not apply"),
        (["calibrate", "--compare", "p.json", "--json"], "--json does not apply"),
        (["calibrate", "--quick", "--gpu", "h200", "--out", "q.json"],
         "--gpu h200: this machine has no GPU, so it measures its CPU"),
    ],
)
def test_a_slip_is_one_line_naming_the_flag_and_nothing_else(argv, message, tmp_path, monkeypatch, capsys):
    import torch

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU machine, wherever the test runs
    (tmp_path / "lens.txt").write_text("300\n20\n")
    code, out, err = _main(argv, capsys)
    assert code == 2 and out == "" and message in err and len(err.splitlines()) == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lens.txt"]


def test_help_says_what_ballonet_is_and_where_to_start(capsys):
    from tests.parsers import subcommand_flags

    code, out, _ = _main(["--help"], capsys)
    assert code == 0 and "Ballonet: plan, simulate and train" in out
    assert "Start with `ballonet demo`" in " ".join(out.split()) and "ballonet COMMAND --help" in " ".join(out.split())
    for name in subcommand_flags():
        code, out, err = _main([name, "--help"], capsys)
        assert code == 0 and out.startswith(f"usage: ballonet {name}") and err == "", name
        if name in ("cost", "plan", "simulate"):  # --model takes a model file and a HF folder too, as in the README
            model_help = " ".join(out.split("--model", 2)[2].split()[:24])
            assert "TOML file" in model_help and "hf:DIR" in model_help, name


def test_the_loan_day_s_json_is_strict_as_every_json_output(tmp_path, monkeypatch, capsys):
    from types import SimpleNamespace

    from ballonet.simulation import loans

    monkeypatch.chdir(tmp_path)
    (tmp_path / "day.toml").write_text("lent = [[0, 8]]\nhours = 24\n")
    monkeypatch.setattr(loans, "membership", lambda *args, **kwargs: None)
    monkeypatch.setattr(loans, "day", lambda *args: SimpleNamespace(to_dict=lambda: {"tokens_alone": float("nan")}))
    code, out, err = _main(["simulate", "--cluster", "h800+h20", "--loan-schedule", "day.toml", "--json"], capsys)
    assert code == 2 and out == "" and "a number JSON cannot hold (NaN or Infinity)" in err, (out, err)


def test_ctrl_c_is_one_line_exit_130_and_leaves_no_file(tmp_path):
    script = ("import ballonet.planning\n"
              "def interrupted(*args, **kwargs):\n    raise KeyboardInterrupt\n"
              "ballonet.planning.plan_batch = interrupted\n"
              "from ballonet import cli\n"
              "raise SystemExit(cli.main(['plan', '--cluster', 'cpu', '--model', 'tiny', '--out', 'p.json']))\n")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, check=False)
    assert r.returncode == 130 and r.stdout == "" and r.stderr == "ballonet plan: interrupted\n", r.stderr
    assert list(tmp_path.iterdir()) == []


def test_each_foreign_flag_names_a_flag_of_train():
    from ballonet.cli.foreign_flags import FOREIGN_FLAGS
    from tests.parsers import subcommand_flags

    train = subcommand_flags()["train"]
    for theirs, (tool, ours) in FOREIGN_FLAGS.items():
        assert ours.split()[0] in train and theirs not in train and "_" not in theirs, (theirs, ours)


def test_calibrate_names_each_file_it_wrote(capsys):
    from tests.closed_forms import FLAT

    from ballonet.cli.calibrate import _print_summary

    _print_summary(FLAT, "my_gpu.json", "my_gpu.png")
    out = capsys.readouterr().out
    assert "wrote my_gpu.json" in out and "wrote the plot: my_gpu.png" in out
