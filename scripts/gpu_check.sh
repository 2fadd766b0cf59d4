#!/usr/bin/env bash
# GPU check (under 5 minutes on one GPU): calibrate this GPU with `ballonet calibrate` and
# compare the measured profile with the built-in profile of its type.
#
#   bash scripts/gpu_check.sh [OUT_DIR]      # default OUT_DIR: bench/results/gpu_check
#
# Writes OUT_DIR/profile.json (the measured profile), OUT_DIR/calibrate.json (profile and
# raw timings) and OUT_DIR/compare.md (measured / built-in efficiency per length and part).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-bench/results/gpu_check}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "gpu_check: no CUDA device")'
"$PY" -m ballonet calibrate --out "$OUT/profile.json" --json > "$OUT/calibrate.json"
"$PY" -m ballonet.calibration_check "$OUT/profile.json" | tee "$OUT/compare.md"
