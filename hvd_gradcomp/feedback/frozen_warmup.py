"""What :class:`hvd_gradcomp.feedback.frozen.FrozenVariance` watches during a tensor's dense warm-up: the
learning rates seen, the window of squared averaged gradients recovered from Adam's ``v``, the
steps without a gradient, and the user's code (or a loss scaler) scaling the gradients between
the exchange and the optimizer step (:class:`WarmupWindow`); and when the warm-up ends, and the
second moment it then freezes (:class:`DenseWarmup`).
"""
from __future__ import annotations

import math
import warnings
from typing import Any, Callable, Dict, Optional, Set, Tuple

import torch

from .policy import _clone_tensors
from .frozen_scale import _squared_norm

CLIP_DETECT_TOLERANCE = 1e-2
"""A squared gradient sum recovered from Adam's ``v`` this far from the exchanged one's (relative)
counts as scaled by the user's code (see :meth:`WarmupWindow.unscale`); float32 recovery
errors stay well under it."""
SCALED_GRADIENT_RATIO = 1000.0
"""A first compressed gradient this many times the warm-up's RMS is taken for a loss-scaled one."""


class WarmupWindow:
    """The warm-up's bookkeeping per tensor name, checkpointed with the policy (so a run resumed
    inside the warm-up freezes the same ``v`` at the same step as one that never stopped); the
    policy's settings (``window``) are passed in where they are used."""

    def __init__(self) -> None:
        self.flat: Dict[str, Tuple[float, int]] = {}             # each tensor's rate, and the step it was first seen at
        self.lr_seen: Dict[str, Tuple[int, float, bool]] = {}    # step, its rate, rose since the step before
        self.last_v: Dict[str, Tuple[int, torch.Tensor]] = {}    # Adam's v at the step last seen
        self.recent: Dict[str, Tuple[torch.Tensor, int]] = {}    # EMA of the squared average, samples
        self.delivered: Dict[str, Tuple[int, torch.Tensor]] = {}  # step, squared norm of the average exchanged
        self.rescaled: Dict[str, torch.Tensor] = {}              # least ratio seen: clipped / exchanged
        self.idle: Dict[str, torch.Tensor] = {}                  # dense steps with an all-zero average
        self.scale_checked: Set[str] = set()                     # tensors checked for a loss scale
        self.clipping_seen = False

    def lr_rising(self, name: str, t: int, lr: float) -> bool:
        """Whether the rate of the coming step ``t`` (the optimizer's completed steps) is higher than
        step ``t - 1``'s. The same on every rank: the rate comes from the same scheduler there.
        Unknown (the first call after a resume) counts as rising: one more dense step to find out."""
        seen = self.lr_seen.get(name)
        if seen is not None and seen[0] == t:
            return seen[2]   # asked again in the same step
        rising = seen is None or seen[0] != t - 1 or lr > seen[1] * (1.0 + 1e-9)
        self.lr_seen[name] = (t, lr, rising)
        self.note_rate(name, t, lr)
        return rising

    def note_rate(self, name: str, t: int, lr: float) -> None:
        """Remember since which step ``t`` (completed optimizer steps) ``name``'s rate is ``lr``."""
        seen = self.flat.get(name)
        if seen is None or seen[0] != lr:
            self.flat[name] = (lr, t)

    def track(self, name: str, state: Dict[str, Any], group: Dict[str, Any], window: int) -> None:
        """Once per optimizer step of the warm-up: the squared averaged gradient of Adam's last step,
        recovered from its second moment (``v_t = b2 * v_(t-1) + (1 - b2) * g_t**2``, so no extra
        communication), into an average over about ``window`` steps."""
        t = int(state["step"])
        last = self.last_v.get(name)
        if last is not None and last[0] == t:
            return   # this step was seen (dense() is asked more than once a step)
        v = state["exp_avg_sq"].detach().reshape(-1).to(torch.float32, copy=True)
        if last is not None and last[0] == t - 1:
            b2 = group["betas"][1]
            squared = torch.sub(v, last[1], alpha=b2).div_(1.0 - b2).clamp_(min=0.0)
            self.unscale(name, t, squared)
            recent, n = self.recent.get(name, (torch.zeros_like(squared), 0))
            self.recent[name] = (recent.lerp_(squared, 1.0 / window), n + 1)
        self.last_v[name] = (t, v)

    def count_idle(self, name: str, avg: torch.Tensor) -> None:
        """Count the warm-up steps whose average was all zero (no rank had a gradient: a layer not
        used yet, sent as zeros), which the policy's ``dense`` does not count as warm-up.

        Why: Adam steps such a tensor (``exp_avg_sq`` stays zero, ``step`` grows), so a layer first
        used after ``warmup`` steps froze after its first gradient, its ``v`` a tenth of the
        gradient's square: each compressed step then moved it about ten times too far (its weights
        20x uncompressed training's within 10 steps). On the device, no host sync here."""
        if name in self.lr_seen:   # asked by dense(): a tensor to freeze
            zero = (avg == 0).all().to(torch.int64)
            idle = self.idle.get(name)
            self.idle[name] = zero if idle is None else idle + zero.to(idle.device)

    def deliver(self, name: str, t: int, avg: torch.Tensor) -> None:
        """Keep the squared norm of ``name``'s average as exchanged for Adam's step ``t``, before the
        user's code sees it (see :meth:`unscale`). On the device, no host sync here."""
        self.delivered[name] = (t, _squared_norm(avg))

    def unscale(self, name: str, t: int, squared: torch.Tensor) -> None:
        """Undo, in the squared gradient of Adam's step ``t``, a scaling done by the user's code
        between the exchange and that step: ``clip_grad_norm_`` in Horovod's pattern
        (``synchronize()``, clip, ``step()``) or before ``step()`` under DDP.

        Why: after the freeze the update is made from the gradients as exchanged, where such code
        no longer reaches them (compressed tensors hand the optimizer zeros). A ``v`` frozen from
        clipped gradients then divides unclipped ones: every compressed step too long. The scale
        is the ratio of the squared sums, left alone within :data:`CLIP_DETECT_TOLERANCE` (float32
        recovery errors are orders of magnitude below it, so runs without clipping are unchanged,
        bit for bit)."""
        got = self.delivered.pop(name, None)
        if got is None or got[0] != t:
            return
        ratio = squared.sum() / got[1].to(squared.device)
        if name not in self.scale_checked:   # once per tensor: one read to the host
            self.scale_checked.add(name)
            self.refuse_loss_scale(name, float(ratio))
        scaled = (ratio - 1.0).abs() > CLIP_DETECT_TOLERANCE
        squared.div_(torch.where(scaled & (ratio > 0), ratio, torch.ones_like(ratio)))
        least = self.rescaled.get(name)
        self.rescaled[name] = ratio if least is None else torch.minimum(least, ratio)

    @staticmethod
    def refuse_loss_scale(name: str, ratio: float) -> None:
        """Refuse, in the warm-up's first steps, gradients exchanged over :data:`SCALED_GRADIENT_RATIO`
        times larger than the optimizer then used, by a power of two (``ratio``: the squared sums'
        quotient): a loss scaler's ``unscale_``. Why here: after the warm-up the policy applies the
        update itself, before the scaler unscales; its ``_check_scale`` refuses it then, but only after
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

    def frozen_v(self, name: str, v: torch.Tensor, b2: float, t: int, window: Optional[int]) -> torch.Tensor:
        """The second moment to freeze: the average of the warm-up's last ~``window`` squared
        gradients when it saw enough of them (a fifth of the window), else Adam's own, bias-corrected.
        The tensor's warm-up bookkeeping ends here.

        Why not Adam's own: with ``b2 = 0.999`` Adam's v at step 100 is close to a plain average of
        all 100 steps, dominated by the first ones, whose gradients are large and differently
        shaped. Adam itself forgets them over the next ~1000 steps; a frozen v never does. With
        AdamW over 1200 steps, freezing Adam's v at step 100 ended above the 1% target, the last
        50 steps' average within it (benchmarks/results/STUDY_RUN_LENGTH.md)."""
        recent, n = self.recent.pop(name, (None, 0))
        self.last_v.pop(name, None)
        self.lr_seen.pop(name, None)
        self.delivered.pop(name, None)
        self.idle.pop(name, None)
        if recent is not None and window is not None and n >= max(2, window // 5):
            return (recent / (1.0 - (1.0 - 1.0 / window) ** n)).to(v.dtype)
        return v / (1.0 - b2 ** t)

    def say_if_clipped(self, name: str) -> None:
        """At the freeze, once per policy: say that the warm-up saw the user's code scale the gradients
        (see :meth:`unscale`), and what bounds them from now on."""
        least = self.rescaled.pop(name, None)
        if least is None or self.clipping_seen or not float(least) < 1.0 - CLIP_DETECT_TOLERANCE:
            return
        self.clipping_seen = True
        # stacklevel 4: the policy's prepare(), which calls _freeze(), which calls DenseWarmup.frozen_v, which calls this
        warnings.warn(
            f"feedback='frozen': during Adam's dense warm-up the gradients of {name!r} were scaled (down to "
            f"{float(least) ** 0.5:.3g}x) between the exchange and the optimizer step, as clip_grad_norm_ does. The "
            "second moment is frozen from the gradients as exchanged, and from now on such code does not reach "
            "the compressed tensors (their update is applied from the exchange; p.grad holds zeros): to bound "
            "the gradients, use the compressor's clip= (e.g. TopKQSGD(ratio=0.01, bits=8, clip=1.0)), which "
            "clips each rank's gradient before it is sent.", RuntimeWarning, stacklevel=4)

    def state_dict(self) -> Dict[str, Any]:
        # The window (running average, Adam's last v) and the rates seen: two gradient-sized tensors
        # per tensor still in its warm-up; none after it.
        return {"flat": dict(self.flat), "recent": {n: (r.clone(), k) for n, (r, k) in self.recent.items()},
                "last_v": {n: (t, v.clone()) for n, (t, v) in self.last_v.items()},
                "lr_seen": dict(self.lr_seen),
                "delivered": {n: (t, x.clone()) for n, (t, x) in self.delivered.items()},
                "rescaled": _clone_tensors(self.rescaled), "clipping_seen": self.clipping_seen,
                "idle": _clone_tensors(self.idle)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.flat = {n: (float(lr), int(t)) for n, (lr, t) in state.get("flat", {}).items()}
        # Checkpoints from before the window was saved have none: the warm-up's window starts again.
        self.recent = {n: (r.clone(), int(k)) for n, (r, k) in state.get("recent", {}).items()}
        self.last_v = {n: (int(t), v.clone()) for n, (t, v) in state.get("last_v", {}).items()}
        self.lr_seen = {n: (int(t), float(lr), bool(up)) for n, (t, lr, up) in state.get("lr_seen", {}).items()}
        self.delivered = {n: (int(t), x.clone()) for n, (t, x) in state.get("delivered", {}).items()}
        self.rescaled = _clone_tensors(state.get("rescaled", {}))
        # Checkpoints from before idle steps were counted: those steps count as warm-up, as they did.
        self.idle = _clone_tensors(state.get("idle", {}))
        self.clipping_seen = bool(state.get("clipping_seen", False))


class DenseWarmup:
    """When a tensor under :class:`hvd_gradcomp.feedback.frozen.FrozenVariance` leaves its dense warm-up
    (``warmup``, ``max_warmup``: see the policy's docstring) and the second moment it then freezes
    (``window``), from what its :class:`WarmupWindow` (``seen``) saw.

    >>> w = torch.nn.Parameter(torch.ones(4)); opt = torch.optim.AdamW([w], lr=0.1)
    >>> warm = DenseWarmup(warmup=1)
    >>> warm.dense("w", opt.state[w], opt.param_groups[0])      # no Adam step yet
    True
    >>> w.grad = torch.full((4,), 0.5); opt.step()
    >>> warm.dense("w", opt.state[w], opt.param_groups[0])
    False
    """

    def __init__(self, warmup: int = 100, max_warmup: int = 1000, window: Optional[int] = 50) -> None:
        _check_settings(warmup, max_warmup, window)
        self.warmup, self.max_warmup, self.window = warmup, max_warmup, window
        self.seen = WarmupWindow()

    @property
    def longest(self) -> int:
        """The most dense steps of a tensor while the learning rate still rises."""
        return max(self.warmup, self.max_warmup)

    def dense(self, name: str, state: Dict[str, Any], group: Dict[str, Any]) -> bool:
        """Whether ``name``, not frozen yet, goes dense this step (``state``, ``group``: its Adam's); asked
        once a step or more, the same answer on every rank (replicated state only)."""
        if self.window is not None and "exp_avg_sq" in state and not group.get("amsgrad") \
                and state["exp_avg_sq"].dtype in (torch.float32, torch.float64):
            # Not from a float16/bfloat16 v (a half-precision model's Adam state): each step's squared
            # gradient, recovered as v_t - b2 * v_(t-1), is lost to rounding there (a spurious "scaled
            # by the user's code" warning showed it); Adam's own v is frozen instead (see frozen_v).
            self.seen.track(name, state, group, self.window)
        t = int(state.get("step", 0))
        rising = self.seen.lr_rising(name, t, float(group["lr"]))
        if t < self.warmup or "exp_avg_sq" not in state or (rising and t < self.longest):
            return True
        idle = self.seen.idle.get(name)
        if idle is not None and t - int(idle) < self.warmup:
            return True   # fewer than warmup steps with a gradient (a layer unused at first): see averaged
        return not bool(state["exp_avg_sq"].any())  # no gradient yet: nothing to freeze

    def averaged(self, name: str, avg: torch.Tensor, next_step: Callable[[], int]) -> None:
        """A warm-up step's average as exchanged: its squared norm kept for Adam's coming step
        (``next_step()``; see :meth:`WarmupWindow.unscale`), and an all-zero one counted
        (:meth:`WarmupWindow.count_idle`). On the device, no host sync here."""
        self.seen.count_idle(name, avg)
        if name in self.seen.last_v and self.window is not None:
            self.seen.deliver(name, next_step(), avg)

    def frozen_v(self, name: str, v: torch.Tensor, b2: float, t: int) -> torch.Tensor:
        """The second moment to freeze at Adam's step ``t`` (``v``: Adam's own; :meth:`WarmupWindow.frozen_v`),
        once the user has been told of the gradients scaled during the warm-up (:meth:`WarmupWindow.say_if_clipped`)."""
        self.seen.say_if_clipped(name)
        return self.seen.frozen_v(name, v, b2, t, self.window)

    def note_rate(self, name: str, t: int, lr: float) -> None:
        self.seen.note_rate(name, t, lr)

    def rate_since(self, name: str) -> Optional[Tuple[float, int]]:
        """``name``'s learning rate and the step it was first seen at (None: not seen)."""
        return self.seen.flat.get(name)

    def state_dict(self) -> Dict[str, Any]:
        return {"warmup": self.warmup, "window": self.window, "max_warmup": self.max_warmup, **self.seen.state_dict()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.warmup = int(state.get("warmup", self.warmup))
        self.window = state.get("window", self.window)
        self.max_warmup = int(state.get("max_warmup", self.max_warmup))
        self.seen.load_state_dict(state)


def _check_settings(warmup: Any, max_warmup: Any, window: Any) -> None:
    """:class:`DenseWarmup`'s checks of its arguments (``FrozenVariance``'s words), in its constructor's order."""
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
        raise ValueError(f"FrozenVariance warmup must be an int >= 1 (dense Adam steps before v is frozen), "
                         f"got {warmup!r}")
    if isinstance(max_warmup, bool) or not isinstance(max_warmup, int) or max_warmup < 1:
        raise ValueError(f"FrozenVariance max_warmup must be an int >= 1 (the most dense steps while the learning "
                         f"rate still rises; never fewer than warmup), got {max_warmup!r}")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 2):
        raise ValueError(f"FrozenVariance window must be an int >= 2 (the warm-up's last steps that the frozen v "
                         f"averages) or None (Adam's own v), got {window!r}")
