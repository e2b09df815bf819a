#!/usr/bin/env bash
# A real SLURM on this one machine, for the tests: munged, slurmctld and emulated slurmd nodes, no systemd.
#
#   tests/slurm/cluster.sh up      install Debian's slurmctld/slurmd/slurm-client/munge if missing (needs root and
#                                  apt), write a config, start the daemons, wait until the nodes are idle
#   tests/slurm/cluster.sh down    cancel what is still queued, stop the daemons this script started
#   tests/slurm/cluster.sh status  sinfo + squeue
#   tests/slurm/cluster.sh check   exit 0 if the cluster is up (slurmctld answers, the nodes are idle)
#   tests/slurm/cluster.sh env     the line to export so sbatch/srun/scontrol find this cluster
#
# Everything (config, pid files, spool, logs, job completions) lives under $STREAMBATCH_SLURM_DIR
# (default /tmp/streambatch-slurm); nothing is written to /etc/slurm. Clients find the cluster through
# SLURM_CONF=$STREAMBATCH_SLURM_DIR/slurm.conf (`eval "$(tests/slurm/cluster.sh env)"`).
# STREAMBATCH_SLURM_NODES (default 2) emulated nodes node1..nodeN run on this host (Debian's slurmd is built
# with MULTIPLE_SLURMD), each with CPUs = nproc, so multi-node templates run for real; their NodeAddr is
# 127.0.0.1. Idempotent: `up` on a running cluster only checks it. `up` is quiet unless something fails.
set -euo pipefail

STATE=${STREAMBATCH_SLURM_DIR:-/tmp/streambatch-slurm}
NODES=${STREAMBATCH_SLURM_NODES:-2}
CTLD_PORT=${STREAMBATCH_SLURM_PORT:-16817}
CONF=$STATE/slurm.conf
export SLURM_CONF=$CONF
LOG=$STATE/log

say() { echo "cluster.sh: $*" >&2; }
die() { say "$*"; exit 1; }

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

install() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
     && command -v munged >/dev/null; then
    return 0
  fi
  [ "$(id -u)" = 0 ] || die "SLURM is not installed and installing it needs root (apt-get install slurmctld slurmd slurm-client munge)"
  command -v apt-get >/dev/null || die "SLURM is not installed and there is no apt-get to install it"
  mkdir -p "$STATE"
  say "installing slurmctld slurmd slurm-client munge (Debian packages)"
  if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
         slurmctld slurmd slurm-client munge; } >"$STATE/apt.log" 2>&1; then
    tail -20 "$STATE/apt.log" >&2
    die "apt-get install failed (log: $STATE/apt.log)"
  fi
}

munge_ok() { munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; }

start_munge() {
  munge_ok && return 0  # a munged is already serving the default socket (ours or the machine's)
  [ "$(id -u)" = 0 ] || die "munged is not running and starting it needs root"
  local key=/etc/munge/munge.key
  if [ ! -s "$key" ]; then
    mkdir -p /etc/munge
    dd if=/dev/urandom of="$key" bs=1 count=1024 status=none
  fi
  chown munge:munge /etc/munge "$key"; chmod 700 /etc/munge; chmod 400 "$key"
  mkdir -p /run/munge /var/lib/munge /var/log/munge "$STATE/munge"
  chown munge:munge /run/munge /var/lib/munge /var/log/munge "$STATE/munge"
  chmod 755 /run/munge
  runuser -u munge -- munged --pid-file="$STATE/munge/munged.pid" --log-file="$STATE/munge/munged.log" \
    || die "munged did not start (log: $STATE/munge/munged.log)"
  touch "$STATE/munge/started-by-us"
  for _ in $(seq 50); do munge_ok && return 0; sleep 0.1; done
  die "munged does not answer (log: $STATE/munge/munged.log)"
}

write_conf() {
  local cpus
  cpus=$(nproc)
  mkdir -p "$STATE/ctld" "$LOG"
  {
    cat <<CONF
# written by tests/slurm/cluster.sh: a test cluster of $NODES emulated node(s) on $(hostname)
ClusterName=streambatch
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# a requeued job waits cred_expire seconds (default 120) before it may start again
AuthInfo=cred_expire=5
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool-%n
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd-%n.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$LOG/jobcomp.txt
SlurmdParameters=config_overrides
ReturnToService=2
MinJobAge=600
KillWait=10
InactiveLimit=0
Waittime=0
SchedulerParameters=sched_interval=2
CONF
    for i in $(seq "$NODES"); do
      echo "NodeName=node$i NodeHostname=localhost NodeAddr=127.0.0.1 Port=$((CTLD_PORT + 100 + i)) CPUs=$cpus State=UNKNOWN"
    done
    echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO"
  } >"$CONF.new"
  mv "$CONF.new" "$CONF"
}

nodes_idle() {
  local n
  n=$(sinfo -h -N -o '%N %t' 2>/dev/null | awk '$2 ~ /^(idle|mix|alloc)/' | wc -l)
  [ "$n" -ge "$NODES" ]
}

up() {
  install
  mkdir -p "$STATE"
  if alive "$STATE/slurmctld.pid" && nodes_idle; then
    return 0
  fi
  start_munge
  down_daemons
  write_conf
  slurmctld -c -f "$CONF" || die "slurmctld did not start (log: $LOG/slurmctld.log)"
  for _ in $(seq 100); do scontrol ping 2>/dev/null | grep -q UP && break; sleep 0.1; done
  scontrol ping 2>/dev/null | grep -q UP || { tail -20 "$LOG/slurmctld.log" >&2; die "slurmctld does not answer"; }
  for i in $(seq "$NODES"); do
    slurmd -f "$CONF" -N "node$i" || die "slurmd node$i did not start (log: $LOG/slurmd-node$i.log)"
  done
  for _ in $(seq 150); do nodes_idle && return 0; sleep 0.2; done
  sinfo -N >&2 || true
  tail -20 "$LOG/slurmctld.log" >&2 || true
  die "the nodes did not come up idle"
}

stop_pidfile() {
  local f=$1
  [ -f "$f" ] || return 0
  local pid
  pid=$(cat "$f")
  if kill -0 "$pid" 2>/dev/null; then
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
  fi
  rm -f "$f"
}

down_daemons() {
  local f
  for f in "$STATE"/slurmd-*.pid; do stop_pidfile "$f"; done
  stop_pidfile "$STATE/slurmctld.pid"
}

down() {
  if [ -f "$CONF" ] && alive "$STATE/slurmctld.pid"; then
    local jobs
    jobs=$(squeue -h -o %i 2>/dev/null || true)
    if [ -n "$jobs" ]; then
      # shellcheck disable=SC2086
      scancel $jobs 2>/dev/null || true
      for _ in $(seq 100); do [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break; sleep 0.1; done
    fi
  fi
  down_daemons
  if [ -f "$STATE/munge/started-by-us" ]; then
    stop_pidfile "$STATE/munge/munged.pid"
    rm -f "$STATE/munge/started-by-us"
  fi
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  status) sinfo -N; squeue ;;
  check) alive "$STATE/slurmctld.pid" && nodes_idle ;;
  env) echo "export SLURM_CONF=$CONF" ;;
  *) echo "usage: $0 up|down|status|check|env" >&2; exit 2 ;;
esac
