"""``optimizer.step(closure)`` and rank-0 checkpoints on the Horovod roads (tests/workers/closure.py is the rank side, 2 Gloo ranks).

``hvd_gradcomp.DistributedOptimizer`` gives the weights of ``backward()`` then ``step()``, bit for bit, under
every feedback policy, and LBFGS (several closure calls per step) keeps the replicas identical; stock
``hvd.DistributedOptimizer`` synchronizes before running the closure, so with a compressor it is refused.
"""
from __future__ import annotations

from typing import Any, Dict

import pytest

from tests.harness import run_ranks

pytestmark = pytest.mark.multirank
POLICIES = ["classic", "none", "momentum", "frozen", "update"]
_cache: Dict[str, Any] = {}


@pytest.fixture(scope="module")
def battery(tmp_path_factory) -> Dict[str, Any]:
    if "all" not in _cache:
        ckpt = str(tmp_path_factory.mktemp("ckpt"))
        jobs = {**{p: {"fn": "closure_matches", "policy": p} for p in POLICIES},
                "lbfgs": {"fn": "lbfgs"},
                **{f"ckpt-{p}-{road}": {"fn": "rank0_checkpoint", "policy": p, "ckpt": ckpt, "stock": road == "stock"}
                   for p in ("momentum", "frozen") for road in ("gc", "stock")},
                **{f"seed-{road}-{s}": {"fn": "seeded", "seed": s % 10, "stock": road == "stock"}
                   for road in ("gc", "stock") for s in (5, 15, 6)},
                "stock": {"fn": "stock_refuses"}}
        _cache["all"] = run_ranks("closure:battery", timeout=240, jobs=jobs)
    return _cache["all"]


@pytest.mark.parametrize("policy", POLICIES)
def test_gc_optimizer_step_with_closure_matches_backward_then_step(battery, policy):
    for rank, result in enumerate(battery):
        got = result[policy]
        assert got["feedback"] == policy
        assert got["identical"], f"rank {rank}: max difference {got['max_diff']}"
        assert got["replicas"]


def test_gc_optimizer_runs_lbfgs(battery):
    for result in battery:
        got = result["lbfgs"]
        assert got["replicas"]
        assert got["calls"] > 3 + 1
        assert got["last"] < 0.9 * got["first"]


def test_stock_optimizer_refuses_a_closure_naming_the_road_that_works(battery):
    for result in battery:
        error = result["stock"]["error"]
        assert error.count("HorovodIntegrationError") >= 1 or "step(closure)" in error
        assert "hvd_gradcomp.DistributedOptimizer" in error and "step(closure)" in error


@pytest.mark.parametrize("road", ["gc", "stock"])
@pytest.mark.parametrize("policy", ["momentum", "frozen"])
def test_rank0_only_checkpoint_of_the_accumulator_resumes_every_rank(battery, policy, road):
    r0, r1 = (result[f"ckpt-{policy}-{road}"] for result in battery)
    assert r0["identical"] and r1["identical"]
    assert r0["held"] and not r1["held"]
    assert "6 steps (bytes of steps 4-6, counted since the resume at step 3)" in r0["summary"]


@pytest.mark.parametrize("road", ["gc", "stock"])
def test_manual_seed_makes_a_compressed_run_repeatable(battery, road):
    a, b, c = (battery[0][f"seed-{road}-{s}"] for s in (5, 15, 6))
    assert a["seed"] == b["seed"] == 5 and c["seed"] == 6
    assert a["params"] == b["params"]
    assert a["params"] != c["params"]
