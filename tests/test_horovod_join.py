"""``hvd.join()`` with uneven data on ``hvd_gradcomp.DistributedOptimizer`` (issue 63): after a rank
joins, the ranks still training carry their parts dense in allreduces among themselves; the average
is over the ranks that contributed; a joined rank's residuals wait for its next step; after
``opt.sync_after_join(hvd.join())`` every replica is identical and the next epoch trains compressed.

Every built-in codec (PowerSGD included) and two codecs of one's own (tests/external_randomk.py,
tests/plugins/sign_plugin), on 2 and 3 ranks, two uneven epochs each (one rank with no batch at
all in the last 3-rank epoch). The average of every join step is checked bit for bit against the
sum of what each rank still training contributed, computed on the ranks without the exchange
(tests/workers/horovod_join.py), divided by their number. Stock ``hvd.DistributedOptimizer``
refuses join with a message naming the wrapper that carries it: tests/test_horovod_features.py.
"""
from __future__ import annotations

import os
from typing import Any, Dict, List

import pytest
import torch

from tests.harness import ROOT, run_ranks

SIGN_PLUGIN = ROOT / "tests" / "plugins" / "sign_plugin"
# batches per rank, per epoch: rank 1 joins first, then rank 0 (2 ranks); on 3 ranks one rank
# has no batch at all in the second epoch
BATCHES = {2: [[4, 2], [2, 3]], 3: [[5, 3, 4], [3, 0, 2], [2, 2, 2]]}
CODECS = ("topk", "topkqsgd", "qsgd", "powersgd", "randomk", "ef-sign")
_cache: Dict[Any, List[Dict[str, Any]]] = {}


def job(kind: str, np: int, policy: str = "classic") -> List[Dict[str, Any]]:
    key = (kind, np, policy)
    if key not in _cache:
        env = {"PYTHONPATH": f"{ROOT}{os.pathsep}{SIGN_PLUGIN}"}
        _cache[key] = run_ranks("horovod_join:uneven", np=np, env=env, timeout=300, kind=kind,
                                batches=BATCHES[np], policy=policy, tag=f"{kind}-{policy}")
    return _cache[key]


def _join_steps(ranks: List[Dict[str, Any]]) -> Dict[Any, Dict[int, Dict[str, Any]]]:
    """(epoch, t) -> {rank: its row}, for the steps where some rank had joined."""
    out: Dict[Any, Dict[int, Dict[str, Any]]] = {}
    for r, res in enumerate(ranks):
        for row in res["steps"]:
            if row["active"] < len(ranks):
                out.setdefault((row["epoch"], row["t"]), {})[r] = row
    return out


def _trained_alike(ranks: List[Dict[str, Any]]) -> None:
    """The replicas were identical after the last step every rank took in each epoch (compressed, all
    ranks training): in the first epoch, and in the later ones, which start from sync_after_join."""
    np = len(ranks)
    for res in ranks:
        seen = [row["identical"] for row in res["steps"] if "identical" in row]
        assert seen == [True] * sum(1 for counts in BATCHES[np] if min(counts) > 0), seen


@pytest.mark.multirank
@pytest.mark.parametrize("np", [2, 3])
@pytest.mark.parametrize("kind", CODECS)
def test_join_steps_average_over_the_ranks_still_training(kind, np):
    """Each join step's averaged gradient is, bit for bit, the sum of what the ranks still training
    contributed (their decoded payloads, the small tensors as they are) divided by their number: not
    by every rank, as Horovod's own Average does under join (measured: sum / size)."""
    ranks = job(kind, np)
    steps = _join_steps(ranks)
    assert len(steps) == sum(max(c) - min(c) for c in BATCHES[np])   # every step after the first join
    checked = 0
    for (epoch, t), rows in steps.items():
        active = next(iter(rows.values()))["active"]
        assert len(rows) == active, (epoch, t, sorted(rows))
        for name in next(iter(rows.values()))["received"]:
            parts = [torch.tensor(row["contribution"][name], dtype=torch.float32) for row in rows.values()]
            if any(p.numel() == 0 for p in parts):
                continue   # PowerSGD over two ranks: its factors are not a sum of parts
            expected = torch.stack(parts).sum(0) / active
            for r, row in rows.items():
                got = torch.tensor(row["received"][name], dtype=torch.float32)
                assert torch.equal(got, expected), (kind, np, epoch, t, r, name, float((got - expected).abs().max()))
            checked += 1
    assert checked >= len(steps) * (2 if kind == "powersgd" else 4)


