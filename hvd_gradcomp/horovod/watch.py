"""The change watch of ``hvd_gradcomp.DistributedOptimizer``: user code writing a gradient whose exchange is open.

Between ``backward()`` and ``synchronize()`` a gradient holds this rank's values or already the
average, depending on timing; :class:`ChangeWatch` notes each as backward left it and refuses a
``step()`` after code changed one (``clip_grad_norm_`` before ``synchronize()``).
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch


class ChangeWatch:
    """Each gradient as backward left it (tensor, version): user code changing it before the exchange
    is finished is refused at synchronize() (see :meth:`changed`)."""

    def __init__(self, names: Dict[torch.Tensor, str]) -> None:
        self._names = names   # the optimizer's, which add_param_group extends
        self._final: Dict[torch.Tensor, Optional[Tuple[torch.Tensor, int]]] = {}

    def watch(self, p: torch.Tensor) -> None:
        """Note ``p``'s gradient as final; at the end of this backward pass (an autograd engine callback,
        after the early decodes of :meth:`~hvd_gradcomp.horovod.exchanges.StepExchanges.progress` have
        written what they write), its version is taken."""
        if not self._final:
            torch.autograd.Variable._execution_engine.queue_callback(self.backward_done)
        self._final[p] = None

    def backward_done(self) -> None:
        for p in self._final:
            self._final[p] = None if p.grad is None else (p.grad, p.grad._version)

    def changed(self) -> Optional[str]:
        """The name of a gradient that user code changed between ``backward()`` and ``step()`` without
        ``synchronize()`` first (``clip_grad_norm_``, a loss scaler's ``unscale_``, a hand-made decay),
        or None. One read of a version counter per parameter.

        Why: until ``synchronize()`` a gradient's ``p.grad`` holds this rank's gradient or, where its
        exchange was already decoded during backward, the average: which of the two depends on timing.
        Clipping there measured a different norm on each rank and scaled the averages already written
        by a different factor, so the replicas drifted apart, silently; what it did to the local
        gradients was lost (they had been sent)."""
        changed = next((p for p, seen in self._final.items()
                        if seen is not None and (p.grad is not seen[0] or p.grad._version != seen[1])), None)
        self._final.clear()
        return None if changed is None else self._names.get(changed, "?")

    @staticmethod
    def refuse(name: str) -> None:
        raise RuntimeError(
            f"hvd_gradcomp.DistributedOptimizer: the gradient of {name!r} was changed after backward() and before "
            "step() (clip_grad_norm_, a loss scaler's unscale_, or other code writing p.grad) while its exchange "
            "was still open. Until synchronize() p.grad holds this rank's gradient or the average, depending on "
            "timing, so such code scales each rank differently and the replicas drift apart. Call "
            "opt.synchronize(), then change the averaged gradients, then `with opt.skip_synchronize(): "
            "opt.step()` (Horovod's pattern), or clip with GradientAccumulator(opt, steps=..., max_grad_norm=...); "
            "with a TopK compressor bound each rank's gradient with its clip= instead "
            "(docs/PRECISION_AND_CLIPPING.md). This step's exchange was finished; the optimizer did not step.")

    def taken(self) -> bool:
        """Whether this backward pass's versions were taken (its end callback ran)."""
        return bool(self._final) and next(iter(self._final.values())) is not None

    def clear(self) -> None:
        self._final.clear()
