#!/usr/bin/env bash
# Snapshots from GPU memory: pinned staging, side-stream copies, the writer process, restore onto the GPU,
# against torch.save and DCP's async_save, about 1 GiB of parameters + Adam state (bench/snapshot.py).
# Called by bench/gpu_checks.sh with OUT_DIR; alone: bash bench/gpu_checks.d/snapshot.sh [OUT_DIR].
set -uo pipefail
out=${1:-/tmp/gpu-checks}
mkdir -p "$out"
export PYTHONPATH="$PWD:$PWD/daemon" PYTHONUNBUFFERED=1
python3 bench/snapshot.py --device cuda 2>&1 | tee "$out/snapshot.log"
