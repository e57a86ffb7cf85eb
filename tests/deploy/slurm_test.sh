#!/usr/bin/env bash
# slurm_test.sh BUILD_DIR SRC_DIR: the Slurm deployment end to end on a real
# Slurm cluster brought up on this machine (slurm_cluster.sh: Debian's
# slurmctld + two slurmd + munge on 127.0.0.1), CPU backend, tiny model:
#  1. submit deploy/slurm/twain.sbatch unchanged (heterogeneous job: prefill
#     component + decode component, router on the first node);
#  2. chat requests through the router succeed;
#  3. add_worker.sh adds a decode worker job; the router registers it;
#  4. while requests keep coming, remove_worker.sh cancels that worker job
#     (drain); every request succeeds and the router is back to one decode worker;
#     then the same with another worker job and a plain `scancel`;
#  5. the service job drains and ends; the cluster is torn down.
# Every wait is bounded; the whole test takes about a minute. Exit 77 (skip)
# when not root, when slurm-wlm/munge are missing, or when the service
# programs are not built.
# shellcheck disable=SC2016  # check() and wait_for() evaluate their single-quoted conditions
set -euo pipefail
build=$1 src=$2
skip() { echo "SKIP: $*"; exit 77; }
[ "$(id -u)" = 0 ] || skip "needs root to run slurmd"
export PATH=$PATH:/usr/sbin
for p in slurmctld slurmd munged sbatch; do command -v "$p" >/dev/null || skip "$p not installed (deploy/dev.sh PKGS: slurm-wlm munge)"; done
for p in router/twain-router prefill/twain-prefill decode/twain-decode router/twain; do
  [ -x "$build/$p" ] || skip "$build/$p not built yet"
done

