"""Local gradient clipping (``clip=``): :class:`Clipping`, a part of
:class:`~hvd_gradcomp.codecs.compressor.GradientCompressor`."""
from __future__ import annotations

from typing import List, Optional

import torch


class Clipping:
    """``clip``: the largest global L2 norm of each rank's gradient, as ``clip_grad_norm_`` means it, or
    None: done to each rank's own gradient before anything is compressed, over every tensor of the
    step (compressed, small and excluded ones). ``hvd_gradcomp.DistributedOptimizer`` and the DDP hook
    then start the exchanges once backward is over (the norm needs every gradient); stock
    ``hvd.DistributedOptimizer`` compresses each tensor as its gradient arrives and refuses it.
    ``whole_step_clipped``: set by a wrapper that clips every tensor of a step at once (:meth:`local`) before
    compressing any, so that a tensor is not clipped again alone (:meth:`clipped`).

    >>> c = Clipping(1.0)
    >>> a, b = torch.full((4,), 3.0), torch.full((9,), 2.0)    # norms 6 and 6: global 8.49
    >>> round(float(c.local([a, b])), 2), round(float(torch.cat([a, b]).norm()), 4)
    (8.49, 1.0)
    >>> float(c.clipped(torch.full((4,), 3.0)).norm())       # one tensor, no wrapper: clipped alone
    1.0
    """

    def __init__(self, clip: Optional[float] = None) -> None:
        if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float)) or not clip > 0):
            raise ValueError(f"clip must be None or a positive number (the largest global L2 norm of each "
                             f"rank's gradient, as in clip_grad_norm_), got {clip!r}")
        self.clip = clip
        # Unset (a direct compress() call) the one tensor handed is all there is, and is clipped alone.
        self.whole_step_clipped = False

    def clipped(self, grad: torch.Tensor) -> torch.Tensor:
        """``grad`` clipped alone (a direct ``compress()`` call, no wrapper); under a wrapper, :meth:`local`
        clipped the whole step already."""
        if self.clip is None or self.whole_step_clipped:
            return grad
        norm = float(grad.float().norm())
        return grad if norm <= self.clip else grad * (self.clip / norm)

    def local(self, grads: List[torch.Tensor]) -> Optional[torch.Tensor]:
        """Scale this rank's gradients ``grads``, in place, to a global L2 norm of at most ``clip``, as
        ``clip_grad_norm_`` does; the wrappers call it with every gradient of the step (compressed, small
        and excluded tensors) before compressing any. Returns the norm before clipping (a tensor: no
        host sync), or None without ``clip``.

        Why the global norm, and every tensor: that is what users mean by clipping. A bound per
        tensor let the total grow with the number of tensors, and tensors too small to compress
        went unclipped: a 2-layer LSTM with SGD lr 20 and ``clip=0.25`` diverged through its
        768-element biases (benchmarks/results/RECIPES.md, ``lstm``). A NaN or Inf stays non-finite (as with
        ``clip_grad_norm_``), so the step is still skipped on every rank.
        """
        if self.clip is None or not grads:
            return None
        dev = grads[0].device
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32).to(dev)
                                                     for g in grads]))
        coef = torch.clamp(self.clip / (norm + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.device, g.dtype))
        return norm
