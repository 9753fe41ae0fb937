#!/usr/bin/env bash
# One lease: synth llama3-8b (cores 0-7) while the gpu_ tests run, sanitizers on the
# changed kernels, then bench --batched for the base build and the candidates.
# Before: three release builds, 2785726 (its memra as memra-base), the patch without its
# quant_gemm.cu hunk (memra), and all of it (memra-r, and its engine tests as
# engine-tests-r). Copy each binary out before the next build, and build 2785726 in its own
# CARGO_TARGET_DIR (a worktree sharing main's target dir gets main's binary back). Put them
# in .device/ as NAME.xz (xz -k), with tiny/ and GPL-3 (scripts/build-device.sh's), then run
# this script with .device carried.
set -u
out=${OUT:-/tmp}; m=/tmp/memra-models; b=/tmp/b; mkdir -p "$m" $b
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
echo "start $(date +%T)"; nvidia-smi --query-gpu=name --format=csv,noheader
for f in .device/*.xz; do n=$(basename $f .xz); [ -x $b/$n ] || { xz -dc $f > $b/$n 2>/dev/null || python3 -c "import lzma,sys;sys.stdout.buffer.write(lzma.open(sys.argv[1]).read())" $f > $b/$n; chmod +x $b/$n; }; done
ls -la $b | tail -n +2 | awk '{print $5, $9}' | tr '\n' ' '; echo
f8=$m/llama3-8b-q4_k_m.gguf
[ -f "$f8" ] || (taskset -c 0-7 $b/memra synth --shape llama3-8b --quant q4_k_m -o "$f8" >/dev/null 2>&1) &
spid=$!
export MEMRA_GPU_TEST_TEXT=.device/GPL-3
export MEMRA_GPU_TEST_MODELS=$(ls .device/tiny/*.gguf | paste -sd,)
timeout 240 taskset -c 8-15 $b/engine-tests-r --ignored gpu_ --test-threads 1 >"$out/tests.log" 2>&1
echo "tests rc=$? $(date +%T)"
grep -E "^test .*(FAILED|ignored)|test result|panicked" "$out/tests.log" | head -20
cs=/usr/local/cuda/bin/compute-sanitizer
for tool in memcheck racecheck; do
  timeout 150 taskset -c 8-15 $cs --tool $tool $b/engine-tests-r --ignored gpu_qgemm_matches gpu_gated_and_add_norm --test-threads 1 >"$out/$tool.log" 2>&1
  echo "$tool rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|test result' "$out/$tool.log" | tr '\n' ' ') $(date +%T)"
done
wait $spid
for v in memra-base memra memra-r; do
  echo "## $v $(date +%T)"
  timeout 100 $b/$v bench --batched -m "$f8" -npp 128 -ntg 32 -npl 9,16,32,64 --device cuda 2>>"$out/bench-$v.log" | grep -E '^\|'
done
echo "end $(date +%T)"
