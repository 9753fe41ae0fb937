#!/usr/bin/env bash
# On the GPU machine (after scripts/build-device.sh, carrying .device): kernel tests against
# the CPU reference, GPU-vs-CPU model tests (logits of prompt batches and decode steps,
# perplexity, greedy tokens) on the tiny models and synthetic llama3-1b, greedy text through
# the CLI, and `memra bench` on synthetic llama3-8b Q4_K_M and Q8_0.
# Full logs go to $OUT (or /tmp); a short summary is printed.
set -u
out=${OUT:-/tmp}
m=${MEMRA_DEVICE_MODELS:-/tmp/memra-models}
mkdir -p "$m"
# cuBLAS for the prompt GEMMs.
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
.device/memra probe 2>&1 | tee "$out/probe.log" | grep -E "gpu|copy|read"
status=0
synth() { # shape quant
  local f="$m/$1-$2.gguf"
  [ -f "$f" ] || .device/memra synth --shape "$1" --quant "$2" -o "$f" >/dev/null 2>&1
  echo "$f"
}
q40=$(synth llama3-1b q4_0)
q4km=$(synth llama3-1b q4_k_m)
q80=$(synth llama3-1b q8_0)
tiny=$(ls .device/tiny/*.gguf | paste -sd,)
export MEMRA_GPU_TEST_TEXT=.device/GPL-3
MEMRA_GPU_TEST_MODELS="$tiny,$q40,$q4km" timeout 300 .device/engine-tests --ignored gpu_ --test-threads 1 --nocapture \
  >"$out/tests.log" 2>&1 || status=1
grep -E "^test |test result|tokens;|perplexity GPU|panicked|differ|TB/s" "$out/tests.log"
# Greedy text, the CPU without activation rounding as the reference (docs/cuda.md).
for f in $q4km $q80 $q40; do
  MEMRA_CPU_F32_ACTIVATIONS=1 .device/memra run -m "$f" -p "Hello world, this is" -n 16 --temp 0 --device cpu >/tmp/cpu.txt 2>>"$out/run.log"
  .device/memra run -m "$f" -p "Hello world, this is" -n 16 --temp 0 --device cuda >/tmp/gpu.txt 2>>"$out/run.log"
  if cmp -s /tmp/cpu.txt /tmp/gpu.txt; then echo "greedy $(basename $f): CPU and GPU texts agree"; else
    echo "greedy $(basename $f): CPU and GPU texts differ at byte $(cmp /tmp/cpu.txt /tmp/gpu.txt | awk '{print $5}')"; fi
done
.device/memra perplexity -m .device/tiny/tiny-llama.gguf -f .device/GPL-3 -c 128 --chunks 4 --device cuda 2>&1 | tail -1
f8=$(synth llama3-8b q4_k_m)
.device/memra bench -m "$f8" -p 512 -n 128 -d 0,4096 -r 5 --device cuda 2>"$out/bench-q4km.log" | tee "$out/bench-q4km.md"
grep "gpu memory" "$out/bench-q4km.log" | tail -n 1
# Generation with llama.cpp's default sampling (temperature 0.8, top-k 40, top-p 0.95, min-p
# 0.05) picks on the device; top-k 0 sends the logits to the host; greedy for comparison.
for s in "--temp 0" "" "--top-k 0"; do
  echo "memra run ${s:-(default sampling)}: $(.device/memra run -m "$f8" -p "Once upon a time" -n 128 $s --device cuda 2>&1 >/dev/null | grep -o 'generated: .*t/s')"
done
f8=$(synth llama3-8b q8_0)
.device/memra bench -m "$f8" -p 512 -n 128 -r 5 --device cuda 2>"$out/bench-q80.log" | tee "$out/bench-q80.md" | tail -n 2
grep "gpu memory" "$out/bench-q80.log" | tail -n 1
exit $status
