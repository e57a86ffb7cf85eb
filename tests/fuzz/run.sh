#!/usr/bin/env bash
# tests/fuzz/run.sh: build the libFuzzer harnesses with clang (ASan + UBSan,
# CUDA off) in their own build folder, replay every past crash
# (tests/fuzz/regress/NAME/*), then fuzz each harness for a bounded time from
# its seed corpus (tests/fuzz/corpus/NAME, read-only) plus a working corpus
# in OUT. Exits 1 if any harness crashed (the input is kept in OUT as
# crash-*: add it to tests/fuzz/regress/NAME once fixed).
#   bash tests/fuzz/run.sh [--build DIR] [--seconds N] [--out DIR] [NAME...]
# CI: 60 s each. A longer run (docs/testing.md): --seconds 3600 NAME, one or two
# at a time under nice -n 19.
set -euo pipefail
src=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
build=$src/build-fuzz seconds=60 out="" names=()
while (($#)); do
  case $1 in
    --build) build=$2; shift 2 ;;
    --seconds) seconds=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
    *) names+=("$1"); shift ;;
  esac
done
out=${out:-$build/fuzz-out}
((${#names[@]})) || names=(fuzz_tokenizer fuzz_harmony_parse fuzz_checkpoint fuzz_router_client fuzz_router_worker
                    fuzz_http_request)
command -v clang >/dev/null || { echo "run.sh: no clang (apt-get install clang)"; exit 1; }

flags="-O1 -g -fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
CC=clang cmake -S "$src" -B "$build" -DTWAIN_FUZZ=ON -DTWAIN_CUDA=OFF -DCMAKE_BUILD_TYPE=Debug \
  -DCMAKE_C_FLAGS="$flags" >/dev/null
cmake --build "$build" -j"$(nproc)" --target "${names[@]}" >/dev/null

export ASAN_OPTIONS=detect_leaks=0:allocator_may_return_null=1 UBSAN_OPTIONS=print_stacktrace=1
fails=0
for n in "${names[@]}"; do
  bin=$build/tests/fuzz/$n work=$out/$n
  mkdir -p "$work/corpus"
  if compgen -G "$src/tests/fuzz/regress/$n/*" >/dev/null; then
    if ! "$bin" -runs=0 "$src/tests/fuzz/regress/$n"/* >"$work/regress.log" 2>&1; then
      echo "FAIL $n: a past crash is back (tests/fuzz/regress/$n); see $work/regress.log"
      fails=$((fails + 1)); continue
    fi
  fi
  rc=0
  "$bin" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -max_len=65536 \
    -print_final_stats=1 -artifact_prefix="$work/" "$work/corpus" "$src/tests/fuzz/corpus/$n" \
    >"$work/fuzz.log" 2>&1 || rc=$?
  # (a crash on the first input leaves no "cov:" line: grep finds nothing)
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$work/fuzz.log" | tail -1)
  cov=$(grep -o 'cov: [0-9]*' "$work/fuzz.log" | tail -1 | cut -d' ' -f2 || true)
  ft=$(grep -o 'ft: [0-9]*' "$work/fuzz.log" | tail -1 | cut -d' ' -f2 || true)
  if ((rc)); then
    echo "FAIL $n: exit $rc after ${execs:-?} runs; crash input: $(ls "$work"/crash-* "$work"/timeout-* "$work"/oom-* 2>/dev/null | head -1)"
    grep -m5 -E 'ERROR|runtime error|SUMMARY' "$work/fuzz.log" || true
    fails=$((fails + 1))
  else
    echo "ok   $n: ${seconds} s, ${execs:-?} runs, coverage ${cov:-?} edges, ${ft:-?} features, corpus $(ls "$work/corpus" | wc -l) new inputs"
  fi
done
exit $((fails ? 1 : 0))
