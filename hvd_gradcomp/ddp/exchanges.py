"""The DDP hook's drivers: how one bucket travels over ``torch.distributed`` (Gloo, NCCL, MPI alike).

One function per declared collective (:data:`_EXCHANGES`, see :mod:`hvd_gradcomp.codecs`):
:func:`_allgather` (sparse payloads), :func:`_scatter_reduce` (QSGD's compressed allreduce),
:func:`_rounds` (PowerSGD's two allreduces), driving the algorithms of :mod:`hvd_gradcomp.collectives.rounds`,
and :func:`_sparse_allreduce` (TopK's and TopKQSGD's ``exchange="allreduce"``, the algorithm of
:mod:`hvd_gradcomp.collectives.sparse_allreduce`, framed by :mod:`hvd_gradcomp.ddp.sparse_exchange`), plus the
dense and float16 allreduces of what a bucket does not compress. Each returns a future and never waits
(but :func:`_sparse_allreduce`, for two small collectives of counts): second-round collectives are
chained on the first round's futures and issued in bucket order on a second process group
(``state._then_in_order``, :class:`_InOrder`), so their order is the same on every rank.

A driver takes the hook's state (:class:`hvd_gradcomp.ddp.GradCompState`) or Auto's view of it
(:class:`hvd_gradcomp.ddp.auto._RoadView`): anything with its attributes (``compression``,
``world_size``, ``_record``, ``_lock``, ``_then_in_order``...), hence :data:`State`.
"""
# No `from __future__ import annotations`: as in hvd_gradcomp.ddp.
import atexit
import threading
import time
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from .. import codecs, wire
from ..feedback import kernels
from ..codecs.compressor import payload_size
from ..collectives.reduce import chunk_bounds, sparse_support
from ..collectives.rounds import HALF, compressed_allreduce, dense_fallback, low_rank_rounds, sparse_allgather
from ..collectives.sparse_allreduce import sparse_allreduce
from ..collectives.rounds import finish as finish_rounds
from ..collectives.transport import TorchTransport
from ..collectives.transport import all_gather_single as _all_gather_single
from .sparse_exchange import Payloads, contribution, counts_of, cut, gather_bound, uncut

State = Any
"""The hook's state or Auto's view of it (see the module docstring)."""

# Process groups a hook uses stay referenced here. Callbacks run on the groups' worker threads;
# if one of them dropped the last reference (the user let go of model and state while a
# callback was unwinding), the group would be destroyed from its own worker thread, which
# aborts the process ("Resource deadlock avoided").
_KEEP_ALIVE: List[Any] = []

Future = torch.futures.Future


# This module's callbacks still held by a collective's worker thread: weak references, so an
# entry leaves when its thread releases the callback, after running it (see _drain_at_exit).
_PENDING: "weakref.WeakSet[Callable[[Future], Any]]" = weakref.WeakSet()


def _then(fut: Future, fn: Callable[[Future], Any]) -> Future:
    """``fut.then(fn)``, with the callback counted in ``_PENDING`` until its thread lets go of it.

    Example::

        >>> f = Future(); g = _then(f, lambda done: done.value() + 1); f.set_result(1); g.wait()
        2
    """
    def run(done: Future) -> Any:  # a callable of our own: ``fn`` may be shared or not weak-referenceable
        return fn(done)

    _PENDING.add(run)
    return fut.then(run)


