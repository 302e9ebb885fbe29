#!/usr/bin/env bash
# The checks that need a GPU machine, in one run (what a session with a device runs; see the closing notes).
# Usage, from the repository root on a machine with an NVIDIA GPU, PyTorch with CUDA, h5py, msgpack and
# nvidia-ml-py: bash bench/gpu_checks.sh [OUT_DIR]   (wheels for pyzmq/pyroute2 in .devwheels/ are installed
# first when present, for machines that cannot reach a package registry).
set -uo pipefail
out=${1:-${OUT:-/tmp/gpu-checks}}
mkdir -p "$out"
if compgen -G ".devwheels/*.whl" >/dev/null; then python3 -m pip install -q --no-deps .devwheels/*.whl; fi
export PYTHONPATH="$PWD:$PWD/daemon" PYTHONUNBUFFERED=1
# The GPU machine's torch is whatever it came with (not the 2.13 TorchPass is tested with, torchpass.rank.torch_compat):
# these checks are there to run the GPU paths on it, so they run on it with the warning, the release printed below.
export TORCHPASS_UNTESTED_TORCH=${TORCHPASS_UNTESTED_TORCH:-1}
nvidia-smi -L
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version())'
echo "== NVML as the audit reads it"
python3 -c 'import json; from clockwork.audit.node_checks import gpu_health; print(json.dumps(gpu_health()))' \
    | tee "$out/nvml_audit.json"
for extra in bench/gpu_checks.d/*.sh; do [ -e "$extra" ] && { echo "== $extra"; bash "$extra" "$out"; }; done
echo "== TorchPass over NCCL: planned migration on the GPU"
python3 bench/gpu_torchpass_nccl.py --backend nccl 2>&1 | tee "$out/nccl.log"
if [ -z "${SKIP_OVERHEAD:-}" ]; then
    echo "== TorchPass overhead with no fault (CPU gloo, 4 ranks, quiet 16-core machine)"
    python3 bench/torchpass_overhead.py --skip-torchft --nproc 4 --rounds 5 2>&1 | tee "$out/overhead.log"
fi
