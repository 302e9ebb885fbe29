#!/usr/bin/env bash
# GPU health watch against the real driver: the NVML source read once and for 5 s (XID event wait), the values
# checked for sanity, then the same GPUs read through a real clockworkd and `clockwork node gpus --json`.
# Called by bench/gpu_checks.sh with OUT_DIR; alone: bash bench/gpu_checks.d/gpu_health.sh [OUT_DIR].
set -uo pipefail
out=${1:-/tmp/gpu-checks}
mkdir -p "$out"
export PYTHONPATH="$PWD:$PWD/daemon" PYTHONUNBUFFERED=1
python3 tests/device/nvml_check.py --seconds 5 --daemon 2>&1 | tee "$out/gpu_health.log"
