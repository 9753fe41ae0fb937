#!/usr/bin/env bash
# On the GPU machine (after scripts/build-device.sh, carrying .device): the serving engine's
# GPU checks: the attention and sampling kernels under compute-sanitizer (memcheck,
# racecheck) and the decoder's paths under memcheck, every GPU test on the tiny models and
# synthetic llama3-1b, perplexity and chat through the engine, one-sequence speed (`memra
# bench`), batched speed (`memra bench --batched`, with and without a shared prefix, and
# with half the sequences held to a JSON schema) and speculative decoding (prompt lookup
# and a draft model: the same text, and the rates) on synthetic llama3-8b Q4_K_M. Logs go
# to $OUT (or /tmp, at most 8 files: what the device tool brings back); a short summary
# is printed.
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
  for t in gpu_attention gpu_decode_rows_sum gpu_sampling gpu_token_mask gpu_mmq_matches gpu_fused_experts gpu_moe_route gpu_qkv_pair gpu_router_routes; do
    compute-sanitizer --tool $tool --error-exitcode 9 .device/engine-tests --ignored $t \
      >>"$out/sanitizer.log" 2>&1 && echo "compute-sanitizer $tool: $t clean" \
      || { echo "compute-sanitizer $tool: $t FAILED (see sanitizer.log)"; status=1; }
  done
done
# The whole decoder (prompt, decode and many-decode paths, device argmax) under memcheck,
# on one tiny model.
MEMRA_GPU_TEST_MODELS=.device/tiny/tiny-llama.gguf compute-sanitizer --tool memcheck --error-exitcode 9 \
  .device/engine-tests --ignored gpu_decoder_matches >>"$out/sanitizer.log" 2>&1 \
  && echo "compute-sanitizer memcheck: decoder paths clean" \
  || { echo "compute-sanitizer memcheck: decoder FAILED (see sanitizer.log)"; status=1; }
q4km=$(synth llama3-1b q4_k_m)
q40=$(synth llama3-1b q4_0)
tiny=$(ls .device/tiny/*.gguf | paste -sd,)
export MEMRA_GPU_TEST_TEXT=.device/GPL-3
MEMRA_GPU_TEST_MODELS="$tiny,$q40,$q4km" timeout 300 .device/engine-tests --ignored gpu_ --test-threads 1 --nocapture \
  >"$out/tests.log" 2>&1 || status=1
grep -E "^test |test result|panicked|preemptions|sequences' decode| us\)" "$out/tests.log"
# The engine's command-line clients on the GPU (tiny model).
.device/memra perplexity -m .device/tiny/tiny-llama.gguf -f .device/GPL-3 -c 128 --chunks 4 --device cuda \
  2>"$out/clients.log" | tail -n 2
printf 'Hello there\nAnd again\n' | .device/memra chat -m .device/tiny/tiny-llama.gguf -n 8 --temp 0 --template chatml \
  --device cuda >>"$out/clients.log" 2>&1 && echo "chat --device cuda: ok" \
  || { echo "chat --device cuda: FAILED"; status=1; }
# The replayed decode graph against eager steps over 1,200 greedy tokens: the decode
# attention's grid changes with the split count (heads dealt into shares below 128 blocks;
# llama3-1b's 8 KV heads cross that at 16 splits, 1,024 positions).
.device/memra run -m "$q4km" --device cuda --temp 0 -n 1200 -p "Once upon a time" >/tmp/graph1.txt 2>/dev/null
MEMRA_CUDA_GRAPH=0 .device/memra run -m "$q4km" --device cuda --temp 0 -n 1200 -p "Once upon a time" \
  >/tmp/graph0.txt 2>/dev/null
cmp -s /tmp/graph1.txt /tmp/graph0.txt && echo "decode graph = eager steps over 1,200 tokens" \
  || { echo "decode graph and eager steps DIFFER over 1,200 tokens"; status=1; }
f8=$(synth llama3-8b q4_k_m)
.device/memra bench -m "$f8" -p 512 -n 128 -d 0,4096 -r 3 --device cuda 2>"$out/bench.log" | tee "$out/bench.md"
.device/memra bench --batched -m "$f8" -npp 128 -ntg 128 -npl 1,12,16,32,64,256 --device cuda 2>"$out/batched.log" \
  | tee "$out/batched.md"
# The other side of the choice: the dp4a kernels in groups of 8 with the GEMM path from 9
# (MEMRA_DECODE_MMQ=0), against the tensor-core kernels up to 16.
echo "MEMRA_DECODE_MMQ=0:"
MEMRA_DECODE_MMQ=0 .device/memra bench --batched -m "$f8" -npp 128 -ntg 128 -npl 12,16 --device cuda \
  2>>"$out/batched.log" | tail -n 2
# The products alone (the tensor-core kernels' 16 tokens against the dp4a kernels' 8).
.device/engine-tests --ignored gpu_mmq_bandwidth --nocapture 2>&1 | grep -E "tokens:" | tee "$out/mmq.log"
# Structured output's cost (issue 13): half of 64 sequences held to a JSON schema that
# does not end early, against none.
bb() { .device/memra bench --batched -m "$f8" -npp 128 -ntg 128 --device cuda "$@" 2>>"$out/batched.log"; }
echo "constrained 0 / 0.5 of 64:"
bb -npl 64 | tail -n 1
bb -npl 64 --json-schema scripts/data/bench-schema.json --constrained-frac 0.5 | tail -n 1
# Speculative decoding (issue 15) on the GPU: greedy output equal with and without, the
# rate of each (a synthetic model's text loops, so prompt lookup finds drafts).
q1=$(synth llama3-1b q4_k_m)
gen() { .device/memra run -m "$f8" --device cuda --temp 0 -n 256 -p "Once upon a time" "$@"; }
plain=$(gen 2>"$out/spec.log")
for s in "--spec-ngram 3" "--model-draft $q1"; do
  got=$(gen $s 2>>"$out/spec.log")
  [ "$got" == "$plain" ] && echo "speculative ($s): same text" || { echo "speculative ($s): DIFFERENT"; status=1; }
done
grep "^prompt:" "$out/spec.log"
for sp in 0 1024; do
  .device/memra bench --batched -m "$f8" -npp 1152 -ntg 16 -npl 64 --shared-prefix $sp --device cuda \
    2>>"$out/batched.log" | tail -n 1
done
grep "KV pool" "$out/batched.log" | head -n 1
exit $status
