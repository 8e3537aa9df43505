"""Feedback policies (issue 9): invariants, exactness at ratio 1, the automatic choice,
ratio schedules, per-tensor policy, clipping and checkpoints. Single process: the ranks of
an exchange are simulated by averaging several compressors' decoded payloads."""
from __future__ import annotations

import io
import logging
import math

import pytest
import torch

import hvd_gradcomp as gc
from hvd_gradcomp import QSGD, TopK, TopKQSGD
from hvd_gradcomp import feedback as fb
from hvd_gradcomp.codecs.binding import HANDED_CHECK_STEPS
from hvd_gradcomp.codecs.compressor import SparsityWarmup
from hvd_gradcomp.feedback.frozen import FLAT_RATE_STEPS
from hvd_gradcomp.feedback.momentum import MomentumCorrection


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def exchange(comps, name, grads):
    """What every simulated rank's optimizer receives: the average of all decoded payloads,
    rewritten by each rank's policy (they must agree)."""
    avg = sum(c.decode(c.compress_named(name, g)).reshape(-1).double() for c, g in zip(comps, grads)).float()
    avg /= len(comps)
    outs = []
    for c in comps:
        out = avg.clone()
        c.received(name, out)
        outs.append(out)
    for o in outs[1:]:
        assert torch.equal(o, outs[0]), "ranks would hold different gradients"
    return outs[0]


# ------------------------------------------------------------------ momentum correction
@pytest.mark.parametrize("opts", [dict(momentum=0.9), dict(momentum=0.9, weight_decay=1e-2),
                                  dict(momentum=0.8, nesterov=True), dict(momentum=0.9, dampening=0.5)],
                         ids=["plain", "weight-decay", "nesterov", "dampening"])
def test_momentum_correction_at_ratio_one_is_momentum_sgd(opts):
    """TopK(ratio=1) sends everything: training must follow momentum SGD on the mean gradient."""
    torch.manual_seed(0)
    w = torch.randn(40, 30)
    p_ref, p = w.clone().requires_grad_(), w.clone().requires_grad_()
    ref = torch.optim.SGD([p_ref], lr=0.05, **opts)
    opt = torch.optim.SGD([p], lr=0.05, **opts)
    comps = [TopK(ratio=1.0, feedback="momentum") for _ in range(2)]
    for c in comps:
        c.attach(opt, {p: "w"})
    for step in range(12):
        grads = [torch.randn(40, 30, generator=gen(10 * step + r)) for r in range(2)]
        p_ref.grad = (grads[0] + grads[1]) / 2
        ref.step()
        p.grad = exchange(comps, "w", grads).view_as(p)
        opt.step()
        torch.testing.assert_close(p, p_ref, rtol=1e-5, atol=1e-6)


def test_momentum_correction_keeps_the_error_feedback_invariant():
    """sent + new residual == velocity + old residual, and the velocity is m*u + g."""
    mc = MomentumCorrection(momentum=0.5)
    c = TopK(ratio=0.1, feedback=mc)
    u = torch.zeros(100)
    for step in range(5):
        g = torch.randn(100, generator=gen(step))
        u = g.clone() if step == 0 else 0.5 * u + g
        old = mc.residuals.residual("w")
        old = torch.zeros(100) if old is None else old.clone()
        sent = c.decode(c.compress_named("w", g))
        torch.testing.assert_close(mc.velocity["w"], u)
        torch.testing.assert_close(sent + mc.residuals.residual("w"), u + old)


def test_momentum_masking_zeroes_the_sent_coordinates():
    mc = MomentumCorrection(momentum=0.9, masking=True)
    c = TopK(ratio=0.1, feedback=mc)
    payload = c.compress_named("w", torch.randn(50, generator=gen(1)))
    idx, _ = c.decode_parts(payload)
    assert torch.all(mc.velocity["w"][idx] == 0) and torch.all(mc.residuals.residual("w")[idx] == 0)
    assert int((mc.velocity["w"] != 0).sum()) == 50 - idx.numel()


