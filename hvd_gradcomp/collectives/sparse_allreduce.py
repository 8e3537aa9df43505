"""A sparse allreduce whose bytes per rank stay O(k) as ranks are added (issue 62): Ok-Topk's
exchange (Li and Hoefler, PPoPP 2022), written once as a generator beside
:mod:`hvd_gradcomp.collectives.rounds`' algorithms (it yields :class:`~hvd_gradcomp.collectives.rounds.Scatter`
and :class:`~hvd_gradcomp.collectives.rounds.Gather`, nothing new for a driver to implement).

Today's sparse exchange allgathers every rank's top-k payload: each rank forwards (P-1) payloads,
so past a few hundred ranks it moves more bytes than a dense allreduce. Here the index space is
cut into P *regions*, one per rank (its *owner*):

1. **Select.** Each rank selects its top-k through the codec, with its feedback policy
   (:meth:`~hvd_gradcomp.codecs.compressor.GradientCompressor.compress_carried`: gradient +
   residual in, the policy told what was selected); the codec's own payload is not sent, its
   carried ``(indices, values)`` are (for TopKQSGD: the quantised values, as float32).
2. **Route** (one :class:`Scatter`, tag ``"route"``): the pairs of region ``o`` go to rank ``o``.
3. **Reduce and select** on each owner: the pairs from every rank summed in rank order (float32),
   and the owner keeps the :func:`owner_budget` largest non-zero sums of its distinct indices.
4. **Gather** (one :class:`Gather`, tag ``"gather"``): every owner's kept (index, sum) pairs to every
   rank, which writes them into its out (divided by the ranks for an average), zeros elsewhere.
   Every rank decodes the same bytes in the same order: identical bits on every rank.

**Budget.** A rank sends exactly k pairs, so the owners receive P*k in all; owner ``o``, having
received ``c_o`` of them, keeps at most ``ceil(c_o / P)``: the global budget k split in
proportion to where the ranks' selections fell, known to each owner without another collective.
Kept in all: K <= k + P - 1 (each ceiling adds less than one). Not a global threshold (Ok-Topk's):
that needs an estimate agreed on by every rank and bounds nothing in the step it is wrong; an
equal budget per region (k / P) needs regions that hold equal shares of the large values, which
the balancer only approaches after the fact, and would cap a region where many ranks agree.

**Second phase not re-quantised.** The kept sums travel as float32, so the result is exactly the
sum of what the ranks sent at the kept indices (re-quantising, as
:func:`~hvd_gradcomp.collectives.rounds.compressed_allreduce` does its chunk, would need a residual
per owner and save 3 bytes of 8 per kept pair).

**Wire.** A pair is 8 bytes: int32 index relative to its region's start, then the float32 value's
bits (:func:`encode_pairs`). No header: a payload's length gives its count, so no bytes grow
with P per destination (a codec header, 40 bytes, to each of 1,024 owners would outweigh the
pairs of a small tensor). Bytes each rank sends (a ring allgather forwards every payload but one):

    8 * (k - pairs it owns itself)  +  8 * (K - the kept pairs of the next rank)
    ~ 8 * (P - 1) / P * (k + K) <= 16 k + 8 (P - 1),

against (P - 1) times a top-k payload for the allgather
(:func:`hvd_gradcomp.auto.policy.sparse_allreduce_bytes` models it). A driver's own framing
(Horovod's envelopes, DDP's split sizes) comes on top, as for every exchange.

**Region bounds** start equal (:func:`~hvd_gradcomp.collectives.reduce.chunk_bounds`); a
:class:`Balancer` moves them every few steps to the quantiles of the indices the global selection
kept (Ok-Topk re-balances from where the indices fell). Kept indices fall where the ranks'
selections fall (each owner keeps 1/P of what it receives), so equal shares of them balance both
the pairs each owner receives and sums (its work and its bytes in) and those it sends. Computed
from the gathered selection alone, the bounds are the same on every rank (a step with a NaN
region is not observed; a balancer is not checkpointed yet: after a restart every rank starts
from equal regions again).

**Error feedback.** A value a rank sent whose index the global selection dropped goes back into
that rank's residual, so no gradient is lost: with classic error feedback, summed over ranks,
``residual_after + what the result holds == gradient + residual_before`` (exactly for TopK,
whose sent value is the accumulated one; to float32 rounding for TopKQSGD). Done by
:func:`return_to_residual` on the policy's :class:`~hvd_gradcomp.feedback.ResidualStore` (every
:class:`~hvd_gradcomp.feedback.ErrorFeedback` policy keeps ``acc - sent`` there); ``feedback="none"``
keeps no residual, and what it drops is lost, as on its other exchanges. ``MomentumCorrection`` with
its masking cleared the velocity of every coordinate it sent, dropped ones too (their value stays
in the residual). A driver then hands the average to
:meth:`~hvd_gradcomp.codecs.compressor.GradientCompressor.received` with the support this
algorithm returns (the kept indices); inside an optimizer, a step whose result is non-finite
puts the previous residuals back (``end_round(keep=False)``), as on every exchange.

**Non-finite.** A rank whose gradient holds NaN/Inf sends every owner the flag ``None`` (the codec
raised before touching its residual, as :func:`~hvd_gradcomp.collectives.inflight.encode_or_flag`
does on every exchange); an owner that received a flag, or whose sum overflows, sends ``None``, and
every rank writes NaN over that owner's region: the same non-finite result on every rank, so every
loss scaler skips the step; the pairs a rank sent into such a region go back to its residual.
``flags=False`` (a driver that checked its inputs): an overflowing sum raises
``FloatingPointError``. Both drivers below pass ``flags=True``.

**Drivers** (a codec takes this exchange with ``TopK(..., exchange="allreduce")``, whose declared
collective is then :data:`~hvd_gradcomp.codecs.SPARSE_ALLREDUCE`):
:class:`~hvd_gradcomp.collectives.exchange.SparseAllreduceExchange` (``hvd_gradcomp.DistributedOptimizer``:
the Scatter as ``hvd.alltoall`` with splits, the Gather as ``hvd.allgather``, behind its envelopes; a
joined rank makes the step dense among the others) and :func:`hvd_gradcomp.ddp.exchanges._sparse_allreduce`
(the DDP hook: counts by ``all_to_all_single`` and a MAX allreduce, the pairs by ``all_to_all_single``,
the owners' selections by an ``all_gather`` padded to the agreed bound behind a header). Stock
``hvd.DistributedOptimizer`` refuses it (:func:`hvd_gradcomp.horovod.stock.refuse_rounds`).
:func:`hvd_gradcomp.collectives.simulate.simulate` drives it with simulated ranks in one process.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .. import wire
from ..codecs.compressor import GradientCompressor
from ..feedback import ErrorFeedback
from .inflight import encode_or_flag
from .reduce import chunk_bounds
from .rounds import Algorithm, Gather, Payloads, Scatter, _check_shape

PAIR_BYTES = 8
"""Bytes of one (index, value) pair on the wire: int32 index in its region, float32 value."""

MAX_NUMEL = (1 << 31) - 1
"""The largest tensor the pairs can index (int32, relative to a region that may span it all)."""

Returned = Callable[[str, torch.Tensor, torch.Tensor], None]
"""``returned(name, indices, values)``: this rank's sent values the global selection dropped."""


