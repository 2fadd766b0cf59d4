"""Property test: on random (mixed) clusters and random batches every planner returns a
plan that keeps the contract, or raises `InfeasiblePlan`; zeppelin raises only when the
batch cannot fit the cluster's memory at all."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ballonet import PLANNERS, plan_batch, specs
from ballonet.errors import InfeasiblePlan
from ballonet.planning.devices import devices
from ballonet.specs import ClusterSpec, NodeGroup

GPUS = ["h200", "h20", "a800", "l40s", "a10"]


@st.composite
def node_groups(draw):
    gpus = draw(st.integers(1, 8))
    nics = draw(st.sampled_from(sorted({d for d in range(1, gpus + 1) if gpus % d == 0} | {2 * gpus})))
    return NodeGroup(gpu=draw(st.sampled_from(GPUS)), num_nodes=draw(st.integers(1, 6)), gpus_per_node=gpus,
                     nics_per_node=nics, nic_gbps=draw(st.sampled_from([100.0, 200.0, 400.0])))


@st.composite
def clusters(draw):
    groups = draw(st.lists(node_groups(), min_size=1, max_size=3))
    while sum(g.num_nodes for g in groups) > 16:
        groups.pop()
    return ClusterSpec(name="random", groups=tuple(groups))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cluster=clusters(),
       model=st.sampled_from(["tiny", "llama-3b", "llama3-8b"]),
       lengths=st.lists(st.one_of(st.integers(1, 64), st.integers(1, 1_000_000)), max_size=30))
def test_every_planner_returns_a_valid_plan_or_infeasible(cluster, model, lengths):
    model = specs.model(model)
    dev = devices(cluster, model)
    fits = (dev.token_cap >= 0).all() and sum(lengths) <= dev.token_cap.sum()
    for name, options in [(n, {}) for n in PLANNERS] + [("zeppelin", {"double": False})]:
        try:
            plan = plan_batch(lengths, cluster, model, planner=name, **options)
        except InfeasiblePlan as e:
            assert "document" in str(e) or "batch" in str(e) or "state" in str(e)
            assert name != "zeppelin" or not fits, str(e)
            continue
        plan.validate()
        assert plan.lengths == tuple(lengths) and len(plan.memory_bytes) == cluster.num_ranks
        assert sum(plan.linear_tokens(r) for r in range(plan.num_ranks)) == sum(lengths)
