"""An unmodified HF model with and without the remap, against `ballonet.training.parallelism.model`.

    OMP_NUM_THREADS=1 python bench/hf.py [--tokens 16384] [--reps 3] [--out bench/results]

The same global batches (workload samples of `--tokens` tokens), the same Zeppelin plans
on 2 gloo ranks (`cpu` cluster, one node), the same model shape (fp32, sizes in
`SPEC`), forward + backward with the summed token loss:

* `hf_no_remap`: `LlamaForCausalLM` with attn_implementation="ballonet" (`ballonet.integrations.hf`)
  on the plan with its remap transfers dropped: every linear layer on the attention layout
  (what the adapter did before it remapped);
* `hf`: the same model on the plan: q, k, v remapped to the attention layout and o back
  inside the attention call, every linear layer on the token-balanced linear layout;
* `ballonet`: `ballonet.training.parallelism.model.Transformer`: attention on the plan, linear layers on the
  token-balanced linear layout (remapped after QKV and before the output projection).

Per rank: the median over `--reps` runs of the main thread's CPU time (time.thread_time:
gloo moves bytes on its own threads, and wall time on a shared 2-core machine measures the
neighbours); the models alternate within each repetition, so they are measured side
by side. A step waits for its slowest rank, so the max over ranks is what a step costs.
Writes hf.md to `--out`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import platform
import queue
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import LlamaConfig, LlamaForCausalLM

import ballonet
from _common import RESULTS, command, record, write_text
from ballonet import workloads
from ballonet.integrations import hf
from ballonet.specs import ModelSpec
from ballonet.training.data.corpus import from_lengths
from ballonet.training.data.loader import Batch, Piece, RankBatch, build_batch, rank_view
from ballonet.training.parallelism.model import Transformer

WORLD = 2
SPEC = ModelSpec(name="bench-hf", num_layers=2, hidden=256, num_heads=8, num_kv_heads=4, ffn_hidden=704,
                 vocab_size=256, dtype_bytes=4)
BATCHES = (("shortmix", 0), ("shortmix", 2), ("prolong", 0), ("wlbllm", 1))
MODELS = ("hf_no_remap", "hf", "ballonet")


def hf_model(spec: ModelSpec) -> LlamaForCausalLM:
    config = LlamaConfig(hidden_size=spec.hidden, num_attention_heads=spec.num_heads,
                         num_key_value_heads=spec.num_kv_heads, intermediate_size=spec.ffn_hidden,
                         vocab_size=spec.vocab_size, num_hidden_layers=spec.num_layers, attention_dropout=0.0,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM._from_config(config, attn_implementation=hf.ATTENTION, dtype=torch.float32)


def _rank(rank: int, init_file: str, num_tokens: int, reps: int, results) -> None:
    torch.set_num_threads(1)
    batches = make_batches(num_tokens)  # each rank reads its own tokens from the corpus
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    models = {"hf_no_remap": hf_model(SPEC), "hf": hf_model(SPEC), "ballonet": Transformer(SPEC, seed=0)}

    def step(name: str, view: RankBatch) -> None:
        if name.startswith("hf"):
            view = views[name]
            with hf.plan_context(view.plan, rank):
                hf.loss_sum(models[name], view).backward()
        else:
            models[name].loss(view.input_ids, view.labels, view.plan, rank).backward()

    out = []
    for batch in batches:
        view = rank_view(batch, rank)
        views = {"hf": view, "hf_no_remap": rank_view(without_remap(batch), rank)}
        times = {name: [] for name in MODELS}
        for rep in range(reps + 1):  # the first repetition warms up
            for name in MODELS:
                models[name].zero_grad(set_to_none=True)
                dist.barrier()
                start = time.thread_time()
                step(name, view)
                if rep:
                    times[name].append(time.thread_time() - start)
        out.append({name: statistics.median(t) for name, t in times.items()})
    results.put((rank, out))
    dist.destroy_process_group()


def measure(num_tokens: int, reps: int) -> list[list[dict]]:
    """[rank][batch] -> {model: median CPU seconds}."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_rank, args=(r, os.path.join(tmp, "store"), num_tokens, reps, results))
                 for r in range(WORLD)]
        for p in procs:
            p.start()
        got = {}
        while len(got) < WORLD:
            try:
                rank, out = results.get(timeout=5)
                got[rank] = out
            except queue.Empty:
                if any(p.exitcode for p in procs):  # a rank died: the others wait forever
                    for p in procs:
                        p.terminate()
                    raise SystemExit("bench/hf.py: a rank failed (traceback above)")
        for p in procs:
            p.join()
    return [got[r] for r in range(WORLD)]


