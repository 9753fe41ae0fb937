#!/usr/bin/env bash
# One lease for docs/pending/norm-rowtiles.patch: gpu_ tests, bench A/B against main,
# sanitizers on the changed kernels' tests, the tests at both row-tile settings, kernel
# speeds and a 16-row step's ncu breakdown where time is left.
# Before: `scripts/build-device.sh` on main, then `xz -k`: .device/memra -> memra-r.xz;
# `git apply docs/pending/norm-rowtiles.patch`, build again, and put its memra and
# engine-tests in .device as memra-q.xz and engine-tests-q.xz (build-device.sh removes
# .device: copy the first build out before the second). Keep .device/tiny and GPL-3.
# Run from the repository root with .device carried: bash docs/pending/norm-rowtiles-lease.sh
# Also: the decode attention's head shares at every row count (MEMRA_DECODE_SHARED_BELOW,
# added to the patch 2026-12-07, second session) against the 128-block rule.
set -u
out=${OUT:-/tmp}; m=/tmp/memra-models; b=/tmp/b; mkdir -p "$m" $b
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
echo "start $(date +%T)"; nvidia-smi --query-gpu=name --format=csv,noheader
for f in .device/*.xz; do n=$(basename $f .xz); [ -x $b/$n ] || { xz -dc $f > $b/$n; chmod +x $b/$n; }; done
f8=$m/llama3-8b-q4_k_m.gguf
[ -f "$f8" ] || (taskset -c 0-7 $b/memra-q synth --shape llama3-8b --quant q4_k_m -o "$f8" >/dev/null 2>&1) &
spid=$!
export MEMRA_GPU_TEST_TEXT=.device/GPL-3
export MEMRA_GPU_TEST_MODELS=$(ls .device/tiny/*.gguf | paste -sd,)
T=$b/engine-tests-q
timeout 100 taskset -c 8-15 $T --ignored gpu_ --skip gpu_qgemm_speed --test-threads 1 >"$out/tests.log" 2>&1
echo "tests rc=$? $(date +%T)"
grep -E "^test .*(FAILED|ignored)|test result|panicked" "$out/tests.log" | head -20
wait $spid
run() { echo "## $* $(date +%T)"; timeout 30 env "$@" bench --batched -m "$f8" -npp 128 -ntg 32 -npl 1,9,16,32,64 --device cuda 2>>"$out/bench.log" | grep -E '^\|' | awk -F'|' 'NR>2{printf "%s:%s ", $4, $9} END{print ""}'; }
run $b/memra-r; run $b/memra-q; run MEMRA_QG_ROW_TILES=1,1,1 $b/memra-q; run MEMRA_QG_ROW_TILES=2,2,2 $b/memra-q
run MEMRA_DECODE_SHARED_BELOW=100000000 $b/memra-q; run $b/memra-r; run $b/memra-q
cs=/usr/local/cuda/bin/compute-sanitizer
for tool in memcheck racecheck; do
  timeout 60 taskset -c 8-15 $cs --tool $tool $T --ignored gpu_gated_and_add_norm gpu_qgemm_matches --test-threads 1 >"$out/$tool.log" 2>&1
  echo "$tool rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|test result' "$out/$tool.log" | tr '\n' ' ') $(date +%T)"
done
for rt in 1,1,1 2,2,2; do MEMRA_QG_ROW_TILES=$rt timeout 40 taskset -c 8-15 $T --ignored gpu_qgemm_matches gpu_decode_graphs_equal --test-threads 1 2>&1 | grep -E "test result|panicked" | tr "\n" " "; echo "(rt $rt)"; done
MEMRA_DECODE_SHARED_BELOW=100000000 timeout 60 taskset -c 8-15 $T --ignored gpu_decode_graphs_equal gpu_decode_rows_sum gpu_engine_batches --test-threads 1 2>&1 | grep -E "test result|panicked" | tr "\n" " "; echo "(shared heads always)"
[ $SECONDS -lt 330 ] && for rt in 1,1,1 2,2,2; do MEMRA_QG_ROW_TILES=$rt timeout 45 $T --ignored gpu_qgemm_speed --nocapture --test-threads 1 > "$out/speed-rt$rt.log" 2>&1; echo "speed rt$rt rc=$?"; done
ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
[ $SECONDS -lt 420 ] && timeout 60 $ncu --csv --clock-control none --cache-control none --metrics gpu__time_duration.sum --print-summary per-kernel $b/memra-q bench --batched -m "$f8" -npp 128 -ntg 4 -npl 16 --device cuda > "$out/ncu16.csv" 2>"$out/ncu16.err"
echo "ncu rc=$? $(date +%T) $(wc -l < $out/ncu16.csv)"
echo "end $(date +%T)"
