"""Attention kernels and GEMMs on one GPU: exactness of the CUDA kernel seam, and forward
and backward timed separately (the evidence for the built-in GPU profiles).

    python bench/gpu_kernels.py --out bench/results/gpu_kernels.json

1. Each GPU backend of `ballonet.runtime.kernels` named by --kernels (default: every one
   installed here: "cuda", aten's FlashAttention-2 varlen, and with the `gpu` extra
   "flash_attn" (flash-attn 2.8) and "fa4" (flash-attn-4, Hopper and Blackwell)) held to
   the seam's contract (`runtime.kernel_contract.check`, bf16: shapes, the LSE and its
   -inf on rows without keys), then in bf16 against the fp32 "reference" on packed causal
   documents, GQA and MHA: forward out and LSE, backward dq/dk/dv, max relative error.
2. For each backend, causal varlen attention, forward alone and backward alone, CUDA events, median of
   several repeats, per document length 64 .. 128K, for two head shapes: GQA 64/4 x 128
   (the shape of the H100 files in data/calibration) and MHA 32/32 x 128 (llama-7b). A
   length L is run as a pack of max(1, 64K // L) documents so short documents are timed
   as they run in a batch, not launch-bound one by one. TFLOP/s use the causal count
   2*H*D*L*(L+1) forward and 2.5x that backward (docs/design.md, cost model).
3. bf16 GEMMs of llama-7b's layer shapes by token count (QKV, output, MLP up and down).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time

import torch
from _common import command, record

from ballonet.runtime import kernel_contract, kernels


def _time_ms(fn, repeats: int = 7, warmup: int = 2) -> tuple[float, float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), min(times)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def check_exactness(device, name: str) -> list[dict]:
    rows = []
    torch.manual_seed(0)
    for heads, kv_heads in ((8, 2), (8, 8)):
        lengths = [1, 7, 64, 300, 1000, 2048]
        T, D = sum(lengths), 64
        packing = kernels.Packing.of(lengths)
        q = torch.randn(T, heads, D, device=device)
        k = torch.randn(T, kv_heads, D, device=device)
        v = torch.randn(T, kv_heads, D, device=device)
        dout = torch.randn(T, heads, D, device=device)
        scale = kernels.default_scale(D)
        ref, cuda = kernels.KERNELS["reference"], kernels.KERNELS[name]
        out_r, lse_r = ref.forward(q, k, v, packing, scale)
        grads_r = ref.backward(dout, q, k, v, out_r, lse_r, packing, scale)
        qb, kb, vb, db = (x.bfloat16() for x in (q, k, v, dout))
        out_c, lse_c = cuda.forward(qb, kb, vb, packing, scale)
        grads_c = cuda.backward(db, qb, kb, vb, out_c, lse_c, packing, scale)
        rows.append({"kernel": name, "heads": heads, "kv_heads": kv_heads, "out": _rel(out_c, out_r), "lse": _rel(lse_c, lse_r),
                     "dq": _rel(grads_c[0], grads_r[0]), "dk": _rel(grads_c[1], grads_r[1]),
                     "dv": _rel(grads_c[2], grads_r[2])})
    return rows


def time_attention(device, max_length: int, name: str) -> list[dict]:
    rows = []
    cuda = kernels.KERNELS[name]
    for name, heads, kv_heads in (("gqa64/4", 64, 4), ("mha32", 32, 32)):
        D = 128
        L = 64
        while L <= max_length:
            num_docs = max(1, 65536 // L)
            T = num_docs * L
            packing = kernels.Packing.of([L] * num_docs)
            q = torch.randn(T, heads, D, device=device, dtype=torch.bfloat16)
            k = torch.randn(T, kv_heads, D, device=device, dtype=torch.bfloat16)
            v = torch.randn(T, kv_heads, D, device=device, dtype=torch.bfloat16)
            scale = kernels.default_scale(D)
            out, lse = cuda.forward(q, k, v, packing, scale)
            dout = torch.randn_like(out)
            fwd_ms, fwd_min = _time_ms(lambda: cuda.forward(q, k, v, packing, scale))
            bwd_ms, bwd_min = _time_ms(lambda: cuda.backward(dout, q, k, v, out, lse, packing, scale))
            flops = 2.0 * heads * D * L * (L + 1) * num_docs
            rows.append({"kernel": cuda.name, "shape": name, "heads": heads, "kv_heads": kv_heads, "head_dim": D, "length": L,
                         "num_docs": num_docs, "forward_ms": fwd_ms, "forward_ms_min": fwd_min,
                         "backward_ms": bwd_ms, "backward_ms_min": bwd_min,
                         "forward_tflops": flops / fwd_ms / 1e9, "backward_tflops": 2.5 * flops / bwd_ms / 1e9,
                         "backward_over_forward": bwd_ms / fwd_ms})
            print(f"{cuda.name:6s} {name:8s} L={L:6d} x{num_docs:5d}  fwd {fwd_ms:8.3f} ms ({rows[-1]['forward_tflops']:6.1f} TF/s)"
                  f"  bwd {bwd_ms:8.3f} ms ({rows[-1]['backward_tflops']:6.1f} TF/s)", flush=True)
            del q, k, v, out, lse, dout
            L *= 2
    return rows


def time_gemms(device) -> list[dict]:
    h, kv, ffn = 4096, 4096, 11008
    shapes = {"qkv": (h, h + 2 * kv), "out": (h, h), "mlp_up": (h, 2 * ffn), "mlp_down": (ffn, h)}
    rows = []
    for tokens in (128, 512, 2048, 8192, 32768):
        for name, (k_dim, n_dim) in shapes.items():
            x = torch.randn(tokens, k_dim, device=device, dtype=torch.bfloat16)
            w = torch.randn(k_dim, n_dim, device=device, dtype=torch.bfloat16)
            ms, ms_min = _time_ms(lambda: x @ w)
            rows.append({"gemm": name, "tokens": tokens, "ms": ms, "ms_min": ms_min,
                         "tflops": 2.0 * tokens * k_dim * n_dim / ms / 1e9})
        print(f"gemm tokens={tokens:6d}  " + "  ".join(f"{r['gemm']} {r['tflops']:.0f}" for r in rows[-4:]), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench/results/gpu_kernels.json")
    p.add_argument("--max-length", type=int, default=131072)
    p.add_argument("--kernels", default=None,
                   help="comma-separated GPU backends of ballonet.runtime.kernels to check and time "
                        "(default: every one installed here)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench/gpu_kernels.py: no CUDA device")
    device = torch.device("cuda")
    names = args.kernels.split(",") if args.kernels else [n for n in ("cuda", "flash_attn", "fa4")
                                                          if kernels.installed(n)]
    t0 = time.time()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
              "python": platform.python_version(), "date": time.strftime("%Y-%m-%d")}
    result["selected"] = kernels.select(None, device).name
    result["contract"] = {name: kernel_contract.check(kernels.select(name), device, torch.bfloat16) for name in names}
    for name, problems in result["contract"].items():
        print(f"contract {name}: " + ("; ".join(problems) if problems else "met"), flush=True)
    result["exactness"] = [row for name in names for row in check_exactness(device, name)]
    for r in result["exactness"]:
        print("exactness", r, flush=True)
    result["attention"] = [row for name in names for row in time_attention(device, args.max_length, name)]
    result["gemm"] = time_gemms(device)
    result["seconds"] = time.time() - t0
    record(command("gpu_kernels.py", argv, env=""), result, args.out)
    print(f"wrote {args.out} in {result['seconds']:.0f} s")
    return 1 if any(result["contract"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
