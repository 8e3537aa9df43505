"""Mixed precision with a loss scaler, misuse, checkpoints, and Horovod's features
(state broadcast, process sets, join, elastic resets, Horovod's own optimizer test scenarios)
with both wrappers: hvd_gradcomp.DistributedOptimizer and the stock hvd.DistributedOptimizer.

Starting 2 ranks costs seconds, so every scenario runs in one job per backend (a battery,
cached for the module); each test asserts on its part of the results.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap
from typing import Any, Dict, List

import pytest

from tests.harness import ROOT, rank_env, run_ranks

pytestmark = pytest.mark.multirank
WRAPPERS = ("ours", "stock")
KINDS = ("qsgd", "topk", "topkqsgd")
WK = [(w, k) for w in WRAPPERS for k in KINDS]
_cache: Dict[str, Dict[str, List[Any]]] = {}


def _scenarios(ckpt_dir: str) -> Dict[str, Dict[str, Any]]:
    sc: Dict[str, Dict[str, Any]] = {}
    for w, k in WK:
        for fn in ("gradscaler", "rank0_resume", "process_set_excluding", "step_after_synchronize",
                   "dynamic_requires_grad", "gradient_clipping", "unused_parameters", "names"):
            sc[f"{fn}-{w}-{k}"] = {"fn": fn, "wrapper": w, "kind": k}
        for dense in (False, True):
            sc[f"sparse_embedding-{w}-{k}-{dense}"] = {"fn": "sparse_embedding", "wrapper": w, "kind": k,
                                                       "sparse_as_dense": dense}
        if w == "ours" and k != "qsgd":
            # Case 18 is about hvd_gradcomp.DistributedOptimizer (Horovod's own optimizer clears
            # its handles). The reset is simulated without resetting Horovod, so the abandoned
            # collectives stay queued: on the stock road that hung once in a clean-clone CI run
            # (rank 0 in synchronize, rank 1 past it), and (ours, qsgd) can start a QSGD stage on
            # one rank only. Both are left to a real hvd.elastic test; see elastic_reset.
            sc[f"elastic_reset-{w}-{k}"] = {"fn": "elastic_reset", "wrapper": w, "kind": k}
    for k in ("topk", "none"):
        sc[f"requires_grad_changes-{k}"] = {"fn": "requires_grad_changes", "wrapper": "ours", "kind": k}
    sc["small_early_after_freeze"] = {"fn": "small_early_after_freeze", "wrapper": "ours", "kind": "topkqsgd"}
    sc["param_group_added_later"] = {"fn": "param_group_added_later", "wrapper": "ours", "kind": "topkqsgd"}
    for k in KINDS:
        sc[f"broadcast_bytes-{k}"] = {"fn": "broadcast_bytes", "kind": k}
        sc[f"checkpoint_checks-{k}"] = {"fn": "checkpoint_checks", "kind": k, "ckpt_dir": ckpt_dir}
    for w, k in WK:  # these leave a compressor refused or a step abandoned: after the others
        sc[f"one_owner-{w}-{k}"] = {"fn": "one_owner", "wrapper": w, "kind": k}
    for w in WRAPPERS:
        sc[f"rank_restarts_alone-{w}"] = {"fn": "rank_restarts_alone", "wrapper": w, "kind": "topk"}
    for w in WRAPPERS:  # join last: the ranks left in hvd.join() stay there until all have joined
        for k in ("qsgd", "topk", "none"):
            sc[f"join_uneven-{w}-{k}"] = {"fn": "join_uneven", "wrapper": w, "kind": k}
    return sc


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("ckpt")


def results(backend: str, ckpt_dir) -> Dict[str, List[Any]]:
    if backend not in _cache:
        scenarios = _scenarios(str(ckpt_dir / backend))
        (ckpt_dir / backend).mkdir(exist_ok=True)
        ids = list(scenarios)
        per_rank = run_ranks("horovod_features:battery", backend=backend, timeout=420,
                             env={"HOROVOD_DYNAMIC_PROCESS_SETS": "1"},
                             scenarios=[scenarios[i] for i in ids])
        _cache[backend] = {i: [r[j] for r in per_rank] for j, i in enumerate(ids)}
    return _cache[backend]


@pytest.fixture
def res(backend, ckpt_dir):
    return results(backend, ckpt_dir)


# ---------------------------------------------------------------- one behaviour per test
@pytest.mark.parametrize("wrapper,kind", WK)
def test_gradscaler_overflow_skipped_on_every_rank(res, wrapper, kind):
    """Rank 1's scaled loss is inf at step 2: every rank sees a non-finite average, every rank's
    scaler skips that step, and no residual, random stream, velocity or parameter moves;
    the compressor warns of the non-finite average at that step, through either wrapper."""
    for r in res[f"gradscaler-{wrapper}-{kind}"]:
        rows = r["rows"]
        assert [row["skipped"] for row in rows] == [False, False, True, False, False], rows
        assert [row["grads_finite"] for row in rows] == [True, True, False, True, True], rows
        # said (no silent NaN without a scaler), on every rank, at that step only
        assert [row["warned_not_finite"] for row in rows] == [False, False, True, False, False], rows
        bad = rows[2]
        assert bad["params_unchanged"] and bad["compressor_unchanged"] and bad["velocity_unchanged"], bad
        for row in rows[1:2] + rows[3:]:  # the checks can fail: good steps do change all three
            assert not (row["params_unchanged"] or row["compressor_unchanged"] or row["velocity_unchanged"]), row
        assert r["params_equal_across_ranks"] and r["finite"]


@pytest.mark.parametrize("wrapper,kind", WK)
def test_broadcast_state_after_rank0_resume(res, wrapper, kind):
    """Rank 0 alone loads the checkpoint, hvd.broadcast_optimizer_state runs Horovod's dummy
    step on rank 1 only: no hang, and both ranks continue with the same state."""
    for r in res[f"rank0_resume-{wrapper}-{kind}"]:
        assert r["state_steps"] and all(s == 2.0 for s in r["state_steps"]), r
        assert r["params_equal_across_ranks"] and r["moments_equal_across_ranks"]


@pytest.mark.parametrize("kind", KINDS)
def test_bytes_exclude_state_broadcast_step(res, kind):
    for r in res[f"broadcast_bytes-{kind}"]:
        assert r["after_broadcast"] == [0, 0, 0], "the state-broadcast dummy step exchanged something"
        assert r["total"] == r["last_step_bytes"] > 0


@pytest.mark.parametrize("wrapper,kind", WK)
def test_process_set_excluding_rank_trains_locally(res, wrapper, kind):
    r0, r1 = res[f"process_set_excluding-{wrapper}-{kind}"]
    assert r1["equals_local"], "rank 1 is outside the process set: it must train like a plain optimizer"
    assert r0["finite"] and r0["moved"] > 1e-4


@pytest.mark.parametrize("wrapper", WRAPPERS)
@pytest.mark.parametrize("kind", ["qsgd", "topk", "none"])
def test_join_with_uneven_data(res, wrapper, kind):
    """hvd_gradcomp.DistributedOptimizer: the rank still training trains on after the other joined
    (tests/test_horovod_join.py checks the averages). Stock hvd.DistributedOptimizer, compressed: a
    clear error on the rank still training, before Horovod's allgather could fail, naming the wrapper
    that carries join. Uncompressed: join works as in Horovod."""
    r0, r1 = res[f"join_uneven-{wrapper}-{kind}"]
    assert r1["error"] is None
    if kind == "none" or wrapper == "ours":
        assert r0["error"] is None
        assert r0["replicas_identical"] and r1["replicas_identical"]
    else:
        assert "hvd.join()" in r0["error"] and "use hvd_gradcomp.DistributedOptimizer" in r0["error"], r0
        assert "same number of batches" in r0["error"], r0


@pytest.mark.parametrize("wrapper,kind", [wk for wk in WK if wk[0] == "ours" and wk[1] != "qsgd"])
def test_pending_exchanges_cleared_on_load_state_dict(res, wrapper, kind):
    for r in res[f"elastic_reset-{wrapper}-{kind}"]:
        assert r["errors"] == [], r["errors"]
        assert r["params_equal_across_ranks"]


@pytest.mark.parametrize("wrapper,kind", WK)
def test_step_after_synchronize_warns_once(res, wrapper, kind):
    for r in res[f"step_after_synchronize-{wrapper}-{kind}"]:
        assert len(r["warnings"]) == 1, r["warnings"]
        if wrapper == "ours":  # no second exchange: the synchronized gradients are applied once
            assert r["applied_once"]


@pytest.mark.parametrize("wrapper,kind", WK)
@pytest.mark.parametrize("dense", [False, True])
def test_sparse_gradients_on_both_paths(res, wrapper, kind, dense):
    """nn.Embedding(sparse=True): Horovod's sparse allreduce, or sparse_as_dense=True: dense and
    compressed; the same on both wrappers, ranks identical, gradient sparse again for the step."""
    for r in res[f"sparse_embedding-{wrapper}-{kind}-{dense}"]:
        assert r["params_equal_across_ranks"] and r["embedding_moved"] and r["grad_is_sparse"], r


@pytest.mark.parametrize("wrapper,kind", WK)
def test_one_owner_per_compressor(res, wrapper, kind):
    for r in res[f"one_owner-{wrapper}-{kind}"]:
        assert r["error"] and "another optimizer" in r["error"] and "deepcopy" in r["error"], r
        if wrapper == "ours":
            assert r["reused"] is True


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_rank_out_of_step_stops_the_job_naming_it(res, wrapper):
    """No silent divergence: every payload carries its step; a rank at another step is named."""
    for r in res[f"rank_restarts_alone-{wrapper}"]:
        assert r["error"] and "rank 0 at step 2" in r["error"] and "rank 1 at step 0" in r["error"], r


@pytest.mark.parametrize("kind", KINDS)
def test_checkpoint_validation(res, kind):
    for r in res[f"checkpoint_checks-{kind}"]:
        assert r["mid_window_save"] == r["mid_window_load"] and "flush()" in r["mid_window_save"]
        assert "steps" in r["malformed"] and "Nothing was changed" in r["malformed"], r["malformed"]
        assert "(of another run)" in r["other_kind"] and "Nothing was changed" in r["other_kind"]
        assert r["unchanged_after_refusals"]
        assert r["stream"] == r["rank"], "this rank's noise stream must survive a load"
        assert len(r["stream_warnings"]) == (1 if r["rank"] == 1 else 0), r["stream_warnings"]


def test_resume_at_another_world_size(backend, res, ckpt_dir):
    """A 2-rank checkpoint loaded by a 1-rank job: the message names both world sizes."""
    if backend != "gloo":
        pytest.skip("one single-process check is enough")
    path = ckpt_dir / backend / "s{}-rank0.pt"
    tag = list(_scenarios("")).index("checkpoint_checks-qsgd")
    code = textwrap.dedent(f"""
        import torch, horovod.torch as hvd, hvd_gradcomp as gc
        from tests.workers.integration import make_model
        from tests.workers.horovod_features import named
        hvd.init()
        model = make_model()
        opt = gc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      named_parameters=named(model, "s{tag}"), compression=gc.QSGD(bits=8, seed=5),
                                      min_compress_numel=1, backward_passes_per_step=2)
        acc = gc.GradientAccumulator(opt, steps=2)
        try:
            acc.load_state_dict(torch.load({str(path).format(tag)!r}))
        except ValueError as e:
            print("ERROR:", e)
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=rank_env(), capture_output=True,
                         text=True, timeout=120)
    assert "ERROR:" in out.stdout, out.stdout + out.stderr
    assert "saved with 2 ranks, this job has 1" in out.stdout


