"""Collectives: how each kind of payload crosses the network and comes back averaged.

The exchanges, chosen by :func:`choose_exchange` from the compressor's declared ``collective``
(:mod:`hvd_gradcomp.codecs`), never from its class:

* :class:`DenseExchange`: Horovod's allreduce of the (optionally fp16-cast) tensor. Used
  with no compressor, with Horovod's own compressors, and for small tensors.
* :class:`HalfExchange`: the tensors one of our compressors exempts from compression (small or
  ``exclude=``d), fused, as float16 with error feedback of the cast (``exempt="fp16"``); what goes
  as float16 and how it comes back is :func:`~hvd_gradcomp.collectives.rounds.dense_fallback`'s.
* :class:`FusedAllgatherExchange`: sparse payloads (TopK, TopKQSGD), several tensors' per
  allgather (:class:`AllgatherExchange`: one each, stock Horovod's exchange, driving
  :func:`~hvd_gradcomp.collectives.rounds.sparse_allgather`). Every rank
  decodes all payloads in rank order and averages, so all ranks end with identical gradients.
* :class:`RoundsExchange`: low-rank factors (PowerSGD) in two dependent allreduces of float32.
* :class:`SparseAllreduceExchange`: the sparse allreduce
  (TopK, TopKQSGD with ``exchange="allreduce"``): an alltoall of (index, value) pairs to the rank
  owning their region, an allgather of what the owners kept; bytes per rank flat in P.
* :class:`ScatterReduceExchange`: QSGD's compressed allreduce. Each rank quantises its
  gradient in P chunks; an alltoall sends chunk i to rank i; rank i decodes and sums its
  chunk, re-quantises it (with its own error feedback), and an allgather returns every
  chunk. The bytes a rank sends stay about (1 + 1/P) x its payload, whatever P is.

Each exchange has two phases: ``start`` (at the gradient hook, overlapping backward) and
``finish`` (in ``synchronize``); the QSGD and sparse allreduce exchanges have a middle phase
``advance`` that launches the allgather once the alltoall is done. ``bytes_sent`` counts the bytes handed to Horovod.

Every payload travels behind an envelope, the tensor in flight is a :class:`Pending`: see
:mod:`hvd_gradcomp.collectives.inflight`; the fused allgather is in :mod:`hvd_gradcomp.collectives.fused`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch

from .. import codecs
from ..codecs.compressor import GradientCompressor
from .fused import FusedAllgatherExchange, encode_carried
from .inflight import ENVELOPE_BYTES, Envelope, Pending, _begin, _confirm, _hvd, check_steps, is_average, seal, unseal
from .inflight import RankDivergenceError as RankDivergenceError  # raised by every exchange; documented here
from .reduce import chunk_bounds, finite_at_indices, own_dense, sparse_support
from .rounds import Algorithm, Allreduce, Payloads, compressed_allreduce, low_rank_rounds, sparse_allgather
from .rounds import finish as finish_rounds
from .sparse_allreduce import Balancer, decode_pairs, sparse_allreduce
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

    def start(self, name: str, grad: torch.Tensor, joined: int = 0) -> Pending:
        """``joined``: the ranks still training while others are inside ``hvd.join()`` (they add zeros):
        summed, and :meth:`result` divides an average by them, not by every rank as Horovod's Average."""
        # Horovod's collectives take contiguous tensors only (a channels_last gradient is not).
        tensor, ctx = self.compression.compress(grad.contiguous())
        tensor = allreducible(tensor)   # finish() casts back as it copies into the output
        hvd = _hvd()
        handle = hvd.allreduce_async(tensor, name=f"hvdgc.dense.{name}", op=hvd.Sum if joined else self.op,
                                     process_set=self.process_set)
        return Pending(name, grad.shape, grad.dtype, handle, ctx, tensor.numel() * tensor.element_size(),
                       joined=joined if is_average(self.op) else 0)

    def advance(self, p: Pending) -> None:
        pass

    def progress(self, p: Pending) -> None:
        """Nothing to do early: Horovod's allreduce runs in its background thread."""

    def finish(self, p: Pending, out: torch.Tensor) -> None:
        out.copy_(self.result(p).view_as(out))

    def result(self, p: Pending) -> torch.Tensor:
        """The average (or sum, as ``op`` says), decompressed, once done."""
        p.finished = True
        out = self.compression.decompress(_hvd().synchronize(p.handle), p.ctx)
        return out.div_(p.joined) if p.joined else out


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
    """A rank called ``hvd.join()`` while others still exchange compressed gradients, on an exchange that
    cannot carry them then (stock ``hvd.DistributedOptimizer``, ``gc.Auto``)."""


