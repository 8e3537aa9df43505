"""The Horovod-facing layer without starting ranks: the adapter's errors, every argument and
misuse error of DistributedOptimizer and GradientAccumulator, and the pure reduction helpers.

Horovod's optimizer frames are reproduced by code compiled under the file name Horovod's
optimizer has (the adapter recognises its caller by that name, see
``hvd_gradcomp.horovod.HOROVOD_INTERNALS``); what needs ``hvd.init()`` runs Horovod's real
optimizer in one plain process (:func:`tests.harness.run_single`).
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Dict

import pytest
import torch

hvd = pytest.importorskip("horovod.torch")

import hvd_gradcomp as gc  # noqa: E402
from hvd_gradcomp import horovod as adapter  # noqa: E402
from hvd_gradcomp import settings  # noqa: E402
from hvd_gradcomp.collectives import exchange  # noqa: E402
from hvd_gradcomp.collectives.exchange import JoinGuard, JoinNotSupportedError  # noqa: E402
from hvd_gradcomp.collectives.reduce import (chunk_bounds, decode_payloads, finite_at_indices,  # noqa: E402
                                             reduce_payloads, sum_parts)
from tests.harness import run_single  # noqa: E402

# What Horovod 0.28.1's optimizers do around compress(), under their file name.
_FAKE_HOROVOD = '''
class Optimizer:
    def __init__(self, compression, **attrs):
        self._compression = compression
        self.__dict__.update(attrs)

    def _allreduce_grad_async(self, p):
        tensor = p.grad
        if p.grad.is_sparse and getattr(self, "sparse_as_dense", False):
            tensor = tensor.to_dense()
        return self._compression.compress(tensor)

    def _grouped_allreduce_grad_async(self, ps):
        return [self._compression.compress(p.grad) for p in ps]

    def compress_parameter(self, p):   # _DistributedAdasumOptimizer compresses the parameter itself
        return self._compression.compress(p)
'''
_ns: Dict[str, Any] = {}
exec(compile(_FAKE_HOROVOD, "/site-packages/horovod/torch/optimizer.py", "exec"), _ns)
FakeOptimizer = _ns["Optimizer"]


class Finder:
    """Stands where a compressor stands; returns what the adapter found instead of exchanging."""

    def __init__(self, names=None):
        self.names = names

    def compress(self, tensor):
        return adapter.find_horovod_call(tensor, self.names)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    model(torch.randn(3, 8)).sum().backward()
    return model


def _horovod_names(model):
    return {p: n for n, p in model.named_parameters()}


# ---------------------------------------------------------------- finding the call
def test_name_op_and_process_set_come_from_horovods_call() -> None:
    model = _model()
    opt = FakeOptimizer(Finder(), _parameter_names=_horovod_names(model), op=hvd.Sum, process_set="ps")
    call = opt._allreduce_grad_async(model.weight)
    assert (call.name, call.op, call.process_set) == ("weight", hvd.Sum, "ps")
    grouped = opt._grouped_allreduce_grad_async([model.weight, model.bias])
    assert [c.name for c in grouped] == ["weight", "bias"]


def test_bound_names_win_and_need_no_private_table() -> None:
    model = _model()
    names = adapter.name_map([("mine." + n, p) for n, p in model.named_parameters()])
    opt = FakeOptimizer(Finder(names), op=hvd.Average, process_set="ps")   # no _parameter_names
    assert opt._allreduce_grad_async(model.bias).name == "mine.bias"


def test_outside_horovod_nothing_is_found() -> None:
    assert adapter.find_horovod_call(torch.ones(3)) is None


@pytest.mark.parametrize("attrs, expected", [
    ({"_starting_models": {}}, "op=hvd.Adasum"),
    ({"op": hvd.Adasum}, "op=hvd.Adasum"),
    ({"op": hvd.Average, "process_set": "ps"}, "has no _parameter_names"),
])
def test_adapter_errors(attrs, expected) -> None:
    model = _model()
    opt = FakeOptimizer(gc.TopK(), **attrs)
    with pytest.raises(adapter.HorovodIntegrationError, match=expected):
        opt._allreduce_grad_async(model.weight)


def test_adasum_optimizer_compressing_the_parameter_is_refused() -> None:
    model = _model()
    opt = FakeOptimizer(gc.TopK(), _parameter_names=_horovod_names(model), _starting_models={})
    with pytest.raises(adapter.HorovodIntegrationError, match="Adasum"):
        opt.compress_parameter(model.weight)


def test_sparse_as_dense_gradient_is_found_by_its_parameter() -> None:
    """sparse_as_dense=True hands compress() a dense copy of the sparse .grad (issue 11 item 19):
    the frame's parameter names it; without sparse_as_dense a sparse gradient is refused."""
    emb = torch.nn.Embedding(100, 8, sparse=True)
    emb(torch.tensor([1, 5])).sum().backward()
    opt = FakeOptimizer(Finder(), _parameter_names={emb.weight: "emb"}, op=hvd.Average, process_set="ps",
                        sparse_as_dense=True)
    call = opt._allreduce_grad_async(emb.weight)
    assert (call.name, call.op, call.process_set) == ("emb", hvd.Average, "ps")
    opt.sparse_as_dense = False
    with pytest.raises(adapter.HorovodIntegrationError, match="sparse gradient"):
        opt._allreduce_grad_async(emb.weight)


