"""Simulated ranks in one process: :func:`simulate` drives one copy of an exchange algorithm
(:mod:`hvd_gradcomp.collectives.rounds`, :mod:`hvd_gradcomp.collectives.sparse_allreduce`) per
rank, answers each request as every rank's transport would, and counts the bytes each rank sends.
For tests and byte benchmarks at rank counts no machine here has; no timing, no transport.

Bytes a rank sends per request, payloads' own bytes (a driver's framing, Horovod's envelopes or
DDP's flags and padding, left out; a ``None`` flag counts 0), as
:func:`hvd_gradcomp.auto.policy.wire_bytes` models them:

* :class:`~hvd_gradcomp.collectives.rounds.Scatter` (alltoall): its payloads to the other ranks;
* :class:`~hvd_gradcomp.collectives.rounds.Gather` (ring allgather: a rank forwards every payload
  but the next rank's, which that rank holds): the sum of every rank's payloads less the next
  rank's;
* :class:`~hvd_gradcomp.collectives.rounds.Allreduce` (ring): ``2 (P-1) / P`` times the tensor's bytes;
* :class:`~hvd_gradcomp.collectives.rounds.Together`: the sum of its requests'.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence, Tuple

import torch

from .rounds import Algorithm, Allreduce, Gather, Request, Scatter, Together


@dataclass
class Traffic:
    """What :func:`simulate` counted: per request, its tag and the bytes each rank sent."""

    tags: List[str] = field(default_factory=list)
    sent: List[List[float]] = field(default_factory=list)

    def per_rank(self) -> List[float]:
        """Bytes each rank sent over the whole exchange."""
        return [sum(column) for column in zip(*self.sent)] if self.sent else []

    def most(self) -> float:
        """The most bytes any rank sent (the link that limits the step)."""
        return max(self.per_rank(), default=0.0)


def simulate(runs: Sequence[Algorithm]) -> Tuple[List[Any], Traffic]:
    """Every rank's algorithm (``runs[r]``: rank ``r``'s generator) to its end in lockstep; what each
    returned, and the :class:`Traffic`. Ranks must ask for the same collectives (kind and tag) in
    the same order, as a transport requires; else ``RuntimeError``.

    >>> from hvd_gradcomp.codecs.topk import TopK
    >>> from hvd_gradcomp.collectives.rounds import sparse_allgather
    >>> grads, outs = [torch.tensor([4.0, 0, 0, 1]), torch.tensor([0, 2.0, 0, 1])], [torch.empty(4), torch.empty(4)]
    >>> runs = [sparse_allgather(TopK(ratio=0.25, min_k=1), [("w", g)], [o], 2, r, average=False)
    ...         for r, (g, o) in enumerate(zip(grads, outs))]
    >>> _, traffic = simulate(runs)
    >>> outs[0].tolist(), traffic.tags, traffic.per_rank()     # each rank forwards the other's 64-byte payload
    ([4.0, 2.0, 0.0, 0.0], ['gather'], [64, 64])
    """
    world, traffic = len(runs), Traffic()
    results: List[Any] = [None] * world
    requests: List[Optional[Request]] = [next(r) for r in runs]
    while True:
        _check_same(requests)
        answers, sent = _execute(requests, world)   # type: ignore[arg-type]
        traffic.tags.append(requests[0].tag if not isinstance(requests[0], Together) else "together")
        traffic.sent.append(sent)
        done = 0
        for r, run in enumerate(runs):
            try:
                requests[r] = run.send(answers[r])
            except StopIteration as stop:
                results[r], requests[r], done = stop.value, None, done + 1
        if done:
            if done != world:
                raise RuntimeError(f"{done} of {world} ranks finished, the others asked for more collectives")
            return results, traffic


def _check_same(requests: List[Optional[Request]]) -> None:
    kinds = {(type(q).__name__, _tags(q)) for q in requests}
    if len(kinds) != 1:
        raise RuntimeError(f"ranks asked for different collectives: {sorted(kinds)}")


def _tags(q: Any) -> Tuple[str, ...]:
    return tuple(p.tag for p in q.requests) if isinstance(q, Together) else (q.tag,)


def _execute(requests: List[Request], world: int) -> Tuple[List[Any], List[float]]:
    """Each rank's answer to ``requests`` (one per rank, all of one kind) and the bytes it sent."""
    first = requests[0]
    if isinstance(first, Together):
        each = [_execute([q.requests[i] for q in requests], world) for i in range(len(first.requests))]  # type: ignore[union-attr]
        return ([[answers[r] for answers, _ in each] for r in range(world)],
                [sum(sent[r] for _, sent in each) for r in range(world)])
    if isinstance(first, Allreduce):
        total = torch.stack([q.tensor for q in requests]).sum(0)   # type: ignore[union-attr]
        result = total / world if first.average else total
        ring = 2.0 * (world - 1) / world * first.tensor.numel() * first.tensor.element_size()
        return [result.clone() for _ in range(world)], [ring] * world
    if isinstance(first, Scatter):
        answers = [[q.payloads[me] for q in requests] for me in range(world)]   # type: ignore[union-attr]
        sent = [sum(_nbytes(seg) for dst, segs in enumerate(q.payloads) if dst != src for seg in segs)   # type: ignore[union-attr]
                for src, q in enumerate(requests)]
        return answers, sent
    if isinstance(first, Gather):
        every = [list(q.payloads) for q in requests]   # type: ignore[union-attr]
        sizes = [sum(_nbytes(p) for p in payloads) for payloads in every]
        total = sum(sizes)
        return [every] * world, [total - sizes[(r + 1) % world] if world > 1 else 0 for r in range(world)]
    raise TypeError(f"no simulated transport for {type(first).__name__}")


def _nbytes(payload: Optional[torch.Tensor]) -> int:
    return 0 if payload is None else payload.numel() * payload.element_size()
