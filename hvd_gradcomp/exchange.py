"""Collectives: how each kind of payload crosses the network and comes back averaged.

Three roads, chosen per tensor by :func:`choose_exchange`:

* :class:`DenseExchange`: Horovod's allreduce of the (optionally fp16-cast) tensor. Used
  with no compressor, with Horovod's own compressors, and for small tensors.
* :class:`AllgatherExchange`: sparse payloads (TopK, TopKQSGD). Each rank allgathers its
  payload; every rank decodes all payloads in rank order and averages, so all ranks end
  with identical gradients.
* :class:`ScatterReduceExchange`: QSGD's compressed allreduce. Each rank quantises its
  gradient in P chunks; an alltoall sends chunk i to rank i; rank i decodes and sums its
  chunk, re-quantises it (with its own error feedback), and an allgather returns every
  chunk. The bytes a rank sends stay about (1 + 1/P) x its payload, whatever P is.

Each exchange has two phases: ``start`` (at the gradient hook, overlapping backward) and
``finish`` (in ``synchronize``); the QSGD road has a middle phase ``advance`` that launches
the allgather once the alltoall is done. ``bytes_sent`` counts the bytes handed to Horovod.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List

import torch

from . import wire
from .compressors import GradientCompressor, QSGD
from .stock import reduce_payloads


@dataclass
class Pending:
    """One tensor in flight."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    handle: Any
    ctx: Any = None
    bytes_sent: int = 0
    stage: int = 1
    extra: dict = field(default_factory=dict)


def _hvd():
    import horovod.torch as hvd
    return hvd


class DenseExchange:
    """Horovod allreduce, through a Horovod-style compressor (``hvd.Compression.none/fp16``)."""

    def __init__(self, op: Any, process_set: Any, compression: Any = None) -> None:
        self.op, self.process_set = op, process_set
        self.compression = compression if compression is not None else _hvd().Compression.none

    def start(self, name: str, grad: torch.Tensor) -> Pending:
        tensor, ctx = self.compression.compress(grad)
        handle = _hvd().allreduce_async(tensor, name=f"hvdgc.dense.{name}", op=self.op,
                                        process_set=self.process_set)
        return Pending(name, grad.shape, grad.dtype, handle, ctx, tensor.numel() * tensor.element_size())

    def advance(self, p: Pending) -> None:
        pass

    def finish(self, p: Pending) -> torch.Tensor:
        return self.compression.decompress(_hvd().synchronize(p.handle), p.ctx)


class AllgatherExchange:
    """Sparse payloads: allgather, then every rank decodes all of them in rank order."""

    def __init__(self, compressor: GradientCompressor, op: Any, process_set: Any) -> None:
        self.compressor, self.op, self.process_set = compressor, op, process_set

    def start(self, name: str, grad: torch.Tensor) -> Pending:
        payload = self.compressor.compress_named(name, grad)
        handle = _hvd().allgather_async(payload, name=f"hvdgc.ag.{name}", process_set=self.process_set)
        return Pending(name, grad.shape, grad.dtype, handle, bytes_sent=payload.numel())

    def advance(self, p: Pending) -> None:
        pass

    def finish(self, p: Pending) -> torch.Tensor:
        gathered = _hvd().synchronize(p.handle)
        payloads = wire.split_payloads(gathered)
        return reduce_payloads(self.compressor, payloads, self.op, self.process_set.size(), p.dtype).view(p.shape)


def chunk_bounds(n: int, parts: int) -> List[int]:
    """Boundaries of ``parts`` nearly equal chunks of n elements: [0, ..., n].

    >>> chunk_bounds(10, 3)
    [0, 4, 7, 10]
    """
    base, extra = divmod(n, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    return bounds


class ScatterReduceExchange:
    """QSGD's compressed allreduce: alltoall of quantised chunks, reduce, allgather."""

    def __init__(self, compressor: QSGD, op: Any, process_set: Any) -> None:
        self.compressor, self.op, self.process_set = compressor, op, process_set

    def start(self, name: str, grad: torch.Tensor) -> Pending:
        size = self.process_set.size()
        bounds = chunk_bounds(grad.numel(), size)
        payloads = self.compressor.compress_chunks(name, grad, bounds)
        splits = torch.tensor([pl.numel() for pl in payloads], dtype=torch.int32)
        handle = _hvd().alltoall_async(torch.cat(payloads), splits=splits, name=f"hvdgc.a2a.{name}",
                                       process_set=self.process_set)
        # The chunk this rank keeps never leaves it: count only what goes to the others, so
        # that alltoall + allgather together send exactly one payload's worth per rank.
        sent = int(splits.sum()) - int(splits[self.process_set.rank()])
        return Pending(name, grad.shape, grad.dtype, handle, bytes_sent=sent, extra={"bounds": bounds})

    def advance(self, p: Pending) -> None:
        """Stage 2: reduce my chunk from everybody's payloads, re-quantise, start the allgather."""
        hvd = _hvd()
        received, _ = hvd.synchronize(p.handle)
        payloads = wire.split_payloads(received)
        mine = reduce_payloads(self.compressor, payloads, self.op, self.process_set.size(), p.dtype)
        rank = self.process_set.rank()
        payload = self.compressor.compress_named(f"{p.name}#reduced{rank}", mine)
        p.handle = hvd.allgather_async(payload, name=f"hvdgc.ag2.{p.name}", process_set=self.process_set)
        p.bytes_sent += payload.numel()
        p.stage = 2

    def finish(self, p: Pending) -> torch.Tensor:
        if p.stage == 1:
            self.advance(p)
        gathered = _hvd().synchronize(p.handle)
        chunks = [self.compressor.decode(pl).reshape(-1) for pl in wire.split_payloads(gathered)]
        out = torch.cat(chunks) if chunks else gathered.new_zeros(0)
        if out.numel() != p.shape.numel():
            raise RuntimeError(f"{p.name}: reassembled {out.numel()} of {p.shape.numel()} elements; "
                               "ranks disagree on the tensor's shape")
        return out.view(p.shape)


def choose_exchange(compression: Any, op: Any, process_set: Any):
    """The exchange for a compression setting (None / Horovod compressor / ours)."""
    if isinstance(compression, QSGD):
        return ScatterReduceExchange(compression, op, process_set)
    if isinstance(compression, GradientCompressor):
        return AllgatherExchange(compression, op, process_set)
    return DenseExchange(op, process_set, compression)

