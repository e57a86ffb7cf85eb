#!/usr/bin/env bash
# run_gpu.sh: the GPU run of twain: every gpu-labelled ctest case, then the
# CUDA engine benchmark, on the GPU machine. Two halves:
#
#   here (no GPU):  bash tests/gpu/run_gpu.sh
#       configures and builds build-cumoe, then stages the gpu test binaries,
#       twain-bench-cuda and the shared libraries the GPU machine lacks (from
#       ldd, minus CUDA/cuBLAS/NCCL/libc which it has) into .carry/gpu
#       (ignored by git). Carry `.carry/gpu` with the device call.
#   on the GPU machine:  bash tests/gpu/run_gpu.sh --device [bench args...]
#       runs each staged test (exit 77 = skip) with TW_FIXTURES_DIR set to
#       this checkout's tests/fixtures, then twain-bench-cuda with the given
#       arguments (default: a short run), writes every log under $OUT and
#       prints a short table last.
# Environment on the device: TW_TESTS="test_moe test_gemm" limits the tests;
# TW_SKIP_BENCH=1 skips the benchmark.
set -u
root=$(cd "$(dirname "$0")/../.." && pwd)
carry=$root/.carry/gpu
build=$root/build-cumoe

if [ "${1:-}" != "--device" ]; then
  set -e
  cmake -S "$root" -B "$build" -DTWAIN_WERROR=${TW_WERROR:-ON} >/dev/null
  tests=$(cd "$build" && ctest -N -L gpu | awk '/Test +#/ {print $3}')
  # shellcheck disable=SC2086
  if ! cmake --build "$build" -j2 --target $tests twain-bench-cuda >"$build/run_gpu_build.log" 2>&1; then
    grep -E "error|Error" "$build/run_gpu_build.log" | head -20
    echo "build failed: see $build/run_gpu_build.log"
    exit 1
  fi
  rm -rf "$carry" && mkdir -p "$carry/bin" "$carry/lib"
  for t in $tests; do
    f=$(find "$build/tests" -type f -name "$t" -perm -u+x | head -1)
    [ -n "$f" ] && cp "$f" "$carry/bin/"
  done
  cp "$build/tests/bench/twain-bench-cuda" "$carry/bin/"
  echo "$tests" >"$carry/tests.txt"
  for b in "$carry"/bin/*; do
    ldd "$b" | awk '/=> \// {print $3}' |
      grep -v -E 'libc\.so|libm\.so|libdl|libpthread|librt|ld-linux|libcuda\.so|libcublas|libnccl|libstdc\+\+|libgcc_s' |
      while read -r l; do cp -L -n "$l" "$carry/lib/" 2>/dev/null || true; done
  done
  du -sh "$carry"
  exit 0
fi
shift
export LD_LIBRARY_PATH=$carry/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export TW_FIXTURES_DIR=$root/tests/fixtures
out=${OUT:-/tmp/twain-gpu}
mkdir -p "$out"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used,memory.total --format=csv,noheader |
  tee "$out/gpu.txt"
tests=${TW_TESTS:-$(cat "$carry/tests.txt")}
summary=""
rc=0
for t in $tests; do
  start=$(date +%s)
  "$carry/bin/$t" >"$out/$t.log" 2>&1
  r=$?
  dur=$(($(date +%s) - start))
  case $r in
    0) s=PASS ;;
    77) s=SKIP ;;
    *) s="FAIL($r)"; rc=1 ;;
  esac
  grep -E "^(ok|FAIL|prefill|decode|sampling)" "$out/$t.log" | tail -40
  summary="$summary$(printf '%-22s %-8s %4ds' "$t" "$s" "$dur")\n"
done
if [ -z "${TW_SKIP_BENCH:-}" ]; then
  if [ $# -eq 0 ]; then
    set -- --synthetic 20b --prefill 8192,32768 --batches 1,8,32 --contexts 8192 --steps 10
  fi
  "$carry/bin/twain-bench-cuda" "$@" 2>&1 | tee "$out/bench.log" | grep -v "^|"
fi
echo
echo "== gpu tests =="
printf "%b" "$summary"
if [ -f "$out/bench.log" ]; then
  echo "== bench =="
  grep "^|" "$out/bench.log"
fi
exit $rc
