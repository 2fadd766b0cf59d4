"""One training iteration of a Plan on a cluster, simulated: step time, breakdown, trace.

What is simulated (`timeline.py` has the event model, `fabric.py` the links,
`layer_graph.py` builds a layer's tasks):

* One transformer layer forward and one backward, each a task graph started at time 0 on
  every rank; every layer is alike, so a step is num_layers * (forward + backward), plus
  the LM head, the exposed part of the gradient all-reduce and the optimizer step. Layers
  are synchronous here (a rank never starts layer l+1 before the slowest rank finishes
  layer l): a small pessimism where ranks are unbalanced.
* Forward layer: attention (every split document's ring steps, every local document),
  then the remap all-to-all to the linear layout, the linear layers (QKV, O, MLP), the
  tensor-parallel collectives (tp > 1, sequence parallel: 2 all-gathers and 2
  reduce-scatters over NVLink; the backward also the gathers its recomputation reruns),
  and the remap back. Backward mirrors it in reverse. The head adds the embedding's and
  the head's collectives, the loss's all-reduces and the norms' gradient all-reduces
  (`cost.tensor_parallel.tp_step_collectives`), exposed.
* Split documents that share the same ring of ranks run as one ring, as TransformerEngine
  does for packed sequences: per step one kernel on each rank and one K/V transfer.
  Ring step s of position i computes its zig-zag chunks against the block of position
  i - s. Backward passes K/V ahead and dK/dV (fp32, as the runtime sends them) after each
  step's compute, with one more hop to bring dK/dV home. "allgather" rings send K/V to
  every member first (backward: again, then each block's gradient back to its owner).
  Local documents of a rank are one varlen kernel call. Bytes are what the runtime moves
  (`SimResult.bytes_sent`; tests compare them with the runtime's own prediction).
* Order and the attention engine: every rank's compute stream runs its kernels in the
  order the runtime queues them (`runtime.engine`: its rings round-robin, inter-node
  first, its local documents after every ring's first step), the same for every plan.
  With the engine (`engine=True`, the default for every planner: what the runtime does,
  sends posted on a communication stream once their data is there, relays forwarded as
  they arrive) a transfer waits for its data only; without it (`engine=False`, every
  ring kind, double rings included) a send also waits for every kernel its rank queued
  before it, as `batch_isend_irecv` on the compute stream does.
* Data-parallel collectives, as the runtime's FSDP2 runs them (`training/parallelism/parallel.py`):
  each layer's forward runs beside the next layer's parameter all-gather (bf16), each
  backward beside an all-gather and the previous layer's gradient reduce-scatter (fp32),
  each priced as half of `cost.seconds.grad_allreduce_parts` (a hierarchical all-reduce:
  inside nodes, then across them; NCCL's flat ring over all ranks moves about as much
  per NIC). They share NVLink ports and NICs with ring and remap transfers, cut into
  pieces so the two interleave: context-parallel traffic runs on its own process group
  (`cp_group=True`, as the runtime does; False: one group, whose stream runs the
  collectives first). The last layer's reduce-scatter is exposed.
* Recomputation: what the plan says each rank recomputes (`Plan.recompute`: the cheapest
  under which its tokens fit, each rank as little as its own tokens need), or, where the
  simulation departs from the plan (a model that fixes its `ModelSpec.recompute`, no
  remap) or the plan says nothing, the same rule on the simulated tokens
  (`cost.recompute.per_rank_recompute`): the backward reruns the MLP GEMMs
  ("selective"), every GEMM and elementwise op of the layer ("linear"), each on as few
  of the first layers as a rank's memory needs (or the model's `recompute_layers`), the
  others one mode below; one backward is simulated per run of layers alike), or the
  whole layer forward, attention included ("full", on every rank; the rerun's K/V
  transfers are taken as shared with the backward's).
* Compute that overlaps communication on the same GPU slows by the profile's
  `overlap_slowdown` times the rank's transfer seconds (an assumption on GPUs).

Linear work is the layer's GEMMs, its elementwise work (norms, rotary, SwiGLU's product,
residual adds: bytes over the profile's memory bandwidth) and the training framework's
per-layer work on the compute thread (`Profile.framework_s_per_layer`); the head adds the
loss's elementwise work.

Per rank: compute (attention + linear + head + optimizer), exposed communication (time its stream
waits before its own last piece of a layer arrives, plus TP collectives and the exposed
all-reduce) and idle (waiting for the slowest rank). `lower_bound_s` is a bound on the
batch, the same for every plan (`cost.bounds.batch_lower_bound`); `compute_bound_s` is
this plan's compute spread perfectly over the GPUs by peak FLOP/s.
"""