def _join_error(size: int, active: int, wrapper: str = "stock") -> JoinNotSupportedError:
    what = ("gc.Auto measures and decides with allgathers and broadcasts, which Horovod refuses while a rank "
            "is inside hvd.join(): give hvd_gradcomp.DistributedOptimizer a fixed compressor (e.g. "
            "TopKQSGD(ratio=0.01, bits=8)), which carries the steps after a join densely among the ranks "
            "still training" if wrapper == "auto" else
            "stock hvd.DistributedOptimizer hands Horovod compressed payloads by allgather, which Horovod "
            "refuses while a rank is inside hvd.join(): use hvd_gradcomp.DistributedOptimizer (same "
            "arguments), which carries the steps after a join densely among the ranks still training, then "
            "optimizer.sync_after_join(hvd.join()) on every rank")
    return JoinNotSupportedError(
        f"{size - active} of {size} ranks called hvd.join() while this rank still trains: {what}. Or give every "
        "rank the same number of batches (drop the last uneven batches, or stop all ranks at the smallest "
        "count: hvd.allreduce(torch.tensor(len(loader)), op=hvd.Min)).")


def check_no_joined_ranks(process_set: Any) -> None:
    """Raise :class:`JoinNotSupportedError` if a rank of ``process_set`` is inside ``hvd.join()``.

    Stock Horovod's exchange allgathers each payload, which Horovod refuses while a rank has joined
    ("Allgather is not supported with Join at this time", a ``HorovodInternalError``). A joined rank
    adds zero to an allreduce, so one allreduce of a 1 per rank counts the ranks still training.
    Blocking: stock Horovod's check; ``hvd_gradcomp.DistributedOptimizer`` uses :class:`JoinGuard`.
    """
    hvd = _hvd()
    size = process_set.size()
    if size == 1:
        return
    active = int(hvd.allreduce(torch.ones(1), op=hvd.Sum, name="hvdgc.active", process_set=process_set).item())
    if active < size:
        raise _join_error(size, active)


