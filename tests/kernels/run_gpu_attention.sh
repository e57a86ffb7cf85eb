#!/usr/bin/env bash
# run_gpu_attention.sh: build the attention / norm / RoPE tests and bench here,
# then (with --device, on the GPU machine) run them from the carried folder.
#   here:    bash tests/kernels/run_gpu_attention.sh            (build + stage .carry/cuattn)
#   device:  bash tests/kernels/run_gpu_attention.sh --device [bench args]
# The GPU machine lacks most Debian libraries, so the binaries and the shared
# libraries they need (ldd) are staged in .carry/cuattn (ignored by git).
set -u
root=$(cd "$(dirname "$0")/../.." && pwd)
carry=$root/.carry/cuattn
if [ "${1:-}" != "--device" ]; then
  set -e
  cmake -S "$root" -B "$root/build-cuattn" -DTWAIN_WERROR=ON >/dev/null
  cmake --build "$root/build-cuattn" -j2 --target test_attention test_norm_rope twain-bench-attention
  rm -rf "$carry" && mkdir -p "$carry/bin" "$carry/lib"
  for b in tests/kernels/test_attention tests/kernels/test_norm_rope tests/bench/twain-bench-attention; do
    cp "$root/build-cuattn/$b" "$carry/bin/"
  done
  for b in "$carry"/bin/*; do
    ldd "$b" | awk '/=> \// {print $3}' | grep -v -E 'libc\.so|libm\.so|libdl|libpthread|librt|ld-linux' |
      while read -r l; do cp -L "$l" "$carry/lib/"; done
  done
  du -sh "$carry"
  exit 0
fi
shift
export LD_LIBRARY_PATH=$carry/lib:${LD_LIBRARY_PATH:-}
out=${OUT:-/tmp}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
rc=0
( time "$carry/bin/test_norm_rope" ) 2>&1 | tee "$out/test_norm_rope.log"; rc=$((rc | ${PIPESTATUS[0]}))
( time "$carry/bin/test_attention" ) 2>&1 | tee "$out/test_attention.log"; rc=$((rc | ${PIPESTATUS[0]}))
# every prefill kernel variant on a subset of cases, mma.sync and wgmma ones in
# separate processes (a trap in one must not hide the others)
for vl in 0123 4 5 6 7; do
  TW_ATTN_TEST_VARIANTS=$vl "$carry/bin/test_attention" 2>&1 | grep -E '^(ok|FAIL)' | grep -v api | tee -a "$out/test_variants.log"
done
if [ -n "${TW_SANITIZE:-}" ] && command -v compute-sanitizer >/dev/null; then
  TW_ATTN_TEST_QUICK=1 compute-sanitizer --tool "$TW_SANITIZE" "$carry/bin/test_attention" 2>&1 | tail -15 | tee "$out/sanitize.log"
fi
for vl in 0123 04 05 06 07; do
  "$carry/bin/twain-bench-attention" prefill $vl 2>&1 | grep -E '^\| prefill|rror' | tee -a "$out/bench_attention.log"
done
"$carry/bin/twain-bench-attention" decode 2>&1 | tee -a "$out/bench_attention.log"
echo "tests rc=$rc"
