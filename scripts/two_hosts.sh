#!/usr/bin/env bash
# Two "hosts" on this machine for multi-node tests: network namespaces hvdgc-a and hvdgc-b,
# joined by a veth pair rate-limited with tc tbf (1 Gbit/s per direction by default), each
# with its own sshd on port 22 and its own host name.
#
#   bash scripts/two_hosts.sh up [--rate 1gbit] [--no-slurm]  # idempotent; also starts a two-node Slurm
#   bash scripts/two_hosts.sh exec hvdgc-a CMD  # run CMD "on" host hvdgc-a
#   bash scripts/two_hosts.sh status
#   bash scripts/two_hosts.sh down             # kills every process in both namespaces
#
# Each host: a network namespace (interface hvdgc0 with a private address that exists
# only inside these namespaces, loopback up), a UTS namespace per process tree giving
# `hostname` = the namespace name, and /etc/netns/NAME/{hosts,ssh,slurm}, which
# `ip netns exec` mounts over /etc/hosts, /etc/ssh and /etc/slurm for that namespace only:
# the machine's own /etc/hosts, /etc/ssh and /etc/slurm are never touched. ssh between the
# hosts uses a key pair made at set-up (authorised for root in both) and host keys made at
# set-up (pinned in the namespaces' ssh_known_hosts), so no prompt and no
# StrictHostKeyChecking=no. The file system is shared, so the same Python environment
# works on both hosts.
#
# --rate sets the link's tc rate per direction (default 1gbit; `up` again with another rate
# changes it in place); --no-slurm skips the two-node Slurm. Root only. On failure it prints
# why and exits non-zero.
set -euo pipefail

HOSTS=(hvdgc-a hvdgc-b)
ADDRS=(10.99.14.1 10.99.14.2)   # private, only ever inside the two namespaces
IFACE=hvdgc0                    # same name on both hosts, like eth0 on a real cluster
RATE=1gbit
SLURM=1
STATE=/var/lib/hvdgc-two-hosts  # client key, authorized_keys
RUNDIR=/run/hvdgc-two-hosts     # pid files, logs
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
T0=$(date +%s)