class _InOrder:
    """Second-round collectives issued in bucket order, on every rank the same, whichever thread
    completes a first-round future first."""

    def __init__(self, lock: threading.Lock) -> None:
        self._lock = lock   # the state's: decodes use the compressor, shared with the hook's thread
        self._launched: Future = _done(None)

    def then(self, deps: List[Future], launch: Callable[[], Optional[Tuple[Future, Callable]]],
             result: Future, buffer: torch.Tensor, finish_dense: Callable[[], None]) -> None:
        """Run ``launch()`` when ``deps`` are done *and* the previous bucket's launch has run.

        ``launch`` issues the second-round collective and returns (its future, decode); it
        returns None when the bucket carries non-finite values. ``result`` gets the buffer.
        """
        previous, mine = self._launched, Future()
        self._launched = mine

        def fail(err: BaseException) -> None:
            if not result.done():
                result.set_exception(err)

        def complete(fut: Optional[Future], decode: Optional[Callable]) -> None:
            try:
                if fut is not None:
                    fut.wait()
                    with self._lock:
                        decode()
                else:
                    buffer.fill_(float("nan"))
                for d in deps:
                    d.wait()  # this callback's CUDA stream too must wait for the dense allreduces
                finish_dense()
                result.set_result(buffer)
            except BaseException as err:  # noqa: BLE001 -- handed to DDP, which raises it in backward
                fail(err)

        def ready(_: Future) -> None:
            try:
                for d in deps:
                    d.wait()  # raises a failed first round (e.g. a peer died)
                launched = launch()
            except BaseException as err:  # noqa: BLE001
                mine.set_result(None)
                fail(err)
                return
            mine.set_result(None)
            if launched is None:
                complete(None, None)
            else:
                _then(launched[0], lambda f: complete(f, launched[1]))

        _then(torch.futures.collect_all(deps + [previous]), ready)


def _drain_at_exit(timeout: float = 5.0, settle: float = 0.02) -> None:
    """At interpreter exit, let the collectives' worker threads finish with this module's callbacks.

    Why: after a callback hands DDP its result, the worker thread that ran it still needs the
    GIL, to release the callback and then the collective's tensors. DDP already returned, so the
    main thread may be exiting; a thread that asks for the GIL once Python has begun shutting
    down is stopped inside C++ and the process aborts ("terminate called without an active
    exception", SIGABRT, pytorch/pytorch#190489) after training that succeeded: a failed job
    to its launcher. ``atexit`` runs while other threads may still take the GIL: wait (the
    GIL released) until every callback was released, at most ``timeout`` seconds (a collective
    whose peer died never completes), then ``settle`` seconds for the tensors' release.
    """
    if not _PENDING and not _KEEP_ALIVE:
        return
    deadline = time.monotonic() + timeout
    while _PENDING and time.monotonic() < deadline:
        time.sleep(0.001)
    time.sleep(settle)


atexit.register(_drain_at_exit)


@dataclass(frozen=True)
class _Segment:
    """One parameter's gradient inside a bucket's flat buffer."""

    name: str
    offset: int
    numel: int
    shape: Tuple[int, ...]

    def view(self, buffer: torch.Tensor) -> torch.Tensor:
        return buffer[self.offset:self.offset + self.numel]


@dataclass(frozen=True)
class _Plan:
    """A bucket split into compressed and dense segments."""

    compressed: Tuple[_Segment, ...]
    dense: Tuple[_Segment, ...]


# ---------------------------------------------------------------- dense
def _allreduce(state: State, flat: torch.Tensor, step: int, name: Optional[str],
               cast: Optional[torch.dtype]) -> Future:
    """Average ``flat`` in place by one allreduce (of a ``cast`` copy when given); counted as ``name``
    (None: the caller counts it)."""
    send = flat.to(cast) if cast is not None else flat
    send.div_(state.world_size)
    if name is not None:
        state._record(step, name, flat.numel() * flat.element_size(), send.numel() * send.element_size())
    fut = dist.all_reduce(send, group=state.process_group, async_op=True).get_future()

    def done(f: Future) -> torch.Tensor:
        f.wait()
        if send is not flat:
            flat.copy_(send)
        return flat

    return _then(fut, done)


