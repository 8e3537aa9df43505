"""hvd_gradcomp.integrations.lightning.GradCompStrategy with the real Lightning (the ``lightning`` extra).

The multi-rank tests run one torchrun job of 2 Gloo ranks (tests/lightning_workers.py is the rank
side) with every scenario, and assert on its parts:

* Lightning against plain DDP + ``hvd_gradcomp.ddp.register`` + ``GradientAccumulator``, same
  compressor, seed and batches: AdamW (``frozen``, past its warm-up) with ``accumulate_grad_batches=2``
  and ``gradient_clip_val=1.0``, and momentum SGD: bit-identical weights, one exchange per step;
* a ``ModelCheckpoint`` (written by rank 0) and ``fit(ckpt_path=...)`` in a new Trainer continue
  bit-identically to an uninterrupted run;
* a second ``fit`` on the same Trainer carries the hook state on;
* ``gradient_clip_algorithm="value"`` is refused on every rank with the reason.

The unit tests below start no ranks.
"""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, List

import pytest

from tests.harness import ROOT
from tests.torchrun_jobs import run_torchrun

WORKER = ROOT / "tests" / "lightning_workers.py"
_cache: Dict[str, Any] = {}


@pytest.fixture(scope="module")
def battery(tmp_path_factory) -> Dict[str, List[Any]]:
    if "all" not in _cache:
        root = tmp_path_factory.mktemp("lightning")
        scenarios = {
            "adamw": {"fn": "match_ddp", "optimizer": "adamw", "accumulate": 2, "clip": 1.0, "epochs": 2},
            "sgd": {"fn": "match_ddp", "optimizer": "sgd", "accumulate": 1, "clip": 0, "epochs": 2},
            "resume": {"fn": "resume", "optimizer": "adamw", "accumulate": 2, "clip": 1.0},
            "refit": {"fn": "refit"},
            "refusals": {"fn": "refusals"},
        }
        jobs = [dict(job, root=str(root / sid)) for sid, job in scenarios.items()]
        per_rank = run_torchrun(WORKER, jobs, timeout=150)
        _cache["all"] = {sid: [per_rank[0][i], per_rank[1][i]] for i, sid in enumerate(scenarios)}
    return _cache["all"]


@pytest.mark.multirank
@pytest.mark.timeout(200)
@pytest.mark.parametrize("sid", ["adamw", "sgd"])
def test_lightning_trains_bit_identically_to_plain_ddp_with_the_hook(battery, sid):
    for r in battery[sid]:
        assert r["identical"], f"max |diff| {r['max_diff']}"
        assert r["compressed_bytes"] < r["raw_bytes"] / 4   # the compressed phase was reached
        assert r["pending"] == 0                              # optimizer.step(closure) applied every update
    r = battery[sid][0]
    assert r["optimizer_type"] == ("AdamW" if sid == "adamw" else "SGD")   # the trainer's optimizer, unwrapped
    assert r["feedback"] == ("frozen" if sid == "adamw" else "momentum")


@pytest.mark.multirank
@pytest.mark.timeout(200)
@pytest.mark.parametrize("sid", ["adamw", "sgd"])
def test_one_exchange_per_optimizer_step_with_accumulate_grad_batches(battery, sid):
    for r in battery[sid]:
        steps = r["global_step"]
        assert r["exchanges"] == steps == r["ref_exchanges"] == r["ref_steps"]
        assert r["iters_at_steps"] == list(range(1, steps + 1))   # the step's exchange, before its step


@pytest.mark.multirank
@pytest.mark.timeout(200)
def test_gradient_clip_val_becomes_the_compressors_clip(battery):
    for r in battery["adamw"]:
        assert r["compressor_clip"] == 1.0
        assert r["clip_vals_seen"] == [None] * r["global_step"]   # Lightning clipped no average
        assert r["clip_after"] == 1.0                              # the trainer's setting given back
    assert all(r["compressor_clip"] is None for r in battery["sgd"])


