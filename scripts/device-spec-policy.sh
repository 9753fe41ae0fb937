#!/usr/bin/env bash
# On the GPU machine (after scripts/build-device.sh, carrying .device): the draft length's
# two rules (`--draft-policy length` and `cost`, docs/engine.md) on synthetic Q4_K_M files,
# runs alternating, about 4 minutes. llama3-8b with llama3-1b drafting (random weights:
# almost no draft passes, so the cost rule should stop drafting and keep plain decoding's
# rate) on issue 15's ten code prompts, and prompt lookup on the editing prompt (the
# random model repeats itself: most drafts pass, so the cost rule should draft as long as
# the length rule or longer). MEMRA_SPEC_RULES picks the rules run, in order (default
# "length cost length cost"). One table line a run to stdout; logs to $OUT (or /tmp).
set -u
out=${OUT:-/tmp}
m=${MEMRA_DEVICE_MODELS:-/tmp/memra-models}
mkdir -p "$m" "$out"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
M=.device/memra
t0=$(date +%s)
el() { echo "[t+$(($(date +%s) - t0))s] $*"; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for s in llama3-8b llama3-1b; do
  [ -f "$m/$s-q4_k_m.gguf" ] || $M synth --shape "$s" --quant q4_k_m -o "$m/$s-q4_k_m.gguf" >/dev/null 2>&1
done
el "models"
spec() { # policy, label, bench arguments
  $M bench -m "$m/llama3-8b-q4_k_m.gguf" --device cuda --draft-policy "$1" "${@:3}" \
    2>>"$out/spec.log" | tee -a "$out/spec-tables.md" | grep '^| all' | sed "s/^/$2 $1 /"
}
for pol in ${MEMRA_SPEC_RULES:-length cost length cost}; do
  spec "$pol" draft --model-draft "$m/llama3-1b-q4_k_m.gguf" \
    --spec-prompts scripts/data/spec-code-prompts.jsonl -n 64
  spec "$pol" lookup --spec-ngram 3 --spec-prompts scripts/data/spec-edit-prompts.jsonl -n 256
done
el "done"
