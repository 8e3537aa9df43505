"""PowerSGD on 2 ranks, on both roads that can carry its two dependent allreduces
(``hvd_gradcomp.DistributedOptimizer`` and the DDP hook), and refused by stock
``hvd.DistributedOptimizer`` with the wrappers to use instead (rank side: tests/workers/powersgd.py)."""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List

import pytest

from tests.harness import ROOT, launch, rank_env, run_ranks

pytestmark = pytest.mark.multirank
STEPS = 5


def _ddp(jobs: List[Dict[str, Any]]) -> List[List[Dict[str, Any]]]:
    with tempfile.TemporaryDirectory(prefix="hvdgc-ddp-psgd-") as outdir:
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                str(ROOT / "tests" / "ddp_powersgd_workers.py"), json.dumps(jobs), outdir]
        res = launch(argv, 300, rank_env())
        if res.returncode != 0:
            pytest.fail(f"DDP job exited {res.returncode}\n--- output of all ranks ---\n{res.output}")
        return [json.loads((Path(outdir) / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module", params=["ours", "ddp"])
def road(request) -> Dict[str, Any]:
    if request.param == "ddp":
        per_rank = _ddp([{"fn": "powersgd_ddp", "pgrank": 8}, {"fn": "powersgd_ddp", "pgrank": 1}])
        return {"exact": [r[0] for r in per_rank], "rank1": [r[1] for r in per_rank]}
    return {"exact": run_ranks("powersgd:ours", np=2, pgrank=8), "rank1": run_ranks("powersgd:ours", np=2, pgrank=1)}


def test_ranks_end_identical(road):
    for label in ("exact", "rank1"):
        r0, r1 = road[label]
        assert r0["final"] == r1["final"], label


def test_the_average_is_exact_when_its_rank_fits_and_close_otherwise(road):
    for r in road["exact"]:
        assert max(r["rel"][:2]) < 1e-5, r["rel"]     # first step: the average's rank <= 8 = PowerSGD's rank
    for r in road["rank1"]:
        # first step: a projection of the average onto one direction, not exact but never longer than it;
        # later steps also carry what earlier ones held back (error feedback), so each may stray further
        assert all(0.01 < e <= 1.0 for e in r["rel"][:2]) and max(r["rel"]) < 2.0, r["rel"]


def test_error_feedback_conserves_what_was_not_sent(road):
    """sum over steps of the averages handed over + the ranks' average residual = sum of the true averages."""
    for label in ("exact", "rank1"):
        for r in road[label]:
            assert max(r["conservation"].values()) < 1e-5, (label, r["conservation"])


def test_bytes_are_the_factors(road):
    for label in ("exact", "rank1"):
        for r in road[label]:
            for name, (n, m, k) in r["factors"].items():
                assert r["bytes"][name] == STEPS * (n + m) * k * 4, (label, name)


def test_a_resumed_run_continues_bit_identically(road):
    assert all(r["resumed_identical"] for label in ("exact", "rank1") for r in road[label])


def test_stock_horovod_refuses_it_naming_the_wrappers_that_carry_it():
    for r in run_ranks("powersgd:stock", np=2):
        assert r["error"] and "hvd_gradcomp.DistributedOptimizer" in r["error"] and "ddp.register" in r["error"]
