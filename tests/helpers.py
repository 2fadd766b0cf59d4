"""What several test files share: plans built by hand, the single-process references the
distributed results are checked against, and the checks the attention tests run per rank.
(The harness that spawns gloo ranks is `distributed.py`.) No test file imports another;
each imports what it shares from here.

    one_rank_plan, small_plan, remap_plan, make_plan, hand_plans   plans by hand
    routed, rails_plan, tangled_plan, plans4, plans6                  routed and double rings
    attention_reference, run_attention, total_bytes, check_attention_plan
    SPEC, batch, model_reference, rank_outputs, assert_grads_close  the tiny model's
    runtime_bytes                                                   what the runtime sends
    tp_groups                                                       a 2-D mesh for tensor parallelism
    mallinfo2                                                       glibc's heap accounting
    lent_cluster_toml, free_port                                    two GPU types, a loaned group; a port

(The simulator's closed forms are `closed_forms.py`.)
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import random
import socket
from collections import Counter

import torch
import torch.distributed as dist
import torch.nn.functional as F

import ballonet
from ballonet.plan import Plan, Ring, Route, Segment, Transfer, chunk_bounds
from ballonet.planning.assembly import zigzag_bounds
from ballonet.runtime import ByteCounter, attention, remapping, routing, token_index
from ballonet.runtime.routing import predicted_bytes
from ballonet.training.data.corpus import load_corpus
from ballonet.training.data.loader import BalancedLoader
from ballonet.training.parallelism.model import IGNORE_INDEX, NORM_EPS, ROPE_THETA, Transformer

H, H_KV, D = 4, 2, 8
"""Attention tests' heads, KV heads and head dim."""
SPEC = ballonet.model("tiny")
"""The model of the model-level tests."""


# ---- plans by hand ---------------------------------------------------------------------


def one_rank_plan(lengths=(5, 3), order=None) -> Plan:
    """One rank holding documents of `lengths`, in `order` (default input order)."""
    order = range(len(lengths)) if order is None else order
    return Plan(planner="hand", lengths=tuple(lengths), node_of_rank=(0,), nic_of_rank=(0,),
                attention=(tuple(Segment(d, 0, lengths[d]) for d in order),)).validate()


def small_plan(**changes) -> Plan:
    """2 nodes x 2 ranks; documents of 5, 7 and 3 tokens; the 7-token one split over
    ranks 0 and 2 (chunks 0,3 on rank 0 and 1,2 on rank 2); rank 1 gives one token to rank 0."""
    fields = dict(
        planner="hand",
        lengths=(5, 7, 3),
        node_of_rank=(0, 0, 1, 1),
        nic_of_rank=(0, 1, 2, 3),
        attention=(
            (Segment(1, 0, 1), Segment(1, 5, 7)),
            (Segment(0, 0, 5),),
            (Segment(1, 1, 3), Segment(1, 3, 5)),
            (Segment(2, 0, 3),),
        ),
        rings=(Ring(doc=1, kind="inter", ranks=(0, 2), bounds=(0, 1, 3, 5, 7)),),
        remap=(Transfer(1, 0, 4, 5),),
        routes=(Route(doc=1, src=0, dst=2, proxies=((0, 2), (1, 3))),),
        memory_bytes=(10.0, 10.0, 10.0, 10.0),
        memory_cap=(20.0, 20.0, 20.0, 20.0),
    )
    fields.update(changes)
    return Plan(**fields)


def remap_plan() -> Plan:
    """2 nodes x 2 ranks, 32 tokens, 8 per rank after the remap. Document 0 (9 tokens) is
    split over ranks 0 and 2 (chunks 0,3 and 1,2). Every rank sends and receives; rank 1
    sends two ranges to rank 0 and one to rank 3; rank 3's range [4, 7) spans two documents.

    Global positions: doc 0 is 0..8, 1 is 9..14, 2 is 15..17, 3 is 18..22, 4 is 23..24,
    5 is 25..28, 6 is 29..31."""
    return Plan(
        planner="hand",
        lengths=(9, 6, 3, 5, 2, 4, 3),
        node_of_rank=(0, 0, 1, 1),
        nic_of_rank=(0, 1, 2, 3),
        attention=(
            (Segment(0, 0, 2), Segment(0, 6, 9), Segment(4, 0, 2)),
            (Segment(1, 0, 6), Segment(2, 0, 3)),
            (Segment(0, 2, 4), Segment(0, 4, 6), Segment(6, 0, 3)),
            (Segment(3, 0, 5), Segment(5, 0, 4)),
        ),
        rings=(Ring(doc=0, kind="inter", ranks=(0, 2), bounds=chunk_bounds(9, 4)),),
        remap=(Transfer(1, 0, 7, 9), Transfer(1, 0, 2, 3), Transfer(1, 3, 5, 6),
               Transfer(0, 2, 1, 3), Transfer(3, 1, 4, 7), Transfer(2, 3, 0, 1)),
    ).validate()


