"""The check before a step's first exchange: every rank of the group runs the same plan,
as the plan rank it really is, and, given digests of the tokens, reads the same data.

One all_gather of a small int64 row per rank (the plan digest, the rank, and optionally
two `content_digest`s: of tokens the rank holds, and of the same tokens of its
successor's share, rank + 1 mod the world, as this rank reads them from its own data;
the training loader samples them, `loader.sample_offsets`), and one copy of the gathered
rows to the host. Every rank decides from the same rows, so ranks that disagree fail
together, each with the same one line. Ranks that read from different data differ on a
share read by a rank and by its predecessor wherever the ring of successors crosses from
one to the other (on the sampled tokens: data that differ only elsewhere pass).

`check_heads`, with no exchange: the plan's "heads" documents fit the heads the ranks
hold (every rank raises alike, before any exchange).
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch
import torch.distributed as dist

from ballonet.plan import Plan

__all__ = ["CONTENT_BYTES", "check_heads", "check_plan", "content_digest"]

CONTENT_BYTES = 16
"""Bytes of a token digest (BLAKE2b)."""


def content_digest(*arrays) -> bytes:
    """A digest of token arrays (numpy or CPU tensors), in order."""
    h = hashlib.blake2b(digest_size=CONTENT_BYTES)
    for a in arrays:
        a = a.numpy() if isinstance(a, torch.Tensor) else np.asarray(a)
        h.update(np.ascontiguousarray(a, dtype=np.int64).tobytes())
        h.update(b"|")
    return h.digest()


def _words(data: bytes) -> list[int]:
    return np.frombuffer(data, dtype=np.int64).tolist()


def check_heads(plan: Plan, num_kv_heads: int) -> None:
    """ValueError unless every "heads" document's member count divides `num_kv_heads`
    (the K/V heads of each rank's q, k, v): each member takes a whole share of them."""
    for ring in plan.rings:
        if ring.comm == "heads" and num_kv_heads % len(ring.ranks):
            raise ValueError(f"document {ring.doc} splits its heads over {len(ring.ranks)} ranks, which does not "
                             f"divide the {num_kv_heads} key/value heads of each rank")


def check_plan(plan: Plan, rank: int, group: dist.ProcessGroup | None, device: torch.device, *,
               content: tuple[bytes, bytes] | None = None, outer_group: dist.ProcessGroup | None = None) -> None:
    """Raise RuntimeError on every rank unless all ranks of `group` run the same plan, each
    as the plan rank it is, and, with `content` ((digest of tokens of this rank's share,
    digest of the same tokens of its successor's share as this rank reads them),
    `content_digest`), every share is read alike by its rank and its predecessor. `outer_group`, if given, must hold the
    group's ranks in their order (ValueError)."""
    if not dist.is_available() or not dist.is_initialized():
        if plan.num_ranks != 1 or rank != 0:
            raise RuntimeError(f"a plan for {plan.num_ranks} ranks needs torch.distributed initialised")
        return
    if outer_group is not None:
        outer, ranks = (dist.get_process_group_ranks(g) for g in (outer_group, group or dist.group.WORLD))
        if outer != ranks:
            raise ValueError(f"outer_group holds ranks {outer}, not the ranks of the group, {ranks}, in their order")
    world = dist.get_world_size(group)
    if world != plan.num_ranks:
        raise RuntimeError(f"the plan is for {plan.num_ranks} ranks but the process group has {world}")
    words = _words(bytes.fromhex(plan.digest)) + [rank, int(content is not None)]
    words += _words(content[0] + content[1]) if content is not None else [0] * (2 * CONTENT_BYTES // 8)
    mine = torch.tensor(words, dtype=torch.int64).to(device)
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine, group=group)
    rows = torch.stack(everyone).cpu().numpy()  # the one copy back: [world, words]
    wrong_rank = np.flatnonzero(rows[:, 4] != np.arange(world)).tolist()
    if wrong_rank:
        raise RuntimeError(f"ranks {wrong_rank} of the group were called as another plan rank")
    _, holder = np.unique(rows[:, :4], axis=0, return_inverse=True)
    if holder.max() > 0:
        sets = sorted(np.flatnonzero(holder.ravel() == h).tolist() for h in range(holder.max() + 1))
        raise RuntimeError(f"ranks disagree on the plan: rank sets {sets} hold different plans")
    if rows[:, 5].any():
        if not rows[:, 5].all():
            raise RuntimeError(f"ranks disagree on the step's tokens: ranks {np.flatnonzero(rows[:, 5] == 0).tolist()} "
                               "gave no token digest")
        half = CONTENT_BYTES // 8
        own, successor = rows[:, 6:6 + half], rows[:, 6 + half:6 + 2 * half]
        differ = [r for r in range(world) if not np.array_equal(successor[r], own[(r + 1) % world])]
        if differ:
            pairs = "; ".join(f"ranks {r} and {(r + 1) % world} read rank {(r + 1) % world}'s tokens differently"
                              for r in differ[:4])
            raise RuntimeError(f"ranks disagree on the step's tokens: {pairs}{'; and more' if len(differ) > 4 else ''} "
                               "(they read different data)")
