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

Every payload travels behind a 16-byte envelope (:func:`seal`, not part of the codec's wire
format) carrying what the exchange needs besides the codec's bytes:

* the sender's exchange step: receivers compare them (:func:`check_steps`), so a rank that
  skipped or repeated part of a step stops the job with :class:`RankDivergenceError`
  naming every rank's step, instead of averaging gradients of different steps;
* a non-finite flag: a gradient holding NaN/Inf (a loss scaler's overflow step) is sent as
  an envelope without payload that decodes to NaN, so the average is non-finite on *every*
  rank and every rank's scaler skips the same step (the codec raised FloatingPointError
  before touching the residual or the random stream).
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Tuple

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


# ---------------------------------------------------------------- envelope
_ENVELOPE = struct.Struct("<2sBBIQ")   # magic, version, flags, step mod 2**32, payload bytes
ENVELOPE_BYTES = _ENVELOPE.size       # 16: payloads behind it stay 8-byte aligned
_MAGIC, _VERSION, FLAG_NONFINITE = b"HX", 1, 1


@dataclass
class Envelope:
    """One rank's contribution as received: its step and its payload (None: NaN/Inf input)."""

    step: int
    payload: Optional[torch.Tensor]
    device: torch.device = torch.device("cpu")

    def nan(self, numel: int) -> torch.Tensor:
        """What a non-finite contribution decodes to."""
        return torch.full((numel,), float("nan"), device=self.device)


def seal(payload: Optional[torch.Tensor], step: int, device: torch.device) -> torch.Tensor:
    """Envelope + payload, one uint8 tensor; ``payload=None`` sends the non-finite flag alone.

    >>> [e.step for e in unseal(torch.cat([seal(torch.ones(8, dtype=torch.uint8), 3, "cpu"),
    ...                                    seal(None, 3, "cpu")]))]
    [3, 3]
    """
    size = 0 if payload is None else payload.numel()
    head = _ENVELOPE.pack(_MAGIC, _VERSION, FLAG_NONFINITE if payload is None else 0, step % (1 << 32), size)
    head_t = torch.frombuffer(bytearray(head), dtype=torch.uint8).to(device)
    return head_t if payload is None else torch.cat([head_t, payload])


def unseal(blob: torch.Tensor) -> List[Envelope]:
    """Split concatenated sealed payloads (an allgather's or alltoall's output), in rank order."""
    out, pos, n = [], 0, blob.numel()
    while pos < n:
        if n - pos < ENVELOPE_BYTES:
            raise wire.WireFormatError(f"truncated exchange: {n - pos} bytes left where a {ENVELOPE_BYTES}-byte "
                                       "envelope was expected")
        magic, version, flags, step, size = _ENVELOPE.unpack(blob[pos:pos + ENVELOPE_BYTES].cpu().numpy().tobytes())
        if magic != _MAGIC or version != _VERSION or flags & ~FLAG_NONFINITE or size > n - pos - ENVELOPE_BYTES:
            raise wire.WireFormatError(f"corrupt exchange envelope at byte {pos}: run the same hvd-gradcomp "
                                       "version on every rank")
        start = pos + ENVELOPE_BYTES
        out.append(Envelope(step, None if flags & FLAG_NONFINITE else blob[start:start + size], blob.device))
        pos = start + size
    return out


def encode_or_flag(encode: Callable[[], Any]) -> Any:
    """``encode()``, or None when the gradient held NaN/Inf (the codec then changed nothing)."""
    try:
        return encode()
    except FloatingPointError:
        return None


class RankDivergenceError(RuntimeError):
    """Ranks exchanged gradients of different steps: one skipped or repeated a step."""


def check_steps(compressor: GradientCompressor, name: str, envelopes: List[Envelope]) -> None:
    """Raise :class:`RankDivergenceError` unless every envelope (index = rank) is from this rank's step."""
    if os.environ.get("HOROVOD_ELASTIC") == "1":
        return  # ranks that join an elastic job start at step 0; state.sync() realigns them
    mine = compressor.exchange_step % (1 << 32)
    steps = [e.step for e in envelopes]
    if any(s != mine for s in steps):
        where = ", ".join(f"rank {r} at step {s}" for r, s in enumerate(steps))
        raise RankDivergenceError(
            f"ranks exchanged different steps of {name!r} ({where}; this rank is at step {mine}): a rank "
            "skipped or repeated a step (caught an exception and went on, skipped step() or called "
            "synchronize() once more than the others). Every rank must run the same steps; stopping "
            "instead of averaging gradients of different steps.")


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


class SparseExchange:
    """Sparse gradients (``nn.Embedding(sparse=True)``): Horovod's own sparse allreduce (an
    allgather of indices and values), uncompressed, as ``hvd.DistributedOptimizer`` does."""

    def __init__(self, op: Any, process_set: Any) -> None:
        self.op, self.process_set = op, process_set

    def start(self, name: str, grad: torch.Tensor) -> Pending:
        grad = grad.coalesce()
        handle = _hvd().sparse_allreduce_async(grad, name=f"hvdgc.sparse.{name}", op=self.op,
                                               process_set=self.process_set)
        sent = grad.values().numel() * grad.element_size() + grad.indices().numel() * 8
        return Pending(name, grad.shape, grad.dtype, handle, bytes_sent=sent)

    def finish(self, p: Pending, out: torch.Tensor) -> None:
        out.zero_().add_(p.handle())  # sparse tensors have no set_(): zero, then add (as Horovod)
        p.finished = True


