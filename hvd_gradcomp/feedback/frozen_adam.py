"""The wrapped Adam of each tensor under :class:`hvd_gradcomp.feedback.frozen.FrozenVariance`: what the
policy reads of it (its param group, its state, its moments), the most one gradient may move a
coordinate, and the update the policy applies to the parameter in Adam's place after the freeze.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch

from .residuals import residual_dtype


class AdamBinding:
    """Each tensor name's parameter, param group (read live: schedulers change it) and wrapped
    Adam or AdamW, as the compressor bound them (:meth:`bind`).

    >>> w = torch.nn.Parameter(torch.ones(2))
    >>> opt = torch.optim.AdamW([w], lr=0.1)
    >>> adam = AdamBinding(); adam.bind("w", w, opt.param_groups[0], opt)
    >>> "w" in adam, adam.step("w")
    (True, 0)
    """

    def __init__(self) -> None:
        self._bound: Dict[str, Tuple[torch.Tensor, Dict[str, Any], Any]] = {}

    def bind(self, name: str, param: torch.Tensor, group: Dict[str, Any], optimizer: Any) -> None:
        self._bound[name] = (param, group, optimizer)

    def __contains__(self, name: object) -> bool:
        return name in self._bound

    def group(self, name: str) -> Dict[str, Any]:
        return self._bound[name][1]

    def state(self, name: str) -> Dict[str, Any]:
        """Adam's state of ``name`` (empty before its first step)."""
        param, _, optimizer = self._bound[name]
        return optimizer.state.get(param, {})

    def step(self, name: str) -> int:
        """Adam's completed steps of ``name``."""
        return int(self.state(name).get("step", 0))

    def second_moment(self, name: str) -> torch.Tensor:
        """Adam's ``v`` of ``name`` (AMSGrad's running maximum where it keeps one), flat, in the dtype of
        the tensor's residual."""
        param, group, _ = self._bound[name]
        state = self.state(name)
        v = state["max_exp_avg_sq"] if group.get("amsgrad") else state["exp_avg_sq"]
        return v.detach().to(residual_dtype(param.dtype)).reshape(-1)

    def first_moment(self, name: str) -> torch.Tensor:
        """Adam's ``exp_avg`` of ``name``, as it holds it (detached)."""
        return self.state(name)["exp_avg"].detach()

    def clear_first_moment(self, name: str) -> None:
        """From the freeze on, the wrapped optimizer moves nothing but weight decay."""
        self.state(name)["exp_avg"].zero_()

    def step_bound(self, name: str) -> Optional[float]:
        """The most one gradient may add to a coordinate's movement (in units of ``lr``):
        ``1 / sqrt(1 - b2)``, the most Adam moves a coordinate in answer to one gradient, however
        large (its ``v`` takes at least ``(1 - b2) * g**2`` of it, so ``|g| / sqrt(v) <= 1 / sqrt(1 - b2)``);
        None for ``b2 == 1``.

        Why: with ``v`` frozen, a coordinate whose gradient was (almost) zero during the warm-up
        (an embedding row of a rare token, a tied head's row) has the floor for ``denom``; its first
        large gradient afterwards moved it ``|g| / denom`` times the rate (311,810x in
        tests/test_frozen_bound.py), and the tied-embedding recipe at lr 8e-3 diverged ~80 steps
        after the freeze (benchmarks/results/RECIPES.md, "Before the fixes"). Adam's own bound leaves every
        ordinary step alone.

        >>> adam = AdamBinding(); adam.bind("w", None, {"betas": (0.9, 0.99)}, None)
        >>> round(adam.step_bound("w"), 6)
        10.0
        """
        b2 = float(self.group(name)["betas"][1])
        return None if b2 >= 1.0 else (1.0 - b2) ** -0.5

    def move(self, name: str, avg: torch.Tensor, t: int, momentum: bool) -> None:
        """Move the parameter by ``-lr * avg``, divided by ``1 - b1**t`` (Adam's bias correction of the
        first moment) when ``avg`` averages momenta (``momentum``), and pre-divided by the decay the
        wrapped optimizer applies after it (decoupled weight decay, ``p *= 1 - lr*wd``), so that the
        result is ``p*(1 - lr*wd) + step``, as in AdamW."""
        param, group, _ = self._bound[name]
        lr = float(group["lr"])
        scale = -lr / (1.0 - group["betas"][0] ** t) if momentum else -lr
        if group.get("maximize", False):
            scale = -scale
        decay = 1.0 - lr * float(group.get("weight_decay", 0.0))
        if decay > 0.0:
            scale /= decay
        with torch.no_grad():
            param.add_(avg.view(param.shape).to(param.dtype), alpha=scale)
