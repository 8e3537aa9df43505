"""Adam and AdamW with their second moment frozen after a dense warm-up: the
``feedback="frozen"`` policy (see :mod:`hvd_gradcomp.feedback` for the protocol every policy follows).
"""
from __future__ import annotations

import math
import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch

from . import kernels
from .feedback import (ErrorFeedback, _clone_tensors, _RoundUndo, check_sparsity_warmup, frozen_variance_unsupported,
                       residual_dtype)


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
    moves_parameters = True
    _round_stores = ("velocity", "steps", "scale")  # velocity, steps: set at the freeze, before _remember

    def __init__(self, warmup: int = 100, floor: float = 0.1, sparsity_warmup: int = 0,
                 window: Optional[int] = 50, max_warmup: int = 1000, momentum: Optional[bool] = False,
                 follow_scale: Optional[str] = "down") -> None:
        super().__init__()
        if follow_scale not in FOLLOW_SCALE:
            raise ValueError(f"FrozenVariance follow_scale must be one of {list(FOLLOW_SCALE)} ('down': longer steps "
                             f"where the gradients shrank since the freeze; 'both': shorter ones too where they grew; "
                             f"None: v frozen for good), got {follow_scale!r}")
        self.follow_scale = follow_scale
        if momentum is not None and not isinstance(momentum, bool) and momentum != WHILE_DENSE:
            raise ValueError(f"FrozenVariance momentum must be None (Adam's first moment kept while the learning rate "
                             f"changes), {WHILE_DENSE!r} (kept while the sparsity warm-up sends more than 1 - b1 of "
                             f"a tensor), True (always kept) or False (never: error feedback's residual sums the "
                             f"gradients), got {momentum!r}")
        self.momentum = momentum
        self._flat: Dict[str, Tuple[float, int]] = {}   # each tensor's rate, and the step it was first seen at
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
            raise ValueError(f"FrozenVariance warmup must be an int >= 1 (dense Adam steps before v is frozen), "
                             f"got {warmup!r}")
        if isinstance(max_warmup, bool) or not isinstance(max_warmup, int) or max_warmup < 1:
            raise ValueError(f"FrozenVariance max_warmup must be an int >= 1 (the most dense steps while the learning "
                             f"rate still rises; never fewer than warmup), got {max_warmup!r}")
        self.max_warmup = max_warmup
        self._lr_seen: Dict[str, Tuple[int, float, bool]] = {}    # step, its rate, rose since the step before
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 2):
            raise ValueError(f"FrozenVariance window must be an int >= 2 (the warm-up's last steps that the frozen v "
                             f"averages) or None (Adam's own v), got {window!r}")
        self.window = window
        self._last_v: Dict[str, Tuple[int, torch.Tensor]] = {}     # Adam's v at the step last seen
        self._recent: Dict[str, Tuple[torch.Tensor, int]] = {}     # EMA of the squared average, samples
        self._delivered: Dict[str, Tuple[int, torch.Tensor]] = {}  # step, squared norm of the average exchanged
        self._rescaled: Dict[str, torch.Tensor] = {}               # least ratio seen: clipped / exchanged
        self._idle: Dict[str, torch.Tensor] = {}                   # dense steps with an all-zero average
        self._scale_checked: set = set()                            # tensors checked for a loss scale
        self.clipping_seen = False
        self.sparsity_warmup = check_sparsity_warmup(sparsity_warmup, "FrozenVariance")
        if not 0.0 <= floor <= 1.0:
            raise ValueError(f"FrozenVariance floor must be in [0, 1] (share of the mean of sqrt(v)), got {floor!r}")
        self.warmup, self.floor = warmup, floor
        self._bound: Dict[str, Tuple[torch.Tensor, Dict[str, Any], Any]] = {}
        self.velocity: Dict[str, torch.Tensor] = {}
        self.denom: Dict[str, torch.Tensor] = {}
        self.steps: Dict[str, int] = {}
        # This rank's b2-average of its gradient's mean square (0-dim tensors, on the gradient's
        # device: no host sync), and its value when v was frozen: see _follow_scale.
        self.scale: Dict[str, torch.Tensor] = {}
        self.scale_at_freeze: Dict[str, torch.Tensor] = {}
        self._undo = None  # see _RoundUndo

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
            self._track(name, state, group)
        t = int(state.get("step", 0))
        rising = self._lr_rising(name, t, float(group["lr"]))
        if t < self.warmup or "exp_avg_sq" not in state or (rising and t < self._longest_warmup):
            return True
        idle = self._idle.get(name)
        if idle is not None and t - int(idle) < self.warmup:
            return True   # fewer than warmup steps with a gradient (a layer unused at first): see dense_average
        return not bool(state["exp_avg_sq"].any())  # no gradient yet: nothing to freeze

    def needs_optimizer_state(self, name: str) -> bool:
        """Adam's state of ``name`` is what is frozen: a tensor outside the bound optimizer cannot be."""
        return name not in self._bound

    @property
    def _longest_warmup(self) -> int:
        return max(self.warmup, self.max_warmup)

    def _lr_rising(self, name: str, t: int, lr: float) -> bool:
        """Whether the rate of the coming step ``t`` (the optimizer's completed steps) is higher than
        step ``t - 1``'s. The same on every rank: the rate comes from the same scheduler there.
        Unknown (the first call after a resume) counts as rising: one more dense step to find out."""
        seen = self._lr_seen.get(name)
        if seen is not None and seen[0] == t:
            return seen[2]   # asked again in the same step
        rising = seen is None or seen[0] != t - 1 or lr > seen[1] * (1.0 + 1e-9)
        self._lr_seen[name] = (t, lr, rising)
        self._note_rate(name, t, lr)
        return rising

    def _note_rate(self, name: str, t: int, lr: float) -> None:
        """Remember since which step ``t`` (completed optimizer steps) ``name``'s rate is ``lr``."""
        seen = self._flat.get(name)
        if seen is None or seen[0] != lr:
            self._flat[name] = (lr, t)

    def _track(self, name: str, state: Dict[str, Any], group: Dict[str, Any]) -> None:
        """Once per optimizer step of the warm-up: the squared averaged gradient of Adam's last step,
        recovered from its second moment (``v_t = b2 * v_(t-1) + (1 - b2) * g_t**2``, so no extra
        communication), into an average over about ``window`` steps."""
        t = int(state["step"])
        last = self._last_v.get(name)
        if last is not None and last[0] == t:
            return   # this step was seen (dense() is asked more than once a step)
        v = state["exp_avg_sq"].detach().reshape(-1).to(torch.float32, copy=True)
        if last is not None and last[0] == t - 1:
            b2 = group["betas"][1]
            squared = torch.sub(v, last[1], alpha=b2).div_(1.0 - b2).clamp_(min=0.0)
            self._unscale(name, t, squared)
            recent, n = self._recent.get(name, (torch.zeros_like(squared), 0))
            self._recent[name] = (recent.lerp_(squared, 1.0 / self.window), n + 1)
        self._last_v[name] = (t, v)

    def dense_local(self, name: str, grad: torch.Tensor) -> None:
        """A warm-up step's own gradient (a tensor not frozen yet goes dense: :meth:`dense`): its scale is
        followed from the first step (see :meth:`_follow_scale`)."""
        if name in self._bound and name not in self.denom:
            self._follow_scale(name, grad)

    def _follow_scale(self, name: str, grad: torch.Tensor) -> None:
        """Average this rank's gradient mean square over about ``window`` steps (weight ``1 / window``,
        the span the frozen ``v`` averages; ``window=None``: Adam's ``1 - b2``), started at the first
        value, from the tensor's first step on, at any rate. A non-finite gradient (a step the loss
        scaler skips) leaves the average as it was. Nothing with ``follow_scale=None``: the average
        would never be read (:meth:`_scale_factor`), and it costs a pass over the gradient."""
        if self.follow_scale is None:
            return
        weight = 1.0 / self.window if self.window is not None else 1.0 - float(self._bound[name][1]["betas"][1])
        ms = _squared_norm(grad) / max(grad.numel(), 1)
        old = self.scale.get(name)
        if old is None:
            new = torch.where(torch.isfinite(ms), ms, torch.zeros_like(ms))
        else:
            new = torch.lerp(old, ms.to(old.device), weight)
            new = torch.where(torch.isfinite(new), new, old)
        self._replace("scale", name, new)

    def _scale_factor(self, name: str) -> Optional[torch.Tensor]:
        """``sqrt(s_freeze / s_t)`` where the gradients shrank since the freeze, else 1: how much longer
        this rank's step is than with ``v`` frozen for good (1 where either average is zero: a tensor
        without gradient); None while the scale has not moved since the freeze.

        >>> fv = FrozenVariance()
        >>> fv.scale_at_freeze["w"] = torch.tensor(4.0)
        >>> fv.scale["w"] = torch.tensor(1.0); float(fv._scale_factor("w"))     # gradients 2x smaller
        2.0
        >>> fv.scale["w"] = torch.tensor(9.0); float(fv._scale_factor("w"))     # larger: v stays frozen
        1.0
        """
        now, then = self.scale.get(name), self.scale_at_freeze.get(name)
        if self.follow_scale is None or now is None or then is None or now is then:
            return None
        ok = (now > 0) & (then > 0)
        ratio = torch.where(ok, then / torch.where(ok, now, torch.ones_like(now)), torch.ones_like(now))
        return (ratio.clamp(min=1.0) if self.follow_scale == "down" else ratio).sqrt()

    def dense_average(self, name: str, avg: torch.Tensor) -> None:
        """Keep the squared norm of a warm-up step's average as exchanged (see :meth:`_unscale`), and
        count the warm-up steps whose average was all zero (no rank had a gradient: a layer not used
        yet, sent as zeros), which :meth:`dense` does not count as warm-up.

        Why: Adam steps such a tensor (``exp_avg_sq`` stays zero, ``step`` grows), so a layer first
        used after ``warmup`` steps froze after its first gradient, its ``v`` a tenth of the
        gradient's square: each compressed step then moved it about ten times too far (its weights
        20x uncompressed training's within 10 steps). On the device, no host sync here."""
        if name in self._lr_seen and name not in self.denom:   # asked by dense(): a tensor to freeze
            zero = (avg == 0).all().to(torch.int64)
            idle = self._idle.get(name)
            self._idle[name] = zero if idle is None else idle + zero.to(idle.device)
        if name in self._last_v and name not in self.denom and self.window is not None:
            param, _, optimizer = self._bound[name]
            t = int(optimizer.state.get(param, {}).get("step", 0)) + 1   # the Adam step about to use it
            self._delivered[name] = (t, _squared_norm(avg))

    def _unscale(self, name: str, t: int, squared: torch.Tensor) -> None:
        """Undo, in the squared gradient of Adam's step ``t``, a scaling done by the user's code
        between the exchange and that step: ``clip_grad_norm_`` in Horovod's pattern
        (``synchronize()``, clip, ``step()``) or before ``step()`` under DDP.

        Why: after the freeze the update is made from the gradients as exchanged, where such code
        no longer reaches them (compressed tensors hand the optimizer zeros). A ``v`` frozen from
        clipped gradients then divides unclipped ones: every compressed step too long. The scale
        is the ratio of the squared sums, left alone within :data:`CLIP_DETECT_TOLERANCE` (float32
        recovery errors are orders of magnitude below it, so runs without clipping are unchanged,
        bit for bit)."""
        got = self._delivered.pop(name, None)
        if got is None or got[0] != t:
            return
        ratio = squared.sum() / got[1].to(squared.device)
        if name not in self._scale_checked:   # once per tensor: one read to the host
            self._scale_checked.add(name)
            self._refuse_loss_scale(name, float(ratio))
        scaled = (ratio - 1.0).abs() > CLIP_DETECT_TOLERANCE
        squared.div_(torch.where(scaled & (ratio > 0), ratio, torch.ones_like(ratio)))
        least = self._rescaled.get(name)
        self._rescaled[name] = ratio if least is None else torch.minimum(least, ratio)

    def _refuse_loss_scale(self, name: str, ratio: float) -> None:
        """Refuse, in the warm-up's first steps, gradients exchanged over :data:`SCALED_GRADIENT_RATIO`
        times larger than the optimizer then used, by a power of two (``ratio``: the squared sums'
        quotient): a loss scaler's ``unscale_``. Why here: after the warm-up this policy applies the
        update itself, before the scaler unscales; :meth:`_check_scale` refuses it then, but only after
        ``warmup`` steps (up to ``max_warmup`` under a rising rate) of a run that cannot go on. The
        averages and Adam's state are the same on every rank, so every rank raises at the same step."""
        # A loss scale is a power of two (GradScaler's growth and backoff factors are 2 and 0.5); a
        # clip_grad_norm_ of a huge gradient, also >1000x, is not, and is said at the freeze instead.
        power = math.log2(ratio) if ratio > 0.0 else 0.5
        if ratio * SCALED_GRADIENT_RATIO ** 2 < 1.0 and abs(power - round(power)) < 1e-2:
            raise ValueError(
                f"feedback='frozen': the gradients of {name!r} were exchanged {ratio ** -0.5:.3g}x larger than the "
                "optimizer used them: a loss scaler's unscale_ (torch.amp.GradScaler)? After its dense warm-up this "
                "policy applies the update itself, before the scaler unscales, so it cannot follow a loss scale. "
                "Use bf16 autocast without a scaler, or build the compressor with feedback='classic'.")

    def _frozen_v(self, name: str, v: torch.Tensor, b2: float, t: int) -> torch.Tensor:
        """The second moment to freeze: the average of the warm-up's last ~``window`` squared
        gradients when it saw enough of them (a fifth of the window), else Adam's own, bias-corrected.

        Why not Adam's own: with ``b2 = 0.999`` Adam's v at step 100 is close to a plain average of
        all 100 steps, dominated by the first ones, whose gradients are large and differently
        shaped. Adam itself forgets them over the next ~1000 steps; a frozen v never does. With
        AdamW over 1200 steps, freezing Adam's v at step 100 ended above the 1% target, the last
        50 steps' average within it (docs/STUDY_RUN_LENGTH.md)."""
        recent, n = self._recent.pop(name, (None, 0))
        self._last_v.pop(name, None)
        self._lr_seen.pop(name, None)
        self._delivered.pop(name, None)
        self._idle.pop(name, None)
        if recent is not None and self.window is not None and n >= max(2, self.window // 5):
            return (recent / (1.0 - (1.0 - 1.0 / self.window) ** n)).to(v.dtype)
        return v / (1.0 - b2 ** t)

    def _say_if_clipped(self, name: str) -> None:
        """At the freeze, once per policy: say that the warm-up saw the user's code scale the gradients
        (see :meth:`_unscale`), and what bounds them from now on."""
        least = self._rescaled.pop(name, None)
        if least is None or self.clipping_seen or not float(least) < 1.0 - CLIP_DETECT_TOLERANCE:
            return
        self.clipping_seen = True
        warnings.warn(
            f"feedback='frozen': during Adam's dense warm-up the gradients of {name!r} were scaled (down to "
            f"{float(least) ** 0.5:.3g}x) between the exchange and the optimizer step, as clip_grad_norm_ does. The "
            "second moment is frozen from the gradients as exchanged, and from now on such code does not reach "
            "the compressed tensors (their update is applied from the exchange; p.grad holds zeros): to bound "
            "the gradients, use the compressor's clip= (e.g. TopKQSGD(ratio=0.01, bits=8, clip=1.0)), which "
            "clips each rank's gradient before it is sent.", RuntimeWarning, stacklevel=3)

    def _freeze(self, name: str) -> None:
        self._say_if_clipped(name)
        param, group, optimizer = self._bound[name]
        state = optimizer.state[param]
        b1, b2 = group["betas"]
        t = int(state["step"])
        v = state["max_exp_avg_sq"] if group.get("amsgrad") else state["exp_avg_sq"]
        v = v.detach().to(residual_dtype(param.dtype)).reshape(-1)
        root = self._frozen_v(name, v, b2, t).sqrt()
        self.denom[name] = root.clamp(min=self.floor * float(root.mean())).add_(group["eps"])
        if self._keeps_momentum(name, t):
            self.velocity[name] = state["exp_avg"].detach().to(root.dtype).reshape(-1).clone()
        self.steps[name] = t

    def _keeps_momentum(self, name: str, t: int) -> bool:
        """Whether ``name`` sends Adam's momentum at step ``t`` (see :data:`FLAT_RATE_STEPS`)."""
        if self.momentum == WHILE_DENSE:
            return self._dense_share(name)
        if self.momentum is not None:
            return self.momentum
        since = self._flat.get(name)
        return since is None or t - since[1] < FLAT_RATE_STEPS

    def _dense_share(self, name: str) -> bool:
        """Whether the exchange being prepared sends more than ``1 - b1`` of ``name`` (``momentum="while
        dense"``). Why that line: above it a coordinate goes out more often than every ``1 / (1 - b1)``
        steps, the span Adam's momentum averages, so the residual no longer averages its gradient's
        noise as the momentum would: each rank's gradient over ``denom`` sent at a 25% share made the
        freeze check's model jump right after the freeze (docs/FREEZE_CHECK_01.md), as plain SGD does
        at a rate that heavy-ball momentum takes in its stride. Below it, the momentum sent through
        error feedback is late twice (the momentum's own delay, then the residual's) and swung the
        same model's loss; the gradient is not.

        >>> fv = FrozenVariance(momentum="while dense")
        >>> fv._bound["w"] = (None, {"betas": (0.9, 0.999)}, None)
        >>> fv.share_sent = lambda name: 0.25; fv._dense_share("w")
        True
        >>> fv.share_sent = lambda name: 0.01; fv._dense_share("w")
        False
        """
        if self.share_sent is None:
            return False   # a dense codec: no warm-up
        return self.share_sent(name) > 1.0 - float(self._bound[name][1]["betas"][0])

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
        if name not in self.scale_at_freeze and name in self.scale:
            # the scale at the freeze: the warm-up's (none when the road did not show the warm-up's
            # gradients: then the first compressed step's, taken at the next one)
            self.scale_at_freeze[name] = self.scale[name]
        self._follow_scale(name, grad)
        u = self._direction(name, grad)
        # What goes out is the update direction u / denom, not u: top-k then picks the coordinates
        # that would move most, and the residual is kept in the units of movement.
        acc, res = self.residuals.buffer(name, u), self.residuals.residual(name, self._lr(name))
        factor = self._scale_factor(name)
        if factor is not None:
            u = u * factor.to(u.dtype)
        return torch.div(u, self.denom[name], out=acc) if res is None else \
            torch.addcdiv(res, u, self.denom[name], out=acc)

    def _direction(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        """What is divided by ``denom`` and sent: the new first moment while the tensor keeps Adam's
        momentum, else the gradient (see the class docstring)."""
        denom = self.denom[name]
        t = self.steps[name]
        self._note_rate(name, t, float(self._bound[name][1]["lr"]))
        if name in self.velocity and not self._keeps_momentum(name, t):
            self._remember(name)          # an undone step puts the velocity back
            del self.velocity[name]       # for good: the rate has stayed the same
        if name not in self.velocity:
            return grad.reshape(-1).to(denom.dtype)
        b1 = self._bound[name][1]["betas"][0]
        old = self.velocity[name]
        # A new tensor, not old.mul_: the old velocity is what an undone step puts back.
        # b1*u + (1-b1)*g in one pass.
        u = torch.lerp(grad.reshape(-1).to(old.dtype), old, b1, out=self._buffer("velocity", name, old))
        self._replace("velocity", name, u)
        return u

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
                + {True: "each rank's momentum through error feedback (1-bit Adam style)",
                   False: "each rank's gradient through error feedback, whose residual takes the first moment's place",
                   None: "each rank's momentum through error feedback (1-bit Adam style) while the learning rate "
                         f"changes, its gradient once the rate has stayed the same {FLAT_RATE_STEPS} steps (error "
                         "feedback's residual then takes the first moment's place: docs/STUDY.md, transformer-const)",
                   WHILE_DENSE: "each rank's momentum through error feedback while the sparsity warm-up sends more than "
                                "1 - b1 of a tensor, its gradient after (whose residual takes the first moment's place)"
                   }[self.momentum]
                + {"down": ", the frozen v following the gradients' scale where it shrinks (docs/STUDY.md)",
                   "both": ", the frozen v following the gradients' scale", None: ", v frozen for good"
                   }[self.follow_scale]
                + f"; for a run much longer than {4 * self.warmup} steps, freeze "
                "later: feedback=FrozenVariance(warmup=a quarter of the run's steps) (docs/STUDY_RUN_LENGTH.md)")

    def state_dict(self) -> Dict[str, Any]:
        # The warm-up's window (running average, Adam's last v) and the rates seen are saved too, so
        # a run resumed inside the warm-up freezes the same v at the same step as one that never
        # stopped (two gradient-sized tensors per tensor still in its warm-up; none after it).
        return {**super().state_dict(), "velocity": _clone_tensors(self.velocity), "denom": _clone_tensors(self.denom),
                "steps": dict(self.steps), "warmup": self.warmup, "floor": self.floor,
                "sparsity_warmup": self.sparsity_warmup, "window": self.window,
                "max_warmup": self.max_warmup, "momentum": self.momentum, "flat": dict(self._flat),
                "follow_scale": self.follow_scale,
                "recent": {n: (r.clone(), k) for n, (r, k) in self._recent.items()},
                "last_v": {n: (t, v.clone()) for n, (t, v) in self._last_v.items()},
                "lr_seen": dict(self._lr_seen),
                "delivered": {n: (t, x.clone()) for n, (t, x) in self._delivered.items()},
                "rescaled": _clone_tensors(self._rescaled), "clipping_seen": self.clipping_seen,
                "scale": _clone_tensors(self.scale), "scale_at_freeze": _clone_tensors(self.scale_at_freeze),
                "idle": _clone_tensors(self._idle)}

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
        self.follow_scale = state.get("follow_scale", self.follow_scale)
        self._flat = {n: (float(lr), int(t)) for n, (lr, t) in state.get("flat", {}).items()}
        # Checkpoints from before the window was saved have none: the warm-up's window starts again.
        self._recent = {n: (r.clone(), int(k)) for n, (r, k) in state.get("recent", {}).items()}
        self._last_v = {n: (int(t), v.clone()) for n, (t, v) in state.get("last_v", {}).items()}
        self._lr_seen = {n: (int(t), float(lr), bool(up)) for n, (t, lr, up) in state.get("lr_seen", {}).items()}
        self._delivered = {n: (int(t), x.clone()) for n, (t, x) in state.get("delivered", {}).items()}
        self._rescaled = _clone_tensors(state.get("rescaled", {}))
        # Checkpoints from before idle steps were counted: those steps count as warm-up, as they did.
        self._idle = _clone_tensors(state.get("idle", {}))
        self.clipping_seen = bool(state.get("clipping_seen", False))
        # Checkpoints from before the scale was followed (or followed at a constant rate only, averaged
        # as Adam averages; their "scale_rate" is ignored): followed from the next step on.
        self.scale = _clone_tensors(state.get("scale", {}))
        # the same tensor when the scale has not moved since the freeze (see _scale_factor)
        self.scale_at_freeze = {n: self.scale[n] if n in self.scale and torch.equal(t, self.scale[n]) else t.detach().clone()
                                for n, t in state.get("scale_at_freeze", {}).items()}
        self.sparsity_warmup = int(state.get("sparsity_warmup", self.sparsity_warmup))
        if self._undo is not None:
            self._undo.clear()


FOLLOW_SCALE = ("down", "both", None)
"""The choices of :class:`FrozenVariance`'s ``follow_scale`` (see its docstring)."""
WHILE_DENSE = "while dense"
"""``FrozenVariance(momentum=WHILE_DENSE)``: Adam's momentum while the share sent is above ``1 - b1``."""

FLAT_RATE_STEPS = 50
"""Steps at one learning rate after which a tensor under :class:`FrozenVariance` (``momentum=None``)
sends its gradient rather than Adam's momentum (see the class docstring). Why 50: a schedule that
changes the rate every step (cosine, linear, exponential, OneCycleLR) never gets there, nor does the
end of a warm-up ramp pass for a constant rate; and it is shorter than the 100-step dense warm-up, so
at a rate constant from the start the momentum is dropped from the first compressed step on."""

CLIP_DETECT_TOLERANCE = 1e-2
"""A squared gradient sum recovered from Adam's ``v`` this far from the exchanged one's (relative)
counts as scaled by the user's code (see :meth:`FrozenVariance._unscale`); float32 recovery
errors stay well under it."""
SCALED_GRADIENT_RATIO = 1000.0
"""A first compressed gradient this many times the warm-up's RMS is taken for a loss-scaled one."""


def check_frozen_variance(optimizer: Any) -> None:
    """Raise unless ``optimizer`` is Adam or AdamW without coupled weight decay (what
    :class:`FrozenVariance` can freeze exactly).

    >>> check_frozen_variance(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1))
    Traceback (most recent call last):
    ...
    ValueError: feedback='frozen' needs torch.optim.Adam or AdamW, got SGD: use feedback='momentum' for SGD with momentum, 'classic' for plain SGD, and for other adaptive optimizers 'update' (the Horovod wrappers) or 'classic' (the DDP hook)
    """
    why = frozen_variance_unsupported(optimizer)
    if why:
        raise ValueError(f"feedback='frozen' needs torch.optim.Adam or AdamW, got {why}: use feedback='momentum' "
                         "for SGD with momentum, 'classic' for plain SGD, and for other adaptive optimizers 'update' "
                         "(the Horovod wrappers) or 'classic' (the DDP hook)")


def _squared_norm(t: torch.Tensor) -> torch.Tensor:
    """The squared L2 norm of ``t`` as a float32 0-dim tensor, summed in float32 or wider, whatever
    ``t``'s floating dtype. Why not ``vector_norm(t, dtype=torch.float32)``: it refuses to narrow a
    float64 tensor (a float64 layer goes uncompressed, but its dense steps still reach the policy).

    >>> _squared_norm(torch.tensor([3.0, 4.0], dtype=torch.float64)), _squared_norm(torch.tensor([3.0, 4.0]).half())
    (tensor(25.), tensor(25.))
    """
    t = t.detach()
    return torch.linalg.vector_norm(t, dtype=None if t.dtype == torch.float64 else torch.float32).float().square()