from __future__ import annotations

import itertools
from collections import Counter

from ballonet.cost import hardware
from ballonet.cost.bounds import batch_lower_bound
from ballonet.cost.flops import (
    LINEAR_BACKWARD_FACTOR,
    attention_flops,
    head_flops_per_token,
    linear_flops_per_token,
)
from ballonet.cost.memory import BELOW
from ballonet.cost.recompute import per_rank_recompute
from ballonet.cost.seconds import (
    DP_BACKWARD_SHARE,
    DP_FORWARD_SHARE,
    collective_time,
    dp_layer_parts,
    grad_allreduce_time,
    head_seconds,
    linear_layer_seconds,
    optimizer_time,
)
from ballonet.cost.tensor_parallel import tp_layer_seconds, tp_sent_bytes, tp_step_collectives
from ballonet.plan import Plan
from ballonet.plan.recompute import heaviest
from ballonet.simulation import ping_pong
from ballonet.simulation.fabric import Fabric
from ballonet.simulation.layer_graph import LayerGraph
from ballonet.simulation.result import SimResult
from ballonet.specs import ClusterSpec, ModelSpec


def _run_pass(p: LayerGraph) -> tuple[float, list, list, list, tuple]:
    """(period, per-rank compute, per-rank end, per-rank attention seconds, timeline record)."""
    ends = p.build()
    start, finish = p.tl.run()
    R = p.plan.num_ranks
    compute, attention = [0.0] * R, [0.0] * R
    for task in range(p.tl.num_tasks):
        kind, rank, _ = p.tl.label[task]
        if p.tl.stream[task] >= 0 and kind != "tp":
            compute[rank] += p.tl.duration[task]
            if kind != "linear":
                attention[rank] += p.tl.duration[task]
    end = [finish[e] if e is not None else 0.0 for e in ends]
    name = "backward" if p.backward else "forward"
    return max(end, default=0.0), compute, end, attention, (name, p.tl, start, finish, p.fabric)


def _pass(common: dict, backward: bool, grad_bucket: tuple) -> tuple:
    """(period, per-rank compute, per-rank end, per-rank attention, per-rank slowdown,
    timeline record, bytes) of one layer's forward or backward: one task graph, or for a
    plan run in DistCA's ping-pong (`plan.meta["ping_pong"]`) two nano-batches in turn."""
    if common["plan"].meta.get("ping_pong"):
        return ping_pong.run(common, backward, grad_bucket)
    g = LayerGraph(backward=backward, grad_bucket=grad_bucket, **common)
    period, compute, end, attention, record = _run_pass(g)
    return period, compute, end, attention, _slowdown(g, compute), record, g.sent


def _slowdown(p: LayerGraph, compute: list) -> list:
    """Per rank, compute seconds lost to communication running beside it: the profile's
    overlap slowdown times the rank's transfer seconds (at most its compute)."""
    comm = [0.0] * p.plan.num_ranks
    for task in range(p.tl.num_tasks):
        kind, rank, _ = p.tl.label[task]
        if kind == "send" and rank >= 0:
            comm[rank] += p.tl.duration[task]
    return [hardware.profile(p.fabric.gpu[r]).overlap_slowdown * min(comm[r], compute[r]) for r in range(len(comm))]