def _start_dense(state: State, buffer: torch.Tensor, plan: _Plan, step: int,
                 finite: Union[bool, Callable[[], bool]]) -> Tuple[List[Future], Callable[[], None]]:
    """The segments of a bucket that go uncompressed, by
    :func:`~hvd_gradcomp.collectives.rounds.dense_fallback`: one allreduce, and one of the float16
    ones; returns (futures, write-back). ``finite``: whether this rank's bucket is all finite (or
    how to tell, see :func:`~hvd_gradcomp.collectives.rounds.dense_fallback`)."""
    views = [s.view(buffer) for s in plan.dense]
    run = dense_fallback(state.compression, [(s.name, v.view(s.shape)) for s, v in zip(plan.dense, views)], views,
                         state.world_size, state.min_compress_numel, finite=finite)
    with state._lock:
        requests = next(run).requests
    futs, results = [], []
    for request in requests:
        half = request.tag == HALF
        sent = request.tensor
        if plan.compressed and sent.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr():
            # not averaged in place here: a non-finite compressed part fills the bucket with NaN, and the
            # dense averages are written back after that (_InOrder)
            sent = sent.clone()
        state._record(step, "exempt.fp16" if half else "dense", request.raw_bytes, sent.numel() * sent.element_size())
        if request.average:   # divided by the ranks, then summed, in place
            futs.append(_allreduce(state, sent, step, None, None))
        else:                 # the float16 casts: divided by the ranks already
            futs.append(dist.all_reduce(sent, group=state.process_group, async_op=True).get_future())
        results.append(sent)
    return futs, lambda: finish_rounds(run, results)


def _dense_bucket(state: State, buffer: torch.Tensor, plan: _Plan, step: int) -> Future:
    """A bucket with nothing to compress this step: :func:`_start_dense` of all of it (its
    finiteness read only where a float16 cast depends on it)."""
    futs, write_back = _start_dense(state, buffer, plan, step, lambda: kernels.all_finite(buffer))
    return _when_all(futs, buffer, write_back)


def _when_all(futs: List[Future], buffer: torch.Tensor, finish: Callable[[], None] = lambda: None) -> Future:
    """A future of ``buffer``, set once every future in ``futs`` is done and ``finish()`` ran.

    Why not ``collect_all(futs).then(...)``: collect_all's future carries no CUDA events. Its
    callback runs on whatever stream the thread that completed the last future had current
    (a callback stream of a ``then``, say), so DDP, waiting on such a future, would not wait
    for that stream: it could read the bucket before ``finish`` wrote the average into it
    (seen on a GPU: ranks drifted apart). Here each future is ``wait()``ed (making the current
    stream wait for its events; value() does not) and the result is a device future, which
    records the callback's stream for DDP to wait on.
    """
    result = Future(devices=[buffer.device]) if buffer.is_cuda else Future()

    def done(f: Future) -> None:
        try:
            for x in f.value():
                x.wait()   # raises a failed collective
            finish()
            result.set_result(buffer)
        except BaseException as err:  # noqa: BLE001 -- handed to DDP, which raises it in backward
            result.set_exception(err)

    _then(torch.futures.collect_all(futs), done)
    return result


def _meta(state: State, value: int, device: torch.device) -> Tuple[torch.Tensor, Future]:
    """all_gather of one int64 per rank: a payload size, or -1 for non-finite gradients."""
    mine = torch.tensor([value], dtype=torch.int64, device=device)
    out = torch.empty(state.world_size, dtype=torch.int64, device=device)
    work = _all_gather_single(out, mine, group=state.process_group, async_op=True)
    return out, work.get_future()


