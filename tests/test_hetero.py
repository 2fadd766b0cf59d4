"""Mixed GPU types (issue #8): planner and simulator against closed-form cases.

Expected figures come from the hardware table (peak FLOP/s, memory) and hand formulas,
never from the planner under test.
"""

import dataclasses
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.tight_memory import tight

from ballonet import calibration, plan_batch, specs, workloads
from ballonet.cli import main
from ballonet.cost import hardware
from ballonet.cost.seconds import breakeven_chunk_tokens
from ballonet.errors import InfeasiblePlan
from ballonet.plan import Plan, Segment
from ballonet.simulation.simulator import simulate
from ballonet.specs import ClusterSpec, NodeGroup

MODEL = specs.model("llama-3b")
H100 = hardware.gpu("h100")


@pytest.fixture
def half_h100(monkeypatch):
    """A GPU exactly half as fast as an H100, otherwise alike: half the FLOP/s and half the
    memory bandwidth, twice the framework and optimizer seconds."""
    slow = dataclasses.replace(H100, name="h100-half", peak_flops=H100.peak_flops / 2)
    monkeypatch.setitem(hardware.GPUS, "h100-half", slow)
    p = hardware.profile("h100")
    half = dataclasses.replace(p, gpu="h100-half", memory_bw=p.memory_bw / 2,
                               framework_s_per_layer=2 * p.framework_s_per_layer,
                               optimizer_s_per_param=2 * p.optimizer_s_per_param)
    with calibration.use(half):
        yield slow


def two_gpus(gpus_per_node=1):
    """Node 0: H100s; node 1: the half-speed twin. One NIC per GPU."""
    kw = dict(num_nodes=1, gpus_per_node=gpus_per_node, nics_per_node=gpus_per_node, nic_gbps=400)
    return ClusterSpec(name="2x", groups=(NodeGroup(gpu="h100", **kw), NodeGroup(gpu="h100-half", **kw)))


def quadratic_share(plan: Plan, rank: int) -> float:
    """Share of the batch's causal attention FLOPs that `rank` computes, from its segments:
    a segment [a, e) of a document costs its queries against keys 0..q, i.e.
    sum_{q=a}^{e-1} (q + 1) = (e(e+1) - a(a+1)) / 2 query-key pairs."""
    pairs = lambda a, e: (e * (e + 1) - a * (a + 1)) / 2  # noqa: E731
    mine = sum(pairs(s.start, s.end) for s in plan.attention[rank])
    total = sum(pairs(0, L) for L in plan.lengths)
    return mine / total


def test_twice_as_fast_gpu_gets_two_thirds_of_a_split_document(half_h100):
    plan = plan_batch([65536], tight(two_gpus(), MODEL), MODEL)
    assert len(plan.rings) == 1 and plan.rings[0].kind == "inter"
    assert quadratic_share(plan, 0) == pytest.approx(2 / 3, abs=0.02)
    assert plan.linear_tokens(0) == pytest.approx(2 / 3 * 65536, abs=1)


def test_twice_as_fast_gpu_gets_two_thirds_of_whole_documents(half_h100):
    plan = plan_batch([4096] * 30, two_gpus(), MODEL)
    assert not plan.rings
    assert len(plan.local_docs(0)) == 20 and len(plan.local_docs(1)) == 10
    assert quadratic_share(plan, 0) == pytest.approx(2 / 3, abs=1e-9)
    assert [plan.linear_tokens(r) for r in (0, 1)] == [81920, 40960]


def test_assume_homogeneous_plans_equal_shares(half_h100):
    plan = plan_batch([4096] * 30, two_gpus(), MODEL, assume_homogeneous=True)
    assert len(plan.local_docs(0)) == len(plan.local_docs(1)) == 15
    assert plan.linear_tokens(0) == plan.linear_tokens(1) == 61440
    split = plan_batch([65536], two_gpus(), MODEL, assume_homogeneous=True)
    assert quadratic_share(split, 0) == pytest.approx(1 / 2, abs=0.02)