def make_batches(num_tokens: int) -> list[Batch]:
    cluster = ballonet.cluster("cpu", num_nodes=1, gpus_per_node=WORLD)
    batches = []
    for i, (workload, seed) in enumerate(BATCHES):
        lengths = workloads.sample_batch(workload, num_tokens, seed=seed)
        corpus = from_lengths(lengths, seed=seed, vocab_size=SPEC.vocab_size)
        pieces = [Piece(0, doc, 0, n) for doc, n in enumerate(lengths)]
        batches.append(build_batch(corpus, pieces, i, lambda ls: ballonet.plan_batch(ls, cluster, SPEC)))
    return batches


def without_remap(batch: Batch) -> Batch:
    """The batch on its plan with no remap transfer: the linear layout is the attention layout."""
    return dataclasses.replace(batch, plan=dataclasses.replace(batch.plan, remap=()).validate())


def _ratio(values) -> float:
    return max(values) / statistics.mean(values)


def report(batches: list, per_rank: list[list[dict]], command: str, reps: int) -> str:
    lines = [
        "# Hugging Face model with and without the remap vs Ballonet's model",
        "",
        f"Command: `{command}`  ",
        f"Model: Llama shape, {SPEC.num_layers} layers, hidden {SPEC.hidden}, {SPEC.num_heads} heads, "
        f"{SPEC.num_kv_heads} KV heads, FFN {SPEC.ffn_hidden}, vocabulary {SPEC.vocab_size}, fp32; "
        f"`hf` = transformers `LlamaForCausalLM` with attn_implementation=\"ballonet\" (remapped inside the "
        "attention call), `hf_no_remap` = the same on the plan without its remap transfers, `ballonet` = "
        "`ballonet.training.parallelism.model.Transformer`. Plans: `zeppelin`, cluster `cpu` (1 node x 2 gloo ranks).  ",
        f"Forward + backward of the summed token loss; median of {reps} runs of each rank's main-thread CPU "
        "time, the models alternating.  ",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "",
        "Linear tokens: what each rank's embedding, projections, MLP and LM head see (`hf_no_remap`: the "
        "attention layout; `hf` and `ballonet`: the linear layout). A step waits for the slowest rank: `max` "
        "is the step's compute.",
        "",
        "| batch | docs | split | linear tokens hf_no_remap | linear tokens hf, ballonet | CPU s hf_no_remap "
        "| CPU s hf | CPU s ballonet | max hf_no_remap | max hf | max ballonet | max hf_no_remap/hf "
        "| max hf/ballonet |",
        "| --- | ---: | ---: | --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    gains, gaps = [], []
    for i, (batch, (workload, seed)) in enumerate(zip(batches, BATCHES)):
        plan = batch.plan
        att = [plan.attention_tokens(r) for r in range(WORLD)]
        lin = [plan.linear_tokens(r) for r in range(WORLD)]
        cpu = {m: [per_rank[r][i][m] for r in range(WORLD)] for m in MODELS}
        top = {m: max(v) for m, v in cpu.items()}
        gains.append(top["hf_no_remap"] / top["hf"])
        gaps.append(top["hf"] / top["ballonet"])
        lines.append(
            f"| {workload} seed {seed} | {len(plan.lengths)} | {len(plan.rings)} | {att} | {lin} "
            + " ".join(f"| {[round(x, 3) for x in cpu[m]]}" for m in MODELS)
            + "".join(f" | {top[m]:.3f}" for m in MODELS) + f" | {gains[-1]:.2f} | {gaps[-1]:.2f} |")
    token_ratios = [_ratio([b.plan.attention_tokens(r) for r in range(WORLD)]) for b in batches]
    lines += ["", f"Medians over the batches: max hf_no_remap/hf {statistics.median(gains):.2f}, "
                  f"max hf/ballonet {statistics.median(gaps):.2f}.",
              "",
              f"Without the remap, the attention layout's token imbalance (max/mean of its linear tokens: "
              f"{min(token_ratios):.2f} to {max(token_ratios):.2f} here) is what the HF model's linear layers "
              "lose; with it, the unmodified HF model runs its linear layers on the same balanced layout as "
              "`ballonet.training.parallelism.model`. What remains between them is per-token overhead of the two "
              "implementations and the extra position ids moved by the HF loss."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args(argv)
    batches = make_batches(args.tokens)
    cmd = command("hf.py", argv)
    results = measure(args.tokens, args.reps)
    text = report(batches, results, cmd, args.reps)
    record(cmd, {"results": results}, os.path.join(args.out, "hf.json"))
    write_text(os.path.join(args.out, "hf.md"), text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
