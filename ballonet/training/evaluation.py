"""The held-out loss (`--eval-every N`): documents held out of the training corpus, or
another corpus (`--eval-corpus`), cut into global batches, planned and run forward as
training runs them, without gradients.

`eval_loss` is the sum of token losses over every evaluated batch divided by their valid
labels (the mean token loss of the evaluation set, not a mean of batch means), so it does
not depend on the number of ranks or on how the batches are planned.

The held-out documents are a seeded choice from the whole corpus (`hold_out`), fixed by
the seed and the token count alone: a run and its resumption hold out the same ones, and
the training loader never sees them (its corpus is the rest).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from ballonet.errors import InputError
from ballonet.plan import Plan
from ballonet.training.config import TrainConfig
from ballonet.training.data.corpus import Corpus, load_corpus
from ballonet.training.parallelism import tensor_parallel
from ballonet.training.data.loader import BalancedLoader, RankBatch

_HOLD_OUT_STREAM = 0x5EED_E7A1
"""Mixed into the seed of the held-out choice, so it is not the first epoch's order."""


def subset(corpus: Corpus, docs: np.ndarray, name: str) -> Corpus:
    """The documents `docs` of `corpus` (in that order) as a corpus of their own."""
    docs = np.asarray(docs, dtype=np.int64)
    read_range = corpus.read_range
    return Corpus(name=name, names=tuple(corpus.names[int(d)] for d in docs), lengths=corpus.lengths[docs],
                  vocab_size=corpus.vocab_size, read=lambda doc: corpus.read(int(docs[doc])),
                  read_range=None if read_range is None else
                  (lambda doc, start, end: read_range(int(docs[doc]), start, end)))


def hold_out(corpus: Corpus, num_tokens: int, seed: int) -> tuple[Corpus, Corpus]:
    """(the training corpus, the held-out corpus): documents of a seeded permutation held
    out until they hold `num_tokens` tokens; refused if that leaves nothing to train on."""
    order = np.random.default_rng([seed, _HOLD_OUT_STREAM]).permutation(corpus.num_docs)
    taken = int(np.searchsorted(np.cumsum(corpus.lengths[order]), num_tokens) + 1)
    if taken >= corpus.num_docs:
        raise InputError(f"--eval-every: holding out {num_tokens} tokens for evaluation leaves nothing of corpus "
                         f"{corpus.name!r} ({corpus.num_tokens} tokens in {corpus.num_docs} documents) to train "
                         "on; give --eval-corpus or fewer --eval-tokens")
    held = np.sort(order[:taken])
    kept = np.setdiff1d(np.arange(corpus.num_docs), held)
    return subset(corpus, kept, corpus.name), subset(corpus, held, f"{corpus.name} (held out)")


def eval_tokens(config: TrainConfig) -> int:
    """Tokens each evaluation reads (--eval-tokens; default two global batches)."""
    return config.eval_tokens or 2 * config.global_tokens


def split_corpora(config: TrainConfig, corpus: Corpus) -> tuple[Corpus, Corpus | None]:
    """(the corpus the run trains on, the one it evaluates on or None without --eval-every)."""
    if not config.eval_every:
        return corpus, None
    if config.eval_corpus:
        return corpus, load_corpus(config.eval_corpus, seed=config.seed)
    return hold_out(corpus, eval_tokens(config), config.seed)


def eval_batches(corpus: Corpus, *, num_tokens: int, global_tokens: int, plan_fn: Callable[[tuple[int, ...]], Plan],
                 rank: int, world_size: int, max_doc_tokens: int | None, grad_accum: int = 1) -> Iterable[RankBatch]:
    """This rank's share of the evaluation set: the corpus in its own order, in batches of
    `global_tokens` (as `grad_accum` micro-batches each, as training runs them), as many
    as `num_tokens` needs (fewer if the corpus holds fewer; a last batch under one token
    per rank is left out)."""
    loader = BalancedLoader(corpus, global_tokens=global_tokens, plan_fn=plan_fn, rank=rank, world_size=world_size,
                            shuffle=False, max_epochs=1, max_doc_tokens=max_doc_tokens, grad_accum=grad_accum)
    wanted, micro = math.ceil(num_tokens / global_tokens), []
    for batch in loader:
        micro.append(batch)
        if len(micro) < batch.num_micro_batches:
            continue
        if wanted == 0 or sum(p.end - p.start for b in micro for p in b.pieces) < world_size:
            break
        yield from micro
        wanted, micro = wanted - 1, []


def evaluate(model, batches: Iterable[RankBatch], rank: int, group, device: torch.device, outer_group=None,
             reduce_group=None) -> dict:
    """Collective: the model's loss over `batches` (this rank's share of each), without
    gradients; `group` carries the plan's traffic, `outer_group` as in
    `runtime.attention`, the sum is reduced over `reduce_group` (default `group`).
    -> {"eval_loss", "eval_tokens"} (tokens with a label, over all batches)."""
    loss_sum, valid = torch.zeros((), dtype=torch.float64, device=device), 0
    with torch.no_grad():
        for batch in batches:
            meta, input_ids, labels = batch.staged.to(device)
            with tensor_parallel.loss_context(model):
                loss = model.loss(input_ids, labels, batch.plan, rank, group, outer_group=outer_group, meta=meta,
                                  content=batch.content)  # the plan and data checked first
            loss_sum += loss.double()
            valid += batch.batch.num_valid_tokens  # this (micro-)batch's own
    for module in model.modules():  # no backward resharded what the forward gathered (the root keeps it)
        if isinstance(module, FSDPModule):
            module.reshard()
    reduce_group = reduce_group or group
    if reduce_group is not None and dist.get_world_size(reduce_group) > 1:
        dist.all_reduce(loss_sum, group=reduce_group)
    if not valid:
        raise InputError("evaluation: the evaluation set has no token with a label")
    return {"eval_loss": loss_sum.item() / valid, "eval_tokens": valid}