def test_a_tensor_that_is_no_parameters_grad_is_refused() -> None:
    model = _model()
    opt = FakeOptimizer(gc.TopK(), _parameter_names=_horovod_names(model), op=hvd.Average, process_set="ps")
    stranger = SimpleNamespace(grad=torch.randn(4, 8))
    with pytest.raises(adapter.HorovodIntegrationError, match="not the .grad of any parameter.*named_parameters="):
        opt._allreduce_grad_async(stranger)


def test_unknown_horovod_without_op_is_refused() -> None:
    model = _model()
    opt = FakeOptimizer(gc.TopK(), _parameter_names=_horovod_names(model))
    with pytest.raises(adapter.HorovodIntegrationError, match="no op/process_set.*0.28.1"):
        opt._allreduce_grad_async(model.weight)


def test_every_internal_is_listed_with_the_version_checked() -> None:
    assert adapter.HOROVOD_CHECKED == "0.28.1"
    listed = " ".join(name for name, _ in adapter.HOROVOD_INTERNALS)
    for internal in ("horovod/torch/optimizer.py", "_parameter_names", "_starting_models", "process_set"):
        assert internal in listed
    assert all(why for _, why in adapter.HOROVOD_INTERNALS)


# ---------------------------------------------------------------- compress/decompress outside Horovod
def test_compressor_outside_horovod() -> None:
    with pytest.raises(ValueError, match="needs name="):
        gc.TopKQSGD().compress(torch.randn(100))
    c = gc.QSGD(bits=8, error_feedback=False)
    payload, ctx = c.compress(torch.full((100,), 0.5))
    assert payload.dtype == torch.uint8
    step = 5.0 / 127   # one QSGD level: bucket norm (sqrt(100) * 0.5) / s
    torch.testing.assert_close(c.decompress(payload, ctx), torch.full((100,), 0.5), atol=step, rtol=0)
    with pytest.raises(ValueError, match="context it did not make"):
        c.decompress(payload, object())


def test_bind_checks_names() -> None:
    model = _model()
    assert gc.TopK().bind(model.named_parameters()) is not None
    with pytest.raises(ValueError, match="unique"):
        gc.TopK(named_parameters=[("w", model.weight), ("w", model.bias)])
    with pytest.raises(ValueError, match=r"\(name, parameter\) tuples"):
        gc.TopK(named_parameters=list(model.parameters()))


