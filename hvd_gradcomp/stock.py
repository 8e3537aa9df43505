"""Make the compressors right inside an unmodified ``hvd.DistributedOptimizer``.

Stock Horovod calls ``compression.compress(grad)`` with no parameter name, allreduces what
comes back, then ``decompress(result, ctx)``. An allreduce of packed levels or sparse
indices would be meaningless, so the payload takes another road:

1. ``compress`` finds the parameter name in Horovod's own call (the frame of
   ``_DistributedOptimizer._allreduce_grad_async``, whose ``p.grad`` must be the very
   tensor handed in, so a name can never be confused with another tensor's), applies error
   feedback, and starts an **allgather of the payload** named after the parameter.
2. It returns an empty tensor: Horovod's allreduce of it moves no data.
3. ``decompress`` waits for the allgather, decodes every rank's payload in rank order and
   averages (or sums): every rank computes the same bytes in the same order, so every rank
   ends with the same gradient.

Where the name cannot be found (Adasum, sparse gradients, a Horovod whose internals differ)
it raises :class:`HorovodIntegrationError` at the first step instead of guessing.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Optional

import torch

from .exchange import AllgatherExchange, Pending

_HOROVOD_OPTIMIZER_FILE = "horovod/torch/optimizer.py"
_FRAMES_TO_SEARCH = 5


class HorovodIntegrationError(RuntimeError):
    """The compressor cannot run correctly inside this Horovod call."""


@dataclass
class HorovodCall:
    name: str
    op: Any
    process_set: Any
    optimizer: Any = None


@dataclass
class StockContext:
    """decompress()'s context: the allgather in flight for one parameter."""

    exchange: AllgatherExchange
    pending: Pending
    device: torch.device


def find_horovod_call(tensor: torch.Tensor) -> Optional[HorovodCall]:
    """The parameter name, op and process set of the Horovod optimizer call that passed
    ``tensor`` to ``compress``; None when not called from Horovod's optimizer."""
    frame = sys._getframe(1)
    for _ in range(_FRAMES_TO_SEARCH):
        frame = frame.f_back
        if frame is None:
            return None
        if frame.f_code.co_filename.replace("\\", "/").endswith(_HOROVOD_OPTIMIZER_FILE):
            return _call_from_frame(frame, tensor)
    return None


def _call_from_frame(frame: Any, tensor: torch.Tensor) -> HorovodCall:
    import horovod.torch as hvd

    opt = frame.f_locals.get("self")
    if opt is None and frame.f_back is not None:
        opt = frame.f_back.f_locals.get("self")
    names = getattr(opt, "_parameter_names", None)
    if names is None:
        raise HorovodIntegrationError(_advice("this Horovod version's optimizer has no _parameter_names"))
    if getattr(opt, "op", None) == hvd.Adasum or hasattr(opt, "_starting_models"):
        raise HorovodIntegrationError("hvd_gradcomp compressors do not support op=hvd.Adasum (it "
                                      "reduces dense deltas); use op=hvd.Average or hvd.Sum")
    p = frame.f_locals.get("p")
    if not (isinstance(p, torch.Tensor) and p.grad is tensor):
        p = next((q for q in names if q.grad is tensor), None)
    if p is None:
        raise HorovodIntegrationError(_advice("the tensor handed to compress() is not any parameter's "
                                              ".grad (sparse_as_dense=True or a modified optimizer?)"))
    return HorovodCall(names[p], opt.op, opt.process_set, opt)


def _advice(why: str) -> str:
    return (f"hvd_gradcomp cannot tell which parameter this gradient belongs to: {why}. "
            "Use hvd_gradcomp.DistributedOptimizer(...) (same arguments), which passes names explicitly.")


def start_exchange(compressor: Any, call: HorovodCall, tensor: torch.Tensor):
    """compress() inside Horovod: error feedback and an async allgather of the payload, on the
    same road as hvd_gradcomp.DistributedOptimizer's sparse exchanges."""
    compressor.attach(call.optimizer, call.optimizer._parameter_names, call.process_set.rank())
    exchange = AllgatherExchange(compressor, call.op, call.process_set)
    ctx = StockContext(exchange, exchange.start(call.name, tensor), tensor.device)
    return tensor.new_empty(0), ctx


def finish_exchange(compressor: Any, ctx: StockContext) -> torch.Tensor:
    """decompress() inside Horovod: the average (or sum) of every rank's decoded payload."""
    out = torch.empty(ctx.pending.shape, dtype=ctx.pending.dtype, device=ctx.device)
    ctx.exchange.finish(ctx.pending, out)
    return out
