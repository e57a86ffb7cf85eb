#!/usr/bin/env bash
# serve_bench.sh: issue 15's serving figures in one command (docs/benchmarks.md
# "Serving benchmark"): a random checkpoint of real shapes, `twain serve` on
# it, `twain bench` at the acceptance workloads, one JSON per run.
#
#   bash tests/bench/serve_bench.sh BIN_DIR TOKENIZER_JSON [PRESET] [BACKEND]
#
# BIN_DIR holds twain (and the worker programs serve starts); PRESET 20b
# (default), 120b or tiny; BACKEND cuda (default) or cpu. The checkpoint goes
# to ${TW_CKPT_DIR:-/dev/shm/twain-PRESET-random} (written once, kept); the
# JSON and serve's log to ${OUT:-.}. Workloads (TW_SERVE_BENCH, one
# "concurrency:requests:input:output" per word) default to the acceptance
# ones: 1,024 in / 1,024 out at concurrency 1, 64, 256 and 512. Extra serve
# flags: TW_SERVE_ARGS. Every wait is bounded; serve is stopped at the end.
set -u
bin=${1:?usage: serve_bench.sh BIN_DIR TOKENIZER_JSON [PRESET] [BACKEND]}
tok=${2:?usage: serve_bench.sh BIN_DIR TOKENIZER_JSON [PRESET] [BACKEND]}
preset=${3:-20b}
backend=${4:-cuda}
out=${OUT:-.}
ckpt=${TW_CKPT_DIR:-/dev/shm/twain-$preset-random}
runs=${TW_SERVE_BENCH:-"1:16:1024:1024 64:256:1024:1024 256:1024:1024:1024 512:2048:1024:1024"}
mkdir -p "$out"

if [ ! -f "$ckpt/model.safetensors.index.json" ]; then
  "$bin/twain" write-checkpoint --preset "$preset" --out "$ckpt" --tokenizer "$tok" || exit 1
fi

log=$out/serve_bench_$preset.log
# shellcheck disable=SC2086 # TW_SERVE_ARGS is a list of flags
"$bin/twain" serve --model "$ckpt" --backend "$backend" --listen tcp://127.0.0.1:0 \
  ${TW_SERVE_ARGS:-} >"$log" 2>&1 &
serve=$!
ep=
for _ in $(seq 1 1200); do # model upload and graph capture: at most 10 minutes
  ep=$(sed -n 's/.*ready.*clients at \([^ ]*\).*/\1/p' "$log" | head -1)
  [ -n "$ep" ] && break
  kill -0 "$serve" 2>/dev/null || break
  sleep 0.5
done
rc=0
if [ -z "$ep" ]; then
  echo "serve_bench: twain serve did not get ready; last lines of $log:"
  tail -20 "$log"
  rc=1
fi
for w in $runs; do
  [ $rc -eq 0 ] || break
  IFS=: read -r c n i o <<<"$w"
  echo "== $preset $backend: concurrency $c, $n requests, $i in / $o out"
  timeout 3600 "$bin/twain" bench --endpoint "$ep" --model "$ckpt" --num-requests "$n" \
    --concurrency "$c" --input-len "$i" --output-len "$o" \
    --json "$out/serve_bench_${preset}_c${c}_${i}x${o}.json" || rc=1
done
kill -INT "$serve" 2>/dev/null
for _ in $(seq 1 60); do kill -0 "$serve" 2>/dev/null || break; sleep 0.5; done
kill -KILL "$serve" 2>/dev/null
exit $rc
