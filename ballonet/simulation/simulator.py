"""One training iteration of a Plan on a cluster, simulated: step time, breakdown, trace.

What is simulated (`timeline.py` has the event model, `fabric.py` the links,
`layer_graph.py` builds a layer's tasks):

* One transformer layer forward and one backward, each a task graph started at time 0 on
  every rank; every layer is alike, so a step is num_layers * (forward + backward), plus
  the LM head and the exposed part of the gradient all-reduce. Layers are synchronous
  here (a rank never starts layer l+1 before the slowest rank finishes layer l): a small
  pessimism where ranks are unbalanced.
* Forward layer: attention (every split document's ring steps, every local document),
  then the remap all-to-all to the linear layout, the linear layers (QKV, O, MLP), the
  tensor-parallel collectives (tp > 1, sequence parallel: 2 all-gathers and 2
  reduce-scatters over NVLink), and the remap back. Backward mirrors it in reverse.
* Split documents that share the same ring of ranks run as one ring, as TransformerEngine
  does for packed sequences: per step one kernel on each rank and one K/V transfer.
  Ring step s of position i computes its zig-zag chunks against the block of position
  i - s. Backward passes K/V ahead and dK/dV after each step's compute, with one more
  hop to bring dK/dV home. "allgather" rings gather K/V first (backward: compute, then
  reduce-scatter dK/dV).
* The attention engine (`engine=True`, Zeppelin's): transfers start as soon as their data
  is there and each GPU's stream runs ready work in queue order inter-node, intra-node,
  local, so local attention fills waits. Without it (the baselines' loop), a rank runs its
  attention work in a fixed order and issues a ring step's send only after its previous
  compute, as ring-flash-attention and TransformerEngine do.
* Gradient all-reduce: hierarchical (`cost_model.grad_allreduce_time`), in one bucket per
  layer that starts when that layer's backward ends (Megatron's overlap_grad_reduce); it
  does not contend with attention traffic in this model.

Per rank: compute (attention + linear + head), exposed communication (time its stream
waits before its own last piece of a layer arrives, plus TP collectives and the exposed
all-reduce) and idle (waiting for the slowest rank). Lower bound: the same compute spread
perfectly over the GPUs in proportion to peak FLOP/s, with all communication hidden.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field

from ballonet import cost_model, hardware
from ballonet.plan import Plan
from ballonet.simulation.fabric import Fabric
from ballonet.simulation.layer_graph import LayerGraph
from ballonet.specs import ClusterSpec, ModelSpec


@dataclass(frozen=True, kw_only=True)
class SimResult:
    planner: str
    num_gpus: int
    num_tokens: int
    step_time_s: float
    lower_bound_s: float
    mfu: float
    compute_s: tuple[float, ...]
    """Per plan rank, per step: attention, linear and head compute."""
    exposed_comm_s: tuple[float, ...]
    idle_s: tuple[float, ...]
    attention_s: tuple[float, ...]
    layer_forward_s: float
    layer_backward_s: float
    head_s: float
    grad_allreduce_s: float
    grad_allreduce_exposed_s: float
    timelines: tuple = field(default=(), repr=False, compare=False)
    """(name, Timeline, start, finish, Fabric) of the simulated forward and backward layer."""

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.step_time_s

    @property
    def attention_imbalance(self) -> float:
        """Slowest rank's attention compute over the mean (1.0 is perfect)."""
        mean = sum(self.attention_s) / len(self.attention_s)
        return max(self.attention_s) / mean if mean > 0 else 1.0

    @property
    def exposed_comm_share(self) -> float:
        return sum(self.exposed_comm_s) / len(self.exposed_comm_s) / self.step_time_s

    def to_dict(self) -> dict:
        keys = ("planner", "num_gpus", "num_tokens", "step_time_s", "lower_bound_s", "mfu", "layer_forward_s",
                "layer_backward_s", "head_s", "grad_allreduce_s", "grad_allreduce_exposed_s")
        d = {k: getattr(self, k) for k in keys}
        d.update(tokens_per_s=self.tokens_per_s, attention_imbalance=self.attention_imbalance,
                 exposed_comm_share=self.exposed_comm_share,
                 per_rank={"compute_s": list(self.compute_s), "exposed_comm_s": list(self.exposed_comm_s),
                           "idle_s": list(self.idle_s), "attention_s": list(self.attention_s)})
        return d

    def to_chrome_trace(self, path: str) -> None:
        """Chrome trace-event JSON of one forward and one backward layer (Perfetto opens it):
        a process per rank, a thread for its compute stream and one per link it sends on."""
        events, offset, threads = [], 0.0, {}  # threads: (pid, thread name) -> tid
        for name, tl, start, finish, fabric in self.timelines:
            for task in range(tl.num_tasks):
                kind, rank, what = tl.label[task]
                if kind == "join":
                    continue
                if tl.stream[task] >= 0:
                    pid, thread = rank, "compute"
                else:
                    link = tl.links[task][0]
                    pid, thread = fabric.link_owner(link), fabric.link_name(link)
                tid = threads.setdefault((pid, thread), len(threads))
                events.append({"name": _text(what), "cat": f"{name} {kind}", "ph": "X", "pid": pid, "tid": tid,
                               "ts": (offset + start[task]) * 1e6, "dur": tl.duration[task] * 1e6})
            offset += max(finish, default=0.0)
        for r in range(len(self.compute_s)):
            events.append({"name": "process_name", "ph": "M", "pid": r, "tid": 0, "args": {"name": f"rank {r}"}})
        for (pid, thread), tid in threads.items():
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": thread}})
        with open(path, "w") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms",
                       "metadata": {"planner": self.planner, "step_time_s": self.step_time_s}}, f)


