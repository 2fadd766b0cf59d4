"""Replay a recorded schedule of transfers under NCCL's rules: does every rank finish?

A `Schedule` holds, per rank, what its host queued, in order (`ScheduleBuilder`):

* batches of sends and receives on a process group (one `batch_isend_irecv`, one NCCL
  group call), and collectives (all-to-all, all-gather) on a group;
* on the compute stream, marks (a CUDA event recorded there) and waits for batches.

The rules (NCCL's, not gloo's):

1. Tags are ignored: the n-th send from rank a to rank b on a group is received by the
   n-th receive b posts from a on that group, in posting order (FIFO per (group, src,
   dst)). A pairing whose sizes or intended tags differ is reported as a mismatch.
2. Each group has one stream per rank, which runs that rank's batches and collectives of
   the group one at a time, in posting order.
3. A batch starts when it is first on its stream and what it was posted after is done:
   the compute-stream marks it waits for and the batches (of any group) it forwards data
   from; a batch posted from the compute stream (a collective) waits for the compute
   stream to reach it.
4. A send completes only while its receiver's batch is running (rendezvous: no message
   is taken as buffered, whatever its size), and a batch completes when all its messages
   have; a collective completes once every rank of the group has started it.
5. The compute stream passes a wait when the batch waited for has completed.

`replay` runs these rules to a fixed point and says whether everything completes, and if
not, which ranks are stuck first and on what.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

__all__ = ["ScheduleBuilder", "ScheduleCheck", "replay"]


class ScheduleBuilder:
    """What every rank's host queued, in its order: `batch`, `collective`, `mark`, `wait`.
    Batches are stored column by column (a 1024-rank step has a few hundred thousand)."""

    def __init__(self, num_ranks: int):
        self.num_ranks = num_ranks
        self.rank: list[int] = []
        self.group: list[str] = []
        self.label: list[tuple] = []
        """(order, what): where in its rank's program a batch was posted; `order` is
        comparable across ranks (the report names the earliest stuck ones)."""
        self.sends: list[list] = []
        """(peer, bytes, tag) per message."""
        self.recvs: list[list] = []
        self.deps: list[list] = []
        """("mark", id) and ("batch", id): compute marks and batches it was posted after."""
        self.collective_name: dict[int, str] = {}
        """The collectives' batch ids and names."""
        self.compute: list[list[tuple]] = [[] for _ in range(num_ranks)]
        """Per rank: ("mark", id) or ("wait", batch id), in order."""
        self.num_marks = 0
        self._synced: list[int | None] = [None] * num_ranks

    @property
    def num_batches(self) -> int:
        return len(self.rank)

    def mark(self, rank: int) -> int:
        """The compute stream of `rank` reaches this point (a CUDA event recorded now)."""
        self.num_marks += 1
        self.compute[rank].append(("mark", self.num_marks - 1))
        return self.num_marks - 1

    def wait(self, rank: int, batch_ids) -> None:
        """The compute stream of `rank` waits for these batches."""
        self.compute[rank].extend([("wait", b) for b in batch_ids])

    def host_sync(self, rank: int) -> None:
        """The host of `rank` waits for its compute stream here (e.g. copies a result
        back): everything it posts later is posted after this point."""
        self._synced[rank] = self.mark(rank)

    def batch(self, rank: int, group: str, sends, recvs, *, marks=(), after=(), label=((0,), "")) -> int:
        """A batch of sends and receives ((peer, bytes, tag) each) on `group`, posted after
        the compute marks `marks` and the batches `after`."""
        deps = [("mark", m) for m in marks] + [("batch", a) for a in after]
        if self._synced[rank] is not None:
            deps.append(("mark", self._synced[rank]))
        self.rank.append(rank)
        self.group.append(group)
        self.label.append(label)
        self.sends.append(sends)
        self.recvs.append(recvs)
        self.deps.append(deps)
        return len(self.rank) - 1

    def collective(self, rank: int, group: str, name: str, label=((0,), "")) -> int:
        """A collective on `group` posted from the compute stream, which then waits for it."""
        b = self.batch(rank, group, [], [], marks=[self.mark(rank)], label=label)
        self.collective_name[b] = name
        self.wait(rank, [b])
        return b


