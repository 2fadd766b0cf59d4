"""A measured calibration profile against the built-in profile of its GPU type
(`ballonet calibrate --compare PROFILE.json`).

A Markdown table: per token count, the measured efficiency over the built-in one for
attention forward, attention backward, the linear layers and the elementwise work (1.00 =
the built-in profile predicts this machine exactly), the largest deviation of each part,
and the scalar terms (memory bandwidth, framework and optimizer seconds).
"""

from __future__ import annotations

import numpy as np

from ballonet.calibration.profile import Profile
from ballonet.cost import hardware
from ballonet.cost.profiles import PROFILES


def compare(measured: Profile) -> tuple[list[str], dict[str, float]]:
    """(the table's lines, the largest |ln ratio| of each part)."""
    built_in = PROFILES.get(measured.gpu, hardware.profile(measured.gpu))
    lines = [f"# {measured.source} vs the built-in '{measured.gpu}' profile", "",
             "| part | tokens | measured | built-in | ratio |", "| --- | --- | --- | --- | --- |"]
    worst = {}
    for part in ("attention_forward", "attention_backward", "linear", "elementwise"):
        mine, theirs = getattr(measured, part), getattr(built_in, part)
        ratios = []
        for t, e in zip(mine.tokens, mine.efficiency):
            ref = float(theirs.at(t))
            ratios.append(e / ref)
            lines.append(f"| {part} | {int(t)} | {e:.4f} | {ref:.4f} | {e / ref:.2f} |")
        worst[part] = float(np.max(np.abs(np.log(ratios))))
    lines += ["", "Largest deviation (max |ln ratio|, as a factor): "
              + ", ".join(f"{k} x{np.exp(v):.2f}" for k, v in worst.items())]
    lines += ["", "| term | measured | built-in |", "| --- | --- | --- |"]
    lines += [f"| {k} | {getattr(measured, k):.4g} | {getattr(built_in, k):.4g} |"
              for k in ("memory_bw", "framework_s_per_layer", "optimizer_s_per_param")]
    return lines, worst
