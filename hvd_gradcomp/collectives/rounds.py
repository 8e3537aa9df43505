"""Exchange algorithms written once, whatever carries them: a generator per algorithm.

An algorithm here knows the codec and the order of its collectives, not how they travel: it
*yields* each collective it needs (a request: :class:`Allreduce`, :class:`Scatter`,
:class:`Gather`, or several issued at once, :class:`Together`) and is *sent* the result. A driver issues each request on its transport
(Horovod's handles, or ``torch.distributed``'s futures) at the moment its own wrapper allows, in
its own framing (Horovod's envelopes; DDP's equal-sized collectives after a flag per rank), and
sends the result back; :func:`finish` sends the last one.

* :func:`low_rank_rounds`, PowerSGD's two dependent allreduces, driven by
  :class:`hvd_gradcomp.collectives.exchange.RoundsExchange` (one tensor, ``start`` / ``advance`` /
  ``finish``) and :func:`hvd_gradcomp.ddp.exchanges._rounds` (a DDP bucket's matrices, the second
  request issued in bucket order on the hook's second process group);
* :func:`compressed_allreduce`, QSGD's scatter-reduce (alltoall of quantised chunks, each rank
  reduces and re-quantises its chunk, allgather), driven by
  :class:`hvd_gradcomp.collectives.exchange.ScatterReduceExchange` and
  :func:`hvd_gradcomp.ddp.exchanges._scatter_reduce`;
* :func:`sparse_allgather`, the sparse (and dense-payload) allgather: every rank's payload to every
  rank, decoded in rank order (this rank's own part as its encoder carried it) and summed, driven
  by :class:`hvd_gradcomp.collectives.exchange.AllgatherExchange` (stock Horovod, one tensor) and
  :func:`hvd_gradcomp.ddp.exchanges._allgather` (a DDP bucket, in one padded gather).
  :class:`hvd_gradcomp.collectives.fused.FusedAllgatherExchange` pipelines the same steps with
  backward (its decode starts as each group lands) and so keeps a driver of its own;
* :func:`dense_fallback`, what a step does not compress (small, excluded, a dtype the wire cannot
  carry, a feedback policy's dense step): the policy told of each, the float16 ones fused and
  summed with error feedback of the cast, the rest fused per dtype and averaged, then written back;
  driven by ``hvd_gradcomp.DistributedOptimizer``'s fused small tensors, stock Horovod's
  ``compress``/``decompress`` (one tensor) and :func:`hvd_gradcomp.ddp.exchanges._start_dense`.

So each choreography (P averaged, orthogonalised, Q computed from it...; chunks decoded, summed,
re-quantised, gathered...; which tensors go as float16, and how their average comes back) exists once. Nothing here imports Horovod or ``torch.distributed``.

Example, one rank (the average of a tensor is the tensor)::

    >>> from hvd_gradcomp.codecs.powersgd import PowerSGD
    >>> m = torch.outer(torch.arange(1.0, 65.0), torch.linspace(-1, 1, 32))   # rank 1
    >>> out = torch.empty_like(m)
    >>> run = low_rank_rounds(PowerSGD(rank=1, seed=0), [("w", m)], [out])
    >>> request = next(run)
    >>> while True:
    ...     try:
    ...         request = run.send(request.tensor)     # a transport would average it over ranks
    ...     except StopIteration:
    ...         break
    >>> request.tag, bool(torch.allclose(out, m, atol=1e-4))
    ('q', True)
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Dict, Generator, List, Optional, Sequence, Tuple, Union

import torch

from ..feedback import kernels
from .inflight import encode_or_flag
from .reduce import Parts, chunk_bounds, decode_flagged, sum_parts


@dataclass(frozen=True)
class Allreduce:
    """A request to the transport: ``tensor`` summed over the ranks (one allreduce), divided by their
    number when ``average``. ``tag`` names the round (Horovod matches collectives by name; the
    driver prefixes it). ``raw_bytes``: the gradient bytes it stands for, for the driver's byte
    ledger (:class:`~hvd_gradcomp.stats.ByteStats`); 0 where the driver counts its own."""

    tensor: torch.Tensor
    tag: str
    average: bool = True
    raw_bytes: int = 0


Payloads = List[List[Optional[torch.Tensor]]]
"""Payloads by rank, then by segment: ``received[r][j]``, rank ``r``'s payload of segment ``j``.
``None`` is a flag: the sender's input held NaN/Inf, and the payload stands for NaN."""