@dataclass(frozen=True)
class ScheduleCheck:
    completes: bool
    ranks: int
    messages: int
    """Point-to-point messages (sends)."""
    bytes: int
    batches: int
    collectives: int
    stuck_ranks: tuple[int, ...] = ()
    """Ranks that never finish (empty when it completes)."""
    reason: str = ""
    """One line: what is stuck first, or what does not match (empty when it completes)."""

    def to_dict(self) -> dict:
        return {"completes": self.completes, "ranks": self.ranks, "messages": self.messages, "bytes": self.bytes,
                "batches": self.batches, "collectives": self.collectives, "stuck_ranks": list(self.stuck_ranks),
                "reason": self.reason}


def _streams(b: ScheduleBuilder) -> dict[tuple[int, str], list[int]]:
    streams = defaultdict(list)
    for i, key in enumerate(zip(b.rank, b.group)):
        streams[key].append(i)
    return streams


def _match(b: ScheduleBuilder, streams) -> tuple[list[list[int]], list[str]]:
    """Rendezvous (batch ids that must run at once; -1: one that never comes) and
    mismatches, by rule 1."""
    sends, recvs = defaultdict(list), defaultdict(list)  # (group, src, dst) -> [(batch, bytes, tag)] in order
    collectives = defaultdict(list)  # (group, n) -> batch ids
    for (rank, group), ids in sorted(streams.items()):
        n = 0
        for i in ids:
            if i in b.collective_name:
                collectives[group, n].append(i)
                n += 1
            for peer, nbytes, tag in b.sends[i]:
                sends[group, rank, peer].append((i, nbytes, tag))
            for peer, nbytes, tag in b.recvs[i]:
                recvs[group, peer, rank].append((i, nbytes, tag))
    pairs, problems = set(), []
    for key in sends.keys() | recvs.keys():
        out, into = sends.get(key, []), recvs.get(key, [])
        if len(out) != len(into):
            problems.append(f"group {key[0]!r}: rank {key[1]} sends {len(out)} messages to rank {key[2]}, "
                            f"which receives {len(into)}")
        for (a, size_a, tag_a), (c, size_c, tag_c) in zip(out, into):
            if size_a != size_c or tag_a != tag_c:
                problems.append(f"group {key[0]!r}: a send from rank {key[1]} to rank {key[2]} "
                                f"({size_a} bytes, tag {tag_a}) meets a receive of {size_c} bytes, tag {tag_c}")
            pairs.add((a, c) if a < c else (c, a))
        for i, *_ in out[len(into):] + into[len(out):]:
            pairs.add((i, -1))
    rendezvous = [list(pair) for pair in pairs]
    for (group, n), ids in sorted(collectives.items()):
        names = {b.collective_name[i] for i in ids}
        bad = len(ids) != b.num_ranks or len(names) > 1
        if bad:
            problems.append(f"group {group!r}: collective {n} is {sorted(names)} on {len(ids)} of {b.num_ranks} ranks")
        rendezvous.append(ids + [-1] * bad)
    return rendezvous, problems