def simulate(plan: Plan, cluster: ClusterSpec, model: ModelSpec, *, routing: bool = True, remap: bool = True,
             engine: bool = True, cp_group: bool = True, overlap_grad_allreduce: bool = True) -> SimResult:
    """Simulate one training iteration of `plan`. `routing=False` sends every hop directly,
    `remap=False` runs the linear layers in the attention layout, `engine=False` posts
    every send behind the kernels queued before it (for every plan alike), `cp_group=False`
    puts context-parallel and data-parallel traffic on one process group; see the module
    docstring."""
    fabric = Fabric(cluster, plan.num_ranks, model.tp)
    R = plan.num_ranks
    moves = plan.remap_tokens() if remap else Counter()
    att_tokens = [sum(s.num_tokens for s in segs) for segs in plan.attention]
    tokens = list(att_tokens)
    for (src, dst), n in moves.items():
        tokens[src] -= n
        tokens[dst] += n
    if plan.recompute and remap and model.recompute is None:
        chosen = plan.recompute
    else:
        chosen = per_rank_recompute(model, tokens, fabric.gpu, att_tokens)
    per_rank = tuple((m.value, k) for m, k in chosen)
    mode = heaviest(chosen).mode.value
    linear_s = [linear_layer_seconds(model, fabric.gpu[r], tokens[r], m)
                for r, (m, _) in enumerate(per_rank)]
    tp_s = [tp_layer_seconds(model, tokens[r], fabric.intra_bw[r], fabric.gpu[r], m)
            for r, (m, _) in enumerate(per_rank)]
    routes = {}
    if routing:
        for route in plan.routes:
            routes.setdefault((route.src, route.dst), route.proxies)
    L = model.num_layers
    bucket = dp_layer_parts(model, cluster) if overlap_grad_allreduce else (0.0, 0.0)
    common = dict(plan=plan, model=model, fabric=fabric, engine=engine, routes=routes, remap=moves,
                  linear_s=linear_s, tp_s=tp_s, recompute=mode, cp_group=cp_group)
    forward_dp = tuple(x * DP_FORWARD_SHARE for x in bucket)
    bucket = tuple(x * DP_BACKWARD_SHARE for x in bucket)
    fwd, fwd_compute, fwd_end, fwd_att, fwd_slow, fwd_rec, fwd_sent = _pass(common, False, forward_dp)
    bwd, bwd_compute, bwd_end, bwd_att, bwd_slow, bwd_rec, bwd_sent = _pass(common, True, bucket)
    runs = _runs_of_layers(model, fabric, tokens, per_rank, linear_s, tp_s)
    if runs != [(L, linear_s, tp_s)]:  # one backward graph per run of alike layers, weighted by its length
        passes = []
        for n, lin, tp in runs:
            if lin == linear_s and tp == tp_s:
                passes.append((n, (bwd, bwd_compute, bwd_end, bwd_att, bwd_slow)))
            else:
                passes.append((n, _pass({**common, "linear_s": lin, "tp_s": tp}, True, bucket)[:5]))
        bwd = sum(n * p[0] for n, p in passes) / L
        bwd_compute, bwd_end, bwd_att, bwd_slow = ([sum(n * p[i][r] for n, p in passes) / L for r in range(R)]
                                                   for i in range(1, 5))
    slow = [a + b for a, b in zip(fwd_slow, bwd_slow)]

    head = [head_seconds(model, fabric.gpu[r], n) for r, n in enumerate(tokens)]
    head_tp = [sum(collective_time(op, nbytes, model.tp, fabric.intra_bw[r], fabric.gpu[r])
                   for _, op, nbytes in tp_step_collectives(model, n)) for r, n in enumerate(tokens)]
    optimizer = [optimizer_time(model, fabric.gpu[r], R) for r in range(R)]
    grad = grad_allreduce_time(model, cluster)
    grad_exposed = grad / L if overlap_grad_allreduce else grad  # the last layer's bucket
    layers = max(L * (fwd_end[r] + bwd_end[r] + slow[r]) for r in range(R))
    layers = max(layers, L * (fwd + bwd))
    # The optimizer steps after the last gradient bucket is reduced.
    step = layers + max(h + t for h, t in zip(head, head_tp)) + grad_exposed + max(optimizer)

    compute = [L * (fwd_compute[r] + bwd_compute[r]) + head[r] + optimizer[r]  # slowdown: exposed
               for r in range(R)]
    busy_end = [L * (fwd_end[r] + bwd_end[r] + slow[r]) + head[r] + head_tp[r] + optimizer[r] for r in range(R)]
    exposed = [busy_end[r] - compute[r] + grad_exposed for r in range(R)]
    idle = [step - compute[r] - exposed[r] for r in range(R)]
    peaks = [fabric.gpu[r].peak_flops for r in range(R)]

    T = plan.num_tokens
    model_flops = (1 + LINEAR_BACKWARD_FACTOR) * (
        L * (linear_flops_per_token(model) * T + float(attention_flops(model, plan.lengths).sum()))
        + head_flops_per_token(model) * T)
    mfu = model_flops / (step * sum(peaks) * model.tp)
    return SimResult(
        planner=plan.planner, num_gpus=R * model.tp, num_tokens=T, step_time_s=step,
        lower_bound_s=batch_lower_bound(plan.lengths, cluster, model),
        compute_bound_s=sum(c * p for c, p in zip(compute, peaks)) / sum(peaks), recompute=mode,
        recompute_layers=heaviest(chosen).layers, recompute_per_rank=per_rank,
        mfu=mfu, compute_s=tuple(compute), exposed_comm_s=tuple(exposed), idle_s=tuple(idle),
        attention_s=tuple(L * (fwd_att[r] + bwd_att[r]) for r in range(R)),
        layer_forward_s=fwd, layer_backward_s=bwd, head_s=max(head), grad_allreduce_s=grad,
        grad_allreduce_exposed_s=grad_exposed, optimizer_s=max(optimizer),
        bytes_sent={"forward": fwd_sent, "backward": bwd_sent},
        tp_bytes=_tp_bytes(model, tokens, per_rank),
        timelines=(fwd_rec, bwd_rec))


