"""The gradient scale :class:`hvd_gradcomp.feedback.frozen.FrozenVariance` follows after its freeze
(``follow_scale``): each rank's average of its gradient's mean square, its value at the freeze,
and the factor by which a rank's step is made longer where the gradients shrank since.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from .policy import _clone_tensors

FOLLOW_SCALE = ("down", "both", None)
"""The choices of :class:`FrozenVariance`'s ``follow_scale`` (see its docstring)."""


class ScaleFollower:
    """This rank's b2-average of each tensor's gradient mean square (``scale``: 0-dim tensors, on the
    gradient's device: no host sync) and its value when ``v`` was frozen (``scale_at_freeze``); the
    policy replaces ``scale[name]`` with :meth:`averaged`'s value, so an undone step puts it back.

    ``follow_scale``: ``"down"``, ``"both"`` or None (see :class:`hvd_gradcomp.feedback.frozen.FrozenVariance`).
    """

    def __init__(self, follow_scale: Optional[str] = "down") -> None:
        if follow_scale not in FOLLOW_SCALE:
            raise ValueError(f"FrozenVariance follow_scale must be one of {list(FOLLOW_SCALE)} ('down': longer steps "
                             f"where the gradients shrank since the freeze; 'both': shorter ones too where they grew; "
                             f"None: v frozen for good), got {follow_scale!r}")
        self.follow_scale = follow_scale
        self.scale: Dict[str, torch.Tensor] = {}
        self.scale_at_freeze: Dict[str, torch.Tensor] = {}

    def averaged(self, name: str, grad: torch.Tensor, window: Optional[int], b2: Any) -> Optional[torch.Tensor]:
        """The next value of ``scale[name]``: ``grad``'s mean square averaged over about ``window`` steps
        (weight ``1 / window``, the span the frozen ``v`` averages; ``window=None``: Adam's ``1 - b2``),
        started at the first value, at any rate. A non-finite gradient (a step the loss scaler skips)
        leaves the average as it was. None with ``follow_scale=None``: the average would never be
        read (:meth:`factor`), and it costs a pass over the gradient."""
        if self.follow_scale is None:
            return None
        weight = 1.0 / window if window is not None else 1.0 - float(b2)
        ms = _squared_norm(grad) / max(grad.numel(), 1)
        old = self.scale.get(name)
        if old is None:
            new = torch.where(torch.isfinite(ms), ms, torch.zeros_like(ms))
        else:
            new = torch.lerp(old, ms.to(old.device), weight)
            new = torch.where(torch.isfinite(new), new, old)
        return new

    def mark_freeze(self, name: str) -> None:
        """Keep the scale at the freeze: the warm-up's (none when the wrapper did not show the warm-up's
        gradients: then the first compressed step's, taken at the next one)."""
        if name not in self.scale_at_freeze and name in self.scale:
            self.scale_at_freeze[name] = self.scale[name]

    def factor(self, name: str) -> Optional[torch.Tensor]:
        """``sqrt(s_freeze / s_t)`` where the gradients shrank since the freeze, else 1: how much longer
        this rank's step is than with ``v`` frozen for good (1 where either average is zero: a tensor
        without gradient); None while the scale has not moved since the freeze.

        >>> sf = ScaleFollower("down")
        >>> sf.scale_at_freeze["w"] = torch.tensor(4.0)
        >>> sf.scale["w"] = torch.tensor(1.0); float(sf.factor("w"))     # gradients 2x smaller
        2.0
        >>> sf.scale["w"] = torch.tensor(9.0); float(sf.factor("w"))     # larger: v stays frozen
        1.0
        """
        now, then = self.scale.get(name), self.scale_at_freeze.get(name)
        if self.follow_scale is None or now is None or then is None or now is then:
            return None
        ok = (now > 0) & (then > 0)
        ratio = torch.where(ok, then / torch.where(ok, now, torch.ones_like(now)), torch.ones_like(now))
        return (ratio.clamp(min=1.0) if self.follow_scale == "down" else ratio).sqrt()

    def describe(self) -> str:
        """What ``follow_scale`` does, in words (see :meth:`FrozenVariance.describe`)."""
        return _FOLLOW_SCALE_SAID[self.follow_scale]

    def state_dict(self) -> Dict[str, Any]:
        return {"follow_scale": self.follow_scale, "scale": _clone_tensors(self.scale),
                "scale_at_freeze": _clone_tensors(self.scale_at_freeze)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.follow_scale = state.get("follow_scale", self.follow_scale)
        # Checkpoints from before the scale was followed (or followed at a constant rate only, averaged
        # as Adam averages; their "scale_rate" is ignored): followed from the next step on.
        self.scale = _clone_tensors(state.get("scale", {}))
        # the same tensor when the scale has not moved since the freeze (see factor)
        self.scale_at_freeze = {n: self.scale[n] if n in self.scale and torch.equal(t, self.scale[n]) else t.detach().clone()
                                for n, t in state.get("scale_at_freeze", {}).items()}


_FOLLOW_SCALE_SAID = {"down": ", the frozen v following the gradients' scale where it shrinks (benchmarks/results/STUDY.md)",
                      "both": ", the frozen v following the gradients' scale", None: ", v frozen for good"}
"""What :meth:`ScaleFollower.describe` says of each ``follow_scale`` choice."""


def _squared_norm(t: torch.Tensor) -> torch.Tensor:
    """The squared L2 norm of ``t`` as a float32 0-dim tensor, summed in float32 or wider, whatever
    ``t``'s floating dtype. Why not ``vector_norm(t, dtype=torch.float32)``: it refuses to narrow a
    float64 tensor (a float64 layer goes uncompressed, but its dense steps still reach the policy).

    >>> _squared_norm(torch.tensor([3.0, 4.0], dtype=torch.float64)), _squared_norm(torch.tensor([3.0, 4.0]).half())
    (tensor(25.), tensor(25.))
    """
    t = t.detach()
    return torch.linalg.vector_norm(t, dtype=None if t.dtype == torch.float64 else torch.float32).float().square()
