#!/usr/bin/env bash
# service_gpu.sh: the disaggregated service on one GPU with the CUDA backend
# (issue 4 "unchanged with the CUDA backend"), with the C programs only (the
# GPU machine has no pyzmq). Two halves:
#
#   here:  bash tests/gpu/service_gpu.sh --stage [BUILD_DIR]
#          builds twain, twain-prefill, twain-decode and twain-bench-kv-handoff
#          in BUILD_DIR (default $TW_BUILD_DIR or build-gpu-svc, CUDA on) and
#          stages them under .carry/gpu/svc/ (deploy/bundle.sh --system-cuda,
#          recompressed with xz: the programs + the libraries and UCX modules
#          the GPU machine lacks), next to run_gpu.sh's own carry. When
#          deploy/build_ucx_cuda.sh has built UCX with CUDA transports
#          (TW_UCX_CUDA=PREFIX, default build-ucx-cuda/install), its libraries
#          and modules replace Debian's UCX in the bundle (TW_UCX_CUDA=none:
#          keep Debian's).
#   GPU:   bash tests/gpu/service_gpu.sh [BUILD_DIR]
#          (run_gpu.sh runs it through TWAIN_GPU_EXTRA=tests/gpu/service_gpu.sh,
#          cwd = checkout, $OUT set, LD_LIBRARY_PATH with the CUDA libraries).
#          Uses BUILD_DIR's programs when given, else the staged bundle.
#          1. `twain serve --backend cuda --prefill 1 --decode 1 --verify-kv`
#             (both workers on GPU 0), waits for `ready` (bounded);
#          2. for the 4 fixture prompts (tests/fixtures/tiny-gptoss-wordnet/
#             prompts.json ids): `twain generate` greedy 32 tokens through
#             router -> prefill -> UCX KV handoff -> decode, compared token for
#             token with `twain-prefill --backend cuda --generate 32` in one
#             process: PASS/FAIL per prompt;
#          3. prints the KV handoff mode the workers logged (device KV pool
#             STAGED through pinned host memory, or DIRECT over UCX cuda
#             transports), and from the workers' /metrics: KV bytes sent and
#             received, transfer time, per-layer put batches, KV checksums;
#          4. stops serve with SIGINT (bounded; then SIGKILL of everything it
#             started);
#          5. twain-bench-kv-handoff --device (cudaMalloc'd pools), <= 30 s.
#          6. with TW_SVC_PY=1: the Python service tests (tests/service/
#             test_service_*.py; TW_SVC_PY_TESTS="greedy robust ..." picks
#             them) against the same programs, each behind a wrapper that turns
#             the tests' `--backend cpu` into TW_SVC_BACKEND (cuda: every
#             worker on GPU 0). No pyzmq there: tests/service/zmq_compat/ goes
#             first on PYTHONPATH (zmq_ctypes.py over the bundle's
#             libzmq.so.5); without google.protobuf, the staged pure-Python
#             copy of Debian's (PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python).
#             Budget TW_SVC_PY_BUDGET_S (default 300), at most 240 s a test.
#          TW_SVC_KV_ONLY=1: only the KV handoff device to device (issue 16),
#          then stop: nvidia-smi topo -m, UCX's CUDA transports (ucx_info),
#          test_kv_transfer_gpu (two processes, direct and staged paths, exact
#          bytes) and twain-bench-kv-handoff --device by prompt length (1k,
#          8k, 32k, 128k tokens of gpt-oss-20b) over the path the code picks
#          (direct with the CUDA-enabled UCX) and --staged; budget 300 s.
#          One call on the GPU machine (after --stage here, carry .carry/gpu):
#            TW_SVC_KV_ONLY=1 bash tests/gpu/service_gpu.sh
#          Everything is bounded; steps 1-5 stay under ~90 s
#          (TW_SVC_GPU_BUDGET_S). Writes one log, $OUT/service_gpu.log. Exit 0
#          when every prompt matched, the checksums held and every Python test
#          passed (or skipped).
set -u
root=$(cd "$(dirname "$0")/../.." && pwd)
stage_dir=$root/.carry/gpu/svc

