"""pytest plugin of ``make unit``: a test that starts a launcher, MPI, Slurm or a network
namespace fails, naming the program, so that the unit selection stays what it claims to be.

``make unit`` deselects the markers that need those (``multirank``, ``slurm``, ``two_hosts``,
``slow``) and loads this plugin (``-p tests.unit_guard``): a test that needs them but lacks its
marker fails here instead of quietly making ``make unit`` need root, MPI or minutes.
Only the test process is watched; the pure command builders are not affected (they build
argv lists and start nothing).
"""
from __future__ import annotations

import os
import subprocess
from typing import Any

import pytest

FORBIDDEN = {
    "horovodrun": "multirank", "mpirun": "multirank", "mpiexec": "multirank", "torchrun": "multirank",
    "srun": "slurm", "sbatch": "slurm", "salloc": "slurm", "scontrol": "slurm", "squeue": "slurm",
    "ip": "two_hosts", "ssh": "two_hosts", "tc": "two_hosts", "nsenter": "two_hosts", "sudo": "two_hosts",
}


def _program(args: Any) -> str:
    if isinstance(args, (str, bytes, os.PathLike)):
        first = os.fsdecode(args).split()[0] if os.fsdecode(args).split() else ""
    else:
        first = os.fsdecode(list(args)[0]) if list(args) else ""
    return os.path.basename(first)


@pytest.fixture(autouse=True)
def _no_launchers(monkeypatch: pytest.MonkeyPatch) -> None:
    original = subprocess.Popen.__init__

    def guarded(self: subprocess.Popen, args: Any, *rest: Any, **kwargs: Any) -> None:
        name = _program(args)
        if name in FORBIDDEN:
            raise RuntimeError(f"`make unit` test started {name!r}: mark the test "
                               f"@pytest.mark.{FORBIDDEN[name]} (make unit runs none of those)")
        original(self, args, *rest, **kwargs)

    monkeypatch.setattr(subprocess.Popen, "__init__", guarded)
