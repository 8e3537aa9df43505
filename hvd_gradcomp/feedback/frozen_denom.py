"""The frozen second moment of each tensor under :class:`hvd_gradcomp.feedback.frozen.FrozenVariance`:
``denom``, what each rank's update direction is divided by after the freeze (the same on every
rank), the refusal of loss-scaled gradients measured against it, and the division itself.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from .policy import _clone_tensors
from .frozen_warmup import SCALED_GRADIENT_RATIO


class FrozenDenominator:
    """``denom[name] = max(sqrt(v_hat), floor * mean(sqrt(v_hat))) + eps`` for each frozen tensor
    (``v_hat``: the second moment frozen, see :meth:`DenseWarmup.frozen_v`); the floor keeps
    coordinates that had (almost) no gradient in the warm-up from taking ``lr/eps``-sized steps later.

    >>> fd = FrozenDenominator(floor=0.5)
    >>> fd.freeze("w", torch.tensor([4.0, 0.0]), eps=0.0); fd.denom["w"].tolist()   # sqrt: [2, 0], mean 1
    [2.0, 0.5]
    >>> fd.step("w", torch.tensor([1.0, 1.0]), torch.empty(2), bound=1.5).tolist()
    [0.5, 1.5]
    """

    def __init__(self, floor: float = 0.1) -> None:
        if not 0.0 <= floor <= 1.0:
            raise ValueError(f"FrozenVariance floor must be in [0, 1] (share of the mean of sqrt(v)), got {floor!r}")
        self.floor = floor
        self.denom: Dict[str, torch.Tensor] = {}

    def __contains__(self, name: object) -> bool:
        return name in self.denom

    def freeze(self, name: str, v_hat: torch.Tensor, eps: float) -> None:
        root = v_hat.sqrt()
        self.denom[name] = root.clamp(min=self.floor * float(root.mean())).add_(eps)

    def refuse_scaled(self, name: str, grad: torch.Tensor, eps: float) -> None:
        """Refuse gradients far larger than the warm-up's (a loss scaler's scaled gradients): the
        update is applied before the scaler unscales, so it would be that many times too large.
        Called once per tensor, right after :meth:`freeze`, whose ``denom`` it drops before the error."""
        rms_g = float(grad.detach().float().pow(2).mean().sqrt())
        rms_v = float((self.denom[name] - eps).pow(2).mean().sqrt())
        if rms_v > 0 and rms_g > SCALED_GRADIENT_RATIO * rms_v:
            del self.denom[name]
            raise ValueError(
                f"feedback='frozen': the gradient of {name!r} is {rms_g / rms_v:.3g}x larger than during Adam's "
                "dense warm-up; is it scaled by a loss scaler (torch.amp.GradScaler)? This policy applies the "
                "update in synchronize(), before the scaler unscales. Use bf16 autocast without a scaler, or "
                "build the compressor with feedback='classic'.")

    def step(self, name: str, u: torch.Tensor, out: torch.Tensor, bound: Optional[float]) -> torch.Tensor:
        """``u / denom[name]`` into ``out``, each coordinate within ``bound`` (None: unbounded; see
        :meth:`AdamBinding.step_bound`)."""
        step = torch.div(u, self.denom[name], out=out)
        if bound is not None:
            step.clamp_(-bound, bound)
        return step

    def state_dict(self) -> Dict[str, Any]:
        return {"denom": _clone_tensors(self.denom), "floor": self.floor}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.denom = _clone_tensors(state.get("denom", {}))
        self.floor = float(state.get("floor", self.floor))