# ------------------------------------------------------------------ compress the update
@pytest.mark.parametrize("cls,opts", [(torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
                                      (torch.optim.Adam, dict(lr=1e-2, betas=(0.8, 0.99))),
                                      (torch.optim.RMSprop, dict(lr=1e-3))], ids=["adamw", "adam", "rmsprop"])
def test_update_feedback_at_ratio_one_is_the_optimizer(cls, opts):
    """One rank, ratio 1: the parameter follows the plain optimizer (learning-rate schedule included).

    AdamW decays the parameter after the update arrived, not before: a difference of
    lr * weight_decay * |update| (1e-5 here) per step, hence the tolerance."""
    torch.manual_seed(0)
    w = torch.randn(20, 10)
    p_ref, p = w.clone().requires_grad_(), w.clone().requires_grad_()
    ref, opt = cls([p_ref], **opts), cls([p], **opts)
    sched_ref = torch.optim.lr_scheduler.LambdaLR(ref, lambda s: 1.0 / (1 + s))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    c = TopK(ratio=1.0, feedback="update")
    c.attach(opt, {p: "w"})
    assert c.feedback.key == "update"
    for step in range(10):
        g = torch.randn(20, 10, generator=gen(step))
        p_ref.grad = g.clone()
        ref.step()
        sched_ref.step()
        p.grad = exchange([c], "w", [g]).view_as(p)
        assert torch.count_nonzero(p.grad) == 0  # the wrapped optimizer only decays
        opt.step()
        sched.step()
        torch.testing.assert_close(p, p_ref, rtol=0, atol=5e-5 if opts.get("weight_decay") else 1e-6)


def test_update_feedback_without_an_optimizer_says_how_to_use_it():
    with pytest.raises(RuntimeError, match="DistributedOptimizer"):
        TopK(feedback="update").compress_named("w", torch.randn(10))


# ------------------------------------------------------------------ Adam with v frozen
def frozen_reference(w, grads, opts, warmup, floor=0.1, gamma=None, momentum=False, follow="down", window=50):
    """Adam for ``warmup`` steps, then v frozen (floored) and the step ``g / denom``, at most
    ``1 / sqrt(1 - b2)`` per coordinate (``momentum``:
    Adam's ``m = b1*m + (1-b1)*g`` carried over, bias-corrected, in place of ``g``), each step
    lengthened by sqrt(s_freeze / s_t) where that is above 1 (``follow="down"``; ``"both"``: also
    shortened below 1; None: never), s the average over ``window`` steps (weight 1/window) of the
    gradient's mean square from the first step on: written out. ``gamma``: the rate multiplied by
    it after every step (ExponentialLR)."""
    p = w.clone().requires_grad_()
    adam = torch.optim.AdamW([p], **opts)
    sched = torch.optim.lr_scheduler.ExponentialLR(adam, gamma) if gamma else None
    b1, b2 = adam.param_groups[0]["betas"]
    lr, eps, wd = opts["lr"], adam.param_groups[0]["eps"], adam.param_groups[0]["weight_decay"]
    denom = m = s = s_freeze = None
    for t, g in enumerate(grads, start=1):
        ms = g.pow(2).mean()
        s = ms if s is None else (1 - 1 / window) * s + ms / window
        lr = adam.param_groups[0]["lr"]
        if t <= warmup:
            p.grad = g.clone()
            adam.step()
            if sched is not None:
                sched.step()
            s_freeze = s
            continue
        if denom is None:
            st = adam.state[p]
            root = (st["exp_avg_sq"] / (1 - b2 ** warmup)).sqrt()
            denom = root.clamp(min=floor * root.mean().item()) + eps
            m = st["exp_avg"].clone()
        m = b1 * m + (1 - b1) * g
        with torch.no_grad():
            p.mul_(1 - lr * wd)
            factor = {"down": (s_freeze / s).clamp(min=1.0), "both": s_freeze / s, None: torch.tensor(1.0)}[follow]
            # no more than Adam's largest answer to one gradient, 1/sqrt(1 - b2) (AdamBinding.step_bound)
            u = ((m if momentum else g) * factor.sqrt() / denom).clamp(-(1 - b2) ** -0.5, (1 - b2) ** -0.5)
            p.sub_(u * (lr / (1 - b1 ** t) if momentum else lr))
            if sched is not None:
                sched.step()
    return p.detach()


@pytest.mark.parametrize("momentum", [False, True], ids=["default", "momentum"])
@pytest.mark.parametrize("opts", [dict(lr=1e-2, weight_decay=0.1), dict(lr=1e-2, betas=(0.8, 0.99))],
                         ids=["adamw-decay", "betas"])
def test_frozen_variance_at_ratio_one_is_adam_then_frozen_adam(opts, momentum):
    """One rank, ratio 1: exact Adam through the dense warm-up (the compressor sends nothing),
    then Adam with v frozen at the end of the warm-up: by default without its first moment (error
    feedback's residual takes its place), with ``momentum=True`` with it, carried over."""
    torch.manual_seed(0)
    w = torch.randn(40, 30)
    grads = [torch.randn(40, 30, generator=gen(s)) * (1 + s % 3) for s in range(12)]
    p = w.clone().requires_grad_()
    opt = torch.optim.AdamW([p], **opts)
    c = TopK(ratio=1.0, feedback=gc.FrozenVariance(warmup=4, momentum=momentum))
    c.attach(opt, {p: "w"})
    for step, g in enumerate(grads):
        if step < 4:
            assert not c.compresses("w", p.numel())   # dense warm-up: the plain allreduce takes it
            c.dense_local("w", g)                     # as every road shows it this rank's gradient
            p.grad = g.clone()
        else:
            assert c.compresses("w", p.numel())
            p.grad = exchange([c], "w", [g]).view_as(p)
            assert torch.count_nonzero(p.grad) == 0   # the wrapped optimizer only decays
        opt.step()
    torch.testing.assert_close(p.detach(), frozen_reference(w, grads, opts, 4, momentum=momentum),
                               rtol=0, atol=2e-6)   # float32 rounding: the update's factors multiply in another order


@pytest.mark.slow
@pytest.mark.parametrize("schedule, dropped_at", [(None, FLAT_RATE_STEPS), ("ramp", 19 + FLAT_RATE_STEPS),
                                                  ("cosine", None), ("steps", None)])
def test_frozen_variance_drops_adams_momentum_once_the_rate_has_stayed_the_same(schedule, dropped_at):
    """Issue 9 (transformer-const), ``momentum=None`` (the default before it was False): a tensor whose rate has not changed for FLAT_RATE_STEPS steps
    (from the first step, or from the end of a warm-up ramp) sends its gradient from then on, and
    its parameter moves by lr times the average, without Adam's bias correction of the first
    moment; under a schedule that keeps changing the rate the momentum stays. An undone step (a
    loss scaler's overflow) puts a dropped momentum back."""
    p = torch.zeros(2000, requires_grad=True)
    opt = torch.optim.AdamW([p], lr=1e-2)
    steps = 3 * FLAT_RATE_STEPS
    sched = None if schedule is None else torch.optim.lr_scheduler.LambdaLR(opt, {
        "ramp": lambda t: min(1.0, (t + 1) / 20),              # the rate's last change: into step 19
        "cosine": lambda t: 0.5 * (1 + math.cos(math.pi * t / steps)),
        "steps": lambda t: 0.5 ** (t // (FLAT_RATE_STEPS // 2))}[schedule])
    c = TopK(ratio=0.1, feedback=gc.FrozenVariance(warmup=4, momentum=None), seed=0)
    c._claim(opt, 1)
    c.attach(opt, {p: "w"})
    seen = None
    for step in range(steps):
        g = torch.randn(2000, generator=gen(step))
        if not c.compresses("w", p.numel()):
            c.dense_local("w", g)
            p.grad = g.clone()
        else:
            if step == dropped_at:   # the step that drops it, undone: the momentum comes back
                before = c.feedback.velocity["w"]
                c.compress_named("w", g)
                assert "w" not in c.feedback.velocity
                c.end_round(False)
                assert c.feedback.velocity["w"] is before
            p.grad = exchange([c], "w", [g]).view_as(p)
            c.end_round(True)
            if seen is None and "w" not in c.feedback.velocity:
                seen = step
        opt.step()
        if sched is not None:
            sched.step()
    assert seen == dropped_at
    # a checkpoint carries the rule's state: a resumed run drops the momentum at the same step
    restored = gc.FrozenVariance(warmup=4, momentum=True)
    restored.load_state_dict(c.feedback.state_dict())
    assert restored.momentum is None and restored.state_dict()["flat"] == c.feedback.state_dict()["flat"]
    assert set(restored.velocity) == set(c.feedback.velocity)


def test_frozen_variance_keeps_adams_momentum_while_the_sparsity_warmup_is_dense():
    """Issue 9, ``momentum="while dense"``: through the sparsity warm-up after the freeze a tensor sends
    Adam's momentum while the share sent is above 1 - b1 (here 0.25, 0.167, 0.112 of it: 3 exchanges),
    then its gradient for good. A checkpoint carries the choice; a dense codec (no share, no
    warm-up) sends the gradient from the start."""
    p = torch.zeros(4000, requires_grad=True)
    opt = torch.optim.Adam([p], lr=1e-2)
    c = TopK(ratio=0.01, feedback=gc.FrozenVariance(warmup=1, sparsity_warmup=8, momentum="while dense"), seed=0)
    c.attach(opt, {p: "w"})
    p.grad = torch.randn(4000, generator=gen(0))
    opt.step()
    kept = []
    for s in range(6):
        before = p.detach().clone()
        p.grad = exchange([c], "w", [torch.randn(4000, generator=gen(s + 1))]).view_as(p)
        kept.append("w" in c.feedback.velocity)
        opt.step()
        assert not torch.equal(p.detach(), before)
    assert kept == [True, True, True, False, False, False], kept
    restored = gc.FrozenVariance()
    restored.load_state_dict(c.feedback.state_dict())
    assert restored.momentum == "while dense" and "w" not in restored.velocity
    q = torch.zeros(4000, requires_grad=True)
    adam = torch.optim.Adam([q], lr=1e-2)
    dense = gc.QSGD(bits=8, feedback=gc.FrozenVariance(warmup=1, momentum="while dense"))
    dense.attach(adam, {q: "w"})
    q.grad = torch.randn(4000, generator=gen(0))
    adam.step()
    dense.compress_named("w", torch.randn(4000, generator=gen(1)))
    assert "w" not in dense.feedback.velocity


@pytest.mark.parametrize("bad", ["yes", 1, 0.0])
def test_frozen_variance_momentum_takes_only_none_true_or_false(bad):
    """A wrong ``momentum=`` is refused at construction, naming the three choices."""
    with pytest.raises(ValueError, match=r"momentum must be None .*True .*False"):
        gc.FrozenVariance(momentum=bad)


@pytest.mark.parametrize("bad", ["up", True, 1])
def test_frozen_variance_follow_scale_takes_only_down_both_or_none(bad):
    """A wrong ``follow_scale=`` is refused at construction, naming the three choices."""
    with pytest.raises(ValueError, match=r"follow_scale must be one of \['down', 'both', None\]"):
        gc.FrozenVariance(follow_scale=bad)


@pytest.mark.parametrize("follow_scale", ["down", "both", None])
@pytest.mark.parametrize("momentum", [False, True], ids=["default", "momentum"])
def test_frozen_variance_under_a_schedule_follows_the_scale_as_at_a_constant_rate(momentum, follow_scale):
    """A rate that changes every step (a schedule) changes nothing in how the gradients' scale is
    followed. Here the gradients grow after the warm-up: by default (``"down"``) v stays frozen,
    ``"both"`` shortens the steps, None never follows; each exactly as written out."""
    torch.manual_seed(0)
    w = torch.randn(40, 30)
    grads = [torch.randn(40, 30, generator=gen(s)) * (1 + s % 3) for s in range(12)]
    opts = dict(lr=1e-2, weight_decay=0.1)
    p = w.clone().requires_grad_()
    opt = torch.optim.AdamW([p], **opts)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, 0.9)
    c = TopK(ratio=1.0, feedback=gc.FrozenVariance(warmup=4, momentum=momentum, follow_scale=follow_scale))
    c.attach(opt, {p: "w"})
    for step, g in enumerate(grads):
        if step < 4:
            c.dense_local("w", g)
            p.grad = g.clone()
        else:
            p.grad = exchange([c], "w", [g]).view_as(p)
            factor = c.feedback._scales.factor("w")
            if follow_scale is None:
                assert factor is None
            elif follow_scale == "down":
                assert float(factor) == 1.0     # the gradients grew: v stays frozen
            else:
                assert float(factor) < 1.0
        opt.step()
        sched.step()
    torch.testing.assert_close(p.detach(), frozen_reference(w, grads, opts, 4, gamma=0.9, momentum=momentum,
                                                            follow=follow_scale),
                               rtol=0, atol=2e-6)   # float32 rounding: the update's factors multiply in another order


@pytest.mark.slow
@pytest.mark.parametrize("schedule", [False, True], ids=["constant-rate", "schedule"])
@pytest.mark.parametrize("follow", [True, False], ids=["warm-up-shown", "from-the-first-compressed-step"])
def test_frozen_variance_steps_stay_adam_sized_while_the_gradients_shrink(follow, schedule):
    """Gradients 100x smaller after the warm-up (a classifier nearing zero loss): Adam's steps stay
    their size, and so do those with v frozen once the averages have followed the new scale. With
    v frozen for good they would be 100x shorter, as they are when the warm-up's gradients were not
    shown (``dense_local``, which every road calls): the scale is then followed only from the first
    compressed step, after the drop. With Adam's momentum kept (``momentum=True``), so that each
    step compares with Adam's own: without it a step of pure noise is longer than Adam's, whose
    momentum averages the noise over steps (error feedback's residual does that at ratio < 1)."""
    p, q = torch.zeros(4000).requires_grad_(), torch.zeros(4000).requires_grad_()
    opt, adam = (torch.optim.Adam([x], lr=1e-3, betas=(0.9, 0.95)) for x in (p, q))
    # under a schedule as at a constant rate (both optimizers' rates decay alike)
    scheds = [torch.optim.lr_scheduler.ExponentialLR(o, 0.999) for o in (opt, adam)] if schedule else []
    c = TopK(ratio=1.0, feedback=gc.FrozenVariance(warmup=5, window=None, momentum=True))
    c.attach(opt, {p: "w"})
    moved, moved_adam = [], []
    for step in range(300):
        g = torch.randn(4000, generator=gen(step)) * (1.0 if step < 5 else 0.01)
        q_before, q.grad = q.detach().clone(), g.clone()
        adam.step()
        moved_adam.append(float((q.detach() - q_before).norm()))
        before = p.detach().clone()
        if step < 5:
            assert not c.compresses("w", p.numel())
            if follow:
                c.dense_local("w", g)
            p.grad = g.clone()
        else:
            p.grad = exchange([c], "w", [g]).view_as(p)
        opt.step()
        for sched in scheds:
            sched.step()
        moved.append(float((p.detach() - before).norm()))
    ratio = moved[-1] / moved[4]      # the last step against the warm-up's last
    adam_ratio = moved_adam[-1] / moved_adam[4]
    if follow:
        assert 2 / 3 < ratio / adam_ratio < 1.5, (ratio, adam_ratio)
    else:
        assert ratio < 0.05 * adam_ratio, (ratio, adam_ratio)   # ~0.01: v frozen for good


def test_frozen_variance_floors_coordinates_without_gradient_in_the_warm_up():
    """A coordinate whose gradient was 0 through the warm-up moves like an average one, not by lr/eps."""
    p = torch.zeros(2000, requires_grad=True)
    opt = torch.optim.Adam([p], lr=1e-3)
    c = TopK(ratio=1.0, feedback="frozen")
    c.attach(opt, {p: "w"})
    g = torch.ones(2000)
    g[0] = 0.0
    for _ in range(100):
        assert not c.compresses("w", p.numel())
        p.grad = g.clone()
        opt.step()
    assert c.compresses("w", p.numel())
    before = p.detach().clone()
    p.grad = exchange([c], "w", [torch.ones(2000)]).view_as(p)
    opt.step()
    moved = (before - p.detach()).abs()
    assert moved[0] < 20 * moved[1:].mean(), moved[:3]


@pytest.mark.parametrize("momentum", [False, True], ids=["default", "momentum"])
def test_frozen_variance_leaves_the_parameter_alone_on_a_non_finite_step(momentum):
    p = torch.ones(2000, requires_grad=True)
    opt = torch.optim.AdamW([p], lr=1e-2)
    c = TopK(ratio=0.1, feedback=gc.FrozenVariance(warmup=1, momentum=momentum), seed=0)
    c._claim(opt, 2)
    c.attach(opt, {p: "w"})
    p.grad = torch.ones(2000)
    opt.step()
    exchange([c], "w", [torch.randn(2000, generator=gen(0))])
    c.end_round(True)
    assert ("w" in c.feedback.velocity) == momentum   # Adam's first moment, kept only with momentum=True
    before, velocity = p.detach().clone(), c.feedback.velocity.get("w", torch.zeros(0)).clone()
    residual, steps = c.residuals.residual("w").clone(), dict(c.feedback.steps)
    c.compress_named("w", torch.randn(2000, generator=gen(1)))
    out = torch.full((2000,), float("inf"))
    c.received("w", out)
    assert torch.isinf(out).all() and torch.equal(p.detach(), before)
    c.end_round(False)
    assert torch.equal(c.feedback.velocity.get("w", torch.zeros(0)), velocity) and c.feedback.steps == steps
    assert torch.equal(c.residuals.residual("w"), residual)


def test_frozen_variance_refuses_loss_scaled_gradients_and_changes_nothing():
    p = torch.ones(2000, requires_grad=True)
    opt = torch.optim.AdamW([p], lr=1e-2)
    c = TopK(ratio=0.1, feedback=gc.FrozenVariance(warmup=2))
    c.attach(opt, {p: "w"})
    for _ in range(2):
        p.grad = torch.randn(2000, generator=gen(0))
        opt.step()
    state = {k: v.clone() for k, v in opt.state[p].items()}
    with pytest.raises(ValueError, match="loss scaler"):
        c.compress_named("w", torch.randn(2000, generator=gen(1)) * 65536.0)
    assert all(torch.equal(state[k], v) for k, v in opt.state[p].items())
    assert c.residuals.residual("w") is None and not c.feedback.denom
    c.compress_named("w", torch.randn(2000, generator=gen(1)))   # unscaled: fine
    assert "w" in c.feedback.denom


def test_frozen_variance_refuses_optimizers_it_cannot_freeze():
    p = torch.zeros(10, requires_grad=True)
    for opt in (torch.optim.SGD([p], lr=0.1, momentum=0.9), torch.optim.Adam([p], weight_decay=0.1)):
        with pytest.raises(ValueError, match="feedback='frozen' needs torch.optim.Adam or AdamW"):
            TopK(feedback="frozen").attach(opt, {p: "w"})
    with pytest.raises(ValueError, match="warmup must be an int >= 1"):
        gc.FrozenVariance(warmup=0)


# ------------------------------------------------------------------ the automatic choice
def _opt(cls, **kw):
    return cls([torch.zeros(3, requires_grad=True)], **kw)


@pytest.mark.parametrize("make,compressor,expected", [
    (lambda: _opt(torch.optim.SGD, lr=0.1, momentum=0.9), TopKQSGD, "momentum"),
    (lambda: _opt(torch.optim.SGD, lr=0.1), TopK, "classic"),
    (lambda: _opt(torch.optim.Adam), TopKQSGD, "frozen"),
    (lambda: _opt(torch.optim.AdamW, weight_decay=0.1), TopKQSGD, "frozen"),
    (lambda: _opt(torch.optim.NAdam), TopKQSGD, "update"),
    (lambda: _opt(torch.optim.Adam, weight_decay=0.1), TopKQSGD, "classic"),  # coupled L2 decay
    (lambda: _opt(torch.optim.RMSprop), TopK, "update"),
    (lambda: _opt(torch.optim.AdamW), lambda: QSGD(bits=8), "classic"),
    (lambda: _opt(torch.optim.AdamW), lambda: QSGD(bits=4), "none"),
    (lambda: _opt(torch.optim.SGD, lr=0.1), lambda: QSGD(bits=2), "none"),
], ids=["sgd-momentum", "sgd", "adam", "adamw", "nadam", "adam-l2", "rmsprop", "qsgd8", "qsgd4", "qsgd2"])
def test_auto_feedback_follows_the_optimizer(make, compressor, expected, caplog):
    opt, c = make(), compressor()
    assert c.feedback.key == "classic"  # before an optimizer is known
    with caplog.at_level(logging.INFO, logger="hvd_gradcomp"):
        c.attach(opt, {opt.param_groups[0]["params"][0]: "w"})
        c.attach(opt, {opt.param_groups[0]["params"][0]: "w"})
    assert c.feedback.key == expected
    said = [r.getMessage() for r in caplog.records if r.name == "hvd_gradcomp"]
    assert len(said) == 1 and f"feedback '{expected}'" in said[0]


@pytest.mark.parametrize("ratio, cautioned", [(0.001, True), (SparsityWarmup(0.001, steps=10), True),
                                               (0.01, False), (0.05, False)])
def test_ratios_below_the_measured_ones_are_cautioned_once(ratio, cautioned, caplog):
    """Issue 9: TopKQSGD(0.1%) ended above uncompressed on every task of the study; the start-up
    message says so (once, with the policy chosen), and says nothing at 1% and above."""
    opt = _opt(torch.optim.AdamW)
    with caplog.at_level(logging.INFO, logger="hvd_gradcomp"):
        TopKQSGD(ratio=ratio).attach(opt, {opt.param_groups[0]["params"][0]: "w"})
    said = [r.getMessage() for r in caplog.records if r.name == "hvd_gradcomp"]
    assert len(said) == 1 and "feedback 'frozen'" in said[0]
    assert ("ratio 0.001 is below 0.01" in said[0] and "benchmarks/results/STUDY_RUN_LENGTH.md" in said[0]) == cautioned
    assert ("min_ratio={name pattern: share}" in said[0]) == cautioned
    assert "min_ratio" not in TopKQSGD(ratio=0.001, min_ratio={"^out": 0.01})._caution()
    assert QSGD(bits=8)._caution() == ""
    # the warm-up's length at this ratio (a short run may end inside it): "auto" gives "frozen" one below
    # 1% (TopK._auto_policy), none at 1% and above; none for a schedule of the user's
    assert ("sparsity warm-up lasts 172 compressed steps" in said[0]) == (ratio == 0.001)
    asked = TopKQSGD(ratio=0.001, feedback=gc.FrozenVariance(sparsity_warmup=100))
    asked.attach(opt, {opt.param_groups[0]["params"][0]: "w"})
    assert "sparsity warm-up lasts 172 compressed steps" in asked._caution()


@pytest.mark.parametrize("ratio, warm", [(0.001, 100), (0.005, 100), (0.01, 0), (0.05, 0),
                                         (SparsityWarmup(0.001, steps=10), 0)])
def test_auto_gives_adam_a_dense_momentum_warmup_below_one_percent(ratio, warm):
    """Issue 9: with Adam, ``feedback="auto"`` below ratio 1% (without a schedule of the user's) is
    ``FrozenVariance(sparsity_warmup=100, momentum="while dense")``; at 1% and above the class's
    defaults (no warm-up after the freeze, the gradient sent); SGD keeps momentum correction."""
    c = TopKQSGD(ratio=ratio)
    c.attach(_opt(torch.optim.Adam), {})
    assert c.feedback.key == "frozen" and c.feedback.sparsity_warmup == warm
    assert c.feedback.momentum == ("while dense" if warm else False)
    sgd = TopKQSGD(ratio=ratio)
    sgd.attach(_opt(torch.optim.SGD, lr=0.1, momentum=0.9), {})
    assert sgd.feedback.key == "momentum"


def test_a_forced_policy_is_kept_and_only_rank_zero_speaks(caplog):
    c = TopKQSGD(feedback="momentum")
    with caplog.at_level(logging.INFO, logger="hvd_gradcomp"):
        c.attach(_opt(torch.optim.AdamW), {}, rank=1)
    assert c.feedback.key == "momentum" and not caplog.records


def test_without_logging_configured_the_choice_goes_to_stderr(capsys, monkeypatch):
    monkeypatch.setattr(fb.log, "hasHandlers", lambda: False)
    TopK().attach(_opt(torch.optim.Adam), {})
    assert "hvd_gradcomp: TopK" in capsys.readouterr().err


@pytest.mark.parametrize("kw,match", [(dict(feedback="ef99"), "feedback must be"),
                                      (dict(error_feedback=False, feedback="momentum"), "contradicts"),
                                      (dict(clip=0), "clip"), (dict(exclude="("), "regular expression")])
def test_bad_feedback_arguments_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        TopK(**kw)


# ------------------------------------------------------------------ schedules, exclude, clip
def test_sparsity_warmup_sends_more_at_first():
    c = TopK(ratio=SparsityWarmup(0.01, steps=4, start=0.5), error_feedback=False, min_k=1)
    ks = [c.decode_parts(c.compress_named("w", torch.randn(1000, generator=gen(s))))[0].numel() for s in range(6)]
    assert ks == [500, 189, 71, 27, 10, 10]  # ceil(1000 * 0.5 * 0.02 ** (s / 4))
    assert c.ratio == 0.01 and "SparsityWarmup" in repr(c)


def test_ratio_may_be_any_schedule():
    c = TopK(ratio=lambda step: 0.5 if step < 1 else 0.1, error_feedback=False, min_k=1)
    ks = [c.decode_parts(c.compress_named("w", torch.randn(100, generator=gen(s))))[0].numel() for s in range(3)]
    assert ks == [50, 10, 10]
    with pytest.raises(ValueError, match="ratio"):
        TopK(ratio=lambda step: 2.0)


def test_sparsity_warmup_checks_its_arguments():
    with pytest.raises(ValueError, match="start"):
        SparsityWarmup(0.5, steps=10, start=0.1)
    with pytest.raises(ValueError, match="steps"):
        SparsityWarmup(0.01, steps=-1)


def test_exclude_by_name():
    c = TopKQSGD(exclude=r"embed|norm")
    assert not c.compresses("tok_embed.weight") and not c.compresses("blocks.0.norm.bias")
    assert c.compresses("blocks.0.mlp.0.weight")


def test_local_clipping_bounds_what_is_sent():
    c = TopK(ratio=1.0, clip=1.0, error_feedback=False)
    g = torch.randn(500, generator=gen(3)) * 10
    assert abs(float(c.decode(c.compress_named("w", g)).norm()) - 1.0) < 1e-5
    small = torch.full((4,), 0.1)
    assert torch.equal(c.decode(c.compress_named("v", small)), small)


# ------------------------------------------------------------------ checkpoints
@pytest.mark.parametrize("policy", ["momentum", "update", "classic", "frozen"])
def test_state_dict_round_trip_continues_identically(policy):
    def build():
        p = torch.ones(30, 20, requires_grad=True)
        adaptive = policy in ("update", "frozen")
        opt = torch.optim.AdamW([p], lr=1e-2) if adaptive else torch.optim.SGD([p], lr=0.1, momentum=0.9)
        c = TopKQSGD(ratio=0.1, feedback=gc.FrozenVariance(warmup=1) if policy == "frozen" else policy, seed=5)
        c.attach(opt, {p: "w"})
        if policy == "frozen":   # one dense Adam step: v to freeze (the same on both copies)
            p.grad = torch.full((30, 20), 0.5)
            opt.step()
            p.grad = None
        return p, c

    def steps(p, c, start, n):
        payloads = []
        for s in range(start, start + n):
            payload = c.compress_named("w", torch.randn(30, 20, generator=gen(s)))
            out = c.decode(payload).reshape(-1)
            c.received("w", out)
            payloads.append(payload)
        return payloads

    p1, c1 = build()
    steps(p1, c1, 0, 3)
    buf = io.BytesIO()
    torch.save(c1.state_dict(), buf)
    buf.seek(0)
    p2, c2 = build()
    with torch.no_grad():
        p2.copy_(p1)
    c2.load_state_dict(torch.load(buf, weights_only=True))
    for a, b in zip(steps(p1, c1, 3, 3), steps(p2, c2, 3, 3)):
        assert torch.equal(a, b)
    assert torch.equal(p1, p2)


def test_checkpoint_of_another_policy_is_refused():
    a, b = TopK(feedback="momentum", seed=1), TopK(feedback="classic", seed=2)
    a.compress_named("w", torch.randn(10))
    with pytest.raises(ValueError, match="feedback='momentum'"):
        b.load_state_dict(a.state_dict())
    assert b.residuals.residual("w") is None and b.seed != a.seed  # refused before anything changed


def test_overflow_step_undoes_residuals_velocity_and_relay():
    """An exchange step ended non-finite (end_round(False)) restores the policy's residuals
    and momentum correction's velocity and delivered average, the relay's residuals and the
    random streams."""
    p = torch.ones(40, requires_grad=True)
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    c = TopKQSGD(ratio=0.25, bits=2, bucket_size=8, seed=3, feedback="momentum")
    c._claim(opt, 2)
    c.attach(opt, {p: "w"})
    assert c.feedback.key == "momentum"
    c.compress_named("w", torch.randn(40, generator=gen(0)))
    c.compress_named("w#reduced0", torch.randn(20, generator=gen(1)), relay=True)
    c.received("w", torch.ones(40))
    c.end_round(True)
    before = (c.residuals.residual("w").clone(), c._relay.residuals.residual("w#reduced0").clone(), dict(c._steps))
    velocity, delivered = c.feedback.velocity["w"].clone(), c.feedback.delivered["w"].clone()
    c.compress_named("w", torch.randn(40, generator=gen(2)))
    c.compress_named("w#reduced0", torch.randn(20, generator=gen(3)), relay=True)
    c.received("w", torch.full((40,), float("nan")))
    assert not torch.equal(c.residuals.residual("w"), before[0])
    assert not torch.equal(c.feedback.velocity["w"], velocity)
    c.end_round(False)
    assert torch.equal(c.residuals.residual("w"), before[0])
    assert torch.equal(c._relay.residuals.residual("w#reduced0"), before[1])
    assert c._steps == before[2] and c.exchange_step == 2
    assert torch.equal(c.feedback.velocity["w"], velocity)
    assert torch.equal(c.feedback.delivered["w"], delivered)


def test_momentum_correction_starts_with_a_sparsity_warmup():
    """Momentum correction (the default for SGD with momentum) sends a share falling from 25% to
    the ratio over its first ``sparsity_warmup`` steps, per tensor; 0 or a ratio schedule of the
    user's own turns it off; the setting is checkpointed (old checkpoints resume without one)."""
    p = torch.zeros(4000, requires_grad=True)
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    c = TopK(ratio=0.01, feedback=gc.MomentumCorrection(sparsity_warmup=4), seed=0)
    c.attach(opt, {p: "w"})
    sent = [c.decode_parts(c.compress_named("w", torch.randn(4000, generator=gen(s))))[0].numel() for s in range(6)]
    assert sent == [1000, 448, 200, 90, 40, 40], sent   # ceil(4000 * 0.25 * 0.04 ** (s / 4))
    auto = TopK(ratio=0.01)
    auto.attach(opt, {p: "w"})
    assert auto.feedback.key == "momentum" and auto.ratio_at(0) == 0.25
    assert auto.feedback.sparsity_warmup == gc.feedback.SPARSITY_WARMUP
    assert TopK(ratio=0.01, feedback=gc.MomentumCorrection(sparsity_warmup=0)).ratio_at(0) == 0.01
    assert TopK(ratio=gc.SparsityWarmup(0.01, steps=0), feedback="momentum").ratio_at(0) == 0.01
    state = c.feedback.state_dict()
    assert state["sparsity_warmup"] == 4
    old = {k: v for k, v in state.items() if k != "sparsity_warmup"}
    resumed = gc.MomentumCorrection()
    resumed.load_state_dict(old)
    assert resumed.sparsity_warmup == 0
    with pytest.raises(ValueError, match="sparsity_warmup must be an int >= 0"):
        gc.MomentumCorrection(sparsity_warmup=2.5)


def test_frozen_variance_sparsity_warmup_follows_the_dense_warmup():
    """After the dense warm-up the share sent falls from 25% to the ratio over ``sparsity_warmup``
    compressed steps (per tensor), then stays; a ratio schedule of the user's own takes precedence."""
    p = torch.zeros(4000, requires_grad=True)
    opt = torch.optim.AdamW([p], lr=1e-3)
    c = TopK(ratio=0.01, feedback=gc.FrozenVariance(warmup=1, sparsity_warmup=4), seed=0)
    c.attach(opt, {p: "w"})
    p.grad = torch.randn(4000, generator=gen(0))
    opt.step()
    sent = []
    for s in range(6):
        idx, _ = c.decode_parts(c.compress_named("w", torch.randn(4000, generator=gen(s + 1))))
        sent.append(idx.numel())
    assert sent == [1000, 448, 200, 90, 40, 40], sent   # ceil(4000 * 0.25 * 0.04 ** (s / 4))
    own = TopK(ratio=gc.SparsityWarmup(0.01, steps=2), feedback=gc.FrozenVariance(sparsity_warmup=4))
    assert [own.ratio_at(s) for s in (0, 2, 3)] == [0.25, 0.01, 0.01]
    with pytest.raises(ValueError, match="sparsity_warmup must be an int >= 0"):
        gc.FrozenVariance(sparsity_warmup=-1)


@pytest.mark.parametrize("policy", ["momentum", "frozen"])
def test_sparsity_warmup_lasts_longer_below_one_percent(policy):
    """A sparsity warm-up of 100 steps (momentum's default; frozen's when asked for) lasts 100 steps at
    ratios of 1% and above; below, longer: "frozen" keeps the pace it has at 1% (172 steps at 0.1%),
    "momentum", whose warm-up is all its lead-in, lasts sqrt(1%/ratio) times longer (317 steps at
    0.1%); a schedule of the user's own takes precedence. "frozen" has none by default."""
    from hvd_gradcomp.codecs.compressor import sparsity_warmup_steps
    p = torch.zeros(4000, requires_grad=True)
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9) if policy == "momentum" else torch.optim.AdamW([p])
    asked = {} if policy == "momentum" else {"feedback": gc.FrozenVariance(sparsity_warmup=100)}
    at = {}
    for ratio in (0.1, 0.01, 0.001, 0.0001):
        c = TopK(ratio=ratio, **asked)
        c.attach(opt, {p: "w"})
        assert c.feedback.key == policy
        at[ratio] = [c.ratio_at(s) for s in range(1200)]
    warm = {r: next(s for s, v in enumerate(shares) if v == r) for r, shares in at.items()}
    expected = {0.1: 100, 0.01: 100, 0.001: 172, 0.0001: 244} if policy == "frozen" else \
        {0.1: 100, 0.01: 100, 0.001: 317, 0.0001: 1000}
    assert warm == expected, warm
    assert warm[0.001] == sparsity_warmup_steps(100, 0.001, c.feedback.warmup_pace)
    told = TopK(ratio=0.001, **asked)
    told.attach(opt, {p: "w"})
    assert f"sparsity warm-up lasts {expected[0.001]} compressed steps" in told._caution()   # said at start-up
    if policy == "frozen":
        # the same share step for step (within the rounding up of 171.5 steps) until 1%, reached near step 100
        assert all(a == pytest.approx(b, rel=0.01) for a, b in zip(at[0.001][:100], at[0.01][:100]))
        assert at[0.001][100] > 0.01 > at[0.001][110]
    else:
        # from 25% as at 1%, but falling more slowly: still above 1% at step 100, and 1% reached near
        # step 317 * log(25) / log(250) = 185
        assert at[0.001][0] == 0.25 and at[0.001][100] > 0.01 * 2
        assert at[0.001][180] > 0.01 > at[0.001][190]
    for ratio in (0.01, 0.001):
        assert all(a >= b for a, b in zip(at[ratio], at[ratio][1:]))       # never rises
    own = TopK(ratio=gc.SparsityWarmup(0.001, steps=100), feedback=policy)
    assert own.ratio_at(100) == 0.001
    default = TopK(ratio=0.01)
    default.attach(opt, {p: "w"})
    assert default.feedback.key == policy and default.ratio_at(0) == (0.25 if policy == "momentum" else 0.01)


@pytest.mark.parametrize("policy", ["momentum", "frozen"])
def test_a_param_group_added_after_binding_is_bound_before_its_first_compression(policy):
    """``optimizer.add_param_group`` unseen by the wrapper (the DDP hook, stock hvd.DistributedOptimizer):
    the policy binds the new group before it compresses a tensor of it. Unbound, momentum correction ran
    it with momentum 0, and "frozen" could not compress it."""
    p, q = torch.zeros(4000, requires_grad=True), torch.zeros(4000, requires_grad=True)
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.5) if policy == "momentum" else torch.optim.AdamW([p])
    c = TopK(ratio=0.01)
    c.attach(opt, {p: "a", q: "b"})   # the names of the whole model, as the DDP hook has them
    assert c.feedback.key == policy
    opt.add_param_group({"params": [q], "momentum": 0.9} if policy == "momentum" else {"params": [q]})
    c.compresses("b", q.numel())
    if policy == "momentum":
        assert c.feedback._coefficients("b") == (0.9, 0.0) and c.feedback._coefficients("a") == (0.5, 0.0)
    else:
        assert not c.feedback.needs_optimizer_state("b")


def test_sparsity_warmup_pace_is_checked():
    from hvd_gradcomp.codecs.compressor import sparsity_warmup_steps
    with pytest.raises(ValueError, match="pace must be 'same' or 'sqrt'"):
        sparsity_warmup_steps(100, 0.001, "fast")


# ------------------------------------------------------------------ averages scaled before the step
def _handed_once(comp, p, opt, edit, k):
    """Exchange ``k`` as the optimizers run it: the average handed over (received), the user's
    ``edit`` of p.grad, the optimizer's step."""
    avg = torch.zeros(p.numel())
    support = torch.arange(0, p.numel(), 7)
    avg[support] = torch.linspace(0.5, 2.0, support.numel())
    comp.received("w", avg, support)
    p.grad = avg.view_as(p).clone()
    edit(p.grad, k)
    opt.step()


@pytest.mark.parametrize("edit,warned,scaled", [
    (lambda g, k: None, False, False),
    (lambda g, k: g.mul_(0.3 + 0.001 * k), True, True),          # clip_grad_norm_: a new factor each step
    (lambda g, k: g.mul_(0.3), False, True),                     # a fixed rescale: another learning rate
    (lambda g, k: g.mul_(2.0 ** -(3 + k % 2)), False, False),    # a loss scaler's unscale_, scale changing
    (lambda g, k: g.mul_((0.3 + 0.001 * k) * 2.0 ** -(3 + k % 2)), True, True),   # unscale_, then a clip
    (lambda g, k: g.add_(1.0), False, False),
    (lambda g, k: g.view(-1)[:10].mul_(0.3 + 0.001 * k), False, False)],
    ids=["untouched", "clipped", "constant", "unscaled", "unscaled-clipped", "added", "partly-scaled"])
def test_averages_scaled_before_the_step_are_said_once(edit, warned, scaled):
    """A factor on the whole average that changes from step to step (clip_grad_norm_) is said, once,
    naming the fix; a constant factor, a power of two (a loss scaler's unscale_) and other edits are
    not. ``scaled_after_exchange`` counts the steps scaled other than by a power of two. Checked
    for HANDED_CHECK_STEPS steps."""
    p = torch.nn.Parameter(torch.zeros(30, 20))
    opt = torch.optim.SGD([p], lr=0.1)          # plain SGD: classic error feedback
    comp = TopKQSGD(ratio=0.1)
    comp.attach(opt, {p: "w"})
    assert comp.carries_held_back
    with pytest.warns(RuntimeWarning, match=r"scaled by 0\.\d+ before .*changes from step to step.*clip=max_norm") \
            if warned else _no_warning():
        for k in range(3):
            _handed_once(comp, p, opt, edit, k)
    assert comp.scaled_after_exchange == (3 if scaled else 0)
    for k in range(3, 3 + HANDED_CHECK_STEPS):
        _handed_once(comp, p, opt, edit, k)
    assert comp.scaled_after_exchange == (HANDED_CHECK_STEPS if scaled else 0)


def _no_warning():
    import contextlib
    import warnings

    @contextlib.contextmanager
    def quiet():
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            yield
    return quiet()


def test_policies_that_move_the_parameters_are_not_watched():
    p = torch.nn.Parameter(torch.zeros(30, 20))
    opt = torch.optim.AdamW([p], lr=0.1)
    for policy in ("frozen", "update"):
        comp = TopKQSGD(ratio=0.1, feedback=policy)
        comp.attach(opt, {p: "w"})
        assert not comp.carries_held_back
    assert not QSGD(bits=8).carries_held_back
