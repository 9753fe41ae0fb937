#!/usr/bin/env bash
# On the GPU machine (after scripts/build-device.sh, carrying .device): the one-token decode
# runs docs/cuda.md plans for the next lease, in one call of about 6 minutes. The `gpu_`
# tests; `memra bench -p 0 -n 128 -r 3` (tg128) on synthetic qwen2.5-0.5b, qwen3-30b-a3b
# and llama3-8b Q4_K_M at the L2 prefetch's bound (MEMRA_PREFETCH_MAX_BYTES: 0, the default
# 8 MiB, 16 MiB, unbounded) and the staged Q8_0/Q5_0 kernels' (MEMRA_STAGED_MIN_BYTES: off,
# the heads only, every launch), runs alternating; the tiny models' decoder tests with the
# staged kernels everywhere; memcheck and racecheck on the new kernels; and the 0.5B's
# per-kernel times (profile-decode.sh). One line per run to stdout, logs to $OUT (or /tmp).
set -u
out=${OUT:-/tmp}
m=${MEMRA_DEVICE_MODELS:-/tmp/memra-models}
mkdir -p "$m" "$out"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
M=.device/memra
t0=$(date +%s)
el() { echo "[t+$(($(date +%s) - t0))s] $*"; }
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
synth() { [ -f "$m/$1-q4_k_m.gguf" ] || $M synth --shape "$1" --quant q4_k_m -o "$m/$1-q4_k_m.gguf" >/dev/null 2>&1; }
synth qwen2.5-0.5b
(synth qwen3-30b-a3b; touch "$m/30b.ok") &
(synth llama3-8b; touch "$m/8b.ok") &
tiny=$(ls "$PWD"/.device/tiny/*.gguf | paste -sd,)
export MEMRA_GPU_TEST_TEXT="$PWD/.device/GPL-3" MEMRA_GPU_TEST_MODELS="$tiny"
tests() { # test filters
  .device/engine-tests --ignored "$@" --skip gpu_qgemm_speed --test-threads 1 2>&1 \
    | grep -E "^test .*FAILED|panicked|test result"
}
tests gpu_
el "gpu_ tests"
OFF=1000000000000
tg() { # model, prefetch bound, staged bound
  MEMRA_PREFETCH_MAX_BYTES=$2 MEMRA_STAGED_MIN_BYTES=$3 $M bench -m "$m/$1-q4_k_m.gguf" -p 0 -n 128 \
    -r 3 --device cuda 2>>"$out/bench.log" | grep tg128 | sed "s/^/$1 P=$2 S=$3 /"
}
for _ in 1 2; do
  for cfg in "0 $OFF" "8388608 $OFF" "16777216 $OFF" "$OFF $OFF" "8388608 33554432" "8388608 0"; do
    tg qwen2.5-0.5b $cfg
  done
done
el "0.5b"
while [ ! -f "$m/30b.ok" ]; do sleep 2; done
for cfg in "0 $OFF" "8388608 $OFF" "$OFF $OFF" "0 $OFF" "8388608 $OFF"; do tg qwen3-30b-a3b $cfg; done
el "30b"
while [ ! -f "$m/8b.ok" ]; do sleep 2; done
for cfg in "0 $OFF" "8388608 $OFF" "$OFF $OFF" "0 $OFF"; do tg llama3-8b $cfg; done
el "8b"
MEMRA_STAGED_MIN_BYTES=0 tests gpu_decoder gpu_staged gpu_qkv_pair gpu_matvec_matches
el "decoder tests, staged kernels everywhere"
cs=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
san() { # tool, test filters
  MEMRA_PREFETCH_MAX_BYTES=$OFF "$cs" --tool "$1" --error-exitcode 9 .device/engine-tests --ignored \
    "${@:2}" --test-threads 1 >"$out/$1.log" 2>&1
  echo "$1 rc=$? on ${*:2}: $(grep 'ERROR SUMMARY' "$out/$1.log" | tail -1)"
}
san memcheck gpu_staged gpu_matvec_matches_the_cpu_reference gpu_qkv_pair
san racecheck gpu_staged
el "sanitizers"
MEMRA_DEVICE_MODELS=$m bash scripts/profile-decode.sh "$m/qwen2.5-0.5b-q4_k_m.gguf" | tee "$out/profile-0.5b.txt"
el "profile"