def _token_cap(gpu: hardware.GPUType, model, num_ranks: int) -> int:
    """Most tokens a GPU holds: (memory * reserve - FSDP2's sharded fp32 weights, grads and
    Adam, and its gathered bf16 embedding, head and two blocks) / bytes per token."""
    h, kv, f = model.hidden, model.kv_dim, model.ffn_hidden
    block = h * (h + 2 * kv) + h * h + 3 * h * f + 2 * h
    params = model.num_layers * block + 2 * model.vocab_size * h + h
    state = params * 16 / num_ranks + (2 * model.vocab_size * h + 2 * (params - 2 * model.vocab_size * h)
                                       / model.num_layers) * 2
    layer = (5 * h + 4 * f) + (2 * h + 2 * kv)  # one layer's saved tensors (cost.memory, by hand)
    per_token = (model.num_layers * h + layer) * 2  # full recomputation: layer inputs + one layer
    return int((gpu.memory_bytes * 0.9 - state) // per_token)


@pytest.mark.parametrize("assume_homogeneous", [False, True])
def test_memory_cap_of_the_small_gpu_is_respected(assume_homogeneous):
    # L40S (48 GB) is faster than A800 (80 GB): by speed it would take more tokens than it can hold.
    model = specs.model("llama-7b")
    cluster = tight(specs.cluster("a800+l40s"), model)
    l40s = cluster.groups[1].gpu_type
    cap = _token_cap(l40s, model, cluster.num_ranks)
    per_gpu = 40_000
    assert per_gpu * 362 / 337 > cap  # the speed-proportional share is over the cap
    rng = np.random.default_rng(3)
    lengths, total = [], 0
    while total < per_gpu * cluster.num_ranks:
        lengths.append(int(rng.integers(500, 9000)))
        total += lengths[-1]
    plan = plan_batch(lengths, cluster, model, assume_homogeneous=assume_homogeneous)
    for r in range(16, 32):
        assert plan.attention_tokens(r) <= cap and plan.linear_tokens(r) <= cap
        assert plan.memory_bytes[r] <= l40s.memory_bytes * 0.9
    assert sum(plan.linear_tokens(r) for r in range(32)) == sum(lengths)
    assert all(plan.node_of_rank[t.src] == plan.node_of_rank[t.dst] for t in plan.remap)


def test_mixed_preset_balances_seconds_not_tokens():
    cluster, model = specs.cluster("h800+h20"), specs.model("llama-7b")
    rng = np.random.default_rng(0)
    lengths = [int(x) for x in rng.integers(300, 8000, size=150)] + [60_000, 40_000]
    plan = plan_batch(lengths, cluster, model)
    res = simulate(plan, cluster, model)
    flat = simulate(plan_batch(lengths, cluster, model, assume_homogeneous=True), cluster, model)
    assert res.step_time_s * 1.3 < flat.step_time_s
    compute = np.array(res.compute_s)
    assert compute.max() / compute.mean() < 1.05  # seconds, not tokens, are level
    lin = [plan.linear_tokens(r) for r in range(32)]
    assert sum(lin[:16]) / sum(lin[16:]) > 3  # the H800 nodes (6.7x the peak) take most tokens


def test_simulator_runs_each_device_at_its_speed_and_bound_is_speed_weighted(half_h100):
    c = two_gpus()
    L = 8192
    plan = Plan(planner="test", lengths=(L, L), node_of_rank=(0, 1), nic_of_rank=(0, 1),
                attention=((Segment(0, 0, L),), (Segment(1, 0, L),))).validate()
    res = simulate(plan, c, MODEL)
    assert res.compute_s[1] == pytest.approx(2 * res.compute_s[0], rel=1e-9)
    # perfect balance: work c0*p + c1*p/2 over total peak 1.5p
    assert res.compute_bound_s == pytest.approx((res.compute_s[0] + res.compute_s[1] / 2) / 1.5, rel=1e-9)
    assert res.step_time_s >= res.compute_s[1]


def test_pcie_node_has_no_cheap_intra_node_ring():
    from ballonet.planning.zeppelin import crossover_lengths

    cluster, model = specs.cluster("a800+l40s"), specs.model("llama-7b")
    a800, l40s = crossover_lengths(cluster, model)
    assert l40s.intra > 5 * a800.intra
    assert breakeven_chunk_tokens(model, hardware.gpu("l40s"), 25e9) * 2 == l40s.intra


@st.composite
def mixed_clusters(draw):
    groups = []
    for gpu in draw(st.lists(st.sampled_from(["h200", "h20", "a800", "l40s", "a10"]), min_size=2, max_size=3,
                             unique=True)):
        gpus = draw(st.sampled_from([1, 2, 4, 8]))
        groups.append(NodeGroup(gpu=gpu, num_nodes=draw(st.integers(1, 3)), gpus_per_node=gpus,
                                nics_per_node=draw(st.sampled_from([d for d in (1, 2, 4, 8) if gpus % d == 0])),
                                nic_gbps=draw(st.sampled_from([100.0, 200.0, 400.0]))))
    return ClusterSpec(name="mixed", groups=tuple(groups))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cluster=mixed_clusters(), assume_homogeneous=st.booleans(),
       lengths=st.lists(st.one_of(st.integers(1, 512), st.integers(1, 300_000)), min_size=1, max_size=40))