@pytest.mark.multirank
@pytest.mark.timeout(200)
def test_checkpoint_and_resume_through_lightning_continue_bit_identically(battery):
    for r in battery["resume"]:
        assert r["identical"], f"max |diff| {r['max_diff']}"
        assert r["saved_iter"] == 8 and r["iter"] == r["global_step"] == 16
        assert "counted since the resume at step 8" in r["summary"]
    r0 = battery["resume"][0]
    assert r0["saved_all_ranks"] and r0["saved_ranks"] == 2   # rank 0's file holds both ranks' hook state
    assert "last.ckpt" in r0["files"]


@pytest.mark.multirank
@pytest.mark.timeout(200)
def test_a_second_fit_on_the_same_trainer_carries_the_hook_state_on(battery):
    for r in battery["refit"]:
        assert r["after_first"] == [8, 1.0]                    # the trainer's clip given back after fit
        assert r["iter"] == r["global_step"] == 16
        assert r["new_state"] and r["new_compressor"] and r["clip"] == 1.0 and r["clip_after"] == 1.0


@pytest.mark.multirank
@pytest.mark.timeout(200)
def test_clipping_by_value_is_refused_on_every_rank(battery):
    for r in battery["refusals"]:
        assert "gradient_clip_algorithm='value'" in r["value"] and "norm" in r["value"]


# ---------------------------------------------------------------- no ranks
def _strategy(**kw: Any) -> Any:
    from hvd_gradcomp.integrations.lightning import GradCompStrategy

    return GradCompStrategy(**kw)


def test_lightnings_own_hook_keywords_are_refused() -> None:
    with pytest.raises(ValueError, match="registers hvd-gradcomp's hook itself; drop ddp_comm_hook"):
        _strategy(ddp_comm_hook=lambda state, bucket: None)


def test_norm_clipping_moves_into_the_compressor_and_value_clipping_is_refused() -> None:
    import hvd_gradcomp as gc

    strategy = _strategy(compression=gc.TopKQSGD(ratio=0.01, bits=8, seed=1))
    trainer = SimpleNamespace(gradient_clip_val=0.5, gradient_clip_algorithm=None)
    strategy._take_clipping(trainer)
    assert strategy.compression.clip == 0.5 and trainer.gradient_clip_val is None
    assert strategy._clip_moved == (trainer, 0.5)

    with pytest.raises(ValueError, match="gradient_clip_algorithm='value'"):
        _strategy(compression=gc.QSGD(bits=8))._take_clipping(SimpleNamespace(gradient_clip_val=1.0,
                                                                              gradient_clip_algorithm="value"))
    disagree = _strategy(compression=gc.TopKQSGD(ratio=0.01, bits=8, seed=1, clip=2.0))
    with pytest.raises(ValueError, match="disagree"):
        disagree._take_clipping(SimpleNamespace(gradient_clip_val=0.5, gradient_clip_algorithm="norm"))
    with pytest.raises(ValueError, match="Auto has no clip="):
        _strategy(compression=gc.Auto())._take_clipping(SimpleNamespace(gradient_clip_val=1.0,
                                                                         gradient_clip_algorithm=None))
    uncompressed = _strategy(compression=None)     # plain averages: Lightning clips them as usual
    trainer = SimpleNamespace(gradient_clip_val=1.0, gradient_clip_algorithm=None)
    uncompressed._take_clipping(trainer)
    assert trainer.gradient_clip_val == 1.0


def test_without_lightning_the_strategy_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from hvd_gradcomp.integrations import lightning as gc_lightning

    monkeypatch.setattr(gc_lightning, "_BUILT", {})
    monkeypatch.setitem(sys.modules, "lightning.pytorch", None)   # as if not installed
    with pytest.raises(ImportError, match=r"pip install 'hvd-gradcomp\[lightning\]'"):
        gc_lightning.GradCompStrategy


def test_the_strategy_class_pickles_by_name() -> None:
    """Lightning's spawn launchers pickle the trainer, strategy included."""
    import pickle

    from hvd_gradcomp.integrations.lightning import GradCompStrategy

    assert pickle.loads(pickle.dumps(GradCompStrategy)) is GradCompStrategy
    assert Path(sys.modules[GradCompStrategy.__module__].__file__).name == "lightning.py"
