""":class:`hvd_gradcomp.auto.Auto` inside stock ``hvd.DistributedOptimizer``: what ``compress()``
hands Horovod on each road and what ``decompress()`` makes of it (:func:`send`, :func:`receive`).
Auto picks the road and records the costs; Horovod runs the collective (an allreduce of what
:func:`send` returns; the compressed roads' allgather is started here, Horovod reduces an empty
tensor).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Tuple

import torch

from ..codecs.compressor import GradientCompressor
from ..collectives.exchange import AllgatherExchange, allreducible, wait_done
from .policy import DENSE, FP16, QSGD_AG, SPARSE


def _hvd():
    import horovod.torch as hvd
    return hvd


@dataclass
class StockCtx:
    """decompress()'s context inside stock Horovod: the road and what is in flight on it."""

    name: str
    road: str
    inner: Any
    like: torch.Tensor
    codec_s: float
    payload: float


def send(call: Any, road: str, tensor: torch.Tensor, compressor: GradientCompressor) -> Tuple[torch.Tensor, StockCtx]:
    """What Horovod allreduces for ``tensor`` on ``road`` (``call``: Horovod's, from
    :func:`hvd_gradcomp.horovod.stock.find_horovod_call`; ``compressor``: the road's, if compressed)."""
    t0 = time.perf_counter()
    if road == DENSE:
        out, inner = allreducible(tensor), None   # receive() casts back
        payload = out.numel() * out.element_size()
    elif road == FP16:
        out, inner = _hvd().Compression.fp16.compress(tensor)
        payload = out.numel() * out.element_size()
    else:
        exchange = AllgatherExchange(compressor, call.op, call.process_set)
        inner = (exchange, exchange.start(call.name, tensor))
        out, payload = allreducible(tensor.new_empty(0)), inner[1].bytes_sent
    return out, StockCtx(call.name, road, inner, tensor, time.perf_counter() - t0, payload)


def receive(tensor: torch.Tensor, ctx: StockCtx) -> Tuple[torch.Tensor, float, float]:
    """The averaged (or summed) gradient from what Horovod returned, its codec seconds in all and
    the seconds waited for a compressed road's allgather."""
    wait = 0.0
    if ctx.road in (SPARSE, QSGD_AG):
        wait = wait_done(ctx.inner[1].handle)
    t0 = time.perf_counter()
    if ctx.road == DENSE:
        out = tensor.to(ctx.like.dtype)
    elif ctx.road == FP16:
        out = _hvd().Compression.fp16.decompress(tensor, ctx.inner)
    else:
        exchange, pending = ctx.inner
        out = torch.empty(pending.shape, dtype=pending.dtype, device=ctx.like.device)
        exchange.finish(pending, out)
    return out, ctx.codec_s + time.perf_counter() - t0, wait