def test_mixed_clusters_valid_plans_under_memory_caps(cluster, assume_homogeneous, lengths):
    model = specs.model("llama-3b")
    try:
        plan = plan_batch(lengths, cluster, model, assume_homogeneous=assume_homogeneous)
    except InfeasiblePlan:
        caps = [_token_cap(cluster.gpu_of(r), model, cluster.num_ranks) for r in range(cluster.num_ranks)]
        assert min(caps) < 0 or sum(lengths) > sum(caps) - cluster.num_ranks  # does not fit at all
        return
    plan.validate()
    for r in range(cluster.num_ranks):
        cap = _token_cap(cluster.gpu_of(r), model, cluster.num_ranks)
        assert max(plan.attention_tokens(r), plan.linear_tokens(r)) <= cap + 1


def test_cli_assume_homogeneous(capsys):
    assert main(["plan", "--cluster", "h800+h20", "--tokens-per-gpu", "4096", "--assume-homogeneous", "--json"]) == 0
    import json

    ranks = json.loads(capsys.readouterr().out)["ranks"]
    by_node = {}
    for r in ranks:  # planned as one GPU type: the remap (if it pays) stays inside nodes
        attention, linear = by_node.setdefault(r["node"], ([], []))
        attention.append(r["tokens_attention"])
        linear.append(r["tokens_linear"])
    assert len(by_node) > 1 and all(sum(a) == sum(lin) for a, lin in by_node.values())
    assert main(["plan", "--cluster", "h800+h20", "--tokens-per-gpu", "4096", "--planner", "te_cp",
                 "--assume-homogeneous"]) == 2
    assert "has no option 'assume_homogeneous'" in capsys.readouterr().err
    assert main(["simulate", "--cluster", "h800+h20", "--tokens-per-gpu", "4096", "--planners", "zeppelin",
                 "--assume-homogeneous", "--json"]) == 0


def test_routing_skips_pcie_dispatch_that_costs_more_than_it_saves():
    from ballonet.planning.routing import best_width

    m = 64e6
    pcie = NodeGroup(gpu="l40s", nics_per_node=2, nic_gbps=200)  # 25 GB/s PCIe, 25 GB/s NICs
    # routed over 2 rails: 2 * (m/2) / (25e9 * 0.8) + (m/2) / (25e9 * 0.9) > m / (25e9 * 0.9) direct
    assert best_width(m, 0.0, [0.0, 0.0], (pcie.intra_bw, pcie.intra_bw), pcie.nic_bw) == 1
    nvlink = NodeGroup(gpu="h800", nics_per_node=8, nic_gbps=400)  # 200 GB/s NVLink, 50 GB/s NICs
    # over 8 rails: 2 * (7m/8) / 160e9 + (m/8) / 45e9 = m/91e9 + m/360e9 < m / 45e9
    assert best_width(m, 0.0, [0.0] * 8, (nvlink.intra_bw, nvlink.intra_bw), nvlink.nic_bw) == 8
    # a busy own NIC makes a detour worth it even over PCIe: (m + 2m) / 22.5e9 > m/20e9 + m/45e9
    assert best_width(m, 2 * m, [0.0, 0.0], (pcie.intra_bw, pcie.intra_bw), pcie.nic_bw) == 2


