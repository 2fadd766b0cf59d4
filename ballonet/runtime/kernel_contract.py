"""What a backend of the kernel seam (`kernels.Kernel`) must return, checked against the
fp32 reference: `check(kernel)` lists each way it does not conform (empty: it conforms).

On packed sequences (causal documents, one of a single token; query blocks against longer
key blocks; a query sequence with no keys), GQA and MHA:
  forward   out [T_q, H, D] in q's dtype, lse [T_q, H] fp32, -inf on a row without keys,
            both equal to the reference's on rows with keys (bf16/fp16: 2% of the largest
            magnitude, fp32: 1e-4);
  backward  given the reference's out and lse, dq/dk/dv of q's, k's and v's shapes (dk, dv
            with H_kv heads: the query heads of a group summed), in the inputs' dtype or
            fp32, equal to the reference's.
`scripts/gpu_check.sh` holds every installed GPU backend to it; tests/test_kernels.py the
CPU ones and fakes of the flash-attn packages.
"""

from __future__ import annotations

import torch

from ballonet.runtime.kernels import KERNELS, Kernel, Packing, default_scale

CASES = {
    "causal documents": Packing.of([5, 1, 9, 3]),
    "blocks against longer keys": Packing.of([4, 2, 3], [7, 5, 1], causal=False),
    "a sequence without keys": Packing.of([3, 4], [5, 0], causal=False),
}
HEADS = ((4, 2), (2, 2))
HEAD_DIM = 8


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1.0))


def _inputs(packing: Packing, heads: tuple[int, int], dtype, device, seed: int):
    gen = torch.Generator().manual_seed(seed)
    shapes = ((packing.offsets_q[-1], heads[0]), (packing.offsets_k[-1], heads[1]),
              (packing.offsets_k[-1], heads[1]), (packing.offsets_q[-1], heads[0]))
    return [torch.randn(n, h, HEAD_DIM, generator=gen).to(device=device, dtype=dtype) for n, h in shapes]


def check(kernel: Kernel, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> list[str]:
    """Every way `kernel` departs from the seam's contract on `device` in `dtype`."""
    problems: list[str] = []
    ref, scale = KERNELS["reference"], default_scale(HEAD_DIM)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for seed, (case, packing) in enumerate(CASES.items()):
        for heads in HEADS:
            where = f"{kernel.name}, {case}, {heads[0]}/{heads[1]} heads"
            q, k, v, dout = _inputs(packing, heads, dtype, device, seed)
            keyless = torch.ones(q.shape[0], dtype=torch.bool)
            for qa, qb, _, _ in packing.sequences():
                keyless[qa:qb] = False
            keyless = keyless.to(device)
            want_out, want_lse = ref.forward(q, k, v, packing, scale)
            out, lse = kernel.forward(q, k, v, packing, scale)
            if out.shape != q.shape or out.dtype != q.dtype:
                problems.append(f"{where}: out {tuple(out.shape)} {out.dtype}, wanted {tuple(q.shape)} {q.dtype}")
            elif _error(out[~keyless], want_out[~keyless]) > tol:
                problems.append(f"{where}: out off by {_error(out[~keyless], want_out[~keyless]):.1e}")
            if lse.shape != q.shape[:2] or lse.dtype != torch.float32:
                problems.append(f"{where}: lse {tuple(lse.shape)} {lse.dtype}, wanted {tuple(q.shape[:2])} "
                                "torch.float32")
                continue
            if not bool((lse[keyless] == float("-inf")).all()):
                problems.append(f"{where}: lse of a row without keys is not -inf")
            if _error(lse[~keyless], want_lse[~keyless]) > tol:
                problems.append(f"{where}: lse off by {_error(lse[~keyless], want_lse[~keyless]):.1e}")
            dout = dout.masked_fill(keyless[:, None, None], 0)
            want = ref.backward(dout, q, k, v, want_out, want_lse, packing, scale)
            got = kernel.backward(dout, q, k, v, want_out.to(dtype), want_lse, packing, scale)
            for name, g, w, x in zip(("dq", "dk", "dv"), got, want, (q, k, v)):
                if g.shape != x.shape or g.dtype not in (x.dtype, torch.float32):
                    problems.append(f"{where}: {name} {tuple(g.shape)} {g.dtype}, wanted {tuple(x.shape)} "
                                    f"{x.dtype} or torch.float32")
                elif _error(g, w) > 5 * tol:
                    problems.append(f"{where}: {name} off by {_error(g, w):.1e}")
    return problems
