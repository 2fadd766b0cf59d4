"""Regenerate the workload presets in ballonet/presets/ and bench/results/workloads_fit.md.

    .venv/bin/python scripts/fit_workloads.py [--data data]

wlbllm and prolong: quantile tables of the real length lists in
`data/workloads/{wlbllm,prolong}.json` (from hao-ai-lab/distca, Apache-2.0; see
`data/README.md`). The probability grid is uniform in the body and
geometric towards 1 in the tail, down to single documents: in prolong the 10 longest of
78K documents hold 28% of the sum of L^2, so the tail must be resolved document by document.

shortmix: synthetic, standing in for ArXiv/GitHub-like data with many short documents: a
mixture of 95% lognormal(median 512, sigma 1.2) and 5% lognormal(median 12288, sigma 1.0),
clipped to [16, 131072]. Its median (~560 tokens) is about a sixth of wlbllm's, about 4%
of documents exceed 8K, and these hold ~95% of the sum of L^2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from scipy.stats import norm

REPO = Path(__file__).resolve().parents[1]
SOURCES = {
    "wlbllm": "WLB-LLM-style pre-training mix, data/workloads/wlbllm.json "
              "(hao-ai-lab/distca, distca/simulator/data/dist_wlbllm.json, Apache-2.0)",
    "prolong": "ProLong-style long-context mix, data/workloads/prolong.json "
               "(hao-ai-lab/distca, distca/simulator/data/dist_prolong.json, Apache-2.0)",
}
SHORTMIX = {"weights": [0.95, 0.05], "medians": [512, 12288], "sigmas": [1.2, 1.0], "min": 16, "max": 131072}
NUM_BODY = 201
NUM_TAIL = 64


def probability_grid(num_docs: int) -> np.ndarray:
    """Uniform in [0, 1] plus 1 - k/num_docs for k geometric from num_docs/100 down to 1."""
    tail = 1.0 - np.unique(np.rint(np.geomspace(1, num_docs / 100, NUM_TAIL))) / num_docs
    return np.unique(np.round(np.concatenate([np.linspace(0.0, 1.0, NUM_BODY), tail]), 10))


def fit_real(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    cdf = probability_grid(len(lengths))
    knots = np.rint(np.quantile(lengths, cdf)).astype(np.int64)
    return cdf, knots


def fit_shortmix(num_docs: int = 1_000_000) -> tuple[np.ndarray, np.ndarray]:
    """Quantiles of the clipped mixture by inverting its CDF on a fine log grid."""
    m = SHORTMIX
    grid = np.geomspace(m["min"], m["max"], 20_000)
    mix = sum(w * norm.cdf((np.log(grid) - np.log(med)) / s)
              for w, med, s in zip(m["weights"], m["medians"], m["sigmas"]))
    cdf = probability_grid(num_docs)
    knots = np.rint(np.interp(cdf, mix, grid, left=m["min"], right=m["max"])).astype(np.int64)
    knots[0], knots[-1] = m["min"], m["max"]
    return cdf, np.maximum.accumulate(knots)


def sample_shortmix(num_docs: int, rng: np.random.Generator) -> np.ndarray:
    """Direct draws from the mixture, the reference the quantile table is checked against."""
    m = SHORTMIX
    comp = rng.choice(len(m["weights"]), size=num_docs, p=m["weights"])
    draws = np.asarray(m["medians"])[comp] * np.exp(np.asarray(m["sigmas"])[comp] * rng.standard_normal(num_docs))
    return np.clip(np.rint(draws), m["min"], m["max"]).astype(np.int64)


def stats(lengths: np.ndarray) -> dict:
    x = np.asarray(lengths, dtype=np.float64)
    sq = x * x
    p50, p90, p99 = np.percentile(x, [50, 90, 99])
    return {"mean": x.mean(), "p50": p50, "p90": p90, "p99": p99,
            "docs>8K": (x > 8192).mean(), "tokens>8K": x[x > 8192].sum() / x.sum(),
            "L2>8K": sq[x > 8192].sum() / sq.sum()}


def write_preset(name: str, cdf: np.ndarray, knots: np.ndarray, source: str, **extra) -> None:
    body = {"name": name, "source": source, **extra,
            "note": "quantile table: lengths[i] is the length at cumulative probability cdf[i]; "
                    "sampled by inverse CDF with log-linear interpolation; regenerate with "
                    "scripts/fit_workloads.py"}
    lines = [f'  "{k}": {json.dumps(v)},' for k, v in body.items()]
    lines.append('  "cdf": [' + ", ".join(f"{p:.10g}" for p in cdf) + "],")
    lines.append('  "lengths": [' + ", ".join(str(int(k)) for k in knots) + "]")
    (REPO / "ballonet" / "presets" / f"{name}.json").write_text("{\n" + "\n".join(lines) + "\n}\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(REPO / "data"), help="folder with workloads/ (default: the repo's data/)")
    parser.add_argument("--draws", type=int, default=1_000_000)
    args = parser.parse_args()
    (REPO / "ballonet" / "presets").mkdir(exist_ok=True)

    references = {}
    for name, source in SOURCES.items():
        lengths = np.asarray(json.loads((Path(args.data) / "workloads" / f"{name}.json").read_text()))
        cdf, knots = fit_real(lengths)
        write_preset(name, cdf, knots, source, num_documents=len(lengths))
        references[name] = lengths
    cdf, knots = fit_shortmix()
    write_preset("shortmix", cdf, knots, "synthetic short-heavy mix standing in for ArXiv/GitHub-like "
                 "data: clipped lognormal mixture, parameters in 'mixture'", mixture=SHORTMIX)
    references["shortmix"] = sample_shortmix(args.draws, np.random.default_rng(1))

    sys.path.insert(0, str(REPO))
    from ballonet import workloads

    cols = ["mean", "p50", "p90", "p99", "docs>8K", "tokens>8K", "L2>8K"]
    rows = ["| preset | what | " + " | ".join(cols) + " |", "|" + " --- |" * (len(cols) + 2)]
    for name, ref in references.items():
        drawn = workloads._load_preset(name).sample_lengths(args.draws, np.random.default_rng(0))
        what = "real list" if name in SOURCES else "mixture, direct draws"
        for label, s in ((what, stats(ref)), (f"preset, {args.draws:,} draws", stats(drawn))):
            cells = [f"{s[c]:.0f}" if c in ("mean", "p50", "p90", "p99") else f"{s[c]:.3f}" for c in cols]
            rows.append(f"| {name} | {label} | " + " | ".join(cells) + " |")
    report = ("# Workload presets against their sources\n\n"
              f"Command: `.venv/bin/python scripts/fit_workloads.py --draws {args.draws}`\n\n"
              + "\n".join(rows) + "\n")
    out = REPO / "bench" / "results" / "workloads_fit.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report)
    print(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