@dataclass(frozen=True)
class Scatter:
    """A request: ``payloads[r]`` (one payload per segment) sent to rank ``r``, this rank's own
    included, and what every rank sent to this one received (an alltoall). Result: :data:`Payloads`."""

    payloads: Payloads
    tag: str


@dataclass(frozen=True)
class Gather:
    """A request: ``payloads`` (one per segment) sent to every rank, and every rank's received, in
    rank order (an allgather). Result: :data:`Payloads`."""

    payloads: List[Optional[torch.Tensor]]
    tag: str


@dataclass(frozen=True)
class Together:
    """Requests issued at once, each its own collective, none waiting for another. Result: the
    list of their results, in order."""

    requests: Tuple[Allreduce, ...]


Request = Union[Allreduce, Scatter, Gather, Together]
Algorithm = Generator[Request, Any, None]
"""Yields the collectives it needs, is sent each one's result, returns when ``outs`` are written."""


def finish(run: Algorithm, result: Any) -> Any:
    """Send ``run`` the result of its last request; it must be done then (every rank issued the
    same collectives). Returns what the algorithm returns (:func:`sparse_allgather`: the parts)."""
    try:
        request = run.send(result)
    except StopIteration as done:
        return done.value
    raise RuntimeError(f"the exchange algorithm asked for one more collective ({request.tag!r}) than its driver "
                       "carries: driver and algorithm disagree")


def low_rank_rounds(compressor: Any, segments: Sequence[Tuple[str, torch.Tensor]], outs: Sequence[torch.Tensor],
                    scale: float = 1.0) -> Algorithm:
    """PowerSGD's two dependent rounds (:mod:`hvd_gradcomp.codecs.powersgd`) for ``segments`` (name,
    matrix-shaped gradient), written into ``outs`` (``scale`` times the average: 1, or the number
    of ranks for a sum). Every segment's ``P`` travels in one request, then every ``Q``.

    Each step of the generator uses the compressor (residuals, ``Q``): a driver whose callbacks
    run on other threads holds its lock around ``next`` and ``send``.
    """
    works = [compressor.first_round(name, grad) for name, grad in segments]
    p_average = yield Allreduce(_joined([w.send for w in works]), "p")
    q_sends = [compressor.second_round(w, part) for w, part in zip(works, _parts(p_average, [w.send for w in works]))]
    q_average = yield Allreduce(_joined(q_sends), "q")
    for w, part, out in zip(works, _parts(q_average, q_sends), outs):
        compressor.finish_rounds(w, part, out, scale)


def _joined(tensors: List[torch.Tensor]) -> torch.Tensor:
    """One flat tensor of ``tensors``: a view, with no copy, when there is one or when they lie end
    to end in one storage (a DDP bucket's segments), else their concatenation.

    >>> buffer = torch.arange(6.0)
    >>> _joined([buffer[:2], buffer[2:6]]).data_ptr() == buffer.data_ptr()
    True
    >>> _joined([buffer[:2], buffer[3:6]]).tolist()
    [0.0, 1.0, 3.0, 4.0, 5.0]
    """
    if len(tensors) == 1:
        return tensors[0].reshape(-1)
    if _end_to_end(tensors):
        first = tensors[0]
        return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(),
                                       (sum(t.numel() for t in tensors),))
    return torch.cat([t.reshape(-1) for t in tensors])


def _end_to_end(tensors: List[torch.Tensor]) -> bool:
    """Whether ``tensors`` are contiguous pieces of one storage, each starting where the last ended."""
    first = tensors[0]
    at = first.storage_offset()
    for t in tensors:
        if not (t.is_contiguous() and t.dtype == first.dtype and t.storage_offset() == at
                and t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()):
            return False
        at += t.numel()
    return True


