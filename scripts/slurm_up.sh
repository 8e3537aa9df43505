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
#
# `slurm_up.sh --two-hosts` (run by scripts/two_hosts.sh up) starts a second, separate
# cluster "hvdgc2" on the two test hosts: slurmctld and `slurmd -N hvdgc-a` in namespace
# hvdgc-a, `slurmd -N hvdgc-b` in hvdgc-b. Its slurm.conf lives in /etc/netns/NAME/slurm/,
# which `ip netns exec` mounts over /etc/slurm, so sbatch/srun/sinfo run on those hosts see
# it and the one-node cluster is left alone. scripts/two_hosts.sh down stops it.
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

# ---------------------------------------------------------------- two hosts
TWO_HOSTS=(hvdgc-a hvdgc-b)
TWO_ADDRS=(10.99.14.1 10.99.14.2)  # scripts/two_hosts.sh's addresses
TWO_RUN=/run/hvdgc-two-hosts
TWO_LOG=/var/log/hvdgc-two-hosts
TWO_STATE=/var/lib/hvdgc-two-hosts-slurm
TWO_SPOOL=/var/spool/hvdgc-two-hosts
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

on() { bash "$HERE/two_hosts.sh" exec "$@"; }

render_two_conf() {
  cat <<EOF
# Written by hvd-gradcomp scripts/slurm_up.sh --two-hosts: a two-node test cluster.
ClusterName=hvdgc2
SlurmctldHost=${TWO_HOSTS[0]}(${TWO_ADDRS[0]})
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
StateSaveLocation=$TWO_STATE
SlurmdSpoolDir=$TWO_SPOOL/%n
SlurmctldPidFile=$TWO_RUN/slurmctld.pid
SlurmdPidFile=$TWO_RUN/slurmd-%n.pid
SlurmctldLogFile=$TWO_LOG/slurmctld.log
SlurmdLogFile=$TWO_LOG/slurmd-%n.log
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
MinJobAge=300
KillWait=5
NodeName=${TWO_HOSTS[0]} NodeAddr=${TWO_ADDRS[0]} CPUs=$CPUS State=UNKNOWN
NodeName=${TWO_HOSTS[1]} NodeAddr=${TWO_ADDRS[1]} CPUs=$CPUS State=UNKNOWN
PartitionName=two Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
}

pid_alive() { local pid; pid="$(cat "$1" 2>/dev/null || true)"; [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; }

two_states() { on "${TWO_HOSTS[0]}" sinfo -h -N -o '%N %t' 2>/dev/null | sort -u; }

two_die() {
  printf '[slurm_up] ERROR: %s\n' "$*" >&2
  for f in "$TWO_LOG"/*.log; do
    [ -r "$f" ] && { printf -- '--- last lines of %s ---\n' "$f" >&2; tail -15 "$f" >&2; }
  done
  exit 1
}

two_hosts_main() {
  ensure_packages
  ensure_munge
  local name f mpi changed="" want
  want="$(render_two_conf)"
  install -d -m 0755 "$TWO_RUN" "$TWO_LOG" "$TWO_STATE"
  for name in "${TWO_HOSTS[@]}"; do
    [ -d "/etc/netns/$name" ] || two_die "host $name is not up; run: bash $HERE/two_hosts.sh up"
    install -d -m 0755 "/etc/netns/$name/slurm" "$TWO_SPOOL/$name" "$TWO_SPOOL/$name/pmix"
    # The hosts share /tmp, where PMIx would put both nodes' step directories under one
    # name ("Cannot create directory /tmp/spmix_appdir_0_2.0: File exists"): one per node.
    mpi="PMIxCliTmpDirBase=$TWO_SPOOL/$name/pmix"
    if [ "$(cat "/etc/netns/$name/slurm/slurm.conf" 2>/dev/null)" != "$want" ] \
        || [ "$(cat "/etc/netns/$name/slurm/mpi.conf" 2>/dev/null)" != "$mpi" ]; then
      printf '%s\n' "$want" >"/etc/netns/$name/slurm/slurm.conf"
      printf '%s\n' "$mpi" >"/etc/netns/$name/slurm/mpi.conf"
      changed=1
    fi
  done
  if [ -n "$changed" ]; then  # the daemons read their configuration at start only
    for f in "$TWO_RUN"/slurmd-*.pid "$TWO_RUN/slurmctld.pid"; do
      if pid_alive "$f"; then kill "$(cat "$f")"; fi
    done
    sleep 1
  fi
  if ! pid_alive "$TWO_RUN/slurmctld.pid"; then
    log "starting slurmctld on ${TWO_HOSTS[0]}"
    on "${TWO_HOSTS[0]}" /usr/sbin/slurmctld -i || two_die "slurmctld on ${TWO_HOSTS[0]} did not start"
  fi
  for name in "${TWO_HOSTS[@]}"; do
    pid_alive "$TWO_RUN/slurmd-$name.pid" && continue
    log "starting slurmd -N $name on $name"
    on "$name" /usr/sbin/slurmd -N "$name" || two_die "slurmd on $name did not start"
  done
  local states=""
  for _ in $(seq $(( WAIT_S * 2 ))); do
    states="$(two_states)"
    if [ "$(grep -cE ' (idle|mix|alloc|comp)$' <<<"$states")" -eq ${#TWO_HOSTS[@]} ]; then
      log "two-node cluster hvdgc2 ready: $(tr '\n' ' ' <<<"$states")"
      return
    fi
    if grep -qE ' (down|drain|fail)' <<<"$states"; then
      on "${TWO_HOSTS[0]}" scontrol update NodeName="${TWO_HOSTS[0]},${TWO_HOSTS[1]}" State=RESUME >/dev/null 2>&1 || true
    fi
    sleep 0.5
  done
  two_die "two-node cluster not ready after ${WAIT_S}s (states: $(tr '\n' ' ' <<<"$states"))"
}

if [ "${1:-}" = "--two-hosts" ]; then
  two_hosts_main
else
  main "$@"
fi