tmp=$(mktemp -d /tmp/twain-slurm-test.XXXXXX)
cluster=$tmp/cluster
fails=0
check() { if eval "$2"; then echo "ok: $1"; else echo "FAIL: $1"; fails=$((fails + 1)); fi; }
cleanup() {
  set +e
  if [ -n "${SLURM_CONF:-}" ]; then
    scancel --quiet --user=root 2>/dev/null
    for _ in $(seq 1 30); do [ -z "$(squeue -h 2>/dev/null)" ] && break; sleep 1; done
  fi
  bash "$src/tests/deploy/slurm_cluster.sh" stop "$cluster"
  # Job processes of this cluster still alive (only if a step outlived its
  # slurmstepd): found by their environment, ended by pid.
  for e in /proc/[0-9]*/environ; do
    pid=${e#/proc/}; pid=${pid%/environ}
    if tr '\0' '\n' 2>/dev/null < "$e" | grep -qx "SLURM_CONF=$cluster/slurm.conf" &&
       tr '\0' '\n' 2>/dev/null < "$e" | grep -q '^SLURM_JOB_ID='; then
      kill -KILL "$pid" 2>/dev/null
    fi
  done
  if ((fails)); then
    echo "---- logs"; tail -n 30 "$tmp"/logs/*.log "$tmp"/*.out 2>/dev/null
    tail -n 15 "$cluster"/log/slurmctld.log 2>/dev/null
  fi
  rm -rf "$tmp"
}
trap cleanup EXIT

# A port the router binds later: below the kernel's ephemeral range when there
# is room, so no outgoing connection (slurm's RPCs, curl) and no bind to port 0
# elsewhere takes it between this check and the router's bind.
free_port() {
  python3 - <<'EOF'
import random, socket
lo = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
for port in (random.sample(range(lo - 10000, lo), 100) if lo > 11024 else []) + [0]:
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", port))
        port = s.getsockname()[1]
    except OSError:
        continue
    finally:
        s.close()
    print(port)
    break
EOF
}
metric() { # NAME: the router's value of a gauge, or empty
  curl -s --max-time 2 "http://127.0.0.1:$router_metrics_port/metrics" 2>/dev/null |
    awk -v n="$1" '$1 == n || index($1, n "{") == 1 {print $2; exit}'
}
wait_for() { # SECONDS DESCRIPTION CONDITION
  local limit=$1 what=$2 cond=$3 t0=$SECONDS
  while ! eval "$cond"; do
    if ((SECONDS - t0 >= limit)); then echo "FAIL: $what (not within $limit s)"; fails=$((fails + 1)); return 1; fi
    sleep 1
  done
  echo "ok: $what ($((SECONDS - t0)) s)"
}

eval "$(bash "$src/tests/deploy/slurm_cluster.sh" start "$cluster")"
echo "cluster up: $(sinfo -h -N -o '%N %T %G' | tr '\n' ';')"

# The programs, in one folder as in an unpacked bundle.
mkdir -p "$tmp/bin" "$tmp/logs"
for p in router/twain-router prefill/twain-prefill decode/twain-decode router/twain; do ln -s "$build/$p" "$tmp/bin/"; done
export TWAIN_BIN=$tmp/bin TWAIN_MODEL=$src/tests/fixtures/tiny-gptoss-wordnet-mxfp4 TWAIN_BACKEND=cpu
export TWAIN_PREFILL_TP=1 TWAIN_PREFILL_EP=1 TWAIN_DECODE_TP=1 TWAIN_DECODE_EP=1
export TWAIN_PREFILL_WORKERS=1 TWAIN_DECODE_WORKERS=1 TWAIN_WORKER_ARGS="--threads 1"
export TWAIN_LISTEN_HOST=127.0.0.1 TWAIN_ROUTER_HOST=127.0.0.1 TWAIN_LOG_DIR=$tmp/logs TWAIN_DRAIN_SECONDS=30
export TWAIN_KEYS_FILE=$tmp/keys/link.keys # made by the first job (tw_keys)
TWAIN_API_PORT=$(free_port) TWAIN_WORKER_PORT=$(free_port)
for _ in 1 2 3; do [ "$TWAIN_WORKER_PORT" != "$TWAIN_API_PORT" ] && break; TWAIN_WORKER_PORT=$(free_port); done
# Metrics ports 0: each daemon binds a free one as it starts. (A fixed base made
# the workers use base + 1 and base + 101, ports nobody checked: a prefill
# worker once failed on one in use.) The router's port is read from its log.
TWAIN_METRICS_PORT=0 router_metrics_port=
export TWAIN_API_PORT TWAIN_WORKER_PORT TWAIN_METRICS_PORT
endpoint=tcp://127.0.0.1:$TWAIN_API_PORT
chat() { timeout 60 "$tmp/bin/twain" chat --endpoint "$endpoint" --timeout-ms 45000 "$1"; }

# 1. the service, as an operator submits it
cd "$tmp"
job=$(sbatch --parsable --output="$tmp/service-%j.out" "$src/deploy/slurm/twain.sbatch")
echo "service job $job"
wait_for 60 "service job running" '[ "$(squeue -h -j "$job" -o %T | sort -u)" = RUNNING ]'
wait_for 60 "router metrics port in its log" \
  'router_metrics_port=$(sed -n "s/.* metrics port \([0-9][0-9]*\).*/\1/p" "$tmp/logs/router.log" 2>/dev/null | head -n 1); [ -n "$router_metrics_port" ]'
wait_for 60 "router has 1 prefill + 1 decode worker" '[ "$(metric twain_router_prefill_workers)" = 1 ] && [ "$(metric twain_router_decode_workers)" = 1 ]'
check "the job made a private link key file" '[ "$(stat -c %a "$TWAIN_KEYS_FILE")" = 600 ] && grep -q "server-public" "$TWAIN_KEYS_FILE"'
check "job comment names the router" 'squeue -h -j "$job" -o %k | grep -q "router=tcp://127.0.0.1:$TWAIN_WORKER_PORT"'

# 2. chat through the router
answer=$(chat "tree" 2>&1) || true
echo "chat answer: ${answer:0:120}"
check "first chat request answered (the tiny model defines the word)" 'grep -qi "tree" <<<"$answer" && chat "river" >/dev/null 2>&1'

# 3. one more decode worker, as a job of its own
extra=$(bash "$src/deploy/slurm/add_worker.sh" --service "$job" --pool decode --gpus-per-node 1)
echo "added decode worker job $extra"
wait_for 60 "router has 2 decode workers" '[ "$(metric twain_router_decode_workers)" = 2 ]'

# 4. requests keep coming while the extra worker job is cancelled (drained)
: > "$tmp/results"
(
  for w in apple house water light stone music paper cloud; do
    if out=$(chat "$w" 2>&1); then echo "ok $w" >> "$tmp/results"
    else echo "fail $w: $(tr '\n' ' ' <<<"$out" | cut -c1-200)" >> "$tmp/results"; fi
  done
) &
load=$!
wait_for 60 "two requests served before the removal" '[ "$(grep -c . "$tmp/results")" -ge 2 ]'
bash "$src/deploy/slurm/remove_worker.sh" "$extra" --timeout 60
check "the worker job is gone" '[ -z "$(squeue -h -j "$extra" 2>/dev/null)" ]'
check "the removed worker drained (SIGTERM), it was not killed" 'grep -q "draining" "$tmp/logs/decode-$extra-0.log"'
wait "$load" || true
echo "requests during the removal:"; sed 's/^/  /' "$tmp/results"
check "all 8 requests during the removal succeeded" '[ "$(grep -c "^ok" "$tmp/results")" = 8 ]'
wait_for 30 "router is back to 1 decode worker" '[ "$(metric twain_router_decode_workers)" = 1 ]'
check "requests after the removal succeed" 'chat "garden" >/dev/null 2>&1 && chat "bread" >/dev/null 2>&1'

# 4b. the same with a plain `scancel` of a worker job (Slurm sends SIGTERM to
#     every step, then SIGKILL after KillWait): requests keep succeeding
extra2=$(bash "$src/deploy/slurm/add_worker.sh" --service "$job" --pool decode --gpus-per-node 1)
wait_for 60 "router has 2 decode workers again (job $extra2)" '[ "$(metric twain_router_decode_workers)" = 2 ]'
: > "$tmp/results2"
(
  for w in salt glass horse wind; do
    if out=$(chat "$w" 2>&1); then echo "ok $w" >> "$tmp/results2"
    else echo "fail $w: $(tr '\n' ' ' <<<"$out" | cut -c1-200)" >> "$tmp/results2"; fi
  done
) &
load=$!
wait_for 60 "a request served before the scancel" '[ "$(grep -c . "$tmp/results2")" -ge 1 ]'
scancel "$extra2"
wait_for 60 "the cancelled worker job is gone" '[ -z "$(squeue -h -j "$extra2" 2>/dev/null)" ]'
wait "$load" || true
echo "requests around the scancel:"; sed 's/^/  /' "$tmp/results2"
check "all 4 requests around the scancel succeeded" '[ "$(grep -c "^ok" "$tmp/results2")" = 4 ]'
wait_for 30 "router is back to 1 decode worker after the scancel" '[ "$(metric twain_router_decode_workers)" = 1 ]'

# 5. drain and stop the service
scancel --signal=TERM --batch "$job"
wait_for 60 "service job ended after its drain" '[ -z "$(squeue -h -j "$job" 2>/dev/null)" ]'
check "service log shows the drain" 'grep -q "service stopped" "$tmp"/service-*.out'
check "the service's workers and router drained" 'grep -q draining "$tmp/logs/decode-$job-0.log" && grep -q draining "$tmp/logs/prefill-$job-0.log" && grep -q draining "$tmp/logs/router.log"'
echo "slurm_test: $fails failure(s)"
[ "$fails" = 0 ]