def _parts(joined: torch.Tensor, like: List[torch.Tensor]) -> List[torch.Tensor]:
    """``joined`` cut back into flat pieces of the sizes of ``like``."""
    sizes = [t.numel() for t in like]
    if joined.numel() != sum(sizes):
        raise RuntimeError(f"an average of {joined.numel()} elements where {sum(sizes)} were sent: "
                           "ranks disagree on the model")
    return list(joined.reshape(-1).split(sizes))


def compressed_allreduce(compressor: Any, segments: Sequence[Tuple[str, torch.Tensor]], outs: Sequence[torch.Tensor],
                         world: int, rank: int, average: bool = True, flags: bool = True) -> Algorithm:
    """QSGD's compressed allreduce of ``segments`` (name, gradient) over ``world`` ranks, the
    average (or sum, ``average=False``) written into ``outs`` (flat, contiguous, one per segment).

    Each gradient is cut into ``world`` near-equal chunks (:func:`~hvd_gradcomp.collectives.reduce.chunk_bounds`)
    and quantised with the feedback policy on the whole tensor; chunk ``r`` goes to rank ``r``
    (:class:`Scatter`). This rank decodes the ``world`` payloads of its chunk in rank order, sums
    them and re-quantises the sum (``#reduced{rank}``, classic error feedback of its own); every
    rank's re-quantised chunk comes back by :class:`Gather` and is decoded into place. A rank
    sends about (1 + 1/world) times one payload, whatever ``world`` is.

    ``flags``: a gradient or a reduced chunk holding NaN/Inf travels as ``None`` and decodes to
    NaN on every rank (Horovod's envelopes carry the flag). ``False``: the driver checked its
    input for NaN/Inf first (DDP's bucket flag); a sum that overflows raises ``FloatingPointError``.

    Example, one rank (its chunks come back to it)::

        >>> from hvd_gradcomp.codecs.qsgd import QSGD
        >>> grad, out = torch.linspace(-1, 1, 1000), torch.empty(1000)
        >>> run = compressed_allreduce(QSGD(bits=8, seed=0), [("w", grad)], [out], world=1, rank=0)
        >>> scatter = next(run)
        >>> gather = run.send(scatter.payloads)
        >>> finish(run, [gather.payloads])
        >>> bool((out - grad).norm() < 0.1 * grad.norm())   # quantised twice, unbiased
        True
    """
    bounds = [chunk_bounds(grad.numel(), world) for _, grad in segments]
    chunks = [_chunks(compressor, name, grad, bd, flags) for (name, grad), bd in zip(segments, bounds)]
    received = yield Scatter([[c[r] for c in chunks] for r in range(world)], "scatter")
    _check_shape(received, world, len(segments))
    reduced = []
    for j, ((name, grad), bd) in enumerate(zip(segments, bounds)):
        numel = bd[rank + 1] - bd[rank]
        parts = decode_flagged(compressor, [received[r][j] for r in range(world)], numel, grad.device)
        mine = sum_parts(parts, average, numel, grad.dtype)
        relay = partial(compressor.compress_named, f"{name}#reduced{rank}", mine, relay=True)
        reduced.append(encode_or_flag(relay) if flags else relay())
    gathered = yield Gather(reduced, "gather")
    _check_shape(gathered, world, len(segments))
    for j, ((name, _), bd, out) in enumerate(zip(segments, bounds, outs)):
        for r, (b, e) in enumerate(zip(bd, bd[1:])):
            payload = gathered[r][j]
            chunk = torch.full((e - b,), float("nan"), device=out.device) if payload is None else \
                compressor.decode(payload).reshape(-1)
            if chunk.numel() != e - b:
                raise RuntimeError(f"{name}: chunk of {chunk.numel()} elements from rank {r} where {e - b} were "
                                   "expected; ranks disagree on the model")
            out[b:e].copy_(chunk)


