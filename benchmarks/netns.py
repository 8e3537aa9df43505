"""Network namespaces whose loopback is rate-limited with ``tc tbf``: a slow link on one machine.

The command builders are pure (tested with exact lists); :func:`rate_limited_netns` runs them.
"""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import uuid
from contextlib import contextmanager
from typing import Any, Iterator, List, Optional, Sequence

TBF = {"burst": "256kb", "latency": "50ms"}

# How the speed rows of one table ran: the link their traffic crossed (the tables' titles).
LINK_MODES = {
    "two-hosts": "two hosts: one rank in each of two network namespaces, across a veth link rate-limited per "
                 "direction",
    "loopback": "one namespace: both ranks on one rate-limited loopback, shared by both directions",
    "unthrottled": "unthrottled: the host's loopback, no rate limit",
}


def netns_setup_commands(name: str, rate: str, burst: str = TBF["burst"], latency: str = TBF["latency"]) -> List[List[str]]:
    """Commands that create namespace ``name`` with a loopback limited to ``rate``.

    >>> netns_setup_commands("ns", "1gbit")[-1]
    ['ip', 'netns', 'exec', 'ns', 'tc', 'qdisc', 'add', 'dev', 'lo', 'root', 'tbf', 'rate', '1gbit', 'burst', '256kb', 'latency', '50ms']
    """
    return [
        ["ip", "netns", "add", name],
        ["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"],
        ["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo", "root", "tbf",
         "rate", rate, "burst", burst, "latency", latency],
    ]


def netns_teardown_command(name: str) -> List[str]:
    """The command that deletes namespace ``name`` (and its qdisc with it).

    >>> netns_teardown_command("ns")
    ['ip', 'netns', 'del', 'ns']
    """
    return ["ip", "netns", "del", name]


def in_netns(name: Optional[str], argv: Sequence[str]) -> List[str]:
    """``argv`` run inside namespace ``name`` (unchanged when ``name`` is None).

    >>> in_netns("ns", ["horovodrun", "-np", "2"])
    ['ip', 'netns', 'exec', 'ns', 'horovodrun', '-np', '2']
    """
    return list(argv) if name is None else ["ip", "netns", "exec", name, *argv]


def _quiet(argv: List[str], timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)


@contextmanager
def rate_limited_netns(rate: str, say: Any) -> Iterator[Optional[str]]:
    """A namespace limited to ``rate`` for the duration (always deleted), or None when not allowed."""
    name = f"hvdgc-{uuid.uuid4().hex[:8]}"
    reason = _netns_unavailable()
    if reason is None:
        for cmd in netns_setup_commands(name, rate):
            res = _quiet(cmd)
            if res.returncode != 0:
                reason = f"`{shlex.join(cmd)}` failed: {res.stdout.strip()}"
                break
    if reason is not None:
        _quiet(netns_teardown_command(name))
        say(f"cannot create a rate-limited network namespace ({reason}); running UNTHROTTLED")
        yield None
        return
    try:
        yield name
    finally:
        _quiet(netns_teardown_command(name))


def _netns_unavailable() -> Optional[str]:
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not installed (apt-get install iproute2)"
    if hasattr(os, "geteuid") and os.geteuid() != 0:
        return "needs root (CAP_NET_ADMIN)"
    return None