def replay(b: ScheduleBuilder) -> ScheduleCheck:
    """Run the schedule under the rules above (module docstring)."""
    streams = _streams(b)
    rendezvous, problems = _match(b, streams)
    num = b.num_batches
    started, done = [False] * num, [False] * num
    unstarted = [len(r) for r in rendezvous]  # a -1 member never starts
    open_rdv = [0] * num
    rdv_of = [[] for _ in range(num)]
    for x, r in enumerate(rendezvous):
        for i in r:
            if i >= 0:
                rdv_of[i].append(x)
                open_rdv[i] += 1
    stream_of, next_on_stream = [None] * num, [-1] * num
    for ids in streams.values():
        for i, j in zip(ids, ids[1:]):
            next_on_stream[i] = j
    is_head = [False] * num
    for ids in streams.values():
        is_head[ids[0]] = True
    unmet = [len(d) for d in b.deps]
    on_mark, on_batch = defaultdict(list), defaultdict(list)  # what waits for a mark / a batch's end
    for i, deps in enumerate(b.deps):
        for kind, x in deps:
            (on_mark if kind == "mark" else on_batch)[x].append(i)
    on_compute = defaultdict(list)  # batch -> ranks whose compute stream waits for it
    fired = [False] * b.num_marks
    cursor = [0] * b.num_ranks
    todo_compute = list(range(b.num_ranks))
    todo_start = [ids[0] for ids in streams.values()]

    def complete(i: int) -> None:
        if done[i]:
            return
        done[i] = True
        j = next_on_stream[i]
        if j >= 0:
            is_head[j] = True
            todo_start.append(j)
        for x in on_batch[i]:
            unmet[x] -= 1
            todo_start.append(x)
        todo_compute.extend(on_compute[i])

    del stream_of
    while todo_compute or todo_start:
        while todo_compute:  # advance a compute stream as far as it goes
            r = todo_compute.pop()
            items, k = b.compute[r], cursor[r]
            while k < len(items):
                what, y = items[k]
                if what == "wait":
                    if not done[y]:
                        on_compute[y].append(r)
                        break
                elif not fired[y]:
                    fired[y] = True
                    for i in on_mark[y]:
                        unmet[i] -= 1
                        todo_start.append(i)
                k += 1
            cursor[r] = k
        while todo_start:
            x = todo_start.pop()
            if started[x] or unmet[x] or not is_head[x]:
                continue
            started[x] = True
            for r in rdv_of[x]:
                unstarted[r] -= 1
                if unstarted[r] == 0:
                    for i in rendezvous[r]:
                        open_rdv[i] -= 1
                        if open_rdv[i] == 0 and started[i]:
                            complete(i)
            if open_rdv[x] == 0:
                complete(x)
    return _result(b, rendezvous, problems, started, done, cursor)


def _result(b: ScheduleBuilder, rendezvous, problems, started, done, cursor) -> ScheduleCheck:
    stuck = sorted({b.rank[i] for i in range(b.num_batches) if not done[i]}
                   | {r for r in range(b.num_ranks) if cursor[r] < len(b.compute[r])})
    counts = dict(ranks=b.num_ranks, messages=sum(len(x) for x in b.sends),
                  bytes=sum(n for x in b.sends for _, n, _ in x), batches=b.num_batches,
                  collectives=len(b.collective_name))
    if not stuck and not problems:
        return ScheduleCheck(completes=True, **counts)
    reason = "; ".join(([_stuck_line(b, rendezvous, started, done, stuck)] if stuck else [])
                       + ([f"messages do not match: {problems[0]}"
                           + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")] if problems else []))
    return ScheduleCheck(completes=False, stuck_ranks=tuple(stuck), reason=reason, **counts)


def _stuck_line(b: ScheduleBuilder, rendezvous, started, done, stuck) -> str:
    """The earliest unfinished batches in program order, their ranks and whom they wait for."""
    first: dict[int, int] = {}
    for i in range(b.num_batches):
        if not done[i] and b.rank[i] not in first:
            first[b.rank[i]] = i
    if not first:
        return f"ranks {_ranks(stuck)} never finish their compute stream"
    order = min(b.label[i][0] for i in first.values())
    ranks = sorted(r for r, i in first.items() if b.label[i][0] == order)
    i = first[ranks[0]]
    peers = sorted({b.rank[j] for r in rendezvous if i in r for j in r if j >= 0 and j != i and not started[j]})
    state = (f"started, waiting for ranks {_ranks(peers)} to start theirs" if started[i]
             else "not started (waiting for what it was posted after)")
    return (f"stuck under NCCL's rules: {len(stuck)} of {b.num_ranks} ranks never finish; first ranks "
            f"{_ranks(ranks)} at {_describe(b.label[i])} on group {b.group[i]!r}; rank {ranks[0]}'s batch is {state}")


def _describe(label: tuple) -> str:
    order, what = label
    if len(order) == 4 and order[1] >= 0:  # (pass, step, payload, stage) of an attention pass
        return f"{what} pass {order[0]}, round (step {order[1]}, {('kv', 'grad')[order[2]]}, stage {order[3]})"
    return what or f"batch {order}"


def _ranks(ranks) -> str:
    ranks = list(ranks)
    return ", ".join(map(str, ranks[:12])) + (f" (+{len(ranks) - 12})" if len(ranks) > 12 else "")
