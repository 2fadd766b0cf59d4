"""`ballonet simulate --plot`: each planner's step as one stacked bar (compute, exposed
communication, idle: the mean over ranks, which make up the step), its lower bound, and
its speedup over TE CP.

The axis is linear (stacked parts stay comparable) and sized by the planners that matter:
a bar over `OUTLIER` times the median step is cut at the top of the axis and labelled with
its step time, so one slow baseline does not squash the others."""

from __future__ import annotations

import os
import statistics

from ballonet.paths import write_atomic

OUTLIER = 2.5
"""A step longer than this many times the median step is cut at the axis and labelled."""

PARTS = (("compute_share", "compute", "tab:blue"), ("exposed_comm_share", "exposed communication", "tab:orange"),
         ("idle_share", "idle", "tab:gray"))


def axis_top(steps: list[float]) -> tuple[float, list[bool]]:
    """(the y axis' top, which steps are cut at it)."""
    limit = OUTLIER * statistics.median(steps)
    cut = [s > limit for s in steps]
    top = max([s for s, c in zip(steps, cut) if not c], default=limit)
    return (limit if any(cut) else top) * 1.12, cut


def plot_steps(rows, path: str, title: str) -> None:
    """Write the chart of the feasible `rows` (`comparison.Row`) to `path` (its suffix the format)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r.feasible]
    steps = [r.step_time_s for r in rows]
    top, cut = axis_top(steps)
    fig, ax = plt.subplots(figsize=(1.2 * len(rows) + 3, 4.5))
    x = range(len(rows))
    bottom = [0.0] * len(rows)
    for key, label, color in PARTS:
        heights = [getattr(r, key) * r.step_time_s for r in rows]
        ax.bar(x, heights, bottom=bottom, color=color, label=label, width=0.7)
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.scatter(x, [r.lower_bound_s for r in rows], color="black", marker="_", s=600, label="lower bound", zorder=3)
    for i, r in enumerate(rows):
        speedup = f"{r.speedup_vs_te_cp:.2f}x" if r.speedup_vs_te_cp else ""
        if cut[i]:
            ax.annotate(f"{r.step_time_s:.3g} s\n(cut) {speedup}", (i, top), ha="center", va="top", fontsize=8,
                        bbox={"facecolor": "white", "edgecolor": "none", "pad": 1})
        elif speedup:
            ax.annotate(speedup, (i, r.step_time_s), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x), [r.planner for r in rows], rotation=30, ha="right")
    ax.set_ylim(0, top)
    ax.set_ylabel("seconds per step")
    ax.set_title(title, fontsize=9)
    note = f"; bars over {OUTLIER:g}x the median step are cut, labelled with their time" if any(cut) else ""
    ax.text(0, -0.32, f"mean over ranks; speedup over te_cp above each bar{note}", transform=ax.transAxes,
            fontsize=7)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=120, format=os.path.splitext(path)[1][1:].lower()))
    plt.close(fig)
