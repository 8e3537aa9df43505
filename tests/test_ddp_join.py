"""Uneven inputs under DDP's ``model.join()`` with the hook (tests/ddp_join_workers.py is the rank side; 2 and 3
Gloo ranks, rank r has 4 - r batches, so a step after a join has one or two ranks training):

* uncompressed DDP (no hook) measured: the sum over the ranks still training divided by every rank
  (``divide_by_initial_world_size=True``, torch's default) or by the ranks still training (``False``);
* the hook divides the same way, and a step after a join is, bit for bit, the sum of what each rank still
  training contributed (its payload's decoded part for a compressed parameter, its gradient for the
  others) divided so;
* ``gc.Auto()`` is refused in a step after a join, on every rank; ``throw_on_early_termination=True``
  raises as without the hook;
* a second epoch under a new ``model.join()`` works the same (the count stops when a join ends);
* a joined rank's residuals stay as they were when it joined, every rank ends at the same exchange
  step, the replicas are identical at the end and after two more (even) steps, for TopKQSGD, QSGD,
  PowerSGD, no compression, momentum correction, ``frozen`` (AdamW) and ``update`` (RMSprop).
"""
from __future__ import annotations

from typing import Any, Dict, List

import pytest
import torch

from tests.harness import ROOT
from tests.test_ddp import run_job

pytestmark = pytest.mark.multirank
WORKERS = str(ROOT / "tests" / "ddp_join_workers.py")
JOBS = {
    "ddp": {"compression": "ddp"}, "ddp-n": {"compression": "ddp", "divide": False},
    "topkqsgd": {}, "topkqsgd-n": {"divide": False},
    "none": {"compression": "none"}, "none-n": {"compression": "none", "divide": False},
    "qsgd": {"compression": "qsgd"}, "topk-n": {"compression": "topk", "divide": False},
    "powersgd": {"compression": "powersgd"}, "topkqsgd-2ep": {"epochs": 2},
    "momentum": {"feedback": "auto", "momentum": 0.9},
    "frozen": {"feedback": "frozen", "optimizer": "adamw"}, "update": {"feedback": "auto", "optimizer": "rmsprop"},
}
_cache: Dict[int, Dict[str, List[Any]]] = {}


@pytest.fixture(scope="module", params=[2, 3], ids=["2ranks", "3ranks"])
def runs(request) -> Dict[str, List[Any]]:
    world = request.param
    if world not in _cache:
        per_rank = run_job([{"fn": "join_run", **job} for job in JOBS.values()], timeout=300, workers=WORKERS,
                           nproc=world)
        _cache[world] = {k: [per_rank[r][i] for r in range(world)] for i, k in enumerate(JOBS)}
    return _cache[world]


def _join_steps(ranks: List[Any]):
    """(step, the ranks training it) for every step some rank had joined."""
    world = len(ranks)
    for t in range(len(ranks[0]["steps"])):
        training = [r for r in range(world) if t < len(ranks[r]["steps"])]
        if len(training) < world:
            yield t, training


def _divisor(job: str, world: int, training: List[int]) -> int:
    return len(training) if job.endswith("-n") else world


@pytest.mark.parametrize("job", ["ddp", "ddp-n"])
def test_uncompressed_ddp_divides_as_measured(runs, job):
    ranks = runs[job]
    steps = list(_join_steps(ranks))
    assert steps
    for t, training in steps:
        divisor = _divisor(job, len(ranks), training)
        for name, avg in ranks[0]["steps"][t]["avg"].items():
            total = sum(torch.tensor(ranks[r]["steps"][t]["local"][name]) for r in training)
            torch.testing.assert_close(torch.tensor(avg), total / divisor, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("job", ["topkqsgd", "topkqsgd-n", "none", "none-n", "qsgd", "topk-n", "topkqsgd-2ep"])
def test_join_steps_average_bit_for_bit(runs, job):
    """At most two ranks train in a join step here, so their sum is one rounding, whatever the order."""
    ranks = runs[job]
    for t, training in _join_steps(ranks):
        divisor = _divisor(job, len(ranks), training)
        compressed = set(ranks[training[0]]["steps"][t]["part"])
        assert bool(compressed) == (job not in ("none", "none-n"))
        for r in range(len(ranks)):
            if r not in training:
                continue
            assert set(ranks[r]["steps"][t]["part"]) == compressed
            for name, avg in ranks[r]["steps"][t]["avg"].items():
                contrib = [torch.tensor(ranks[q]["steps"][t]["part" if name in compressed else "local"][name])
                           for q in training]
                total = contrib[0] if len(contrib) == 1 else contrib[0] + contrib[1]
                assert torch.equal(torch.tensor(avg), total / divisor), (job, t, r, name)


@pytest.mark.parametrize("job", ["none", "none-n"])
def test_the_hook_uncompressed_matches_ddp(runs, job):
    ddp, hook = runs["ddp" + job[4:]], runs[job]
    for t in range(len(ddp[0]["steps"])):
        for name, avg in hook[0]["steps"][t]["avg"].items():
            torch.testing.assert_close(torch.tensor(avg), torch.tensor(ddp[0]["steps"][t]["avg"][name]),
                                       rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("job", [j for j in JOBS if not j.startswith("ddp")])
def test_joined_ranks_keep_residuals_and_replicas_end_identical(runs, job):
    ranks = runs[job]
    world = len(ranks)
    assert all(r["kept"] for r in ranks)
    assert len({r["iter"] for r in ranks}) == 1                      # every rank at the same exchange step
    epochs = JOBS[job].get("epochs", 1)
    assert [r["join_steps"] for r in ranks] == [epochs * (world - 1 - r) for r in range(world)]
    assert all(r["weights_at_end"] == ranks[0]["weights_at_end"] for r in ranks)
    assert all(r["weights_after"] == ranks[0]["weights_after"] for r in ranks)


@pytest.mark.parametrize("mode,says", [("auto", "compression=gc.Auto() cannot carry such steps"),
                                       ("throw", "exhausted")])
def test_auto_and_early_termination_raise_on_every_rank(mode, says):
    per_rank = run_job([{"fn": "refused", "mode": mode}], timeout=120, workers=WORKERS)
    assert all(says in r[0]["error"] for r in per_rank), per_rank
