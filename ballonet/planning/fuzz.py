"""Planner fuzz: random clusters, models and batches, every planner on each, and every
outcome but a valid plan or a clear refusal counted as a failure (`bench/fuzz.py` runs it
at scale; `tests/test_fuzz.py` a slice).

A case is 1 to 3 node groups of any GPU type (1 to 8 GPUs and NICs per node), a model
preset at tp 1, 2 or 4, and a batch of 64 to 32K tokens per GPU made of 1 to 256
documents of 1 to 1M tokens (log-uniform up to a longest length, itself log-uniform).
A call may end in a valid plan or in `InfeasiblePlan` / `InputError`; anything else (an
invalid plan, another exception, a call longer than its timeout) is a failure.
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import sys
from collections import Counter

import numpy as np

from ballonet import specs
from ballonet.cost import hardware
from ballonet.errors import InputError
from ballonet.planning import PLANNERS, plan_batch

__all__ = ["VARIANTS", "check_call", "fuzz_planners", "random_case", "random_cluster"]

MAX_LENGTH = 1 << 20
MAX_DOCS = 256
TP_CHOICES = (1, 2, 4)
MODEL_WEIGHTS = {"tiny": 0.3, "llama-3b": 0.2, "llama-7b": 0.2, "llama3-8b": 0.1, "llama-13b": 0.1, "llama-30b": 0.1}
"""Draw weights of the model presets: big models do not fit most random GPUs (an early
InfeasiblePlan), so smaller ones are drawn more often to exercise the planners."""


def random_cluster(rng: np.random.Generator) -> specs.ClusterSpec:
    """1 to 3 node groups of random GPU types, 1 to 8 GPUs per node, NICs dividing them."""
    groups = []
    for _ in range(int(rng.integers(1, 4))):
        gpus = int(rng.choice([1, 2, 4, 8]))
        nics = int(rng.choice([n for n in (1, 2, 4, 8) if gpus % n == 0 or n % gpus == 0]))
        groups.append(specs.NodeGroup(gpu=str(rng.choice(sorted(hardware.GPUS))), num_nodes=int(rng.integers(1, 5)),
                                      gpus_per_node=gpus, nics_per_node=nics,
                                      nic_gbps=float(rng.choice([100, 200, 400]))))
    return specs.ClusterSpec(name="fuzz", groups=tuple(groups))


def random_case(rng: np.random.Generator):
    """(lengths, cluster, model): tp is 1, 2 or 4 where every node fits it and the heads divide."""
    cluster = random_cluster(rng)
    names = list(MODEL_WEIGHTS)
    model = specs.MODELS[names[int(rng.choice(len(names), p=list(MODEL_WEIGHTS.values())))]]
    fitting = [tp for tp in TP_CHOICES if all(g.gpus_per_node % tp == 0 for g in cluster.groups)
               and model.num_heads % tp == 0 and model.num_kv_heads % tp == 0]
    model = dataclasses.replace(model, tp=int(rng.choice(fitting)))
    longest = np.exp(rng.uniform(0, np.log(MAX_LENGTH)))
    budget = cluster.num_ranks * np.exp(rng.uniform(np.log(64), np.log(32768)))  # tokens per GPU: 64 to 32K
    lengths = np.exp(rng.uniform(0, np.log(longest), MAX_DOCS)).astype(np.int64).clip(1, MAX_LENGTH)
    num_docs = max(1, int(np.searchsorted(np.cumsum(lengths), budget)))
    return lengths[:num_docs].tolist(), cluster, model
VARIANTS = {**{name: (name, {}) for name in PLANNERS}, "zeppelin single": ("zeppelin", {"double": False})}
"""What each call plans with (name: (planner, options)): every planner, and zeppelin
without double rings."""


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout


def check_call(lengths, cluster, model, planner: str, timeout_s: float, options: dict | None = None) -> str:
    """"ok", "infeasible" or "input_error"; anything else is a failure ("invalid: ...",
    "crash: ...", "hang")."""
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        plan_batch(lengths, cluster, model, planner=planner, **(options or {})).validate()
        return "ok"
    except _Timeout:
        return "hang"
    except InputError as e:
        return "infeasible" if type(e).__name__ == "InfeasiblePlan" else "input_error"
    except Exception as e:  # noqa: BLE001 - a fuzz records every other exception as a failure
        return f"{'invalid' if type(e).__name__ == 'InvalidPlan' else 'crash'}: {type(e).__name__}: {e}"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _fuzz_case(seed: int, case: int, timeout_s: float) -> tuple[int, dict[str, str], tuple]:
    """Case `case` of the fuzz (its own generator, so cases split over processes)."""
    lengths, cluster, model = random_case(np.random.default_rng([seed, case]))
    outcomes = {name: check_call(lengths, cluster, model, planner, timeout_s, options)
                for name, (planner, options) in VARIANTS.items()}
    return case, outcomes, (lengths, cluster, model)


def fuzz_planners(num_cases: int, seed: int = 0, timeout_s: float = 30.0, jobs: int = 1) -> dict:
    """Outcome counts per planner, and the first failures (with the case that made them)."""
    import functools
    import multiprocessing

    counts: dict[str, Counter] = {name: Counter() for name in VARIANTS}
    failures: list[dict] = []
    run = functools.partial(_fuzz_case, seed, timeout_s=timeout_s)
    with multiprocessing.get_context("fork").Pool(jobs) if jobs > 1 else contextlib.nullcontext() as pool:
        results = pool.imap_unordered(run, range(num_cases), chunksize=16) if pool else map(run, range(num_cases))
        for done, (case, outcomes, (lengths, cluster, model)) in enumerate(results, 1):
            for name, outcome in outcomes.items():
                counts[name][outcome.split(":")[0]] += 1
                if outcome not in ("ok", "infeasible", "input_error") and len(failures) < 20:
                    failures.append({"case": case, "planner": name, "outcome": outcome, "lengths": lengths,
                                     "cluster": cluster.to_dict(), "model": model.name, "tp": model.tp})
            if done % 500 == 0:
                print(f"  {done}/{num_cases} cases", file=sys.stderr, flush=True)
    return {"cases": num_cases, "seed": seed, "timeout_s": timeout_s, "counts": {k: dict(v) for k, v in counts.items()},
            "failures": failures}