# ---------------------------------------------------------------- sparse: all_gather
def _allgather(state: State, buffer: torch.Tensor, plan: _Plan, step: int) -> Future:
    """The sparse allgather (:func:`~hvd_gradcomp.collectives.rounds.sparse_allgather`) of the bucket's
    compressed segments: every payload of this rank in one padded ``all_gather`` on the second group,
    after an ``all_gather`` of the sizes (-1: this rank's bucket holds NaN/Inf, and the bucket is NaN
    on every rank), in bucket order."""
    comp, world, n = state.compression, state.world_size, len(plan.compressed)
    with state._lock:
        finite, sends = _encode_sparse(state, buffer, plan)
    views = [s.view(buffer) for s in plan.compressed]
    run = sparse_allgather(comp, [(s.name, v) for s, v in zip(plan.compressed, views)], views, world, state.rank,
                           sends=sends)
    payloads = next(run).payloads if finite else []
    blob = torch.cat(payloads) if payloads else torch.empty(0, dtype=torch.uint8, device=buffer.device)
    sizes, meta_fut = _meta(state, blob.numel() if finite else -1, buffer.device)
    dense_futs, copy_back = _start_dense(state, buffer, plan, step, finite)
    for s, pl in zip(plan.compressed, payloads):
        state._record(step, s.name, s.numel * buffer.element_size(), pl.numel())

    def launch() -> Optional[Tuple[Future, Callable]]:
        counts = sizes.tolist()
        if min(counts) < 0:
            _nonfinite(state)
            return None
        cap = max(counts)
        padded = torch.zeros(cap, dtype=torch.uint8, device=buffer.device)
        padded[:blob.numel()] = blob
        gathered = torch.empty(world * cap, dtype=torch.uint8, device=buffer.device)
        state._record(step, "(sizes+padding)", 0, 0, 8 + cap - blob.numel())
        work = _all_gather_single(gathered, padded, group=state._second, async_op=True)

        def decode() -> None:
            # This rank's own payloads are not split from the gather: they are the ones it sent.
            per_rank = [payloads if r == state.rank else _split(gathered[r * cap:r * cap + counts[r]], n)
                        for r in range(world)]
            if buffer.is_cuda:  # made on the hook's stream, read on this callback's: keep them till done
                for t in (t for _, carried in sends if isinstance(carried, tuple) for t in carried if t is not None):
                    t.record_stream(torch.cuda.current_stream(buffer.device))
            for s, parts in zip(plan.compressed, finish_rounds(run, per_rank)):
                # momentum correction: what SGD should see
                state._received(s.name, s.view(buffer), sparse_support(parts))
                state._exchanged_average(s, buffer)

        return work.get_future(), decode

    result = Future(devices=[buffer.device]) if buffer.is_cuda else Future()
    state._then_in_order([meta_fut] + dense_futs, launch, result, buffer, copy_back)
    return result


def _encode_sparse(state: State, buffer: torch.Tensor, plan: _Plan
                   ) -> Tuple[bool, List[Tuple[torch.Tensor, Any]]]:
    """Whether this rank's bucket is all finite and, if so, (payload, what it carries) per
    compressed segment; nothing is kept from a non-finite bucket.

    Where the feedback policy builds every segment's input and its sum in one pass
    (:attr:`~hvd_gradcomp.feedback.Feedback.marks_input`), all segments are prepared first and
    the verdict is read from those sums (and one sum per other segment): no separate pass over
    the bucket. Either way one host sync (on GPU) decides, for the whole bucket.
    """
    comp = state.compression
    grads = [(s.name, s.view(buffer).view(s.shape)) for s in plan.compressed]
    if comp.clip is not None or not comp.feedback.marks_input:
        if not kernels.all_finite(buffer):  # a host sync: what is sent depends on it
            return False, []
        return True, [comp.send_prepared(comp.prepare_named(name, grad)) for name, grad in grads]
    prepared = [comp.prepare_named(name, grad, total=True) for name, grad in grads]
    totals = [p.total for p in prepared if p.total is not None]
    rest = [s.view(buffer) for s, p in zip(plan.compressed, prepared) if p.total is None] + \
        [s.view(buffer) for s in plan.dense]
    checks = [torch.isfinite(torch.stack(totals)).all()] if totals else []
    if rest:
        checks.append(kernels.sums_finite(rest))
    # A host sync; a non-finite sum of finite values (an overflow) is told apart exactly.
    if not (bool(torch.stack(checks).all()) or kernels.all_finite(buffer)):
        return False, []   # nothing was kept: the policies keep their state until sent()
    return True, [comp.send_prepared(p) for p in prepared]


