"""The gradient hooks of ``hvd_gradcomp.DistributedOptimizer``: which parameters it exchanges, and when.

A hook (``register_post_accumulate_grad_hook``) on each parameter calls the optimizer as soon as
the gradient is accumulated; :class:`GradientHooks` counts down the ``backward_passes_per_step``
passes of each, so that the exchange starts at the last one.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List

import torch


class GradientHooks:
    """The hooks on the parameters and each one's count of backward passes still to come this step.

    >>> hooks = GradientHooks(passes=2, hook=lambda p: None)
    >>> w = torch.nn.Parameter(torch.ones(3))
    >>> hooks.register([{"params": [w]}])
    >>> hooks.count(w), hooks.count(w)        # final at the second pass
    (False, True)
    >>> hooks.rearm(); hooks.count(w)
    False
    >>> hooks.remove()
    """

    def __init__(self, passes: int, hook: Callable[[torch.Tensor], None]) -> None:
        self._passes, self._hook = passes, hook
        self._delay: Dict[torch.Tensor, int] = {}   # in the param groups' order: the order of exchanges
        self._handles: List[Any] = []

    def register(self, param_groups: Iterable[Dict[str, Any]]) -> None:
        """Hook every parameter that requires a gradient."""
        self._handles = []
        for group in param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    self._add(p)

    def adopt(self, param_groups: Iterable[Dict[str, Any]]) -> None:
        """Hook the parameters that have a gradient and no hook: ``requires_grad=False`` when the optimizer
        was built, unfrozen since (a layer unfrozen to fine-tune it). Without this each rank stepped them
        on its own gradient and the ranks drifted apart, silently (stock ``hvd.DistributedOptimizer``
        does that)."""
        for group in param_groups:
            for p in group["params"]:
                if p.grad is not None and p not in self._delay:
                    self._add(p)

    def _add(self, p: torch.Tensor) -> None:
        self._delay[p] = self._passes
        self._handles.append(p.register_post_accumulate_grad_hook(self._hook))

    def remove(self) -> None:
        """Take every hook off its parameter."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def count(self, p: torch.Tensor) -> bool:
        """One backward pass of ``p``: whether its gradient is final for this step."""
        self._delay[p] -= 1
        return self._delay[p] == 0

    def params(self) -> List[torch.Tensor]:
        """The hooked parameters, in the order they were hooked."""
        return list(self._delay)

    def rearm(self) -> None:
        """A new step: every parameter waits for ``passes`` backward passes again."""
        for p in self._delay:
            self._delay[p] = self._passes