# ---------------------------------------------------------------- here ----
if [ "${1:-}" = "--stage" ]; then
  set -e
  build=${2:-${TW_BUILD_DIR:-$root/build-gpu-svc}}
  cmake -S "$root" -B "$build" -DTWAIN_WERROR="${TW_WERROR:-ON}" -DTWAIN_CUDA=ON >/dev/null
  cmake --build "$build" -j2 --target twain twain-router twain-prefill twain-decode \
    twain-bench-kv-handoff test_kv_transfer_gpu twain_proto_desc >"$build/service_gpu_build.log" 2>&1 ||
    { grep -E "error|Error" "$build/service_gpu_build.log" | head -20; exit 1; }
  mkdir -p "$stage_dir"
  rm -f "$stage_dir/twain.tar.gz" "$stage_dir/twain.tar.xz"
  # UCX with CUDA transports (deploy/build_ucx_cuda.sh), when built: bundle.sh
  # carries its libraries, modules and ucx_info instead of Debian's 1.13.1
  # (same libucp.so.0 ABI; 1.22.0 by default, whose puts reach device memory
  # over cuda_ipc), so the workers put device to device (the prefill worker
  # logs the path per decode worker). TW_UCX_CUDA=PREFIX, default
  # build-ucx-cuda/install; TW_UCX_CUDA=none keeps Debian's UCX.
  ucx_cuda=${TW_UCX_CUDA:-$root/build-ucx-cuda/install}
  if [ "$ucx_cuda" != none ] && ! compgen -G "$ucx_cuda/lib/ucx/libuct_cuda.so*" >/dev/null; then
    ucx_cuda=none
  fi
  bash "$root/deploy/bundle.sh" --no-build --build-dir "$build" --system-cuda --no-default-model \
    --ucx "$ucx_cuda" --out "$stage_dir/twain.tar.gz" >/dev/null
  if [ "$ucx_cuda" != none ]; then
    echo "service_gpu: UCX with CUDA transports from $ucx_cuda ($(tar -xzOf "$stage_dir/twain.tar.gz" \
      --wildcards '*/share/twain/MANIFEST.txt' | sed -n 's/^UCX: .*, \(version [^,]*\),.*/\1/p'))"
  else
    echo "service_gpu: Debian's UCX (no CUDA transports: KV handoff STAGED; deploy/build_ucx_cuda.sh builds one)"
  fi
  # xz: the device call carries at most 64 MiB with the tracked tree
  gzip -dc "$stage_dir/twain.tar.gz" | xz -T2 -6 >"$stage_dir/twain.tar.xz"
  rm -f "$stage_dir/twain.tar.gz"
  cp "$build/tests/bench/twain-bench-kv-handoff" "$build/tests/service/test_kv_transfer_gpu" "$stage_dir/"
  # for the Python service tests (TW_SVC_PY=1): the protobuf descriptor set, and
  # Debian's pure-Python google.protobuf for a python that has none (no .so: the
  # device's python is another version)
  cp "$build/tests/service/twain.desc" "$stage_dir/"
  pbroot=/usr/lib/python3/dist-packages
  if [ -f "$pbroot/google/protobuf/descriptor_pool.py" ]; then
    tar -C "$pbroot" --exclude='*.so' --exclude=__pycache__ -cf - google/protobuf | xz -T2 -6 \
      >"$stage_dir/protobuf-py.tar.xz"
  else
    echo "service_gpu: no Debian python3-protobuf here: a python without google.protobuf cannot run the tests"
  fi
  du -sh "$stage_dir"
  exit 0
fi

# ------------------------------------------------------- on the device ----
out=${OUT:-/tmp/twain-svc-gpu}
mkdir -p "$out"
log=$out/service_gpu.log
: >"$log"
t_start=$(date +%s)
budget=${TW_SVC_GPU_BUDGET_S:-85}
[ -n "${TW_SVC_KV_ONLY:-}" ] && budget=${TW_SVC_GPU_BUDGET_S:-300}
tmo() { # tmo WANTED: at most WANTED seconds, cut to what is left of the budget
  local left=$((t_start + budget - $(date +%s) - 2))
  [ "$left" -lt 1 ] && left=1
  if [ "$1" -lt "$left" ]; then echo "$1"; else echo "$left"; fi
}
say() { echo "$*" | tee -a "$log"; }
work=$(mktemp -d "${TMPDIR:-/tmp}/twain-svc-gpu.XXXXXX")
fails=0