# ---------------------------------------------------------------- Horovod's optimizer tests
@pytest.mark.parametrize("wrapper,kind", WK)
def test_horovod_dynamic_requires_grad(res, wrapper, kind):
    for r in res[f"dynamic_requires_grad-{wrapper}-{kind}"]:
        assert r["grads_as_expected"] and r["params_equal_across_ranks"]


@pytest.mark.parametrize("kind", ["topk", "none"])
def test_a_layer_unfrozen_after_wrapping_is_exchanged_and_a_frozen_one_stays(res, kind):
    """hvd_gradcomp.DistributedOptimizer: a layer unfrozen after the optimizer was built is hooked then and
    trains exactly as if trainable from the start (before, each rank stepped it on its own gradient and
    the ranks drifted apart); a layer frozen mid-run stops moving, momentum SGD or not."""
    for r in res[f"requires_grad_changes-{kind}"]:
        assert r["late_equals_reference"] and r["late_fc1_moved"], r
        assert r["frozen_fc1_still"], r
        assert r["params_equal_across_ranks"], r


def test_a_param_group_added_after_wrapping_is_bound_to_the_policy(res):
    """add_param_group on the wrapped optimizer (progressive unfreezing): the new parameters are exchanged,
    DGC's correction reads the new group's momentum, "frozen" knows them (before: a RuntimeError at their
    first compressed step); a parameter without a name is refused, naming the fix."""
    for r in res["param_group_added_later"]:
        assert r["sgd"]["policy"] == "momentum" and r["sgd"]["momentum_read"] == 0.5, r["sgd"]
        assert r["adamw"]["policy"] == "frozen" and r["adamw"]["bound"], r["adamw"]
        for o in ("sgd", "adamw"):
            assert r[o]["fc1_moved"] and r[o]["params_equal_across_ranks"], r[o]
        assert "no name in the named_parameters" in r["unnamed"] and "whole model" in r["unnamed"]


