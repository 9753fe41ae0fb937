#!/usr/bin/env bash
# On the GPU machine (carrying .device): where a decode step's time goes, kernel by kernel.
# Runs a few eager decode steps (no CUDA graph, so each launch is its own record) under
# Nsight Compute and prints its per-kernel summary: count, and average duration.
#   bash scripts/profile-decode.sh [model.gguf]
set -u
m=${MEMRA_DEVICE_MODELS:-/tmp/memra-models}
f=${1:-$m/llama3-8b-q4_k_m.gguf}
[ -f "$f" ] || .device/memra synth --shape llama3-8b --quant q4_k_m -o "$f" >/dev/null 2>&1
ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
MEMRA_CUDA_GRAPH=0 "$ncu" --metrics gpu__time_duration.sum --print-summary per-kernel \
  .device/memra bench -m "$f" -p 0 -n 4 -r 1 --device cuda 2>/dev/null \
  | awk '/^  [a-z_0-9]+ \(/ {name=$1} /gpu__time_duration.sum/ {print name, $0}' \
  | awk '{printf "%-28s %s %s %s %s\n", $1, $3, $4, $5, $6}'
