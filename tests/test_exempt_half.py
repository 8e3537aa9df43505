"""The float16 road of tensors exempt from compression (``exempt="fp16"``, issue 9): the
saturating cast, its error feedback, the compressor option and its checkpoints. The roads
themselves (2 ranks) are tested in test_integration.py and test_ddp.py."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hvd_gradcomp import FrozenVariance, QSGD, TopK, TopKQSGD
from hvd_gradcomp.feedback import HalfPrecision
from hvd_gradcomp.feedback.kernels import HALF_MAX, half_bound, to_half_saturated


def owed_invariant(sent: torch.Tensor, world: int, residual: torch.Tensor, acc: torch.Tensor) -> float:
    """max |sent * world + residual - acc| relative to max |acc| (float64 arithmetic)."""
    got = sent.double() * world + residual.double()
    return float((got - acc.double()).abs().max() / acc.double().abs().max().clamp(min=1e-30))


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7, 8, 64, 1000])
def test_sum_of_saturated_values_never_overflows(world):
    """The worst case: every rank sends the bound, all of one sign, summed one addition at a time in
    float16 (each partial sum rounded, as Gloo, MPI and NCCL do): finite, and near 65504."""
    per_rank, finite = to_half_saturated(torch.full((1,), 1e30), world)
    assert finite and per_rank.item() <= half_bound(world) * (1 + 2 ** -11)   # the cast's rounding
    total = torch.zeros(1, dtype=torch.float16)
    for _ in range(world):
        total = total + per_rank
    assert math.isfinite(total.item()) and total.item() > HALF_MAX / 3, total


def test_cast_divides_by_world_and_rounds_to_float16():
    x = torch.tensor([3.0, -1.0, 0.1, 1e-3])
    half, finite = to_half_saturated(x, 2)
    assert finite and half.dtype == torch.float16
    assert torch.equal(half, (x / 2).to(torch.float16))
    assert torch.equal(x, torch.tensor([3.0, -1.0, 0.1, 1e-3])), "the input must not change"


def test_large_values_saturate_instead_of_becoming_inf():
    half, finite = to_half_saturated(torch.tensor([1e6, -1e6, 1e38, 7.0e4]), 2)
    assert finite and torch.isfinite(half).all()
    bound = torch.tensor(half_bound(2)).to(torch.float16).item()
    assert half.tolist() == [bound, -bound, bound, bound]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_values_stay_non_finite(bad):
    half, finite = to_half_saturated(torch.tensor([1.0, bad, 1e6]), 2)
    assert not finite
    assert half[0].item() == 0.5
    assert not math.isfinite(half[1].item()), "a NaN/Inf gradient must arrive non-finite"
    if not math.isnan(bad):
        assert half[1].item() == bad


def test_error_feedback_keeps_what_the_cast_took_away_over_steps():
    """sent * world + new residual == gradient + old residual (rel 1e-6), every step, for values
    beyond float16's range and below its resolution; the sum over steps of what was sent plus
    what is still owed is the sum of the gradients."""
    hp, world = HalfPrecision(), 2
    g = torch.Generator().manual_seed(0)
    total_sent = {"a": torch.zeros(40, dtype=torch.float64), "b": torch.zeros(6, dtype=torch.float64)}
    total_true = {k: torch.zeros_like(v) for k, v in total_sent.items()}
    for step in range(6):
        grads = {"a": torch.randn(40, generator=g) * 10.0 ** torch.randint(-9, 7, (40,), generator=g),
                 "b": torch.tensor([1e6, -3e5, 1e-9, 5e-8, 70000.0, 0.0])}
        old = {k: (hp.residuals.residual(k) if hp.residuals.residual(k) is not None
                   else torch.zeros(v.numel())).clone() for k, v in grads.items()}
        half, finite = hp.encode(list(grads.items()), world)
        assert finite and half.dtype == torch.float16 and half.numel() == 46
        assert torch.isfinite(half).all(), "nothing a finite gradient sends may be inf"
        sent = {"a": half[:40], "b": half[40:]}
        for k in grads:
            acc = grads[k] + old[k]
            assert owed_invariant(sent[k], world, hp.residuals.residual(k), acc) <= 1e-6, (step, k)
            total_sent[k] += sent[k].double() * world
            total_true[k] += grads[k].double()
    for k in grads:
        owed = hp.residuals.residual(k).double()
        err = (total_sent[k] + owed - total_true[k]).abs().max() / total_true[k].abs().max()
        assert err <= 1e-6, k
    assert hp.residuals.residual("b")[0].item() > 1e5, "the saturated part of 1e6 is owed, not lost"


def test_non_finite_gradient_leaves_every_residual_untouched():
    hp = HalfPrecision()
    hp.encode([("a", torch.full((4,), 1e-7)), ("b", torch.full((3,), 1e6))], 2)
    before = {k: hp.residuals.residual(k).clone() for k in ("a", "b")}
    half, finite = hp.encode([("a", torch.ones(4)), ("b", torch.tensor([1.0, float("nan"), 2.0]))], 2)
    assert not finite and math.isnan(half[5].item())
    for k, r in before.items():
        assert torch.equal(hp.residuals.residual(k), r), f"residual of {k} changed on a non-finite step"


def test_single_tensor_and_fused_sends_agree():
    """Fusing tensors into one send changes nothing but the layout."""
    g = torch.Generator().manual_seed(1)
    grads = [("x", torch.randn(5, 3, generator=g) * 1e-4), ("y", torch.randn(7, generator=g) * 3e4)]
    one, fused = HalfPrecision(), HalfPrecision()
    for _ in range(3):
        alone = torch.cat([one.encode([nt], 3)[0] for nt in grads])
        together, _ = fused.encode(grads, 3)
        assert torch.equal(alone, together)
        for name, _ in grads:
            assert torch.equal(one.residuals.residual(name).reshape(-1), fused.residuals.residual(name).reshape(-1))


def test_undone_step_puts_the_residuals_back():
    hp = HalfPrecision()
    hp.track_rounds(True)
    hp.encode([("a", torch.full((3,), 1e6))], 2)
    hp.end_round(True)
    kept = hp.residuals.residual("a").clone()
    hp.encode([("a", torch.full((3,), 5e5))], 2)
    hp.end_round(False)   # an average came back NaN/Inf: the step is undone
    assert torch.equal(hp.residuals.residual("a"), kept)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False), min_size=1, max_size=64),
       st.integers(min_value=1, max_value=512))
def test_property_sent_plus_owed_is_the_input(values, world):
    x = torch.tensor(values, dtype=torch.float32)
    hp = HalfPrecision()
    half, finite = hp.encode([("t", x)], world)
    assert finite and torch.isfinite(half).all()
    assert (half.double().abs() <= half_bound(world) * (1 + 2 ** -11)).all()
    got = half.double() * world + hp.residuals.residual("t").double()
    # float32 rounding of the residual: half an ulp of it, at most 2**-24 of the input's magnitude
    assert ((got - x.double()).abs() <= x.double().abs() * 2 ** -23 + 1e-45).all()


# ---------------------------------------------------------------- the compressor option
@pytest.mark.parametrize("make", [TopK, TopKQSGD, QSGD])
def test_exempt_defaults_to_fp16_and_is_validated(make):
    c = make()
    assert c.exempt == "fp16" and "exempt" not in repr(c)
    assert "exempt='fp32'" in repr(make(exempt="fp32"))
    with pytest.raises(ValueError, match="exempt must be one of"):
        make(exempt="bf16")
    with pytest.raises(ValueError, match="exempt must be one of"):
        c.exempt = "half"


def test_which_tensors_go_float16():
    c = TopKQSGD(exclude=r"embed")
    assert c.sends_half("ln.bias", torch.float32, small=True)
    assert c.sends_half("tok_embed.weight", torch.float32, small=False)            # exclude=
    assert not c.sends_half("fc.weight", torch.float32, small=False)               # no dense step of its policy
    assert not c.sends_half("ln.bias", torch.float16, small=True)                  # already 16-bit
    assert not c.sends_half("ln.bias", torch.bfloat16, small=True)
    assert not c.sends_half("ln.bias", torch.float64, small=True)
    assert not TopKQSGD(exempt="fp32").sends_half("ln.bias", torch.float32, small=True)


def test_frozen_warm_up_goes_float16_and_what_it_owes_joins_the_first_compressed_step():
    """feedback="frozen" sends big tensors dense during Adam's warm-up: as float16 with error feedback
    where the road sums (hvd_gradcomp.DistributedOptimizer, DDP), float32 on stock Horovod (whose
    Average divides the float16 sum once more). At the first compressed step what the cast still owed
    joins the gradient, and the float16 road keeps nothing of the tensor (no gradient-sized residual
    kept for good)."""
    w = torch.nn.Parameter(torch.ones(4096))
    opt = torch.optim.AdamW([w], lr=0.1)
    c = TopKQSGD(ratio=1.0, bits=8, feedback=FrozenVariance(warmup=5))
    c.feedback.bind("w", opt.param_groups[0], w, opt)
    assert not c.compresses("w", w.numel())        # dense: the warm-up
    assert c.sends_half("w", torch.float32, small=False)
    assert not c.sends_half("w", torch.float32, small=False, dense_steps=False)
    c = TopKQSGD(ratio=1.0, bits=8, feedback="classic")      # the road's end of it, on a policy that compresses
    g = torch.full((4096,), 1e-9)                       # below float16's resolution: all of it owed
    half, _ = c.encode_half([("w", g)], world=1)
    assert torch.count_nonzero(half) == 0 and "w" in c.half_residuals
    sent = c.decode(c.compress_named("w", torch.zeros(4096))).reshape(-1)   # a zero gradient: only what was owed
    assert "w" not in c.half_residuals
    kept = c.residuals.residual("w")
    total = sent + (kept.reshape(-1) if kept is not None else 0.0)   # error feedback keeps what the codec did not send
    torch.testing.assert_close(total, g, rtol=1e-5, atol=1e-15)
    del opt


def test_checkpoint_holds_the_float16_residuals():
    c = TopKQSGD(seed=3)
    c.encode_half([("ln.weight", torch.full((8,), 1e-5)), ("ln.bias", torch.full((8,), 3e5))], 2)
    state = c.state_dict()
    assert set(state["half"]["residuals"]) == {"ln.weight", "ln.bias"}
    d = TopKQSGD(seed=3)
    d.load_state_dict(state)
    nxt = [("ln.weight", torch.full((8,), 2e-5)), ("ln.bias", torch.full((8,), -1.0))]
    assert torch.equal(c.encode_half(nxt, 2)[0], d.encode_half(nxt, 2)[0])
    for name in ("ln.weight", "ln.bias"):
        assert torch.equal(c.half_residuals.residual(name), d.half_residuals.residual(name))


def test_checkpoint_with_float16_residuals_refused_by_exempt_fp32():
    c = TopKQSGD(seed=3)
    c.encode_half([("ln.bias", torch.full((8,), 3e5))], 2)
    with pytest.raises(ValueError, match="exempt='fp16'"):
        TopKQSGD(seed=3, exempt="fp32").load_state_dict(c.state_dict())
    TopKQSGD(seed=3, exempt="fp32").load_state_dict(TopKQSGD(seed=3).state_dict())   # nothing owed: fine
