"""Run a test function on several Horovod ranks, under horovodrun --gloo or --mpi.

A multi-rank test names a worker function ``tests/workers/<module>.py::<func>``. Every
rank runs it through ``tests/rank_main.py`` after ``hvd.init()``; the function returns a
JSON-able dict, written to ``<outdir>/rank<r>.json``. :func:`run_ranks` returns the dicts
in rank order so that the test (in the pytest process) asserts on real values.

Nothing hangs: the job runs in its own process group with a timeout, and any failure or
timeout fails the test with every rank's output.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
HOROVODRUN = str(BIN / "horovodrun")
BACKENDS = ("gloo", "mpi")


def rank_env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """Environment for rank processes: importable repo, Open MPI allowed to run as root."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("HVDGC_COMPILE", "0")  # eager kernels: tests use small tensors
    env.update(extra or {})
    return env


def launch(argv: List[str], timeout: float, env: Dict[str, str], cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """Run argv in a new process group; on timeout kill the whole group and fail with its output."""
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"timed out after {timeout:.0f}s: {' '.join(argv)}\n--- output of all ranks ---\n{out}")
    return subprocess.CompletedProcess(argv, proc.returncode, out, "")


def horovodrun_argv(np: int, backend: str, program: List[str]) -> List[str]:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return [HOROVODRUN, "-np", str(np), "-H", f"localhost:{np}", f"--{backend}", *program]


def run_ranks(target: str, np: int = 2, backend: str = "gloo", timeout: float = 180,
              env: Optional[Dict[str, str]] = None, expect_fail: bool = False,
              **kwargs: Any) -> List[Dict[str, Any]]:
    """Run ``target`` ("module:function" under tests/workers) on ``np`` ranks; return their results.

    kwargs are passed to the function (JSON). With ``expect_fail`` the job must exit
    non-zero and the CompletedProcess is returned as ``[{"returncode":..., "output":...}]``.
    """
    with tempfile.TemporaryDirectory(prefix="hvdgc-ranks-") as outdir:
        program = [sys.executable, str(ROOT / "tests" / "rank_main.py"), target, outdir, json.dumps(kwargs)]
        res = launch(horovodrun_argv(np, backend, program), timeout, rank_env(env))
        if expect_fail:
            if res.returncode == 0:
                pytest.fail(f"expected the job to fail, but it exited 0\n{res.stdout}")
            return [{"returncode": res.returncode, "output": res.stdout}]
        if res.returncode != 0:
            pytest.fail(f"{target} on {np} ranks ({backend}) exited {res.returncode}\n"
                        f"--- output of all ranks ---\n{res.stdout}")
        results = []
        for r in range(np):
            path = Path(outdir) / f"rank{r}.json"
            if not path.exists():
                pytest.fail(f"rank {r} wrote no result\n--- output of all ranks ---\n{res.stdout}")
            results.append(json.loads(path.read_text()))
        return results