def test_pcie_nodes_keep_their_tokens_and_balance_attention_plus_linear():
    model = specs.model("llama-7b")
    cluster = tight(specs.cluster("a800+l40s"), model)
    pcie = {r for r in range(cluster.num_ranks) if cluster.gpu_of(r).intra_link == "pcie"}
    # A batch where the remap pays on the NVLink nodes: they even their tokens, the PCIe
    # nodes keep theirs (under selective recomputation; with the linear layers recomputed
    # on every layer, keeping tokens prices the same and is kept).
    lengths = list(workloads.get("prolong").batches(4096 * cluster.num_ranks, 3, 1, 65536))[0]
    plan = plan_batch(lengths, cluster, dataclasses.replace(model, recompute="selective"))
    assert pcie and plan.remap and not any(t.src in pcie or t.dst in pcie for t in plan.remap)
    # One where every rank keeping its tokens prices shorter: attention plus linear work
    # balanced per rank, PCIe nodes included.
    lengths = list(workloads.get("wlbllm").batches(16384 * cluster.num_ranks, 0, 1, 65536))[0]
    plan = plan_batch(lengths, cluster, model)
    assert not any(t.src in pcie or t.dst in pcie for t in plan.remap)
    res = simulate(plan, cluster, model)
    compute = np.array(res.compute_s)
    assert compute.max() / compute.mean() < 1.05
    for name in ("te_cp", "hybrid_dp", "wlb_llm", "megatron_hcp"):
        assert res.step_time_s <= simulate(plan_batch(lengths, cluster, model, planner=name), cluster, model).step_time_s


def test_cost_prices_each_gpu_type_of_a_mixed_cluster(tmp_path, capsys):
    def cost(*argv):
        assert main(["cost", "--length", "32768", "--json", *argv]) == 0
        return json.loads(capsys.readouterr().out)

    mixed = cost("--cluster", "h800+h20")
    assert [g["gpu"] for g in mixed["gpus"]] == ["h800", "h20"]
    # each type as a one-type cluster of its group's nodes prices it
    for gpu, nics, gbps in (("h800", 8, 400), ("h20", 4, 200)):
        alone = tmp_path / f"{gpu}.toml"
        alone.write_text(f'[[node_groups]]\ngpu = "{gpu}"\nnum_nodes = 2\nnics_per_node = {nics}\nnic_gbps = {gbps}\n')
        expected = dict(cost("--cluster", str(alone)), cluster="h800+h20")
        assert next(g for g in mixed["gpus"] if g["gpu"] == gpu) == expected
        assert cost("--cluster", "h800+h20", "--gpu", gpu) == expected
    assert main(["cost", "--length", "1024", "--cluster", "h800+h20", "--gpu", "a100"]) == 2
    assert "--gpu a100: cluster 'h800+h20' has no such GPU (it has h800, h20)" in capsys.readouterr().err


def test_bound_splits_each_kind_of_work_by_each_group_own_seconds():
    """Two GPUs, two kinds of work, one unit each. GPU A takes 1 s for either; GPU B takes
    4 s for the first, 2 s for the second. Best split by hand: A does the first and 1-x
    of the second, B does x of it: 1 + (1 - x) = 2x, x = 2/3, 4/3 s. Pooled as one GPU
    type at the best per-kind seconds (the former bound) it was (1 + 1) / 2 = 1 s."""
    from ballonet.cost.bounds import _least_max
    costs = np.array([[1.0, 1.0], [4.0, 2.0]])
    got = _least_max(costs, np.ones(2), np.ones(2), np.zeros(2), np.ones(2))
    assert 4 / 3 * (1 - 1e-3) <= got <= 4 / 3 * (1 + 1e-12)
    # a fixed second on A moves the level: 2 + (1 - x) = 2x -> x = 1, 2 s (B could take nothing more)
    got = _least_max(costs, np.ones(2), np.ones(2), np.array([1.0, 0.0]), np.ones(2))
    assert 2 * (1 - 1e-3) <= got <= 2 * (1 + 1e-12)


