"""Horovod integration on 2 ranks, under Gloo and under MPI (issue 4, tests a-f).

Starting ranks costs seconds, so related scenarios run as one job per backend (a
"battery", cached for the module) and each test asserts on its part of the results.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List

import pytest

from tests.harness import run_ranks

pytestmark = pytest.mark.multirank
COMPRESSORS = {"qsgd8": ("qsgd", {"bits": 8}), "qsgd4": ("qsgd", {"bits": 4}),
               "topk": ("topk", {"ratio": 0.05}), "topkqsgd": ("topkqsgd", {"ratio": 0.05, "bits": 8})}
DENSE = {"none": ("none", {}), "fp16": ("fp16", {})}
BYTES = {"topkqsgd": ("topkqsgd", {"ratio": 0.01, "bits": 8}, 150), "qsgd8": ("qsgd", {"bits": 8}, 3.9),
         "qsgd4": ("qsgd", {"bits": 4}, 7.8), "qsgd2": ("qsgd", {"bits": 2}, 15.0),
         "topk": ("topk", {"ratio": 0.01}, 60), "none": ("none", {}, 1.0)}
_cache: Dict[Any, List[Any]] = {}


def battery(backend: str, group: str, tmp_path_factory=None) -> Dict[str, Any]:
    """Results of one job running every scenario of ``group``, keyed by scenario id (rank 0 and 1)."""
    key = (backend, group)
    if key not in _cache:
        scenarios = SCENARIOS[group](tmp_path_factory)
        ids = list(scenarios)
        per_rank = run_ranks("integration:battery", backend=backend, timeout=300,
                             scenarios=[scenarios[i] for i in ids])
        _cache[key] = {i: [rank_result[j] for rank_result in per_rank] for j, i in enumerate(ids)}
    return _cache[key]


def _gradient_scenarios(_):
    sc = {f"ours-{k}": {"fn": "compressed_gradient", "kind": kind, **kw}
          for k, (kind, kw) in {**COMPRESSORS, **DENSE}.items()}
    sc.update({f"stock-{k}": {"fn": "compressed_gradient", "kind": kind, "stock": True, **kw}
               for k, (kind, kw) in COMPRESSORS.items()})
    sc["ours-topk-sum"] = {"fn": "compressed_gradient", "kind": "topk", "op": "sum", "ratio": 0.05}
    sc["ours-qsgd-sum"] = {"fn": "compressed_gradient", "kind": "qsgd", "op": "sum", "bits": 8}
    sc.update({f"exempt-{road}-{op}": {"fn": "exempt_half", "stock": road == "stock", "op": op}
               for road in ("ours", "stock") for op in ("average", "sum")})
    sc["errors"] = {"fn": "stock_errors"}
    sc["noise"] = {"fn": "independent_noise"}
    sc["prepared"] = {"fn": "prepared_groups"}
    return sc


def _accumulation_scenarios(_):
    return {"ours": {"fn": "accumulation", "n": 4, "micro": 4},
            "stock": {"fn": "accumulation", "n": 4, "micro": 4, "stock": True},
            "partial": {"fn": "accumulation", "n": 4, "micro": 4, "partial": 3},
            "partial-stock": {"fn": "accumulation", "n": 4, "micro": 4, "partial": 3, "stock": True}}


def _bytes_scenarios(_):
    return {k: {"fn": "bytes_per_step", "kind": kind, **kw} for k, (kind, kw, _) in BYTES.items()}


def _checkpoint_scenarios(tmp_path_factory):
    sc = {kind: {"fn": "checkpoint_resume", "kind": kind, "ckpt_dir": str(tmp_path_factory.mktemp(kind))}
          for kind in ("topkqsgd", "qsgd", "topk", "none")}
    sc["topkqsgd-stock"] = {"fn": "checkpoint_resume", "kind": "topkqsgd", "stock": True,
                            "ckpt_dir": str(tmp_path_factory.mktemp("topkqsgd-stock"))}
    for stock in (False, True):   # Auto's state through GradientAccumulator (it refused to load it)
        key = f"auto{'-stock' if stock else ''}"
        sc[key] = {"fn": "checkpoint_resume", "kind": "auto", "stock": stock, "ckpt_dir": str(tmp_path_factory.mktemp(key))}
    # With a scheduler, resumed after the freeze and inside the warm-up, on both wrappers.
    for stock in (False, True):
        for where, extra in (("frozen", {}), ("warmup", {"warmup": 4, "window": 4})):
            key = f"topkqsgd-scheduled-{where}{'-stock' if stock else ''}"
            sc[key] = {"fn": "checkpoint_resume", "kind": "topkqsgd", "stock": stock, "schedule": True, **extra,
                       "ckpt_dir": str(tmp_path_factory.mktemp(key))}
    return sc


def _clipped_scenarios(_):
    # SGD with momentum uncompressed; TopKQSGD with AdamW (frozen: dense warm-up, clipped as usual)
    # and, refused, with SGD with momentum (momentum correction)
    return {f"{kind}-{opt}{'-stock' if stock else ''}": {"fn": "accumulation_clipped", "kind": kind, "stock": stock,
                                                          "optimizer": opt}
            for kind, opt in (("none", "sgd"), ("topkqsgd", "adamw"), ("topkqsgd", "sgd")) for stock in (False, True)}


def _bfloat16_scenarios(_):
    return {f"{kind}{'-stock' if stock else ''}": {"fn": "bfloat16_model", "kind": kind, "stock": stock}
            for kind in ("topkqsgd", "auto") for stock in (False, True)}


def _float64_scenarios(_):
    return {f"{kind}{'-stock' if stock else ''}": {"fn": "float64_layer", "kind": kind, "stock": stock}
            for kind in ("topkqsgd", "auto") for stock in (False, True)}


SCENARIOS = {"gradient": _gradient_scenarios, "accumulation": _accumulation_scenarios, "clipped": _clipped_scenarios,
             "bfloat16": _bfloat16_scenarios, "float64": _float64_scenarios,
             "bytes": _bytes_scenarios, "checkpoint": _checkpoint_scenarios}


def _check_gradient(results: List[Dict[str, Any]], kind: str) -> None:
    for r in results:
        for name, same, err, bound, rel in zip(r["names"], r["identical"], r["max_err"], r["bound"], r["rel_err"]):
            assert same, f"{name}: ranks hold different gradients"
            assert err <= bound, f"{name}: error {err} above the {kind} bound {bound} (relative {rel})"


@pytest.mark.parametrize("case", [*COMPRESSORS, *DENSE, "topk-sum", "qsgd-sum"])
def test_compressed_gradient_matches_reference(backend, case):
    """(a) gc.DistributedOptimizer: identical on every rank, within the compressor's bound."""
    kind = {**COMPRESSORS, **DENSE}.get(case, (case.split("-")[0],))[0]
    _check_gradient(battery(backend, "gradient")[f"ours-{case}"], kind)


