#!/usr/bin/env bash
# Everything that needs a GPU, in one run (under 5 minutes on one H200). Run it whenever a
# GPU is lent; each part records its figures in bench/results/ (gpu.md: date and numbers).
#
#   bash scripts/gpu_check.sh [OUT_DIR]      # default OUT_DIR: bench/results/gpu_check
#
#   1. kernels: the CUDA kernel seam against the fp32 reference, attention forward and
#      backward timed separately, GEMMs (bench/gpu_kernels.py -> OUT_DIR/gpu_kernels.json);
#   3. calibration: `ballonet calibrate` on this GPU, compared with the built-in profile
#      of its type (OUT_DIR/profile.json, OUT_DIR/compare.md);
#   2. training: one-rank bf16 training of a ~1B model with FSDP2 and recomputation,
#      tokens/s and MFU per step (scripts/gpu_train_check.sh, appended to gpu.md).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-bench/results/gpu_check}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
"$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "gpu_check: no CUDA device")'
echo "== 1/3 kernels"
"$PY" bench/gpu_kernels.py --max-length 65536 --out "$OUT/gpu_kernels.json"
echo "== 2/3 training"
bash scripts/gpu_train_check.sh
echo "== 3/3 calibrate and compare with the built-in profile"
"$PY" -m ballonet calibrate --out "$OUT/profile.json" --json > "$OUT/calibrate.json"
"$PY" -m ballonet calibrate --compare "$OUT/profile.json" | tee "$OUT/compare.md"
