"""Adam and AdamW with their second moment frozen after a dense warm-up: the
``feedback="frozen"`` policy (see :mod:`hvd_gradcomp.feedback` for the protocol every policy follows).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from . import kernels
from .policy import ErrorFeedback, _RoundUndo, check_sparsity_warmup
from .registry import frozen_variance_unsupported
from .frozen_adam import AdamBinding
from .frozen_denom import FrozenDenominator
from .frozen_momentum import FLAT_RATE_STEPS, WHILE_DENSE, MomentumChoice
from .frozen_scale import FOLLOW_SCALE, ScaleFollower
from .frozen_warmup import CLIP_DETECT_TOLERANCE, SCALED_GRADIENT_RATIO, DenseWarmup

__all__ = ["FrozenVariance", "check_frozen_variance", "FOLLOW_SCALE", "WHILE_DENSE", "FLAT_RATE_STEPS",
           "CLIP_DETECT_TOLERANCE", "SCALED_GRADIENT_RATIO"]


class FrozenVariance(_RoundUndo, ErrorFeedback):
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
      of a tensor (:func:`~hvd_gradcomp.feedback.frozen_momentum.dense_share`); ``None`` keeps it until a tensor's rate has stayed the
      same :data:`FLAT_RATE_STEPS` steps. Why ``False``: sending the momentum made the loss jump
      after the freeze on models with shared, frozen or intermittent layers.
    * ``sparsity_warmup``: DGC's falling share after the freeze (default 0: none, for the same reason).

    Why ``v`` is frozen rather than error feedback on gradients or "update", and the measurements
    behind every default: docs/FEEDBACK.md (``frozen``) and benchmarks/results/STUDY.md. Its parts, each with its own
    state: :class:`DenseWarmup`, :class:`FrozenDenominator`, :class:`MomentumChoice`, :class:`ScaleFollower`
    and the wrapped Adam, :class:`AdamBinding`.

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
        # The parts, each with its own state (checked in this order): this rank's gradient scale since
        # the freeze, Adam's momentum kept or not, the dense warm-up and what it saw, the wrapped Adam.
        self._scales = ScaleFollower(follow_scale)
        self._momentum = MomentumChoice(momentum)
        self._warmup = DenseWarmup(warmup, max_warmup, window)
        self.sparsity_warmup = check_sparsity_warmup(sparsity_warmup, "FrozenVariance")
        self._denoms = FrozenDenominator(floor)
        self._adam = AdamBinding()
        self.steps: Dict[str, int] = {}   # Adam's steps of each frozen tensor (a round store)
        self._undo = None  # see _RoundUndo

    # The parts' settings and round stores ("velocity", "scale": the dicts themselves, replaced entry by entry)
    warmup = property(lambda self: self._warmup.warmup)
    max_warmup = property(lambda self: self._warmup.max_warmup)
    window = property(lambda self: self._warmup.window)
    floor = property(lambda self: self._denoms.floor)
    denom = property(lambda self: self._denoms.denom)
    momentum = property(lambda self: self._momentum.momentum,
                        lambda self, value: setattr(self._momentum, "momentum", value))
    follow_scale = property(lambda self: self._scales.follow_scale,
                            lambda self, value: setattr(self._scales, "follow_scale", value))
    velocity = property(lambda self: self._momentum.velocity)
    scale = property(lambda self: self._scales.scale)

    def bind(self, name: str, group: Dict[str, Any], param: Optional[torch.Tensor] = None,
             optimizer: Any = None) -> None:
        if param is None or optimizer is None:
            return
        check_frozen_variance(optimizer)
        super().bind(name, group, param, optimizer)
        self._adam.bind(name, param, group, optimizer)

    def dense(self, name: str) -> bool:
        if name in self.denom or name not in self._adam:
            return False  # frozen, or not bound (yet): prepare() says what is missing
        return self._warmup.dense(name, self._adam.state(name), self._adam.group(name))

    def needs_optimizer_state(self, name: str) -> bool:
        """Adam's state of ``name`` is what is frozen: a tensor outside the bound optimizer cannot be."""
        return name not in self._adam

    def dense_local(self, name: str, grad: torch.Tensor) -> None:
        """A warm-up step's own gradient (a tensor not frozen yet goes dense: :meth:`dense`): its scale is
        followed from the first step (see :meth:`_follow_scale`)."""
        if name in self._adam and name not in self.denom:
            self._follow_scale(name, grad)

    def _follow_scale(self, name: str, grad: torch.Tensor) -> None:
        """This rank's gradient scale, followed from the tensor's first step on (:meth:`ScaleFollower.averaged`)."""
        scale = self._scales.averaged(name, grad, self.window, self._adam.group(name)["betas"][1])
        if scale is not None:
            self._replace("scale", name, scale)

    def dense_average(self, name: str, avg: torch.Tensor) -> None:
        """A warm-up step's average as exchanged, for the Adam step about to use it (:meth:`DenseWarmup.averaged`)."""
        if name not in self.denom:   # else frozen: the warm-up is over
            self._warmup.averaged(name, avg, lambda: self._adam.step(name) + 1)

    def _freeze(self, name: str, grad: torch.Tensor) -> None:
        group, t = self._adam.group(name), self._adam.step(name)
        self._denoms.freeze(name, self._warmup.frozen_v(name, self._adam.second_moment(name), group["betas"][1], t),
                            group["eps"])
        self._denoms.refuse_scaled(name, grad, group["eps"])   # a loss-scaled gradient: before the rest changes
        if self._keeps_momentum(name, t):
            self.velocity[name] = self._adam.first_moment(name).to(self.denom[name].dtype).reshape(-1).clone()
        self.steps[name] = t

    def _keeps_momentum(self, name: str, t: int) -> bool:
        """Whether ``name`` sends Adam's momentum at step ``t`` (:meth:`MomentumChoice.keeps`)."""
        share = self.share_sent
        return self._momentum.keeps(t, self._warmup.rate_since(name), None if share is None else lambda: share(name),
                                    self._adam.group(name)["betas"][0])

    def prepare(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        if self.needs_optimizer_state(name):   # the DDP hook sends such a tensor dense instead
            raise RuntimeError(f"feedback='frozen' needs the wrapped optimizer to know parameter {name!r}: "
                               "use it through hvd_gradcomp.DistributedOptimizer, hvd.DistributedOptimizer or "
                               "hvd_gradcomp.ddp.register(..., optimizer=opt)")
        self.residuals.check_shape(name, grad)
        if name not in self.denom:
            self._freeze(name, grad)
            self._adam.clear_first_moment(name)
        self._scales.mark_freeze(name)
        self._follow_scale(name, grad)
        t, group = self.steps[name], self._adam.group(name)
        self._warmup.note_rate(name, t, float(group["lr"]))
        u = self._momentum.direction(name, grad, self.denom[name].dtype, group["betas"][0],
                                     lambda: self._keeps_momentum(name, t), self)   # what is divided by denom
        # What goes out is the update direction u / denom, not u: top-k then picks the coordinates
        # that would move most, and the residual is kept in the units of movement.
        acc, res = self.residuals.buffer(name, u), self.residuals.residual(name, self._lr(name))
        factor = self._scales.factor(name)
        if factor is not None:
            u = u * factor.to(u.dtype)
        step = self._denoms.step(name, u, acc, self._adam.step_bound(name))
        return step if res is None else step.add_(res)

    def received(self, name: str, avg: torch.Tensor, support: Optional[torch.Tensor] = None) -> None:
        if not kernels.all_finite(avg):
            return  # passed on as it is: the loss scaler skips this step on every rank
        self._remember(name)
        t = self.steps[name] = self.steps[name] + 1
        self._adam.move(name, avg, t, momentum=name in self.velocity)
        avg.zero_()

    def received_terms(self, name: str) -> Optional[List[Tuple[torch.Tensor, torch.Tensor]]]:
        """``[]``: :meth:`received` zeroes a finite average and leaves a non-finite one as it was, so
        the exchange's check at the sent indices holds (see :meth:`Feedback.received_terms`) and
        ``synchronize()`` needs no full pass over a compressed tensor of AdamW."""
        return []

    def describe(self) -> str:
        # with AdamW over 1200 steps, freezing after 300 steps (a quarter of the run, 1-bit
        # Adam's advice) ended closest to uncompressed (benchmarks/results/STUDY_RUN_LENGTH.md); the run's length
        # is not known here, so the user is told once rather than the default guessed. The frozen v
        # follows the gradients where they shrink (see the class docstring)
        return (f"Adam's second moment frozen after {self.warmup} dense steps per tensor (more while the learning "
                f"rate still rises, at most {self._warmup.longest}), "
                + self._momentum.describe() + self._scales.describe()
                + f"; for a run much longer than {4 * self.warmup} steps, freeze "
                "later: feedback=FrozenVariance(warmup=a quarter of the run's steps) (benchmarks/results/STUDY_RUN_LENGTH.md)")

    def state_dict(self) -> Dict[str, Any]:
        # The warm-up's window (running average, Adam's last v) and the rates seen are saved too, so
        # a run resumed inside the warm-up freezes the same v at the same step as one that never
        # stopped (two gradient-sized tensors per tensor still in its warm-up; none after it).
        parts = {"steps": dict(self.steps), "sparsity_warmup": self.sparsity_warmup, **self._momentum.state_dict(),
                 **self._denoms.state_dict(), **self._warmup.state_dict(), **self._scales.state_dict()}
        return {**super().state_dict(), **{k: parts.pop(k) for k in _STATE_ORDER if k in parts}, **parts}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._momentum.load_state_dict(state)
        self._denoms.load_state_dict(state)
        self.steps = dict(state.get("steps", {}))
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