if [ -n "${1:-}" ] && [ -d "$1" ]; then
  b=$(cd "$1" && pwd)
  twain=$b/router/twain prefill=$b/prefill/twain-prefill bench=$b/tests/bench/twain-bench-kv-handoff
  kvtest=$b/tests/service/test_kv_transfer_gpu
  router_bin=$b/router/twain-router decode_bin=$b/decode/twain-decode desc=$b/tests/service/twain.desc
  libdir=""
else
  if [ ! -s "$stage_dir/twain.tar.xz" ]; then
    say "service_gpu: no staged programs: run 'bash tests/gpu/service_gpu.sh --stage' here and carry .carry/gpu"
    exit 1
  fi
  if command -v xz >/dev/null 2>&1; then xz -dc "$stage_dir/twain.tar.xz" | tar -C "$work" -xf -; else
    python3 -c 'import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]), sys.stdout.buffer)' \
      "$stage_dir/twain.tar.xz" | tar -C "$work" -xf -
  fi
  bdir=$(echo "$work"/twain-*)
  # shellcheck disable=SC1091
  . "$bdir/share/twain/env.sh" # UCX_MODULE_DIR, NCCL_NVLS_ENABLE=0, PATH
  twain=$bdir/bin/twain prefill=$bdir/bin/twain-prefill bench=$stage_dir/twain-bench-kv-handoff
  kvtest=$stage_dir/test_kv_transfer_gpu
  router_bin=$bdir/bin/twain-router decode_bin=$bdir/bin/twain-decode desc=$stage_dir/twain.desc
  libdir=$bdir/lib
fi
model=$root/tests/fixtures/tiny-gptoss-wordnet-mxfp4
prompts=$root/tests/fixtures/tiny-gptoss-wordnet/prompts.json
export TWAIN_LOG=${TWAIN_LOG:-info}
backend=${TW_SVC_BACKEND:-cuda} # cpu: a dry run of this script on a machine without a GPU
say "service_gpu: $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1); programs $(dirname "$twain")"

# KV handoff only (TW_SVC_KV_ONLY=1): the GPU test and the benchmark, both paths
if [ -n "${TW_SVC_KV_ONLY:-}" ]; then
  export LD_LIBRARY_PATH=${libdir:+$libdir:}${LD_LIBRARY_PATH:-}
  { nvidia-smi topo -m 2>/dev/null || true; } | tee -a "$log"
  say "UCX: $(ucx_info -v 2>/dev/null | sed -n 's/^# Version //p' | head -1); CUDA transports: $(ucx_info -d 2>/dev/null | sed -n 's/.*Transport: \(cuda[a-z_]*\).*/\1/p' | sort -u | tr '\n' ' ')"
  kv_fail=0
  say "test_kv_transfer_gpu (bounded $(tmo 90) s):"
  timeout "$(tmo 90)" "$kvtest" 2>"$work/kvtest.err" | tee -a "$log"
  r=${PIPESTATUS[0]}
  grep -E "kvx|ERROR|WARN" "$work/kvtest.err" | sed 's/^[^ ]* /  /' | sort -u | head -20 | tee -a "$log"
  say "  exit $r (0 passed, 77 skipped: see above)"
  [ "$r" = 0 ] || [ "$r" = 77 ] || kv_fail=1
  for mode in "" --staged; do
    say "twain-bench-kv-handoff --device $mode (bounded $(tmo 120) s):"
    # shellcheck disable=SC2086  # $mode: no option or one
    timeout "$(tmo 120)" "$bench" --device $mode --reps "${TW_KV_REPS:-5}" 2>"$work/bench.err" | tee -a "$log"
    r=${PIPESTATUS[0]}
    grep -E "kv handoff|staged kv pieces|ERROR|WARN" "$work/bench.err" | sed 's/^[^ ]* /  /' | sort -u | head -10 | tee -a "$log"
    say "  exit $r"
    [ "$r" = 0 ] || kv_fail=1
  done
  rm -rf "$work"
  exit "$kv_fail"
fi