NODES = {1: (0,), 2: (0, 1), 4: (0, 0, 1, 1)}


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


def routed(plan: Plan, *routes: tuple[int, int, int, tuple]) -> Plan:
    return dataclasses.replace(plan, routes=tuple(Route(doc=d, src=s, dst=t, proxies=p) for d, s, t, p in routes)).validate()


def rails_plan() -> Plan:
    """Document 0 (16 tokens) on the ring 0 1 2 3, four rows per rank; hops 1->2 and 3->0
    cross nodes and go over both rails, as the planner routes them."""
    plan = make_plan([16, 5], [(0, 1, 2, 3), 1], (0, 0, 1, 1))
    return routed(plan, (0, 1, 2, ((0, 2), (1, 3))), (0, 3, 0, ((2, 0), (3, 1))))


def tangled_plan() -> Plan:
    """Every hop of three rings crosses nodes and is routed: proxies equal to the source
    or destination or to each other, three-leg paths, parts of one row or none, ranks that
    forward for rings they are not in, hops of one ring sharing a pair of ranks; beside an
    unrouted all-gather ring, an intra-node ring and local documents."""
    lengths = [37, 9, 5, 6, 11, 4, 3]
    plan = make_plan(lengths, [(0, 2, 1, 3), (1, 3), (2, 0, 3, 1), (0, 3), (2, 3), 0, 2], (0, 0, 1, 1),
                     comms={3: "allgather"}, seed=4)
    return routed(plan,
                  (0, 0, 2, ((0, 2), (1, 3))), (0, 2, 1, ((3, 1), (2, 0), (3, 0))),
                  (0, 1, 3, ((1, 3), (0, 2))), (0, 3, 0, ((2, 1),)),
                  (1, 1, 3, ((0, 2),)), (1, 3, 1, ((2, 0), (3, 1))),
                  (2, 2, 0, ((2, 0), (3, 1), (2, 1))), (2, 0, 3, ((1, 2), (0, 3), (1, 3))),
                  (2, 3, 1, ((3, 1), (3, 0), (2, 1))), (2, 1, 2, ((0, 2), (1, 3), (0, 3))))


NODES4, NODES6 = (0, 0, 1, 1), (0, 0, 1, 1, 2, 2)


def plans4() -> dict[str, Plan]:
    lengths = [37, 13, 5, 20, 9, 7, 3, 11, 6]
    placement = [(0, 1, 2, 3), (0, 2), (2, 3, 0, 1), (0, 1, 2, 3), (2, 3), 1, 3, (3, 1), (1, 2)]
    mixed = make_plan(lengths, placement, NODES4, comms={8: "allgather"}, seed=3,
                      groups={0: 2, 1: 2, 2: 2, 7: 2}, tokens={0: [11, 7, 12, 7], 1: [8, 5], 2: [2, 0, 3, 0]})
    routes = (Route(doc=3, src=1, dst=2, proxies=((0, 2), (1, 3))), Route(doc=3, src=3, dst=0, proxies=((2, 0), (3, 1))))
    return {
        "alone": make_plan([64], [(0, 1, 2, 3)], NODES4, groups={0: 2}, tokens={0: [20, 12, 18, 14]}),
        "mixed": mixed,
        "mixed routed": dataclasses.replace(mixed, routes=routes).validate(),
    }