def encode_pairs(idx: torch.Tensor, vals: torch.Tensor, start: int) -> torch.Tensor:
    """``(idx, vals)`` (global indices of one region starting at ``start``) as flat uint8 payload,
    8 bytes per pair, interleaved so that many payloads concatenated decode in one pass.

    >>> p = encode_pairs(torch.tensor([10, 12]), torch.tensor([1.5, -2.0]), start=10)
    >>> p.numel(), [t.tolist() for t in decode_pairs(p, 4)]
    (16, [[0, 2], [1.5, -2.0]])
    """
    rel = (idx - start).to(torch.int32)
    pairs = torch.stack([rel, vals.to(torch.float32).view(torch.int32)], dim=1)
    return pairs.view(torch.uint8).reshape(-1)


def decode_pairs(payload: torch.Tensor, length: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`encode_pairs`: (int64 indices relative to the region, float32 values);
    raises :class:`~hvd_gradcomp.wire.WireFormatError` for a payload that cannot hold pairs of a
    region of ``length`` indices."""
    if payload.numel() % PAIR_BYTES:
        raise wire.WireFormatError(f"a pair payload of {payload.numel()} bytes, not a multiple of {PAIR_BYTES}")
    words = wire.from_bytes(payload, torch.int32).view(-1, 2)
    idx, vals = words[:, 0].to(torch.int64), words[:, 1].contiguous().view(torch.float32)
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= length):
        raise wire.WireFormatError(f"a pair index outside its region of {length}: ranks disagree on the region bounds")
    return idx, vals


def owner_budget(received: int, world: int) -> int:
    """How many sums an owner keeps of the ``received`` pairs sent to it: ``ceil(received / world)``
    (the budget k in proportion to the owner's share of the ``world * k`` pairs sent).

    >>> owner_budget(1000, 8), owner_budget(3, 8), owner_budget(0, 8)
    (125, 1, 0)
    """
    return -(-received // world)


class Balancer:
    """Region bounds of each tensor, the same on every rank: equal at first, then, every ``every``
    steps, moved to the quantiles of the indices the global selection kept over those steps
    (:meth:`observe`, fed the gathered selection: identical on every rank). Each rank holds one.

    >>> b = Balancer(world=2, every=1)
    >>> b.bounds("w", 10)
    [0, 5, 10]
    >>> b.observe("w", 10, torch.tensor([0, 1, 2, 3, 9]))
    >>> b.bounds("w", 10)     # half of the kept indices below 2, half from it
    [0, 2, 10]
    """

    def __init__(self, world: int, every: int = 4) -> None:
        if world < 1 or every < 1:
            raise ValueError(f"a balancer needs world >= 1 and every >= 1, got {world}, {every}")
        self.world, self.every = world, every
        self._bounds: Dict[str, List[int]] = {}
        self._window: Dict[str, List[torch.Tensor]] = {}

    def bounds(self, name: str, numel: int) -> List[int]:
        """The region bounds of ``name``: ``world + 1`` non-decreasing offsets from 0 to ``numel``."""
        bounds = self._bounds.get(name)
        if bounds is None or bounds[-1] != numel:
            bounds = self._bounds[name] = chunk_bounds(numel, self.world)
        return list(bounds)

    def observe(self, name: str, numel: int, kept: torch.Tensor) -> None:
        """The global indices the selection of ``name`` kept this step (the same on every rank)."""
        window = self._window.setdefault(name, [])
        window.append(kept.detach().to("cpu", torch.int64))
        if len(window) < self.every:
            return
        seen = torch.cat(window).sort().values
        window.clear()
        if seen.numel():
            picks = [(o * seen.numel()) // self.world for o in range(1, self.world)]
            self._bounds[name] = [0] + seen[picks].tolist() + [numel]


def return_to_residual(compressor: GradientCompressor) -> Returned:
    """The default error-feedback rule: the dropped values are added back, in place, into the
    residual the compressor's policy committed this step (``acc - sent``), so that it holds
    ``acc - what the result kept``. A policy without residuals (``feedback="none"``) loses them."""
    def returned(name: str, idx: torch.Tensor, vals: torch.Tensor) -> None:
        policy = compressor.feedback
        residual, _ = policy.residuals.scaled(name, None)   # as stored: committed at this step's rate
        if isinstance(policy, ErrorFeedback) and residual is not None:
            residual.index_add_(0, idx.to(residual.device), vals.to(residual.dtype))
    return returned


def sparse_allreduce(compressor: GradientCompressor, segments: Sequence[Tuple[str, torch.Tensor]],
                     outs: Sequence[torch.Tensor], world: int, rank: int, average: bool = True, flags: bool = True,
                     balancer: Optional[Balancer] = None, returned: Optional[Returned] = None) -> Algorithm:
    """The sparse allreduce of ``segments`` (name, gradient) with a top-k codec (TopK, TopKQSGD)
    over ``world`` ranks, the average (or sum, ``average=False``) of what the global selection kept
    written into ``outs`` (flat, contiguous, one per segment); see the module docstring.

    Yields a :class:`Scatter` (tag ``"route"``: this rank's pairs of region ``o`` to rank ``o``)
    then a :class:`Gather` (tag ``"gather"``: this rank's kept sums of its own region). Returns,
    per segment, the global indices kept (the support to hand to ``received``), or None where a
    region's result is NaN. Error feedback: what this rank sent and the global selection dropped
    (or a NaN region took) is handed to ``returned`` (default: :func:`return_to_residual`).
    ``balancer``: the region bounds (default: equal, every step); it is told what was kept.

    Example, one rank (it owns every index; it keeps its own top-k)::

        >>> from hvd_gradcomp.codecs.topk import TopK
        >>> from hvd_gradcomp.collectives.rounds import finish
        >>> out = torch.empty(8)
        >>> run = sparse_allreduce(TopK(ratio=0.25, min_k=1), [("w", torch.arange(8.0))], [out], world=1, rank=0)
        >>> route = next(run)
        >>> gather = run.send(route.payloads)
        >>> [kept.tolist() for kept in finish(run, [gather.payloads])], out.tolist()
        ([[6, 7]], [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 6.0, 7.0])
    """
    returned = returned or return_to_residual(compressor)
    for name, grad in segments:
        if grad.numel() > MAX_NUMEL:
            raise ValueError(f"{name}: {grad.numel()} elements; the pairs' int32 indices reach {MAX_NUMEL}")
    bounds = [balancer.bounds(name, grad.numel()) if balancer else chunk_bounds(grad.numel(), world)
              for name, grad in segments]
    sent = [_select(compressor, name, grad, flags) for name, grad in segments]
    routes = [_route(s, bd, grad.device) for s, bd, (_, grad) in zip(sent, bounds, segments)]
    received = yield Scatter([[r[o] for r in routes] for o in range(world)], "route")
    _check_shape(received, world, len(segments))
    mine = [_reduce_region([received[r][j] for r in range(world)], bd[rank + 1] - bd[rank], world, flags, name)
            for j, ((name, _), bd) in enumerate(zip(segments, bounds))]
    gathered: Payloads = yield Gather(mine, "gather")
    _check_shape(gathered, world, len(segments))
    every = []
    for j, ((name, grad), bd, out, s) in enumerate(zip(segments, bounds, outs, sent)):
        kept, flagged = _write(out, [gathered[r][j] for r in range(world)], bd, world if average else 1)
        _return_dropped(name, s, kept, out.numel(), returned)
        if balancer is not None and not flagged:
            balancer.observe(name, grad.numel(), kept)
        every.append(None if flagged else kept)
    return every


def _select(compressor: GradientCompressor, name: str, grad: torch.Tensor, flags: bool
            ) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """This rank's selected ``(indices, values)`` as its policy was told; None: its input held NaN/Inf."""
    def carried() -> Tuple[torch.Tensor, torch.Tensor]:
        return compressor.compress_carried(name, grad)[1]
    what = encode_or_flag(carried) if flags else carried()
    if what is not None and not (isinstance(what, tuple) and what[0] is not None):
        raise TypeError(f"sparse_allreduce needs a top-k codec (TopK, TopKQSGD); {type(compressor).__name__} "
                        "sent a dense payload")
    return what


def _route(sent: Optional[Tuple[torch.Tensor, torch.Tensor]], bounds: List[int], device: torch.device
           ) -> List[Optional[torch.Tensor]]:
    """This rank's payload to each owner: its pairs in that owner's region (empty where none fell);
    all ``None`` (the non-finite flag) when it has none to send. Encoded in one pass and cut into
    views: at 1,024 ranks a pass per owner would cost more than the selection."""
    world = len(bounds) - 1
    if sent is None:
        return [None] * world
    idx, vals = sent
    starts = torch.tensor(bounds[:world], dtype=torch.int64, device=idx.device)
    owner = torch.bucketize(idx, starts[1:], right=True)   # bounds[o] <= i < bounds[o + 1]; empty regions skipped
    order = torch.argsort(owner, stable=True)
    owner, idx, vals = owner[order], idx[order], vals[order]
    counts = torch.bincount(owner, minlength=world).mul_(PAIR_BYTES).tolist()
    return list(encode_pairs(idx - starts[owner], vals, 0).split(counts))


def _reduce_region(payloads: List[Optional[torch.Tensor]], length: int, world: int, flags: bool, name: str
                   ) -> Optional[torch.Tensor]:
    """This owner's kept sums: every rank's pairs of its region summed in rank order, the
    :func:`owner_budget` largest non-zero ones kept; None (the flag) when a rank flagged or a sum
    is not finite."""
    if any(p is None for p in payloads):
        return None
    if any(p.numel() % PAIR_BYTES for p in payloads):   # checked apart: concatenated, two could look whole
        raise wire.WireFormatError(f"{name}: a pair payload whose size is not a multiple of {PAIR_BYTES} bytes")
    device = payloads[0].device
    idx, vals = decode_pairs(torch.cat(payloads), length)
    # rank order: the payloads are concatenated in it, each rank's indices distinct, and index_add_
    # adds in order on the CPU; on a GPU the order is the atomics', but only this owner sums: every
    # rank gets its bits through the gather.
    acc = torch.zeros(length, dtype=torch.float32, device=device).index_add_(0, idx, vals)
    cand = torch.unique(idx)
    sums = acc[cand]
    if not bool(torch.isfinite(sums).all()):
        if not flags:
            raise FloatingPointError(f"{name}: a sum of the ranks' sparse values overflows float32")
        return None
    cand, sums = cand[sums != 0], sums[sums != 0]    # a zero sum changes nothing: no budget for it
    budget = owner_budget(idx.numel(), world)
    if cand.numel() > budget:
        top = torch.topk(sums.abs(), budget, sorted=False).indices.sort().values
        cand, sums = cand[top], sums[top]
    return encode_pairs(cand, sums, 0)


def _write(out: torch.Tensor, payloads: List[Optional[torch.Tensor]], bounds: List[int], divisor: int
           ) -> Tuple[torch.Tensor, bool]:
    """Every owner's kept sums written into ``out`` (divided by ``divisor``), zeros elsewhere and NaN
    over a flagged owner's region; (the kept global indices, whether a region is NaN)."""
    flat = out.view(-1)
    flat.zero_()
    idx, vals = _kept(payloads, bounds, flat.device)
    flat[idx] = (vals / divisor if divisor != 1 else vals).to(flat.dtype)
    flagged = [(b, e) for p, b, e in zip(payloads, bounds, bounds[1:]) if p is None]
    for b, e in flagged:
        flat[b:e] = float("nan")
    return idx, bool(flagged)


def _kept(payloads: List[Optional[torch.Tensor]], bounds: List[int], device: torch.device
          ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Every owner's kept pairs (flagged ones skipped), global indices, decoded in one pass."""
    owners = [o for o, p in enumerate(payloads) if p is not None]
    if not owners:
        return torch.zeros(0, dtype=torch.int64, device=device), torch.zeros(0, device=device)
    sizes = [payloads[o].numel() for o in owners]   # type: ignore[union-attr]
    if any(n % PAIR_BYTES for n in sizes):
        raise wire.WireFormatError(f"a kept-pairs payload whose size is not a multiple of {PAIR_BYTES} bytes")
    idx, vals = decode_pairs(torch.cat([payloads[o] for o in owners]).to(device), 1 << 31)   # type: ignore[misc]
    which = torch.arange(len(owners), device=device).repeat_interleave(torch.tensor(sizes, device=device) // PAIR_BYTES)
    ranges = torch.tensor([[bounds[o], bounds[o + 1]] for o in owners], dtype=torch.int64, device=device)[which]
    idx = idx + ranges[:, 0]
    if bool((idx >= ranges[:, 1]).any()):
        raise wire.WireFormatError("a kept index outside its owner's region: ranks disagree on the region bounds")
    return idx, vals


def _return_dropped(name: str, sent: Optional[Tuple[torch.Tensor, torch.Tensor]], kept: torch.Tensor,
                    numel: int, returned: Returned) -> None:
    """Hand ``returned`` what this rank sent whose index the global selection did not keep (a
    region that came back NaN kept nothing)."""
    if sent is None:   # flagged: the codec changed nothing of this rank's state
        return
    idx, vals = sent
    mask = torch.zeros(numel, dtype=torch.bool, device=idx.device)
    mask[kept.to(idx.device)] = True
    dropped = ~mask[idx]
    if bool(dropped.any()):
        returned(name, idx[dropped], vals[dropped])
