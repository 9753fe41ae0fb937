#!/usr/bin/env bash
# memra-a: main (7f6b223) + prompt-attention steps graphed, from 96 decodes.
set -u
out=${OUT:-/tmp}; m=/tmp/memra-models; b=/tmp/b; mkdir -p "$m" $b
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
echo "start $(date +%T)"; nvidia-smi --query-gpu=name --format=csv,noheader
for f in .device/*.xz; do n=$(basename $f .xz); [ -x $b/$n ] || { xz -dc $f > $b/$n; chmod +x $b/$n; }; done
f8=$m/llama3-8b-q4_k_m.gguf
[ -f "$f8" ] || (taskset -c 0-11 $b/memra-a synth --shape llama3-8b --quant q4_k_m -o "$f8" >/dev/null 2>&1) &
spid=$!
export MEMRA_GPU_TEST_TEXT=.device/GPL-3
export MEMRA_GPU_TEST_MODELS=$(ls .device/tiny/*.gguf | paste -sd,)
T=$b/engine-tests-a
timeout 100 taskset -c 12-15 $T --ignored gpu_ --skip gpu_qgemm_speed --test-threads 1 >"$out/tests.log" 2>&1
echo "tests rc=$? $(date +%T)"
grep -E "^test .*(FAILED|ignored)|test result|panicked" "$out/tests.log" | head -20
wait $spid; echo "synth $(date +%T)"
run() { echo "## $* $(date +%T)"; timeout 60 env "$@" 2>>"$out/bench.log" | grep -E '^\|' | awk -F'|' 'NR>2{printf "%s:%s ", $4, $9} END{print ""}'; }
B="bench --batched -m $f8 -npp 128 -ntg 32 --device cuda -npl"
run $b/memra-a $B 64,96,128,256
run MEMRA_PROMPT_ATTENTION_FROM=100000 $b/memra-a $B 64,96,128,256
run MEMRA_PROMPT_ATTENTION_FROM=48 $b/memra-a $B 48,64
run $b/memra-a $B 48,64,96,128,256
run MEMRA_PROMPT_ATTENTION_FROM=100000 $b/memra-a $B 48,96,128,256
run $b/memra-a bench --batched -m $f8 -npp 128 -ntg 128 --device cuda -npl 1,16,64,256
$b/memra-a serve -m "$f8" --device cuda -np 64 --port 8080 >"$out/serve.log" 2>&1 &
pid=$!
for _ in $(seq 240); do curl -sf http://127.0.0.1:8080/health >/dev/null 2>&1 && break; sleep 0.5; done
echo "serve up $(date +%T)"
timeout 60 $b/memra-a bench serve -n 64 -c 64 --input-len 128 --output-len 16 >/dev/null
timeout 120 $b/memra-a bench serve -n 320 -c 64 --input-len 128 --output-len 128 | tee "$out/serve-bench.txt"
kill -TERM $pid; wait $pid; echo "serve exit $?"
echo "end $(date +%T)"
