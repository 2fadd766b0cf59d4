"""The task patterns of a layer's split documents on a `LayerGraph`'s primitives
(`compute`, `post`, `send`, `wait`), as `runtime.ring` runs them: a ring forward and
backward, a "double" ring (a ring in each node group, rounds between them), the
gather of every member's K/V (DistCA, MagiAttention), and a "heads" document's gather of
q, k and v by heads (DeepSpeed-Ulysses). Each takes the graph, the ring's
ranks, its queue position `q`, the per-member per-step kernel seconds and K/V rows, and
the tasks each member starts after; it returns per member the task that ends its part.
The graph is anything with `Graph`'s primitives, so this module sits below `layer_graph`.
"""

from __future__ import annotations

from typing import Protocol

from ballonet.simulation.timeline import Timeline


class Graph(Protocol):
    """The primitives the patterns build on (`layer_graph.LayerGraph` has them): declared
    here so that this module needs nothing of the graph's."""

    tl: Timeline
    backward: bool

    def compute(self, rank: int, seconds: float, kind: str, key: tuple, after, name) -> int | None: ...

    def post(self, rank: int, key: tuple, after) -> list: ...

    def send(self, hop: tuple[int, int], rows: int, after, name, kind: str = "kv",
             members: int = 1) -> int | None: ...

    def wait(self, rank: int, key: tuple, after, name) -> int | None: ...


def ring_hops(ranks) -> list:
    """(src, dst) of each member to its successor in the ring."""
    g = len(ranks)
    return [(ranks[i], ranks[(i + 1) % g]) for i in range(g)]


def ring_forward(graph: Graph, ranks, kind, q, seconds, rows, begin, name) -> list:
    g, hops = len(ranks), ring_hops(ranks)
    arrive = [begin[r] for r in ranks]
    done = [[] for _ in ranks]
    for s in range(g):
        nxt = [None] * g
        for i, r in enumerate(ranks):
            if s < g - 1:  # posted before the step's compute
                nxt[(i + 1) % g] = graph.send(hops[i], rows[i][s], graph.post(r, (s, q, 0), [arrive[i]]),
                                             (name, "kv", s))
            done[i].append(graph.compute(r, seconds[i][s], kind, (s, q, 1), [arrive[i]], (name, "step", s)))
        arrive = nxt
    return [graph.tl.join(d) for d in done]


def ring_backward(graph: Graph, ranks, kind, q, seconds, rows, begin, name) -> list:
    """As `runtime.ring.ring_pass` runs it: at step s >= 1 a rank adds its
    predecessor's partial dK/dV of the block it holds (its stream waits for it) and
    passes the sum on; after the last step it waits for its own block's sum."""
    g, hops = len(ranks), ring_hops(ranks)
    kv = [begin[r] for r in ranks]
    dkv = [None] * g
    done = [[] for _ in ranks]
    for s in range(g):
        next_kv, next_dkv = [None] * g, [None] * g
        for i, r in enumerate(ranks):
            j = (i + 1) % g
            if s < g - 1:
                next_kv[j] = graph.send(hops[i], rows[i][s], graph.post(r, (s, q, 0), [kv[i]]), (name, "kv", s))
            c = graph.compute(r, seconds[i][s], kind, (s, q, 1), [kv[i]], (name, "step", s))
            done[i].append(c)
            if s >= 1:  # the gradient of the block held at step s, toward its owner
                summed = graph.wait(r, (s, q, 2), [c, dkv[i]], (name, "dkv wait", s))
                next_dkv[j] = graph.send(hops[i], rows[i][s], graph.post(r, (s, q, 3), [summed]),
                                        (name, "dkv", s), "grad")
        kv, dkv = next_kv, next_dkv
    return [graph.tl.join(d + [graph.wait(r, (g, q, 2), [dkv[i]], (name, "dkv wait", g))])
            for i, (r, d) in enumerate(zip(ranks, done))]


