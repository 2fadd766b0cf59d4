"""The `distca` baseline (core attention disaggregation): valid plans on random (mixed, tp > 1)
clusters, DistCA's balance rule measured from the plan alone, the simulator, the CLI, and the
plan run on 4 gloo ranks against single-process references (the attention engine, as in
tests/test_attention.py, and the whole model with its remap, as in tests/test_llama.py).
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter

import numpy as np
import pytest
import torch
from distributed import run_ranks
from attention_checks import check_attention_plan
from runtime_traffic import runtime_bytes
from tiny_model import SPEC, assert_grads_close, batch, model_reference, rank_outputs

import ballonet
from ballonet import plan_batch, runtime, specs, workloads
from ballonet.cli import main
from ballonet.cost.seconds import attention_work
from ballonet.errors import InfeasiblePlan, InputError
from ballonet.plan import Plan
from ballonet.planning.devices import devices
from ballonet.planning.metrics import plan_metrics
from ballonet.simulation import simulate
from ballonet.specs import ClusterSpec, NodeGroup
from ballonet.training.parallelism.model import Transformer

GPUS = ["h200", "h800", "a800", "h20", "l40s"]


def _random_case(rng: np.random.Generator):
    """(lengths, cluster, model): 1 to 3 node groups of random GPU types, tp 1 or 2 where
    every node allows it, heavy-tailed document lengths."""
    groups = []
    for _ in range(int(rng.integers(1, 4))):
        gpus = int(rng.choice([1, 2, 4, 8]))
        groups.append(NodeGroup(gpu=str(rng.choice(GPUS)), num_nodes=int(rng.integers(1, 4)), gpus_per_node=gpus,
                                nics_per_node=int(rng.choice([n for n in (1, 2, 4, 8) if gpus % n == 0])),
                                nic_gbps=float(rng.choice([100, 200, 400]))))
    cluster = ClusterSpec(name="random", groups=tuple(groups))
    tp = int(rng.choice([t for t in (1, 2) if all(g.gpus_per_node % t == 0 for g in groups)]))
    model = specs.model(str(rng.choice(["tiny", "llama-3b", "llama3-8b"])), tp=tp)
    longest = float(np.exp(rng.uniform(0, np.log(400_000))))
    lengths = np.exp(rng.uniform(0, np.log(longest), int(rng.integers(0, 60)))).astype(int).clip(1).tolist()
    return lengths, cluster, model


def test_valid_plans_on_random_mixed_clusters_and_tp():
    rng = np.random.default_rng(14)
    seen = Counter()
    for _ in range(60):
        lengths, cluster, model = _random_case(rng)
        dev = devices(cluster, model)
        fits = (dev.token_cap >= 0).all() and sum(lengths) <= dev.token_cap.sum()
        try:
            plan = plan_batch(lengths, cluster, model, planner="distca")
        except InfeasiblePlan as e:  # only when no plan could hold the batch at all
            assert not fits, str(e)
            seen["infeasible"] += 1
            continue
        plan.validate()
        assert plan.lengths == tuple(lengths) and plan.attention_engine
        assert all(r.comm == "allgather" for r in plan.rings)
        linear = np.array(plan.linear_token_counts)
        assert linear.sum() == sum(lengths) and (linear <= dev.token_cap).all()
        if (dev.token_cap >= -(-sum(lengths) // plan.num_ranks)).all():  # no cap binds: equal tokens
            assert linear.max() - linear.min() <= 1
        seen["split" if plan.rings else "whole"] += 1
        seen["tp2"] += model.tp == 2
        seen["mixed"] += len({g.gpu for g in cluster.groups}) > 1
    assert seen["split"] >= 10 and seen["tp2"] >= 10 and seen["mixed"] >= 10, seen


def _unit_loads(plan: Plan, model) -> np.ndarray:
    """Per rank, the attention work DistCA balances, from the plan alone: each segment's
    tokens times its document's work per token (`attention_work` of the whole document
    over its length; zig-zag pairs do work in proportion to their tokens)."""
    per_token = attention_work(model, np.array(plan.lengths, dtype=float)) / np.array(plan.lengths)
    return np.array([sum(s.num_tokens * per_token[s.doc] for s in segs) for segs in plan.attention])


def test_attention_balanced_and_linear_layers_token_balanced_on_a_real_batch():
    cluster, model = ballonet.cluster("h200-8nic", num_nodes=4), ballonet.model("llama-7b")
    lengths = next(workloads.get("wlbllm").batches(16384 * cluster.num_ranks, seed=0, num_steps=1, max_length=65536))
    tolerance = 0.05
    plan = plan_batch(lengths, cluster, model, planner="distca", tolerance=tolerance)
    packed = plan_batch(lengths, cluster, model, planner="packed_dp")
    # DistCA's rule: every rank within the tolerance of the mean work (the second pass
    # holds donors to the same bound); integer tokens add a token's work at most.
    loads = _unit_loads(plan, model)
    assert loads.max() <= (1 + tolerance) * loads.mean() * (1 + 1e-6)
    assert loads.min() >= (1 - tolerance) * loads.mean() * (1 - 1e-6)
    # Priced by the cost model (a shard at its own length's efficiency), still far below
    # whole-document packing, which cannot split the 64K documents of this batch.
    m, p = plan_metrics(plan, cluster, model), plan_metrics(packed, cluster, model)
    assert m["attention_imbalance"] < p["attention_imbalance"] / 4
    # Linear layers: equal tokens per rank after the remap (largest remainder: +-1 token).
    assert m["linear_imbalance"] <= 1 + 1 / (sum(lengths) / plan.num_ranks)


def test_only_the_document_balance_needs_is_split_and_a_balanced_batch_stays_put():
    cluster, model = ballonet.cluster("h200-8nic", num_nodes=1), ballonet.model("llama-7b")
    even = plan_batch([3000] * 8, cluster, model, planner="distca")
    assert not even.rings and not even.remap and even.meta["moves"] == 0
    # One 24K document holds most of the attention work of 8 ranks; the short ones stay whole.
    lengths = [24_000] + [500] * 150
    plan = plan_batch(lengths, cluster, model, planner="distca")
    assert [r.doc for r in plan.rings] == [0]
    assert all(len({s.doc for s in segs if s.doc != 0}) == len([s for s in segs if s.doc != 0])
               for segs in plan.attention)


def test_memory_caps_hold_on_a_batch_that_fills_98_percent_of_memory():
    cluster, model = ballonet.cluster("h200-8nic", num_nodes=2), ballonet.model("llama-7b")
    cap = devices(cluster, model).token_cap
    rng = np.random.default_rng(0)
    lengths = [200_000, 150_000, 90_000]  # each near or over one rank's cap
    while sum(lengths) < 0.98 * cap.sum():
        lengths.append(int(min(rng.lognormal(8, 1.5), 0.98 * cap.sum() - sum(lengths))) + 1)
    plan = plan_batch(lengths, cluster, model, planner="distca")
    assert max(plan.attention_token_counts) <= cap.max() and max(plan.linear_token_counts) <= cap.max()
    assert all(u <= c for u, c in zip(plan.memory_bytes, plan.memory_cap))
    with pytest.raises(InfeasiblePlan, match="the batch has .* tokens, over the"):
        plan_batch(lengths + [int(0.03 * cap.sum())], cluster, model, planner="distca")


def test_options_are_checked():
    cluster, model = ballonet.cluster("h200-8nic", num_nodes=1), ballonet.model("llama-7b")
    for bad in ({"tolerance": 1.5}, {"tolerance": True}, {"comm": "p2p"}):
        with pytest.raises(InputError, match="distca option"):
            plan_batch([10, 20], cluster, model, planner="distca", **bad)
    ring = plan_batch([24_000] + [500] * 150, cluster, model, planner="distca", comm="ring")
    assert ring.rings and all(r.comm == "ring" for r in ring.rings)


@pytest.mark.parametrize("comm", ["allgather", "ring"])
def test_simulated_step_respects_the_bound_and_moves_the_runtime_bytes(comm):
    cluster, model = ballonet.cluster("a800-4nic", num_nodes=2), ballonet.model("llama-7b")
    lengths = [120_000, 30000, 1000, 200, 9000, 4000, 600, 16000, 2200, 120, 5000]  # one document > a node's work
    plan = plan_batch(lengths, cluster, model, planner="distca", comm=comm)
    assert any(r.kind == "inter" for r in plan.rings) and plan.remap
    res = simulate(plan, cluster, model)
    assert res.step_time_s >= res.lower_bound_s > 0
    # As the runtime runs the plan (whole blocks all-gathered, one batch), the simulator
    # moves the runtime's own bytes (its prediction is checked on gloo below); as DistCA
    # runs it (the default: K/V prefixes only, ping-pong) never more, the remap alike.
    runtime_run = dataclasses.replace(plan, meta={**plan.meta, "kv_prefix": False, "ping_pong": False})
    expected = runtime_bytes(plan, model)
    for run, exact in ((runtime_run, True), (plan, False)):
        res = simulate(run, cluster, model)
        for phase in ("forward", "backward"):
            sim = Counter({k: v for k, v in res.bytes_sent[phase].items() if k[0] != "allreduce"})
            if exact or comm == "ring":
                assert sim == pytest.approx(expected[phase]), phase
            else:
                assert all(sim[k] <= expected[phase][k] * (1 + 1e-12) for k in sim), phase
                assert all(sim[k] == pytest.approx(expected[phase][k]) for k in expected[phase] if k[0] == "remap")


def test_ping_pong_layers_meet_the_same_barrier_as_every_planner():
    # One rule for every planner (docs/design.md, section 7): a layer starts on every rank
    # together and lasts until its slowest rank's last task ends; the ping-pong's two
    # nano-batches overlap each other inside the layer, never the next layer.
    cluster, model = ballonet.cluster("a800-4nic", num_nodes=1), ballonet.model("llama-3b")
    lengths = [30000, 1000, 200, 9000, 4000, 600, 16000, 2200, 120, 5000]
    plan = plan_batch(lengths, cluster, model, planner="distca")
    assert plan.meta["ping_pong"]
    for run in (plan, dataclasses.replace(plan, meta={**plan.meta, "ping_pong": False})):
        res = simulate(run, cluster, model)
        name, tl, start, finish, _ = res.timelines[0]
        assert name == "forward" and min(start) == 0.0
        assert res.layer_forward_s == pytest.approx(max(finish), rel=1e-12)


def test_cli_plans_and_simulates_distca(capsys):
    args = ["--cluster", "h800-8nic", "--nodes", "2", "--model", "llama-7b", "--workload", "wlbllm",
            "--tokens-per-gpu", "4096"]
    assert main(["plan", *args, "--planner", "distca", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["planner"] == "distca" and out["valid"]
    assert main(["simulate", *args, "--planners", "distca,packed_dp", "--steps", "1", "--json"]) == 0
    rows = {r["planner"]: r for r in json.loads(capsys.readouterr().out)["results"]}
    assert rows["distca"]["step_time_s"] >= rows["distca"]["lower_bound_s"]


# ---- 4 gloo ranks (2 nodes x 2) ---------------------------------------------------------

LENGTHS = (300, 180, 37, 1, 5, 64, 9, 120, 2)


def _gloo_plans() -> dict[str, Plan]:
    cluster = ballonet.cluster("cpu", num_nodes=2, gpus_per_node=2)
    return {comm: plan_batch(LENGTHS, cluster, SPEC, planner="distca", comm=comm) for comm in ("allgather", "ring")}


def _on_ranks(rank: int, world: int, plans: dict) -> tuple[list, list]:
    """(attention engine checks of `attention_checks.check_attention_plan`, per plan the whole
    model's loss, gradients and logits on this rank, as numpy)."""
    rows, model_out = [], []
    for name, plan in plans.items():
        rows += check_attention_plan(f"distca {name}", plan, rank, world)
        model_out.append(rank_outputs(Transformer(SPEC, seed=3).to(torch.float32), plan, rank))
    return rows, model_out


@pytest.mark.slow
def test_distca_plans_run_on_four_gloo_ranks_like_one_process():
    plans = _gloo_plans()
    for plan in plans.values():  # split across nodes, with a remap to the linear layout
        assert any(r.kind == "inter" for r in plan.rings) and plan.remap
    results = run_ranks(4, _on_ranks, plans)
    bad = [f"rank {r}: {check}: {err:.3g} > {tol:.3g}" for r, (rows, _) in enumerate(results)
           for check, err, tol in rows if not err <= tol]
    assert not bad, "\n".join(bad)
    tol = {"rtol": 1e-4, "atol": 2e-5}
    for i, (name, plan) in enumerate(plans.items()):
        ref_model = Transformer(SPEC, seed=3).to(torch.float32)
        tokens, labels = batch(plan.lengths)
        ref_logits, ref_loss = model_reference(ref_model, plan.lengths, tokens, labels)
        per_rank = [r[1][i] for r in results]
        assert torch.allclose(sum(torch.from_numpy(loss) for loss, _, _ in per_rank), ref_loss, **tol), name
        grads = {n: sum(torch.from_numpy(g[n]) for _, g, _ in per_rank) for n, _ in ref_model.named_parameters()}
        assert_grads_close(grads, ref_model, **tol)
        for rank, (_, _, logits) in enumerate(per_rank):
            want = ref_logits[runtime.token_index(plan, rank, "linear")]
            assert torch.allclose(torch.from_numpy(logits), want, **tol), (name, rank)

