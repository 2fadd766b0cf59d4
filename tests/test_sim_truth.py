"""One truth for simulator and runtime, and a bound no plan beats.

* The bytes the simulator moves, per transfer class and (src, dst) pair, equal the
  runtime's own prediction (`runtime.routing.predicted_bytes` for ring K/V and dK/dV,
  `runtime.remapping.predicted_bytes` for the remaps of q/k/v and o) for every planner;
  those predictions are checked against bytes counted on real gloo runs in
  tests/test_attention.py and tests/test_remap.py.
* The bytes of the tensor-parallel collectives the simulator prices (`SimResult.tp_bytes`)
  equal what DTensor sends, counted on 4 gloo ranks (tp 2 x 2 plan ranks) under every
  recomputation mode; and what a TP rank holds beyond 1/tp of one process's is what the
  memory model says it holds.
* `lower_bound_s` is the same for every planner on a batch, and no planner's simulated
  step is below it.
"""

import dataclasses
from collections import Counter

import pytest
import torch
from distributed import run_ranks
from runtime_traffic import runtime_bytes
from tiny_model import batch
from tp_mesh import tp_groups

import ballonet
from ballonet import workloads
from ballonet.cost import hardware, memory
from ballonet.cost.bounds import batch_lower_bound, batch_recomputation, bound_parts
from ballonet.cost.flops import grad_bytes
from ballonet.plan import Plan, Segment
from ballonet.planning import PLANNERS, plan_batch
from ballonet.simulation import simulate
from ballonet.specs import ClusterSpec, NodeGroup
from ballonet.training.parallelism import parallel, tensor_parallel
from ballonet.training.parallelism.model import Transformer

CONFIGS = [
    # (cluster, nodes, model, lengths)
    ("cpu", 2, "tiny", [700, 90, 2300, 40, 1200, 600, 310, 3900, 25, 800]),
    ("h800-8nic", 2, "llama3-8b", [40000, 3000, 800, 12000, 500, 2500, 7000, 300, 1500, 20000] * 3),
    ("a800-4nic", 2, "llama-7b", [30000, 1000, 200, 9000, 4000, 600, 16000, 2200, 120, 5000] * 2),
    # tensor parallelism on a mixed cluster: the bound's TP collectives on the cheaper group
    ("h800+h20", None, "llama-13b:2", [50000, 3000, 900, 14000, 600, 2500, 8000, 300, 1800, 26000] * 3),
    # a "double" ring of 2 nodes x 8 ranks (zeppelin's plan; with `double=False`, a single ring)
    ("h800-8nic", 2, "llama-7b", [80000] + [1200] * 160),
    # a 64K document split by heads over 8 PCIe-only L40S (bench/hetero.py's a800+l40s wlbllm batch 6)
    ("a800+l40s", None, "llama-7b", list(workloads.get("wlbllm").batches(16384 * 32, 0, 7, 65536))[6]),
]


def _planned(cluster_name, nodes, model_name, lengths):
    name, _, tp = model_name.partition(":")
    c, m = ballonet.cluster(cluster_name, num_nodes=nodes), ballonet.model(name, tp=int(tp or 1))
    for name, options in [(n, {}) for n in PLANNERS] + [("zeppelin single", {"double": False})]:
        try:
            yield name, c, m, plan_batch(lengths, c, m, name.split()[0], **options)
        except ballonet.InfeasiblePlan:
            continue


