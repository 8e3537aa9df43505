"""Collectives: how each kind of payload crosses the network and comes back averaged.

The roads, chosen by :func:`choose_exchange` from the compressor's declared ``collective``
(:mod:`hvd_gradcomp.codecs`), never from its class:

* :class:`DenseExchange`: Horovod's allreduce of the (optionally fp16-cast) tensor. Used
  with no compressor, with Horovod's own compressors, and for small tensors.
* :class:`HalfExchange`: the tensors one of our compressors exempts from compression (small or
  ``exclude=``d), fused, as float16 with error feedback of the cast (``exempt="fp16"``); what goes
  as float16 and how it comes back is :func:`~hvd_gradcomp.collectives.rounds.dense_fallback`'s.
* :class:`FusedAllgatherExchange`: sparse payloads (TopK, TopKQSGD), several tensors' per
  allgather (:class:`AllgatherExchange`: one each, the stock-Horovod road, driving
  :func:`~hvd_gradcomp.collectives.rounds.sparse_allgather`). Every rank
  decodes all payloads in rank order and averages, so all ranks end with identical gradients.
* :class:`RoundsExchange`: low-rank factors (PowerSGD) in two dependent allreduces of float32.
* :class:`ScatterReduceExchange`: QSGD's compressed allreduce. Each rank quantises its
  gradient in P chunks; an alltoall sends chunk i to rank i; rank i decodes and sums its
  chunk, re-quantises it (with its own error feedback), and an allgather returns every
  chunk. The bytes a rank sends stay about (1 + 1/P) x its payload, whatever P is.

Each exchange has two phases: ``start`` (at the gradient hook, overlapping backward) and
``finish`` (in ``synchronize``); the QSGD road has a middle phase ``advance`` that launches
the allgather once the alltoall is done. ``bytes_sent`` counts the bytes handed to Horovod.

Every payload travels behind an envelope, the tensor in flight is a :class:`Pending`: see
:mod:`hvd_gradcomp.collectives.inflight`; the fused allgather is in :mod:`hvd_gradcomp.collectives.fused`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, List, Optional

import torch

from .. import codecs
from ..codecs.compressor import GradientCompressor
from .fused import FusedAllgatherExchange, encode_carried
from .inflight import ENVELOPE_BYTES, Envelope, Pending, _begin, _confirm, _hvd, check_steps, is_average, seal, unseal
from .inflight import RankDivergenceError as RankDivergenceError  # raised on every road; documented here
from .reduce import finite_at_indices, sparse_support
from .rounds import Algorithm, Allreduce, Payloads, compressed_allreduce, low_rank_rounds, sparse_allgather
from .rounds import finish as finish_rounds
from .transport import HorovodTransport


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
        out.copy_(self.result(p).view_as(out))

    def result(self, p: Pending) -> torch.Tensor:
        """The average (or sum, as ``op`` says), decompressed, once done."""
        p.finished = True
        return self.compression.decompress(_hvd().synchronize(p.handle), p.ctx)


class HalfExchange:
    """The float16 request of :func:`~hvd_gradcomp.collectives.rounds.dense_fallback` (the tensors a
    compressor exempts from compression, ``exempt="fp16"``, fused and divided by the ranks first):
    one Horovod allreduce (Sum), so the float16 sum is the average and cannot overflow.

    A tensor holding NaN/Inf goes out as it is: its average is non-finite on every rank.
    """

    def __init__(self, process_set: Any) -> None:
        self.process_set = process_set

    def start(self, name: str, half: torch.Tensor) -> Pending:
        handle = _hvd().allreduce_async(half, name=f"hvdgc.half.{name}", op=_hvd().Sum, process_set=self.process_set)
        return Pending(name, half.shape, half.dtype, handle, bytes_sent=half.numel() * half.element_size())

    def result(self, p: Pending) -> torch.Tensor:
        """The sum (float16), once done."""
        p.finished = True
        return _hvd().synchronize(p.handle)


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


class AllgatherExchange:
    """The sparse allgather (:func:`~hvd_gradcomp.collectives.rounds.sparse_allgather`) of one tensor
    on Horovod, its payload behind an envelope (the stock-Horovod road): ``start`` encodes and
    launches the allgather, ``finish`` decodes every rank's payload in rank order and sums."""

    join_guard: Optional[JoinGuard] = None   # checked before the allgather (see choose_exchange)

    def __init__(self, compressor: GradientCompressor, op: Any, process_set: Any) -> None:
        self.compressor, self.op, self.process_set = compressor, op, process_set

    def start(self, name: str, grad: torch.Tensor) -> Pending:
        _begin(self)
        outs = [grad]   # where the average goes: set in finish()
        run = sparse_allgather(self.compressor, [(name, grad)], outs, self.process_set.size(),
                               self.process_set.rank(), is_average(self.op), [encode_carried(self.compressor, name, grad)])
        sealed = seal(next(run).payloads[0], self.compressor.exchange_step, grad.device)
        _confirm(self)
        handle = _hvd().allgather_async(sealed, name=f"hvdgc.ag.{name}", process_set=self.process_set)
        return Pending(name, grad.shape, grad.dtype, handle, _Rounds(run, outs), bytes_sent=sealed.numel(),
                       framing_bytes=ENVELOPE_BYTES)

    def advance(self, p: Pending) -> None:
        pass

    def progress(self, p: Pending) -> None:
        """Nothing early: this road's caller (Horovod's ``decompress``) finishes each tensor at once."""

    def finish(self, p: Pending, out: torch.Tensor) -> None:
        payloads = payloads_of(self.compressor, unseal(_hvd().synchronize(p.handle)), self.process_set.size(), p.name)
        p.ctx.out[0] = out
        parts = finish_rounds(p.ctx.run, payloads)[0]
        self.compressor.received(p.name, out, sparse_support(parts))
        p.finite = finite_at_indices(self.compressor, parts, out, p.name)
        p.finished = True