# the prompts: NAME ids-comma-separated, and the one-process references
python3 -c '
import json, sys
d = json.load(open(sys.argv[1]))
for name in ("short_dog", "short_book", "system_water", "multiturn"):
    print(name, ",".join(str(i) for i in d[name]["ids"]))' "$prompts" >"$work/prompts.txt"
while read -r name ids; do echo "[$ids]" >"$work/$name.json"; done <"$work/prompts.txt"
(
  while read -r name _; do
    timeout "$(tmo 40)" "$prefill" --model "$model" --backend "$backend" --prompt-tokens "$work/$name.json" \
      --generate 32 >"$work/$name.ref" 2>"$work/$name.ref.err"
  done <"$work/prompts.txt"
) &
ref_pid=$!

# 1. serve on GPU 0 (own session: everything it starts is findable and killable)
ss=""
command -v setsid >/dev/null 2>&1 && ss=setsid
$ss "$twain" serve --model "$model" --backend "$backend" --prefill 1 --decode 1 --threads 2 \
  --listen tcp://127.0.0.1:0 --metrics-port 0 --verify-kv >"$work/serve.log" 2>&1 &
serve=$!
ep=""
end=$(($(date +%s) + $(tmo 45)))
while [ "$(date +%s)" -lt "$end" ] && kill -0 "$serve" 2>/dev/null; do
  ep=$(sed -n 's/.*ready.*clients at \([^ ]*\).*/\1/p' "$work/serve.log" | head -1)
  [ -n "$ep" ] && break
  sleep 0.2
done
workers=$(ps -o pid= --ppid "$serve" 2>/dev/null | tr '\n' ' ')
stop_serve() {
  if kill -0 "$serve" 2>/dev/null; then
    kill -INT "$serve"
    local end2=$(($(date +%s) + $(tmo 20)))
    while kill -0 "$serve" 2>/dev/null && [ "$(date +%s)" -lt "$end2" ]; do sleep 0.2; done
  fi
  local left_over=0
  for p in $serve $workers; do
    if kill -0 "$p" 2>/dev/null; then left_over=1; kill -9 -- "-$p" "$p" 2>/dev/null; fi
  done
  wait "$serve" 2>/dev/null
  serve_rc=$?
  [ "$left_over" = 1 ] && serve_rc=killed
}
trap 'stop_serve; kill -9 "$ref_pid" 2>/dev/null; rm -rf "$work"' EXIT
if [ -z "$ep" ]; then
  say "FAIL serve: no 'ready' line within the bound (workers: $workers); its log:"
  tail -40 "$work/serve.log" | tee -a "$log"
  exit 1
fi
say "serve ready at $ep ($(($(date +%s) - t_start)) s; worker pids $workers)"

# 2. the 4 prompts through the service
while read -r name ids; do
  timeout "$(tmo 20)" "$twain" generate --endpoint "$ep" --max-tokens 32 --timeout-ms 15000 "$ids" \
    >"$work/$name.svc" 2>"$work/$name.svc.err"
done <"$work/prompts.txt"
wait "$ref_pid" 2>/dev/null
while read -r name ids; do
  got=$(tail -1 "$work/$name.svc" 2>/dev/null | tr -s ' ' ',' | sed 's/^,//; s/,$//')
  ref=$(grep '^\[' "$work/$name.ref" 2>/dev/null | tail -1 | tr -d '[] ')
  n=$(echo "$got" | tr ',' '\n' | grep -c .)
  if [ -n "$ref" ] && [ "$got" = "$ref" ] && [ "$n" = 32 ]; then
    say "PASS $name ($(echo "$ids" | tr ',' '\n' | wc -l) prompt tokens): 32 tokens identical to twain-prefill --generate"
  else
    fails=$((fails + 1))
    say "FAIL $name: service [$got] vs one process [$ref]"
    tail -3 "$work/$name.svc.err" "$work/$name.ref.err" 2>/dev/null | tee -a "$log"
  fi
done <"$work/prompts.txt"

# 3. the handoff mode and the workers' metrics
say "KV handoff mode (from the workers' logs):"
grep -E "kv handoff mode|cuda memory (native|staged)|registered kv pool|engine.*(cuda|memory plan)" \
  "$work/serve.log" | sed 's/^[^ ]* //' | sort -u | head -12 | sed 's/^/  /' | tee -a "$log"
