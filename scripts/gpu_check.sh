#!/usr/bin/env bash
# Everything that needs a GPU, in one run: about 3 minutes on one H200 (issue 34). Run it
# whenever a GPU is lent; each part records its figures (gpu.md: the date and numbers).
#
#   bash scripts/gpu_check.sh [OUT_DIR]      # default OUT_DIR: bench/results/gpu_check
#
#   0. the kernel seam's tests on CUDA (tests/test_kernels.py: every installed GPU
#      backend, "cuda" and with the `gpu` extra "flash_attn" and "fa4", against dense
#      float64 attention and held to runtime/kernel_contract.py; `select`'s pick);
#   1. kernels: bench/gpu_kernels.py with every installed GPU backend: the contract,
#      exactness against the fp32 reference, forward and backward timed, GEMMs ->
#      OUT_DIR/gpu_kernels.json (and which backend `kernels.select` picks here);
#   2. training: one-rank bf16 FSDP2 training of llama3-1b (full and linear
#      recomputation) with every step after the first under
#      torch.cuda.set_sync_debug_mode("error") (BALLONET_SYNC_DEBUG): a host-device
#      synchronisation in a step's forward, backward or optimizer step fails the run
#      (scripts/gpu_train_check.sh, figures appended to bench/results/gpu.md);
#   3. each rank's compute of a 32-GPU zeppelin plan (llama-7b layer shapes, bf16),
#      replayed rank by rank on this GPU against the simulator's per-rank compute, each
#      rank's engine passes once under the sync debug mode "error"
#      (bench/rank_replay.py -> OUT_DIR/rank_replay.json and .md, appended to gpu.md).
#   GPU_CHECK_CALIBRATE=1 adds `ballonet calibrate` and its comparison with the built-in
#   profile (OUT_DIR/profile.json, OUT_DIR/compare.md; about a minute more).
#
# Every part runs even if one before failed; the exit code is non-zero if any failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-bench/results/gpu_check}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
"$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "gpu_check: no CUDA device")' || exit 1
failed=()
part() {  # part NAME COMMAND...: run it, note a failure, go on
    local name=$1; shift
    echo "== $name"
    local start=$SECONDS
    "$@" || failed+=("$name")
    echo "== $name: $((SECONDS - start)) s"
}
"$PY" -c 'from ballonet.runtime import kernels; print("kernels installed:", [n for n in kernels.KERNELS if kernels.installed(n)])'
part "0/3 kernel seam tests" "$PY" -m pytest -q -n 0 -p no:cacheprovider tests/test_kernels.py
part "1/3 kernels" "$PY" bench/gpu_kernels.py --max-length 32768 --out "$OUT/gpu_kernels.json"
part "2/3 training under the sync debug mode" env BALLONET_SYNC_DEBUG=error bash scripts/gpu_train_check.sh
part "3/3 each rank of a 32-GPU plan against the simulator" "$PY" bench/rank_replay.py --cluster h200-8nic \
    --nodes 4 --model llama-7b --workload wlbllm --tokens-per-gpu 16384 --out "$OUT/rank_replay"
[ -f "$OUT/rank_replay.md" ] && { echo; cat "$OUT/rank_replay.md"; } >> bench/results/gpu.md
if [ "${GPU_CHECK_CALIBRATE:-0}" = 1 ]; then
    part "calibrate" "$PY" -m ballonet calibrate --out "$OUT/profile.json" --json > "$OUT/calibrate.json"
    part "compare with the built-in profile" sh -c "'$PY' -m ballonet calibrate --compare '$OUT/profile.json' | tee '$OUT/compare.md'"
fi
if [ ${#failed[@]} -gt 0 ]; then
    echo "gpu_check: failed: ${failed[*]}"
    exit 1
fi
echo "gpu_check: all parts passed"
