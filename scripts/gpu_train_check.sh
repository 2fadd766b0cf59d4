#!/usr/bin/env bash
# The GPU path, end to end, on one GPU in under 5 minutes (issue 15, item 6):
#   1. the CUDA kernel seam (aten flash-attention varlen, bf16) forward and backward
#      against the fp32 reference (tests/test_kernels.py runs the "cuda" backend when a
#      GPU is present);
#   2. one-rank bf16 training of a ~1B llama-shaped model (llama3-1b) with FSDP2, under full
#      and under linear recomputation (whose peak memory checks the cost model's count),
#      printing tokens/s and MFU per step; with BALLONET_SYNC_DEBUG=error (as
#      scripts/gpu_check.sh runs it) every step after the first runs under
#      torch.cuda.set_sync_debug_mode("error"), so a host-device sync in a step fails it;
# and appends the figures, with the date, to bench/results/gpu.md.
#
#   bash scripts/gpu_train_check.sh      # from the repository root, python on PATH
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true

echo "== 1/2 kernels: cuda against the fp32 reference"
$PY -m pytest -q -x tests/test_kernels.py 2>&1 | tail -3

for MODE in full linear; do
echo "== 2/2 llama3-1b, 1 rank, FSDP2, bf16, --recompute $MODE"
LOG=$(mktemp -d)/train.jsonl
CMD=(-m ballonet train --model llama3-1b --cluster h200-8nic --nodes 1 --dtype bf16 --recompute "$MODE"
     --steps 5 --global-tokens 16384 --max-doc-tokens 4096 --json-log "$LOG")
$PY "${CMD[@]}"

$PY - "$LOG" "${CMD[*]}" <<'PY'
import datetime, json, statistics, sys
records = [json.loads(line) for line in open(sys.argv[1])]
steady = records[1:] or records  # the first step pays for warm-up
import torch
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU (CPU dry run)"
import os
debug = os.environ.get("BALLONET_SYNC_DEBUG")
lines = [f"\n## {datetime.date.today()}: {gpu}\n",
         f"`{'BALLONET_SYNC_DEBUG=' + debug + ' ' if debug else ''}python {sys.argv[2]}`\n",
         "| step | loss | tokens/s | MFU | peak memory GiB |", "| --- | --- | --- | --- | --- |"]
lines += [f"| {r['step']} | {r['loss']:.4f} | {r['tokens_per_s']:.0f} | {r['mfu']:.1%} | "
          f"{r['memory_peak_bytes_max'] / 2**30:.1f} |" for r in records]
lines.append(f"\nSteady state (steps 2+): {statistics.median(r['tokens_per_s'] for r in steady):.0f} tokens/s, "
             f"MFU {statistics.median(r['mfu'] for r in steady):.1%} (median).\n")
with open("bench/results/gpu.md", "a") as f:
    f.write("\n".join(lines))
print("\n".join(lines))
PY
done