def plans6() -> dict[str, Plan]:
    lengths = [45, 12, 10, 8, 15, 6, 4]
    placement = [(0, 1, 2, 3, 4, 5), (4, 0, 2), (2, 3, 4, 5), (5, 1), (1, 3, 5), 0, 4]
    return {"three nodes": make_plan(lengths, placement, NODES6, seed=5, groups={0: 3, 1: 3, 2: 2, 3: 2},
                                     tokens={0: [9, 6, 8, 7, 10, 5], 1: [5, 3, 4]})}


# ---- attention against a single-process reference -------------------------------------


def attention_reference(q, k, v, dout, lengths, math: bool):
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


def run_attention(plan, rank, inputs, dtype=None, kernel=None, counter=None, outer_group=None):
    """(this rank's rows of the batch, its out, dq, dk, dv) of the engine on the global
    q, k, v, dout `inputs` (in `dtype`; default theirs)."""
    idx = token_index(plan, rank)
    q, k, v, dout = (x[idx] if dtype is None else x[idx].to(dtype) for x in inputs)
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    out = attention(q, k, v, plan, rank, kernel=kernel, counter=counter, outer_group=outer_group)
    out.backward(dout)
    return idx, (out.detach(), q.grad, k.grad, v.grad)


def total_bytes(counter: ByteCounter, world: int) -> ByteCounter:
    """Every rank's `counter`, summed (collective)."""
    everyone = [None] * world
    dist.all_gather_object(everyone, counter)
    total = ByteCounter()
    for c in everyone:
        total = total.merge(c)
    return total


def check_attention_plan(name, plan, rank, world, outer_group=None):
    """[(check, error, tolerance)] for one plan on this rank (`outer_group`: as in
    `attention`)."""
    gen = torch.Generator().manual_seed(len(name) + plan.num_tokens)
    N = plan.num_tokens
    inputs = [torch.randn(N, h, D, generator=gen) for h in (H, H_KV, H_KV, H)]  # q, k, v, dout
    rows = []
    ref32 = attention_reference(*(x.double() for x in inputs), plan.lengths, math=True)
    counter = ByteCounter()
    for kernel in ("cpu", "reference"):
        idx, got = run_attention(plan, rank, inputs, torch.float32, kernel, counter if kernel == "cpu" else None,
                                 outer_group)
        for what, a, b in zip("out dq dk dv".split(), got, ref32):
            rows.append((f"{name} fp32 {kernel} {what}", _max_err(a, b[idx]), 1e-5))
    # bf16: no worse than twice the error of the unsharded computation in bf16.
    bf = [x.bfloat16() for x in inputs]
    ref_bf = attention_reference(*(x.double() for x in bf), plan.lengths, math=True)
    yard = attention_reference(*bf, plan.lengths, math=False)
    idx, got = run_attention(plan, rank, bf, torch.bfloat16, outer_group=outer_group)
    for what, a, b, y in zip("out dq dk dv".split(), got, ref_bf, yard):
        rows.append((f"{name} bf16 {what}", _max_err(a, b[idx]), 2 * _max_err(y, b)))
    # Bytes: every rank's sends, summed, equal the plan's prediction exactly.
    total = total_bytes(counter, world)
    predicted = predicted_bytes(plan, H_KV, D, torch.float32)
    for phase in ("forward", "backward"):
        got_bytes, want = getattr(total, phase), getattr(predicted, phase)
        rows.append((f"{name} bytes {phase} {dict(got_bytes)} vs {dict(want)}", float(got_bytes != want), 0.0))
    return rows


# ---- the tiny model: an independent reference, one document at a time -----------------


def _rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + NORM_EPS) * w