def test_public_classes_are_codecs_with_horovods_protocol() -> None:
    from hvd_gradcomp.codecs import qsgd, topk

    assert isinstance(gc.TopKQSGD(), gc.TopK) and isinstance(gc.TopKQSGD(), topk.TopKQSGD)
    assert gc.QSGD is qsgd.QSGD and callable(qsgd.QSGD().compress)   # one class, Horovod's protocol on it
    assert adapter.describe(gc.QSGD(bits=4, seed=3)) == {"compression": "qsgd", "error_feedback": True, "seed": 3,
                                                         "bits": 4}
    assert adapter.describe(hvd.Compression.fp16) == {"compression": "fp16"}
    assert adapter.describe(object()) == {}


def test_noise_stream_is_left_alone_without_horovod_init() -> None:
    c = gc.QSGD()
    c.stream = 5
    if not hvd.is_initialized():
        adapter.bind_noise_stream(c)
        assert c.stream == 5


# ---------------------------------------------------------------- settings nobody read
def test_unread_settings_message() -> None:
    env = {"HVDGC_COMPRESSION": "topk-qsgd", "HVDGC_ACCUMULATE": "4", "HVDGC_COMPILE": "0"}
    msg = settings.unread_settings_message({"compression": "none", "accumulate": 1}, env, "X()")
    assert msg.startswith("HVDGC_COMPRESSION=topk-qsgd HVDGC_ACCUMULATE=4 are set") and "built X()" in msg
    assert "from_env()" in msg and "HVDGC_COMPILE" not in msg      # the library reads that one itself
    built = {"compression": "topk-qsgd", "ratio": 0.01, "bits": 8, "accumulate": 4}
    assert settings.unread_settings_message(built, env) is None
    assert settings.unread_settings_message({"compression": "none"}, {"HVDGC_COMPILE": "1"}) is None
    bad = settings.unread_settings_message({"compression": "none"}, {"HVDGC_RATIO": "2"})
    assert bad.startswith("HVDGC_RATIO: ratio must be in (0, 1]")


# ---------------------------------------------------------------- argument errors
@pytest.mark.parametrize("kwargs, error, expected", [
    ({"groups": 2}, ValueError, "groups/num_groups are not supported"),
    ({"num_groups": 2}, ValueError, "groups/num_groups are not supported"),
    ({"bogus": 1}, TypeError, r"unexpected arguments \['bogus'\]"),
    ({"op": hvd.Adasum}, ValueError, "Adasum is not supported"),
    ({"op": hvd.Max}, ValueError, "op must be hvd.Average or hvd.Sum"),
    ({"gradient_predivide_factor": 2.0}, ValueError, "gradient_predivide_factor is not supported"),
    ({"backward_passes_per_step": 0}, ValueError, "backward_passes_per_step must be an int >= 1"),
    ({"backward_passes_per_step": True}, ValueError, "backward_passes_per_step must be an int >= 1"),
    ({"backward_passes_per_step": 1.5}, ValueError, "backward_passes_per_step must be an int >= 1"),
])
def test_distributed_optimizer_argument_errors(kwargs, error, expected) -> None:
    model = torch.nn.Linear(4, 4)
    with pytest.raises(error, match=expected):
        gc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)


@pytest.mark.parametrize("optimizer, steps, expected", [
    (SimpleNamespace(backward_passes_per_step=2), 0, "steps must be an int >= 1"),
    (SimpleNamespace(backward_passes_per_step=2), True, "steps must be an int >= 1"),
    (SimpleNamespace(backward_passes_per_step=2), "2", "steps must be an int >= 1"),
    (torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1), 2, "got a plain optimizer"),
    (SimpleNamespace(backward_passes_per_step=4), 2, "backward_passes_per_step=4 but steps=2"),
])
def test_gradient_accumulator_argument_errors(optimizer, steps, expected) -> None:
    with pytest.raises(ValueError, match=expected):
        gc.GradientAccumulator(optimizer, steps=steps)