# ---------------------------------------------------------------- QSGD: compressed allreduce
def _scatter_reduce(state: State, buffer: torch.Tensor, plan: _Plan, step: int) -> Future:
    """QSGD's compressed allreduce (:func:`hvd_gradcomp.collectives.rounds.compressed_allreduce`) of the bucket's
    compressed segments: its scatter as one ``all_to_all_single`` on the hook's group, its gather
    as one ``all_gather`` in bucket order on the second group. Payload sizes follow from the
    chunk sizes alone, so no sizes travel, only a flag per rank: a rank whose bucket holds
    NaN/Inf sends zeros and its flag, the bucket is NaN on every rank and no residual changes."""
    comp, world, rank = state.compression, state.world_size, state.rank
    bounds = [chunk_bounds(s.numel, world) for s in plan.compressed]
    sizes = [[payload_size(comp, (e - b,)) for b, e in zip(bd, bd[1:])] for bd in bounds]
    per_dest = [sum(sz[r] for sz in sizes) for r in range(world)]
    run = compressed_allreduce(comp, [(s.name, s.view(buffer).view(s.shape)) for s in plan.compressed],
                               [s.view(buffer) for s in plan.compressed], world, rank, flags=False)
    with state._lock:
        finite = kernels.all_finite(buffer)  # a host sync: what is sent depends on it
        if finite:
            send = torch.cat([pl for to_rank in next(run).payloads for pl in to_rank])
        else:
            send = torch.zeros(sum(per_dest), dtype=torch.uint8, device=buffer.device)
    if send.numel() != sum(per_dest):
        raise RuntimeError(f"QSGD payloads of {send.numel()} bytes where the size formula gives {sum(per_dest)}")
    received = torch.empty(world * per_dest[rank], dtype=torch.uint8, device=buffer.device)
    a2a = dist.all_to_all_single(received, send, [per_dest[rank]] * world, per_dest,
                                 group=state.process_group, async_op=True).get_future()
    flags, meta_fut = _meta(state, 1 if finite else -1, buffer.device)
    dense_futs, copy_back = _start_dense(state, buffer, plan, step, finite)
    cap = max(per_dest)
    state._record(step, "(flags)", 0, 0, 8)

    def launch() -> Optional[Tuple[Future, Callable]]:
        if min(flags.tolist()) < 0:
            _nonfinite(state)
            return None
        n = len(plan.compressed)
        from_rank = [_split(received[r * per_dest[rank]:(r + 1) * per_dest[rank]], n) for r in range(world)]
        with state._lock:
            reduced = run.send(from_rank).payloads
        padded = torch.zeros(cap, dtype=torch.uint8, device=buffer.device)
        padded[:per_dest[rank]] = torch.cat(reduced)
        gathered = torch.empty(world * cap, dtype=torch.uint8, device=buffer.device)
        for j, s in enumerate(plan.compressed):
            to_others = sum(sizes[j]) - sizes[j][rank]
            state._record(step, s.name, s.numel * buffer.element_size(), to_others + reduced[j].numel())
        state._record(step, "(flags+padding)", 0, 0, cap - per_dest[rank])
        work = _all_gather_single(gathered, padded, group=state._second, async_op=True)

        def decode() -> None:   # under state._lock (_InOrder)
            finish_rounds(run, [_split(gathered[r * cap:r * cap + per_dest[r]], n) for r in range(world)])
            for s in plan.compressed:
                state._received(s.name, s.view(buffer))
                state._exchanged_average(s, buffer)

        return work.get_future(), decode

    result = Future(devices=[buffer.device]) if buffer.is_cuda else Future()
    state._then_in_order([a2a, meta_fut] + dense_futs, launch, result, buffer, copy_back)
    return result


