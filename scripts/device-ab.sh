#!/usr/bin/env bash
# On the GPU machine (after scripts/build-device.sh, carrying .device): the A/B runs that
# docs/cuda.md plans ("Planned for the next lease"), in one call, on synthetic llama3-8b
# Q4_K_M. `memra bench --batched -npp 128 -ntg 32` S_TG at the default choices and with
# each alternative forced by its variable; then the server (`device-serve.sh`'s load) at
# `--prompt-chunk` 512 (the default) and 256. One table row per run goes to stdout; the
# logs to $OUT (or /tmp). About 5 minutes.
set -u
out=${OUT:-/tmp}
m=${MEMRA_DEVICE_MODELS:-/tmp/memra-models}
mkdir -p "$m"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
f8="$m/llama3-8b-q4_k_m.gguf"
[ -f "$f8" ] || .device/memra synth --shape llama3-8b --quant q4_k_m -o "$f8" >/dev/null 2>&1
ab() { # label, sequence counts, then VAR=value settings
  local label=$1 npl=$2
  shift 2
  echo "## $label ${*:-(defaults)}"
  env "$@" .device/memra bench --batched -m "$f8" -npp 128 -ntg 32 -npl "$npl" --device cuda \
    2>>"$out/ab.log" | grep -E '^\|'
}
ab "choices as they are" 1,9,12,16,32,64,256
ab "without the dense tile copies" 9,12,16,32,64 MEMRA_DENSE_TILES=0
ab "the dense tile copies up to 16 rows only" 24,32,64 MEMRA_DENSE_TILE_ROWS=16
ab "decodes through the decode attention at every size" 128,256 MEMRA_PROMPT_ATTENTION_FROM=100000
ab "decodes through the tensor-core prompt attention from 64 rows" 64,96 MEMRA_PROMPT_ATTENTION_FROM=64
ab "the group attention kernel at every size" 1,9,16 MEMRA_DECODE_ONE_HEAD_BELOW=0
serve() { # label, then memra serve's extra flags
  local label=$1
  shift
  .device/memra serve -m "$f8" --device cuda -np 64 --port 8080 "$@" >>"$out/serve.log" 2>&1 &
  local pid=$!
  for _ in $(seq 600); do
    python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8080/health')" \
      2>/dev/null && break
    sleep 0.5
  done
  .device/memra bench serve -n 64 -c 64 --input-len 128 --output-len 16 >/dev/null # warm-up
  echo "## server, $label"
  .device/memra bench serve -n 320 -c 64 --input-len 128 --output-len 128 \
    | grep -E "Output token throughput|Median TTFT|P99 TTFT|Failed"
  kill -TERM $pid
  wait $pid
}
serve "--prompt-chunk 512 (default)"
serve "--prompt-chunk 256" --prompt-chunk 256
