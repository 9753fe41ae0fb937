#!/usr/bin/env bash
# On the GPU machine (after scripts/build-device.sh, carrying .device): the serving engine's
# GPU checks: the paged kernels under compute-sanitizer (memcheck, racecheck), every GPU
# test on the tiny models and synthetic llama3-1b, one-sequence speed (`memra bench`) and
# batched speed (`memra bench --batched`, with and without a shared prefix) on synthetic
# llama3-8b Q4_K_M. Full logs go to $OUT (or /tmp); a short summary is printed.
set -u
out=${OUT:-/tmp}
m=${MEMRA_DEVICE_MODELS:-/tmp/memra-models}
mkdir -p "$m"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export PATH=/usr/local/cuda/bin:$PATH
status=0
synth() { # shape quant
  local f="$m/$1-$2.gguf"
  [ -f "$f" ] || .device/memra synth --shape "$1" --quant "$2" -o "$f" >/dev/null 2>&1
  echo "$f"
}
for tool in memcheck racecheck; do
  compute-sanitizer --tool $tool --error-exitcode 9 .device/engine-tests --ignored gpu_attention \
    >"$out/sanitizer-$tool.log" 2>&1 && echo "compute-sanitizer $tool: attention kernels clean" \
    || { echo "compute-sanitizer $tool: FAILED (see sanitizer-$tool.log)"; status=1; }
done
q4km=$(synth llama3-1b q4_k_m)
q40=$(synth llama3-1b q4_0)
tiny=$(ls .device/tiny/*.gguf | paste -sd,)
export MEMRA_GPU_TEST_TEXT=.device/GPL-3
MEMRA_GPU_TEST_MODELS="$tiny,$q40,$q4km" timeout 300 .device/engine-tests --ignored gpu_ --test-threads 1 --nocapture \
  >"$out/tests.log" 2>&1 || status=1
grep -E "^test |test result|panicked|preemptions" "$out/tests.log"
f8=$(synth llama3-8b q4_k_m)
.device/memra bench -m "$f8" -p 512 -n 128 -d 0,4096 -r 3 --device cuda 2>"$out/bench.log" | tee "$out/bench.md"
.device/memra bench --batched -m "$f8" -npp 128 -ntg 128 -npl 1,16,64 --device cuda 2>"$out/batched.log" \
  | tee "$out/batched.md"
for sp in 0 1024; do
  .device/memra bench --batched -m "$f8" -npp 1152 -ntg 16 -npl 16 --shared-prefix $sp --device cuda \
    2>>"$out/batched.log" | tail -n 1
done
grep "KV pool" "$out/batched.log" | head -n 1
exit $status
