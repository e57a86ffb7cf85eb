#!/usr/bin/env bash
# deploy/slurm/add_worker.sh: add workers of one pool to a running twain service
# as a separate Slurm job (so they can be removed on their own later).
#   add_worker.sh --service JOBID --pool prefill|decode [--nodes N] [--gpus-per-node G]
#                 [--workers W] [--router tcp://HOST:PORT] [-- more sbatch options]
# The router endpoint comes from the service job's Comment (twain.sbatch sets
# it) unless --router is given. Prints the new job's id. The environment
# (TWAIN_BIN, TWAIN_MODEL, TWAIN_*_TP ...) is passed to the job as for twain.sbatch;
# its workers take free metrics ports (logged) unless TWAIN_WORKER_METRICS_PORT is set.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
service="" pool="" router="" sb=()
while (($#)); do
  case $1 in
    --service) service=$2; shift 2 ;;
    --pool) pool=$2; shift 2 ;;
    --router) router=$2; shift 2 ;;
    --nodes) sb+=(--nodes="$2"); shift 2 ;;
    --gpus-per-node) sb+=(--gpus-per-node="$2"); shift 2 ;;
    --workers) export TWAIN_WORKERS=$2; shift 2 ;;
    --) shift; sb+=("$@"); break ;;
    -h|--help) sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "add_worker.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
case $pool in prefill|decode) ;; *) echo "add_worker.sh: --pool prefill|decode is required" >&2; exit 2 ;; esac
if [ -z "$router" ]; then
  [ -n "$service" ] || { echo "add_worker.sh: give --service JOBID or --router ENDPOINT" >&2; exit 2; }
  comment=$(squeue -h -j "$service" -o %k 2>/dev/null | head -1)
  router=$(sed -n 's/.*router=\([^ ]*\).*/\1/p' <<<"$comment")
  [ -n "$router" ] || { echo "add_worker.sh: job $service has no router in its comment ('$comment'): is it a running twain.sbatch job?" >&2; exit 1; }
fi
export TWAIN_POOL=$pool TWAIN_ROUTER=$router TWAIN_SLURM_DIR=$here TWAIN_METRICS_PORT=${TWAIN_WORKER_METRICS_PORT:-0}
sbatch --parsable --job-name="twain-$pool" ${service:+--comment="twain-worker service=$service pool=$pool"} \
  "${sb[@]}" "$here/twain-worker.sbatch"
