"""Watch a running job: relay its output, name the host behind a failure, end it when a host is lost.

horovodrun reports a failure by process number only (``Process name: 1``), and when the
link to a host is cut its ranks wait for Gloo's 30 s timeout and then blame the *surviving*
rank. :class:`JobWatch` therefore

- relays the job's stdout and stderr unchanged while reading them for the failure lines of
  horovodrun and Open MPI, so the final message can say which rank on which host failed;
- probes each remote host's ssh port every ``interval`` seconds and, when one that answered
  before has not answered for ``timeout`` seconds, says so and ends the job (``on_lost``).

Example::

    >>> watch = JobWatch(rank_hosts=["nodeA", "nodeB"])
    >>> watch.scan(b"Process name: 1")
    >>> watch.summary(1)
    'hvdgc-launch: the job failed (exit code 1); first failure reported: rank 1 on host nodeB'
"""
from __future__ import annotations

import os
import re
import socket
import threading
import time
from typing import Callable, List, Optional, Sequence

# (pattern, what its groups are): horovodrun's and Open MPI's lines naming a failed rank or node.
_FAILURES = [
    (re.compile(rb"^Process name: (\d+)\s*$"), "rank"),  # horovodrun: the first process that failed
    (re.compile(rb"process rank (\d+) with PID \d+ on node (\S+) exited"), "rank node"),  # mpirun
    (re.compile(rb"Remote daemon: \S+ on node (\S+)"), "node"),  # mpirun lost the daemon of a node
]


def rank_hosts(hosts: Sequence[tuple], np: int) -> List[str]:
    """The host of each rank when ranks fill the hosts' slots in order (horovodrun, mpirun -map-by slot).

    >>> rank_hosts([("a", 2), ("b", 1)], 3)
    ['a', 'a', 'b']
    """
    return [name for name, slots in hosts for _ in range(slots)][:np]


def is_local(host: str) -> bool:
    """Whether ``host`` names this machine (or this network namespace): its address binds here."""
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None, socket.AF_INET)}
    except OSError:
        return False  # unresolvable: the launcher will say so; not ours to probe
    for address in addresses:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
                probe.bind((address, 0))
            return True
        except OSError:
            continue
    return False


def answers(host: str, port: int, timeout: float = 3.0) -> bool:
    """Whether a TCP connection to ``host:port`` opens within ``timeout`` seconds."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


class JobWatch:
    """Relay a job's output, remember the first failure it reports, and watch the remote hosts."""

    def __init__(self, rank_hosts: Sequence[str], remote: Sequence[str] = (), port: int = 22,
                 timeout: float = 0.0, interval: float = 2.0) -> None:
        self.rank_hosts = list(rank_hosts)
        self.remote = list(remote)
        self.port = port
        self.timeout = timeout
        self.interval = interval
        self.failure: Optional[str] = None
        self.lost: Optional[str] = None
        self._stop = threading.Event()
        self._threads: List[threading.Thread] = []

    # ------------------------------------------------------------ output
    def scan(self, line: bytes) -> None:
        """Remember the first failure a line reports (rank and host where known)."""
        if self.failure is not None:
            return
        for pattern, kind in _FAILURES:
            match = pattern.search(line)
            if not match:
                continue
            if kind == "rank":
                rank = int(match.group(1))
                host = self.rank_hosts[rank] if rank < len(self.rank_hosts) else "an unknown host"
                self.failure = f"rank {rank} on host {host}"
            elif kind == "rank node":
                self.failure = f"rank {int(match.group(1))} on host {match.group(2).decode(errors='replace')}"
            else:
                self.failure = f"the ranks on host {match.group(1).decode(errors='replace')}"
            return

    def relay(self, source: int, target: int) -> None:
        """Copy ``source`` to ``target`` as it comes (partial lines too), scanning whole lines."""
        def pump() -> None:
            pending = b""
            while True:
                try:
                    chunk = os.read(source, 65536)
                except OSError:
                    break
                if not chunk:
                    break
                _write_all(target, chunk)
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    self.scan(line)
                pending = pending[-4096:]  # a progress bar without newlines must not grow forever
            if pending:
                self.scan(pending)
            os.close(source)
        thread = threading.Thread(target=pump, daemon=True)
        thread.start()
        self._threads.append(thread)

    # ------------------------------------------------------------ hosts
    def start_watchdog(self, on_lost: Callable[[str], None]) -> None:
        """Probe the remote hosts; call ``on_lost(host)`` once one is silent for ``timeout`` s."""
        if not self.remote or self.timeout <= 0:
            return

        def watch() -> None:
            # Only a host that has answered is watched: one reached some other way (an ssh
            # alias, a jump host) must not be declared lost because this probe cannot see it.
            last_seen: dict = {}
            while not self._stop.wait(self.interval):
                for host in self.remote:
                    if answers(host, self.port, timeout=min(3.0, self.timeout)):
                        last_seen[host] = time.monotonic()
                    elif host in last_seen and time.monotonic() - last_seen[host] >= self.timeout \
                            and not self._stop.is_set():
                        self.lost = host
                        on_lost(host)
                        return
        thread = threading.Thread(target=watch, daemon=True)
        thread.start()
        self._threads.append(thread)

    def stop(self, grace: float = 5.0) -> None:
        """Stop probing; give the relays ``grace`` seconds to drain what the job wrote last."""
        self._stop.set()
        deadline = time.monotonic() + grace
        for thread in self._threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))

    def lost_message(self, host: str) -> str:
        return (f"hvdgc-launch: lost host {host}: no answer on port {self.port} for {self.timeout:g} s; "
                "ending the job")

    def summary(self, code: int) -> Optional[str]:
        """The closing line for a failed job, naming the lost host or the first failed rank's host."""
        if code == 0:
            return None
        if self.lost is not None:
            return f"hvdgc-launch: the job failed (exit code {code}) after losing host {self.lost}"
        if self.failure is not None:
            return f"hvdgc-launch: the job failed (exit code {code}); first failure reported: {self.failure}"
        return None


def _write_all(fd: int, data: bytes) -> None:
    while data:
        try:
            written = os.write(fd, data)
        except OSError:  # our own output is gone (a closed pipe): keep draining the job
            return
        data = data[written:]