@pytest.mark.parametrize("max_grad_norm", [0, -1.0, "1", True, float("inf"), float("nan")])
def test_gradient_accumulator_refuses_a_bad_max_grad_norm(max_grad_norm) -> None:
    with pytest.raises(ValueError, match="max_grad_norm must be a positive number"):
        gc.GradientAccumulator(SimpleNamespace(backward_passes_per_step=2), steps=2, max_grad_norm=max_grad_norm)


# ---------------------------------------------------------------- pure reduction helpers
def test_sum_parts_averages_or_sums_sparse_and_dense_parts() -> None:
    parts = [(None, torch.tensor([1.0, 2.0, 3.0, 4.0])), (torch.tensor([0, 3]), torch.tensor([10.0, 20.0]))]
    assert sum_parts(parts, True, 4, torch.float32).tolist() == [5.5, 1.0, 1.5, 12.0]
    assert sum_parts(parts, False, 4, torch.float32).tolist() == [11.0, 2.0, 3.0, 24.0]
    out = torch.full((2, 2), 7.0)
    sum_parts(parts, False, 4, torch.float32, out=out)       # written in place, the 7s overwritten
    assert out.flatten().tolist() == [11.0, 2.0, 3.0, 24.0]


def test_sum_parts_adds_16_bit_gradients_in_float32() -> None:
    big, small = torch.tensor([2048.0], dtype=torch.float16), torch.tensor([1.0], dtype=torch.float16)
    parts = [(None, big), (None, small), (None, small)]
    # float16 would round 2048 + 1 + 1 one addition at a time back to 2048; float32 keeps 2050
    assert sum_parts(parts, False, 1, torch.float16).tolist() == [2050.0]


def test_decode_and_reduce_payloads_in_rank_order() -> None:
    c = gc.TopK(ratio=0.5, error_feedback=False, min_k=1)
    grads = [torch.tensor([4.0, -1.0, 0.0, 3.0]), torch.tensor([0.0, 2.0, -5.0, 1.0])]
    payloads = [c.encode(g) for g in grads]
    assert reduce_payloads(c, payloads, True, 2, torch.float32).tolist() == [2.0, 1.0, -2.5, 1.5]
    with pytest.raises(RuntimeError, match="expected 3 payloads, got 2"):
        decode_payloads(c, payloads, 3)
    with pytest.raises(gc.WireFormatError, match="rank 0 holds 4 elements, 5 expected"):
        decode_payloads(c, payloads, 2, numel=5)


def test_finiteness_is_read_at_the_sparse_indices_only_where_that_is_exact() -> None:
    c = gc.TopK(ratio=0.5)
    parts = [(torch.tensor([0, 3]), torch.tensor([1.0, 2.0])), (torch.tensor([3]), torch.tensor([float("inf")]))]
    out = sum_parts(parts, True, 4, torch.float32)
    assert not bool(finite_at_indices(c, parts, out))
    assert bool(finite_at_indices(c, parts[:1], sum_parts(parts[:1], True, 4, torch.float32)))
    # a dense part (QSGD, or a rank's non-finite flag) or a policy whose rewrite is unknown: check it all
    assert finite_at_indices(c, [(None, torch.ones(4))], torch.ones(4)) is None
    assert finite_at_indices(gc.TopK(ratio=0.5, feedback="momentum"), parts[:1], out, "w") is None  # no received yet
    assert finite_at_indices(gc.TopK(ratio=0.5, feedback="update"), parts[:1], out, "w") is None


def _corrected(comp: gc.TopK, parts: list) -> torch.Tensor:
    """The average of ``parts`` after momentum correction's rewrite, as the exchanges hand it over."""
    out = sum_parts(parts, True, 4, torch.float32)
    comp.received("w", out, torch.cat([idx for idx, _ in parts]))
    return out


