"""Train an unmodified Hugging Face `LlamaForCausalLM` with Ballonet on 2 CPU ranks.

    pip install -e '.[hf]'
    python examples/hf_llama.py [--steps 10] [--global-tokens 8192]

A small, randomly initialised model is built from a config (nothing is downloaded) with
attn_implementation="ballonet"; `BalancedLoader` streams the Python standard library's
source files as byte tokens and plans every global batch with the Zeppelin planner. Each
rank reads only its own tokens in the plan's linear (token-balanced) layout and calls the
model on them, as a batch of one with per-document positions: embedding, projections, MLP
and LM head run token-balanced; its attention layers move q, k, v to the attention layout,
run the plan's distributed attention (split documents as zig-zag rings, the rest locally)
and move the output back. (`ballonet train --model hf:DIR` does the same from a config.)
"""

from __future__ import annotations

import argparse
import functools
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import LlamaConfig, LlamaForCausalLM

import ballonet
from ballonet.integrations import hf
from ballonet.training.jobs import host
from ballonet.training.data.corpus import stdlib
from ballonet.training.data.loader import BalancedLoader

WORLD_SIZE = 2


def build_model(seed: int) -> LlamaForCausalLM:
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=176,
                         vocab_size=256, num_hidden_layers=2, attention_dropout=0.0, tie_word_embeddings=False)
    torch.manual_seed(seed)  # every rank draws the same weights
    return LlamaForCausalLM._from_config(config, attn_implementation=hf.ATTENTION, dtype=torch.float32)


def all_reduce_grads(model: torch.nn.Module) -> None:
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    offset = 0
    for g in grads:
        g.copy_(flat[offset: offset + g.numel()].view_as(g))
        offset += g.numel()


def train(rank: int, args: argparse.Namespace, init_file: str) -> None:
    host.setup_cpu_rank()  # as `ballonet train` runs a CPU rank: one thread, freed memory kept
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD_SIZE)
    cluster = ballonet.cluster("cpu", num_nodes=1, gpus_per_node=WORLD_SIZE)
    plan_fn = functools.partial(ballonet.plan_batch, cluster=cluster, model=ballonet.model("tiny"), planner="zeppelin")
    loader = BalancedLoader(stdlib(), global_tokens=args.global_tokens, plan_fn=plan_fn, rank=rank,
                            world_size=WORLD_SIZE, max_doc_tokens=args.max_doc_tokens, seed=args.seed, layout="linear")
    model = build_model(args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    for step, batch in zip(range(1, args.steps + 1), loader):
        start = time.perf_counter()
        with hf.plan_context(batch.plan, rank):
            loss = hf.loss_sum(model, batch) / batch.num_valid_tokens_global
            loss.backward()
        all_reduce_grads(model)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss = loss.detach()
        dist.all_reduce(loss)
        tokens = torch.tensor([len(batch.input_ids)])
        everyone = [torch.zeros_like(tokens) for _ in range(WORLD_SIZE)]
        dist.all_gather(everyone, tokens)
        if rank == 0:
            print(f"step {step:3d}  loss {loss.item():.4f}  documents {len(batch.pieces):3d}  "
                  f"split {len(batch.plan.rings)}  linear tokens per rank {[int(t) for t in everyone]}  "
                  f"{time.perf_counter() - start:.2f} s", flush=True)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--global-tokens", type=int, default=8192)
    p.add_argument("--max-doc-tokens", type=int, default=4096)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(train, args=(args, os.path.join(tmp, "store")), nprocs=WORLD_SIZE)


if __name__ == "__main__":
    main()