def _chunks(compressor: Any, name: str, grad: torch.Tensor, bounds: List[int], flags: bool
            ) -> List[Optional[torch.Tensor]]:
    """This rank's payload of each chunk of ``grad``; all ``None`` when it held NaN/Inf (``flags``)."""
    if not flags:   # the driver checked the input: no second pass over it
        return compressor._compress_chunks_finite(name, grad, bounds)
    return encode_or_flag(compressor.compress_chunks, name, grad, bounds) or [None] * (len(bounds) - 1)


def _check_shape(payloads: Payloads, world: int, segments: int) -> None:
    """A collective's result must hold one payload per rank and segment."""
    if len(payloads) != world or any(len(p) != segments for p in payloads):
        raise RuntimeError(f"got {[len(p) for p in payloads]} payloads per rank from {len(payloads)} ranks where "
                           f"{segments} from each of {world} were expected: ranks disagree on this exchange")


def sparse_allgather(compressor: Any, segments: Sequence[Tuple[str, torch.Tensor]], outs: Sequence[torch.Tensor],
                     world: int, rank: int, average: bool = True,
                     sends: Optional[Sequence[Tuple[Optional[torch.Tensor], Any]]] = None) -> Algorithm:
    """The allgather of payloads (TopK, TopKQSGD, any codec declaring ``collective=ALLGATHER``) for
    ``segments`` (name, gradient), the average (or sum, ``average=False``) written into ``outs``.

    Each rank encodes each gradient (:meth:`GradientCompressor.compress_carried`; a gradient
    holding NaN/Inf travels as ``None`` and decodes to NaN on every rank) and every rank's payloads
    come back by :class:`Gather`. Each segment's parts are decoded in rank order, this rank's own
    taken as its encoder carried it (the same bits the others decode from its payload, so every
    rank sums the same parts in the same order: identical replicas), and summed into its out.
    ``sends``: (payload, carried) per segment when the driver encoded them itself (DDP: one
    finiteness verdict per bucket first). Returns each segment's parts, for the feedback
    policy's ``received`` (their :func:`~hvd_gradcomp.collectives.reduce.sparse_support`).

    Example, one rank::

        >>> from hvd_gradcomp.codecs.topk import TopK
        >>> out = torch.empty(8)
        >>> run = sparse_allgather(TopK(ratio=0.25, min_k=1), [("w", torch.arange(8.0))], [out], world=1, rank=0)
        >>> gather = next(run)
        >>> parts = finish(run, [gather.payloads])
        >>> out.tolist()
        [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 6.0, 7.0]
    """
    if sends is None:
        sends = [encode_or_flag(compressor.compress_carried, name, grad) or (None, None)
                 for name, grad in segments]
    gathered = yield Gather([payload for payload, _ in sends], "gather")
    _check_shape(gathered, world, len(segments))
    every: List[Parts] = []
    for j, ((_, grad), (payload, carried), out) in enumerate(zip(segments, sends, outs)):
        mine = (rank, carried) if payload is not None and isinstance(carried, tuple) else None
        parts = decode_flagged(compressor, [gathered[r][j] for r in range(world)], grad.numel(), out.device, mine)
        sum_parts(parts, average, out.numel(), grad.dtype, out=out)
        every.append(parts)
    return every


HALF = "fp16"
"""The tag of :func:`dense_fallback`'s float16 request (the tensors the compressor sends as float16)."""