def test_momentum_corrections_rewrite_is_checked_at_its_indices_too() -> None:
    """Momentum correction subtracts m * (the previous average) at the previous average's indices: the
    verdict comes from the sent values and those (no pass over the tensor in synchronize()), and still
    sees a NaN/Inf or an overflow that the subtraction makes."""
    for bound in (True, False):   # from the values' bound, and from the gather at the indices
        c = gc.TopK(ratio=0.5, feedback=gc.MomentumCorrection(momentum=0.9))
        big = 3e38 if not bound else 1.0
        first = [(torch.tensor([1]), torch.tensor([-big]))]
        out = _corrected(c, first)
        assert bool(finite_at_indices(c, first, out, "w"))
        # the next step's average at index 1: 3e38 - 0.9 * (-3e38) overflows; at index 2 alone it would not
        now = [(torch.tensor([1]), torch.tensor([big]))] if not bound else [(torch.tensor([2]), torch.tensor([5.0]))]
        out = _corrected(c, now)
        assert c.feedback.received_terms("w")[0][0].tolist() == [1]
        assert bool(finite_at_indices(c, now, out, "w")) == bool(torch.isfinite(out).all()) == bound, out
    # a NaN in the previous average (a step a loss scaler skipped is undone; here it was not) is seen
    c = gc.TopK(ratio=0.5, feedback=gc.MomentumCorrection(momentum=0.9))
    _corrected(c, [(torch.tensor([3]), torch.tensor([float("nan")]))])
    now = [(torch.tensor([0]), torch.tensor([1.0]))]
    assert not bool(finite_at_indices(c, now, _corrected(c, now), "w"))
    # dampening scales the rewrite up: no shortcut
    c = gc.TopK(ratio=0.5, feedback=gc.MomentumCorrection(momentum=0.9, dampening=0.5))
    _corrected(c, now)
    _corrected(c, now)
    assert finite_at_indices(c, now, _corrected(c, now), "w") is None

    class Mine(gc.MomentumCorrection):   # a rewrite of the user's own: its effect is unknown, check it all
        def received(self, name, avg, support=None):
            super().received(name, avg, support)
            avg.mul_(2.0)

    c = gc.TopK(ratio=0.5, feedback=Mine(momentum=0.9))
    _corrected(c, now)
    assert finite_at_indices(c, now, _corrected(c, now), "w") is None


def test_frozen_variance_is_checked_at_the_sent_indices_too() -> None:
    """"frozen" zeroes a finite average after applying it and passes a non-finite one on as it was: the
    check at the sent indices holds (no full pass over zeros in synchronize()), and still sees a NaN."""
    c = gc.TopK(ratio=0.5, feedback=gc.FrozenVariance())
    assert c.feedback.received_terms("w") == []
    nan = [(torch.tensor([1]), torch.tensor([float("nan")])), (torch.tensor([2]), torch.tensor([1.0]))]
    out = sum_parts(nan, True, 4, torch.float32)
    c.received("w", out, torch.tensor([1, 2]))   # non-finite: passed on before anything is read
    assert torch.isnan(out[1]) and not bool(finite_at_indices(c, nan, out, "w"))


def test_finiteness_from_the_values_bound_falls_back_to_the_sums_when_it_cannot_tell() -> None:
    c = gc.TopK(ratio=0.5)
    big = [(torch.tensor([0]), torch.tensor([3e38])), (torch.tensor([1]), torch.tensor([3e38]))]
    # the values' magnitudes add up past float32's range, but no two meet: every sum is finite
    assert bool(finite_at_indices(c, big, sum_parts(big, False, 4, torch.float32)))
    same = [(torch.tensor([2]), torch.tensor([3e38])), (torch.tensor([2]), torch.tensor([3e38]))]
    assert not bool(finite_at_indices(c, same, sum_parts(same, False, 4, torch.float32)))
    assert bool(finite_at_indices(c, same, sum_parts(same, True, 4, torch.float32)))   # the average is finite
    # float16 gradients: summed in float32, then cast; 40000 + 40000 overflows float16 (max 65504)
    half = [(torch.tensor([1]), torch.tensor([4e4], dtype=torch.float16))] * 2
    out = torch.empty(4, dtype=torch.float16)
    assert not bool(finite_at_indices(c, half, sum_parts(half, False, 4, torch.float16, out=out)))
    assert bool(finite_at_indices(c, half, sum_parts(half, True, 4, torch.float16, out=out)))
    nan = [(torch.tensor([1]), torch.tensor([float("nan")]))]
    assert not bool(finite_at_indices(c, nan, sum_parts(nan, True, 4, torch.float32)))


