#!/usr/bin/env bash
# A one-node Slurm cluster on this machine, for tests/test_slurm_e2e.py and for trying
# `hvdgc-launch --sbatch --submit` by hand. Root only; no systemd needed (the daemons are
# started directly, so it works in a fresh container).
#
# Idempotent: when munged, slurmctld and slurmd already run with this configuration and
# the node is idle, it returns in seconds. Runtime files live under /etc/slurm,
# /var/lib/slurm, /var/spool/slurmd, /var/log/slurm and /run, never in the repository.
#
# On failure it prints why (the daemons' log tails) and exits non-zero.
set -euo pipefail

NODE="$(hostname -s)"
CPUS="$(nproc)"
CONF=/etc/slurm/slurm.conf
LOGDIR=/var/log/slurm
STATEDIR=/var/lib/slurm/slurmctld
SPOOLDIR=/var/spool/slurmd
WAIT_S="${HVDGC_SLURM_WAIT:-60}"
T0=$(date +%s)

log() { printf '[slurm_up %3ss] %s\n' "$(( $(date +%s) - T0 ))" "$*"; }
die() {
  printf '[slurm_up] ERROR: %s\n' "$*" >&2
  for f in /var/log/munge/munged.log "$LOGDIR/slurmctld.log" "$LOGDIR/slurmd.log"; do
    [ -r "$f" ] && { printf -- '--- last lines of %s ---\n' "$f" >&2; tail -15 "$f" >&2; }
  done
  exit 1
}

[ "$(id -u)" -eq 0 ] || die "run as root (it installs packages and starts system daemons): sudo bash $0"

# ---------------------------------------------------------------- packages
ensure_packages() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
      && command -v munged >/dev/null; then
    return
  fi
  log "installing slurm-wlm and munge from Debian"
  # The package scripts try to start services; without systemd they only warn.
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/tmp/hvdgc-slurm-apt.log 2>&1 \
    || { tail -20 /tmp/hvdgc-slurm-apt.log >&2; die "apt-get install slurm-wlm munge failed (try: apt-get update)"; }
}

# ---------------------------------------------------------------- munge
munge_ok() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }

ensure_munge() {
  if munge_ok; then return; fi
  install -d -o munge -g munge -m 0700 /etc/munge /var/lib/munge /var/log/munge
  install -d -o munge -g munge -m 0755 /run/munge
  if [ ! -s /etc/munge/munge.key ]; then
    log "creating munge key"
    mungekey -c -f -k /etc/munge/munge.key
  fi
  chown munge:munge /etc/munge/munge.key
  chmod 0400 /etc/munge/munge.key
  log "starting munged"
  runuser -u munge -- /usr/sbin/munged --force || die "munged did not start"
  for _ in $(seq 20); do munge_ok && return; sleep 0.5; done
  die "munged runs but 'munge -n | unmunge' fails"
}

# ---------------------------------------------------------------- slurm.conf
render_conf() {
  cat <<EOF
# Written by hvd-gradcomp scripts/slurm_up.sh: a one-node test cluster.
ClusterName=hvdgc
SlurmctldHost=$NODE
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
StateSaveLocation=$STATEDIR
SlurmdSpoolDir=$SPOOLDIR
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=$LOGDIR/slurmctld.log
SlurmdLogFile=$LOGDIR/slurmd.log
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
MinJobAge=300
KillWait=5
NodeName=$NODE CPUs=$CPUS State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
}

# Prints "changed" when the file on disk had to be (re)written.
write_conf() {
  install -d -m 0755 /etc/slurm "$LOGDIR" /var/lib/slurm "$STATEDIR" "$SPOOLDIR"
  local want; want="$(render_conf)"
  if [ -f "$CONF" ] && [ "$(cat "$CONF")" = "$want" ]; then return; fi
  printf '%s\n' "$want" >"$CONF"
  echo changed
}

# ---------------------------------------------------------------- daemons
running() {  # running NAME: the pid in /run/NAME.pid is alive
  local pid; pid="$(cat "/run/$1.pid" 2>/dev/null || true)"
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null
}

stop() {  # stop NAME: only the daemon whose pid file we wrote
  running "$1" || return 0
  log "stopping $1 (configuration changed)"
  kill "$(cat "/run/$1.pid")"
  for _ in $(seq 20); do running "$1" || return 0; sleep 0.5; done
  die "$1 did not stop"
}

node_state() { sinfo -h -n "$NODE" -o '%t' 2>/dev/null | head -1; }

healthy() {
  running slurmctld && running slurmd && case "$(node_state)" in idle|mix|alloc|comp) true ;; *) false ;; esac
}

start_daemons() {
  if ! running slurmctld; then
    log "starting slurmctld"
    /usr/sbin/slurmctld -i || die "slurmctld did not start"
  fi
  if ! running slurmd; then
    log "starting slurmd"
    /usr/sbin/slurmd || die "slurmd did not start"
  fi
}

wait_idle() {
  local state=""
  for _ in $(seq $(( WAIT_S * 2 ))); do
    state="$(node_state)"
    case "$state" in
      idle|mix|alloc|comp) log "node $NODE is $state ($CPUS CPUs); sbatch and srun are ready"; return ;;
      down*|drain*|fail*) scontrol update NodeName="$NODE" State=RESUME >/dev/null 2>&1 || true ;;
    esac
    running slurmctld || die "slurmctld exited"
    running slurmd || die "slurmd exited"
    sleep 0.5
  done
  die "node $NODE not idle after ${WAIT_S}s (state: '${state:-unknown}'); see the logs below"
}

main() {
  ensure_packages
  ensure_munge
  local changed; changed="$(write_conf)"
  if [ -z "$changed" ] && healthy; then
    log "already running: node $NODE is $(node_state)"
    return
  fi
  if [ -n "$changed" ]; then stop slurmd; stop slurmctld; fi
  start_daemons
  wait_idle
}

main "$@"