@pytest.mark.parametrize("case", list(COMPRESSORS))
def test_stock_horovod_optimizer_with_each_compressor(backend, case):
    """(f) the unmodified hvd.DistributedOptimizer with our compressors."""
    _check_gradient(battery(backend, "gradient")[f"stock-{case}"], COMPRESSORS[case][0])


def test_misuse_gives_clear_errors(backend):
    msgs = battery(backend, "gradient")["errors"][0]["messages"]
    assert len(msgs) == 2
    assert "needs name=" in msgs[0]
    assert "Adasum" in msgs[1]


def test_ranks_draw_independent_noise_with_the_same_seed(backend):
    """Same gradient, same explicit seed on both ranks: different payloads on every road (stock
    hvd.DistributedOptimizer, hvd_gradcomp.DistributedOptimizer, a direct compress(name=))."""
    r0, r1 = (r["digests"] for r in battery(backend, "gradient")["noise"])
    assert set(r0) == {"stock-qsgd", "stock-topkqsgd", "ours-topkqsgd", "direct"}
    same = sorted(road for road in r0 if r0[road] == r1[road])
    assert not same, f"ranks drew the same rounding noise on: {same}"


def test_fused_groups_prepared_in_flight_give_the_same_gradients(backend):
    """Issue 13: preparing a fused group while its allgather travels (out of synchronize()),
    summing this rank's part from its encoder instead of decoding its payload, zeroing p.grad
    before the wait and (two ranks) adding this rank's part to it there change no bit of the gradients or parameters, on any rank, and p.grad still
    holds the local gradient between backward() and step()."""
    for r in battery(backend, "gradient")["prepared"]:
        assert all(r["same"].values()), r["same"]
        assert r["ranks_equal"]
        # held in flight: each of the 3 steps waits on both groups in synchronize(), each zeroed
        # there (3 members) unless the shortcuts are off
        assert r["zeroed"]["prepare=True,in_flight=True"] == 3 * 3, r["zeroed"]
        assert r["zeroed"]["own payloads decoded, zeroed after the wait"] == 0, r["zeroed"]
        # and with two ranks each of them got this rank's part there, before the wait
        assert r["held"]["prepare=True,in_flight=True"] == 3 * 3, r["held"]
        assert r["held"]["own payloads decoded, zeroed after the wait"] == 0, r["held"]
        # step 1 launches its last group at synchronize() (unprepared); steps 2-3 launch both during
        # backward; with the allgathers held in flight every one of them is prepared
        assert r["prepared"]["prepare=True,in_flight=True"] == [2] + [2, 1] * 2, r["prepared"]
        assert r["prepared"]["prepare=False,in_flight=True"] == []
        assert r["moved"] == 0.0
        assert r["grads_after_backward_nonzero"]