# ---------------------------------------------------------------- PowerSGD: two allreduce rounds
def _rounds(state: State, buffer: torch.Tensor, plan: _Plan, step: int) -> Future:
    """Low-rank factors (:mod:`hvd_gradcomp.codecs.powersgd`) by :func:`hvd_gradcomp.collectives.rounds.low_rank_rounds`
    for every matrix of the bucket: its first request (every ``P``) on the hook's group, its second
    (every ``Q``, computed from the averaged ``P``) in bucket order on the second group; the
    approximations are written into the bucket. A rank whose bucket holds NaN/Inf sends zeros and
    its flag: the bucket is NaN on every rank and nobody's residual or ``Q`` changes."""
    comp, world = state.compression, state.world_size
    shapes = [comp.factors(s.shape) for s in plan.compressed]   # all matrices: see _make_plan
    run = low_rank_rounds(comp, [(s.name, s.view(buffer).view(s.shape)) for s in plan.compressed],
                          [s.view(buffer).view(s.shape) for s in plan.compressed])
    with state._lock:
        finite = kernels.all_finite(buffer)  # a host sync: what is sent depends on it
        first = next(run).tensor if finite else \
            torch.zeros(sum(n * r for n, _, r in shapes), dtype=torch.float32, device=buffer.device)
    first_work = TorchTransport(state.process_group, world).allreduce(first, "p", average=True)
    flags, meta_fut = _meta(state, 1 if finite else -1, buffer.device)
    dense_futs, copy_back = _start_dense(state, buffer, plan, step, finite)
    for s, (n, m, r) in zip(plan.compressed, shapes):
        state._record(step, s.name, s.numel * buffer.element_size(), (n + m) * r * 4)
    state._record(step, "(flags)", 0, 0, 8)

    def launch() -> Optional[Tuple[Future, Callable]]:
        if min(flags.tolist()) < 0:
            _nonfinite(state)
            return None
        with state._lock:
            second = run.send(first_work.wait()).tensor
        work = TorchTransport(state._second, world).allreduce(second, "q", average=True)

        def decode() -> None:   # under state._lock (_InOrder)
            finish_rounds(run, work.wait())
            for s in plan.compressed:
                state._received(s.name, s.view(buffer))
                state._exchanged_average(s, buffer)

        return work.future, decode

    result = Future(devices=[buffer.device]) if buffer.is_cuda else Future()
    state._then_in_order([first_work.future, meta_fut] + dense_futs, launch, result, buffer, copy_back)
    return result


# ---------------------------------------------------------------- TopK/TopKQSGD: the sparse allreduce
def _sparse_allreduce(state: State, buffer: torch.Tensor, plan: _Plan, step: int) -> Future:
    """The sparse allreduce (:func:`hvd_gradcomp.collectives.sparse_allreduce.sparse_allreduce`) of the bucket's
    compressed segments: the counts by ``all_to_all_single`` and a MAX ``all_reduce`` (both waited for here),
    the pairs by ``all_to_all_single`` on the hook's group, the kept sums by one padded ``all_gather`` in
    bucket order on the second group; a rank whose bucket holds NaN/Inf flags it and every rank skips the
    bucket (NaN), see :mod:`hvd_gradcomp.ddp.sparse_exchange`."""
    comp, world, rank = state.compression, state.world_size, state.rank
    segs, device = plan.compressed, buffer.device
    n = len(segs)
    views = [s.view(buffer) for s in segs]
    run = sparse_allreduce(comp, [(s.name, v.view(s.shape)) for s, v in zip(segs, views)], views, world, rank,
                           average=True, flags=True, balancer=state._balancer)
    with state._lock:
        finite = kernels.all_finite(buffer)   # a host sync: what is sent depends on it
        route: Optional[Payloads] = next(run).payloads if finite else None
    counts = counts_of(route, world, n, device)
    received = torch.empty(world * n, dtype=torch.int64, device=device)
    dist.all_to_all_single(received, counts.view(-1), group=state.process_group)
    got = received.view(world, n)
    own = gather_bound(got, world)
    agreed = torch.tensor([own, int(bool((counts < 0).any()))], dtype=torch.int64, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=state.process_group)
    cap, flagged = agreed.tolist()
    state._record(step, "(counts+padding)", 0, 0, 8 * n * (world - 1) + 16)
    dense_futs, copy_back = _start_dense(state, buffer, plan, step, finite)
    if flagged:
        for s in segs:
            state._record(step, s.name, s.numel * buffer.element_size(), 0)
        return _sparse_skipped(state, run if route is not None else None, world, n, dense_futs, buffer, copy_back)
    assert route is not None   # no rank flagged: this one selected
    send = torch.cat([p for to_rank in route for p in to_rank]) if n else torch.empty(0, dtype=torch.uint8)
    send_splits = counts.sum(dim=1).tolist()
    recv_splits = got.sum(dim=1).tolist()
    pairs_in = torch.empty(sum(recv_splits), dtype=torch.uint8, device=device)
    a2a = dist.all_to_all_single(pairs_in, send, recv_splits, send_splits, group=state.process_group,
                                 async_op=True).get_future()
    to_others = [int(counts[:, j].sum() - counts[rank, j]) for j in range(n)]

    def launch() -> Tuple[Future, Callable]:
        from_rank = cut(pairs_in, got.tolist())
        with state._lock:
            mine = run.send(from_rank).payloads
        blob = contribution(mine, cap, device)
        for s, m, out in zip(segs, mine, to_others):
            state._record(step, s.name, s.numel * buffer.element_size(), out + (m.numel() if m is not None else 0))
        state._record(step, "(counts+padding)", 0, 0, cap - sum(m.numel() for m in mine if m is not None))
        gathered = torch.empty(world * cap, dtype=torch.uint8, device=device)
        work = _all_gather_single(gathered, blob, group=state._second, async_op=True)

        def decode() -> None:   # under state._lock (_InOrder)
            kept = finish_rounds(run, [uncut(gathered[r * cap:(r + 1) * cap], n) for r in range(world)])
            if any(k is None for k in kept):   # an owner's sum overflowed: NaN on every rank
                _nonfinite(state)
                buffer.fill_(float("nan"))
                return
            for s, k in zip(segs, kept):
                state._received(s.name, s.view(buffer), k)
                state._exchanged_average(s, buffer)

        return work.get_future(), decode

    result = Future(devices=[device]) if buffer.is_cuda else Future()
    state._then_in_order([a2a] + dense_futs, launch, result, buffer, copy_back)
    return result


