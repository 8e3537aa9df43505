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
from typing import Any, List, Optional, Tuple

import torch

from . import wire
from .compressors import GradientCompressor, QSGD
from .feedback import residual_dtype


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
    finished: bool = False
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
        # Horovod's collectives take contiguous tensors only (a channels_last gradient is not).
        tensor, ctx = self.compression.compress(grad.contiguous())
        handle = _hvd().allreduce_async(tensor, name=f"hvdgc.dense.{name}", op=self.op,
                                        process_set=self.process_set)
        return Pending(name, grad.shape, grad.dtype, handle, ctx, tensor.numel() * tensor.element_size())

    def advance(self, p: Pending) -> None:
        pass

    def progress(self, p: Pending) -> None:
        """Nothing to do early: Horovod's allreduce runs in its background thread."""

    def finish(self, p: Pending, out: torch.Tensor) -> None:
        out.copy_(self.compression.decompress(_hvd().synchronize(p.handle), p.ctx).view_as(out))
        p.finished = True


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

    def progress(self, p: Pending) -> None:
        """Decode now if the allgather is done, overlapping the rest of backward; never blocks.

        Decoded parts wait in ``p.extra``: ``p.grad`` keeps the local gradient until
        synchronize(), as with Horovod.
        """
        if "parts" not in p.extra and _hvd().poll(p.handle):
            self._decode(p)

    def _decode(self, p: Pending) -> None:
        payloads = wire.split_payloads(_hvd().synchronize(p.handle))
        p.extra["parts"] = decode_payloads(self.compressor, payloads, self.process_set.size(), p.shape.numel())

    def finish(self, p: Pending, out: torch.Tensor) -> None:
        if "parts" not in p.extra:
            self._decode(p)
        sum_parts(p.extra.pop("parts"), is_average(self.op), out.numel(), p.dtype, out=out)
        p.finished = True


Parts = List[Tuple[Optional[torch.Tensor], torch.Tensor]]


def decode_payloads(compressor: GradientCompressor, payloads: List[torch.Tensor], size: int,
                    numel: Optional[int] = None) -> Parts:
    """Every rank's payload decoded, in rank order, as (indices or None, values).

    With ``numel``, each payload must stand for a tensor of that many elements.
    """
    if len(payloads) != size:
        raise RuntimeError(f"expected {size} payloads, got {len(payloads)}: ranks disagree on this exchange")
    if numel is not None:
        for rank, pl in enumerate(payloads):
            got = wire.read_header(pl).numel
            if got != numel:
                raise wire.WireFormatError(f"the payload of rank {rank} holds {got} elements, {numel} expected: "
                                           "ranks disagree on the tensor's shape")
    return [compressor.decode_parts(pl) for pl in payloads]


def is_average(op: Any) -> bool:
    """True for ``hvd.Average``, False for ``hvd.Sum``; anything else is refused."""
    hvd = _hvd()
    if op == hvd.Average:
        return True
    if op == hvd.Sum:
        return False
    raise ValueError(f"unsupported reduction op {op}; use hvd.Average or hvd.Sum")


def sum_parts(parts: Parts, average: bool, numel: int, dtype: torch.dtype,
              out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The average (``average=True``) or sum of decoded parts; no collective, any backend.

    Every rank runs the same additions in the same order on the same bytes, so every rank
    gets bit-identical results. Sums run in float32 for 16-bit gradients. Sparse parts are
    added straight into one zeroed buffer; with ``out`` (contiguous, of the accumulation
    dtype) the result is written there.
    """
    scale = 1.0 / len(parts) if average else 1.0
    acc_dtype = residual_dtype(dtype)
    direct = out is not None and out.dtype == acc_dtype and out.is_contiguous()
    acc = out.view(-1) if direct else torch.empty(numel, dtype=acc_dtype, device=parts[0][1].device)
    acc.zero_()
    for idx, vals in parts:
        if idx is None:
            acc.add_(vals.to(acc_dtype), alpha=scale)
        else:
            acc.index_add_(0, idx, vals.to(acc_dtype), alpha=scale)
    if out is not None and not direct:
        out.copy_(acc.view_as(out))
        return out
    return acc if acc.dtype == dtype else acc.to(dtype)


def reduce_payloads(compressor: GradientCompressor, payloads: List[torch.Tensor], average: bool, size: int,
                    dtype: torch.dtype, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The average (or sum) of every rank's payload, decoded in rank order (see :func:`sum_parts`)."""
    numel = wire.read_header(payloads[0]).numel if payloads else 0
    return sum_parts(decode_payloads(compressor, payloads, size, numel), average, numel, dtype, out)


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

    def progress(self, p: Pending) -> None:
        """Start stage 2 as soon as the alltoall is done (p.grad is untouched); never blocks."""
        if p.stage == 1 and _hvd().poll(p.handle):
            self.advance(p)

    def advance(self, p: Pending) -> None:
        """Stage 2: reduce my chunk from everybody's payloads, re-quantise, start the allgather."""
        if p.stage != 1:
            return
        hvd = _hvd()
        received, _ = hvd.synchronize(p.handle)
        payloads = wire.split_payloads(received)
        mine = reduce_payloads(self.compressor, payloads, is_average(self.op), self.process_set.size(), p.dtype)
        rank = self.process_set.rank()
        payload = self.compressor.compress_named(f"{p.name}#reduced{rank}", mine)
        p.handle = hvd.allgather_async(payload, name=f"hvdgc.ag2.{p.name}", process_set=self.process_set)
        p.bytes_sent += payload.numel()
        p.stage = 2

    def finish(self, p: Pending, out: torch.Tensor) -> None:
        if p.stage == 1:
            self.advance(p)
        gathered = _hvd().synchronize(p.handle)
        payloads = wire.split_payloads(gathered)
        bounds = p.extra["bounds"]
        if len(payloads) != len(bounds) - 1:
            raise RuntimeError(f"{p.name}: got {len(payloads)} chunks for {len(bounds) - 1} ranks")
        # A channels_last (or otherwise strided) gradient cannot be viewed flat: fill a flat
        # buffer in the tensor's logical order and copy it over.
        flat = out.view(-1) if out.is_contiguous() else torch.empty(out.numel(), dtype=out.dtype, device=out.device)
        for payload, b, e in zip(payloads, bounds, bounds[1:]):
            chunk = self.compressor.decode(payload).reshape(-1)
            if chunk.numel() != e - b:
                raise RuntimeError(f"{p.name}: chunk of {chunk.numel()} elements where {e - b} were expected; "
                                   "ranks disagree on the tensor's shape")
            flat[b:e].copy_(chunk)
        if not out.is_contiguous():
            out.copy_(flat.view(out.shape))
        p.finished = True


def choose_exchange(compression: Any, op: Any, process_set: Any):
    """The exchange for a compression setting (None / Horovod compressor / ours)."""
    if isinstance(compression, QSGD):
        return ScatterReduceExchange(compression, op, process_set)
    if isinstance(compression, GradientCompressor):
        return AllgatherExchange(compression, op, process_set)
    return DenseExchange(op, process_set, compression)

