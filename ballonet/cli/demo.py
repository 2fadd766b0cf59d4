"""`ballonet demo`: the README's tour, a simulated planner comparison and then a real
4-rank CPU training with zeppelin plans."""

from __future__ import annotations

import json

from ballonet import specs
from ballonet.cli.common import (
    check_batch_fits,
    infeasible_footer,
    positive_int,
    print_table,
    row_cells,
    seed,
    subparser,
)


def register(sub) -> None:
    p = subparser(sub, "demo", cmd_demo, help="a short tour: a simulated comparison, then a real 4-rank training",
                  description="The README's main job: simulate planners on a 32-GPU A800 cluster, then "
                              "train the tiny model on 4 CPU ranks with zeppelin plans.")
    p.add_argument("--steps", type=positive_int, default=20, help="training steps (default: %(default)s)")
    p.add_argument("--tokens-per-gpu", type=positive_int, default=16384, help="simulated tokens per GPU")
    p.add_argument("--seed", type=seed, default=0, help="seed of the sampled batch and of the training")


def cmd_demo(args) -> int:
    import os
    import tempfile

    from ballonet.simulation import comparison
    from ballonet.training.jobs.launch import launch

    cluster, model = specs.cluster("a800-4nic", num_nodes=4), specs.model("llama-7b")
    planners = ["zeppelin", "te_cp", "hybrid_dp", "packed_dp"]
    check_batch_fits(args.tokens_per_gpu, cluster, model)  # before anything is printed
    print(f"1/2  Simulated: {model.name} on {cluster.num_ranks} A800 GPUs (4 nodes, 2 GPUs per 200 Gb/s NIC), "
          f"wlbllm documents, {args.tokens_per_gpu} tokens per GPU\n", flush=True)
    rows = comparison.compare(cluster, model, "wlbllm", args.tokens_per_gpu, planners, steps=1, seed=args.seed)
    print_table("one training iteration, simulated", ["planner", "step s", "vs te_cp", "MFU", "attn imbalance",
                                                      "exposed comm"],
                [row_cells(r, ["step_time_s", "speedup_vs_te_cp", "mfu", "attention_imbalance",
                               "exposed_comm_share"]) for r in rows], infeasible_footer(rows))
    print(f"\n2/2  Real: the tiny model trained on 4 CPU ranks (2 emulated nodes of 2) with zeppelin plans, "
          f"on the Python standard library's source files, {args.steps} steps\n", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "log.jsonl")
        argv = ["--model", "tiny", "--corpus", "stdlib", "--planner", "zeppelin", "--nodes", "2",
                "--global-tokens", "8192", "--max-doc-tokens", "4096", "--steps", str(args.steps),
                "--seed", str(args.seed), "--json-log", log, "--log-every", "5"]
        code = launch(argv, nproc=4, max_restarts=0)
        if code:
            return code
        with open(log) as f:
            records = [json.loads(line) for line in f]
    first, last = records[0], records[-1]
    imbalance = sorted(r["compute_s_max"] / r["compute_s_mean"] for r in records)
    print(f"\nloss {first['loss']:.3f} -> {last['loss']:.3f} over {len(records)} steps; per-rank compute "
          f"max/mean: median {imbalance[len(imbalance) // 2]:.2f}, worst {imbalance[-1]:.2f}; "
          f"planning {sum(r['plan_ms'] for r in records) / len(records):.1f} ms per batch (in the background)")
    return 0
