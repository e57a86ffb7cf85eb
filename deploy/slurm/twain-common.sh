# deploy/slurm/twain-common.sh: functions shared by twain.sbatch and
# twain-worker.sbatch (sourced, never run). Configuration is the environment
# (sbatch passes the submitting shell's environment to the job):
#   TWAIN_BIN             folder with twain-router/-prefill/-decode (default: the
#                         folder of twain-router on PATH, e.g. an unpacked bundle's bin/)
#   TWAIN_MODEL           checkpoint directory on a filesystem every node sees (required)
#   TWAIN_BACKEND         cuda (default), cpu or auto
#   TWAIN_PREFILL_TP/_EP  prefill parallelism (default 4/4: batch 1 with EP = TP)
#   TWAIN_DECODE_TP/_EP   decode parallelism (default 4/4: EP4 TP4)
#   TWAIN_PREFILL_WORKERS, TWAIN_DECODE_WORKERS
#                         workers to start (default: the component's GPUs / TP)
#   TWAIN_RANKS           spawn (default: one task per worker, the worker starts its
#                         TP ranks itself) or srun (one task per rank, identity from
#                         SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID; the worker is
#                         pinned to a node and its rank 0 listens on TWAIN_RENDEZVOUS =
#                         tcp://NODE:PORT, PORT = TWAIN_RENDEZVOUS_PORT (default 7500)
#                         + i for prefill worker i, + 100 + i for decode worker i)
#   TWAIN_API_PORT, TWAIN_WORKER_PORT, TWAIN_METRICS_PORT
#                         router client API, worker registration, first metrics port
#                         (defaults 7400, 7401, 9100; worker i of a pool on a node
#                         uses TWAIN_METRICS_PORT + 1 + i for prefill, + 101 + i for decode;
#                         0: every worker takes a free port and logs it; add_worker.sh's
#                         jobs use 0 so that they never collide with other workers)
#   TWAIN_LISTEN_HOST     address the router binds (default 0.0.0.0)
#   TWAIN_ROUTER_HOST     address workers and clients use for the router (default:
#                         the router node's hostname)
#   TWAIN_LOG_DIR         logs (default: $SLURM_SUBMIT_DIR/twain-logs-$SLURM_JOB_ID)
#   TWAIN_DRAIN_SECONDS   how long a drain may take before the hard stop (default 600);
#                         also the router's and decode workers' own --drain-timeout
#   TWAIN_METRICS_ADDR    address of every daemon's /metrics, /healthz, /livez
#                         (default 127.0.0.1; 0.0.0.0 for a Prometheus on another node)
#   TWAIN_WORKER_ARGS     extra arguments for every worker (e.g. --kv-blocks N)
#   TWAIN_KEYS_FILE       the link keys (CURVE) of the router and the workers: a file
#                         that only the job's user can read (mode 600), on a filesystem
#                         every node sees (default $HOME/.twain/link.keys, made with
#                         `twain keygen` when missing)
# Every environment started here keeps NVLink multicast off (NCCL_NVLS_ENABLE=0).
# shellcheck shell=bash

export NCCL_NVLS_ENABLE=0

tw_log() { echo "$(date -u +%Y-%m-%dT%H:%M:%SZ) twain-slurm[$SLURM_JOB_ID]: $*"; }
tw_die() { tw_log "error: $*"; exit 1; }

tw_setup() { # common checks and defaults
  if [ -z "${TWAIN_BIN:-}" ]; then
    local r; r=$(command -v twain-router || true)
    [ -n "$r" ] || tw_die "twain-router not on PATH: set TWAIN_BIN to the bundle's bin/ folder"
    TWAIN_BIN=$(dirname "$r")
  fi
  [ -x "$TWAIN_BIN/twain-router" ] || tw_die "no twain-router in TWAIN_BIN=$TWAIN_BIN"
  [ -n "${TWAIN_MODEL:-}" ] || tw_die "set TWAIN_MODEL to the checkpoint directory"
  [ -d "$TWAIN_MODEL" ] || tw_die "TWAIN_MODEL=$TWAIN_MODEL is not a directory on this node"
  TWAIN_BACKEND=${TWAIN_BACKEND:-cuda}
  TWAIN_PREFILL_TP=${TWAIN_PREFILL_TP:-4} TWAIN_PREFILL_EP=${TWAIN_PREFILL_EP:-4}
  TWAIN_DECODE_TP=${TWAIN_DECODE_TP:-4} TWAIN_DECODE_EP=${TWAIN_DECODE_EP:-4}
  TWAIN_RANKS=${TWAIN_RANKS:-spawn}
  TWAIN_API_PORT=${TWAIN_API_PORT:-7400} TWAIN_WORKER_PORT=${TWAIN_WORKER_PORT:-7401}
  TWAIN_METRICS_PORT=${TWAIN_METRICS_PORT:-9100}
  TWAIN_LOG_DIR=${TWAIN_LOG_DIR:-${SLURM_SUBMIT_DIR:-$PWD}/twain-logs-$SLURM_JOB_ID}
  TWAIN_DRAIN_SECONDS=${TWAIN_DRAIN_SECONDS:-600}
  mkdir -p "$TWAIN_LOG_DIR"
  tw_keys
  tw_pids=()
}

