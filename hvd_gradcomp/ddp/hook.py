"""The DDP communication hook (:func:`gradcomp_hook`): each bucket goes its exchange (:mod:`hvd_gradcomp.ddp.exchanges`),
or waits for the step's last one under ``clip=``; and :func:`register`, which builds the
:class:`~hvd_gradcomp.ddp.state.GradCompState` and registers the hook on a DDP model.
"""
# No `from __future__ import annotations`: DDP checks the hook's annotations as real objects.
import copy
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..codecs.compressor import DEFAULT_MIN_COMPRESS_NUMEL, GradientCompressor, clips_whole_step
from . import join
from .exchanges import _EXCHANGES, Future, _allreduce, _dense_bucket
from ..codecs.topk import TopKQSGD
from .state import DENSE_DTYPES, GradCompState, _STATES, _check_compression, torch_optimizer
from .env import _warn_unread_settings


_DEFAULT_COMPRESSION = TopKQSGD(ratio=0.01, bits=8)


def gradcomp_hook(state: GradCompState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average ``bucket`` over the ranks with ``state.compression``.

    Args:
        state: a :class:`GradCompState`.
        bucket: the flat gradient bucket DDP hands over.

    Returns:
        A future whose value is the averaged bucket buffer (written in place).

    Example::

        >>> ddp_model.register_comm_hook(state, gradcomp_hook)    # doctest: +SKIP
    """
    if join.step_with_joined(state, bucket):   # some rank is inside model.join(): see hvd_gradcomp.ddp.join
        return join.joined_bucket(state, bucket)
    if clips_whole_step(state.compression):
        return _held_until_last(state, bucket)
    return _hook_now(state, bucket)


def _held_until_last(state: GradCompState, bucket: dist.GradBucket) -> Future:
    """``clip=``: every bucket of the step waits for the last one; then this rank's whole gradient is
    clipped to one global norm (:meth:`GradientCompressor.clip_local`, every tensor, compressed or
    not) and each bucket goes its exchange, in index order. The exchanges start once backward is over."""
    result: Future = Future()
    if bucket.index() == 0:
        state._held = []   # a new backward pass: nothing left of one that raised before its last bucket
    state._held.append((bucket, result))
    if not bucket.is_last():
        return result
    held, state._held = state._held, []
    state.last_local_norm = state.compression.clip_local([b.buffer() for b, _ in held])
    for b, res in held:
        _relay(_hook_now(state, b), res)
    return result


def _relay(source: Future, target: Future) -> None:
    """Complete ``target`` with ``source``'s value or error."""
    def done(fut: Future) -> None:
        try:
            target.set_result(fut.value())
        except Exception as err:   # noqa: BLE001 - handed on to DDP, which raises it in backward
            target.set_exception(err)
    source.add_done_callback(done)


def _hook_now(state: GradCompState, bucket: dist.GradBucket) -> Future:
    """:func:`gradcomp_hook` on one bucket, now."""
    buffer = bucket.buffer()
    step = state.iter
    if bucket.is_last():  # DDP launches buckets in index order: the last one closes the exchange
        state.iter += 1
        with state._lock:   # the drivers' callbacks record into the ledger from other threads
            state.comm_stats.end_step(state.iter)
    comp = state.compression
    if state.auto is not None and step >= state.start_compress_iter:
        return state.auto.hook(bucket, buffer, step)
    if not isinstance(comp, GradientCompressor) or step < state.start_compress_iter:
        return _allreduce(state, buffer, step, "dense", comp if comp in DENSE_DTYPES else None)
    plan = state._plan(bucket)
    if not plan.compressed:
        return _dense_bucket(state, buffer, plan, step)
    return _EXCHANGES[comp.collective](state, buffer, plan, step)


# ---------------------------------------------------------------- registration
def register(ddp_model: torch.nn.parallel.DistributedDataParallel,
             compression: Any = _DEFAULT_COMPRESSION, process_group: Optional[dist.ProcessGroup] = None,
             start_compress_iter: int = 0, min_compress_numel: int = DEFAULT_MIN_COMPRESS_NUMEL,
             optimizer: Optional[torch.optim.Optimizer] = None) -> GradCompState:
    """Register :func:`gradcomp_hook` on ``ddp_model`` and return its :class:`GradCompState`.

    ``compression`` defaults to a fresh ``TopKQSGD(ratio=0.01, bits=8)``; ``optimizer`` (the one
    stepping the model) lets its ``feedback="auto"`` choose DGC momentum correction for SGD with
    momentum; see :class:`GradCompState` for the other arguments. Call it on every rank, before
    the first backward pass (DDP allows one hook per model).

    Example::

        >>> model = DistributedDataParallel(net)                                       # doctest: +SKIP
        >>> state = register(model, compression=TopKQSGD(ratio=0.01, bits=8))          # doctest: +SKIP
        >>> loss.backward(); opt.step(); print(state.comm_stats.summary())             # doctest: +SKIP
    """
    if not isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(f"register() takes a torch.nn.parallel.DistributedDataParallel model, got "
                        f"{type(ddp_model).__name__}: wrap it first, DistributedDataParallel(model)")
    if compression is _DEFAULT_COMPRESSION:
        compression = copy.deepcopy(_DEFAULT_COMPRESSION)
    optimizer = torch_optimizer(optimizer)
    _check_compression(compression)   # before the rank-0-only warning reads it: the same error on every rank
    group = process_group if process_group is not None else ddp_model.process_group
    _warn_unread_settings(compression, dist.get_rank(group) if dist.is_initialized() else 0)
    state = GradCompState(group, compression, named_parameters=ddp_model.module.named_parameters(),
                          start_compress_iter=start_compress_iter, min_compress_numel=min_compress_numel,
                          optimizer=optimizer)
    ddp_model.register_comm_hook(state, gradcomp_hook)
    join.install(ddp_model, state, optimizer)
    _STATES[ddp_model] = state
    return state