@pytest.mark.multirank
@pytest.mark.parametrize("np", [2, 3])
@pytest.mark.parametrize("kind", CODECS)
def test_replicas_identical_and_residuals_kept_across_join(kind, np):
    """After hvd.join() and sync_after_join every replica is identical (weights, exchange step) and
    the next epoch trains compressed without a RankDivergenceError; every rank's residuals after the
    sync are those it had when it joined (the joined rank's wait for its next step)."""
    ranks = job(kind, np)
    _trained_alike(ranks)
    for e in range(len(BATCHES[np])):
        lasts = {res["epochs"][e]["last"] for res in ranks}
        assert len(lasts) == 1 and BATCHES[np][e][lasts.pop()] == max(BATCHES[np][e])   # a rank that trained last
        for res in ranks:
            ep = res["epochs"][e]
            assert ep["replicas_identical"] and ep["finite"], (kind, np, e)
            assert len(set(ep["exchange_steps"])) == 1, ep["exchange_steps"]
            assert ep["residuals_after_sync"] == ep["residuals_before_join"], (kind, np, e)
            assert ep["residuals_before_join"], "no residual kept: error feedback was off?"


@pytest.mark.multirank
@pytest.mark.parametrize("policy", ["momentum", "frozen", "update"])
def test_every_feedback_policy_trains_on_after_join(policy):
    """momentum correction (its last average), frozen (v, the warm-up's counts) and update (private
    optimizers): the shared state comes from the rank that trained last, each rank keeps its own;
    replicas identical after each epoch, and the second epoch (compressed again) keeps them so."""
    ranks = job("topk", 3, policy)
    _trained_alike(ranks)
    for res in ranks:
        assert res["feedback"] == policy
        for ep in res["epochs"]:
            assert ep["replicas_identical"] and ep["finite"]
            assert len(set(ep["exchange_steps"])) == 1
            assert ep["residuals_after_sync"] == ep["residuals_before_join"]


def test_shared_state_keeps_each_ranks_own_and_takes_the_rest():
    """What sync_after_join moves between compressors, without ranks: momentum correction's last
    average, the random streams' counts and the exchange step come from the other rank; this rank's
    residuals, velocity, stream and seed stay."""
    import hvd_gradcomp as gc
    from hvd_gradcomp.feedback.momentum import MomentumCorrection

    def trained(stream: int, steps: int, seed: int) -> Any:
        c = gc.TopK(ratio=0.25, min_k=1, seed=seed, feedback=MomentumCorrection(momentum=0.9))
        c.stream = stream
        for s in range(steps):
            g = torch.randn(64, generator=torch.Generator().manual_seed(100 * stream + s))
            c.compress_named("w", g)
            c.received("w", torch.full((64,), float(s)))
            c.end_round(True)
        return c

    last, joined = trained(0, 5, seed=1), trained(1, 3, seed=2)
    own = joined.state_dict()
    joined.load_shared_state(last.shared_state())
    now, theirs = joined.state_dict(), last.state_dict()
    assert joined.exchange_step == last.exchange_step == 5
    assert now["steps"] == theirs["steps"] and torch.equal(now["feedback"]["delivered"]["w"],
                                                           theirs["feedback"]["delivered"]["w"])
    assert torch.equal(now["residuals"]["w"], own["residuals"]["w"])
    assert torch.equal(now["feedback"]["velocity"]["w"], own["feedback"]["velocity"]["w"])
    assert (now["stream"], now["seed"]) == (1, 2)
    assert "residuals" not in last.shared_state() and "velocity" not in last.shared_state()["feedback"]