def _sparse_skipped(state: State, run: Optional[Any], world: int, n: int, dense_futs: List[Future],
                    buffer: torch.Tensor, copy_back: Callable[[], None]) -> Future:
    """A bucket some rank flagged: no pairs travel; a rank that selected hands the algorithm flags
    (every region NaN), so that what it sent goes back to its residuals; the bucket is NaN."""
    def launch() -> None:
        if run is not None:
            with state._lock:
                run.send([[None] * n for _ in range(world)])
                finish_rounds(run, [[None] * n for _ in range(world)])
        _nonfinite(state)
        return None

    result = Future(devices=[buffer.device]) if buffer.is_cuda else Future()
    state._then_in_order(list(dense_futs), launch, result, buffer, copy_back)
    return result



_EXCHANGES: Dict[str, Callable[[State, torch.Tensor, _Plan, int], Future]] = {
    codecs.ALLGATHER: _allgather, codecs.COMPRESSED_ALLREDUCE: _scatter_reduce,
    codecs.ALLREDUCE_ROUNDS: _rounds, codecs.SPARSE_ALLREDUCE: _sparse_allreduce}
"""A compressor's declared ``collective`` (:mod:`hvd_gradcomp.codecs`) -> the driver of its buckets."""


def _nonfinite(state: State) -> None:
    state.nonfinite_exchanges += 1
    warnings.warn("a gradient bucket held NaN/Inf on some rank: it is NaN on every rank for this step "
                  "(a GradScaler skips such steps; otherwise lower the learning rate or clip)", RuntimeWarning)


def _split(blob: torch.Tensor, expected: int) -> List[torch.Tensor]:
    payloads = wire.split_payloads(blob) if blob.numel() else []
    if len(payloads) != expected:
        raise RuntimeError(f"got {len(payloads)} payloads where {expected} were expected: ranks disagree on "
                           "the model or its buckets")
    return payloads


def _done(value: Any) -> Future:
    fut: Future = Future()
    fut.set_result(value)
    return fut
