#!/usr/bin/env bash
# On the GPU machine (carrying .device): where a prompt batch spends its time, kernel by
# kernel. One `memra bench -p N -n 0` run under Nsight Compute; its per-kernel summary
# (CSV: invocations, average duration) goes to $OUT/ncu-prompt-NAME.csv.
#   bash scripts/profile-prompt.sh model.gguf [tokens]
set -u
f=$1
p=${2:-512}
out=${OUT:-/tmp}
name=$(basename "$f" .gguf)
ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
"$ncu" --csv --metrics gpu__time_duration.sum --print-summary per-kernel \
  .device/memra bench -m "$f" -p "$p" -n 0 -r 1 --device cuda \
  >"$out/ncu-prompt-$name.csv" 2>"$out/ncu-prompt-$name.log"
echo "ncu prompt $name: $(wc -l <"$out/ncu-prompt-$name.csv") lines"