@pytest.mark.parametrize("case", ["ours", "stock"])
def test_accumulation_equals_large_batch(backend, case):
    """(b) 4 micro-batches of 4 == one batch of 16: gradient and parameters, rel. error <= 1e-5."""
    for r in battery(backend, "accumulation")[case]:
        assert r["stepped"] == [False, False, False, True]
        assert r["grad_rel"] <= 1e-5 and r["param_rel"] <= 1e-5, r
        assert r["grads_zeroed"]
        assert r["describe"] == "micro-batch 4 x 4 steps x 2 ranks = effective batch 32"


@pytest.mark.parametrize("case", ["partial", "partial-stock"])
def test_partial_window_flush(backend, case):
    """(b) 3 of 4 micro-batches then flush() == one batch of 12."""
    for r in battery(backend, "accumulation")[case]:
        assert r["stepped"] == [False, False, False, True]
        assert r["optimizer_steps"] == 1
        assert r["grad_rel"] <= 1e-5 and r["param_rel"] <= 1e-5, r


@pytest.mark.parametrize("case", list(BYTES))
def test_bytes_handed_to_horovod_match_ratio(backend, case):
    """(c) compressed tensors shrink by the compressor's ratio; small ones go dense, fused."""
    min_ratio = BYTES[case][2]
    for r in battery(backend, "bytes")[case]:
        ratio = r["raw_big"] / r["sent_big"]
        assert ratio >= min_ratio, r
        if case == "none":
            assert ratio == 1.0
        assert r["last_step_bytes"] == r["sent_big"] + r["small_bytes"], r
        if r["compressor_ratio"] is not None:   # the compressor's own count of its payloads agrees
            assert r["compressor_ratio"] >= min_ratio, r


@pytest.mark.parametrize("kind", ["topkqsgd", "qsgd", "topk", "none", "topkqsgd-stock",
                                  "topkqsgd-scheduled-frozen", "topkqsgd-scheduled-frozen-stock",
                                  "topkqsgd-scheduled-warmup", "topkqsgd-scheduled-warmup-stock", "auto", "auto-stock"])
def test_checkpoint_resume_is_identical(backend, kind, tmp_path_factory):
    """(d) stop, save per-rank state, rebuild everything, resume == never stopped; the biases'
    float16 road (exempt="fp16") is checkpointed with the rest. The scheduled cases: Adam under a
    rate that changes every step, resumed after v was frozen and inside the dense warm-up (its
    window of squared gradients under way), on both wrappers: the feedback policy reads the param
    groups the optimizer's load_state_dict put in place, and the warm-up's window is saved (on
    hvd_gradcomp.DistributedOptimizer with the float16 residuals of the weights' warm-up)."""
    for r in battery(backend, "checkpoint", tmp_path_factory)[kind]:
        assert r["moved"] > 1e-3, "training did not change the parameters: the test would prove nothing"
        assert r["identical"], f"resumed run differs by {r['max_diff']}"
        assert r["optimizer_steps"] == 6
        if kind == "topkqsgd-scheduled-warmup":   # saved inside frozen's warm-up: the weights go float16 too
            assert r["half_residuals"] == {"fc1.weight": 8192, "fc1.bias": 128, "fc2.weight": 1280, "fc2.bias": 10}, \
                r["half_residuals"]
        elif kind not in ("none", "auto", "auto-stock"):
            assert r["half_residuals"] == {"fc1.bias": 128, "fc2.bias": 10}, r["half_residuals"]