class _Handles:
    """Horovod's allreduce_async/synchronize for JoinGuard, counting ranks still training."""

    Sum = "sum"

    def __init__(self, active: int) -> None:
        self.active, self.started, self.read = active, 0, 0

    def allreduce_async(self, t, **kw):
        self.started += 1
        return self.started

    def synchronize(self, handle):
        self.read += 1
        return torch.tensor([float(self.active)])


def test_join_guard_counts_once_per_step_and_reads_before_the_first_collective(monkeypatch) -> None:
    fake = _Handles(active=2)
    monkeypatch.setattr(exchange, "_hvd", lambda: fake)
    ranks = SimpleNamespace(size=lambda: 2)
    guard = JoinGuard(ranks)
    guard.begin()
    guard.begin()                  # the step's later exchanges: nothing new
    assert (fake.started, fake.read) == (1, 0)   # asynchronous: nobody waited yet
    guard.confirm()
    guard.confirm()
    assert (fake.started, fake.read) == (1, 1)
    guard.end_step()
    guard.begin()                  # next step: checked again (a rank may join between steps)
    guard.end_step()               # started without an allgather after it: still read
    assert (fake.started, fake.read) == (2, 2)
    fake.active = 1                # a rank inside hvd.join(): the roads fall back to allreduces over the other
    assert (guard.confirm(), guard.joined(), fake.started) == (1, 1, 3)
    guard.end_step()
    fake.active = 2
    assert guard.joined() == 0 and fake.started == 4   # the next step is counted again
    guard.end_step()
    fake.active = 1
    auto = JoinGuard(ranks, falls_back=False)   # gc.Auto: refused, naming the road that carries join
    with pytest.raises(JoinNotSupportedError, match="1 of 2 ranks called hvd.join.*fixed compressor"):
        auto.confirm()
    quiet = JoinGuard(ranks, counts=False)      # no compressor: Horovod's own allreduces handle join
    quiet.begin()
    started = fake.started
    assert quiet.joined() == 0 and fake.started == started
    one = JoinGuard(SimpleNamespace(size=lambda: 1))
    one.confirm()
    assert fake.started == started  # one rank: nothing to check


def test_chunk_bounds() -> None:
    assert chunk_bounds(10, 3) == [0, 4, 7, 10]
    assert chunk_bounds(2, 2) == [0, 1, 2]
    assert chunk_bounds(7, 1) == [0, 7]


# ---------------------------------------------------------------- with Horovod's real optimizer (one process)
@pytest.fixture(scope="module")
def real() -> Dict[str, Any]:
    return {**run_single("single:stock_optimizer_frames"), **run_single("single:optimizer_misuse"),
            **run_single("single:unread_settings", env={"HVDGC_COMPRESSION": "topk"})}


@pytest.mark.slow
def test_real_horovod_optimizer_hands_names_to_the_adapter(real) -> None:
    assert real["frame-name"] == "0.weight" and real["bound-name"] == "0.weight"
    assert real["noname-name"] == "allreduce.noname.0.0"       # Horovod's own name for unnamed parameters
    for how in ("frame", "bound", "noname"):
        assert real[f"{how}-ctx"] == "StockContext" and real[f"{how}-equal"] is True
        assert real[f"{how}-stream"] == 0                     # rank 0 of 1
    assert real["wrong-model"].startswith("HorovodIntegrationError") and "bound to this compressor" in real["wrong-model"]