def test_small_tensors_leave_during_backward_after_adams_warm_up(res):
    """The small tensors' fused allreduce leaves during backward at every step, also once Adam's dense
    warm-up is over (its list of small tensors was kept from the first step, when every tensor went dense,
    so after the warm-up it waited for synchronize())."""
    for r in res["small_early_after_freeze"]:
        assert r["early"] == [True] * 5, r["early"]
        assert r["params_equal_across_ranks"]


@pytest.mark.parametrize("wrapper,kind", WK)
def test_horovod_gradient_clipping(res, wrapper, kind):
    for r in res[f"gradient_clipping-{wrapper}-{kind}"]:
        assert all(n <= 0.05 * (1 + 1e-5) for n in r["norms"]), r["norms"]
        assert r["params_equal_across_ranks"]


@pytest.mark.parametrize("wrapper,kind", WK)
def test_horovod_unused_parameters(res, wrapper, kind):
    for r in res[f"unused_parameters-{wrapper}-{kind}"]:
        assert r["params_equal_across_ranks"]
        assert r["unused_unchanged"]  # zeros and an empty residual: zeros come back


@pytest.mark.parametrize("wrapper,kind", WK)
def test_horovod_duplicate_and_missing_names(res, wrapper, kind):
    for r in res[f"names-{wrapper}-{kind}"]:
        assert r["errors"]["duplicate"] and "duplicate" in r["errors"]["duplicate"].lower()
        assert r["errors"]["missing"] and "name" in r["errors"]["missing"]
        assert r["params_equal_across_ranks"]
