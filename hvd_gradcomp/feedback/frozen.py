"""Adam and AdamW with their second moment frozen after a dense warm-up: the
``feedback="frozen"`` policy (see :mod:`hvd_gradcomp.feedback` for the protocol every policy follows).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from . import kernels
from .policy import ErrorFeedback, _clone_tensors, _RoundUndo, check_sparsity_warmup
from .registry import frozen_variance_unsupported
from .residuals import residual_dtype
from .frozen_momentum import FLAT_RATE_STEPS, WHILE_DENSE, MomentumChoice
from .frozen_scale import FOLLOW_SCALE, ScaleFollower, _squared_norm
from .frozen_warmup import CLIP_DETECT_TOLERANCE, SCALED_GRADIENT_RATIO, WarmupWindow

__all__ = ["FrozenVariance", "check_frozen_variance", "FOLLOW_SCALE", "WHILE_DENSE", "FLAT_RATE_STEPS",
           "CLIP_DETECT_TOLERANCE", "SCALED_GRADIENT_RATIO"]


class FrozenVariance(MomentumChoice, _RoundUndo, ErrorFeedback):
    """Adam and AdamW with their second moment frozen after a dense warm-up (1-bit Adam, Tang et
    al. 2021), then each rank's update direction sent through error feedback (``feedback="frozen"``).

    * ``warmup``: for a tensor's first ``warmup`` optimizer steps with a gradient, :meth:`dense` is
      True: the tensor goes through the dense allreduce and the wrapped optimizer runs exact Adam.
    * ``max_warmup``: while the learning rate still rises (a scheduler's warm-up), the dense warm-up
      goes on, up to this many steps; why: a ``v`` frozen mid-ramp is the wrong one for the rest of
      the run (``1``: freeze after ``warmup`` steps whatever the rate does).
    * ``window``, ``floor``: the frozen ``denom = max(sqrt(v_hat), floor * mean(sqrt(v_hat))) + eps``,
      ``v_hat`` the average of the warm-up's last ``window`` squared averaged gradients, recovered
      from Adam's ``v`` (``None``: Adam's bias-corrected ``v``, which still mostly remembers the
      first gradients); the floor keeps coordinates that had (almost) no gradient from taking
      ``lr/eps``-sized steps later.
    * Then each rank sends ``g / denom`` through error feedback, whose residual takes the place of
      Adam's first moment, and the parameter moves by ``-lr * D`` (``D``: the averaged sent
      direction, identical on every rank). The wrapped optimizer is handed a zero gradient with its
      first moment cleared, so it applies only decoupled weight decay (AdamW).
    * ``follow_scale``: ``"down"`` divides what a rank sends by ``denom * sqrt(s_t / s_freeze)``
      while its gradients' mean square ``s_t`` (averaged over ``window`` steps) is below its value at
      the freeze; why: a ``v`` frozen for good makes every later step shorter where gradients
      shrink. ``"both"`` follows growth too, ``None`` keeps ``v`` frozen for good.
    * ``momentum``: ``False`` sends the gradient; ``True`` sends each rank's
      ``u = b1*u + (1-b1)*g`` and moves by ``-lr * D / (1 - b1**t)`` (at ratio 1: exactly Adam with
      ``v`` frozen); ``"while dense"`` keeps it while a sparsity warm-up sends more than ``1 - b1``
      of a tensor (:meth:`_dense_share`); ``None`` keeps it until a tensor's rate has stayed the
      same :data:`FLAT_RATE_STEPS` steps. Why ``False``: sending the momentum made the loss jump
      after the freeze on models with shared, frozen or intermittent layers.
    * ``sparsity_warmup``: DGC's falling share after the freeze (default 0: none, for the same reason).

    Why ``v`` is frozen rather than error feedback on gradients or "update", and the measurements
    behind every default: docs/FEEDBACK.md (``frozen``) and docs/STUDY.md.

    Like "update", the change is applied when the exchange finishes (in ``synchronize()``), so
    clipping ``p.grad`` between ``synchronize()`` and ``step()`` does not reach it: use the
    compressor's ``clip=``. A non-finite average moves nothing and is passed on, so a loss
    scaler skips the step everywhere (and the step's state is put back).

    >>> w = torch.nn.Parameter(torch.ones(4))
    >>> opt = torch.optim.AdamW([w], lr=0.1)
    >>> fv = FrozenVariance(warmup=1)
    >>> fv.bind("w", opt.param_groups[0], w, opt)
    >>> fv.dense("w")                       # no Adam step yet: the warm-up is dense
    True
    >>> w.grad = torch.full((4,), 0.5); opt.step()
    >>> fv.dense("w")
    False
    """

    key = "frozen"
    # this rank's velocity and gradient scale; denom, steps and the warm-up's window are the same on every rank
    rank_own_state = ("units", "velocity", "scale", "scale_at_freeze")
    moves_parameters = True
    _round_stores = ("velocity", "steps", "scale")  # velocity, steps: set at the freeze, before _remember

    def __init__(self, warmup: int = 100, floor: float = 0.1, sparsity_warmup: int = 0,
                 window: Optional[int] = 50, max_warmup: int = 1000, momentum: Optional[bool] = False,
                 follow_scale: Optional[str] = "down") -> None:
        super().__init__()
        # This rank's b2-average of its gradient's mean square and its value when v was frozen: see _follow_scale.
        self._scales = ScaleFollower(follow_scale)
        _check_settings(momentum, warmup, max_warmup, window)
        self.momentum, self.max_warmup, self.window = momentum, max_warmup, window
        self._warmup = WarmupWindow()   # the rates, Adam's v, idle steps and clipping seen during the warm-up
        self.sparsity_warmup = check_sparsity_warmup(sparsity_warmup, "FrozenVariance")
        if not 0.0 <= floor <= 1.0:
            raise ValueError(f"FrozenVariance floor must be in [0, 1] (share of the mean of sqrt(v)), got {floor!r}")
        self.warmup, self.floor = warmup, floor
        self._bound: Dict[str, Tuple[torch.Tensor, Dict[str, Any], Any]] = {}
        self.velocity: Dict[str, torch.Tensor] = {}
        self.denom: Dict[str, torch.Tensor] = {}
        self.steps: Dict[str, int] = {}
        self._undo = None  # see _RoundUndo

    follow_scale = property(lambda self: self._scales.follow_scale,
                            lambda self, value: setattr(self._scales, "follow_scale", value))
    # "scale" is a round store (_round_stores): the dict itself, replaced entry by entry
    scale = property(lambda self: self._scales.scale)
    scale_at_freeze = property(lambda self: self._scales.scale_at_freeze)
    _flat = property(lambda self: self._warmup.flat)

    def bind(self, name: str, group: Dict[str, Any], param: Optional[torch.Tensor] = None,
             optimizer: Any = None) -> None:
        if param is None or optimizer is None:
            return
        check_frozen_variance(optimizer)
        super().bind(name, group, param, optimizer)
        self._bound[name] = (param, group, optimizer)

    def dense(self, name: str) -> bool:
        if name in self.denom:
            return False
        if name not in self._bound:
            return False  # not bound (yet): prepare() says what is missing
        param, group, optimizer = self._bound[name]
        state = optimizer.state.get(param, {})
        if self.window is not None and "exp_avg_sq" in state and not group.get("amsgrad") \
                and state["exp_avg_sq"].dtype in (torch.float32, torch.float64):
            # Not from a float16/bfloat16 v (a half-precision model's Adam state): each step's squared
            # gradient, recovered as v_t - b2 * v_(t-1), is lost to rounding there (a spurious "scaled
            # by the user's code" warning showed it); Adam's own v is frozen instead (see _frozen_v).
            self._warmup.track(name, state, group, self.window)
        t = int(state.get("step", 0))
        rising = self._warmup.lr_rising(name, t, float(group["lr"]))
        if t < self.warmup or "exp_avg_sq" not in state or (rising and t < self._longest_warmup):
            return True
        idle = self._warmup.idle.get(name)
        if idle is not None and t - int(idle) < self.warmup:
            return True   # fewer than warmup steps with a gradient (a layer unused at first): see dense_average
        return not bool(state["exp_avg_sq"].any())  # no gradient yet: nothing to freeze

    def needs_optimizer_state(self, name: str) -> bool:
        """Adam's state of ``name`` is what is frozen: a tensor outside the bound optimizer cannot be."""
        return name not in self._bound

    @property
    def _longest_warmup(self) -> int:
        return max(self.warmup, self.max_warmup)

    def dense_local(self, name: str, grad: torch.Tensor) -> None:
        """A warm-up step's own gradient (a tensor not frozen yet goes dense: :meth:`dense`): its scale is
        followed from the first step (see :meth:`_follow_scale`)."""
        if name in self._bound and name not in self.denom:
            self._follow_scale(name, grad)

    def _follow_scale(self, name: str, grad: torch.Tensor) -> None:
        """Average this rank's gradient mean square over about ``window`` steps (weight ``1 / window``,
        the span the frozen ``v`` averages; ``window=None``: Adam's ``1 - b2``), from the tensor's first
        step on, at any rate (:meth:`ScaleFollower.averaged`). Nothing with ``follow_scale=None``: the
        average would never be read (:meth:`_scale_factor`), and it costs a pass over the gradient."""
        if self.follow_scale is None:
            return
        weight = 1.0 / self.window if self.window is not None else 1.0 - float(self._bound[name][1]["betas"][1])
        self._replace("scale", name, self._scales.averaged(name, grad, weight))

    def _scale_factor(self, name: str) -> Optional[torch.Tensor]:
        """How much longer this rank's step of ``name`` is than with ``v`` frozen for good
        (:meth:`ScaleFollower.factor`); None while the scale has not moved since the freeze."""
        return self._scales.factor(name)

    def dense_average(self, name: str, avg: torch.Tensor) -> None:
        """Keep the squared norm of a warm-up step's average as exchanged (see :meth:`WarmupWindow.unscale`),
        and count the warm-up steps whose average was all zero, which :meth:`dense` does not count as
        warm-up (:meth:`WarmupWindow.count_idle`). On the device, no host sync here."""
        if name in self.denom:
            return   # frozen: the warm-up is over
        self._warmup.count_idle(name, avg)
        if name in self._warmup.last_v and self.window is not None:
            param, _, optimizer = self._bound[name]
            t = int(optimizer.state.get(param, {}).get("step", 0)) + 1   # the Adam step about to use it
            self._warmup.delivered[name] = (t, _squared_norm(avg))

    def _freeze(self, name: str) -> None:
        self._warmup.say_if_clipped(name)
        param, group, optimizer = self._bound[name]
        state = optimizer.state[param]
        b1, b2 = group["betas"]
        t = int(state["step"])
        v = state["max_exp_avg_sq"] if group.get("amsgrad") else state["exp_avg_sq"]
        v = v.detach().to(residual_dtype(param.dtype)).reshape(-1)
        root = self._warmup.frozen_v(name, v, b2, t, self.window).sqrt()
        self.denom[name] = root.clamp(min=self.floor * float(root.mean())).add_(group["eps"])
        if self._keeps_momentum(name, t):
            self.velocity[name] = state["exp_avg"].detach().to(root.dtype).reshape(-1).clone()
        self.steps[name] = t

    def prepare(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        if self.needs_optimizer_state(name):   # the DDP hook sends such a tensor dense instead
            raise RuntimeError(f"feedback='frozen' needs the wrapped optimizer to know parameter {name!r}: "
                               "use it through hvd_gradcomp.DistributedOptimizer, hvd.DistributedOptimizer or "
                               "hvd_gradcomp.ddp.register(..., optimizer=opt)")
        self.residuals.check_shape(name, grad)
        if name not in self.denom:
            self._freeze(name)
            self._check_scale(name, grad)
            param, _, optimizer = self._bound[name]
            optimizer.state[param]["exp_avg"].zero_()  # from now on it moves nothing but weight decay
        self._scales.mark_freeze(name)
        self._follow_scale(name, grad)
        u = self._direction(name, grad)
        # What goes out is the update direction u / denom, not u: top-k then picks the coordinates
        # that would move most, and the residual is kept in the units of movement.
        acc, res = self.residuals.buffer(name, u), self.residuals.residual(name, self._lr(name))
        factor = self._scale_factor(name)
        if factor is not None:
            u = u * factor.to(u.dtype)
        step = torch.div(u, self.denom[name], out=acc)
        bound = self._step_bound(name)
        if bound is not None:
            step.clamp_(-bound, bound)
        return step if res is None else step.add_(res)

    def _step_bound(self, name: str) -> Optional[float]:
        """The most one gradient may add to a coordinate's movement (in units of ``lr``):
        ``1 / sqrt(1 - b2)``, the most Adam moves a coordinate in answer to one gradient, however
        large (its ``v`` takes at least ``(1 - b2) * g**2`` of it, so ``|g| / sqrt(v) <= 1 / sqrt(1 - b2)``);
        None for ``b2 == 1``.

        Why: with ``v`` frozen, a coordinate whose gradient was (almost) zero during the warm-up
        (an embedding row of a rare token, a tied head's row) has the floor for ``denom``; its first
        large gradient afterwards moved it ``|g| / denom`` times the rate (311,810x in
        tests/test_frozen_bound.py), and the tied-embedding recipe at lr 8e-3 diverged ~80 steps
        after the freeze (docs/RECIPES.md, "Before the fixes"). Adam's own bound leaves every
        ordinary step alone.

        >>> fv = FrozenVariance()
        >>> fv._bound["w"] = (None, {"betas": (0.9, 0.99)}, None)
        >>> round(fv._step_bound("w"), 6)
        10.0
        """
        b2 = float(self._bound[name][1]["betas"][1])
        return None if b2 >= 1.0 else (1.0 - b2) ** -0.5

    def _check_scale(self, name: str, grad: torch.Tensor) -> None:
        """Refuse gradients far larger than the warm-up's (a loss scaler's scaled gradients): the
        update is applied before the scaler unscales, so it would be that many times too large.
        Called once per tensor, at its first compressed step, before any state changes."""
        rms_g = float(grad.detach().float().pow(2).mean().sqrt())
        rms_v = float((self.denom[name] - self._bound[name][1]["eps"]).pow(2).mean().sqrt())
        if rms_v > 0 and rms_g > SCALED_GRADIENT_RATIO * rms_v:
            del self.denom[name], self.steps[name]
            self.velocity.pop(name, None)
            raise ValueError(
                f"feedback='frozen': the gradient of {name!r} is {rms_g / rms_v:.3g}x larger than during Adam's "
                "dense warm-up; is it scaled by a loss scaler (torch.amp.GradScaler)? This policy applies the "
                "update in synchronize(), before the scaler unscales. Use bf16 autocast without a scaler, or "
                "build the compressor with feedback='classic'.")

    def received(self, name: str, avg: torch.Tensor, support: Optional[torch.Tensor] = None) -> None:
        if not kernels.all_finite(avg):
            return  # passed on as it is: the loss scaler skips this step on every rank
        param, group, _ = self._bound[name]
        self._remember(name)
        t = self.steps[name] = self.steps[name] + 1
        lr = float(group["lr"])
        # Adam's bias correction, of the first moment only
        scale = -lr / (1.0 - group["betas"][0] ** t) if name in self.velocity else -lr
        if group.get("maximize", False):
            scale = -scale
        # The wrapped optimizer decays the parameter after this (decoupled weight decay,
        # p *= 1 - lr*wd): pre-divide so the result is p*(1 - lr*wd) + step, as in AdamW.
        decay = 1.0 - lr * float(group.get("weight_decay", 0.0))
        if decay > 0.0:
            scale /= decay
        with torch.no_grad():
            param.add_(avg.view(param.shape).to(param.dtype), alpha=scale)
        avg.zero_()

    def received_terms(self, name: str) -> Optional[List[Tuple[torch.Tensor, torch.Tensor]]]:
        """``[]``: :meth:`received` zeroes a finite average and leaves a non-finite one as it was, so
        the exchange's check at the sent indices holds (see :meth:`Feedback.received_terms`) and
        ``synchronize()`` needs no full pass over a compressed tensor of AdamW."""
        return []

    def describe(self) -> str:
        # with AdamW over 1200 steps, freezing after 300 steps (a quarter of the run, 1-bit
        # Adam's advice) ended closest to uncompressed (docs/STUDY_RUN_LENGTH.md); the run's length
        # is not known here, so the user is told once rather than the default guessed. The frozen v
        # follows the gradients where they shrink (see the class docstring)
        return (f"Adam's second moment frozen after {self.warmup} dense steps per tensor (more while the learning "
                f"rate still rises, at most {self._longest_warmup}), "
                + _MOMENTUM_SAID[self.momentum] + _FOLLOW_SCALE_SAID[self.follow_scale]
                + f"; for a run much longer than {4 * self.warmup} steps, freeze "
                "later: feedback=FrozenVariance(warmup=a quarter of the run's steps) (docs/STUDY_RUN_LENGTH.md)")

    def state_dict(self) -> Dict[str, Any]:
        # The warm-up's window (running average, Adam's last v) and the rates seen are saved too, so
        # a run resumed inside the warm-up freezes the same v at the same step as one that never
        # stopped (two gradient-sized tensors per tensor still in its warm-up; none after it).
        parts = {"velocity": _clone_tensors(self.velocity), "denom": _clone_tensors(self.denom),
                 "steps": dict(self.steps), "warmup": self.warmup, "floor": self.floor,
                 "sparsity_warmup": self.sparsity_warmup, "window": self.window,
                 "max_warmup": self.max_warmup, "momentum": self.momentum,
                 **self._warmup.state_dict(), **self._scales.state_dict()}
        return {**super().state_dict(), **{k: parts.pop(k) for k in _STATE_ORDER if k in parts}, **parts}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.velocity = _clone_tensors(state.get("velocity", {}))
        self.denom = _clone_tensors(state.get("denom", {}))
        self.steps = dict(state.get("steps", {}))
        self.warmup, self.floor = int(state.get("warmup", self.warmup)), float(state.get("floor", self.floor))
        self.window = state.get("window", self.window)
        self.max_warmup = int(state.get("max_warmup", self.max_warmup))
        # Checkpoints from before the choice was saved: this policy's (tensors frozen then have a velocity)
        self.momentum = state.get("momentum", self.momentum)
        self._scales.load_state_dict(state)
        self._warmup.load_state_dict(state)
        self.sparsity_warmup = int(state.get("sparsity_warmup", self.sparsity_warmup))
        if self._undo is not None:
            self._undo.clear()


_STATE_ORDER = ("velocity", "denom", "steps", "warmup", "floor", "sparsity_warmup", "window", "max_warmup",
                "momentum", "flat", "follow_scale", "recent", "last_v", "lr_seen", "delivered", "rescaled",
                "clipping_seen", "scale", "scale_at_freeze", "idle")
"""The order :meth:`FrozenVariance.state_dict` writes its own keys in (as it always has, so a saved
checkpoint's bytes do not change with where each part of the state is kept)."""

_MOMENTUM_SAID = {
    True: "each rank's momentum through error feedback (1-bit Adam style)",
    False: "each rank's gradient through error feedback, whose residual takes the first moment's place",
    None: "each rank's momentum through error feedback (1-bit Adam style) while the learning rate "
          f"changes, its gradient once the rate has stayed the same {FLAT_RATE_STEPS} steps (error "
          "feedback's residual then takes the first moment's place: docs/STUDY.md, transformer-const)",
    WHILE_DENSE: "each rank's momentum through error feedback while the sparsity warm-up sends more than "
                 "1 - b1 of a tensor, its gradient after (whose residual takes the first moment's place)"}
"""What :meth:`FrozenVariance.describe` says of each ``momentum`` choice."""
_FOLLOW_SCALE_SAID = {"down": ", the frozen v following the gradients' scale where it shrinks (docs/STUDY.md)",
                      "both": ", the frozen v following the gradients' scale", None: ", v frozen for good"}
"""What :meth:`FrozenVariance.describe` says of each ``follow_scale`` choice."""


def _check_settings(momentum: Any, warmup: Any, max_warmup: Any, window: Any) -> None:
    """:class:`FrozenVariance`'s checks of these arguments, in its constructor's order."""
    if momentum is not None and not isinstance(momentum, bool) and momentum != WHILE_DENSE:
        raise ValueError(f"FrozenVariance momentum must be None (Adam's first moment kept while the learning rate "
                         f"changes), {WHILE_DENSE!r} (kept while the sparsity warm-up sends more than 1 - b1 of "
                         f"a tensor), True (always kept) or False (never: error feedback's residual sums the "
                         f"gradients), got {momentum!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
        raise ValueError(f"FrozenVariance warmup must be an int >= 1 (dense Adam steps before v is frozen), "
                         f"got {warmup!r}")
    if isinstance(max_warmup, bool) or not isinstance(max_warmup, int) or max_warmup < 1:
        raise ValueError(f"FrozenVariance max_warmup must be an int >= 1 (the most dense steps while the learning "
                         f"rate still rises; never fewer than warmup), got {max_warmup!r}")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 2):
        raise ValueError(f"FrozenVariance window must be an int >= 2 (the warm-up's last steps that the frozen v "
                         f"averages) or None (Adam's own v), got {window!r}")


def check_frozen_variance(optimizer: Any) -> None:
    """Raise unless ``optimizer`` is Adam or AdamW without coupled weight decay (what
    :class:`FrozenVariance` can freeze exactly).

    >>> check_frozen_variance(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1))
    Traceback (most recent call last):
    ...
    ValueError: feedback='frozen' needs torch.optim.Adam or AdamW, got SGD: use feedback='momentum' for SGD with momentum, 'classic' for plain SGD, and 'update' for other adaptive optimizers
    """
    why = frozen_variance_unsupported(optimizer)
    if why:
        raise ValueError(f"feedback='frozen' needs torch.optim.Adam or AdamW, got {why}: use feedback='momentum' "
                         "for SGD with momentum, 'classic' for plain SGD, and 'update' for other adaptive optimizers")