tw_keys() { # TWAIN_KEYS_FILE: exists, private, exported to every step
  TWAIN_KEYS_FILE=${TWAIN_KEYS_FILE:-$HOME/.twain/link.keys}
  if [ ! -e "$TWAIN_KEYS_FILE" ]; then
    (umask 077 && mkdir -p "$(dirname "$TWAIN_KEYS_FILE")")
    # keygen never overwrites: a job that loses the race uses the winner's file
    "$TWAIN_BIN/twain" keygen "$TWAIN_KEYS_FILE" >/dev/null 2>&1 || [ -e "$TWAIN_KEYS_FILE" ] ||
      tw_die "cannot make the link keys $TWAIN_KEYS_FILE with $TWAIN_BIN/twain keygen"
    tw_log "made the link keys $TWAIN_KEYS_FILE"
  fi
  if [ ! -f "$TWAIN_KEYS_FILE" ] || [ ! -O "$TWAIN_KEYS_FILE" ]; then
    tw_die "TWAIN_KEYS_FILE=$TWAIN_KEYS_FILE is not a regular file of this user"
  fi
  case $(stat -c %a "$TWAIN_KEYS_FILE") in
    600|400) ;;
    *) tw_die "TWAIN_KEYS_FILE=$TWAIN_KEYS_FILE must be readable by its owner only (chmod 600)" ;;
  esac
  export TWAIN_KEYS_FILE
}

# tw_launch_workers POOL COUNT TP EP NODELIST GPUS_PER_NODE [SRUN_OPTIONS...]:
# start COUNT workers of POOL (prefill|decode) as job steps in the background,
# each on one node of NODELIST with TP GPUs, registering with $TWAIN_ROUTER.
# Their srun pids go to tw_pids.
tw_launch_workers() {
  local pool=$1 count=$2 tp=$3 ep=$4 nodelist=$5 gpn=$6 i port_base par=() prog hosts=() per_node
  local ops=(--metrics-addr "${TWAIN_METRICS_ADDR:-127.0.0.1}")
  shift 6
  prog=$TWAIN_BIN/twain-$pool
  [ -x "$prog" ] || tw_die "no $prog"
  if ((TWAIN_METRICS_PORT == 0)); then port_base=0
  elif [ "$pool" = prefill ]; then port_base=$((TWAIN_METRICS_PORT + 1))
  else port_base=$((TWAIN_METRICS_PORT + 101)); fi
  # Parallelism flags only when a worker has more than one rank (issue 6).
  if ((tp > 1 || ep > 1)); then par=(--tp "$tp" --ep "$ep"); fi
  # decode finishes its sequences on SIGTERM for at most the drain time
  [ "$pool" = decode ] && ops+=(--drain-timeout "$TWAIN_DRAIN_SECONDS")
  if [ "$TWAIN_RANKS" = srun ]; then
    mapfile -t hosts < <(scontrol show hostnames "$nodelist")
    per_node=$((gpn / tp)); ((per_node >= 1)) || per_node=1
  fi
  for ((i = 0; i < count; i++)); do
    local name="$pool-$SLURM_JOB_ID-$i" layout=() rdv=""
    if [ "$TWAIN_RANKS" = srun ]; then
      local host=${hosts[$((i / per_node))]:-${hosts[0]}} off=0
      [ "$pool" = decode ] && off=100
      rdv=tcp://$host:$((${TWAIN_RENDEZVOUS_PORT:-7500} + off + i))
      layout=(--nodelist="$host" --ntasks="$tp" --gpus-per-task=1)
    else
      layout=(--ntasks=1 --gpus="$tp")
    fi
    # shellcheck disable=SC2086  # TWAIN_WORKER_ARGS is a list of words on purpose
    TWAIN_RENDEZVOUS=$rdv srun "$@" --nodes=1 "${layout[@]}" --exact --kill-on-bad-exit=1 --job-name="twain-$pool" \
      --output="$TWAIN_LOG_DIR/$name.log" \
      "$prog" --model "$TWAIN_MODEL" --router "$TWAIN_ROUTER" --backend "$TWAIN_BACKEND" \
      --name "$name" --metrics-port "$((port_base ? port_base + i : 0))" "${ops[@]}" "${par[@]}" ${TWAIN_WORKER_ARGS:-} &
    tw_pids+=($!)
    tw_log "started $pool worker $name (TP $tp EP $ep, ranks: $TWAIN_RANKS) -> $TWAIN_LOG_DIR/$name.log"
  done
}

# tw_drain: SIGTERM to the tasks of every worker step of this job (scancel
# without --batch signals the steps, not this shell): each worker leaves the
# registry and finishes what it runs. Wait for them at most TWAIN_DRAIN_SECONDS,
# then stop what is left. (Signalling srun itself would make srun abort the step
# and kill the tasks after KillWait, cutting their streams.)
tw_drain() {
  local p t0=$SECONDS
  tw_log "draining ${#tw_pids[@]} worker step(s)"
  scancel --signal=TERM "$SLURM_JOB_ID" 2>/dev/null || for p in "${tw_pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for p in "${tw_pids[@]}"; do
    while kill -0 "$p" 2>/dev/null && ((SECONDS - t0 < TWAIN_DRAIN_SECONDS)); do sleep 1; done
    kill -KILL "$p" 2>/dev/null || true
  done
  tw_log "workers stopped after $((SECONDS - t0)) s"
}

# tw_wait_port HOST PORT SECONDS: wait until a TCP port accepts connections.
tw_wait_port() {
  local host=$1 port=$2 limit=$3 t0=$SECONDS
  while ((SECONDS - t0 < limit)); do
    if (exec 3<>"/dev/tcp/$host/$port") 2>/dev/null; then return 0; fi
    sleep 1
  done
  return 1
}