def payloads_of(compressor: GradientCompressor, envelopes: List[Envelope], size: int, name: str) -> Payloads:
    """The payloads of one collective's envelopes, one segment per rank (``None``: that rank's
    input held NaN/Inf), once every rank is seen at this rank's step (:func:`check_steps`)."""
    if len(envelopes) != size:
        raise RuntimeError(f"expected {size} payloads, got {len(envelopes)}: ranks disagree on this exchange")
    check_steps(compressor, name, [e.step for e in envelopes])
    return [[e.payload] for e in envelopes]


class _TwoCollectives:
    """A road of two dependent collectives, the second launched by ``advance`` once the first is done."""

    join_guard: Optional[JoinGuard] = None   # checked before the first (see choose_exchange)
    two_stage = True

    def progress(self, p: Pending) -> None:
        """Launch the second collective as soon as the first is done (``p.grad`` is untouched); never blocks."""
        if p.stage == 1 and _hvd().poll(p.handle):
            self.advance(p)

    def advance(self, p: Pending) -> None:
        raise NotImplementedError


class ScatterReduceExchange(_TwoCollectives):
    """QSGD's compressed allreduce (:func:`~hvd_gradcomp.collectives.rounds.compressed_allreduce`) on Horovod:
    its :class:`~hvd_gradcomp.collectives.rounds.Scatter` as an alltoall, its
    :class:`~hvd_gradcomp.collectives.rounds.Gather` as an allgather, each payload behind its envelope."""

    def __init__(self, compressor: GradientCompressor, op: Any, process_set: Any) -> None:
        self.compressor, self.op, self.process_set = compressor, op, process_set

    def start(self, name: str, grad: torch.Tensor) -> Pending:
        _begin(self)
        size, rank = self.process_set.size(), self.process_set.rank()
        outs = [grad]   # where the average goes: set in finish(), written by the algorithm's last step
        run = compressed_allreduce(self.compressor, [(name, grad)], outs, size, rank, is_average(self.op))
        sealed = [seal(pls[0], self.compressor.exchange_step, grad.device) for pls in next(run).payloads]
        splits = torch.tensor([s.numel() for s in sealed], dtype=torch.int32)
        _confirm(self)
        handle = _hvd().alltoall_async(torch.cat(sealed), splits=splits, name=f"hvdgc.a2a.{name}",
                                       process_set=self.process_set)
        # The chunk this rank keeps never leaves it: count only what goes to the others, so
        # that alltoall + allgather together send exactly one payload's worth per rank.
        sent = int(splits.sum()) - int(splits[rank])
        return Pending(name, grad.shape, grad.dtype, handle, _Rounds(run, outs), bytes_sent=sent,
                       framing_bytes=ENVELOPE_BYTES * (size - 1))

    def advance(self, p: Pending) -> None:
        """Stage 2: hand every rank's payload of my chunk to the algorithm, which reduces and
        re-quantises it; start the allgather of the result."""
        if p.stage != 1:
            return
        hvd = _hvd()
        received, _ = hvd.synchronize(p.handle)
        payloads = payloads_of(self.compressor, unseal(received), self.process_set.size(), p.name)
        gather = p.ctx.run.send(payloads)
        sealed = seal(gather.payloads[0], self.compressor.exchange_step, received.device)
        p.handle = hvd.allgather_async(sealed, name=f"hvdgc.ag2.{p.name}", process_set=self.process_set)
        p.bytes_sent += sealed.numel()
        p.framing_bytes += ENVELOPE_BYTES
        p.stage = 2

    def finish(self, p: Pending, out: torch.Tensor) -> None:
        if p.stage == 1:
            self.advance(p)
        payloads = payloads_of(self.compressor, unseal(_hvd().synchronize(p.handle)), self.process_set.size(), p.name)
        # A channels_last (or otherwise strided) gradient cannot be viewed flat: fill a flat
        # buffer in the tensor's logical order and copy it over.
        flat = out.view(-1) if out.is_contiguous() else torch.empty(out.numel(), dtype=out.dtype, device=out.device)
        p.ctx.out[0] = flat
        finish_rounds(p.ctx.run, payloads)
        if not out.is_contiguous():
            out.copy_(flat.view(out.shape))
        self.compressor.received(p.name, out)
        p.finished = True


