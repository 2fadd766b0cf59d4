"""`simulation.hill_climb` (run by `bench/investigations/hill_climb.py`): the placement it climbs from is
the plan's own, and a climb only ever keeps a valid plan that simulates no slower."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tight_memory import tight

from ballonet import InfeasiblePlan, plan_batch, specs, workloads
from ballonet.simulation import hill_climb
from ballonet.simulation.simulator import simulate

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "investigations" / "hill_climb.py"


@pytest.mark.parametrize("cluster, model, workload, kind", [
    ("h800-8nic", "llama-3b", "shortmix", "rings inside nodes"), ("a800-4nic", "llama-7b", "wlbllm", "remap"),
    ("h800-8nic", "llama-7b", [80_000] + [1_200] * 160, "double ring"), ("h200-8nic", "llama-3b", "wlbllm", "routes")])
def test_rebuilt_placement_is_the_plan_and_a_climb_never_lengthens_it(cluster, model, workload, kind):
    # (The double ring's batch is test_sim_truth's: since the partitioner prices the waits of
    # the runtime's ring order, a main-grid batch keeps single rings.)
    m = specs.model(model)
    c = tight(specs.cluster(cluster, num_nodes=2), m)
    batch = workload if isinstance(workload, list) else \
        next(iter(workloads.get(workload).batches(16384 * c.num_ranks, 0, 1, 65536)))
    plan = plan_batch(batch, c, m, "zeppelin")
    assert {"rings inside nodes": plan.rings, "remap": plan.remap, "routes": plan.routes,
            "double ring": [r for r in plan.rings if r.comm == "double"]}[kind], f"the case should have {kind}"
    again = hill_climb.rebuild(plan, hill_climb.placement_of(plan), c, m)
    assert (again.attention, again.rings, again.remap, again.routes) == (plan.attention, plan.rings, plan.remap,
                                                                         plan.routes)
    start = simulate(plan, c, m).step_time_s
    climbed, kept = hill_climb.hill_climb(plan, c, m, moves=40, seed=1)
    assert climbed.num_tokens == sum(batch)  # (and `hill_climb` validated it)
    assert simulate(climbed, c, m).step_time_s <= start
    assert (kept == 0) == (climbed.attention == plan.attention)


def test_bad_arguments_exit_2_with_one_line():
    """The bench script refuses bad arguments with exit code 2 and a usage error, run as a
    user runs it."""
    for args, message in ((["--cluster", "B", "--model", "llama-3b"], "give all of --cluster, --model and --workload"),
                          (["--cluster", "B", "--model", "llama-99b", "--workload", "shortmix", "--moves", "0"],
                           "unknown model"),
                          (["--cluster", "B", "--model", "llama-3b", "--workload", "shortmix", "--tp", "0"],
                           "--tp must be at least 1")):
        done = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120,
                              check=False)
        assert done.returncode == 2 and message in done.stderr, (args, done.stderr)


def test_a_climb_undoes_a_worsened_placement():
    c, m = specs.cluster("h800-8nic", num_nodes=2), specs.model("llama-3b")
    batch = next(iter(workloads.get("shortmix").batches(8192 * c.num_ranks, 0, 1, 65536)))  # room to move
    plan = plan_batch(batch, c, m, "zeppelin")
    # Move a rank's largest whole document to its neighbour, where memory allows and the
    # step gets longer.
    placement, best = hill_climb.placement_of(plan), simulate(plan, c, m).step_time_s
    start = best
    for a in range(plan.num_ranks):
        if not placement.local[a]:
            continue
        moved = [list(ds) for ds in placement.local]
        d = max(moved[a], key=lambda d: batch[d])
        moved[a].remove(d)
        moved[a ^ 1].append(d)
        try:
            worse = hill_climb.rebuild(plan, dataclasses.replace(placement, local=moved), c, m)
        except InfeasiblePlan:
            continue
        if (start := simulate(worse, c, m).step_time_s) > best:
            break
    assert start > best, "no move of a document to a neighbour fits and lengthens the step"
    climbed, kept = hill_climb.hill_climb(worse, c, m, moves=100, seed=0)
    assert kept > 0 and simulate(climbed, c, m).step_time_s < start
