#!/usr/bin/env bash
# deploy/slurm/remove_worker.sh: take workers out of a running twain service
# without dropping streams.
#   remove_worker.sh JOBID              a job from add_worker.sh: drain all its workers
#   remove_worker.sh JOBID.STEPID       one worker step of the service job (see
#                                       `squeue -s -j JOBID`): drain that worker only
#   [--timeout SECONDS]                 hard stop after this long (default 660)
# Draining: SIGTERM makes each worker leave the router's registry (no new work)
# and finish what it runs; the router keeps serving with the others.
set -euo pipefail
target="" timeout=660
while (($#)); do
  case $1 in
    --timeout) timeout=$2; shift 2 ;;
    -h|--help) sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) target=$1; shift ;;
  esac
done
[ -n "$target" ] || { echo "usage: remove_worker.sh JOBID|JOBID.STEPID [--timeout S]" >&2; exit 2; }
t0=$SECONDS
if [[ $target == *.* ]]; then
  scancel --signal=TERM "$target"
  while squeue -h -s -j "${target%%.*}" -o %i 2>/dev/null | grep -qx "$target"; do
    ((SECONDS - t0 < timeout)) || { echo "remove_worker.sh: $target still running after $timeout s: cancelling" >&2; scancel "$target"; break; }
    sleep 1
  done
else
  # The worker job's batch shell drains its steps (twain-worker.sbatch traps TERM).
  scancel --signal=TERM --batch "$target"
  while [ -n "$(squeue -h -j "$target" -o %i 2>/dev/null)" ]; do
    ((SECONDS - t0 < timeout)) || { echo "remove_worker.sh: job $target still running after $timeout s: cancelling" >&2; scancel "$target"; break; }
    sleep 1
  done
fi
echo "remove_worker.sh: $target removed after $((SECONDS - t0)) s"