def double(graph: Graph, ranks, q, k: int, seconds, rows, begin, name) -> list:
    """A "double" ring (`ring_traffic.double_schedule`), forward or backward, as
    `runtime.ring._double` runs it: per round an inner ring in each node group; each
    round's first block goes on to the same position of the next group as soon as it is
    there. In the backward, dK/dV partials follow the inner ring (each rank waits for
    its predecessor's before adding its own), and each node's sum for a round's first
    block goes straight home, once the next round's first step is queued (where the
    runtime waits for that sum, so that it never holds that step's compute back) or
    after the last round; the owner waits for its sums at the end."""
    g = len(ranks)
    n = g // k
    inner = [(i // n) * n + (i % n + 1) % n for i in range(g)]
    arrive = {(i, 0): begin[r] for i, r in enumerate(ranks)}  # (position, step) -> its block is there
    done = [[] for _ in ranks]
    dkv: dict[int, int | None] = {}  # position -> its predecessor's partial of the step's block
    round_first = [None] * g  # the compute of the round's first step
    pending: dict[int, tuple] = {}  # position -> (its node's sum of the last round's first block, owner, round)
    returns: dict[int, list] = {}  # owner -> the node sums sent home to it
    last = [None] * g  # each position's latest compute

    def home(i: int, owner: int, j: int, after, key: tuple) -> None:
        if owner == i:  # round 0: the rank's own block
            done[i].append(graph.tl.join(after))
            return
        send = graph.send((ranks[i], ranks[owner]), rows[i][j * n], graph.post(ranks[i], key, after),
                         (name, "dkv home", j), "grad")
        returns.setdefault(owner, []).append(send)

    for s in range(g):
        j, t = divmod(s, n)
        incoming: dict[int, int | None] = {}
        for i, r in enumerate(ranks):
            here = arrive[i, s]
            if t < n - 1:
                arrive[inner[i], s + 1] = graph.send((r, ranks[inner[i]]), rows[i][s],
                                                    graph.post(r, (s, q, 0), [here]), (name, "kv", s))
            if t == 0 and j < k - 1:
                nxt = ((i // n + 1) % k) * n + i % n
                arrive[nxt, s + n] = graph.send((r, ranks[nxt]), rows[i][s], graph.post(r, (s, q, 0), [here]),
                                               (name, "kv out", s))
            c = graph.compute(r, seconds[i][s], "inter", (s, q, 1), [here], (name, "step", s))
            done[i].append(c)
            last[i] = c
            if t == 0:
                round_first[i] = c
            if not graph.backward:
                continue
            if i in pending:  # the last round's node sum: waited for after this step's compute
                total, owner, jj = pending.pop(i)
                home(i, owner, jj, [graph.wait(r, (s, q, 2), [total], (name, "dkv wait", s))], (s, q, 3))
            if t >= 1:
                summed = graph.wait(r, (s, q, 2), [c, dkv.get(i)], (name, "dkv wait", s))
                incoming[inner[i]] = graph.send((r, ranks[inner[i]]), rows[i][s], graph.post(r, (s, q, 3), [summed]),
                                               (name, "dkv", s), "grad")
        dkv = incoming
        if graph.backward and t == n - 1:
            for i, r in enumerate(ranks):
                total = graph.tl.join([round_first[i], dkv.get(i), last[i]])  # the node's sum of the round's first block
                owner = ((i // n - j) % k) * n + i % n
                if n == 1:
                    home(i, owner, j, [total], (s, q, 3))
                elif j < k - 1:
                    pending[i] = (total, owner, j)
                else:
                    home(i, owner, j, [graph.wait(r, (g, q, 2), [total], (name, "dkv wait", g))], (g, q, 3))
            dkv = {}
    for owner, sends in returns.items():
        done[owner].append(graph.wait(ranks[owner], (g + 1, q, 2), sends, (name, "dkv home wait", g)))
    return [graph.tl.join(d) for d in done]


def gather(graph: Graph, ranks, q, rows, begin, name) -> list:
    """K/V sent straight from every member to every other member, rows[i][j] from i
    to j (the runtime: i's whole block); per member the task after which all have
    arrived."""
    g = len(ranks)
    start = [graph.post(r, (0, q, 0), [begin[r]]) for r in ranks]
    arrive = [[begin[r]] for r in ranks]
    for i in range(g):
        for j in range(g):
            if j != i:
                arrive[j].append(graph.send((ranks[i], ranks[j]), rows[i][j], start[i], (name, "gather")))
    return [graph.tl.join(a) for a in arrive]


def gather_forward(graph: Graph, ranks, kind, q, seconds, rows, begin, name) -> list:
    """The own block at the first round, the gathered ones in one call at the next."""
    arrive = gather(graph, ranks, q, rows, begin, name)
    return [graph.tl.join([graph.compute(r, seconds[i][0], kind, (0, q, 1), [begin[r]], (name, "own block", 0)),
                          graph.compute(r, seconds[i][1], kind, (1, q, 1), [arrive[i]], (name, "gathered", 1))])
            for i, r in enumerate(ranks)]


def gather_backward(graph: Graph, ranks, kind, q, seconds, rows, begin, name) -> list:
    """K/V gathered again, the own block's call, one call over the gathered blocks,
    then each member's block gradient sent home, where the owner waits for them all."""
    g, arrive = len(ranks), gather(graph, ranks, q, rows, begin, name)
    own = [graph.compute(r, seconds[i][0], kind, (0, q, 1), [begin[r]], (name, "own block", 0))
           for i, r in enumerate(ranks)]
    comp = [graph.compute(r, seconds[i][1], kind, (1, q, 1), [arrive[i]], (name, "gathered", 1))
            for i, r in enumerate(ranks)]
    back = [[] for _ in range(g)]
    for i in range(g):
        for j in range(g):
            if j != i:  # the gradient of the rows j sent i
                back[j].append(graph.send((ranks[i], ranks[j]), rows[j][i],
                                         graph.post(ranks[i], (1, q, 3), [comp[i]]), (name, "dkv"), "grad"))
    return [graph.tl.join([own[i], comp[i], graph.wait(r, (2, q, 2), back[i], (name, "dkv wait", 2))])
            for i, r in enumerate(ranks)]


def heads(graph: Graph, ranks, kind, q, seconds, rows, begin, name, rerun=None) -> list:
    """A "heads" document's pass (`ring_traffic._heads_messages`), as the runtime runs it
    (`runtime.heads.heads_pass`): at the first round each member posts its rows of q, k and
    v (in the backward also "dout") to every other member, for that member's heads; after
    the first round's kernels (its own blocks' steps of other rings, the local documents)
    its one kernel over the whole document for its own heads (`seconds[i]`) once all of
    them are in; then it returns each member's rows of the result ("out"; "dqkv") and its
    stream waits until every other member's return of its own rows is in, before any
    kernel of the next round (the runtime's round (0, GRAD, 0) precedes round (1, KV, 0)).
    `rows[i]`: member i's rows. With `rerun` (full recomputation, backward) the forward
    runs first, its kernel of `rerun[i]` seconds and its messages, and the backward's
    gathers leave once its returns are in. Rounds between 0 and 1 order these on the
    streams (`LayerGraph.order` sorts by key)."""
    after, post = [begin[r] for r in ranks], (0, q, 0)
    if rerun is not None:
        after = _heads_round(graph, ranks, kind, q, post, 0.25, rerun, rows, ("qkv",), "out", after, name)
        post = (0.25, q, 3)
    gathered, back = (("qkv", "dout"), "dqkv") if graph.backward else (("qkv",), "out")
    return _heads_round(graph, ranks, kind, q, post, 0.5, seconds, rows, gathered, back, after, name)


def _heads_round(graph: Graph, ranks, kind, q, post_key: tuple, s: float, seconds, rows, gathered: tuple,
                 back: str, after, name) -> list:
    """`heads`' gather (posted at `post_key`), kernel (round `s`), returns (posted after
    it) and the wait for them; per member the task that ends it."""
    g = len(ranks)
    arrive = [[a] for a in after]
    for i, r in enumerate(ranks):
        post = graph.post(r, post_key, [after[i]])
        for payload in gathered:
            for j in range(g):
                if j != i:
                    arrive[j].append(graph.send((r, ranks[j]), rows[i], post, (name, payload), payload, g))
    comp = [graph.compute(r, seconds[i], kind, (s, q, 1), arrive[i], (name, "heads"))
            for i, r in enumerate(ranks)]
    returned: list[list] = [[] for _ in range(g)]
    for j, r in enumerate(ranks):
        post = graph.post(r, (s, q, 3), [comp[j]])
        for i in range(g):
            if i != j:  # member i's rows of j's heads
                returned[i].append(graph.send((r, ranks[i]), rows[i], post, (name, back), back, g))
    return [graph.tl.join([comp[i], graph.wait(r, (s, q, 4), returned[i], (name, f"{back} wait"))])
            for i, r in enumerate(ranks)]
