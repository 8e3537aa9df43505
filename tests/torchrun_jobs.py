"""Run a worker script on Gloo ranks under torchrun and read back every rank's results: the launcher of
every DDP test (tests/test_ddp.py's ``run_job``, the integration tests).

The worker is ``python -m torch.distributed.run ... WORKER JOBS_JSON OUTDIR`` and writes
``OUTDIR/rank<r>.json``; the job runs in its own process group with a timeout, and a failure or a
timeout fails the test with every rank's output (:func:`tests.harness.launch`).
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List

import pytest

from tests.harness import launch, rank_env


def run_torchrun(worker: Path, jobs: List[Dict[str, Any]], timeout: float, ranks: int = 2,
                 expect_fail: bool = False) -> Any:
    """Every rank's result list (one entry per job, in order); with ``expect_fail``, the finished job itself."""
    with tempfile.TemporaryDirectory(prefix="hvdgc-torchrun-") as outdir:
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
                str(worker), json.dumps(jobs), outdir]
        res = launch(argv, timeout, rank_env())
        if expect_fail:
            return res
        if res.returncode != 0:
            pytest.fail(f"{worker.name} exited {res.returncode}\n--- output of all ranks ---\n{res.output}")
        results = []
        for r in range(ranks):
            path = Path(outdir) / f"rank{r}.json"
            if not path.exists():
                pytest.fail(f"rank {r} wrote no result\n--- output of all ranks ---\n{res.output}")
            results.append(json.loads(path.read_text()))
        return results
