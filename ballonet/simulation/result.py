"""What `simulator.simulate` returns: one simulated training iteration's step time,
bound, per-rank breakdown, bytes and timelines, as a dict or a Chrome trace."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True)
class SimResult:
    planner: str
    num_gpus: int
    num_tokens: int
    step_time_s: float
    lower_bound_s: float
    """No plan of this batch runs faster on this cluster (`cost.bounds.batch_lower_bound`)."""
    compute_bound_s: float
    """This plan's own compute spread evenly over the GPUs by peak, communication hidden."""
    recompute: str
    """The activation recomputation the step runs with (the cheapest that fits, or the model's)."""
    recompute_layers: int = 0
    """How many layers (the first ones) recompute on the rank that recomputes most (0
    without recomputation)."""
    recompute_per_rank: tuple[tuple[str, int], ...] = ()
    """Per plan rank, (mode, how many layers, the first ones, recompute under it; the
    others one mode below, `cost.memory.BELOW`)."""
    mfu: float
    compute_s: tuple[float, ...]
    """Per plan rank, per step: attention, linear (GEMMs, elementwise, the framework's
    per-layer work), head and loss, and the optimizer step."""
    exposed_comm_s: tuple[float, ...]
    idle_s: tuple[float, ...]
    attention_s: tuple[float, ...]
    layer_forward_s: float
    layer_backward_s: float
    head_s: float
    grad_allreduce_s: float
    grad_allreduce_exposed_s: float
    optimizer_s: float = 0.0
    """The slowest rank's optimizer step (part of its `compute_s`)."""
    bytes_sent: dict = field(default_factory=dict, repr=False, compare=False)
    """Bytes of one layer, "forward" and "backward": Counter of (class, src, dst), class
    "kv", "grad" (dK/dV), "remap" or "allreduce"."""
    tp_bytes: dict = field(default_factory=dict, repr=False, compare=False)
    """Bytes of the step's tensor-parallel collectives, "forward" and "backward": Counter
    of (op, rank), what each GPU of plan rank `rank`'s TP group sends."""
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

    @staticmethod
    def weighted(results: list[SimResult], weights: list[float], *, num_tokens: int,
                 lower_bound_s: float) -> SimResult:
        """Several steps that together train one batch of `num_tokens` tokens (a planner that
        defers documents, `planning.wlb_llm.outlier_steps`), as one: times, per-rank
        figures and MFU the steps' weighted sums (MFU by time), the batch's own bound;
        recomputation, bytes and timelines those of the first step."""
        def total(get) -> float:
            return sum(w * get(r) for r, w in zip(results, weights))

        step = total(lambda r: r.step_time_s)
        per_rank = {k: tuple(total(lambda r, i=i, k=k: getattr(r, k)[i]) for i in range(len(results[0].compute_s)))
                    for k in ("compute_s", "exposed_comm_s", "idle_s", "attention_s")}
        scalars = {k: total(lambda r, k=k: getattr(r, k))
                   for k in ("compute_bound_s", "layer_forward_s", "layer_backward_s", "head_s", "grad_allreduce_s",
                             "grad_allreduce_exposed_s", "optimizer_s")}
        return dataclasses.replace(results[0], num_tokens=num_tokens, step_time_s=step, lower_bound_s=lower_bound_s,
                                   mfu=total(lambda r: r.mfu * r.step_time_s) / step, **per_rank, **scalars)

    def to_dict(self) -> dict:
        keys = ("planner", "num_gpus", "num_tokens", "step_time_s", "lower_bound_s", "compute_bound_s", "recompute",
                "recompute_layers", "mfu", "layer_forward_s",
                "layer_backward_s", "head_s", "grad_allreduce_s", "grad_allreduce_exposed_s", "optimizer_s")
        d = {k: getattr(self, k) for k in keys}
        d.update(tokens_per_s=self.tokens_per_s, attention_imbalance=self.attention_imbalance,
                 exposed_comm_share=self.exposed_comm_share,
                 per_rank={"compute_s": list(self.compute_s), "exposed_comm_s": list(self.exposed_comm_s),
                           "idle_s": list(self.idle_s), "attention_s": list(self.attention_s),
                           "recompute": [list(x) for x in self.recompute_per_rank]})
        return d

    def to_chrome_trace(self, path: str) -> None:
        """Chrome trace-event JSON of one forward and one backward layer (Perfetto opens it):
        a process per rank, a thread for its compute stream and one per link it sends on (more
        lanes where transfers share the link), a transfer shown from ready to done."""
        events, offset, threads = [], 0.0, {}  # threads: (pid, thread name) -> tid
        for name, tl, start, finish, fabric in self.timelines:
            lanes: dict = {}  # (pid, link name) -> end of each lane's last transfer
            for task in sorted(range(tl.num_tasks), key=lambda t: (start[t], t)):
                kind, rank, what = tl.label[task]
                if kind == "join":
                    continue
                if tl.stream[task] >= 0:
                    pid, thread = rank, "compute"
                else:  # from ready to done, in the first free lane of its link (links share)
                    link = tl.links[task][0]
                    pid, thread = fabric.link_owner(link), fabric.link_name(link)
                    ends = lanes.setdefault((pid, thread), [])
                    lane = next((i for i, e in enumerate(ends) if e <= start[task]), len(ends))
                    ends[lane:lane + 1] = [finish[task]]
                    thread += f" #{lane + 1}" if lane else ""
                tid = threads.setdefault((pid, thread), len(threads))
                events.append({"name": _text(what), "cat": f"{name} {kind}", "ph": "X", "pid": pid, "tid": tid,
                               "ts": (offset + start[task]) * 1e6, "dur": (finish[task] - start[task]) * 1e6})
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
