"""The attention engine against a single-process reference on the unsharded batch.

Hand-built plans (te_cp-like, llama_cp-like, packed, mixed, random) and planner plans run
on 1, 2 and 4 gloo ranks (4 = 2 nodes x 2); each rank checks its rows of the output and
of the q, k, v gradients, and the bytes sent are checked against the plan's prediction.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import run_ranks

import ballonet
from ballonet.plan import Plan, Ring, Segment, chunk_bounds
from ballonet.planning.assembly import zigzag_bounds
from ballonet.runtime import ByteCounter, attention, token_index
from ballonet.runtime.ring import ring_meta
from ballonet.runtime.routing import predicted_bytes

H, H_KV, D = 4, 2, 8
NODES = {1: (0,), 2: (0, 1), 4: (0, 0, 1, 1)}
PLANNERS = ("zeppelin", "te_cp", "llama_cp", "hybrid_dp")
PLANNER_LENGTHS = [300, 180, 37, 1, 5, 64, 9, 120, 2]


def make_plan(lengths, placement, node_of_rank, comms=None, seed=None, groups=None, tokens=None) -> Plan:
    """placement[d]: a rank (document d whole there) or a tuple of ranks (its ring, in
    order); comms[d]: that ring's comm; groups[d]: that ring is "double" over so many node
    groups; tokens[d]: its tokens per position (`zigzag_bounds`; default: even chunks).
    With `seed`, each rank's units (a local document, or the chunk pair of a ring) are
    shuffled."""
    units = [[] for _ in node_of_rank]
    rings = []
    for d, (length, where) in enumerate(zip(lengths, placement)):
        if isinstance(where, int):
            units[where].append((Segment(d, 0, length),))
            continue
        nodes = {node_of_rank[r] for r in where}
        k = (groups or {}).get(d, 1)
        bounds = zigzag_bounds(length, tokens[d]) if d in (tokens or {}) else chunk_bounds(length, 2 * len(where))
        ring = Ring(doc=d, kind="inter" if len(nodes) > 1 else "intra", ranks=tuple(where), bounds=bounds,
                    comm="double" if k > 1 else (comms or {}).get(d, "ring"), groups=k)
        rings.append(ring)
        for i, r in enumerate(where):
            units[r].append(ring.chunks_of(i))
    if seed is not None:
        for u in units:
            random.Random(seed).shuffle(u)
    return Plan(planner="hand", lengths=tuple(lengths), node_of_rank=tuple(node_of_rank),
                nic_of_rank=tuple(range(len(node_of_rank))),
                attention=tuple(tuple(s for unit in u for s in unit) for u in units), rings=tuple(rings)).validate()


def hand_plans(world: int) -> dict[str, Plan]:
    nodes, ranks = NODES[world], tuple(range(world))
    lengths = [13, 1, 7, 2 * world + 1, 30, 3]
    plans = {
        "te_cp": make_plan(lengths, [ranks] * len(lengths), nodes),
        "llama_cp": make_plan(lengths, [ranks] * len(lengths), nodes, comms=dict.fromkeys(range(len(lengths)), "allgather")),
        "packed": make_plan(lengths, [d % world for d in range(len(lengths))], nodes),
    }
    for seed in range(3):
        rng = random.Random(100 * world + seed)
        lengths = [rng.choice([1, rng.randint(2, 9), rng.randint(10, 45)]) for _ in range(rng.randint(4, 8))]
        placement, comms = [], {}
        for d in range(len(lengths)):
            if rng.random() < 0.4:
                placement.append(rng.randrange(world))
            else:
                placement.append(tuple(rng.sample(ranks, rng.randint(1, world))))
                comms[d] = rng.choice(["ring", "ring", "allgather"])
        plans[f"random{seed}"] = make_plan(lengths, placement, nodes, comms, seed=seed)
    return plans


def planner_plans() -> dict[str, Plan]:
    cluster, model = ballonet.cluster("cpu", num_nodes=2, gpus_per_node=2), ballonet.model("tiny")
    whole = {"cp_size": cluster.num_ranks}  # CP over the whole cluster, so their rings cross nodes
    plans = {name: ballonet.plan_batch(PLANNER_LENGTHS, cluster, model, planner=name,
                                       **(whole if name in ("te_cp", "llama_cp") else {})) for name in PLANNERS}
    plans["zeppelin (intra)"] = ballonet.plan_batch([400, 300, 200, 37, 1, 5, 64, 9, 2], cluster, model)
    return plans


# ---- the reference ---------------------------------------------------------------------


def reference(q, k, v, dout, lengths, math: bool):
    """out, dq, dk, dv of causal per-document attention on the whole batch: in float64
    plain math (`math`), or torch SDPA in the inputs' dtype (the bf16 yardstick: what one
    process computes on the unsharded batch in bf16)."""
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    outs, start = [], 0
    for n in lengths:
        qd, kd, vd = (x[start:start + n].transpose(0, 1) for x in (q, k, v))
        if math:
            kd, vd = (x.repeat_interleave(H // H_KV, dim=0) for x in (kd, vd))
            s = (qd @ kd.transpose(1, 2)) / D ** 0.5
            s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
            outs.append((torch.softmax(s, dim=-1) @ vd).transpose(0, 1))
        else:
            # 4-d, so SDPA runs its bf16 flash kernel (3-d inputs take the fp32 math path).
            out = F.scaled_dot_product_attention(qd[None], kd[None], vd[None], is_causal=True, enable_gqa=True)
            outs.append(out[0].transpose(0, 1))
        start += n
    out = torch.cat(outs)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _max_err(a, b) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def _run(plan, rank, inputs, dtype, kernel=None, counter=None, outer_group=None):
    idx = token_index(plan, rank)
    q, k, v, dout = (x[idx].to(dtype) for x in inputs)
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    out = attention(q, k, v, plan, rank, kernel=kernel, counter=counter, outer_group=outer_group)
    out.backward(dout)
    return idx, (out.detach(), q.grad, k.grad, v.grad)


def _check_plan(name, plan, rank, world, outer_group=None):
    """[(check, error, tolerance)] for one plan on this rank (`outer_group`: as in
    `attention`)."""
    gen = torch.Generator().manual_seed(len(name) + plan.num_tokens)
    N = plan.num_tokens
    inputs = [torch.randn(N, h, D, generator=gen) for h in (H, H_KV, H_KV, H)]  # q, k, v, dout
    rows = []
    ref32 = reference(*(x.double() for x in inputs), plan.lengths, math=True)
    counter = ByteCounter()
    for kernel in ("cpu", "reference"):
        idx, got = _run(plan, rank, inputs, torch.float32, kernel, counter if kernel == "cpu" else None,
                        outer_group)
        for what, a, b in zip("out dq dk dv".split(), got, ref32):
            rows.append((f"{name} fp32 {kernel} {what}", _max_err(a, b[idx]), 1e-5))
    # bf16: no worse than twice the error of the unsharded computation in bf16.
    bf = [x.bfloat16() for x in inputs]
    ref_bf = reference(*(x.double() for x in bf), plan.lengths, math=True)
    yard = reference(*bf, plan.lengths, math=False)
    idx, got = _run(plan, rank, bf, torch.bfloat16, outer_group=outer_group)
    for what, a, b, y in zip("out dq dk dv".split(), got, ref_bf, yard):
        rows.append((f"{name} bf16 {what}", _max_err(a, b[idx]), 2 * _max_err(y, b)))
    # Bytes: every rank's sends, summed, equal the plan's prediction exactly.
    counters = [None] * world
    dist.all_gather_object(counters, counter)
    total = counters[0]
    for c in counters[1:]:
        total = total.merge(c)
    predicted = predicted_bytes(plan, H_KV, D, torch.float32)
    for phase in ("forward", "backward"):
        got_bytes, want = getattr(total, phase), getattr(predicted, phase)
        rows.append((f"{name} bytes {phase} {dict(got_bytes)} vs {dict(want)}", float(got_bytes != want), 0.0))
    return rows


def _check_all(rank, world, plans):
    rows = []
    for name, plan in plans.items():
        rows += _check_plan(name, plan, rank, world)
    if world > 1:  # a rank with another plan fails loudly on every rank
        plan = plans["te_cp"] if rank != 1 else plans["packed"]
        idx = token_index(plan, rank)
        try:
            attention(torch.zeros(len(idx), H, D), torch.zeros(len(idx), H_KV, D), torch.zeros(len(idx), H_KV, D),
                      plan, rank)
            rows.append(("mismatch raised", 1.0, 0.0))
        except RuntimeError as e:
            rows.append((f"mismatch message: {e}", float("disagree" not in str(e) or "[1]" not in str(e)), 0.0))
    return rows


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 4])
def test_engine_matches_reference(world):
    plans = hand_plans(world)
    if world == 4:
        plans.update({f"planner {k}": v for k, v in planner_plans().items()})
        kinds = {(r.kind, r.comm) for p in plans.values() if p.planner != "hand" for r in p.rings}
        assert kinds == {("inter", "ring"), ("intra", "ring"), ("inter", "allgather")}
    results = run_ranks(world, _check_all, plans)
    bad = [f"rank {r}: {check}: {err:.3g} > {tol:.3g}" for r, rows in enumerate(results)
           for check, err, tol in rows if not err <= tol]
    assert not bad, "\n".join(bad)
    assert len(results[0]) >= 10 * len(plans)


# ---- single process: world size 1 without torch.distributed, metadata, predictions -----


def test_one_rank_without_process_group():
    plan = make_plan([9, 1, 4], [0, (0,), 0], (0,), seed=1)  # (0,): a ring of one
    inputs = [torch.randn(plan.num_tokens, h, D) for h in (H, H_KV, H_KV, H)]
    idx, got = _run(plan, 0, inputs, torch.float32)
    for a, b in zip(got, reference(*(x.double() for x in inputs), plan.lengths, math=True)):
        assert _max_err(a, b[idx]) <= 1e-5


def test_wrong_shapes_are_refused():
    plan = make_plan([5], [0], (0,))
    with pytest.raises(ValueError, match="5 tokens"):
        attention(torch.zeros(4, H, D), torch.zeros(4, H_KV, D), torch.zeros(4, H_KV, D), plan, 0)
    with pytest.raises(ValueError, match="multiple"):
        attention(torch.zeros(5, 3, D), torch.zeros(5, 2, D), torch.zeros(5, 2, D), plan, 0)


def test_step_calls_follow_document_offsets():
    # Length 8 over 2 ranks: chunks [0,2) [2,4) [4,6) [6,8); position 0 holds 0 and 3.
    plan = make_plan([8], [(0, 1)], (0, 0))
    first, second = ring_meta(plan, 0)[0], ring_meta(plan, 1)[0]
    assert first.calls.rows.tolist() == [0, 1, 2, 3] and first.block_rows == (4, 4)
    diag = first.calls.calls[0]
    assert diag.packing.causal and diag.packing.offsets_q == (0, 4)
    # Position 0 holding position 1's block: only its chunk [6,8) sees [2,4) and [4,6).
    call = first.calls.calls[1]
    assert call.q_index.tolist() == [2, 3] and call.k_index.tolist() == [0, 1, 2, 3]
    assert call.packing.offsets_q == (0, 2) and call.packing.offsets_k == (0, 4) and not call.packing.causal
    # Position 1 holding position 0's block: both its chunks see [0,2), not [6,8).
    call = second.calls.calls[1]
    assert call.q_index.tolist() == [0, 1, 2, 3] and call.k_index.tolist() == [0, 1]


def grad_rows(plan) -> Counter:
    """dK/dV rows per (src, dst) of the plan's ring messages."""
    out = Counter()
    for msg in plan.ring_messages():
        if msg.payload == "grad":
            out[msg.src, msg.dst] += msg.rows
    return out


def test_grad_rows_by_hand():
    # Length 7 over 3 ranks: chunk bounds 0,1,2,3,4,5,7; blocks hold 3, 2, 2 rows.
    ring_plan = make_plan([7], [(0, 1, 2)], (0, 0, 0))
    assert grad_rows(ring_plan) == Counter({(0, 1): 4, (1, 2): 5, (2, 0): 5})
    gather_plan = make_plan([7], [(0, 1, 2)], (0, 0, 0), comms={0: "allgather"})
    assert grad_rows(gather_plan) == Counter(
        {(0, 1): 2, (0, 2): 2, (1, 0): 3, (1, 2): 2, (2, 0): 3, (2, 1): 2})
    # Forward 0->1 passes blocks 0 then 2 (5 rows); K and V, 2 heads of 8, bf16: 5*2*2*8*2 bytes;
    # the backward adds fp32 dK/dV of blocks 2 and 1 (4 rows).
    predicted = predicted_bytes(ring_plan, 2, 8, torch.bfloat16)
    assert predicted.forward[0, 1] == 320 and predicted.backward[0, 1] == 320 + 4 * 2 * 2 * 8 * 4