@pytest.mark.parametrize("road", ["ours", "stock"])
@pytest.mark.parametrize("op", ["average", "sum"])
def test_exempt_tensors_travel_as_float16_with_error_feedback(backend, road, op):
    """Issue 9: a tensor under min_compress_numel, on hvd_gradcomp.DistributedOptimizer (the fused
    allreduce) and inside stock hvd.DistributedOptimizer: its average is float16 arithmetic done
    independently (bit-exact), identical on every rank, never inf although values reach 2e6
    (beyond float16), and over the steps what arrived plus what the ranks still owe is the sum of
    the true averages; 2 bytes a value are counted; a NaN/Inf on one rank arrives on every rank
    and the step's residuals are put back."""
    for r in battery(backend, "gradient")[f"exempt-{road}-{op}"]:
        assert r["identical"] and r["first_exact"], r
        assert r["received_finite"] and r["owed_max"] > 1e5, "values beyond float16 must be delayed, not lost"
        assert r["err_over_tol"] <= 1.0, r
        assert r["bytes"] == [4 * 10 * 5, 2 * 10 * 5], r["bytes"]   # 5 steps of 10 float32 values, as float16
        assert r["fp32_fused"] == []
        assert r["nonfinite_where"] == [3, 4] and r["rolled_back"], r


@pytest.mark.parametrize("mode", ["raise", "kill"])
def test_failing_rank_ends_job(backend, mode):
    """(e) a rank that raises or is killed makes the job exit non-zero by itself: the harness fails
    the test (with every rank's output) if the job has to be killed at the timeout instead."""
    [res] = run_ranks("integration:failing_rank", backend=backend, mode=mode, expect_fail=True, timeout=240)
    assert res["returncode"] != 0
    assert "rank 1 going down" in res["output"]


@pytest.mark.parametrize("case", ["none-sgd", "none-sgd-stock", "topkqsgd-adamw", "topkqsgd-adamw-stock"])
def test_accumulator_clips_the_averaged_gradients(backend, case):
    """GradientAccumulator(max_grad_norm=...) is Horovod's clipping pattern (synchronize, clip,
    step) written out: the same parameters bit for bit and the same norms, on every rank; the
    norm is large enough that clipping acts."""
    for r in battery(backend, "clipped")[case]:
        assert r["identical"] and r["ranks_equal"], r
        assert r["norms"] == r["ref_norms"] and min(r["norms"]) > 0.05, r


@pytest.mark.parametrize("case", ["topkqsgd-sgd", "topkqsgd-sgd-stock"])
def test_accumulator_refuses_to_clip_momentum_corrected_averages(backend, case):
    """Under momentum correction each sent coordinate carries its accumulated velocity (a norm far
    above a gradient's): max_grad_norm is refused, pointing at clip=."""
    for r in battery(backend, "clipped")[case]:
        assert r["refused"] and "clip=" in r["refused"] and "feedback 'momentum'" in r["refused"], r
        # hvd_gradcomp's optimizer chose the policy when built: refused by GradientAccumulator(...) itself;
        # inside stock Horovod's the choice waits for the first step
        assert r["at"] == ("step" if case.endswith("-stock") else "construction"), r


@pytest.mark.parametrize("case", ["topkqsgd", "topkqsgd-stock", "auto", "auto-stock"])
def test_bfloat16_model_trains_through_horovods_cpu_collectives(backend, case):
    """Horovod 0.28.1's Gloo and MPI allreduce refuse bfloat16: the uncompressed tensors of a
    bfloat16 model travel as float32 (exact: the float32 average cast to bfloat16), compressed
    ones as payloads, on both wrappers, with TopKQSGD and with Auto; ranks stay identical.
    (Inside stock Horovod, Auto routes the small tensors too, some by its float16 road: not exact.)"""
    for r in battery(backend, "bfloat16")[case]:
        assert r["dtype"] == "torch.bfloat16" and r["small"] == ["fc1.bias", "fc2.bias"], r
        assert r["ranks_equal"] and (r["exact"] or case == "auto-stock"), r


@pytest.mark.parametrize("case", ["topkqsgd", "topkqsgd-stock", "auto", "auto-stock"])
def test_a_float64_layer_travels_as_it_is(backend, case):
    """The wire encodes float32, float16 and bfloat16: a large float64 layer goes uncompressed on both
    wrappers (on hvd_gradcomp's it crashed at the first backward), its average every rank's float64
    gradient averaged, with AdamW's second moment frozen past the warm-up (the policy's norm of a
    float64 gradient raised in torch); ranks stay identical."""
    for r in battery(backend, "float64")[case]:
        assert r["dtype"] == "torch.float64" and r["worst_rel"] < 1e-12, r
        assert r["ranks_equal"] and all(math.isfinite(v) for v in r["losses"]), r