@pytest.mark.parametrize("config", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_simulator_moves_exactly_the_runtime_bytes_for_every_planner(config):
    seen, comms = set(), set()
    for name, c, m, plan in _planned(*config):
        res = simulate(plan, c, m)
        expected = runtime_bytes(plan, m)
        for phase in ("forward", "backward"):
            sim = Counter({k: v for k, v in res.bytes_sent[phase].items() if k[0] != "allreduce"})
            if plan.meta.get("kv_prefix"):
                # Priced as MagiAttention / DistCA send K/V (only the rows each member's
                # queries attend to, `layer_graph.prefix_rows`), not as the runtime's
                # all-gather sends whole blocks: never more, pair by pair; the remap exact.
                for key in set(sim) | set(expected[phase]):
                    if key[0] == "remap":
                        assert sim[key] == pytest.approx(expected[phase][key]), (name, phase, key)
                    else:
                        assert sim[key] <= expected[phase][key] * (1 + 1e-12), (name, phase, key)
                continue
            assert sim == expected[phase], (name, phase)
        seen.add(name)
        comms.update(f"{name} {r.comm}" for r in plan.rings)
    assert {"zeppelin", "zeppelin single", "te_cp", "packed_dp", "wlb_llm", "hybrid_dp"} <= seen
    if config is CONFIGS[-2]:
        assert "zeppelin double" in comms and "zeppelin single double" not in comms
    if config is CONFIGS[-1]:
        assert "zeppelin heads" in comms


@pytest.mark.parametrize("config", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_no_planner_beats_the_batch_lower_bound(config):
    bounds, steps = set(), {}
    for name, c, m, plan in _planned(*config):
        res = simulate(plan, c, m)
        bounds.add(res.lower_bound_s)
        steps[name] = res.step_time_s
        assert res.step_time_s >= res.lower_bound_s > 0, name
        # the plan's compute spread by peak FLOP/s ignores each group's own memory: the pooled part
        assert res.compute_bound_s >= bound_parts(plan.lengths, c, m, communication=False)[0] * (1 - 1e-12), name
        assert max(res.compute_s) >= batch_lower_bound(plan.lengths, c, m, communication=False), name
        assert res.lower_bound_s >= batch_lower_bound(plan.lengths, c, m, communication=False)
    assert len(bounds) == 1 and len(steps) >= 5


def test_lower_bound_by_hand_on_one_gpu():
    # One document on one GPU: the bound is its FLOPs at the profile's best efficiencies.
    c = ClusterSpec(name="one", groups=(NodeGroup(gpu="h100", num_nodes=1, gpus_per_node=1, nics_per_node=1),))
    m = ballonet.model("llama-3b")
    L = 2048
    p = hardware.profile("h100")
    best_f = max(e for t, e in zip(p.attention_forward.tokens, p.attention_forward.efficiency) if t <= L)
    best_b = max(e for t, e in zip(p.attention_backward.tokens, p.attention_backward.efficiency) if t <= L)
    best_l = max(e for t, e in zip(p.linear.tokens, p.linear.efficiency) if t <= L)
    att = 2 * 3200 * L * (L + 1)
    lin = 2 * (4 * 3200**2 + 3 * 3200 * 8640) * L
    head = 2 * 32000 * 3200 * L
    mode = batch_recomputation([L], c, m)[0]
    assert mode == "none"  # 2K tokens of llama-3b fit an H100 without recomputation
    work = 26 * (att / best_f + 2.5 * att / best_b + 3 * lin / best_l) + 3 * head / best_l
    # Elementwise bytes a token, forward (bf16): per layer 2 norms (2*2h), rotary on q and k
    # (2*(h+kv)), silu*up (3f), 2 residual adds (2*3h); the loss: final norm (2h), the
    # fp32 cast (V bf16 + V fp32) and log-softmax (2V fp32). Backward 2x. The best
    # elementwise efficiency up to 2048 tokens is the curve between its 1024 and 8192 knots.
    h, f, V = 3200, 8640, 32000
    layer_bytes = (4 * h + 2 * (h + h) + 3 * f + 6 * h) * 2
    loss_bytes = 2 * h * 2 + V * (2 + 4) + 2 * V * 4
    knots = dict(zip(p.elementwise.tokens, p.elementwise.efficiency))
    best_e = knots[1024] + (knots[8192] - knots[1024]) * (11 - 10) / (13 - 10)
    elementwise = 3 * (26 * layer_bytes + loss_bytes) * L / (p.memory_bw * best_e)
    optimizer = m.num_params * p.optimizer_s_per_param + 26 * p.framework_s_per_layer  # one rank holds all
    expected = work / 989e12 + elementwise + optimizer
    assert batch_lower_bound([L], c, m) == pytest.approx(expected, rel=1e-9)


def test_lower_bound_adds_the_collectives_no_plan_escapes():
    # Two GPUs, one TP group: every token crosses 2 all-gathers and 2 reduce-scatters of
    # its hidden states a layer and pass (half of them leave each GPU); the last layer's
    # gradient bucket (reduce-scatter and all-gather over the node) is never hidden.
    c = ClusterSpec(name="two", groups=(NodeGroup(gpu="h100", num_nodes=1, gpus_per_node=2, nics_per_node=1),))
    m = ballonet.model("llama-3b", tp=2)
    lengths = [8192, 4096]  # from the GEMMs' peak count on: the busiest rank's head at its own efficiency
    p, bw = hardware.profile("h100"), c.groups[0].intra_bw
    half_a_token = 3200 * 2 / 2 / bw
    tp = 26 * 2 * (half_a_token / p.collective_efficiency["all_gather"]
                   + half_a_token / p.collective_efficiency["reduce_scatter"])
    grad = grad_bytes(m)
    bucket = sum(p.collective_latency_s + grad / 2 / (bw * p.collective_efficiency[op])
                 for op in ("reduce_scatter", "all_gather")) / 26
    # The one rank's head adds its own: the embedding's and the head's all-gather and
    # reduce-scatter of 12288 tokens' hidden states, the loss's three all-reduces of fp32
    # losses and the 53 norms' gradient all-reduces (twice half the bytes leave each GPU).
    lat, ar = p.collective_latency_s, p.collective_efficiency["all_reduce"]
    head = (2 * sum(lat + 12288 * half_a_token / p.collective_efficiency[op] for op in ("all_gather", "reduce_scatter"))
            + 3 * (lat + 12288 * 4 / bw / ar) + 53 * (lat + 3200 * 2 / bw / ar))
    compute = batch_lower_bound(lengths, c, m, communication=False)
    assert batch_lower_bound(lengths, c, m) == pytest.approx(compute + 2 * tp * 12288 + bucket + head, rel=1e-9)
    one = ClusterSpec(name="one", groups=(NodeGroup(gpu="h100", num_nodes=1, gpus_per_node=1, nics_per_node=1),))
    m1 = ballonet.model("llama-3b")
    assert batch_lower_bound(lengths, one, m1) == pytest.approx(batch_lower_bound(lengths, one, m1, False),
                                                                rel=1e-12)


def test_lower_bound_adds_what_the_layers_collectives_slow():
    # Every rank sends its FSDP shard's collectives beside each layer's forward and
    # backward, whatever the plan; the simulator slows compute by the GPU's overlap
    # slowdown times those seconds (the rank's compute is far longer): read off a
    # simulated layer's timelines, L times that is what the bound adds to the pooled one.
    c, m = ballonet.cluster("h800-8nic", num_nodes=2), ballonet.model("llama3-8b")
    lengths = CONFIGS[1][3]
    res = simulate(plan_batch(lengths, c, m, "packed_dp"), c, m)
    sends = sum(tl.duration[t] for _, tl, *_ in res.timelines for t in range(tl.num_tasks)
                if tl.label[t] == ("send", 0, "data-parallel collectives"))
    pooled, _ = bound_parts(lengths, c, m)
    slow = hardware.profile(c.groups[0].gpu_type).overlap_slowdown * sends * m.num_layers
    assert slow > 0.005 * pooled
    assert batch_lower_bound(lengths, c, m) == pytest.approx(pooled + slow, rel=1e-6)


def test_te_cp_is_sized_to_the_context_as_a_megatron_user_sizes_it():
    c, m = ballonet.cluster("h800-8nic", num_nodes=2), ballonet.model("llama3-8b")  # 16 ranks
    lengths = [30000] + [2000] * 49  # 128000 tokens: 8000 a rank, the context needs 30000 / 8000 -> 4
    plan = plan_batch(lengths, c, m, "te_cp")
    assert plan.meta["cp_size"] == 4
    assert all(len(r.ranks) == 4 and r.ranks[0] % 4 == 0 for r in plan.rings)  # 4 data-parallel CP groups
    whole = plan_batch(lengths, c, m, "te_cp", cp_size=16)
    assert {len(r.ranks) for r in whole.rings} == {16}
    short = plan_batch([3000] * 40, c, m, "te_cp")  # every document fits a rank's share: no CP
    assert short.meta["cp_size"] == 1 and not short.rings


def test_elementwise_framework_and_optimizer_terms_move_the_step_by_what_the_profile_says():
    # One rank, one document: the simulated compute with the profile's step terms, less the
    # same with them switched off, is the profile's figures times counts written out here.
    import dataclasses
    import math

    from ballonet import calibration
    from ballonet.calibration import Curve
    from ballonet.plan import Plan, Segment

    c, m, T = ballonet.cluster("cpu", num_nodes=1, gpus_per_node=1), ballonet.model("tiny"), 3000
    plan = Plan(planner="t", lengths=(T,), node_of_rank=(0,), nic_of_rank=(0,), attention=((Segment(0, 0, T),),))
    base = hardware.profile("cpu")
    on = dataclasses.replace(base, elementwise=Curve(tokens=(1,), efficiency=(0.25,)), memory_bw=8e9,
                             framework_s_per_layer=0.004, optimizer_s_per_param=2e-7)
    off = dataclasses.replace(on, memory_bw=math.inf, framework_s_per_layer=0.0, optimizer_s_per_param=0.0)
    results = {}
    for name, profile in (("on", on), ("off", off)):
        with calibration.use(profile):
            results[name] = simulate(plan, c, m)
    assert results["on"].recompute == results["off"].recompute == "none"
    h, kv, f, V = 64, 32, 176, 256  # fp32: 4 bytes an element
    layer_bytes = (2 * 2 * h + 2 * (h + kv) + 3 * f + 2 * 3 * h) * 4
    loss_bytes = 2 * h * 4 + V * (4 + 4) + 2 * V * 4
    elementwise = 3 * (2 * layer_bytes + loss_bytes) * T / (8e9 * 0.25)  # 2 layers, backward 2x
    framework = 2 * 0.004
    optimizer = m.num_params * 2e-7
    moved = elementwise + framework + optimizer
    assert results["on"].compute_s[0] - results["off"].compute_s[0] == pytest.approx(moved, rel=1e-9)
    assert results["on"].step_time_s - results["off"].step_time_s == pytest.approx(moved, rel=1e-9)
    assert results["on"].optimizer_s == pytest.approx(optimizer, rel=1e-9)
    for r in results.values():
        assert r.step_time_s >= r.lower_bound_s * (1 - 1e-12)


# ---- tensor parallelism: simulator against DTensor -------------------------------------


def _tp_cases() -> list:
    """(plan, model spec) pairs at tp 2 on one node of 4 GPUs: zeppelin's plan (its plan
    ranks hold 154 and 153 tokens: the second pads to 154), te_cp's, and each
    recomputation mode (selective and linear on the first layer only)."""
    cluster, spec = ballonet.cluster("cpu", num_nodes=1, gpus_per_node=4), ballonet.model("tiny", tp=2)
    lengths = (200, 3, 5, 8, 12, 6, 30, 2, 41)
    zeppelin, te_cp = (plan_batch(lengths, cluster, spec, p) for p in ("zeppelin", "te_cp"))
    modes = [dict(recompute="none"), dict(recompute="selective", recompute_layers=1),
             dict(recompute="linear", recompute_layers=1), dict(recompute="full")]
    return [(zeppelin, dataclasses.replace(spec, **m)) for m in modes] + [(te_cp, spec)], cluster


TP, SPEC = 2, ballonet.model("tiny")


def _tp_on_ranks(rank: int, world: int, cases: list) -> dict:
    """Per case, (plan rank, the bytes this rank's TP collectives sent per (phase, op)),
    recomputing as the simulator has its plan rank recompute; and (rank 0) what a TP rank
    holds (`_memory`)."""
    from ballonet import runtime

    mesh, plan_rank, group, outer = tp_groups(world, TP)
    sent = []
    for plan, spec, per_rank in cases:
        model = tensor_parallel.parallelize_transformer(Transformer(SPEC, seed=1), mesh["tp"])
        model.set_recompute(*per_rank[plan_rank])
        parallel.parallelize(model, mesh)
        tokens, labels = batch(plan.lengths)
        index, counter = runtime.token_index(plan, plan_rank), runtime.ByteCounter()
        with tensor_parallel.loss_context(model), tensor_parallel.count_collectives(counter):
            model.loss(tokens[index], labels[index], plan, plan_rank, group, outer_group=outer).backward()
        sent.append((plan_rank, dict(counter.collectives)))
    held = _memory(mesh)
    return {"sent": sent, "held": held if rank == 0 else None}


def _held(model, plan: Plan) -> dict[str, int]:
    """Per recomputation mode, bytes this rank holds for the backward (autograd's saved
    tensors, each storage once, parameters left out) of `plan`'s batch."""
    params = {(p.to_local() if hasattr(p, "to_local") else p).untyped_storage().data_ptr() for p in model.parameters()}
    tokens, labels = batch(plan.lengths)
    out = {}
    for mode in memory.RECOMPUTE_MODES:
        model.set_recompute(mode)
        held = {}

        def pack(t):
            local = t.to_local() if hasattr(t, "to_local") else t
            local = getattr(local, "elem", local)  # an async collective's result
            ptr = local.untyped_storage().data_ptr()
            if ptr not in params:
                held[ptr] = local.untyped_storage().nbytes()
            return t

        with tensor_parallel.loss_context(model), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model.loss(tokens, labels, plan, 0)
        out[mode] = sum(held.values())
    return out


def _memory(mesh) -> dict:
    """What one TP rank holds (parameters, and for the backward per layer: 3 layers less
    2) on a one-rank plan its TP group runs alone, and the same unsharded."""
    lengths = (300, 200, 12)
    plan = Plan(planner="hand", lengths=lengths, node_of_rank=(0,), nic_of_rank=(0,),
                attention=(tuple(Segment(d, 0, n) for d, n in enumerate(lengths)),))
    out = {}
    for tp in (1, TP):
        held = {}
        for layers in (2, 3):
            model = Transformer(dataclasses.replace(SPEC, num_layers=layers), seed=3)
            if tp > 1:
                tensor_parallel.parallelize_transformer(model, mesh["tp"])
            held[layers] = _held(model, plan)
        out[tp] = {"params": parallel.local_parameter_bytes(model),
                   "layer": {m: held[3][m] - held[2][m] for m in held[2]}}
    return out




def _check_memory(holds: dict) -> None:
    """What a TP rank holds beyond 1/tp of what one process holds, for the backward per
    layer, is what the cost model says it holds beyond 1/tp: the normed inputs that
    sequence parallelism gathers (`cost.memory.activation_bytes`), and the rotary tables
    (cos and sin [T, 1, D] for q and for k), which the cost model leaves out at any tp,
    where they are held (not recomputed). Parameters: 1/tp of each but the norms'."""
    T, D, fp32 = 512, SPEC.head_dim, 4
    layer = {tp: dataclasses.replace(SPEC, tp=tp) for tp in (1, TP)}

    def model_per_layer(spec, mode):
        return (memory.activation_bytes(dataclasses.replace(spec, num_layers=3), T, T, mode)
                - memory.activation_bytes(dataclasses.replace(spec, num_layers=2), T, T, mode))

    for mode in memory.RECOMPUTE_MODES:
        held = holds[TP]["layer"][mode] - holds[1]["layer"][mode] / TP
        rope = 4 * D * T * fp32 * (1 - 1 / TP) if mode in ("none", "selective") else 0
        model = model_per_layer(layer[TP], mode) - model_per_layer(layer[1], mode) / TP
        assert held == pytest.approx(model + rope, abs=1e-6), (mode, held, model, rope)
    assert holds[TP]["layer"]["none"] < holds[1]["layer"]["none"] * 0.6
    norms = (2 * 3 + 1) * SPEC.hidden * fp32
    assert holds[TP]["params"] == (holds[1]["params"] - norms) / TP + norms


@pytest.mark.slow
def test_simulator_and_memory_model_price_what_tensor_parallelism_sends_and_holds():
    cases, cluster = _tp_cases()
    results = [simulate(plan, cluster, spec) for plan, spec in cases]
    assert cases[0][0].linear_token_counts == (154, 153)
    assert [r.recompute_per_rank[0] for r in results] == [("none", 0), ("selective", 1), ("linear", 1), ("full", 2),
                                                          ("none", 0)]
    runs = run_ranks(4, _tp_on_ranks, [(p, s, r.recompute_per_rank) for (p, s), r in zip(cases, results)],
                     timeout=600)
    for run in runs:
        for (plan, spec), res, (plan_rank, counted) in zip(cases, results, run["sent"]):
            simulated = {(phase, op): n for phase, c in res.tp_bytes.items() for (op, r), n in c.items()
                         if r == plan_rank}
            assert counted == simulated, (spec.recompute, plan.planner, plan_rank)
    assert runs[0]["sent"][1][1] != runs[0]["sent"][0][1]  # recomputation reruns gathers
    _check_memory(runs[0]["held"])
