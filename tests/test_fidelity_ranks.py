"""Issue 9 on 2 ranks: the feedback recipe is chosen from the wrapped optimizer and said once on
rank 0, on hvd_gradcomp.DistributedOptimizer and on stock hvd.DistributedOptimizer, with
gradient accumulation; and a short training converges close to uncompressed (smoke test)."""
from __future__ import annotations

from typing import Any, Dict

import pytest

from tests.harness import run_ranks

pytestmark = pytest.mark.multirank

SCENARIOS = {
    "gc-adamw-none": dict(wrapper="gc", optimizer="adamw", compression="none"),
    "gc-adamw": dict(wrapper="gc", optimizer="adamw", compression="topkqsgd"),
    "hvd-adamw-acc2": dict(wrapper="hvd", optimizer="adamw", compression="topkqsgd", accumulate=2),
    "gc-adamw-frozen20": dict(wrapper="gc", optimizer="adamw", compression="topkqsgd", feedback="frozen20"),
    "hvd-adamw-frozen20-acc2": dict(wrapper="hvd", optimizer="adamw", compression="topkqsgd", feedback="frozen20",
                                    accumulate=2),
    "gc-sgd-none": dict(wrapper="gc", optimizer="sgd-momentum", compression="none"),
    "hvd-sgd": dict(wrapper="hvd", optimizer="sgd-momentum", compression="topkqsgd"),
    "gc-sgd-acc2": dict(wrapper="gc", optimizer="sgd-momentum", compression="topkqsgd", accumulate=2),
}
_cache: Dict[str, Any] = {}


def results() -> Dict[str, Any]:
    if not _cache:
        ids = list(SCENARIOS)
        per_rank = run_ranks("fidelity:battery", timeout=420, scenarios=[SCENARIOS[i] for i in ids])
        _cache.update({i: [r[j] for r in per_rank] for j, i in enumerate(ids)})
    return _cache


@pytest.mark.parametrize("case,policy", [("gc-adamw", "frozen"), ("hvd-adamw-acc2", "frozen"),
                                         ("hvd-sgd", "momentum"), ("gc-sgd-acc2", "momentum")])
def test_recipe_is_chosen_from_the_optimizer_and_said_once_on_rank_zero(case, policy):
    r0, r1 = results()[case]
    assert r0["feedback"] == r1["feedback"] == policy
    assert len(r0["said"]) == 1 and f"feedback '{policy}'" in r0["said"][0], r0["said"]
    assert r1["said"] == []
    assert r0["identical"] and r1["identical"], "ranks hold different parameters"


@pytest.mark.parametrize("case,base", [("gc-adamw", "gc-adamw-none"), ("hvd-adamw-acc2", "gc-adamw-none"),
                                       ("gc-adamw-frozen20", "gc-adamw-none"),
                                       ("hvd-adamw-frozen20-acc2", "gc-adamw-none"),
                                       ("hvd-sgd", "gc-sgd-none"), ("gc-sgd-acc2", "gc-sgd-none")])
def test_compressed_training_stays_close_to_uncompressed(case, base):
    """TopKQSGD(25%, 8) for 120 steps on a small teacher task: held-out loss within 15% of
    uncompressed (it falls from ~2.3 to ~0.7-0.8 uncompressed, so a broken recipe misses by far).
    The default warm-up of feedback='frozen' (100 dense steps) covers most of this run, so two
    cases freeze after 20 steps and train compressed for 100."""
    lc, lb = results()[case][0]["val_loss"], results()[base][0]["val_loss"]
    assert lb < 1.5, f"uncompressed did not learn ({lb:.3f})"
    assert lc <= lb * 1.15, f"{case}: held-out loss {lc:.4f} vs uncompressed {lb:.4f}"


@pytest.mark.parametrize("case", ["gc-adamw-frozen20", "hvd-adamw-frozen20-acc2"])
def test_frozen_variance_keeps_every_rank_identical(case):
    r0, r1 = results()[case]
    assert r0["feedback"] == "frozen" and r0["identical"] and r1["identical"]


@pytest.mark.parametrize("wrapper", ["gc", "hvd"])
def test_clipping_in_the_warm_up_does_not_shrink_the_frozen_second_moment(wrapper):
    """Gradients scaled by the user's code during Adam's dense warm-up (clip_grad_norm_ between
    synchronize() and step()): v is frozen from the gradients as exchanged, because afterwards
    the update is made from those (with a v of clipped gradients an AdamW MLP under
    clip_grad_norm_(1.0) ended at twice the held-out loss); said once with the fix (clip=)."""
    for r in run_ranks("fidelity:clipped_warmup", timeout=240, wrapper=wrapper):
        assert r["names"] == ["0.weight", "2.weight"], r["names"]
        assert r["rel"] < 1e-2, f"frozen denominators differ by {r['rel']:.3g} (a v of the scaled gradients: 0.5)"
        assert r["plain_warned"] == []
        assert len(r["scaled_warned"]) == 1 and "clip=" in r["scaled_warned"][0], r["scaled_warned"]


@pytest.mark.parametrize("wrapper", ["gc", "hvd"])
def test_clipping_momentum_corrected_averages_is_said(wrapper):
    """Under momentum correction each sent value carries its held-back updates, so clip_grad_norm_
    on the averages shrinks every step (the study's CNN: ~4x uncompressed's held-out loss): said
    once, with the fix (clip=). A loss scaler's unscale_ (a power of two), a constant factor (another
    learning rate) and code that adds to the gradients are not that mistake and stay quiet;
    unscale_ followed by a clip is."""
    for r in run_ranks("fidelity:scaled_averages", timeout=240, wrapper=wrapper):
        assert all(v["feedback"] == "momentum" and v["identical"] for v in r.values()), r
        for quiet in ("none", "unscale", "add"):
            assert r[quiet]["warned"] == [] and r[quiet]["count"] == 0, (quiet, r[quiet])
        assert r["constant"]["warned"] == [] and r["constant"]["count"] == 6, r["constant"]   # counted, not said
        for loud in ("clip", "unscale+clip"):
            assert len(r[loud]["warned"]) == 1 and r[loud]["count"] == 6, (loud, r[loud])
            assert "clip=" in r[loud]["warned"][0] and "feedback 'momentum'" in r[loud]["warned"][0]
