"""The DDP hook's sparse allreduce (``TopK``/``TopKQSGD(exchange="allreduce")``, driven by
:mod:`hvd_gradcomp.ddp.sparse_exchange`) on 2 and 3 Gloo ranks; tests/ddp_sparse_allreduce_workers.py is the
rank side. Per codec, against the allgather exchange with the same seeds:

* the replicas are bit-identical after every run;
* nothing is lost: every step, summed over the ranks, ``residual_after + world * average`` equals
  ``gradient + residual_before`` for every compressed parameter (error feedback gets back what the global
  selection dropped), to float32 rounding;
* a small model trains: its loss on its training batches falls, and ends within 2e-3 of the allgather's
  (measured: 7.2e-4 apart after 8 steps, in which the loss fell by 0.0075 and 0.010, on 2 and 3 ranks: the two
  exchanges keep different pairs, the allgather every rank's top-k, this one the top sums);
* bytes on the wire per rank (an alltoall's bytes to the other ranks, an allgather's input times the others):
  the sparse allreduce's grow less than the allgather's from 2 to 3 ranks (measured, TopK: 3,832 -> 5,276
  per step, x1.38, against 2,622 -> 5,246, x2.0). Not fewer yet at 3 ranks: its pairs are 8 bytes, the
  top-k payload's ~6 (TopK: delta-coded indices) or ~2.5 (TopKQSGD, 8 bits), see
  hvd_gradcomp.ddp.sparse_exchange;
* uneven inputs under ``model.join()`` (steps after a join travel dense, as for every exchange): the
  replicas agree when every rank has joined and after two more steps;
* a NaN/Inf gradient on one rank: that step's compressed gradients are non-finite on every rank (every rank
  skips it), the flagged rank's residuals stay as they were and the others get back all they sent.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List

import pytest

from tests.harness import ROOT
from tests.torchrun_jobs import run_torchrun

pytestmark = pytest.mark.multirank
WORKERS = ROOT / "tests" / "ddp_sparse_allreduce_workers.py"
STEPS, BAD_STEP = 8, 2
JOBS = {f"{kind}-{exchange}": {"fn": "train", "kind": kind, "exchange": exchange, "steps": STEPS}
        for kind in ("topk", "topkqsgd") for exchange in ("allreduce", "allgather")}
JOBS.update({f"{kind}-bad": {"fn": "train", "kind": kind, "exchange": "allreduce", "steps": 4, "bad_step": BAD_STEP}
             for kind in ("topk", "topkqsgd")})
JOBS.update({f"{kind}-join": {"fn": "joined", "kind": kind} for kind in ("topk", "topkqsgd")})
_cache: Dict[int, Dict[str, List[Any]]] = {}


def results(ranks: int) -> Dict[str, List[Any]]:
    if ranks not in _cache:
        per_rank = run_torchrun(Path(WORKERS), list(JOBS.values()), timeout=600, ranks=ranks)
        _cache[ranks] = {key: [per_rank[r][j] for r in range(ranks)] for j, key in enumerate(JOBS)}
    return _cache[ranks]


@pytest.fixture(scope="module", params=[2, 3], ids=["2ranks", "3ranks"])
def runs(request) -> Dict[str, List[Any]]:
    return results(request.param)


@pytest.mark.parametrize("kind", ["topk", "topkqsgd"])
def test_replicas_are_bit_identical(runs, kind):
    for key in (f"{kind}-allreduce", f"{kind}-bad"):
        assert len({r["digest"] for r in runs[key]}) == 1, key


@pytest.mark.parametrize("kind", ["topk", "topkqsgd"])
def test_nothing_is_lost(runs, kind):
    run = runs[f"{kind}-allreduce"][0]
    assert len(run["owed"]) == STEPS
    for owed, scale in zip(run["owed"], run["scale"]):
        assert owed <= 1e-6 * scale + 1e-9, (owed, scale)


@pytest.mark.parametrize("kind", ["topk", "topkqsgd"])
def test_trains_as_the_allgather_does(runs, kind):
    mine, theirs = runs[f"{kind}-allreduce"][0], runs[f"{kind}-allgather"][0]
    assert mine["loss"] < mine["initial_loss"]
    assert abs(mine["loss"] - theirs["loss"]) < 2e-3, (mine["loss"], theirs["loss"])


@pytest.mark.parametrize("kind", ["topk", "topkqsgd"])
def test_wire_bytes_grow_less_than_the_allgathers(kind):
    def per_step(ranks: int, exchange: str) -> float:
        run = results(ranks)[f"{kind}-{exchange}"]
        return sum(sum(r["wire"]) for r in run) / (len(run) * STEPS)

    growth = {exchange: per_step(3, exchange) / per_step(2, exchange) for exchange in ("allreduce", "allgather")}
    assert growth["allgather"] > 1.9 and growth["allreduce"] < growth["allgather"] - 0.3, growth


@pytest.mark.parametrize("kind", ["topk", "topkqsgd"])
def test_a_nonfinite_gradient_on_one_rank_is_skipped_on_every_rank(runs, kind):
    run = runs[f"{kind}-bad"]
    for r in run:
        assert r["skipped"] == [step == BAD_STEP for step in range(4)], r["skipped"]
        assert r["nonfinite_exchanges"] >= 1
    assert run[1]["bad_rank_residuals_kept"] is True
    for r in (run[0],) + tuple(run[2:]):
        assert r["returned_all"] is not None and r["returned_all"] < 1e-6


@pytest.mark.parametrize("kind", ["topk", "topkqsgd"])
def test_uneven_inputs_under_join(runs, kind):
    run = runs[f"{kind}-join"]
    assert len({r["at_join"] for r in run}) == 1 and len({r["digest"] for r in run}) == 1
    assert len({r["iter"] for r in run}) == 1 and run[0]["join_steps"] == len(run) - 1
