"""The small-tensor fuser of ``hvd_gradcomp.DistributedOptimizer``: the tensors it sends uncompressed.

Tensors smaller than ``min_compress_numel`` (biases, norms), of a dtype the wire cannot encode, or
excluded by the compressor's policy travel in one fused allreduce per dtype (fewer, larger messages),
float32 ones the compressor sends as float16 in one more (see :class:`SmallTensors`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Tuple

import torch

from .. import wire
from ..codecs.compressor import GradientCompressor
from ..collectives.exchange import DenseExchange, HalfExchange, JoinGuard, Pending
from ..collectives.inflight import is_average
from ..collectives.rounds import HALF, Algorithm, dense_fallback
from ..collectives.rounds import finish as finish_rounds


@dataclass
class Fused:
    """One fused exchange of :class:`SmallTensors`: its parameters, the algorithm, and its allreduces
    with the exchange that carries each."""

    params: List[torch.Tensor]
    run: Algorithm
    pendings: List[Tuple[Any, Pending]]


class SmallTensors:
    """The tensors exchanged uncompressed (small, a dtype the wire cannot encode, or excluded by the
    compressor's policy): :func:`~hvd_gradcomp.collectives.rounds.dense_fallback` on Horovod, one
    allreduce per dtype (:class:`~hvd_gradcomp.collectives.exchange.DenseExchange`) and one of the
    float16 casts (:class:`~hvd_gradcomp.collectives.exchange.HalfExchange`) for those the compressor
    sends as float16.

    ``record(name, raw bytes, pending)`` counts the bytes of each allreduce started.
    """

    def __init__(self, compression: Any, names: Dict[torch.Tensor, str], dense: DenseExchange, joins: JoinGuard,
                 min_compress_numel: int, record: Callable[[str, int, Pending], None]) -> None:
        self.compression, self._names, self._dense, self._joins = compression, names, dense, joins
        self._half = HalfExchange(dense.process_set)
        self._min_compress_numel, self._record = min_compress_numel, record

    def is_small(self, p: torch.Tensor) -> bool:
        """Exchanged uncompressed: small, of a dtype the wire cannot encode (float64: it travels as it
        is, as under stock Horovod), or excluded by the compressor's policy."""
        if p.dtype not in wire.DTYPES or p.numel() < self._min_compress_numel:
            return True
        return isinstance(self.compression, GradientCompressor) and \
            not self.compression.compresses(self._names[p])

    def start(self, params: List[torch.Tensor], tag: str = "") -> List[Fused]:
        """One allreduce per dtype for all ``params``: fewer, larger messages. ``tag``: part of the
        exchanges' names, for a second fused exchange in the same step."""
        if not params:
            return []
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        ours = self.compression if isinstance(self.compression, GradientCompressor) else None
        grads = [p.grad for p in params]
        # While ranks are inside hvd.join() (they add zeros): averaged over the ranks still training
        joined = self._joins.joined() if ours is not None else 0
        run = dense_fallback(ours, [(self._names[p], p.grad) for p in params], grads,
                             joined or self._dense.process_set.size(), self._min_compress_numel,
                             is_average(self._dense.op))
        pendings = []
        for request in next(run).requests:
            exchange = self._half if request.tag == HALF else self._dense
            name = f"fused{tag}.{request.tag}"
            pending = (exchange.start(name, request.tensor) if exchange is self._half
                       else exchange.start(name, request.tensor, joined))
            self._record(pending.name, request.raw_bytes, pending)
            pendings.append((exchange, pending))
        return [Fused(params, run, pendings)]

    def finish(self, fused: List[Fused]) -> None:
        """Wait for :meth:`start`'s allreduces; the algorithm writes each average into ``p.grad``."""
        for f in fused:
            finish_rounds(f.run, [exchange.result(pending) for exchange, pending in f.pendings])
