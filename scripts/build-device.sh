#!/usr/bin/env bash
# Builds memra and the engine's test binary with CUDA kernels embedded, and puts them,
# stripped, in .device/ for the GPU machine (which has no Rust toolchain):
#   scripts/build-device.sh
#   then on the GPU machine (carry .device):
#   .device/memra probe && .device/engine-tests --ignored gpu_
set -euo pipefail
cd "$(dirname "$0")/.."
MEMRA_NVCC=${MEMRA_NVCC:-$(scripts/setup-cuda.sh)}
export MEMRA_NVCC
cargo build --release -p memra
tests=$(cargo test --release -p memra-engine --lib --no-run --message-format=json 2>/dev/null \
  | grep -o '"executable":"[^"]*memra_engine-[^"]*"' | head -n 1 | cut -d'"' -f4)
[ -n "$tests" ] || { echo "build-device: engine test binary not found" >&2; exit 1; }
rm -rf .device && mkdir -p .device
cp target/release/memra .device/memra
cp "$tests" .device/engine-tests
strip .device/memra .device/engine-tests
# The tiny models and the perplexity text, for the GPU-vs-CPU model tests.
mkdir -p .device/tiny
cp ../shared/golden/tiny/tiny-{llama,qwen2,qwen3,qwen3moe,gemma3}.gguf .device/tiny/
cp ../shared/golden/texts/GPL-3 .device/GPL-3
ls -la .device
