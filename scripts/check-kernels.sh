#!/usr/bin/env bash
# Compiles every CUDA kernel family for every architecture memra supports (compile only:
# no GPU needed), so a kernel that breaks on one arch fails CI. Uses $MEMRA_NVCC, or the
# pinned nvcc of scripts/setup-cuda.sh.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
nvcc=${MEMRA_NVCC:-$("$root/scripts/setup-cuda.sh")}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for arch in 90a 80 89 100a 120a; do
  for src in "$root"/crates/memra-engine/cu/*.cu; do
    "$nvcc" -gencode "arch=compute_$arch,code=sm_$arch" -O3 -std=c++17 --fatbin \
      -I"$root/crates/memra-engine/cu" -o "$out/$(basename "$src" .cu).$arch.fatbin" "$src" \
      || { echo "check-kernels: $src fails for sm_$arch" >&2; exit 1; }
  done
  echo "check-kernels: all kernels compile for sm_$arch"
done