class JoinNotSupportedError(RuntimeError):
    """A rank called ``hvd.join()`` while others still exchange compressed gradients."""


def check_no_joined_ranks(process_set: Any) -> None:
    """Raise :class:`JoinNotSupportedError` if a rank of ``process_set`` is inside ``hvd.join()``.

    Compressed payloads travel by allgather and alltoall, which Horovod cannot run while a
    rank has joined (it crashes in its background thread). A joined rank adds zero to an
    allreduce, so one allreduce of a 1 per rank counts the ranks still training: a few
    bytes, once per step, before the step's first compressed exchange.
    """
    hvd = _hvd()
    size = process_set.size()
    if size == 1:
        return
    active = int(hvd.allreduce(torch.ones(1), op=hvd.Sum, name="hvdgc.active", process_set=process_set).item())
    if active < size:
        raise JoinNotSupportedError(
            f"{size - active} of {size} ranks called hvd.join() while this rank still trains: compressed "
            "gradients travel by allgather/alltoall, which Horovod does not support with joined ranks. "
            "Give every rank the same number of batches (e.g. drop the last uneven batches, or stop all "
            "ranks at the smallest count: hvd.allreduce(torch.tensor(len(loader)), op=hvd.Min)), or use "
            "compression=None / hvd.Compression.fp16 with hvd.join().")


class AllgatherExchange:
    """Sparse payloads: allgather, then every rank decodes all of them in rank order."""

    def __init__(self, compressor: GradientCompressor, op: Any, process_set: Any) -> None:
        self.compressor, self.op, self.process_set = compressor, op, process_set

    def start(self, name: str, grad: torch.Tensor) -> Pending:
        payload = encode_or_flag(lambda: self.compressor.compress_named(name, grad))
        sealed = seal(payload, self.compressor.exchange_step, grad.device)
        handle = _hvd().allgather_async(sealed, name=f"hvdgc.ag.{name}", process_set=self.process_set)
        return Pending(name, grad.shape, grad.dtype, handle, bytes_sent=sealed.numel())

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
        envelopes = unseal(_hvd().synchronize(p.handle))
        p.extra["parts"] = decode_envelopes(self.compressor, envelopes, self.process_set.size(), p.name,
                                            p.shape.numel())

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


def decode_envelopes(compressor: GradientCompressor, envelopes: List[Envelope], size: int, name: str,
                     numel: int) -> Parts:
    """:func:`decode_payloads` of sealed payloads: steps checked first, and a rank whose input
    was non-finite contributes NaN everywhere."""
    if len(envelopes) != size:
        raise RuntimeError(f"expected {size} payloads, got {len(envelopes)}: ranks disagree on this exchange")
    check_steps(compressor, name, envelopes)
    sent = [e.payload for e in envelopes if e.payload is not None]
    decoded = iter(decode_payloads(compressor, sent, len(sent), numel))
    return [(None, e.nan(numel)) if e.payload is None else next(decoded) for e in envelopes]


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
        payloads = encode_or_flag(lambda: self.compressor.compress_chunks(name, grad, bounds)) or [None] * size
        sealed = [seal(pl, self.compressor.exchange_step, grad.device) for pl in payloads]
        splits = torch.tensor([s.numel() for s in sealed], dtype=torch.int32)
        handle = _hvd().alltoall_async(torch.cat(sealed), splits=splits, name=f"hvdgc.a2a.{name}",
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
        rank, bounds = self.process_set.rank(), p.extra["bounds"]
        numel = bounds[rank + 1] - bounds[rank]
        parts = decode_envelopes(self.compressor, unseal(received), self.process_set.size(), p.name, numel)
        mine = sum_parts(parts, is_average(self.op), numel, p.dtype)
        payload = encode_or_flag(lambda: self.compressor.compress_named(f"{p.name}#reduced{rank}", mine))
        sealed = seal(payload, self.compressor.exchange_step, mine.device)
        p.handle = hvd.allgather_async(sealed, name=f"hvdgc.ag2.{p.name}", process_set=self.process_set)
        p.bytes_sent += sealed.numel()
        p.stage = 2

    def finish(self, p: Pending, out: torch.Tensor) -> None:
        if p.stage == 1:
            self.advance(p)
        envelopes = unseal(_hvd().synchronize(p.handle))
        bounds = p.extra["bounds"]
        if len(envelopes) != len(bounds) - 1:
            raise RuntimeError(f"{p.name}: got {len(envelopes)} chunks for {len(bounds) - 1} ranks")
        check_steps(self.compressor, p.name, envelopes)
        # A channels_last (or otherwise strided) gradient cannot be viewed flat: fill a flat
        # buffer in the tensor's logical order and copy it over.
        flat = out.view(-1) if out.is_contiguous() else torch.empty(out.numel(), dtype=out.dtype, device=out.device)
        for env, b, e in zip(envelopes, bounds, bounds[1:]):
            chunk = env.nan(e - b) if env.payload is None else self.compressor.decode(env.payload).reshape(-1)
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