def dense_fallback(compressor: Any, segments: Sequence[Tuple[str, torch.Tensor]], outs: Sequence[torch.Tensor],
                   world: int, min_compress_numel: int, average: bool = True, dense_steps: bool = True,
                   finite: Union[bool, Callable[[], bool]] = True,
                   opening: Optional[Callable[[str], None]] = None) -> Algorithm:
    """What a step does not compress, for ``segments`` (name, gradient): the average (or sum,
    ``average=False``) written into ``outs`` (a segment's own tensor may be its out).

    1. The feedback policy is told this rank's gradient of every tensor large enough to compress
       (:meth:`~GradientCompressor.dense_local`: its dense steps, ``feedback="frozen"``'s warm-up).
    2. Those the compressor sends as float16 (:meth:`~GradientCompressor.sends_half`; ``dense_steps``:
       whether a policy's dense steps may, see there) travel fused as one float16 tensor divided by
       the ranks first, so that its sum is the average and cannot overflow, with error feedback of
       the cast (:meth:`~GradientCompressor.encode_half`; ``finite=False``: this rank's input holds
       NaN/Inf, so a saturated cast and no residual kept; a callable is asked only when there is a
       float16 request, since nothing else depends on it). Request tag :data:`HALF`, summed.
    3. The others travel fused per dtype (tag: the dtype's name), averaged (or summed).
    4. Every result is written back and, tensor by tensor, handed to the policy
       (:meth:`~GradientCompressor.dense_average`).

    All requests leave together (:class:`Together`), sorted by tag: the same order on every rank.
    ``compressor`` None (no compression, or Horovod's own): step 3 alone. ``opening(name)``: called
    for each float16 tensor before its cast is encoded (stock Horovod opens the tensor's exchange
    step there, so that an abandoned step undoes what the cast kept back).

    Example, one rank (the average of a tensor is the tensor)::

        >>> from hvd_gradcomp.codecs.topk import TopKQSGD
        >>> bias, mask = torch.tensor([0.5, -2.0]), torch.tensor([1.0, 2.0], dtype=torch.float64)
        >>> run = dense_fallback(TopKQSGD(), [("b", bias), ("m", mask)], [bias, mask], world=1,
        ...                      min_compress_numel=1024)
        >>> [(r.tag, r.tensor.dtype) for r in next(run).requests]
        [('float64', torch.float64), ('fp16', torch.float16)]
    """
    groups: Dict[str, List[Tuple[int, str, torch.Tensor]]] = {}   # outs are read at the end: a driver may set them late
    for i, (name, grad) in enumerate(segments):
        small = grad.numel() < min_compress_numel
        if compressor is not None and not small:
            compressor.dense_local(name, grad)
        half = compressor is not None and compressor.sends_half(name, grad.dtype, small, dense_steps=dense_steps)
        groups.setdefault(HALF if half else str(grad.dtype).replace("torch.", ""), []).append((i, name, grad))
    if opening is not None:
        for _, name, _ in groups.get(HALF, ()):
            opening(name)
    tags = sorted(groups)
    results = yield Together(tuple(_dense_request(compressor, tag, groups[tag], world, average, finite)
                                   for tag in tags))
    for tag, result in zip(tags, results):
        flat, offset = result.reshape(-1), 0
        for i, name, _ in groups[tag]:
            out = outs[i]
            piece = flat[offset:offset + out.numel()].view_as(out)
            offset += out.numel()
            if piece.data_ptr() != out.data_ptr():   # averaged in place (a DDP bucket's own memory)
                out.copy_(piece)
            if tag == HALF and not average:   # the float16 sum is the average: the sum asked for
                out.mul_(world)
            if compressor is not None:   # the policy sees it before the user's code between exchange and step
                compressor.dense_average(name, out)


def _dense_request(compressor: Any, tag: str, group: List[Tuple[int, str, torch.Tensor]], world: int,
                   average: bool, finite: Union[bool, Callable[[], bool]]) -> Allreduce:
    """One fused request of :func:`dense_fallback`: float16 casts summed, or one dtype averaged."""
    raw = sum(grad.numel() * grad.element_size() for _, _, grad in group)
    if tag != HALF:
        return Allreduce(_joined([grad for _, _, grad in group]), tag, average, raw)
    if finite() if callable(finite) else finite:
        half, _ = compressor.encode_half([(name, grad) for _, name, grad in group], world)
    else:
        half, _ = kernels.to_half_saturated(torch.cat([grad.reshape(-1) for _, _, grad in group]), world)
    return Allreduce(half, HALF, False, raw)
