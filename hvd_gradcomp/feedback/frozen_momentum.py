"""Whether a tensor under :class:`hvd_gradcomp.feedback.frozen.FrozenVariance` sends Adam's momentum or its
gradient after the freeze (its ``momentum`` setting), and this rank's momentum it then sends.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

import torch

from .policy import _clone_tensors

WHILE_DENSE = "while dense"
"""``FrozenVariance(momentum=WHILE_DENSE)``: Adam's momentum while the share sent is above ``1 - b1``."""

FLAT_RATE_STEPS = 50
"""Steps at one learning rate after which a tensor under :class:`hvd_gradcomp.feedback.frozen.FrozenVariance` (``momentum=None``)
sends its gradient rather than Adam's momentum (see the class docstring). Why 50: a schedule that
changes the rate every step (cosine, linear, exponential, OneCycleLR) never gets there, nor does the
end of a warm-up ramp pass for a constant rate; and it is shorter than the 100-step dense warm-up, so
at a rate constant from the start the momentum is dropped from the first compressed step on."""


class MomentumChoice:
    """:class:`hvd_gradcomp.feedback.frozen.FrozenVariance`'s part that keeps or drops Adam's first moment
    per tensor (``momentum``: ``False``, ``True``, :data:`WHILE_DENSE` or None, see the policy's
    docstring), and this rank's momentum of each tensor that keeps it (``velocity``). The policy
    replaces ``velocity[name]``, never changes it in place: it is one of its round stores, which an
    undone step puts back.

    >>> MomentumChoice(None).keeps(t=60, since=(0.1, 5), share_sent=None, b1=0.9)   # 55 steps at one rate
    False
    """

    def __init__(self, momentum: Optional[bool] = False) -> None:
        if momentum is not None and not isinstance(momentum, bool) and momentum != WHILE_DENSE:
            raise ValueError(f"FrozenVariance momentum must be None (Adam's first moment kept while the learning rate "
                             f"changes), {WHILE_DENSE!r} (kept while the sparsity warm-up sends more than 1 - b1 of "
                             f"a tensor), True (always kept) or False (never: error feedback's residual sums the "
                             f"gradients), got {momentum!r}")
        self.momentum = momentum
        self.velocity: Dict[str, torch.Tensor] = {}

    def keeps(self, t: int, since: Optional[Tuple[float, int]], share_sent: Optional[Callable[[], float]],
              b1: Any) -> bool:
        """Whether a tensor sends Adam's momentum at step ``t`` (see :data:`FLAT_RATE_STEPS`): ``since``, its
        rate and the step it was first seen at (None: unknown); ``share_sent``, the share of it the
        exchange being prepared sends (None: a dense codec); ``b1``, Adam's."""
        if self.momentum == WHILE_DENSE:
            return dense_share(share_sent, b1)
        if self.momentum is not None:
            return self.momentum
        return since is None or t - since[1] < FLAT_RATE_STEPS

    def direction(self, name: str, grad: torch.Tensor, dtype: torch.dtype, b1: Any, keeps: Callable[[], bool],
                  rounds: Any) -> torch.Tensor:
        """What is divided by ``denom`` and sent: the new first moment while ``name`` keeps Adam's momentum
        (``keeps()``: :meth:`keeps` of this step), else the gradient, in ``dtype``. ``rounds``: the policy,
        whose round log (``_remember``, ``_buffer``, ``_replace``) keeps what an undone step puts back."""
        if name in self.velocity and not keeps():
            rounds._remember(name)        # an undone step puts the velocity back
            del self.velocity[name]       # for good: the rate has stayed the same
        if name not in self.velocity:
            return grad.reshape(-1).to(dtype)
        old = self.velocity[name]
        # A new tensor, not old.mul_: the old velocity is what an undone step puts back. b1*u + (1-b1)*g in one pass.
        u = torch.lerp(grad.reshape(-1).to(old.dtype), old, b1, out=rounds._buffer("velocity", name, old))
        rounds._replace("velocity", name, u)
        return u

    def describe(self) -> str:
        """What is sent after the freeze, in words (see :meth:`FrozenVariance.describe`)."""
        return _MOMENTUM_SAID[self.momentum]

    def state_dict(self) -> Dict[str, Any]:
        return {"velocity": _clone_tensors(self.velocity), "momentum": self.momentum}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.velocity = _clone_tensors(state.get("velocity", {}))
        # Checkpoints from before the choice was saved: the policy's (tensors frozen then have a velocity)
        self.momentum = state.get("momentum", self.momentum)


def dense_share(share_sent: Optional[Callable[[], float]], b1: Any) -> bool:
    """Whether the exchange being prepared sends more than ``1 - b1`` of a tensor (``momentum="while
    dense"``; ``share_sent``: that share, None for a dense codec). Why that line: above it a coordinate
    goes out more often than every ``1 / (1 - b1)`` steps, the span Adam's momentum averages, so the
    residual no longer averages its gradient's noise as the momentum would: each rank's gradient over
    ``denom`` sent at a 25% share made the freeze check's model jump right after the freeze
    (benchmarks/results/FREEZE_CHECK_01.md), as plain SGD does at a rate that heavy-ball momentum takes in its
    stride. Below it, the momentum sent through error feedback is late twice (the momentum's own
    delay, then the residual's) and swung the same model's loss; the gradient is not.

    >>> dense_share(lambda: 0.25, 0.9), dense_share(lambda: 0.01, 0.9), dense_share(None, 0.9)
    (True, False, False)
    """
    if share_sent is None:
        return False   # a dense codec: no warm-up
    return share_sent() > 1.0 - float(b1)


_MOMENTUM_SAID = {
    True: "each rank's momentum through error feedback (1-bit Adam style)",
    False: "each rank's gradient through error feedback, whose residual takes the first moment's place",
    None: "each rank's momentum through error feedback (1-bit Adam style) while the learning rate "
          f"changes, its gradient once the rate has stayed the same {FLAT_RATE_STEPS} steps (error "
          "feedback's residual then takes the first moment's place: benchmarks/results/STUDY.md, transformer-const)",
    WHILE_DENSE: "each rank's momentum through error feedback while the sparsity warm-up sends more than "
                 "1 - b1 of a tensor, its gradient after (whose residual takes the first moment's place)"}
"""What :meth:`MomentumChoice.describe` says of each ``momentum`` choice."""
