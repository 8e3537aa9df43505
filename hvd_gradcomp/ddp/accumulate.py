"""Gradient accumulation with the DDP hook (:class:`GradientAccumulator`): N micro-batches under
``no_sync()``, one compressed exchange.
"""
from contextlib import contextmanager, nullcontext
from typing import Dict, Iterator, List, Optional

import torch
import torch.distributed as dist

from ..horovod.accumulate import check_clippable, check_max_grad_norm
from .state import _STATES

class GradientAccumulator:
    """N micro-batches, one compressed exchange: DDP's ``no_sync()`` plus loss scaling and tail flush.

    The first N-1 micro-batches of a window run under ``ddp_model.no_sync()`` (gradients add
    up locally, nothing is sent); the N-th runs normally, so the hook compresses and exchanges
    the accumulated gradient once, exactly as it would one N times larger batch. Each loss
    is scaled by 1/N. Forward *and* backward must run inside :meth:`accumulate`, since DDP
    decides at the forward pass whether the backward pass synchronises.

    ``flush()`` ends a partial window of k < N micro-batches (the end of an epoch): their
    gradients never left the rank, so it averages them with one uncompressed allreduce per
    dtype, rescales by N/k and steps. Call it on every rank. (The hook does not see that
    window: under ``feedback="frozen"`` the wrapped Adam steps it with its own state.)

    ``max_grad_norm``: clip the averaged gradients to this norm before each step
    (``last_grad_norm``: the norm before clipping, a tensor). Under ``feedback="frozen"``, after
    a tensor's dense warm-up its ``p.grad`` holds zeros (the update is applied at the step): the
    clipping then covers the uncompressed tensors only; the compressor's ``clip=`` bounds the rest.

    Example::

        acc = gc_ddp.GradientAccumulator(model, opt, steps=8, micro_batch=4)
        for x, y in loader:
            with acc.accumulate():
                acc.backward(loss_fn(model(x), y))      # steps on every 8th call
        acc.flush()
    """

    def __init__(self, ddp_model: torch.nn.parallel.DistributedDataParallel, optimizer: torch.optim.Optimizer,
                 steps: int, micro_batch: Optional[int] = None, max_grad_norm: Optional[float] = None) -> None:
        if not isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel):
            raise TypeError(f"GradientAccumulator takes the DistributedDataParallel model, got "
                            f"{type(ddp_model).__name__}")
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps must be an int >= 1 (micro-batches per optimizer step), got {steps!r}")
        self.model, self.optimizer, self.steps, self.micro_batch = ddp_model, optimizer, steps, micro_batch
        self.max_grad_norm = check_max_grad_norm(max_grad_norm)
        if self.max_grad_norm is not None and ddp_model in _STATES:
            # register() chose the hook's policy: refuse now rather than at the first step (a hook
            # registered after this accumulator is checked then)
            check_clippable(_STATES[ddp_model].compression)
        self.last_grad_norm: Optional[torch.Tensor] = None
        self.pending = 0
        self.optimizer_steps = 0
        self._inside = False

    @contextmanager
    def accumulate(self) -> Iterator[None]:
        """Wrap one micro-batch's forward and backward: no_sync unless it completes the window."""
        self._inside = True
        try:
            with self.model.no_sync() if self.pending + 1 < self.steps else nullcontext():
                yield
        finally:
            self._inside = False

    def backward(self, loss: torch.Tensor) -> bool:
        """``(loss / steps).backward()``; steps and zeroes the gradients on every ``steps``-th call."""
        if not self._inside:
            raise RuntimeError("call backward() inside `with acc.accumulate():`, around the forward pass too "
                               "(DDP decides at the forward pass whether to synchronise)")
        if loss.dim() != 0:
            raise ValueError(f"loss must be a scalar (reduce it with .mean()), got shape {tuple(loss.shape)}")
        (loss / self.steps).backward()
        self.pending += 1
        if self.pending == self.steps:
            self._step()
            return True
        return False

    def flush(self) -> bool:
        """Average, rescale and step on a partial window (see the class docstring); False if empty."""
        if self.pending == 0:
            return False
        params = [p for p in self.model.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        group = self.model.process_group
        scale = self.steps / self.pending / dist.get_world_size(group)
        by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
        for p in params:
            by_dtype.setdefault(p.grad.dtype, []).append(p)
        for dtype in sorted(by_dtype, key=str):  # the same order on every rank
            grads = [p.grad for p in by_dtype[dtype]]
            flat = torch.cat([g.reshape(-1) for g in grads]).mul_(scale)
            dist.all_reduce(flat, group=group)
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
        self._step()
        return True

    def _step(self) -> None:
        if self.max_grad_norm is not None:
            state = _STATES.get(self.model)
            check_clippable(state.compression if state is not None else None)
            self.last_grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.pending = 0
        self.optimizer_steps += 1

    def effective_batch(self) -> Optional[int]:
        """micro_batch x steps x ranks (None when micro_batch is unknown)."""
        if self.micro_batch is None:
            return None
        return self.micro_batch * self.steps * dist.get_world_size(self.model.process_group)
