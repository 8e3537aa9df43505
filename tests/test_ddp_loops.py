"""The DDP hook in the loops frameworks run (tests/ddp_loop_workers.py is the rank side, 2 Gloo ranks):

* ``optimizer.step(closure)`` (Lightning's automatic optimization, LBFGS): the same weights, bit for bit,
  as ``backward()`` then ``step()``, under every feedback policy, nothing pending after the last step;
* a checkpoint written by rank 0 alone resumes every rank's residuals bit-identically, and one taken on
  another rank count restarts error feedback with a warning;
* with no ``seed=``, ``torch.manual_seed`` makes a compressed run repeatable.
"""
from __future__ import annotations

from typing import Any, Dict, List

import pytest

from tests.harness import ROOT
from tests.test_ddp import run_job

pytestmark = pytest.mark.multirank
WORKERS = str(ROOT / "tests" / "ddp_loop_workers.py")
POLICIES = ["classic", "none", "momentum", "frozen", "auto-adamw", "update"]
_cache: Dict[str, Any] = {}


@pytest.fixture(scope="module")
def battery(tmp_path_factory) -> Dict[str, List[Any]]:
    if "all" not in _cache:
        ckpt = str(tmp_path_factory.mktemp("ckpt"))
        jobs = {**{f"closure-{p}": {"fn": "closure", "policy": p} for p in POLICIES},
                "lbfgs": {"fn": "lbfgs"},
                **{f"ckpt-{p}": {"fn": "rank0_checkpoint", "policy": p, "ckpt": ckpt}
                   for p in ("classic", "momentum", "frozen")},
                "rank-count": {"fn": "rank_count_change", "ckpt": ckpt},
                "stub": {"fn": "stub_from_other_rank"},
                "seed-5a": {"fn": "seeded", "seed": 5}, "seed-5b": {"fn": "seeded", "seed": 5},
                "seed-6": {"fn": "seeded", "seed": 6}}
        per_rank = run_job(list(jobs.values()), timeout=300, workers=WORKERS)
        _cache["all"] = {k: [per_rank[0][i], per_rank[1][i]] for i, k in enumerate(jobs)}
    return _cache["all"]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("how", ["positional", "keyword"])
def test_step_with_closure_matches_backward_then_step(battery, policy, how):
    for rank in (0, 1):
        got = battery[f"closure-{policy}"][rank][how]
        assert got["identical"], f"rank {rank}: max difference {got['max_diff']}"
        assert got["pending"] == 0
        assert got["replicas"]


def test_closure_runs_every_policy_the_hook_has(battery):
    keys = {battery[f"closure-{p}"][0]["feedback"] for p in POLICIES}
    assert keys == {"classic", "none", "momentum", "frozen", "update"}


def test_lbfgs_calls_the_closure_several_times_and_replicas_agree(battery):
    r0, r1 = battery["lbfgs"]
    assert r0["replicas"] and r1["replicas"]
    assert r0["calls"] > 4 + 1   # several closure calls per step
    assert r0["exchanges"] == r0["calls"]   # one exchange per closure call, finished before LBFGS reads it
    assert r0["last"] < 0.9 * r0["first"]
    assert r0["pending"] == 0


@pytest.mark.parametrize("policy", ["classic", "momentum", "frozen"])
def test_rank0_only_checkpoint_resumes_every_rank_bit_identically(battery, policy):
    r0, r1 = battery[f"ckpt-{policy}"]
    assert r0["identical"] and r1["identical"]
    assert r0["held"] and not r1["held"]   # rank 0 holds every rank's state, rank 1 a stub
    assert r0["iter"] == r1["iter"] == 6
    assert r0["counted"] == 3
    assert "bytes of steps 4-6, counted since the resume at step 3" in r0["summary"]


def test_another_rank_count_restarts_error_feedback_with_a_warning(battery):
    r0, r1 = battery["rank-count"]
    assert any("saved by 2 ranks and this job has 1" in w and "restarts from zero" in w for w in r0["warnings"])
    assert r0["iter"] == r1["iter"] == 4   # 3 before, one after
    assert r0["residuals"] == 0            # nothing of another rank count's residuals was loaded


def test_stub_of_another_rank_is_refused_naming_the_fix(battery):
    assert "save the dict that rank 0 got" in battery["stub"][0]["error"]


def test_manual_seed_makes_a_compressed_run_repeatable(battery):
    a, b, c = battery["seed-5a"][0], battery["seed-5b"][0], battery["seed-6"][0]
    assert a["seed"] == b["seed"] == 5 and c["seed"] == 6
    assert a["params"] == b["params"]
    assert a["params"] != c["params"]


@pytest.mark.slow
def test_static_graph_and_torch_compile_keep_the_hook_working():
    per_rank = run_job([{"fn": "compiled"}], timeout=420, workers=WORKERS)
    for result in per_rank:
        got = result[0]
        for mode in ("eager", "static", "compile"):
            assert got[mode]["exchanges"] == 3 and got[mode]["replicas"], (mode, got[mode])
        assert got["static"]["max_diff"] == 0.0
        assert got["compile"]["max_diff"] < 1e-4