def test_lower_bound_keeps_each_groups_memory():
    """Two H100s, one left no room for activations (30 GB: llama-3b's weights, gradients
    and Adam shard over 2 ranks are 32 GB): it cannot hold a single token in the linear
    layout, so the GEMMs and elementwise work of every layer fall on the other, which
    holds the batch without recomputation. Pooled memory would split them in two."""
    from ballonet.cost.bounds import batch_lower_bound

    c = ClusterSpec(name="roomy+cramped", groups=(NodeGroup(gpu="h100", gpus_per_node=1),
                                                  NodeGroup(gpu="h100", gpus_per_node=1, memory_gb=30)))
    lengths = [1024] * 8
    T = 8192
    p = hardware.profile("h100")
    best_l = max(e for t, e in zip(p.linear.tokens, p.linear.efficiency) if t <= T)
    best_e = max(e for t, e in zip(p.elementwise.tokens, p.elementwise.efficiency) if t <= T)
    h, f = 3200, 8640
    lin = 2 * (4 * h**2 + 3 * h * f)  # QKV (no GQA), output projection, SwiGLU: FLOPs a token
    layer_bytes = (4 * h + 2 * (h + h) + 3 * f + 6 * h) * 2  # elementwise bytes a token (see test_sim_truth)
    layers = 26 * T * (3 * lin / (989e12 * best_l) + 3 * layer_bytes / (p.memory_bw * best_e))
    # Attention too: a GPU runs a document's attention only where it holds its queries'
    # attention layout, which the cramped one cannot (`cost.layout_bound`).
    att = 8 * 2 * h * 1024 * 1025
    layers += 26 * att / 989e12 * (1 / p.attention_forward.at(1024) + 2.5 / p.attention_backward.at(1024))
    # The roomy GPU runs every layer's work and the LM head and loss over its linear
    # tokens: 2 h V FLOPs a token forward; the final norm, the logits cast to fp32 and
    # log-softmax, 2 h 2 + V (2 + 4) + 2 V 4 bytes (at 8192 tokens, both curves' peak).
    head = T * (3 * 2 * h * 32000 / (989e12 * best_l) + 3 * (4 * h + 6 * 32000 + 8 * 32000) / (p.memory_bw * best_e))
    # Each pays its optimizer half and framework.
    fixed = MODEL.num_params / 2 * p.optimizer_s_per_param + 26 * p.framework_s_per_layer
    expected = layers + head + fixed
    got = batch_lower_bound(lengths, c, MODEL, communication=False)
    assert got == pytest.approx(expected, rel=2e-3)
    assert got <= expected * (1 + 1e-9)  # a lower bound never passes the optimum
    pooled = (layers + fixed * 2) / 2  # what pooling both GPUs' memory allowed at most
    assert got > pooled * 1.3


def test_no_planner_beats_the_per_group_memory_bound():
    """Where a group's own memory binds (4 H100s of 45 GB beside 4 of 80 GB: every plan
    recomputes fully), the bound rises above the pooled one and still no planner's
    slowest rank, nor its step, is below it."""
    from ballonet.cost.bounds import batch_lower_bound, bound_parts

    c = ClusterSpec(name="roomy+cramped", groups=(NodeGroup(gpu="h100", gpus_per_node=4),
                                                  NodeGroup(gpu="h100", gpus_per_node=4, memory_gb=45)))
    m = specs.model("llama-7b")
    c = tight(c, m)
    lengths = next(iter(workloads.get("wlbllm").batches(24000 * 8, 1, 1, 65536)))
    pooled, held = bound_parts(lengths, c, m, communication=False)
    assert held > pooled * 1.1
    bound = batch_lower_bound(lengths, c, m, communication=False)
    for name in ("zeppelin", "te_cp", "packed_dp", "hybrid_dp"):
        res = simulate(plan_batch(lengths, c, m, name), c, m)
        assert max(res.compute_s) >= bound, name
        assert res.step_time_s >= res.lower_bound_s, name
