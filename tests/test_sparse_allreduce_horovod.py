"""The sparse allreduce (``TopK/TopKQSGD(exchange="allreduce")``, issue 62) driven by
``hvd_gradcomp.DistributedOptimizer`` on 2 and 3 Gloo ranks (tests/workers/sparse_allreduce_hvd.py):
identical parameters on every rank, nothing lost (residuals plus the applied average hold every
rank's gradient), training about as the allgather exchange does, its wire bytes (fewer than TopK's
allgather at 3 ranks), a non-finite gradient skipped on every rank, hvd.join() with uneven data, and
stock ``hvd.DistributedOptimizer``'s refusal.

One job per rank count runs every case (starting ranks costs seconds), cached for the module.
"""
from __future__ import annotations

from typing import Any, Dict, List

import pytest

from tests.harness import run_ranks

pytestmark = pytest.mark.multirank
KINDS = ("topk", "topkqsgd")
STEPS = 30
# The loss on the training set after STEPS of SGD (lr 0.1, 2 batches per rank cycled), the sparse
# allreduce's fall against the allgather exchange's, same seeds and data. Measured (from 2.34):
# 2 ranks 1.24 vs 1.10 (TopK), 1.23 vs 1.10 (TopKQSGD), a share of 0.89-0.90; 3 ranks 1.69 vs 1.51,
# 1.68 vs 1.51, 0.78-0.79. The bound leaves room for other library versions' rounding.
LOSS_SHARE = 0.7
_cache: Dict[int, Dict[str, List[Any]]] = {}


def _cases() -> List[Dict[str, Any]]:
    cases = []
    for k in KINDS:
        for ex in ("allreduce", "allgather"):
            cases.append({"key": f"train-{k}-{ex}", "fn": "train", "kind": k, "exchange": ex, "steps": STEPS,
                          "tag": f"sa.{k}.{ex}", "conserve": ex == "allreduce"})
        cases.append({"key": f"gradscaler-{k}", "fn": "gradscaler", "kind": k})
    cases += [{"key": f"stock-{k}", "fn": "stock", "kind": k} for k in KINDS]   # late: leaves hooks armed
    # last: the ranks left in hvd.join() stay there until all have joined
    cases += [{"key": f"join-{k}", "fn": "join", "kind": k} for k in KINDS]
    return cases


@pytest.fixture(scope="module", params=[2, 3], ids=["np2", "np3"])
def res(request):
    np = request.param
    if np not in _cache:
        per_rank = run_ranks("sparse_allreduce_hvd:battery", np=np, timeout=600, cases=_cases())
        _cache[np] = {key: [r[key] for r in per_rank] for key in per_rank[0]}
    return np, _cache[np]


@pytest.mark.parametrize("kind", KINDS)
def test_every_rank_ends_with_the_same_bits(res, kind):
    _, r = res
    for rank in r[f"train-{kind}-allreduce"]:
        assert rank["exchange"] == "SparseAllreduceExchange"
        assert rank["params_equal_across_ranks"]
    assert r[f"train-{kind}-allreduce"][0]["params"] != r[f"train-{kind}-allgather"][0]["params"]


@pytest.mark.parametrize("kind", KINDS)
def test_nothing_lost(res, kind):
    """Summed over ranks, residual after + the ranks times the applied average == gradient + residual
    before, at every step and every element (float32 rounding: TopKQSGD's residual is acc - quantised)."""
    _, r = res
    for rank in r[f"train-{kind}-allreduce"]:
        assert rank["worst_conservation"] < 1e-4, rank["worst_conservation"]


@pytest.mark.parametrize("kind", KINDS)
def test_trains_like_the_allgather(res, kind):
    """The loss falls by at least LOSS_SHARE of what the allgather exchange's falls. Less is expected:
    the allgather applies every rank's top-k (up to P x k coordinates a step), the sparse allreduce
    about k; error feedback carries the rest to later steps."""
    _, r = res
    ar, ag = r[f"train-{kind}-allreduce"][0]["losses"], r[f"train-{kind}-allgather"][0]["losses"]
    assert ar[0] == ag[0]
    assert ar[0] - ar[-1] >= LOSS_SHARE * (ag[0] - ag[-1]), (ar[0], ar[-1], ag[-1])


@pytest.mark.parametrize("kind", KINDS)
def test_wire_bytes(res, kind):
    """The ledger counts what each rank hands Horovod: for the allgather, its own payload, which the
    ring forwards to the P-1 others (every rank's payload but the next rank's leaves each rank). The
    sparse allreduce's ``ring_bytes`` counts the same way (its routed pairs, then every owner's kept
    sums but the next owner's): at most ``8 k`` routed and ``8 K`` forwarded, K <= k + P - 1, plus
    envelopes (on average ``8 (P-1)/P (k + K)``, the module's model). At 3 ranks it is below TopK's allgather (5 bytes a value on the wire against
    8 a pair; the gain grows with P); not yet below TopKQSGD's (about 2.2 bytes a value: the
    crossover is near 8 ranks)."""
    np, r = res
    ag = [rank["step_bytes"][-1] for rank in r[f"train-{kind}-allgather"]]
    ag_ring = [sum(ag) - ag[(i + 1) % np] for i in range(np)]
    ar_ring = [rank["ring_bytes"] for rank in r[f"train-{kind}-allreduce"]]
    if np == 3 and kind == "topk":
        assert max(ar_ring) < min(ag_ring), (ar_ring, ag_ring)
    for rank in r[f"train-{kind}-allreduce"]:
        ks = rank["ks"]
        bound = sum(8 * (2 * k + np - 1) + 2 * 16 * (np - 1) for k in ks)
        assert rank["ring_bytes"] <= bound, (rank["ring_bytes"], bound, ar_ring, ag_ring)
        # the ledger: routed pairs and kept sums this rank handed over, never the codec payload
        assert 0 < rank["step_bytes"][-1] <= rank["ring_bytes"]


@pytest.mark.parametrize("kind", KINDS)
def test_non_finite_skipped_on_every_rank(res, kind):
    """As tests/test_horovod_features.py's GradScaler case: rank 1's loss is inf at step 2."""
    _, r = res
    for rank in r[f"gradscaler-{kind}"]:
        rows = rank["rows"]
        assert [row["skipped"] for row in rows] == [False, False, True, False, False], rows
        assert [row["grads_finite"] for row in rows] == [True, True, False, True, True], rows
        bad = rows[2]
        assert bad["params_unchanged"] and bad["compressor_unchanged"] and bad["velocity_unchanged"], bad
        for row in rows[1:2] + rows[3:]:
            assert not (row["params_unchanged"] or row["compressor_unchanged"] or row["velocity_unchanged"]), row
        assert rank["params_equal_across_ranks"] and rank["finite"]


@pytest.mark.parametrize("kind", KINDS)
def test_stock_horovod_refuses(res, kind):
    _, r = res
    for rank in r[f"stock-{kind}"]:
        error = rank["error"]
        assert error is not None and "hvd_gradcomp.DistributedOptimizer" in error, error
        assert "alltoall" in error and "allgather" in error and "hvd_gradcomp.ddp.register" in error, error


@pytest.mark.parametrize("kind", KINDS)
def test_join_uneven_data(res, kind):
    """A rank inside hvd.join(): the ranks still training carry their pairs dense in one allreduce
    (no alltoall, which Horovod refuses then), and sync_after_join leaves every replica alike."""
    _, r = res
    for rank in r[f"join-{kind}"]:
        assert rank["error"] is None and rank["replicas_identical"], rank