def _rope(x_LHD, theta=ROPE_THETA):
    """Rotate pairs (i, i + D/2) as complex numbers by pos * theta^(-2i/D), pos = 0..L-1."""
    L, _, D = x_LHD.shape
    freqs = torch.arange(L, dtype=torch.float64)[:, None] * theta ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    rot = torch.polar(torch.ones_like(freqs), freqs)[:, None, :]
    z = torch.complex(x_LHD[..., : D // 2].double(), x_LHD[..., D // 2:].double()) * rot
    return torch.cat([z.real, z.imag], -1).to(x_LHD.dtype)


def reference_logits(model: Transformer, ids_L: torch.Tensor) -> torch.Tensor:
    """[L] token ids of one document -> [L, V] logits, causal attention over the document."""
    p, L = dict(model.named_parameters()), ids_L.shape[0]
    H, K, D = SPEC.num_heads, SPEC.num_kv_heads, SPEC.head_dim
    x = p["embed.weight"][ids_L]
    for i in range(SPEC.num_layers):
        w = {name.split(".", 2)[2]: t for name, t in p.items() if name.startswith(f"layers.{i}.")}
        h = _rms(x, w["attention_norm.weight"])
        q = _rope((h @ w["wq.weight"].T).view(L, H, D))
        k = _rope((h @ w["wk.weight"].T).view(L, K, D)).repeat_interleave(H // K, 1)
        v = (h @ w["wv.weight"].T).view(L, K, D).repeat_interleave(H // K, 1)
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
        x = x + o.transpose(0, 1).reshape(L, H * D) @ w["wo.weight"].T
        h = _rms(x, w["ffn_norm.weight"])
        x = x + (F.silu(h @ w["w1.weight"].T) * (h @ w["w3.weight"].T)) @ w["w2.weight"].T
    return _rms(x, p["norm.weight"]) @ p["head.weight"].T


def batch(lengths, seed=0):
    """Global token ids and labels [N]: the next token of the document, IGNORE_INDEX at a
    document's end and (a loss mask) at every 7th token."""
    tokens = torch.randint(0, SPEC.vocab_size, (sum(lengths),), generator=torch.Generator().manual_seed(seed))
    labels, start = tokens.roll(-1).clone(), 0
    for n in lengths:
        labels[start + n - 1] = IGNORE_INDEX
        start += n
    labels[::7] = IGNORE_INDEX
    return tokens, labels


def model_reference(model: Transformer, lengths, tokens, labels):
    """Global logits [N, V] and summed loss; gradients land in `model`."""
    logits = torch.cat([reference_logits(model, doc) for doc in tokens.split(list(lengths))])
    loss = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")
    loss.backward()
    return logits.detach(), loss.detach()


def rank_outputs(model: Transformer, plan, rank: int) -> tuple:
    """This rank's loss, parameter gradients and logits on its tokens of `plan`'s batch.
    numpy, not tensors: a tensor crosses the result queue as shared memory that dies with the rank."""
    tokens, labels = batch(plan.lengths)
    ti = token_index(plan, rank)
    loss = model.loss(tokens[ti], labels[ti], plan, rank)
    loss.backward()
    with torch.no_grad():
        logits = model(tokens[ti], plan, rank)
    return loss.detach().numpy(), {n: p.grad.numpy() for n, p in model.named_parameters()}, logits.numpy()


def assert_grads_close(grads: dict, ref_model, **tol):
    for name, p in ref_model.named_parameters():
        assert torch.allclose(grads[name], p.grad, **tol), name


# ---- what the runtime sends -------------------------------------------------------------


def _dtype(model) -> torch.dtype:
    return {2: torch.bfloat16, 4: torch.float32}[model.dtype_bytes]


def runtime_bytes(plan, model) -> dict[str, Counter]:
    """Per phase, Counter of (class, src, dst) the runtime sends in one layer, from one
    GPU of each tensor-parallel group (its 1/tp of the heads)."""
    ring = routing.predicted_bytes(plan, model.num_kv_heads // model.tp, model.head_dim, _dtype(model))
    grad_only = ring.backward - ring.forward  # backward = K/V again + fp32 dK/dV
    elem = model.dtype_bytes
    qkv = remapping.predicted_bytes(plan, (model.hidden + 2 * model.kv_dim) * elem // model.tp, src="linear")
    o = remapping.predicted_bytes(plan, model.hidden * elem // model.tp, src="attention")
    out = {}
    for phase in ("forward", "backward"):
        c = Counter()
        for (a, b), n in ring.forward.items():
            c["kv", a, b] += n
        if phase == "backward":
            for (a, b), n in grad_only.items():
                c["grad", a, b] += n
        for (a, b), n in (getattr(qkv, phase) + getattr(o, phase)).items():
            c["remap", a, b] += n
        out[phase] = +c
    return out


# ---- tensor parallelism -------------------------------------------------------------------


def tp_groups(world: int, tp: int):
    """As `ballonet train --tp` builds them on `world` gloo ranks: the 2-D mesh (plan ranks
    x tp, a plan rank's TP ranks consecutive, as inside a node), this rank's plan rank,
    the plan-rank group of its TP index, and the second group over the same ranks (double
    rings' transfers across nodes)."""
    from ballonet.training.parallelism import parallel

    cpu = torch.device("cpu")
    mesh = parallel.device_mesh(world, "full", cpu, tp)
    plan = parallel.plan_mesh(cpu, world, tp).get_group("plan")
    return mesh, dist.get_rank() // tp, plan, parallel.outer_group(world, tp, cpu)


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def mallinfo2() -> _Mallinfo2 | None:
    """glibc's accounting of this process's heap (`mallinfo2`, glibc 2.33+; None without):
    `arena` bytes the heap holds, `fordblks` of them free, `hblkhd` bytes mapped apart."""
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is None or not hasattr(libc, "mallinfo2"):
        return None
    libc.mallinfo2.restype = _Mallinfo2
    return libc.mallinfo2()


# ---- training against one process ------------------------------------------------------

BASE = dict(model="tiny", corpus="stdlib", global_tokens=1536, max_doc_tokens=1024, lr=3e-3, seed=3)


def whole_docs(lengths):
    return Plan(planner="ref", lengths=tuple(lengths), node_of_rank=(0,), nic_of_rank=(0,),
                attention=(tuple(Segment(d, 0, n) for d, n in enumerate(lengths)),))


def reference_loader(**config):
    return BalancedLoader(load_corpus(config["corpus"], seed=config["seed"]), global_tokens=config["global_tokens"],
                          plan_fn=whole_docs, seed=config["seed"], max_doc_tokens=config["max_doc_tokens"],
                          prefetch=False)


def ledger_reference(num_batches, **config):
    """The pieces the first `num_batches` batches must hold, read straight off the loader
    with a trivial one-rank plan (no planner, no model)."""
    out = []
    for i, b in enumerate(reference_loader(**config)):
        if i == num_batches:
            break
        out.append([list(p) for p in b.pieces])
    return out


def reference_run(steps, **config):
    """Plain PyTorch, one process, no process group, no FSDP: every document whole on one
    rank, the loss averaged over the batch's valid labels, AdamW. -> (losses, parameters)."""
    model = Transformer(ballonet.model(config["model"]), seed=config["seed"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=config["lr"], weight_decay=0.0)
    losses = []
    for i, b in enumerate(reference_loader(**config)):
        if i == steps:
            break
        loss = model.loss(b.input_ids, b.labels, b.plan, 0) / b.num_valid_tokens_global
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def round_robin(world_size):
    """Whole documents to ranks in turn: a planner independent of ballonet.planning."""

    def plan_fn(lengths):
        attention = [[] for _ in range(world_size)]
        for doc, n in enumerate(lengths):
            attention[doc % world_size].append(Segment(doc, 0, n))
        return Plan(planner="round_robin", lengths=tuple(lengths), node_of_rank=(0,) * world_size,
                    nic_of_rank=tuple(range(world_size)), attention=tuple(map(tuple, attention))).validate()

    return plan_fn


def loader(corpus, world_size=1, rank=0, **kw):
    kw.setdefault("global_tokens", 4)
    return BalancedLoader(corpus, plan_fn=round_robin(world_size), rank=rank, world_size=world_size, **kw)



# ---- launching: a cluster file of two GPU types, a free port ------------------------------


def lent_cluster_toml(name: str, lent_nodes: int, lent_gpus_per_node: int) -> str:
    """A cluster file of two GPU types: one node of 2 H800s (2 NICs), and a loaned group of
    `lent_nodes` H20 nodes of `lent_gpus_per_node` GPUs (a NIC each)."""
    return f"""
name = "{name}"
[[node_groups]]
gpu = "h800"
gpus_per_node = 2
nics_per_node = 2
[[node_groups]]
gpu = "h20"
num_nodes = {lent_nodes}
gpus_per_node = {lent_gpus_per_node}
nics_per_node = {lent_gpus_per_node}
loaned = true
"""


def free_port() -> int:
    """A TCP port on 127.0.0.1 free now (for a rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
