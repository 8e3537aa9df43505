"""Run a local multi-rank job: the one process runner and rank environment shared by the test
harness (tests/harness.py), ``make demo`` (examples/demo.py) and ``make bench`` (benchmarks/).

* :func:`rank_env`: the environment of the ranks: the checkout importable, Open MPI allowed
  as root, one thread per rank, no stray ``HVDGC_*`` settings from the caller's shell.
* :func:`local_horovodrun`: ``horovodrun -np N -H localhost:N --gloo|--mpi PROGRAM``, built by
  :func:`hvd_gradcomp.launchers.command.build_command` like every other launch command.
* :func:`run_job`: run it in its own process group with a timeout; on timeout, Ctrl-C or any
  error the whole group is killed, so no rank is left behind.

Example::

    >>> argv = local_horovodrun(["python", "train.py"], np=2, backend="gloo", bin_dir=Path("/v/bin"))
    >>> argv
    ['/v/bin/horovodrun', '-np', '2', '-H', 'localhost:2', '--gloo', 'python', 'train.py']
"""
from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Union

from ..config import VARIABLES

from .command import LaunchSpec, build_command

BIN = Path(sys.executable).parent
CAPTURE = "capture"


@dataclass
class JobResult:
    """How a job ended: exit code (None when killed at the timeout), all output when captured, seconds."""

    argv: List[str]
    returncode: Optional[int]
    output: str
    seconds: float

    @property
    def stdout(self) -> str:
        """``output``, named as on ``subprocess.CompletedProcess``."""
        return self.output

    @property
    def timed_out(self) -> bool:
        return self.returncode is None

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def rank_env(root: Path, settings: Optional[Mapping[str, str]] = None,
             base: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """Environment of the ranks of a job run from the checkout at ``root``.

    ``HVDGC_*`` variables of ``base`` (default ``os.environ``) are dropped, so a stray export
    in the caller's shell cannot change a test or a benchmark; ``settings`` go in last.

    >>> env = rank_env(Path("/repo"), {"HVDGC_COMPILE": "0"}, base={"HVDGC_RATIO": "0.5", "PATH": "/bin"})
    >>> sorted(env.items())  # doctest: +NORMALIZE_WHITESPACE
    [('HVDGC_COMPILE', '0'), ('OMPI_ALLOW_RUN_AS_ROOT', '1'), ('OMPI_ALLOW_RUN_AS_ROOT_CONFIRM', '1'),
     ('OMP_NUM_THREADS', '1'), ('PATH', '/bin'), ('PYTHONPATH', '/repo')]
    """
    base = os.environ if base is None else base
    env = {k: v for k, v in base.items() if k not in VARIABLES}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    env["OMP_NUM_THREADS"] = "1"
    env.update(settings or {})
    return env


def local_horovodrun(program: Sequence[str], np: int = 2, backend: str = "gloo", bin_dir: Path = BIN,
                     bind_cores: bool = False) -> List[str]:
    """horovodrun (of this Python's environment) starting ``program`` on ``np`` local ranks
    (``bind_cores``: each on its own slice of the cores, see :mod:`hvd_gradcomp.launchers.bind`)."""
    argv, _ = build_command(LaunchSpec(command=tuple(program), np=np, backend=backend, bind_cores=bind_cores))
    return [str(bin_dir / argv[0]), *argv[1:]]


def run_job(argv: Sequence[str], env: Mapping[str, str], timeout: float, cwd: Optional[Path] = None,
            output: Union[None, str, Path] = None) -> JobResult:
    """Run ``argv`` (no shell) in a new process group and wait at most ``timeout`` seconds.

    ``output``: None streams to this terminal, :data:`CAPTURE` returns it in the result, a
    path writes it there (after a ``$ command`` line). The group is killed on timeout
    (``returncode`` None), on Ctrl-C and on any error, which is then re-raised.
    """
    argv = list(argv)
    log = None
    if isinstance(output, Path):
        output.parent.mkdir(parents=True, exist_ok=True)
        log = open(output, "w")
        log.write(f"$ {shlex.join(argv)}\n")
        log.flush()
    sink = subprocess.PIPE if output == CAPTURE else log
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=cwd, env=dict(env), stdout=sink, stderr=subprocess.STDOUT if sink else None,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        code: Optional[int] = proc.returncode
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        out, _ = proc.communicate()
        code = None
    except BaseException:
        _kill_group(proc)
        proc.communicate()
        raise
    finally:
        if log is not None:
            log.close()
    text = out or (output.read_text(errors="replace") if isinstance(output, Path) else "")
    return JobResult(argv, code, text, time.perf_counter() - t0)


GRACE_S = 10.0


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM the job's process group, then SIGKILL whatever is left after :data:`GRACE_S`.

    SIGTERM first because torchrun starts each worker in a session of its own, out of the
    group's reach: on SIGTERM it ends them itself, while a SIGKILL of torchrun alone would
    leave them running (a hung rank forever). horovodrun and mpirun also end their ranks on it.
    """
    _signal_group(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    _signal_group(proc.pid, signal.SIGKILL)


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:   # already gone
        pass


def tail(text: str, lines: int = 15) -> str:
    """The last ``lines`` lines of ``text``."""
    return "\n".join(text.splitlines()[-lines:])
