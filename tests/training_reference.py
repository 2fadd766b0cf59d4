"""Training in one process, what the distributed runs are checked against
(`reference_run`, `ledger_reference`), and loaders that plan without
ballonet.planning (`round_robin`, `loader`)."""

from __future__ import annotations

import torch

import ballonet
from ballonet.plan import Plan, Segment
from ballonet.training.data.corpus import load_corpus
from ballonet.training.data.loader import BalancedLoader
from ballonet.training.parallelism.model import Transformer

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
