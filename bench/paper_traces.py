"""The Chrome traces behind `paper.md`'s bound rows: the main grid's worst configuration
(`paper_worst_trace.json`) and every configuration whose step is over the bound target
(`traces/<cluster>-<gpus>-<model>-<workload>-<context>.json.gz`, gzipped: Perfetto opens
them as they are), each of its first batch, one layer forward and backward, with the
breakdown the report quotes."""

from __future__ import annotations

import gzip
import os
import shutil
import tempfile

from paper_report import BOUND_TARGET, CLUSTERS

from ballonet import plan_batch, specs, workloads
from ballonet.cost.bounds import batch_recomputation
from ballonet.simulation.simulator import simulate


def _root(out_dir: str) -> str:
    """The repository of `out_dir` (bench/results): trace paths are given from there."""
    return os.path.dirname(os.path.dirname(os.path.abspath(out_dir)))


def _trace(cfg: dict, path: str, root: str) -> dict:
    """Simulate `cfg`'s first batch under zeppelin, write its trace to `path` (gzipped
    when it ends in .gz); its breakdown, the path relative to `root`."""
    c = specs.cluster(CLUSTERS.get(cfg["cluster"], cfg["cluster"]), num_nodes=cfg["gpus"] // 8
                      if cfg["cluster"] in CLUSTERS else None)
    m = specs.model(cfg["model"], tp=cfg["tp"])
    batch = next(iter(workloads.get(cfg["workload"]).batches(cfg["tokens_per_gpu"] * c.num_ranks, 0, 1,
                                                             cfg["max_length"])))
    res = simulate(plan_batch(batch, c, m, "zeppelin"), c, m)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if path.endswith(".gz"):
        with tempfile.TemporaryDirectory() as tmp:
            plain = os.path.join(tmp, "trace.json")
            res.to_chrome_trace(plain)
            with open(plain, "rb") as f, gzip.open(path, "wb") as g:
                shutil.copyfileobj(f, g)
    else:
        res.to_chrome_trace(path)
    n = len(res.compute_s)
    return {"cluster": cfg["cluster"], "gpus": cfg["gpus"], "model": cfg["model"], "tp": cfg["tp"],
            "workload": cfg["workload"], "trace": os.path.relpath(path, root),
            "step_time_s": res.step_time_s, "lower_bound_s": res.lower_bound_s, "recompute": res.recompute,
            "batch_recompute": batch_recomputation(batch, c, m)[0],
            "compute_max_s": max(res.compute_s), "compute_mean_s": sum(res.compute_s) / n,
            "exposed_mean_s": sum(res.exposed_comm_s) / n, "idle_mean_s": sum(res.idle_s) / n,
            "grad_allreduce_exposed_s": res.grad_allreduce_exposed_s, "head_s": res.head_s}


def worst(grid_data: list[dict], out_dir: str) -> dict:
    """The main-grid configuration where zeppelin is furthest from the batch's lower bound:
    its breakdown, and a Chrome trace of its first batch (one layer forward and backward)."""
    cfg = max(grid_data, key=lambda c: c["results"]["zeppelin"]["ratio_to_lower_bound"])
    return _trace(cfg, os.path.join(out_dir, "paper_worst_trace.json"), _root(out_dir))


def over_bound(data: dict, out_dir: str) -> None:
    """Every configuration of the main grid, the scale grid and the mixed presets whose
    step is over `BOUND_TARGET` times its bound gets `cfg["over_bound"]`: its breakdown
    and trace (`_trace`)."""
    root = _root(out_dir)
    for part in ("grid", "scale", "mixed"):
        for cfg in data.get(part) or []:
            if cfg["results"]["zeppelin"]["ratio_to_lower_bound"] > BOUND_TARGET:
                name = (f"{cfg['cluster']}-{cfg['gpus']}-{cfg['model']}-{os.path.basename(cfg['workload'])}-"
                        f"{cfg['max_length'] // 1024}k.json.gz").replace("+", "_")
                cfg["over_bound"] = _trace(cfg, os.path.join(out_dir, "traces", name), root)
