"""How a job is laid out and launched: node counts of one and several node groups (`--nodes`
against the cluster file and against torchrun's LOCAL_WORLD_SIZE), two torchrun agents as
two nodes, each rank's GPU checked against its group's type, and `--no-` forms over a
config file. (Ranks that cannot import a `./ballonet/` folder of the working directory:
tests/test_lease.py runs its jobs beside one.)"""

import json
import os
import subprocess
import sys

import pytest
from launching import free_port, lent_cluster_toml

import ballonet
from ballonet import specs
from ballonet.cli import build_parser, main
from ballonet.training import preflight

TWO = lent_cluster_toml("two-kinds", lent_nodes=2, lent_gpus_per_node=1)
TRAIN = ["--steps", "2", "--global-tokens", "512", "--max-doc-tokens", "256"]


def test_several_node_groups_keep_their_nodes_and_nodes_must_agree(tmp_path, capsys):
    path = tmp_path / "two.toml"
    path.write_text(TWO)
    full = specs.job_cluster(str(path), 4)
    assert [g.gpu for g in full.groups] == ["h800", "h20"] and full.num_nodes == 3
    assert [full.gpu_of(r).name for r in range(4)] == ["h800", "h800", "h20", "h20"]
    assert specs.job_cluster(str(path), 4, num_nodes=3) == full
    own = specs.job_cluster(str(path), 2)  # the loaned group reclaimed
    assert [g.gpu for g in own.groups] == ["h800"] and not own.has_loans
    with pytest.raises(ballonet.InputError, match=r"--nodes 1: cluster 'two-kinds' has 2 node groups of 3 nodes"):
        specs.job_cluster(str(path), 4, num_nodes=1)
    with pytest.raises(ballonet.InputError, match=r"has 4 GPUs in its node groups .*2 without its loaned groups\), "
                                                  r"the job 3 ranks"):
        specs.job_cluster(str(path), 3)
    # one group: its nodes are the job's (--nodes, default 1), as before
    assert specs.job_cluster("cpu", 4).num_nodes == 1 and specs.job_cluster("cpu", 4, 2).nodes() == [[0, 1], [2, 3]]
    # planning reads a file of several groups the same way: --nodes is their sum or an error, not a per-group count
    assert specs.cluster("h800+h20", num_nodes=4).num_ranks == 32
    for command in ("plan", "simulate"):
        assert main([command, "--cluster", "h800+h20", "--nodes", "1"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--nodes 1: cluster 'h800+h20' has 2 node groups of 4 nodes in all" in err
    with pytest.raises(ballonet.InputError, match="loaned must be true or false"):
        specs.NodeGroup(gpu="h20", loaned="yes")


def test_each_rank_is_checked_against_its_groups_gpu_and_torchruns_node(tmp_path, monkeypatch):
    path = tmp_path / "two.toml"
    path.write_text(TWO)
    cluster = specs.job_cluster(str(path), 4)
    monkeypatch.setattr(preflight.torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    assert "puts it on a h20 (node group 1), but its device is a NVIDIA H200" in preflight.placement_problem(cluster, 2,
                                                                                                       True)
    monkeypatch.setattr(preflight.torch.cuda, "get_device_name", lambda *a: "NVIDIA H20")
    assert preflight.placement_problem(cluster, 2, True) is None
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun put 2 ranks on rank 2's node; its group has 1 per node
    monkeypatch.delenv("BALLONET_ERROR_DIR", raising=False)
    assert "torchrun runs 2 ranks on its node (LOCAL_WORLD_SIZE), cluster 'two-kinds' 1" in \
        preflight.placement_problem(cluster, 2, False)
    assert preflight.placement_problem(cluster, 0, False) is None
    monkeypatch.setenv("WORLD_SIZE", "2")
    one_node = specs.job_cluster("cpu", 2, 2)  # --nodes 2, but torchrun ran both ranks on one node
    assert preflight.placement_problem(one_node, 0, False) == (
        "--nodes 2: torchrun runs 2 ranks as 2 per node (LOCAL_WORLD_SIZE), so 1 node; give --nodes 1")
    monkeypatch.setenv("BALLONET_ERROR_DIR", str(tmp_path))  # our launcher emulates nodes on one machine
    assert preflight.placement_problem(one_node, 0, False) is None


@pytest.mark.slow
def test_two_torchrun_agents_train_as_two_nodes(tmp_path):
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    log = tmp_path / "log.jsonl"
    agents = [["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-id", "t",
               "--rdzv-endpoint", f"127.0.0.1:{free_port()}"]]
    cmd = [torchrun, *agents[0], "-m", "ballonet", "train", "--nodes", "2", *TRAIN, "--json-log", str(log)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]  # a hang guard: ~40 s on a loaded 2-core machine
    assert [p.returncode for p in procs] == [0, 0], outs
    assert [(r["step"], r["world_size"]) for r in map(json.loads, log.read_text().splitlines())] == [(1, 2), (2, 2)]


def test_every_boolean_flag_can_switch_off_a_config_files_true(tmp_path):
    from ballonet.training.config import config_from_args

    path = tmp_path / "run.toml"
    path.write_text('async_checkpoint = true\nresume = true\nno_double = true\ncheckpoint_dir = "ck"\n')

    def resolve(*argv):
        return config_from_args(build_parser().parse_args(["train", "--config", str(path), *argv]))

    config = resolve()
    assert (config.async_checkpoint, config.resume, config.no_double) == (True, True, True)
    config = resolve("--no-async-checkpoint", "--no-resume", "--double")
    assert (config.async_checkpoint, config.resume, config.no_double) == (False, False, False)
    assert resolve("--no-resume", "--resume").resume  # the last one given wins
