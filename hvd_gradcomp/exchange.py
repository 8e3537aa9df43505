"""Collectives: how each kind of payload crosses the network and comes back averaged.

The roads, chosen by :func:`choose_exchange` from the compressor's declared ``collective``
(:mod:`hvd_gradcomp.codecs`), never from its class:

* :class:`DenseExchange`: Horovod's allreduce of the (optionally fp16-cast) tensor. Used
  with no compressor, with Horovod's own compressors, and for small tensors.
* :class:`HalfExchange`: the tensors one of our compressors exempts from compression (small or
  ``exclude=``d), fused, as float16 with error feedback of the cast (``exempt="fp16"``).
* :class:`FusedAllgatherExchange`: sparse payloads (TopK, TopKQSGD), several tensors' per
  allgather (:class:`AllgatherExchange`: one each, the stock-Horovod road). Every rank
  decodes all payloads in rank order and averages, so all ranks end with identical gradients.
* :class:`RoundsExchange`: low-rank factors (PowerSGD) in two dependent allreduces of float32.
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

The fused allgather road carries the same two fields in each rank's group index instead (one
step per rank's part, one non-finite flag per tensor; see :class:`FusedAllgatherExchange`).
"""
from __future__ import annotations

import os
import struct
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Tuple

import torch

from . import codecs, wire
from .compressors import GradientCompressor
from .reduce import (Parts, add_part, chunk_bounds, decode_payloads, finite_at_indices, sparse_support,
                     sum_parts, sums_in_place)


