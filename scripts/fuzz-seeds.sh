#!/usr/bin/env bash
# Seed the GGUF reader's fuzz corpus: the tiny models (trimmed to their headers plus a
# little data, so mutations reach the parser instead of the tensor bytes) and the
# malformed-file corpus of the reader tests.
#   scripts/fuzz-seeds.sh [CORPUS_DIR]   (default fuzz/corpus/gguf_reader)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$root/fuzz/corpus/gguf_reader}
shared=${MEMRA_SHARED:-$root/../shared}
mkdir -p "$out"
for m in "$shared"/golden/tiny/*.gguf; do
  head -c 65536 "$m" >"$out/$(basename "$m" .gguf)-head"
done
cargo run -q --release --manifest-path "$root/Cargo.toml" -p memra-gguf --example write-malformed-corpus -- "$out"
echo "seeded $(ls "$out" | wc -l) files in $out"
