#!/usr/bin/env bash
# On the GPU machine (carrying .device): where the steps of many decodes spend their time,
# kernel by kernel. `memra bench --batched` with 128-token prompts and a few decode steps of
# N sequences under Nsight Compute; its per-kernel summary (CSV: invocations, average
# duration) goes to $OUT/ncu-N.csv. The clocks and caches are left as they run (ncu's
# defaults lock the base clock and flush the caches, which nearly doubles the times of
# the GEMMs), so the per-kernel times add up to what a step costs on the GPU.
#   bash scripts/profile-batched.sh [sequences] [model.gguf]
set -u
n=${1:-16}
out=${OUT:-/tmp}
m=${MEMRA_DEVICE_MODELS:-/tmp/memra-models}
f=${2:-$m/llama3-8b-q4_k_m.gguf}
mkdir -p "$m"
[ -f "$f" ] || .device/memra synth --shape llama3-8b --quant q4_k_m -o "$f" >/dev/null 2>&1
ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
"$ncu" --csv --clock-control none --cache-control none --metrics gpu__time_duration.sum --print-summary per-kernel \
  .device/memra bench --batched -m "$f" -npp 128 -ntg 4 -npl "$n" --device cuda \
  >"$out/ncu-$n.csv" 2>"$out/ncu-$n.log"
echo "ncu $n sequences: $(wc -l <"$out/ncu-$n.csv") lines"
