#!/usr/bin/env bash
# Installs the CUDA compiler memra's kernels are built with (nvcc 13.0.88, the GPU
# machine's release) from the Python package index into a cache folder, and prints the
# nvcc path. No GPU and no system CUDA needed; about 270 MB, downloaded once.
#
#   export MEMRA_NVCC=$(scripts/setup-cuda.sh)
#
# Folder: $MEMRA_CUDA_DIR, default ~/.cache/memra/cuda.
set -euo pipefail
dir=${MEMRA_CUDA_DIR:-$HOME/.cache/memra/cuda}
py=${PYTHON:-python3}
find_nvcc() { ls "$dir"/lib/python3*/site-packages/nvidia/cu13/bin/nvcc 2>/dev/null | head -n 1; }
nvcc=$(find_nvcc || true)
if [ -z "$nvcc" ] || ! "$nvcc" --version >/dev/null 2>&1; then
  echo "setup-cuda: installing nvcc 13.0.88 into $dir" >&2
  "$py" -m venv "$dir" >&2
  "$dir/bin/pip" install -q nvidia-cuda-nvcc==13.0.88 nvidia-cuda-runtime==13.0.96 \
    nvidia-cuda-crt==13.0.88 nvidia-cuda-cccl==13.0.85 nvidia-nvvm==13.0.88 >&2 \
    || { echo "setup-cuda: pip install failed" >&2; exit 1; }
  nvcc=$(find_nvcc || true)
  [ -n "$nvcc" ] || { echo "setup-cuda: nvcc not found after install" >&2; exit 1; }
fi
"$nvcc" --version >/dev/null || { echo "setup-cuda: $nvcc does not run" >&2; exit 1; }
echo "$nvcc"