@dataclass
class Pending:
    """One tensor in flight, with what its road and its callers note on it as it goes."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    handle: Any
    ctx: Any = None
    bytes_sent: int = 0
    stage: int = 1
    finished: bool = False
    # p.grad, final for this step (optimizer._start): a road may write the average there early
    out: Optional[torch.Tensor] = None
    # where the gradient lives (FusedAllgatherExchange.start, TimedExchange.start)
    device: torch.device = torch.device("cpu")
    # each rank's chunk of the tensor, as index bounds (ScatterReduceExchange.start)
    bounds: List[int] = field(default_factory=list)
    # its fusion group, a _Group (FusedAllgatherExchange.start); the group lets go of it once decoded
    group: Any = None
    # this rank's sparse part as its encoder carried it or _prepare decoded it (the allgather roads), taken by the decode
    own: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
    # every rank's decoded part, in rank order (the allgather roads' decode), taken by finish
    parts: Optional[Parts] = None
    # out zeroed before the wait (FusedAllgatherExchange.before_wait), taken by the decode
    zeroed: bool = False
    # out already holds this rank's own part (before_wait, two ranks), taken by the decode
    held: bool = False
    # out holds the average (FusedAllgatherExchange._decode)
    summed: bool = False
    # ... and the feedback policy received it (FusedAllgatherExchange._decode)
    received: bool = False
    # whether the average is finite, read at the parts' indices (the allgather roads); None: not known
    finite: Optional[torch.Tensor] = None
    # the fused float16 allreduce (optimizer._start_fused), finished by HalfExchange
    half: bool = False
    # codec seconds spent on it (TimedExchange; _charge for a fused group's decode run elsewhere)
    codec_s: float = 0.0
    # codec seconds spent inside its calls on other members of its group (_charge), not its own
    codec_elsewhere_s: float = 0.0
    # seconds blocked on the network for it (TimedExchange._wait)
    wait_s: float = 0.0
    # Auto's road for it, the payload bytes that road sends and the gradient's itemsize (auto.AutoExchange.start)
    road: Optional[str] = None
    payload_bytes: int = 0
    itemsize: int = 0


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


def encode_carried(compressor: GradientCompressor, name: str, grad: torch.Tensor
                   ) -> Tuple[Optional[torch.Tensor], Optional[Tuple[torch.Tensor, torch.Tensor]]]:
    """(payload, this rank's part as its encoder carried it) by
    :meth:`GradientCompressor.compress_carried`: the part only for a sparse payload, so that
    it need not be decoded here; (None, None) when the gradient held NaN/Inf."""
    payload, carried = encode_or_flag(lambda: compressor.compress_carried(name, grad)) or (None, None)
    return payload, carried if isinstance(carried, tuple) and _CARRIED else None


def encode_or_flag(encode: Callable[[], Any]) -> Any:
    """``encode()``, or None when the gradient held NaN/Inf (the codec then changed nothing)."""
    try:
        return encode()
    except FloatingPointError:
        return None


class RankDivergenceError(RuntimeError):
    """Ranks exchanged gradients of different steps: one skipped or repeated a step."""


def check_steps(compressor: GradientCompressor, name: str, steps: List[int]) -> None:
    """Raise :class:`RankDivergenceError` unless every rank's step (index = rank) is this rank's step."""
    if os.environ.get("HOROVOD_ELASTIC") == "1":
        return  # ranks that join an elastic job start at step 0; state.sync() realigns them
    mine = compressor.exchange_step % (1 << 32)
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


def allreducible(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in a dtype Horovod's allreduce takes: bfloat16 as float32 (exact; Horovod 0.28.1's
    Gloo and MPI collectives refuse bfloat16: "Tensor type torch.BFloat16Tensor is not supported"),
    anything else as it is. The caller casts the average back.

    >>> allreducible(torch.ones(2, dtype=torch.bfloat16)).dtype, allreducible(torch.ones(2)).dtype
    (torch.float32, torch.float32)
    """
    return tensor.float() if tensor.dtype == torch.bfloat16 else tensor


class DenseExchange:
    """Horovod allreduce, through a Horovod-style compressor (``hvd.Compression.none/fp16``)."""

    def __init__(self, op: Any, process_set: Any, compression: Any = None) -> None:
        self.op, self.process_set = op, process_set
        self.compression = compression if compression is not None else _hvd().Compression.none

    def start(self, name: str, grad: torch.Tensor) -> Pending:
        # Horovod's collectives take contiguous tensors only (a channels_last gradient is not).
        tensor, ctx = self.compression.compress(grad.contiguous())
        tensor = allreducible(tensor)   # finish() casts back as it copies into the output
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


class HalfExchange:
    """Tensors a compressor exempts from compression (``exempt="fp16"``, see
    :meth:`~hvd_gradcomp.compressors.GradientCompressor.sends_half`), fused: one Horovod
    allreduce (Sum) of their float16 cast, pre-divided by the number of ranks, so the float16
    sum is the average and cannot overflow; the cast's error feedback is the compressor's.

    A tensor holding NaN/Inf goes out as it is: its average is non-finite on every rank.
    """

    def __init__(self, compressor: GradientCompressor, op: Any, process_set: Any) -> None:
        self.compressor, self.op, self.process_set = compressor, op, process_set

    def start(self, name: str, named: List[Tuple[str, torch.Tensor]]) -> Pending:
        half, _ = self.compressor.encode_half(named, self.process_set.size())
        handle = _hvd().allreduce_async(half, name=f"hvdgc.half.{name}", op=_hvd().Sum,
                                        process_set=self.process_set)
        return Pending(name, half.shape, torch.float32, handle, bytes_sent=half.numel() * half.element_size())

    def finish(self, p: Pending, out: torch.Tensor) -> None:
        """``out``: a flat float32 tensor of the fused tensors' size."""
        out.copy_(_hvd().synchronize(p.handle))
        if not is_average(self.op):
            out.mul_(self.process_set.size())
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


def _join_error(size: int, active: int) -> JoinNotSupportedError:
    return JoinNotSupportedError(
        f"{size - active} of {size} ranks called hvd.join() while this rank still trains: compressed "
        "gradients travel by allgather/alltoall, which Horovod does not support with joined ranks. "
        "Give every rank the same number of batches (e.g. drop the last uneven batches, or stop all "
        "ranks at the smallest count: hvd.allreduce(torch.tensor(len(loader)), op=hvd.Min)), or use "
        "compression=None / hvd.Compression.fp16 with hvd.join().")


def check_no_joined_ranks(process_set: Any) -> None:
    """Raise :class:`JoinNotSupportedError` if a rank of ``process_set`` is inside ``hvd.join()``.

    Compressed payloads travel by allgather and alltoall, which Horovod cannot run while a
    rank has joined (it crashes in its background thread). A joined rank adds zero to an
    allreduce, so one allreduce of a 1 per rank counts the ranks still training. Blocking: the
    stock road's check; ``hvd_gradcomp.DistributedOptimizer`` uses :class:`JoinGuard`.
    """
    hvd = _hvd()
    size = process_set.size()
    if size == 1:
        return
    active = int(hvd.allreduce(torch.ones(1), op=hvd.Sum, name="hvdgc.active", process_set=process_set).item())
    if active < size:
        raise _join_error(size, active)


class JoinGuard:
    """:func:`check_no_joined_ranks` once per step, off the critical path.

    :meth:`begin` (at each compressed exchange's start; only the step's first does anything)
    starts the count of ranks still training as an asynchronous allreduce; :meth:`confirm`
    (just before an allgather or alltoall is handed to Horovod) reads it, by then usually long
    done, since the payload was encoded in between; :meth:`end_step` (at ``synchronize()``)
    arms it for the next step. A joined rank still gets :class:`JoinNotSupportedError` before
    any allgather is issued, never a hang or crash.
    """

    def __init__(self, process_set: Any) -> None:
        self.process_set = process_set
        self._handle: Any = None
        self._done = False   # this step's check is read (or not needed: one rank)

    def begin(self) -> None:
        if self._done or self._handle is not None:
            return
        if self.process_set.size() == 1:
            self._done = True
            return
        hvd = _hvd()
        self._handle = hvd.allreduce_async(torch.ones(1), op=hvd.Sum, name="hvdgc.active",
                                           process_set=self.process_set)

    def confirm(self) -> None:
        self.begin()
        if self._done:
            return
        active, self._handle, self._done = int(_hvd().synchronize(self._handle).item()), None, True
        size = self.process_set.size()
        if active < size:
            raise _join_error(size, active)

    def end_step(self) -> None:
        """The step is over: the next exchange checks again (a rank may join between steps)."""
        if self._handle is not None:
            self.confirm()   # started but no allgather followed: still read it
        self._done = False

    def reset(self) -> None:
        """Drop a check left in flight (an elastic reset abandoned the step)."""
        self._handle, self._done = None, False


def _begin(exchange: Any) -> None:
    if exchange.join_guard is not None:
        exchange.join_guard.begin()


def _confirm(exchange: Any) -> None:
    if exchange.join_guard is not None:
        exchange.join_guard.confirm()


class AllgatherExchange:
    """Sparse payloads: allgather, then every rank decodes all of them in rank order."""

    join_guard: Optional[JoinGuard] = None   # checked before the allgather (see choose_exchange)

    def __init__(self, compressor: GradientCompressor, op: Any, process_set: Any) -> None:
        self.compressor, self.op, self.process_set = compressor, op, process_set

    def start(self, name: str, grad: torch.Tensor) -> Pending:
        _begin(self)
        payload, own = encode_carried(self.compressor, name, grad)
        sealed = seal(payload, self.compressor.exchange_step, grad.device)
        _confirm(self)
        handle = _hvd().allgather_async(sealed, name=f"hvdgc.ag.{name}", process_set=self.process_set)
        p = Pending(name, grad.shape, grad.dtype, handle, bytes_sent=sealed.numel())
        if own is not None:   # this rank's part, not decoded again
            p.own = own
        return p

    def advance(self, p: Pending) -> None:
        pass

    def progress(self, p: Pending) -> None:
        """Decode now if the allgather is done, overlapping the rest of backward; never blocks.

        Decoded parts wait in ``p.parts``: ``p.grad`` keeps the local gradient until
        synchronize(), as with Horovod.
        """
        if p.parts is None and _hvd().poll(p.handle):
            self._decode(p)

    def _decode(self, p: Pending) -> None:
        envelopes = unseal(_hvd().synchronize(p.handle))
        own, p.own = p.own, None
        p.parts = decode_envelopes(self.compressor, envelopes, self.process_set.size(), p.name,
                                   p.shape.numel(), None if own is None else (self.process_set.rank(), own))

    def finish(self, p: Pending, out: torch.Tensor) -> None:
        if p.parts is None:
            self._decode(p)
        parts, p.parts = p.parts, None
        sum_parts(parts, is_average(self.op), out.numel(), p.dtype, out=out)
        self.compressor.received(p.name, out, sparse_support(parts))
        p.finite = finite_at_indices(self.compressor, parts, out, p.name)
        p.finished = True


def decode_envelopes(compressor: GradientCompressor, envelopes: List[Envelope], size: int, name: str,
                     numel: int, mine: Optional[Tuple[int, Tuple[torch.Tensor, torch.Tensor]]] = None) -> Parts:
    """:func:`decode_payloads` of sealed payloads: steps checked first, and a rank whose input
    was non-finite contributes NaN everywhere. ``mine``: (this rank, its part as its encoder
    carried it, see :meth:`GradientCompressor.compress_carried`), taken as is, not decoded."""
    if len(envelopes) != size:
        raise RuntimeError(f"expected {size} payloads, got {len(envelopes)}: ranks disagree on this exchange")
    check_steps(compressor, name, [e.step for e in envelopes])
    at, part = mine if mine is not None else (-1, None)
    sent = [e.payload for r, e in enumerate(envelopes) if e.payload is not None and r != at]
    decoded = iter(decode_payloads(compressor, sent, len(sent), numel))
    return [(None, e.nan(numel)) if e.payload is None else part if r == at else next(decoded)
            for r, e in enumerate(envelopes)]


def is_average(op: Any) -> bool:
    """True for ``hvd.Average``, False for ``hvd.Sum``; anything else is refused."""
    hvd = _hvd()
    if op == hvd.Average:
        return True
    if op == hvd.Sum:
        return False
    raise ValueError(f"unsupported reduction op {op}; use hvd.Average or hvd.Sum")


class ScatterReduceExchange:
    """QSGD's compressed allreduce: alltoall of quantised chunks, reduce, allgather."""

    join_guard: Optional[JoinGuard] = None
    two_stage = True

    def __init__(self, compressor: GradientCompressor, op: Any, process_set: Any) -> None:
        self.compressor, self.op, self.process_set = compressor, op, process_set

    def start(self, name: str, grad: torch.Tensor) -> Pending:
        _begin(self)
        size = self.process_set.size()
        bounds = chunk_bounds(grad.numel(), size)
        payloads = encode_or_flag(lambda: self.compressor.compress_chunks(name, grad, bounds)) or [None] * size
        sealed = [seal(pl, self.compressor.exchange_step, grad.device) for pl in payloads]
        splits = torch.tensor([s.numel() for s in sealed], dtype=torch.int32)
        _confirm(self)
        handle = _hvd().alltoall_async(torch.cat(sealed), splits=splits, name=f"hvdgc.a2a.{name}",
                                       process_set=self.process_set)
        # The chunk this rank keeps never leaves it: count only what goes to the others, so
        # that alltoall + allgather together send exactly one payload's worth per rank.
        sent = int(splits.sum()) - int(splits[self.process_set.rank()])
        return Pending(name, grad.shape, grad.dtype, handle, bytes_sent=sent, bounds=bounds)

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
        rank, bounds = self.process_set.rank(), p.bounds
        numel = bounds[rank + 1] - bounds[rank]
        parts = decode_envelopes(self.compressor, unseal(received), self.process_set.size(), p.name, numel)
        mine = sum_parts(parts, is_average(self.op), numel, p.dtype)
        payload = encode_or_flag(lambda: self.compressor.compress_named(f"{p.name}#reduced{rank}", mine, relay=True))
        sealed = seal(payload, self.compressor.exchange_step, mine.device)
        p.handle = hvd.allgather_async(sealed, name=f"hvdgc.ag2.{p.name}", process_set=self.process_set)
        p.bytes_sent += sealed.numel()
        p.stage = 2

    def finish(self, p: Pending, out: torch.Tensor) -> None:
        if p.stage == 1:
            self.advance(p)
        envelopes = unseal(_hvd().synchronize(p.handle))
        bounds = p.bounds
        if len(envelopes) != len(bounds) - 1:
            raise RuntimeError(f"{p.name}: got {len(envelopes)} chunks for {len(bounds) - 1} ranks")
        check_steps(self.compressor, p.name, [e.step for e in envelopes])
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
        self.compressor.received(p.name, out)
        p.finished = True


class RoundsExchange:
    """Low-rank factors in two dependent Horovod allreduces of float32 (PowerSGD: P, then Q; the
    compressor computes, see :mod:`hvd_gradcomp.powersgd`): ``start`` launches the first,
    ``advance`` (or ``progress``, once the first is done) hands its average to the compressor
    and launches the second, ``finish`` writes the approximation. A tensor the compressor does
    not factor (1-d, too small to gain) is allreduced as it is, in one round. A NaN/Inf
    gradient on any rank makes the average non-finite on every rank (the optimizer's check then
    undoes the step in the compressor). A rank inside ``hvd.join()`` would add zeros to the
    averages unnoticed: :class:`JoinGuard` refuses it first, as on the other compressed roads."""

    join_guard: Optional[JoinGuard] = None
    two_stage = True

    def __init__(self, compressor: GradientCompressor, op: Any, process_set: Any) -> None:
        self.compressor, self.op, self.process_set = compressor, op, process_set

    def start(self, name: str, grad: torch.Tensor) -> Pending:
        hvd = _hvd()
        _begin(self)   # hvd.join() is refused, as on the other compressed roads (see JoinGuard)
        if not self.compressor.compressible(tuple(grad.shape)):
            _confirm(self)
            tensor = allreducible(grad.contiguous())
            handle = hvd.allreduce_async(tensor, name=f"hvdgc.rounds.dense.{name}", op=self.op,
                                         process_set=self.process_set)
            return Pending(name, grad.shape, grad.dtype, handle, None, tensor.numel() * tensor.element_size(), stage=2)
        work = self.compressor.first_round(name, grad)
        _confirm(self)
        handle = hvd.allreduce_async(work.send, name=f"hvdgc.rounds.1.{name}", op=hvd.Average,
                                     process_set=self.process_set)
        return Pending(name, grad.shape, grad.dtype, handle, work, work.send.numel() * work.send.element_size())

    def progress(self, p: Pending) -> None:
        """Launch the second round as soon as the first is done; never blocks."""
        if p.stage == 1 and _hvd().poll(p.handle):
            self.advance(p)

    def advance(self, p: Pending) -> None:
        if p.stage != 1:
            return
        hvd = _hvd()
        second = self.compressor.second_round(p.ctx, hvd.synchronize(p.handle))
        p.handle = hvd.allreduce_async(second, name=f"hvdgc.rounds.2.{p.name}", op=hvd.Average,
                                       process_set=self.process_set)
        p.bytes_sent += second.numel() * second.element_size()
        p.stage = 2

    def finish(self, p: Pending, out: torch.Tensor) -> None:
        self.advance(p)
        result = _hvd().synchronize(p.handle)
        if p.ctx is None:
            out.copy_(result.view_as(out))
        else:
            scale = 1.0 if is_average(self.op) else float(self.process_set.size())
            self.compressor.finish_rounds(p.ctx, result, out, scale)
            self.compressor.received(p.name, out)
        p.finished = True


FUSE_MAGIC = 0x47434655  # "GCFU"
# FusedAllgatherExchange._prepare on (False: groups wait for their allgather untouched). Private:
# benchmarks/step_probe.py --ab and the tests compare both paths.
_PREPARE = True
# FusedAllgatherExchange.before_wait on (False: p.grad is zeroed after the wait). Private, as _PREPARE.
_PREZERO = True
# With two ranks, FusedAllgatherExchange.before_wait adds this rank's own part to p.grad before the
# wait (False: every part after it). Private, as _PREPARE.
_ADD_OWN = True
# This rank's sparse parts from what its encoder carried (False: decoded from its payload, as the
# other ranks decode it). Private, as _PREPARE.
_CARRIED = True
# Raw gradient bytes per fused allgather (2M float32 values: a ~40 kB TopKQSGD(1%, 8) payload).
# Small tensors still travel together, but the last group of backward (which nothing overlaps:
# its allgather and decode wait in synchronize()) stays small. 64 MB, Horovod's fusion
# buffer, left half of a 25M-parameter model's exchange to synchronize().
DEFAULT_FUSION_BYTES = 8 << 20


_FUSE_BASE = 5     # int64s before the per-member entries: magic, n, prefix bytes, part bytes, step
_FUSE_MEMBER = 4   # int64s per member: payload bytes, header bytes, flags (FLAG_NONFINITE), crc32 of its name


def _head_bytes(shape: torch.Size) -> int:
    return wire.padded(wire.HEADER_BYTES + 8 * len(shape))


def _name_id(name: str) -> int:
    return zlib.crc32(name.encode())


class _Group:
    """Sparse payloads that travel in one allgather, with the index that lets receivers split it.

    The index plays the role of the envelope (:func:`seal`) for the whole group: it carries
    the sender's exchange step once and a non-finite flag per member (a member whose gradient
    held NaN/Inf sends no payload and a zeroed header slot, and decodes to NaN).
    """

    def __init__(self, index: int) -> None:
        self.index = index
        self.members: List[Pending] = []
        self.payloads: List[Optional[torch.Tensor]] = []
        self.raw_bytes = 0
        self.handle: Any = None
        self.decoded = False
        self.prepared = False   # own payloads decoded (see FusedAllgatherExchange._prepare)

    def prefix_bytes(self) -> int:
        """Size of each rank's prefix: known to every rank from the tensors' shapes alone."""
        return 8 * (_FUSE_BASE + _FUSE_MEMBER * len(self.members)) + sum(_head_bytes(p.shape) for p in self.members)

    def blob(self, step: int, device: torch.device) -> torch.Tensor:
        """prefix (int64: magic, n, prefix bytes, part bytes, step, then (payload bytes, header
        bytes, flags, name id) per member, then a copy of each payload's header) + the payloads."""
        heads = [torch.zeros(_head_bytes(p.shape), dtype=torch.uint8, device=device) if pl is None
                 else pl[:_head_bytes(p.shape)] for p, pl in zip(self.members, self.payloads)]
        sent = [pl for pl in self.payloads if pl is not None]
        prefix = self.prefix_bytes()
        index = [FUSE_MAGIC, len(self.members), prefix, prefix + sum(pl.numel() for pl in sent), step % (1 << 32)]
        for p, pl, h in zip(self.members, self.payloads, heads):
            index += [0 if pl is None else pl.numel(), h.numel(), FLAG_NONFINITE if pl is None else 0, _name_id(p.name)]
        index_bytes = torch.tensor(index, dtype=torch.int64).view(torch.uint8).to(device)
        return torch.cat([index_bytes, *heads, *sent])


class FusedAllgatherExchange:
    """Sparse payloads fused into fewer, larger allgathers, as Horovod's tensor fusion does for
    allreduce: each allgather pays Horovod's negotiation once for many tensors.

    Payloads are encoded as each gradient is ready (the hook) and join the open group; the
    group is launched once it holds ``fusion_bytes`` of raw gradient, or once it holds as many
    tensors as the last step had (so the last group of backward does not wait for
    ``synchronize()``), or at ``synchronize()``. These rules depend only on tensor sizes and
    counts, the same on every rank; a rank whose group holds other tensors (a different
    backward order) fails with an error naming them. Each rank's part of the allgather starts
    with an index (sizes, the sender's exchange step, a non-finite flag per tensor and a copy of
    every payload header: the group's envelope, see :class:`_Group`), read to the host in one
    copy per rank: no header is read twice. Completed groups are decoded in ``progress()`` while
    backward goes on; every rank decodes the same bytes in rank order, so gradients are
    bit-identical everywhere. When the caller names the output (``p.out``, the
    parameter's ``.grad``, whose gradient is final once its exchange started) the average is
    written there as soon as the group is decoded, as Horovod's in-place allreduce writes
    ``p.grad`` from its background thread, and handed to the feedback policy's ``received``
    (unless the policy moves parameters, which must wait for ``synchronize()``):
    ``synchronize()`` is then left with the last groups of backward: their outputs are zeroed
    while the allgather travels (:meth:`before_wait`), and only the other ranks' payloads are
    decoded, this rank's parts being known from its encoding (:meth:`_prepare`).
    """

    join_guard: Optional[JoinGuard] = None

    def __init__(self, compressor: GradientCompressor, op: Any, process_set: Any,
                 fusion_bytes: int = DEFAULT_FUSION_BYTES) -> None:
        self.compressor, self.op, self.process_set = compressor, op, process_set
        self.fusion_bytes = fusion_bytes
        self._open: Optional[_Group] = None
        self._groups_this_step = 0
        self._started = 0
        self._expected: Optional[int] = None

    def start(self, name: str, grad: torch.Tensor) -> Pending:
        _begin(self)
        payload, own = encode_carried(self.compressor, name, grad)
        if self._open is None:
            self._open = _Group(self._groups_this_step)
            self._groups_this_step += 1
        g = self._open
        p = Pending(name, grad.shape, grad.dtype, None, bytes_sent=0 if payload is None else payload.numel(),
                    group=g, device=grad.device)
        if own is not None:   # this rank's part, not decoded from its payload (see _prepare)
            p.own = own
        g.members.append(p)
        g.payloads.append(payload)
        g.raw_bytes += grad.numel() * grad.element_size()
        self._started += 1
        if g.raw_bytes >= self.fusion_bytes or self._started == self._expected:
            self._launch(g)
        return p

    def _launch(self, g: _Group) -> None:
        # In name order, not arrival order: a tensor without gradient on some rank (a layer used
        # on rank 0 only) arrives there at synchronize(), elsewhere during backward.
        order = sorted(range(len(g.members)), key=lambda i: g.members[i].name)
        g.members, g.payloads = [g.members[i] for i in order], [g.payloads[i] for i in order]
        blob = g.blob(self.compressor.exchange_step, g.members[0].device)
        g.members[0].bytes_sent += g.prefix_bytes()  # the index travels once per group
        _confirm(self)
        g.handle = _hvd().allgather_async(blob, name=f"hvdgc.fag.{g.index}", process_set=self.process_set)
        for m in g.members:
            m.handle = g.handle
        if self._open is g:
            self._open = None

    def progress(self, p: Pending) -> None:
        """Decode the whole group as soon as its allgather is done, else prepare it; never blocks."""
        g = p.group
        if g.handle is None or g.decoded:
            return
        if _hvd().poll(g.handle):
            self._decode(g, p)
        elif not g.prepared and _PREPARE:
            self._prepare(g, p)

    def _prepare(self, g: _Group, caller: Pending) -> None:
        """While the allgather travels, decode this rank's own payloads that its encoder did not
        say the content of (``p.own``, from :meth:`GradientCompressor.compress_carried`:
        a sparse payload's indices and values, the same bits the other ranks decode, so every
        rank sums the same parts and gradients stay bit-identical). Only the other ranks' parts
        are then left once the allgather is done: this takes 1/P of the last group of backward's
        decode (whose allgather nothing else overlaps) out of ``synchronize()``.

        Only payloads that sit on the CPU: elsewhere reading their headers would be a
        device-to-host sync in the middle of backward, so they are decoded with the others, from
        the header copies in the group's index. (``p.grad`` is not touched before the average
        is ready: between backward and ``step()`` it holds the local gradient or the average, as
        with Horovod, never a zeroed or partial sum.)"""
        g.prepared = True
        for member, payload in zip(g.members, g.payloads):
            if payload is not None and payload.device.type == "cpu" and member.own is None:
                t0 = time.perf_counter()
                # host bytes already: parsed here once, and not again from the group's index
                h = wire.parse_header(payload[:_head_bytes(member.shape)].numpy().tobytes(), payload.numel())
                member.own = self.compressor.decode_parts(payload, h)
                _charge(member, caller, time.perf_counter() - t0)
        g.payloads = []

    def before_wait(self, p: Pending) -> None:
        """``synchronize()`` is about to block on ``p``'s group: zero its members' outputs now.

        The scatter of a sparse average into ``p.grad`` starts with a pass that zeroes it (~1.7 ms
        for a 4M-value gradient on CPU, the first layer's, whose group is the last of backward
        and left to ``synchronize()``). Done here, that pass overlaps the allgather still
        in flight and a peer still in backward, instead of following them. Only here: no user code
        runs inside ``synchronize()``, so ``p.grad`` is never seen zeroed (see :meth:`_prepare`).
        With two ranks this rank's own sparse part is added there too (the second pass of the
        scatter, ~0.6-0.8 ms for that gradient, cache-cold), so that only the other rank's part is
        left after the wait. That is exact with two ranks alone: every index holds zero plus at
        most one value from each rank (a part names each index once), and ``x + y == y + x`` in
        IEEE arithmetic, so rank 0's ``(0 + a) + b`` and rank 1's ``(0 + b) + a`` are the same
        bits. With three ranks or more the order of the additions would differ between ranks,
        and so would the last bit of the average: there the parts are summed in rank order,
        after the wait, as before.

        If the exchange then fails (ranks disagree), ``p.grad`` is left zeroed or holding this
        rank's part, not the local gradient: the error stops the step either way.
        """
        g = p.group
        if g.handle is None or g.decoded or not _PREZERO:
            return
        add_own = _ADD_OWN and self.process_set.size() == 2
        for m in g.members:
            out = m.out
            if out is not None and not m.zeroed and sums_in_place(out, m.dtype):
                out.zero_()
                m.zeroed = True
                if add_own and m.own is not None:   # scaled as sum_parts scales it
                    add_part(out, m.own, 0.5 if is_average(self.op) else 1.0)
                    m.held = True

    def advance(self, p: Pending) -> None:
        """At synchronize(): launch the group still open; the step's tensor count is learnt."""
        if self._started:
            self._expected, self._started, self._groups_this_step = self._started, 0, 0
        g = p.group
        if g.handle is None:
            self._launch(g)

    def _decode(self, g: _Group, caller: Pending) -> None:
        """Decode every member's payloads. The seconds spent on another member are charged to it
        (``codec_s``) and noted as ``codec_elsewhere_s`` on ``caller``, so that
        :class:`TimedExchange` charges each tensor its own decode."""
        blob = _hvd().synchronize(g.handle)
        names = [m.name for m in g.members]
        n, prefix = len(g.members), g.prefix_bytes()
        ranks = self._split_ranks(blob, names, prefix)
        check_steps(self.compressor, ", ".join(names), [index[4] for _, _, index in ranks])
        spent = [0.0] * n
        parts: List[Parts] = [[] for _ in range(n)]
        me = self.process_set.rank()
        for rank, (pos, raw, index) in enumerate(ranks):
            if index[1] != n or index[2] != prefix:
                raise RuntimeError(f"fused allgather of {names}: rank {rank} sent a group of {index[1]} tensors "
                                   f"(index {index[:3]}): ranks disagree on the tensors fused together (a "
                                   "different backward order?)")
            head_pos, body = 8 * (_FUSE_BASE + _FUSE_MEMBER * n), pos + prefix
            for i, member in enumerate(g.members):
                at = _FUSE_BASE + _FUSE_MEMBER * i
                size_i, head_i, flags_i, id_i = index[at:at + _FUSE_MEMBER]
                if id_i != _name_id(member.name):
                    raise RuntimeError(f"fused allgather of {names}: rank {rank} sent another tensor where this rank "
                                       f"has {member.name!r}: ranks disagree on the tensors fused together (a layer "
                                       "used on some ranks only, whose gradient joins another fusion group there?)")
                t0 = time.perf_counter()
                if flags_i & FLAG_NONFINITE:
                    parts[i].append((None, Envelope(index[4], None, blob.device).nan(member.shape.numel())))
                elif rank == me and member.own is not None:
                    parts[i].append(member.own)   # see _prepare
                    member.own = None
                else:
                    h = wire.parse_header(raw[head_pos:head_pos + head_i], size_i)
                    if h.shape != tuple(member.shape):
                        raise RuntimeError(f"{member.name}: rank {rank} sent a payload of shape {h.shape}, expected "
                                           f"{tuple(member.shape)}: ranks disagree on the tensors fused together")
                    parts[i].append(self.compressor.decode_parts(blob[body:body + size_i], h))
                spent[i] += time.perf_counter() - t0
                head_pos, body = head_pos + head_i, body + size_i
        g.decoded = True
        g.payloads = []
        for i, member in enumerate(g.members):
            member.parts = parts[i]
            out = member.out
            if out is not None:   # scatter now, not in synchronize() (see finish)
                t0 = time.perf_counter()
                zeroed, held, member.zeroed, member.held = member.zeroed, member.held, False, False
                sum_parts(parts[i], is_average(self.op), out.numel(), member.dtype, out=out,
                          zeroed=zeroed, held=me if held else None)
                member.summed = True
                if not self.compressor.feedback.moves_parameters:
                    # The policy's rewrite too (momentum correction: a clone and two passes over the
                    # gradient), while backward goes on; not a policy that moves the parameter,
                    # which autograd may still need as it was.
                    self.compressor.received(member.name, out, sparse_support(parts[i]))
                    member.received = True
                    # its finiteness too, read where the average can be nonzero: one thing less
                    # for synchronize() to do (~0.1 ms a tensor on CPU)
                    member.finite = finite_at_indices(self.compressor, parts[i], out, member.name)
                spent[i] += time.perf_counter() - t0
            _charge(member, caller, spent[i])
        # Each member points at its group (p.group); the group lets go of its members now,
        # else the pair is a reference cycle holding every member's p.grad (p.out) until
        # Python's cyclic GC runs: with zero_grad(set_to_none=True) several steps of gradients
        # would stay alive, and every new step's gradients fault in fresh pages.
        g.members = []

    def _split_ranks(self, blob: torch.Tensor, names: List[str], prefix: int) -> List[Tuple[int, bytes, List[int]]]:
        """Each rank's part of a fused allgather as (start, its prefix bytes on the host, its index):
        the one device-to-host copy per rank. Only the fixed fields are checked here, so that the
        steps are compared (:func:`check_steps`) before the group's make-up is."""
        out, pos, words = [], 0, _FUSE_BASE + _FUSE_MEMBER * len(names)
        for rank in range(self.process_set.size()):
            raw = blob[pos:pos + prefix].cpu().numpy().tobytes()
            have = min(len(raw) // 8, words)
            index = torch.frombuffer(bytearray(raw[:8 * have]), dtype=torch.int64).tolist() if have else []
            if have < _FUSE_BASE or index[0] != FUSE_MAGIC or not 8 * _FUSE_BASE <= index[3] <= blob.numel() - pos:
                raise RuntimeError(f"fused allgather of {names}: rank {rank}'s part is truncated or corrupt: ranks "
                                   "disagree on this exchange (run the same hvd-gradcomp version on every rank)")
            out.append((pos, raw, index))
            pos += index[3]
        if pos != blob.numel():
            raise RuntimeError(f"fused allgather of {names}: {blob.numel() - pos} bytes left after "
                               f"{self.process_set.size()} ranks' parts")
        return out

    def finish(self, p: Pending, out: torch.Tensor) -> None:
        g = p.group
        if g.handle is None:
            self.advance(p)
        if not g.decoded:
            self._decode(g, p)
        parts, early, summed, received = p.parts, p.out, p.summed, p.received
        p.parts, p.summed, p.received = None, False, False
        if received:  # summed and rewritten by the policy in _decode, exactly once per step
            if early is not out:
                out.copy_(early.view_as(out))
        else:
            if not (summed and early is out):
                sum_parts(parts, is_average(self.op), out.numel(), p.dtype, out=out)
            # the feedback policy sees the average
            self.compressor.received(p.name, out, sparse_support(parts))
        if not received:   # else _decode read it, after the same sum and the same received
            p.finite = finite_at_indices(self.compressor, parts, out, p.name)
        p.finished = True


def _charge(member: Pending, caller: Pending, seconds: float) -> None:
    """Charge codec seconds spent on ``member`` while serving ``caller`` (a group's decode runs
    inside one member's call), so that :class:`TimedExchange` charges each tensor its own."""
    if member is not caller:
        member.codec_s += seconds
        caller.codec_elsewhere_s += seconds


def wait_done(handle: Any) -> float:
    """Block until a Horovod handle is done without consuming it; returns the seconds waited."""
    hvd = _hvd()
    t0 = time.perf_counter()
    while not hvd.poll(handle):
        time.sleep(5e-5)
    return time.perf_counter() - t0


class TimedExchange:
    """Any exchange, with its codec seconds (encode, decode, reduce) apart from its waits.

    Totals: ``codec_s`` (all codec work), ``codec_sync_s`` (the part done inside
    ``synchronize()``: advance/finish) and ``wait_s`` (time blocked on the network there).
    Each pending also carries its own in ``p.codec_s`` / ``p.wait_s``.
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.codec_s = self.codec_sync_s = self.wait_s = 0.0
        # GPU kernels run asynchronously: timing them means synchronising the device, which
        # costs overlap, so only when a caller needs the figures (gc.Auto, while it measures).
        self.device_sync = False

    def _clock(self, device: torch.device) -> float:
        if self.device_sync and device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    def _timed(self, p: Pending, sync: bool, fn: Any, *args: Any) -> Any:
        device = p.device
        t0 = self._clock(device)
        out = fn(*args)
        dt = self._clock(device) - t0
        p.codec_s, p.codec_elsewhere_s = p.codec_s + dt - p.codec_elsewhere_s, 0.0
        self.codec_s += dt
        if sync:
            self.codec_sync_s += dt
        return out

    def _wait(self, p: Pending) -> None:
        dt = wait_done(p.handle)
        p.wait_s += dt
        self.wait_s += dt

    def start(self, name: str, grad: torch.Tensor) -> Pending:
        t0 = self._clock(grad.device)
        p = self.inner.start(name, grad)
        p.codec_s = self._clock(grad.device) - t0
        p.device = grad.device
        self.codec_s += p.codec_s
        return p

    def progress(self, p: Pending) -> None:
        self._timed(p, False, self.inner.progress, p)

    def advance(self, p: Pending) -> None:
        if getattr(self.inner, "two_stage", False) and p.stage == 1:
            self._wait(p)  # the first collective (QSGD's alltoall, PowerSGD's P), before the second
        self._timed(p, True, self.inner.advance, p)  # launches a fused group still open

    def finish(self, p: Pending, out: torch.Tensor) -> None:
        self.advance(p)
        if p.handle is not None and p.parts is None:
            before = getattr(self.inner, "before_wait", None)
            if before is not None:   # work that needs no payload, overlapping the wait
                self._timed(p, True, before, p)
            self._wait(p)
        self._timed(p, True, self.inner.finish, p, out)


def choose_exchange(compression: Any, op: Any, process_set: Any, join_guard: Optional[JoinGuard] = None):
    """The exchange for a compression setting (None / Horovod compressor / ours / a policy such
    as :class:`hvd_gradcomp.Auto`, which builds its own with ``make_exchange``), timed: its
    ``codec_s``, ``codec_sync_s`` and ``wait_s`` say where the exchange time went.
    ``join_guard``: checked before every allgather/alltoall (see :class:`JoinGuard`)."""
    make = getattr(compression, "make_exchange", None)
    if make is not None:
        exchange = make(op, process_set)   # times itself (codec_s, codec_sync_s, wait_s)
    elif codecs.collective_of(compression) == codecs.COMPRESSED_ALLREDUCE:
        exchange = TimedExchange(ScatterReduceExchange(compression, op, process_set))
    elif codecs.collective_of(compression) == codecs.ALLGATHER:
        exchange = TimedExchange(FusedAllgatherExchange(compression, op, process_set))
    elif codecs.collective_of(compression) == codecs.ALLREDUCE_ROUNDS:
        exchange = TimedExchange(RoundsExchange(compression, op, process_set))
    elif isinstance(compression, GradientCompressor):
        raise ValueError(f"{type(compression).__name__} declares collective={compression.collective!r}, which "
                         f"this exchange cannot carry (known: {', '.join(codecs.COLLECTIVES)}; see hvd_gradcomp.codecs)")
    else:
        exchange = TimedExchange(DenseExchange(op, process_set, compression))
    for road in _roads(exchange):
        if hasattr(road, "join_guard"):
            road.join_guard = join_guard
    return exchange


def _roads(exchange: Any) -> List[Any]:
    """The exchanges doing the work under wrappers (:class:`TimedExchange`, Auto's router)."""
    if hasattr(exchange, "exchanges"):
        return [r for e in exchange.exchanges.values() for r in _roads(e)]
    return _roads(exchange.inner) if hasattr(exchange, "inner") else [exchange]
