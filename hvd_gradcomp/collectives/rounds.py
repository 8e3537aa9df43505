"""Exchange algorithms written once, whatever carries them: a generator per algorithm.

An algorithm here knows the codec and the order of its collectives, not how they travel: it
*yields* each collective it needs (a request: :class:`Average`, :class:`Scatter`,
:class:`Gather`) and is *sent* the result. A driver issues each request on its transport
(Horovod's handles, or ``torch.distributed``'s futures) at the moment its own road allows, in
its own framing (Horovod's envelopes; DDP's equal-sized collectives after a flag per rank), and
sends the result back; :func:`finish` sends the last one.

* :func:`low_rank_rounds`, PowerSGD's two dependent allreduces, driven by
  :class:`hvd_gradcomp.collectives.exchange.RoundsExchange` (one tensor, ``start`` / ``advance`` /
  ``finish``) and :func:`hvd_gradcomp.ddp.roads._rounds` (a DDP bucket's matrices, the second
  request issued in bucket order on the hook's second process group);
* :func:`compressed_allreduce`, QSGD's scatter-reduce (alltoall of quantised chunks, each rank
  reduces and re-quantises its chunk, allgather), driven by
  :class:`hvd_gradcomp.collectives.exchange.ScatterReduceExchange` and
  :func:`hvd_gradcomp.ddp.roads._scatter_reduce`.

So each choreography (P averaged, orthogonalised, Q computed from it...; chunks decoded, summed,
re-quantised, gathered...) exists once. Nothing here imports Horovod or ``torch.distributed``.

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
from typing import Any, Generator, List, Optional, Sequence, Tuple, Union

import torch

from .reduce import chunk_bounds, decode_flagged, sum_parts


@dataclass(frozen=True)
class Average:
    """A request to the transport: ``tensor`` averaged over the ranks (one allreduce). ``tag``
    names the round (Horovod matches collectives by name; the driver prefixes it)."""

    tensor: torch.Tensor
    tag: str


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


Request = Union[Average, Scatter, Gather]
Algorithm = Generator[Request, Any, None]
"""Yields the collectives it needs, is sent each one's result, returns when ``outs`` are written."""


def finish(run: Algorithm, result: Any) -> None:
    """Send ``run`` the result of its last request; it must be done then (every rank issued the
    same collectives)."""
    try:
        request = run.send(result)
    except StopIteration:
        return
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
    p_average = yield Average(_joined([w.send for w in works]), "p")
    q_sends = [compressor.second_round(w, part) for w, part in zip(works, _parts(p_average, [w.send for w in works]))]
    q_average = yield Average(_joined(q_sends), "q")
    for w, part, out in zip(works, _parts(q_average, q_sends), outs):
        compressor.finish_rounds(w, part, out, scale)


def _joined(tensors: List[torch.Tensor]) -> torch.Tensor:
    """One flat tensor of ``tensors`` (the tensor itself, flat, when there is one: no copy)."""
    if len(tensors) == 1:
        return tensors[0].reshape(-1)
    return torch.cat([t.reshape(-1) for t in tensors])


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
        reduced.append(_flagged(relay) if flags else relay())
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
    return _flagged(lambda: compressor.compress_chunks(name, grad, bounds)) or [None] * (len(bounds) - 1)


def _flagged(encode: Any) -> Any:
    """``encode()``, or None when its input held NaN/Inf (the codec then changed nothing)."""
    try:
        return encode()
    except FloatingPointError:
        return None


def _check_shape(payloads: Payloads, world: int, segments: int) -> None:
    """A collective's result must hold one payload per rank and segment."""
    if len(payloads) != world or any(len(p) != segments for p in payloads):
        raise RuntimeError(f"got {[len(p) for p in payloads]} payloads per rank from {len(payloads)} ranks where "
                           f"{segments} from each of {world} were expected: ranks disagree on this exchange")
