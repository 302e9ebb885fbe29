#!/usr/bin/env bash
# Sharded training (FSDP2) over NCCL: a planned migration of the rank holding the only shard, bitwise exact
# against the same job without one (bench/gpu_torchpass_nccl.py --fsdp). The mesh's subgroups are NCCL
# communicators TorchPass creates non-blocking and aborts with the generation's default group.
# Called by bench/gpu_checks.sh with OUT_DIR; alone: bash bench/gpu_checks.d/fsdp.sh [OUT_DIR].
set -uo pipefail
out=${1:-/tmp/gpu-checks}
mkdir -p "$out"
export PYTHONPATH="$PWD:$PWD/daemon" PYTHONUNBUFFERED=1
python3 bench/gpu_torchpass_nccl.py --backend nccl --fsdp --quick 2>&1 | tee "$out/fsdp_nccl.log"