class RoundsExchange(_TwoCollectives):
    """Low-rank factors in two dependent Horovod allreduces of float32 (PowerSGD: P, then Q; the
    compressor computes, see :mod:`hvd_gradcomp.codecs.powersgd`): ``start`` launches the first,
    ``advance`` (or ``progress``, once the first is done) hands its average to the compressor
    and launches the second, ``finish`` writes the approximation. A tensor the compressor does
    not factor (1-d, too small to gain) is allreduced as it is, in one round. A NaN/Inf
    gradient on any rank makes the average non-finite on every rank (the optimizer's check then
    undoes the step in the compressor). A rank inside ``hvd.join()`` would add zeros to the
    averages unnoticed: :class:`JoinGuard` refuses it first, as on the other compressed roads."""

    def __init__(self, compressor: GradientCompressor, op: Any, process_set: Any) -> None:
        self.compressor, self.op, self.process_set = compressor, op, process_set
        self.transport = HorovodTransport(process_set)

    def start(self, name: str, grad: torch.Tensor) -> Pending:
        _begin(self)   # hvd.join() is refused, as on the other compressed roads (see JoinGuard)
        if not self.compressor.compressible(tuple(grad.shape)):
            _confirm(self)
            tensor = allreducible(grad.contiguous())
            work = self.transport.allreduce(tensor, f"hvdgc.rounds.dense.{name}", is_average(self.op))
            return Pending(name, grad.shape, grad.dtype, work.handle, work,
                           tensor.numel() * tensor.element_size(), stage=2)
        scale = 1.0 if is_average(self.op) else float(self.process_set.size())
        outs = [grad]   # where the approximation goes: set in finish(), read by the algorithm's last step
        p = Pending(name, grad.shape, grad.dtype, None, _Rounds(low_rank_rounds(self.compressor, [(name, grad)],
                                                                                outs, scale), outs))
        request = next(p.ctx.run)
        _confirm(self)
        self._issue(p, request)
        return p

    def _issue(self, p: Pending, request: Allreduce) -> None:
        """Hand the algorithm's next request to Horovod; the average comes back in ``advance``/``finish``."""
        work = self.transport.allreduce(request.tensor, f"hvdgc.rounds.{request.tag}.{p.name}", request.average)
        p.ctx.work, p.handle = work, work.handle
        p.bytes_sent += request.tensor.numel() * request.tensor.element_size()

    def advance(self, p: Pending) -> None:
        if p.stage != 1:
            return
        self._issue(p, p.ctx.run.send(p.ctx.work.wait()))
        p.stage = 2

    def finish(self, p: Pending, out: torch.Tensor) -> None:
        self.advance(p)
        if not isinstance(p.ctx, _Rounds):   # sent as it is
            out.copy_(p.ctx.wait().view_as(out))
        else:
            p.ctx.out[0] = out
            finish_rounds(p.ctx.run, p.ctx.work.wait())
            self.compressor.received(p.name, out)
        p.finished = True


@dataclass
class _Rounds:
    """A tensor's exchange algorithm (:mod:`hvd_gradcomp.collectives.rounds`) between its collectives."""

    run: Algorithm
    out: List[torch.Tensor]
    work: Any = None


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
