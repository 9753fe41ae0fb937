#!/usr/bin/env bash
# On the GPU machine (carrying .device with a CUDA build of memra, see build-device.sh):
# the server's cost. `memra bench --batched` at 64 sequences of 128 + 128 tokens, then
# `memra serve -np 64` under `memra bench serve` at concurrency 64 with the same
# lengths, on synthetic llama3-8b Q4_K_M. Logs and tables go to $OUT (or /tmp).
set -u
out=${OUT:-/tmp}
m=${MEMRA_DEVICE_MODELS:-/tmp/memra-models}
n=${REQUESTS:-320}
mkdir -p "$m"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
f8="$m/llama3-8b-q4_k_m.gguf"
[ -f "$f8" ] || .device/memra synth --shape llama3-8b --quant q4_k_m -o "$f8" >/dev/null 2>&1
.device/memra bench --batched -m "$f8" -npp 128 -ntg 128 -npl 64 --device cuda \
  2>"$out/batched.log" | tee "$out/batched.md"
.device/memra serve -m "$f8" --device cuda -np 64 --port 8080 >"$out/serve.log" 2>&1 &
pid=$!
for _ in $(seq 600); do
  curl -sf http://127.0.0.1:8080/health >/dev/null 2>&1 && break
  python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8080/health')" 2>/dev/null && break
  sleep 0.5
done
.device/memra bench serve -n 64 -c 64 --input-len 128 --output-len 16 >/dev/null  # warm-up
.device/memra bench serve -n "$n" -c 64 --input-len 128 --output-len 128 | tee "$out/serve-bench.txt"
kill -TERM $pid
wait $pid
echo "serve exit: $?"
grep -E "KV pool|ready" "$out/serve.log"