@pytest.mark.slow
def test_misuse_errors(real) -> None:
    assert real["too_many_backward"].startswith("AssertionError: Gradients were computed more than "
                                                "backward_passes_per_step (1) times")
    assert real["zero_grad_in_flight"].startswith("AssertionError: optimizer.zero_grad() was called after")
    assert real["zero_grad_after_step"] == "no error"
    assert "already an hvd_gradcomp.DistributedOptimizer" in real["wrap_twice"]
    assert "have no name in named_parameters" in real["unnamed_parameter"]
    assert "duplicated: ['w']" in real["duplicate_names"]
    assert "(name, parameter) tuples" in real["not_tuples"]
    assert real["flush_nothing"] == [False, 0]                # nothing pending: no step
    assert "loss must be a scalar" in real["non_scalar_loss"]
    assert real["stepped"] == [False, True] and real["flush_after_step"] == [False, 1]
    for when in ("save_mid_window", "load_mid_window"):
        assert "between accumulation windows, not in the middle of one" in real[when], real[when]
    assert "steps=4, this accumulator has steps=2" in real["load_other_steps"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["topkqsgd", "qsgd", "none"])
def test_gradients_changed_between_backward_and_step_are_refused(real, kind) -> None:
    """clip_grad_norm_ before step() without synchronize(): p.grad then holds this rank's gradient or the
    average depending on timing (2 ranks: the replicas drifted apart, silently); refused at step() with
    Horovod's pattern named. That pattern, and a plain step, pass."""
    err = real[f"clip-before-step-{kind}"]
    assert err.startswith("RuntimeError: hvd_gradcomp.DistributedOptimizer: the gradient of '"), err
    assert "opt.synchronize()" in err and "skip_synchronize" in err and "max_grad_norm" in err
    assert real[f"plain-step-{kind}"] == "no error"


@pytest.mark.slow
def test_unread_settings_warn_once(real) -> None:
    first, second = real["warnings"]
    assert len(first) == 1 and first[0].startswith("UnreadSettingsWarning: HVDGC_COMPRESSION=topk is set")
    assert "DistributedOptimizer(compression=None, backward_passes_per_step=1)" in first[0]
    assert second == []


@pytest.mark.parametrize("bad", ["topk", "topk-qsgd", 0.01, torch.float16, object()])
def test_distributed_optimizer_refuses_what_is_not_a_compressor(bad: Any) -> None:
    """Refused by gc.DistributedOptimizer before any hook is registered (a name such as "topk"
    used to pass and fail inside the first backward, with hooks left on the parameters); the
    message names what was given and what is accepted, and for a name how to build one."""
    from hvd_gradcomp.horovod.optimizer import _check_compression
    with pytest.raises(ValueError) as err:
        _check_compression(bad)
    text = str(err.value)
    assert "compression must be an hvd_gradcomp compressor" in text and type(bad).__name__ in text
    assert ("make_compressor()" in text) == isinstance(bad, str)


@pytest.mark.parametrize("cls", ["TopKQSGD", "TopK", "QSGD", "Auto"])
def test_distributed_optimizer_refuses_a_compressor_class(cls: str) -> None:
    """compression=TopKQSGD (no parentheses) is refused when the optimizer is built, naming the fix
    (it failed at the first step: compress() called without self)."""
    import hvd_gradcomp as gc
    from hvd_gradcomp.horovod.optimizer import _check_compression
    with pytest.raises(TypeError, match=rf"compression={cls}\) got the class: pass an instance, compression={cls}\(\.\.\.\)"):
        _check_compression(getattr(gc, cls))


def test_distributed_optimizer_accepts_every_kind_of_compressor() -> None:
    """None, ours, Auto and Horovod's compressors (classes with compress/decompress) pass."""
    from hvd_gradcomp.horovod.optimizer import _check_compression
    horovod_like = SimpleNamespace(compress=lambda t: (t, None), decompress=lambda t, ctx: t)
    for ok in (None, gc.TopKQSGD(ratio=0.01, bits=8), gc.QSGD(bits=8), gc.TopK(ratio=0.01), gc.Auto(), horovod_like,
               hvd.Compression.none, hvd.Compression.fp16):
        _check_compression(ok)
