"""Gradient accumulation with the DDP hook: N micro-batches under ``no_sync()``, one compressed exchange.

The accumulator is the one :class:`hvd_gradcomp.horovod.accumulate.GradientAccumulator`, which serves both
wrappers; called with the DDP model first, ``GradientAccumulator(ddp_model, optimizer, steps, micro_batch=None,
max_grad_norm=None)``, it holds the exchange back with ``no_sync()`` (its :class:`DDPWrapper` part).

Example::

    acc = gc_ddp.GradientAccumulator(model, opt, steps=8, micro_batch=4)
    for x, y in loader:
        with acc.accumulate():
            acc.backward(loss_fn(model(x), y))      # steps on every 8th call
    acc.flush()
"""
from ..horovod.accumulate import DDPWrapper, GradientAccumulator

__all__ = ["GradientAccumulator", "DDPWrapper"]
