"""Planning time and level 1s of zeppelin on bench/planner.py's batches (wlbllm, llama-7b,
H200 nodes, 128 and 1024 GPUs) with level 1's widening off and on (`classes._widened`),
medians of 5 alternating runs:

    OMP_NUM_THREADS=1 python bench/investigations/widen_cost.py
"""

import dataclasses
import importlib
import statistics
import time

import numpy as np

from ballonet import plan_batch, specs, workloads

classes = importlib.import_module("ballonet.planning.zeppelin.classes")
level1 = classes.level1
calls = [0]


def counted(*args, **kwargs):
    calls[0] += 1
    return level1(*args, **kwargs)


def main() -> None:
    classes.level1 = counted
    for gpus in (128, 1024):
        lengths = workloads.get("wlbllm").sample_batch(16384 * gpus, 0)
        cluster, model = specs.cluster("h200-8nic", num_nodes=gpus // 8), specs.model("llama-7b")
        seconds: dict[str, list[float]] = {}
        levels = {}
        for name, over in (("off", np.inf), ("on", classes.THRESHOLDS.widen_over)) * 5:
            classes.THRESHOLDS = dataclasses.replace(classes.THRESHOLDS, widen_over=over)
            calls[0] = 0
            t = time.process_time()
            plan_batch(lengths, cluster, model)
            seconds.setdefault(name, []).append(time.process_time() - t)
            levels[name] = calls[0]
        print(gpus, {name: f"{statistics.median(v) * 1e3:.1f} ms, {levels[name]} level 1s" for name, v in seconds.items()})


if __name__ == "__main__":
    main()
