"""The guard between ``hvdgc-launch`` and the launcher it runs: no process of a job outlives it.

``hvdgc-launch`` runs ``python -m hvd_gradcomp.launchers.guard -- horovodrun ...`` (or mpirun, srun,
torchrun) rather than the launcher itself::

    hvdgc-launch -> guard -> horovodrun -> Horovod's middlemen (own sessions) -> ranks

Why: ``hvdgc-launch`` asks the kernel to SIGTERM its child when it dies, even of SIGKILL,
which no handler sees. When that child was the launcher, the job's end was left to the
launcher's own SIGTERM handling, and horovodrun once caught that SIGTERM and left both ranks
running (seen in CI). The guard is a *child subreaper* (``PR_SET_CHILD_SUBREAPER``): whatever
the launcher's processes orphan is re-parented to the guard, so every process of the job stays
under it, whichever sessions they started, and it can always end them all:

- SIGINT / SIGTERM from a live ``hvdgc-launch``: passed on to the launcher's process group, so
  its own shutdown runs as before. The third one, or SIGUSR1, kills every process of the job.
- ``hvdgc-launch`` died: SIGTERM to every process of the job, then SIGKILL after ``--grace``
  seconds to what is left.
- the launcher exited: what it left behind gets SIGTERM, then SIGKILL after ``--grace``.

The guard exits with the launcher's exit code (128+N when it died of signal N).
Linux only (elsewhere it only passes signals on). Example::

    python -m hvd_gradcomp.launchers.guard --parent 4242 -- horovodrun -np 2 python train.py
"""
from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import threading
from typing import List, Optional, Sequence

import psutil

_PR_SET_CHILD_SUBREAPER = 36  # from <linux/prctl.h>
KILL_NOW = signal.SIGUSR1     # "kill every process of the job now" (hvdgc-launch's last resort)


def _become_subreaper() -> bool:
    """Ask the kernel to re-parent this process's orphaned descendants to it (Linux >= 3.4)."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def send(pid: int, signum: int, group: bool = False) -> None:
    """``kill`` (``killpg`` with ``group``), quiet when the process has just ended."""
    try:
        (os.killpg if group else os.kill)(pid, signum)
    except ProcessLookupError:
        pass


def descendants() -> List[psutil.Process]:
    """Every live process under this one: the job, and (as a subreaper) what it orphaned."""
    try:
        return psutil.Process().children(recursive=True)
    except psutil.Error:
        return []


def signal_all(signum: int, procs: Optional[Sequence[psutil.Process]] = None) -> None:
    """Send ``signum`` to ``procs`` (default: every descendant)."""
    for proc in descendants() if procs is None else procs:
        try:
            proc.send_signal(signum)
        except psutil.Error:  # ended meanwhile
            pass


def end_all(grace: float) -> None:
    """SIGTERM to every descendant, SIGKILL after ``grace`` s to those still running, reaped."""
    procs = descendants()
    signal_all(signal.SIGTERM, procs)
    _, alive = psutil.wait_procs(procs, timeout=grace)
    signal_all(signal.SIGKILL, alive + descendants())
    psutil.wait_procs(descendants(), timeout=grace)


class Guard:
    """Runs ``argv`` in its own session and owns every process it starts (see the module doc)."""

    def __init__(self, argv: Sequence[str], parent: int, grace: float) -> None:
        self.argv, self.parent, self.grace = list(argv), parent, grace
        self.received: List[int] = []
        self.job: Optional[subprocess.Popen] = None
        self._ending = threading.Event()

    def _orphaned(self) -> bool:
        return os.getppid() != self.parent

    def _on_signal(self, signum: int, _frame: object) -> None:
        if signum == KILL_NOW:
            signal_all(signal.SIGKILL)
            return
        if signum == signal.SIGTERM and self._orphaned():
            self._end_in_background()
            return
        self.received.append(signum)
        if len(self.received) >= 3:  # a launcher that hangs while shutting down
            signal_all(signal.SIGKILL)
        elif self.job is not None:
            send(self.job.pid, signum, group=True)

    def _end_in_background(self) -> None:
        if not self._ending.is_set():
            self._ending.set()
            threading.Thread(target=end_all, args=(self.grace,), daemon=True).start()

    def run(self) -> int:
        """Start the job, wait for it, end what it left behind; the job's exit code."""
        _become_subreaper()
        for sig in (signal.SIGINT, signal.SIGTERM, KILL_NOW):
            signal.signal(sig, self._on_signal)
        if self._orphaned():  # hvdgc-launch died before the handlers were in
            return 143
        self.job = subprocess.Popen(self.argv, start_new_session=True)
        for signum in list(self.received):  # arrived before the job existed
            send(self.job.pid, signum, group=True)
        if self._orphaned():
            self._end_in_background()
        code = self.job.wait()
        if descendants():
            end_all(self.grace)
        return code if code >= 0 else 128 - code


def main(args: Optional[Sequence[str]] = None) -> int:
    """``python -m hvd_gradcomp.launchers.guard [--parent PID] [--grace S] -- COMMAND...``: run COMMAND guarded."""
    parser = argparse.ArgumentParser(prog="python -m hvd_gradcomp.launchers.guard", description=__doc__.split("\n\n")[0])
    parser.add_argument("--parent", type=int, default=None,
                        help="pid of hvdgc-launch (default: this process's parent)")
    parser.add_argument("--grace", type=float, default=10.0,
                        help="seconds between SIGTERM and SIGKILL when the job is ended [default: 10]")
    parser.add_argument("argv", nargs=argparse.REMAINDER, help="-- the launcher's command")
    opts = parser.parse_args(args)
    argv = opts.argv[1:] if opts.argv[:1] == ["--"] else opts.argv
    if not argv:
        parser.error("no command after --")
    parent = opts.parent if opts.parent is not None else os.getppid()
    return Guard(argv, parent, opts.grace).run()


if __name__ == "__main__":
    sys.exit(main())