class JoinGuard:
    """The ranks still training (not inside ``hvd.join()``), counted once per step, off the critical path.

    :meth:`begin` (at the step's first gradient hook, and at each compressed exchange's start; only
    the first call of a step does anything) starts the count as an asynchronous allreduce of a 1
    per rank (a joined rank adds zero); :meth:`joined` (just before a step's collective is handed to
    Horovod) reads it, by then usually long done; :meth:`end_step` (at ``synchronize()``) arms it
    for the next step. Every rank still training reads the same count, so all take the same exchange.

    When some rank has joined, ``hvd_gradcomp.DistributedOptimizer``'s exchanges carry each rank's part
    dense in an allreduce (Sum, divided by the ranks counted): no allgather or alltoall is issued.
    ``falls_back=False`` (``gc.Auto``) raises :class:`JoinNotSupportedError` instead, before any
    allgather, never a hang or a crash. ``counts=False`` (no compressor: Horovod's own allreduces,
    which handle join themselves): nothing is counted.
    """

    def __init__(self, process_set: Any, falls_back: bool = True, counts: bool = True) -> None:
        self.process_set, self.falls_back, self.counts = process_set, falls_back, counts
        self._handle: Any = None
        self._done = False   # this step's count is read (or not needed: one rank)
        self._active = process_set.size()

    def begin(self) -> None:
        if self._done or self._handle is not None or not self.counts:
            return
        if self.process_set.size() == 1:
            self._done = True
            return
        hvd = _hvd()
        self._handle = hvd.allreduce_async(torch.ones(1), op=hvd.Sum, name="hvdgc.active",
                                           process_set=self.process_set)

    def confirm(self) -> int:
        """The ranks still training this step (all of them when nothing is counted)."""
        self.begin()
        if self._done or self._handle is None:
            return self._active
        self._active, self._handle, self._done = int(_hvd().synchronize(self._handle).item()), None, True
        size = self.process_set.size()
        if self._active < size and not self.falls_back:
            raise _join_error(size, self._active, "auto")
        return self._active

    def joined(self) -> int:
        """The ranks still training when some are inside ``hvd.join()``, else 0."""
        active = self.confirm()
        return active if active < self.process_set.size() else 0

    def end_step(self) -> None:
        """The step is over: the next exchange checks again (a rank may join between steps)."""
        if self._handle is not None:
            self.confirm()   # started but no collective followed: still read
        self._done, self._active = False, self.process_set.size()

    def reset(self) -> None:
        """Drop a check left in flight (an elastic reset abandoned the step)."""
        self._handle, self._done, self._active = None, False, self.process_set.size()


