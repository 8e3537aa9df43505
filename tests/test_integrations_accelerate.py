"""hvd_gradcomp.integrations.accelerate with the real accelerate (the ``accelerate`` extra).

The multi-rank tests run one torchrun job of 2 Gloo ranks (tests/accelerate_workers.py is the rank
side; ``accelerate launch --cpu`` starts one process on this machine, torchrun two):

* ``register`` takes what ``accelerator.prepare`` returned (the DDP model, the ``AcceleratedOptimizer``)
  and binds the feedback policy to the torch optimizer inside;
* ``accelerator.accumulate`` gives one exchange per optimizer step and the same weights, bit for
  bit, as ``hvd_gradcomp.ddp.GradientAccumulator`` on the same batches (AdamW under ``frozen``, past
  its warm-up, accumulating 2; momentum SGD accumulating 3; both with ``clip=``);
* ``accelerator.save_state`` (every process; the main one writes) with ``register_for_checkpointing``
  keeps both ranks' hook state, and ``load_state`` in a fresh set-up continues bit-identically.

The unit tests below start no ranks.
"""
from __future__ import annotations

import sys
from typing import Any, Dict, List

import pytest
import torch

from tests.harness import ROOT
from tests.torchrun_jobs import run_torchrun

WORKER = ROOT / "tests" / "accelerate_workers.py"
_cache: Dict[str, Any] = {}


@pytest.fixture(scope="module")
def battery(tmp_path_factory) -> Dict[str, List[Any]]:
    if "all" not in _cache:
        ckpt = tmp_path_factory.mktemp("accelerate") / "state"
        scenarios = {
            "adamw": {"fn": "accumulate", "optimizer": "adamw", "accumulate": 2, "micro": 12},
            "sgd": {"fn": "accumulate", "optimizer": "sgd", "accumulate": 3, "micro": 12},
            "checkpoint": {"fn": "checkpoint", "optimizer": "adamw", "accumulate": 2, "micro": 8, "ckpt": str(ckpt)},
        }
        per_rank = run_torchrun(WORKER, list(scenarios.values()), timeout=150)
        _cache["all"] = {sid: [per_rank[0][i], per_rank[1][i]] for i, sid in enumerate(scenarios)}
    return _cache["all"]


@pytest.mark.multirank
@pytest.mark.timeout(200)
@pytest.mark.parametrize("sid,accumulate", [("adamw", 2), ("sgd", 3)])
def test_accumulate_is_one_exchange_per_step_and_bit_identical_to_the_gradient_accumulator(battery, sid, accumulate):
    for r in battery[sid]:
        assert r["identical"], f"max |diff| {r['max_diff']}"
        steps = 12 // accumulate
        assert r["exchanges"] == r["ref_exchanges"] == r["ref_steps"] == steps
        # the exchange happens at the window's last micro-batch, never inside no_sync
        assert r["iters"] == [(i + 1) // accumulate for i in range(12)]
        assert r["payload"] < r["raw"] / 4 and r["pending"] == 0


@pytest.mark.multirank
@pytest.mark.timeout(200)
@pytest.mark.parametrize("sid,feedback,bound", [("adamw", "frozen", "AdamW"), ("sgd", "momentum", "SGD")])
def test_register_takes_the_prepared_model_and_optimizer_as_they_come(battery, sid, feedback, bound):
    r = battery[sid][0]
    assert (r["model_type"], r["opt_type"]) == ("DistributedDataParallel", "AcceleratedOptimizer")
    assert (r["bound_to"], r["feedback"]) == (bound, feedback)


@pytest.mark.multirank
@pytest.mark.timeout(200)
def test_save_state_keeps_every_ranks_hook_state_and_resumes_bit_identically(battery):
    for r in battery["checkpoint"]:
        assert r["identical"], f"max |diff| {r['max_diff']}"
        assert (r["saved_iter"], r["resumed_iter"], r["iter"]) == (4, 4, 8)
        assert "counted since the resume at step 4" in r["summary"]
        assert "custom_checkpoint_0.pkl" in r["files"]
        assert r["saved_all_ranks"] and r["saved_ranks"] == 2   # the main process's file holds both ranks'


# ---------------------------------------------------------------- no ranks
def test_register_refuses_a_model_prepare_did_not_wrap() -> None:
    from hvd_gradcomp.integrations import accelerate as gc_accelerate

    with pytest.raises(TypeError, match=r"only when several processes run .* Accelerator\(cpu=True\)"):
        gc_accelerate.register(torch.nn.Linear(4, 4))


def test_register_for_checkpointing_needs_the_accelerator_and_names_the_extra(monkeypatch) -> None:
    from hvd_gradcomp.integrations import accelerate as gc_accelerate

    with pytest.raises(TypeError, match="takes the Accelerator"):
        gc_accelerate.register_for_checkpointing(object(), None)
    monkeypatch.setitem(sys.modules, "accelerate", None)   # as if not installed
    with pytest.raises(ImportError, match=r"pip install 'hvd-gradcomp\[accelerate\]'"):
        gc_accelerate.register_for_checkpointing(object(), None)
