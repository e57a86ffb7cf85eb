#!/usr/bin/env bash
# slurm_cluster.sh start|stop DIR: a private Slurm cluster on this one machine
# (localhost) from Debian's slurm-wlm and munge, entirely inside DIR (its own
# munge key and socket, slurm.conf, spool, state, logs, free ports), so it
# touches nothing of the machine's own /etc/slurm or /etc/munge.
# One host, two Slurm nodes (twain-a, twain-b: two slurmd daemons on
# 127.0.0.1 with their own ports): Slurm never places two components of one
# heterogeneous job on the same node (its backfill scheduler, the only one
# that starts het jobs, reserves whole nodes), so the production script's
# prefill and decode components need a node each. Each node advertises 256 CPUs
# and 16 GPUs (room for the service's 8 and added workers) backed by placeholder files (no task plugin opens them): enough
# for the sbatch script's GPU requests; the CPU backend does the work.
# `start` prints `export SLURM_CONF=...` for the caller to eval.
set -euo pipefail
cmd=$1 dir=$2
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'; }

stop_pidfile() { # FILE: TERM the process it names, then KILL after 10 s
  local f=$1 pid i
  [ -f "$f" ] || return 0
  pid=$(cat "$f")
  if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < 100; i++)); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$f"
}

case $cmd in
start)
  for p in munged slurmctld slurmd; do
    command -v "$p" >/dev/null || [ -x "/usr/sbin/$p" ] || { echo "slurm_cluster: $p not installed" >&2; exit 77; }
  done
  export PATH=$PATH:/usr/sbin
  host=$(hostname -s)
  mkdir -p "$dir/munge" "$dir/state" "$dir/spool" "$dir/log"
  chmod 755 "$dir/munge"
  dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none
  chmod 400 "$dir/munge/munge.key"
  munged --force --socket="$dir/munge/munge.sock" --key-file="$dir/munge/munge.key" \
    --pid-file="$dir/munge/munged.pid" --log-file="$dir/log/munged.log" --seed-file="$dir/munge/seed"
  ctld_port=$(free_port) d_port=$(free_port) d2_port=$(free_port)
  cat > "$dir/slurm.conf" <<EOF
ClusterName=twaintest
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$dir/munge/munge.sock
CredType=cred/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,bf_resolution=60,sched_interval=2
DebugFlags=Backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
SlurmdParameters=config_overrides
ReturnToService=2
MinJobAge=5
KillWait=5
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=30
NodeName=twain-a NodeAddr=127.0.0.1 NodeHostname=$host Port=$d_port CPUs=256 Boards=1 SocketsPerBoard=1 CoresPerSocket=256 ThreadsPerCore=1 RealMemory=4000 Gres=gpu:16 State=UNKNOWN
NodeName=twain-b NodeAddr=127.0.0.1 NodeHostname=$host Port=$d2_port CPUs=256 Boards=1 SocketsPerBoard=1 CoresPerSocket=256 ThreadsPerCore=1 RealMemory=4000 Gres=gpu:16 State=UNKNOWN
PartitionName=twain Nodes=twain-a,twain-b Default=YES MaxTime=INFINITE State=UP
EOF
  # Slurm drops GPUs without device files: give it 8 placeholder files (no
  # task/cgroup plugin constrains devices here, so nothing opens them).
  mkdir -p "$dir/dev"
  for g in $(seq 0 31); do : > "$dir/dev/gpu$g"; done
  printf 'AutoDetect=off\nNodeName=twain-a Name=gpu File=%s/dev/gpu[0-15]\nNodeName=twain-b Name=gpu File=%s/dev/gpu[16-31]\n' "$dir" "$dir" > "$dir/gres.conf"
  touch "$dir/cgroup.conf"
  export SLURM_CONF=$dir/slurm.conf
  slurmctld -f "$dir/slurm.conf" -i
  mkdir -p "$dir/spool/twain-a" "$dir/spool/twain-b"
  slurmd -f "$dir/slurm.conf" -N twain-a
  slurmd -f "$dir/slurm.conf" -N twain-b
  ok=0
  for ((i = 0; i < 300; i++)); do
    state=$(sinfo -h -N -o %T 2>/dev/null | sort -u | tr '\n' ' ' || true)
    case $state in "idle ") ok=1; break ;; esac
    sleep 0.1
  done
  if ((ok == 0)); then
    echo "slurm_cluster: node not idle after 30 s (state '$state'); logs:" >&2
    tail -n 20 "$dir"/log/*.log >&2 || true
    exit 1
  fi
  echo "export SLURM_CONF=$dir/slurm.conf"
  ;;
stop)
  for f in "$dir"/slurmd-*.pid; do stop_pidfile "$f"; done
  stop_pidfile "$dir/slurmctld.pid"
  stop_pidfile "$dir/munge/munged.pid"
  ;;
*) echo "usage: slurm_cluster.sh start|stop DIR" >&2; exit 2 ;;
esac
