"""The two test hosts of ``scripts/two_hosts.sh`` seen from the benchmark (``python -m benchmarks
--two-hosts``): run a 2-rank job across them. A test bed, so it lives here and not in the package.

Host ``hvdgc-a`` and host ``hvdgc-b`` are network namespaces joined by a veth pair (``hvdgc0``
on both) that ``tc tbf`` limits to a rate per direction. :func:`two_hosts` brings them up at a
rate for the duration of a ``with`` block; :func:`horovodrun_across` is the command that runs
a program with one rank on each, launched from ``hvdgc-a`` over ssh::

    >>> horovodrun_across(["python", "bench.py"], bin_dir=Path("/venv/bin"))[4:]
    ['/venv/bin/horovodrun', '-np', '2', '-H', 'hvdgc-a:1,hvdgc-b:1', '--gloo', '--network-interface', 'hvdgc0', 'python', 'bench.py']
"""
from __future__ import annotations

import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, List, Sequence

from hvd_gradcomp.launchers.command import LaunchSpec, build_command

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "two_hosts.sh"
HOSTS = ("hvdgc-a", "hvdgc-b")
INTERFACE = "hvdgc0"


def on_host(host: str, argv: Sequence[str]) -> List[str]:
    """``argv`` run as ``host`` (its network namespace and host name).

    >>> on_host("hvdgc-b", ["hostname"])[-3:]
    ['exec', 'hvdgc-b', 'hostname']
    """
    return ["bash", str(SCRIPT), "exec", host, *argv]


def horovodrun_across(program: Sequence[str], bin_dir: Path = Path(sys.executable).parent) -> List[str]:
    """``program`` on 2 Gloo ranks, one per host, over the rate-limited link, started on hvdgc-a."""
    spec = LaunchSpec(command=tuple(program), np=2, hosts=tuple((h, 1) for h in HOSTS), backend="gloo",
                      network_interface=INTERFACE)
    argv, _ = build_command(spec)
    return on_host(HOSTS[0], [str(bin_dir / "horovodrun"), *argv[1:]])


def up_command(rate: str) -> List[str]:
    """The shell line that brings the hosts up at ``rate`` (for ``--dry-run`` listings)."""
    return ["bash", str(SCRIPT), "up", "--rate", rate, "--no-slurm"]


def down_command() -> List[str]:
    """The shell line that takes the hosts down (idempotent).

    >>> down_command()[-1]
    'down'
    """
    return ["bash", str(SCRIPT), "down"]


@contextmanager
def two_hosts(rate: str, say: Any) -> Iterator[bool]:
    """The two hosts up with a ``rate`` link for the block (always taken down after); False if they cannot be."""
    up = subprocess.run(up_command(rate), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    try:
        if up.returncode != 0:
            say(f"cannot bring up the two hosts at {rate} ({up.stdout.strip().splitlines()[-1:]})")
        yield up.returncode == 0
    finally:
        subprocess.run(down_command(), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                       timeout=120)
