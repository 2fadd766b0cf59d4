"""Water-filling: the amounts that leave slots as level as their caps allow, and the work
of a document split over several ranks (what the placement steps level)."""

from __future__ import annotations

import numpy as np

from ballonet.cost import hardware
from ballonet.cost.flops import attention_flops
from ballonet.specs import ModelSpec

__all__ = ["ordered_sum", "split_work", "water_level", "water_level_list"]


def water_level(base, speed, unit, cap, total: float) -> np.ndarray:
    """Amounts x (sum `total`, 0 <= x <= cap) making (base + unit * x) / speed as level as
    possible: x_i = clip((level * speed_i - base_i) / unit_i, 0, cap_i) at the one level
    where they sum to `total` (every slot at its cap when the caps hold less)."""
    b, s, u, c = (np.asarray(v, dtype=float).tolist() for v in (base, speed, unit, cap))
    return np.array(water_level_list(b, s, u, c, total))


def water_level_list(b: list, s: list, u: list, c: list, total: float) -> list:
    """`water_level` on lists (refinement calls it on rings of a few ranks, where numpy's
    per-call cost is most of the work)."""
    capped = [x if x > 0 else 0.0 for x in c]
    held = sum(capped)  # (none held: every slot at 0, they being at least 0)
    if total <= 0 or held <= 0.0:
        return [0.0] * len(b)
    if held <= total:
        return capped
    # The filled amount grows piecewise linearly with the level: slot i adds s_i / u_i per
    # unit of level between b_i / s_i (its start) and (b_i + u_i c_i) / s_i (its cap).
    # (Points and changes in two lists, visited in the stable order of the points: no
    # tuple per event.)
    points: list[float] = []
    changes: list[float] = []
    add_point, add_change = points.append, changes.append
    for bi, si, ui, ci in zip(b, s, u, c):
        if ci > 0:
            rate = si / ui
            add_point(bi / si)
            add_point((bi + ui * ci) / si)
            add_change(rate)
            add_change(-rate)
    order = sorted(range(len(points)), key=points.__getitem__)
    filled, rate, at = 0.0, 0.0, points[order[0]]  # (`min(points)`)
    for k in order:
        point = points[k]
        more = filled + rate * (point - at)
        if more >= total and rate > 0:
            break
        filled, at, rate = more, point, rate + changes[k]
    else:  # the caps hold `total` only up to rounding
        return capped
    level = at + (total - filled) / rate
    return [ci if ci < (x := (level * si - bi) / ui) else 0.0 if x < 0.0 else x  # min(max(x, 0.0), ci), no calls
            for bi, si, ui, ci in zip(b, s, u, capped)]


def ordered_sum(xs: list[float]) -> float:
    """`np.sum(xs)` (`sum` compensates from Python 3.12 on): numpy adds fewer than 8 floats
    in order; up to 128, in 8 running sums (element i to sum i % 8) added pairwise, then
    the rest in order, as done here without numpy's conversion of the list
    (tests/test_planning_speed.py checks it against `np.sum`); beyond, `np.sum` itself."""
    n = len(xs)
    if n < 8:
        total = 0.0
        for x in xs:
            total += x
        return float(total)
    if n > 128:
        return float(np.sum(xs))
    r0, r1, r2, r3, r4, r5, r6, r7 = (float(x) for x in xs[:8])
    whole = n - n % 8
    for i in range(8, whole, 8):
        r0 += xs[i]
        r1 += xs[i + 1]
        r2 += xs[i + 2]
        r3 += xs[i + 3]
        r4 += xs[i + 4]
        r5 += xs[i + 5]
        r6 += xs[i + 6]
        r7 += xs[i + 7]
    total = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    for i in range(whole, n):
        total += xs[i]
    return float(total)


def split_work(model: ModelSpec, length: int, num_members: float, gpu=None) -> float:
    """Work of a document split over `num_members` ranks: its FLOPs at the kernel
    efficiency of blocks of length / num_members rows (on `gpu`'s profile)."""
    block = max(length / max(num_members, 1.0), 1.0)
    return attention_flops(model, length) / model.tp / hardware.profile(gpu).attention_forward.at_one(block)
