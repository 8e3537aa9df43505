"""Error feedback: what a step did not send is kept per tensor and added to the next step.

Invariant, checked by the tests: ``sent + new_residual == input + old_residual`` (up to float
rounding). Residuals are keyed by a stable name (the parameter name), never by tensor
identity, so they survive re-created gradient tensors and checkpoints.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch

HALF_DTYPES = (torch.float16, torch.bfloat16)


def residual_dtype(dtype: torch.dtype) -> torch.dtype:
    """Residuals of 16-bit gradients are kept in float32: small leftovers would round away in
    bfloat16 (8 mantissa bits) and error feedback would silently stop working."""
    return torch.float32 if dtype in HALF_DTYPES else dtype


class ResidualStore:
    """Per-name residuals, plus the shape each name was first used with.

    >>> store = ResidualStore()
    >>> acc = store.compensate("w", torch.ones(3))        # first step: nothing to add
    >>> store.commit("w", acc - torch.tensor([1.0, 0.0, 0.0]))
    >>> store.residual("w").tolist()
    [0.0, 1.0, 1.0]
    """

    def __init__(self) -> None:
        self._residuals: Dict[str, torch.Tensor] = {}
        self._shapes: Dict[str, Tuple[Tuple[int, ...], torch.dtype]] = {}

    def check_shape(self, name: str, tensor: torch.Tensor) -> None:
        """Raise if ``name`` was used before with another shape: residuals would mix."""
        seen = self._shapes.setdefault(name, (tuple(tensor.shape), tensor.dtype))
        if seen[0] != tuple(tensor.shape):
            raise ValueError(f"tensor name {name!r} was used with shape {seen[0]} and now with "
                             f"{tuple(tensor.shape)}: give every tensor its own name (e.g. the "
                             "parameter names from model.named_parameters())")

    def residual(self, name: str) -> Optional[torch.Tensor]:
        return self._residuals.get(name)

    def compensate(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        """grad + residual, as a new flat tensor of the residual dtype (grad is not modified)."""
        self.check_shape(name, grad)
        res = self._residuals.get(name)
        flat = grad.reshape(-1)
        if res is None:
            return flat.to(residual_dtype(grad.dtype), copy=True)
        # One pass writing a fresh tensor, instead of a copy and then an in-place add.
        return torch.add(flat, res.to(flat.device), out=torch.empty_like(flat, dtype=residual_dtype(grad.dtype)))

    def commit(self, name: str, new_residual: torch.Tensor) -> None:
        self._residuals[name] = new_residual

    def pop(self, name: str) -> Optional[torch.Tensor]:
        """Remove and return the residual of ``name`` (None if there is none): for a caller that
        sends it another way (e.g. :class:`hvd_gradcomp.Auto` switching a tensor's road)."""
        return self._residuals.pop(name, None)

    def clear(self) -> None:
        self._residuals.clear()
        self._shapes.clear()

    def state_dict(self) -> Dict[str, Any]:
        """Residuals and the shape each name was used with (so the shape check survives a restart)."""
        return {"residuals": {name: r.detach().clone() for name, r in self._residuals.items()},
                "shapes": {name: (list(shape), str(dtype).replace("torch.", ""))
                           for name, (shape, dtype) in self._shapes.items()}}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self._residuals = {name: r.detach().clone() for name, r in state["residuals"].items()}
        self._shapes = {name: (tuple(shape), getattr(torch, dtype))
                        for name, (shape, dtype) in state["shapes"].items()}