def _runs_of_layers(model: ModelSpec, fabric: Fabric, tokens: list, per_rank, linear_s: list,
                    tp_s: list) -> list[tuple[int, list, list]]:
    """(layers, [R] linear seconds forward and backward, [R] the same of the TP collectives)
    of each run of alike layers in the backward: layer l on rank r recomputes as its mode
    (`linear_s`, `tp_s`) if r recomputes more than l layers (`per_rank`: (mode, layers)),
    else as the mode below (`cost.memory.BELOW`)."""
    below = {}
    cuts = sorted({0, model.num_layers, *(k for _, k in per_rank)})
    runs = []
    for lo, hi in itertools.pairwise(cuts):
        lin, tp = list(linear_s), list(tp_s)
        for r, (m, k) in enumerate(per_rank):
            if k <= lo and m in BELOW:
                if (r, m) not in below:
                    gpu, mode = fabric.gpu[r], BELOW[m]
                    below[r, m] = (linear_layer_seconds(model, gpu, tokens[r], mode),
                                   tp_layer_seconds(model, tokens[r], fabric.intra_bw[r], gpu, mode))
                lin[r], tp[r] = below[r, m]
        runs.append((hi - lo, lin, tp))
    return runs


def _tp_bytes(model: ModelSpec, tokens: list, per_rank) -> dict:
    """{phase: Counter of (op, rank)}: bytes each GPU of rank r's TP group sends in the
    step's tensor-parallel collectives (`cost.tensor_parallel.tp_sent_bytes`)."""
    out = {"forward": Counter(), "backward": Counter()}
    for r, (n, (mode, layers)) in enumerate(zip(tokens, per_rank)):
        for phase, sent in tp_sent_bytes(model, n, mode, layers).items():
            for op, nbytes in sent.items():
                out[phase][op, r] += nbytes
    return out
