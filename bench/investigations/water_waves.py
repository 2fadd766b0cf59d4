"""Whether refinement's water levels would pay as one numpy pass per wave of rings (issue 49, item 1).

    OMP_NUM_THREADS=1 python bench/investigations/water_waves.py

Refinement levels one split document at a time (`water.water_level_list`, on lists: rings
have a few members). In its LEVEL and DROP sweeps a document's visit reads and writes only
its members' state, so documents with no member in common could be levelled together.
This times the water level alone for a wave of K random rings of 2-8 members: the list
version ring by ring against one pass over all K rows of padded arrays (the event sweep
as stable sorts and cumulative sums along rows, which keep the list version's order of
additions). Timing only: the numpy pass is not checked against the lists here, and a
real wave would also gather and scatter the members' loads and units. Prints microseconds
per wave; nothing is written.

On 2026-12-07 (shared 2-core VM): 10 rings 159 us by lists against 224 us in one pass, 50
rings 740 against 242, 200 rings 3132 against 655. At 1024 GPUs (bench/planner.py's batch)
a candidate's 54-205 split documents fall into 1-4 waves of documents with no member in
common (at 128 GPUs, 8-27 documents). A refinement that re-spread the LEVEL and DROP
sweeps' waves so (branch s6-speed, not kept) made the same plans, every plan through it
(the 258 zeppelin plans of `plan_digests`-style checks digest-identical), but refined the
12 candidates of the 1024-GPU plan in 221 and 223 ms against 194 and 191 ms one ring at a
time (medians of 5, two alternating runs): the per-document steps around the water level
(units, takes and puts, stamps, filling the arrays) cost more than the pass saves.
"""

from __future__ import annotations

import random
import timeit

import numpy as np

from ballonet.planning.zeppelin.water import water_level_list


def _rings(k: int) -> list[tuple[list[float], list[float], list[float], list[float], float]]:
    out = []
    for _ in range(k):
        n = random.choice(range(2, 9))
        out.append(([random.random() * 1e6 for _ in range(n)], [1.0] * n,
                    [random.random() * 10 + 1 for _ in range(n)], [random.random() * 5000 for _ in range(n)],
                    random.random() * 1e4))
    return out


def _numpy_wave(b, s, u, c, total):
    """The water level of every row at once (padded slots: no room, starting far above)."""
    rate = s / u
    points = np.concatenate([b / s, (b + u * c) / s], axis=1)
    change = np.concatenate([rate, -rate], axis=1)
    order = np.argsort(points, axis=1, kind="stable")
    p, ch = np.take_along_axis(points, order, 1), np.take_along_axis(change, order, 1)
    r = np.cumsum(ch, axis=1)
    step = np.zeros_like(p)
    step[:, 1:] = r[:, :-1] * np.diff(p, axis=1)
    filled = np.cumsum(step, axis=1)
    rising = np.concatenate([np.zeros((len(total), 1), bool), r[:, :-1] > 0], axis=1)
    k = ((filled >= total[:, None]) & rising).argmax(axis=1)
    rows = np.arange(len(total))
    with np.errstate(divide="ignore", invalid="ignore"):
        level = p[rows, k - 1] + (total - filled[rows, k - 1]) / r[rows, k - 1]
        x = (level[:, None] * s - b) / u
    return np.where(c < x, c, np.where(x < 0, 0.0, x))


def main() -> int:
    random.seed(0)
    for k in (10, 50, 200):
        rings = _rings(k)
        b, s, u, c = np.full((k, 8), 1e30), np.ones((k, 8)), np.ones((k, 8)), np.zeros((k, 8))
        for i, (bi, si, ui, ci, _) in enumerate(rings):
            n = len(bi)
            b[i, :n], s[i, :n], u[i, :n], c[i, :n] = bi, si, ui, ci
        total = np.array([r[4] for r in rings])
        lists = timeit.timeit(lambda: [water_level_list(*r) for r in rings], number=200) / 200
        wave = timeit.timeit(lambda: _numpy_wave(b, s, u, c, total), number=200) / 200
        print(f"{k} rings of 2-8 members: lists ring by ring {lists * 1e6:.0f} us, one numpy pass {wave * 1e6:.0f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