log() { printf '[two_hosts %3ss] %s\n' "$(( $(date +%s) - T0 ))" "$*"; }
die() {
  printf '[two_hosts] ERROR: %s\n' "$*" >&2
  for f in "$RUNDIR"/*.log; do
    [ -r "$f" ] && { printf -- '--- last lines of %s ---\n' "$f" >&2; tail -10 "$f" >&2; }
  done
  exit 1
}
usage() { sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }

# Run a command as host NAME: its network namespace (and /etc/netns/NAME mounts) plus a
# fresh UTS namespace named after it, so that `hostname` says NAME. `ip netns exec`
# remounts /sys for the namespace, which hides /sys/fs/cgroup; the machine's cgroup
# mounts are made again inside (slurmd refuses to start without them).
on() {
  local name="$1"; shift
  local cgroups; cgroups="$(awk '$2 ~ "^/sys/fs/cgroup" {print $3, $4, $2}' /proc/self/mounts)"
  ip netns exec "$name" unshare --uts /bin/sh -c '
    printf "%s\n" "$1" | while read -r type opts dir; do
      [ -n "$type" ] && mkdir -p "$dir" 2>/dev/null; [ -n "$type" ] && mount -t "$type" -o "$opts" "$type" "$dir" 2>/dev/null
    done
    hostname "$0" && shift && exec "$@"' "$name" "$cgroups" "$@"
}

ensure_packages() {
  local missing=()
  command -v sshd >/dev/null || [ -x /usr/sbin/sshd ] || missing+=(openssh-server)
  command -v ssh >/dev/null || missing+=(openssh-client)
  command -v tc >/dev/null || missing+=(iproute2)
  command -v unshare >/dev/null || missing+=(util-linux)
  [ ${#missing[@]} -eq 0 ] && return
  log "installing ${missing[*]} from Debian"
  # Without systemd or a runlevel the package scripts do not start sshd in the machine's
  # own namespace; only the namespaced ones below run.
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"; } \
    >/tmp/hvdgc-two-hosts-apt.log 2>&1 \
    || { tail -20 /tmp/hvdgc-two-hosts-apt.log >&2; die "apt-get install ${missing[*]} failed"; }
}

ensure_keys() {
  install -d -m 0700 "$STATE"
  [ -s "$STATE/id_ed25519" ] || ssh-keygen -q -t ed25519 -N '' -C "root@hvdgc-two-hosts" -f "$STATE/id_ed25519"
  # root's own keys too, when it has some, so plain `ssh hvdgc-b` works as root would expect
  cat "$STATE/id_ed25519.pub" /root/.ssh/id_*.pub 2>/dev/null >"$STATE/authorized_keys" || true
  chmod 0600 "$STATE/authorized_keys"
}

write_etc() {  # write_etc I: /etc/netns/NAME/{hosts,ssh/} for host I
  local name="${HOSTS[$1]}" addr="${ADDRS[$1]}" dir="/etc/netns/${HOSTS[$1]}"
  install -d -m 0755 "$dir" "$dir/ssh"
  {
    echo "127.0.0.1 localhost"
    for i in "${!HOSTS[@]}"; do echo "${ADDRS[$i]} ${HOSTS[$i]}"; done
  } >"$dir/hosts"
  [ -s "$dir/ssh/ssh_host_ed25519_key" ] || ssh-keygen -q -t ed25519 -N '' -C "$name" -f "$dir/ssh/ssh_host_ed25519_key"
  cat >"$dir/ssh/sshd_config" <<EOF
# Written by hvd-gradcomp scripts/two_hosts.sh for host $name.
Port 22
ListenAddress $addr
HostKey /etc/ssh/ssh_host_ed25519_key
PidFile $RUNDIR/sshd-$name.pid
PermitRootLogin prohibit-password
PubkeyAuthentication yes
AuthorizedKeysFile $STATE/authorized_keys
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
PrintMotd no
ClientAliveInterval 5
ClientAliveCountMax 3
MaxStartups 100:30:200
LogLevel ERROR
EOF
  cat >"$dir/ssh/ssh_config" <<EOF
# Written by hvd-gradcomp scripts/two_hosts.sh: ssh between the two test hosts.
Host *
  IdentityFile $STATE/id_ed25519
  IdentitiesOnly yes
  UserKnownHostsFile /dev/null
  GlobalKnownHostsFile /etc/ssh/ssh_known_hosts
  StrictHostKeyChecking yes
  BatchMode yes
  ConnectTimeout 10
  LogLevel ERROR
EOF
}

write_known_hosts() {  # every host's key, pinned on every host
  local known="" i
  for i in "${!HOSTS[@]}"; do
    known+="${HOSTS[$i]},${ADDRS[$i]} $(cut -d' ' -f1,2 "/etc/netns/${HOSTS[$i]}/ssh/ssh_host_ed25519_key.pub")"$'\n'
  done
  for name in "${HOSTS[@]}"; do printf '%s' "$known" >"/etc/netns/$name/ssh/ssh_known_hosts"; done
}

ensure_network() {
  local i
  for i in "${!HOSTS[@]}"; do
    ip netns list | grep -qw "^${HOSTS[$i]}" || ip netns add "${HOSTS[$i]}"
  done
  if ! ip netns exec "${HOSTS[0]}" ip link show "$IFACE" >/dev/null 2>&1; then
    # A stale half (the peer namespace was deleted) would block the name.
    ip netns exec "${HOSTS[1]}" ip link del "$IFACE" 2>/dev/null || true
    ip link add "$IFACE" netns "${HOSTS[0]}" type veth peer name "$IFACE" netns "${HOSTS[1]}"
  fi
  for i in "${!HOSTS[@]}"; do
    local ns="${HOSTS[$i]}"
    ip netns exec "$ns" ip link set lo up
    ip netns exec "$ns" ip addr replace "${ADDRS[$i]}/24" dev "$IFACE"
    ip netns exec "$ns" ip link set "$IFACE" up
    # Each end shapes what it sends, so both directions are limited.
    ip netns exec "$ns" tc qdisc replace dev "$IFACE" root tbf rate "$RATE" burst 256kb latency 50ms
  done
}

sshd_running() { local pid; pid="$(cat "$RUNDIR/sshd-$1.pid" 2>/dev/null || true)"; [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; }

ensure_sshd() {
  install -d -m 0755 "$RUNDIR" /run/sshd
  local name
  for name in "${HOSTS[@]}"; do
    sshd_running "$name" && continue
    log "starting sshd on $name"
    on "$name" /usr/sbin/sshd -E "$RUNDIR/sshd-$name.log" || die "sshd on $name did not start"
  done
}

check_ssh() {  # every host reaches every host by name, without a prompt
  local from to got
  for from in "${HOSTS[@]}"; do
    for to in "${HOSTS[@]}"; do
      for _ in $(seq 20); do
        got="$(on "$from" ssh "$to" hostname 2>"$RUNDIR/ssh-check.log" || true)"
        [ "$got" = "$to" ] && break
        sleep 0.5
      done
      [ "$got" = "$to" ] || die "ssh $from -> $to failed: $(cat "$RUNDIR/ssh-check.log")"
    done
  done
}

up() {
  [ "$(id -u)" -eq 0 ] || die "run as root (it creates network namespaces and starts sshd): sudo bash $0 up"
  ensure_packages
  ensure_keys
  local i
  for i in "${!HOSTS[@]}"; do write_etc "$i"; done
  write_known_hosts
  ensure_network
  ensure_sshd
  check_ssh
  log "hosts ${HOSTS[*]} up (${ADDRS[*]} on $IFACE, $RATE per direction); ssh works both ways"
  if [ "$SLURM" = 1 ]; then
    bash "$HERE/slurm_up.sh" --two-hosts
  fi
}

down() {
  local name pids
  for name in "${HOSTS[@]}"; do
    ip netns list | grep -qw "^$name" || continue
    pids="$(ip netns pids "$name" | tr '\n' ' ')"
    if [ -n "${pids// }" ]; then
      log "stopping processes on $name: $pids"
      kill $pids 2>/dev/null || true
      for _ in $(seq 20); do [ -z "$(ip netns pids "$name")" ] && break; sleep 0.25; done
      pids="$(ip netns pids "$name" | tr '\n' ' ')"
      [ -n "${pids// }" ] && kill -9 $pids 2>/dev/null || true
    fi
    ip netns del "$name"
  done
  for name in "${HOSTS[@]}"; do rm -rf "/etc/netns/$name"; done
  rmdir /etc/netns 2>/dev/null || true
  rm -rf "$RUNDIR" "$STATE" /var/spool/hvdgc-two-hosts /var/lib/hvdgc-two-hosts-slurm /var/log/hvdgc-two-hosts
  log "down"
}

status() {
  local name
  for name in "${HOSTS[@]}"; do
    if ip netns list | grep -qw "^$name"; then
      echo "$name: up, sshd $(sshd_running "$name" && echo running || echo stopped), processes: $(ip netns pids "$name" | wc -l)"
    else
      echo "$name: down"
    fi
  done
}

case "${1:-}" in
  up)
    shift
    while [ $# -gt 0 ]; do
      case "$1" in
        --rate) [ $# -ge 2 ] || usage; RATE="$2"; shift 2 ;;
        --no-slurm) SLURM=0; shift ;;
        *) usage ;;
      esac
    done
    up ;;
  down) [ "$(id -u)" -eq 0 ] || die "run as root"; down ;;
  status) status ;;
  exec) shift; [ $# -ge 2 ] || usage; on "$@" ;;
  *) usage ;;
esac