class AllgatherExchange:
    """The sparse allgather (:func:`~hvd_gradcomp.collectives.rounds.sparse_allgather`) of one tensor
    on Horovod, its payload behind an envelope (stock Horovod's exchange): ``start`` encodes and
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
        """Nothing early: this exchange's caller (Horovod's ``decompress``) finishes each tensor at once."""

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


def start_joined(name: str, grad: torch.Tensor, dense: torch.Tensor, joined: int, process_set: Any) -> Pending:
    """The allreduce (Sum) of ``dense``, this rank's part of ``name`` (:func:`~hvd_gradcomp.collectives.reduce.own_dense`),
    when ranks inside ``hvd.join()`` leave an allgather or alltoall impossible (a joined rank adds zeros):
    :func:`finish_joined` divides the sum by the ``joined`` ranks still training."""
    hvd = _hvd()
    handle = hvd.allreduce_async(dense, name=f"hvdgc.joined.{name}", op=hvd.Sum, process_set=process_set)
    return Pending(name, grad.shape, grad.dtype, handle, bytes_sent=dense.numel() * dense.element_size(), stage=2,
                   joined=joined)


def finish_joined(p: Pending, out: torch.Tensor, average: bool) -> None:
    """Write the result of :func:`start_joined` into ``out``: the sum over the ranks still training, divided by
    their number (``p.joined``) for an ``average``."""
    total = _hvd().synchronize(p.handle)
    if average:
        total.div_(p.joined)
    out.copy_(total.view(out.shape))
    p.finished = True


class _TwoCollectives:
    """An exchange of two dependent collectives, the second launched by ``advance`` once the first is done."""

    join_guard: Optional[JoinGuard] = None   # checked before the first (see choose_exchange)
    two_stage = True

    def progress(self, p: Pending) -> None:
        """Launch the second collective as soon as the first is done (``p.grad`` is untouched); never blocks."""
        if p.stage == 1 and _hvd().poll(p.handle):
            self.advance(p)

    def advance(self, p: Pending) -> None:
        raise NotImplementedError


class _AlltoallThenAllgather(_TwoCollectives):
    """An alltoall, then an allgather of what the algorithm returns for it (QSGD's compressed allreduce,
    the sparse allreduce): the middle step and the joined step, once. ``gather_tag`` names the allgather
    (``hvdgc.<tag>.<name>``); subclasses set ``compressor``, ``op`` and ``process_set``."""

    gather_tag = ""

    def advance(self, p: Pending) -> None:
        """Stage 2: every rank's payload for this rank, from the finished alltoall, to the algorithm;
        start the allgather of what it returns, behind an envelope."""
        if p.stage != 1:
            return
        hvd = _hvd()
        received, _ = hvd.synchronize(p.handle)
        payloads = payloads_of(self.compressor, unseal(received), self.process_set.size(), p.name)
        gather = p.ctx.run.send(payloads)
        sealed = seal(gather.payloads[0], self.compressor.exchange_step, received.device)
        p.handle = hvd.allgather_async(sealed, name=f"hvdgc.{self.gather_tag}.{p.name}", process_set=self.process_set)
        p.bytes_sent += sealed.numel()
        p.framing_bytes += ENVELOPE_BYTES
        p.stage = 2

    def _finished_joined(self, p: Pending, out: torch.Tensor) -> bool:
        """A step some rank joined (dense among the others): finish it here and say so."""
        if not p.joined:
            return False
        finish_joined(p, out, is_average(self.op))
        self.compressor.received(p.name, out)
        return True


class ScatterReduceExchange(_AlltoallThenAllgather):
    """QSGD's compressed allreduce (:func:`~hvd_gradcomp.collectives.rounds.compressed_allreduce`) on Horovod:
    its :class:`~hvd_gradcomp.collectives.rounds.Scatter` as an alltoall, its
    :class:`~hvd_gradcomp.collectives.rounds.Gather` as an allgather, each payload behind its envelope."""

    gather_tag = "ag2"

    def __init__(self, compressor: GradientCompressor, op: Any, process_set: Any) -> None:
        self.compressor, self.op, self.process_set = compressor, op, process_set

    def start(self, name: str, grad: torch.Tensor) -> Pending:
        _begin(self)
        size, rank = self.process_set.size(), self.process_set.rank()
        if self.compressor._world not in (None, size):   # an hvd.elastic reset without sync (hosts only removed)
            self.compressor.follow_world(size)
        outs = [grad]   # where the average goes: set in finish(), written by the algorithm's last step
        run = compressed_allreduce(self.compressor, [(name, grad)], outs, size, rank, is_average(self.op))
        chunks = next(run).payloads
        joined = _confirm(self)
        if joined:   # ranks inside hvd.join(): no alltoall; this rank's chunks, dense, in one allreduce
            bounds = chunk_bounds(grad.numel(), size)
            dense = torch.cat([own_dense(self.compressor, pls[0], e - b, grad.device)
                               for pls, b, e in zip(chunks, bounds, bounds[1:])])
            return start_joined(name, grad, dense, joined, self.process_set)
        sealed = [seal(pls[0], self.compressor.exchange_step, grad.device) for pls in chunks]
        splits = torch.tensor([s.numel() for s in sealed], dtype=torch.int32)
        handle = _hvd().alltoall_async(torch.cat(sealed), splits=splits, name=f"hvdgc.a2a.{name}",
                                       process_set=self.process_set)
        # The chunk this rank keeps never leaves it: count only what goes to the others, so
        # that alltoall + allgather together send exactly one payload's worth per rank.
        sent = int(splits.sum()) - int(splits[rank])
        return Pending(name, grad.shape, grad.dtype, handle, _Rounds(run, outs), bytes_sent=sent,
                       framing_bytes=ENVELOPE_BYTES * (size - 1))

    def finish(self, p: Pending, out: torch.Tensor) -> None:
        if self._finished_joined(p, out):
            return
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
    undoes the step in the compressor). While ranks are inside ``hvd.join()`` (they add zeros) both
    rounds run over the ranks still training: each allreduce is a sum, divided by their number
    (:class:`JoinGuard`), so the factors are those of the average over the ranks that contributed."""

    def __init__(self, compressor: GradientCompressor, op: Any, process_set: Any) -> None:
        self.compressor, self.op, self.process_set = compressor, op, process_set
        self.transport = HorovodTransport(process_set)

    def start(self, name: str, grad: torch.Tensor) -> Pending:
        _begin(self)
        if not self.compressor.compressible(tuple(grad.shape)):
            joined = _confirm(self)
            tensor = allreducible(grad.contiguous())
            work = self.transport.allreduce(tensor, f"hvdgc.rounds.dense.{name}", is_average(self.op), joined)
            return Pending(name, grad.shape, grad.dtype, work.handle, work,
                           tensor.numel() * tensor.element_size(), stage=2, joined=joined)
        joined = _confirm(self)   # counted since the step's first gradient hook: read at once
        scale = 1.0 if is_average(self.op) else float(joined or self.process_set.size())
        outs = [grad]   # where the approximation goes: set in finish(), read by the algorithm's last step
        p = Pending(name, grad.shape, grad.dtype, None, _Rounds(low_rank_rounds(self.compressor, [(name, grad)],
                                                                                outs, scale), outs), joined=joined)
        self._issue(p, next(p.ctx.run))
        return p

    def _issue(self, p: Pending, request: Allreduce) -> None:
        """Hand the algorithm's next request to Horovod; the average comes back in ``advance``/``finish``."""
        work = self.transport.allreduce(request.tensor, f"hvdgc.rounds.{request.tag}.{p.name}", request.average,
                                        p.joined)
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