port_of() { sed -n "s/.*$1\[[0-9]*\].*serving \/metrics and \/healthz on [0-9.]*:\([0-9]*\).*/\1/p" "$work/serve.log" | head -1; }
for w in twain-prefill twain-decode; do
  p=$(port_of "$w")
  [ -n "$p" ] || { say "  $w: no metrics port in the log"; continue; }
  python3 - "$w" "$p" <<'EOF' | tee -a "$log"
import re, sys, urllib.request
name, port = sys.argv[1], int(sys.argv[2])
text = urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=5).read().decode()
m = {}
for line in text.splitlines():
    if line and not line.startswith("#"):
        k, v = line.rsplit(" ", 1)
        m[re.sub(r"\{process=\"[^\"]*\"(,model_name=\"[^\"]*\")?\}", "", k)] = float(v)
g = lambda k: m.get("twain_" + k, float("nan"))
if name == "twain-prefill":
    n = g("kv_transfer_seconds_count")
    print("  prefill: %d prompts, kv bytes sent %d, transfer (puts + flush) %.2f ms total / %.3f ms per prompt,"
          " engine %.2f ms per prompt, layer put batches %d (%d from the per-layer callback)" % (
          g("prefill_requests_total"), g("kv_bytes_sent_total"), g("kv_transfer_seconds_sum") * 1e3,
          g("kv_transfer_seconds_sum") * 1e3 / max(n, 1), g("prefill_seconds_sum") * 1e3 / max(n, 1),
          g("kv_layer_sends_total"), g("kv_layer_sends_overlapped_total")))
else:
    print("  decode: kv bytes received %d, layer checksums ok %d, mismatch %d, blocks used %d" % (
          g("kv_bytes_received_total"), g("kv_checksum_ok_total"), g("kv_checksum_mismatch_total"),
          g("kv_blocks_used")))
    if g("kv_checksum_mismatch_total") != 0 or g("kv_checksum_ok_total") <= 0:
        sys.exit(1)
EOF
  [ "${PIPESTATUS[0]}" = 0 ] || { fails=$((fails + 1)); say "FAIL $w metrics (checksums)"; }
done

# 4. stop serve cleanly
stop_serve
trap 'rm -rf "$work"' EXIT
if [ "$serve_rc" = 0 ]; then say "serve stopped cleanly (exit 0)"; else
  fails=$((fails + 1)); say "FAIL serve stop: exit $serve_rc"; fi
grep -E " (ERROR|WARN) " "$work/serve.log" | head -10 | sed 's/^/  log: /' | tee -a "$log"
{ echo "---- serve log (first 60 lines)"; head -60 "$work/serve.log"; } >>"$log"

# 5. KV handoff bench with device memory
if [ -x "$bench" ]; then
  say "twain-bench-kv-handoff --device (bounded $(tmo 30) s):"
  LD_LIBRARY_PATH=${libdir:+$libdir:}${LD_LIBRARY_PATH:-} timeout "$(tmo 30)" "$bench" --device --reps 5 \
    --tokens 1024,8192 2>"$work/bench.err" | tee -a "$log"
  r=${PIPESTATUS[0]}
  grep -E "kv handoff (mode|path)" "$work/bench.err" | sed 's/^[^ ]* /  /' | sort -u | tee -a "$log"
  case $r in 0) ;; 77) say "  bench: no GPU (skipped)" ;; 124) say "  bench: cut at the time bound" ;;
    *) say "  bench: exit $r"; tail -5 "$work/bench.err" | tee -a "$log" ;; esac
fi

