#!/usr/bin/env bash
# Create .venv and install Ballonet with its test extras, never pulling a CUDA torch on CPU.
# BALLONET_EXTRAS picks the extras (default "dev": everything the test suite needs, `hf` included,
# so the README's test command and CI run the same tests).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -m pip install -q -c constraints-cpu.txt -e ".[${BALLONET_EXTRAS:-dev}]"