class SparseAllreduceExchange(_AlltoallThenAllgather):
    """The sparse allreduce (:func:`~hvd_gradcomp.collectives.sparse_allreduce.sparse_allreduce`)
    of one tensor on Horovod, for a codec built with ``exchange="allreduce"`` (TopK, TopKQSGD): its
    ``"route"`` Scatter as one ``hvd.alltoall`` with ``splits=`` (the payloads to each owner differ in
    size), its ``"gather"`` Gather as one ``hvd.allgather``, each payload behind its envelope.
    ``start`` selects and launches the alltoall of this rank's pairs to their owners, ``advance``
    hands the owner's received pairs to the algorithm and launches the allgather of its kept sums,
    ``finish`` writes the average and hands it to the compressor's ``received`` with the kept
    indices as support (its feedback policy's rule). Stock ``hvd.DistributedOptimizer`` cannot carry
    it (:func:`hvd_gradcomp.horovod.stock.refuse_rounds`).

    ``bytes_sent`` (the ledger's) counts what this rank hands Horovod: its routed pairs to the other
    ranks and its kept sums, each behind an envelope; never the codec payload ``compress_carried``
    builds and nothing sends. ``ring_bytes[name]``: what this rank put on the wire for the tensor's
    last exchange with a ring allgather (its routed pairs, then every rank's kept sums but the next
    rank's), the figure to compare with the allgather exchange's ``(P-1)`` payloads.

    The :class:`~hvd_gradcomp.collectives.sparse_allreduce.Balancer` (the region bounds, per tensor
    name) lives as long as the exchange, so bounds move with the kept indices from step to step;
    a new one (equal regions) when the ranks change. While ranks are inside ``hvd.join()`` this
    rank's routed pairs go dense in one allreduce among the ranks still training (nothing dropped).
    """

    gather_tag = "sag"

    def __init__(self, compressor: GradientCompressor, op: Any, process_set: Any) -> None:
        self.compressor, self.op, self.process_set = compressor, op, process_set
        self.balancer = Balancer(process_set.size())
        self.ring_bytes: Dict[str, int] = {}

    def start(self, name: str, grad: torch.Tensor) -> Pending:
        _begin(self)
        size, rank = self.process_set.size(), self.process_set.rank()
        if self.balancer.world != size:   # an hvd.elastic reset changed the ranks: equal regions again
            self.balancer = Balancer(size)
        outs = [grad]   # where the average goes: set in finish(), written by the algorithm's last step
        run = sparse_allreduce(self.compressor, [(name, grad)], outs, size, rank, is_average(self.op),
                               balancer=self.balancer)
        routes = [pls[0] for pls in next(run).payloads]
        joined = _confirm(self)
        if joined:   # ranks inside hvd.join(): no alltoall; this rank's pairs, dense, in one allreduce
            run.close()
            dense = self._dense(name, grad, routes)
            return start_joined(name, grad, dense, joined, self.process_set)
        sealed = [seal(r, self.compressor.exchange_step, grad.device) for r in routes]
        splits = torch.tensor([s.numel() for s in sealed], dtype=torch.int32)
        handle = _hvd().alltoall_async(torch.cat(sealed), splits=splits, name=f"hvdgc.sa2a.{name}",
                                       process_set=self.process_set)
        sent = int(splits.sum()) - int(splits[rank])   # the pairs this rank owns never leave it
        self.ring_bytes[name] = sent
        return Pending(name, grad.shape, grad.dtype, handle, _Rounds(run, outs), bytes_sent=sent,
                       framing_bytes=ENVELOPE_BYTES * (size - 1))

    def _dense(self, name: str, grad: torch.Tensor, routes: List[Optional[torch.Tensor]]) -> torch.Tensor:
        """This rank's routed pairs as a dense float32 tensor (NaN everywhere for the non-finite flag)."""
        dense = torch.zeros(grad.numel(), dtype=torch.float32, device=grad.device)
        if routes[0] is None:
            return dense.fill_(float("nan"))
        bounds = self.balancer.bounds(name, grad.numel())
        for payload, b, e in zip(routes, bounds, bounds[1:]):
            idx, vals = decode_pairs(payload, e - b)   # type: ignore[arg-type]
            dense[idx + b] = vals
        return dense

    def finish(self, p: Pending, out: torch.Tensor) -> None:
        if self._finished_joined(p, out):
            return
        if p.stage == 1:
            self.advance(p)
        envelopes = unseal(_hvd().synchronize(p.handle))
        payloads = payloads_of(self.compressor, envelopes, self.process_set.size(), p.name)
        self._count_ring(p.name, envelopes)
        # A channels_last (or otherwise strided) gradient cannot be viewed flat: fill a flat
        # buffer in the tensor's logical order and copy it over.
        flat = out.view(-1) if out.is_contiguous() else torch.empty(out.numel(), dtype=out.dtype, device=out.device)
        p.ctx.out[0] = flat
        kept = finish_rounds(p.ctx.run, payloads)[0]
        if not out.is_contiguous():
            out.copy_(flat.view(out.shape))
        self.compressor.received(p.name, out, kept)   # kept None (a NaN region): the step is undone anyway
        p.finished = True

    def _count_ring(self, name: str, envelopes: List[Any]) -> None:
        """Add the ring allgather's bytes from this rank: every rank's sealed kept sums but the next rank's."""
        sizes = [ENVELOPE_BYTES + (0 if e.payload is None else e.payload.numel()) for e in envelopes]
        nxt = (self.process_set.rank() + 1) % len(sizes)
        self.ring_bytes[name] = self.ring_bytes.get(name, 0) + (sum(sizes) - sizes[nxt] if len(sizes) > 1 else 0)


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
    elif codecs.collective_of(compression) == codecs.SPARSE_ALLREDUCE:
        exchange = TimedExchange(SparseAllreduceExchange(compression, op, process_set))
    elif isinstance(compression, GradientCompressor):
        raise ValueError(f"{type(compression).__name__} declares collective={compression.collective!r}, which "
                         f"this exchange cannot carry (known: {', '.join(codecs.COLLECTIVES)}; see hvd_gradcomp.codecs)")
    else:
        exchange = TimedExchange(DenseExchange(op, process_set, compression))
    for inner in _inner_exchanges(exchange):
        if hasattr(inner, "join_guard"):
            inner.join_guard = join_guard
    return exchange


def _inner_exchanges(exchange: Any) -> List[Any]:
    """The exchanges doing the work under the layers that time or route them (:class:`TimedExchange`,
    Auto's router)."""
    if hasattr(exchange, "exchanges"):
        return [r for e in exchange.exchanges.values() for r in _inner_exchanges(e)]
    return _inner_exchanges(exchange.inner) if hasattr(exchange, "inner") else [exchange]
