""":class:`StockProtocol`, the part of :class:`hvd_gradcomp.auto.Auto` inside stock
``hvd.DistributedOptimizer``: which Horovod call a tensor ``compress()`` gets belongs to, what it
hands Horovod on each road and what ``decompress()`` makes of it. Auto picks the road and records
the costs; Horovod runs the collective (an allreduce of what :meth:`StockProtocol.send` returns;
the compressed roads' allgather is started here, Horovod reduces an empty tensor).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch

from ..codecs.compressor import GradientCompressor
from ..codecs.interface import _compressible
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


class StockProtocol:
    """Horovod's compression protocol for Auto: ``names`` of the gradients (:meth:`bind`, else
    found from Horovod's optimizer), the call a tensor belongs to, and each road's send and receive.

    >>> StockProtocol().call_of(torch.zeros(3)) is None   # not inside hvd.DistributedOptimizer
    True
    """

    def __init__(self) -> None:
        self.names: Optional[Dict[torch.Tensor, str]] = None

    def bind(self, named_parameters: Any) -> None:
        """Use these names for the gradients (:meth:`hvd_gradcomp.auto.Auto.bind`)."""
        from ..horovod.stock import name_map

        self.names = name_map(named_parameters)

    def call_of(self, tensor: torch.Tensor) -> Any:
        """Horovod's call that hands ``tensor`` to compress() (None: anywhere else, or not compressible)."""
        from ..horovod.stock import find_horovod_call

        return find_horovod_call(tensor, self.names) if _compressible(tensor) else None

    def send(self, call: Any, road: str, tensor: torch.Tensor,
             compressor: GradientCompressor) -> Tuple[torch.Tensor, StockCtx]:
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


    def receive(self, tensor: torch.Tensor, ctx: StockCtx) -> Tuple[torch.Tensor, float, float]:
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
