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
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest

from hvd_gradcomp.launchers.jobs import BIN, CAPTURE, JobResult, local_horovodrun, run_job
from hvd_gradcomp.launchers.jobs import rank_env as _rank_env

ROOT = Path(__file__).resolve().parents[1]
HOROVODRUN = str(BIN / "horovodrun")
BACKENDS = ("gloo", "mpi")


def rank_env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """Environment for rank processes (see :func:`hvd_gradcomp.launchers.jobs.rank_env`), eager kernels by default."""
    return _rank_env(ROOT, {"HVDGC_COMPILE": "0", **(extra or {})})  # tests use small tensors


def launch(argv: List[str], timeout: float, env: Dict[str, str], cwd: Path = ROOT) -> JobResult:
    """Run argv in a new process group; on timeout kill the whole group and fail with its output."""
    res = run_job(argv, env, timeout, cwd=cwd, output=CAPTURE)
    if res.timed_out:
        pytest.fail(f"timed out after {timeout:.0f}s: {' '.join(argv)}\n--- output of all ranks ---\n{res.output}")
    return res


def horovodrun_argv(np: int, backend: str, program: List[str]) -> List[str]:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return local_horovodrun(program, np, backend)


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
                pytest.fail(f"expected the job to fail, but it exited 0\n{res.output}")
            return [{"returncode": res.returncode, "output": res.output}]
        if res.returncode != 0:
            pytest.fail(f"{target} on {np} ranks ({backend}) exited {res.returncode}\n"
                        f"--- output of all ranks ---\n{res.output}")
        results = []
        for r in range(np):
            path = Path(outdir) / f"rank{r}.json"
            if not path.exists():
                pytest.fail(f"rank {r} wrote no result\n--- output of all ranks ---\n{res.output}")
            results.append(json.loads(path.read_text()))
        return results


def run_single(target: str, timeout: float = 120, env: Optional[Dict[str, str]] = None,
               **kwargs: Any) -> Dict[str, Any]:
    """Run ``target`` in one plain process after ``hvd.init()`` (size 1, no launcher, no ranks
    to start): Horovod's real optimizer code without the cost of horovodrun."""
    with tempfile.TemporaryDirectory(prefix="hvdgc-single-") as outdir:
        program = [sys.executable, str(ROOT / "tests" / "rank_main.py"), target, outdir, json.dumps(kwargs)]
        res = launch(program, timeout, rank_env(env))
        path = Path(outdir) / "rank0.json"
        if res.returncode != 0 or not path.exists():
            pytest.fail(f"{target} in one process exited {res.returncode}\n--- output ---\n{res.output}")
        return json.loads(path.read_text())
