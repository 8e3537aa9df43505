"""Whether a tensor under :class:`hvd_gradcomp.feedback.frozen.FrozenVariance` sends Adam's momentum or its
gradient after the freeze (its ``momentum`` setting), and the direction it then sends.
"""
from __future__ import annotations

import torch

WHILE_DENSE = "while dense"
"""``FrozenVariance(momentum=WHILE_DENSE)``: Adam's momentum while the share sent is above ``1 - b1``."""

FLAT_RATE_STEPS = 50
"""Steps at one learning rate after which a tensor under :class:`hvd_gradcomp.feedback.frozen.FrozenVariance` (``momentum=None``)
sends its gradient rather than Adam's momentum (see the class docstring). Why 50: a schedule that
changes the rate every step (cosine, linear, exponential, OneCycleLR) never gets there, nor does the
end of a warm-up ramp pass for a constant rate; and it is shorter than the 100-step dense warm-up, so
at a rate constant from the start the momentum is dropped from the first compressed step on."""


class MomentumChoice:
    """:class:`hvd_gradcomp.feedback.frozen.FrozenVariance`'s part that keeps or drops Adam's first moment per
    tensor. Mixed in before its round stores (``_RoundUndo``), whose ``velocity`` and ``steps`` it
    reads and replaces; uses the policy's ``momentum``, ``share_sent``, ``_bound``, ``denom`` and the
    rates its warm-up saw (``_warmup.flat``)."""

    def _direction(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        """What is divided by ``denom`` and sent: the new first moment while the tensor keeps Adam's
        momentum, else the gradient (see the class docstring)."""
        denom = self.denom[name]
        t = self.steps[name]
        self._warmup.note_rate(name, t, float(self._bound[name][1]["lr"]))
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

    def _keeps_momentum(self, name: str, t: int) -> bool:
        """Whether ``name`` sends Adam's momentum at step ``t`` (see :data:`FLAT_RATE_STEPS`)."""
        if self.momentum == WHILE_DENSE:
            return self._dense_share(name)
        if self.momentum is not None:
            return self.momentum
        since = self._warmup.flat.get(name)
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

        >>> from hvd_gradcomp.feedback.frozen import FrozenVariance
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