def _text(name) -> str:
    return " ".join(_text(x) for x in name) if isinstance(name, tuple) else str(name)


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


def _grad_exposed(total: float, num_layers: int, layer_backward: float, overlap: bool) -> float:
    """All-reduce time left after the backward: buckets of total/num_layers, bucket k
    ready at the end of the k-th layer's backward, sent one after another."""
    if not overlap:
        return total
    bucket, t = total / num_layers, 0.0
    for k in range(1, num_layers + 1):
        t = max(t, k * layer_backward) + bucket
    return t - num_layers * layer_backward


def simulate(plan: Plan, cluster: ClusterSpec, model: ModelSpec, *, routing: bool = True, remap: bool = True,
             engine: bool | None = None, overlap_grad_allreduce: bool = True) -> SimResult:
    """Simulate one training iteration of `plan`. `routing=False` sends every hop directly,
    `remap=False` runs the linear layers in the attention layout, `engine` (default:
    `plan.attention_engine`) selects the attention engine; see the module docstring."""
    fabric = Fabric(cluster, plan.num_ranks, model.tp)
    R = plan.num_ranks
    if engine is None:
        engine = plan.attention_engine
    moves = plan.remap_tokens() if remap else Counter()
    tokens = [sum(s.num_tokens for s in segs) for segs in plan.attention]
    for (src, dst), n in moves.items():
        tokens[src] -= n
        tokens[dst] += n
    linear_s = [cost_model.linear_time(model, fabric.gpu[r], tokens[r]) for r in range(R)]
    tp_s = [0.0] * R
    if model.tp > 1:
        for r in range(R):
            nbytes = cost_model.hidden_bytes(model, tokens[r])
            tp_s[r] = 2 * sum(cost_model.collective_time(op, nbytes, model.tp, fabric.intra_bw[r])
                              for op in ("all_gather", "reduce_scatter"))
    routes = {}
    if routing:
        for route in plan.routes:
            routes.setdefault((route.src, route.dst), route.proxies)
    common = dict(plan=plan, model=model, fabric=fabric, engine=engine, routes=routes, remap=moves,
                  linear_s=linear_s, tp_s=tp_s)
    fwd, fwd_compute, fwd_end, fwd_att, fwd_rec = _run_pass(LayerGraph(backward=False, **common))
    bwd, bwd_compute, bwd_end, bwd_att, bwd_rec = _run_pass(LayerGraph(backward=True, **common))

    L = model.num_layers
    head_flops = 2.0 * model.vocab_size * model.hidden * (1 + cost_model.LINEAR_BACKWARD_FACTOR) / model.tp
    head = [head_flops * n / (fabric.gpu[r].peak_flops * hardware.linear_efficiency(n)) if n else 0.0
            for r, n in enumerate(tokens)]
    grad = cost_model.grad_allreduce_time(model, cluster)
    grad_exposed = _grad_exposed(grad, L, bwd, overlap_grad_allreduce)
    step = L * (fwd + bwd) + max(head) + grad_exposed

    compute = [L * (fwd_compute[r] + bwd_compute[r]) + head[r] for r in range(R)]
    busy_end = [L * (fwd_end[r] + bwd_end[r]) + head[r] for r in range(R)]
    exposed = [busy_end[r] - compute[r] + grad_exposed for r in range(R)]
    idle = [step - compute[r] - exposed[r] for r in range(R)]
    peaks = [fabric.gpu[r].peak_flops for r in range(R)]
    lower = sum(c * p for c, p in zip(compute, peaks)) / sum(peaks)

    T = plan.num_tokens
    model_flops = (1 + cost_model.LINEAR_BACKWARD_FACTOR) * (
        L * (cost_model.linear_flops_per_token(model) * T
             + sum(cost_model.attention_flops(model, n) for n in plan.lengths))
        + 2.0 * model.vocab_size * model.hidden * T)
    mfu = model_flops / (step * sum(peaks) * model.tp)
    return SimResult(
        planner=plan.planner, num_gpus=R * model.tp, num_tokens=T, step_time_s=step, lower_bound_s=lower,
        mfu=mfu, compute_s=tuple(compute), exposed_comm_s=tuple(exposed), idle_s=tuple(idle),
        attention_s=tuple(L * (fwd_att[r] + bwd_att[r]) for r in range(R)),
        layer_forward_s=fwd, layer_backward_s=bwd, head_s=max(head), grad_allreduce_s=grad,
        grad_allreduce_exposed_s=grad_exposed, timelines=(fwd_rec, bwd_rec))