# 6. the Python service tests, on this backend
if [ -n "${TW_SVC_PY:-}" ]; then
  py_t0=$(date +%s)
  py_budget=${TW_SVC_PY_BUDGET_S:-300}
  pyb=$work/pybuild
  mkdir -p "$pyb/router" "$pyb/prefill" "$pyb/decode"
  wrap() { # wrap REAL DEST: DEST runs REAL with the tests' '--backend cpu' as $backend.
    # A copy of DEST elsewhere (test_service_ops' relocated bundle) runs a copy of
    # REAL beside itself, so the program's own location is the copy's (its default
    # model is looked up there), with REAL's libraries on LD_LIBRARY_PATH.
    # shellcheck disable=SC2016  # the single-quoted lines are the wrapper's own code
    printf '%s\n' '#!/usr/bin/env bash' "# tests/gpu/service_gpu.sh: $1, --backend cpu -> $backend" \
      'a=(); p=""' 'for x in "$@"; do' \
      "  if [ \"\$p\" = --backend ] && [ \"\$x\" = cpu ]; then x=$backend; fi" \
      "  [ \"\$x\" = --backend=cpu ] && x=--backend=$backend" \
      '  a+=("$x"); p=$x' 'done' "real=\"$1\"" 'me=$(readlink -f "$0")' \
      "if [ \"\${me%/*}\" != \"$(readlink -f "$(dirname "$2")")\" ]; then" \
      '  export LD_LIBRARY_PATH=${real%/*}/../lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}' \
      '  cp "$real" "$me.real" && real=$me.real' 'fi' 'exec "$real" "${a[@]}"' >"$2"
    chmod +x "$2"
  }
  wrap "$twain" "$pyb/router/twain"
  wrap "$router_bin" "$pyb/router/twain-router"
  wrap "$prefill" "$pyb/prefill/twain-prefill"
  wrap "$decode_bin" "$pyb/decode/twain-decode"
  pp=$root/tests/service
  zmq_note="pyzmq"
  if ! python3 -c 'import zmq' 2>/dev/null; then
    pp=$root/tests/service/zmq_compat:$pp
    zmq_note="zmq_ctypes.py (no pyzmq)"
    if [ -n "$libdir" ] && [ -e "$libdir/libzmq.so.5" ]; then export TW_LIBZMQ=$libdir/libzmq.so.5; fi
  fi
  pb_note="google.protobuf $(python3 -c 'import google.protobuf as g; print(g.__version__)' 2>/dev/null)"
  if ! python3 -c 'import google.protobuf.descriptor_pool' 2>/dev/null; then
    if [ -s "$stage_dir/protobuf-py.tar.xz" ]; then
      mkdir -p "$work/pylib"
      if command -v xz >/dev/null 2>&1; then xz -dc "$stage_dir/protobuf-py.tar.xz" | tar -C "$work/pylib" -xf -; else
        python3 -c 'import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]), sys.stdout.buffer)' \
          "$stage_dir/protobuf-py.tar.xz" | tar -C "$work/pylib" -xf -
      fi
      pp=$pp:$work/pylib
      export PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python
      pb_note="Debian's pure-Python google.protobuf (staged)"
    else
      pb_note="no google.protobuf and none staged: the tests will fail to import"
    fi
  fi
  say "Python service tests, backend $backend: $(python3 --version 2>&1), $zmq_note, $pb_note"
  for t in ${TW_SVC_PY_TESTS:-greedy concurrency faults bad_input toolcall cli ops robust}; do
    t=${t#test_service_}
    t=${t%.py}
    left=$((py_t0 + py_budget - $(date +%s)))
    if [ "$left" -lt 20 ]; then
      say "SKIP test_service_$t: the Python test budget (${py_budget} s) is spent"
      continue
    fi
    [ "$left" -gt 240 ] && left=240
    start=$(date +%s)
    TW_BUILD_DIR=$pyb TW_MODEL_DIR=$model TW_FIXTURES_DIR=$root/tests/fixtures TW_PROTO_DESC=$desc \
      PYTHONPATH=$pp TWAIN_LOG=info PYTHONUNBUFFERED=1 \
      timeout "$left" python3 "$root/tests/service/test_service_$t.py" >"$work/py_$t.log" 2>&1
    r=$?
    case $r in 0) s=PASS ;; 77) s=SKIP ;; 124) s="TIMEOUT(${left}s)" ;; *) s="FAIL($r)" ;; esac
    say "$s test_service_$t ($(($(date +%s) - start)) s)"
    if [ "$s" != PASS ] && [ "$s" != SKIP ]; then
      fails=$((fails + 1))
      tail -25 "$work/py_$t.log" | sed 's/^/  /' | tee -a "$log"
    fi
  done
fi
say "service_gpu: $fails failure(s) in $(($(date +%s) - t_start)) s"
[ "$fails" = 0 ]
