"""Exchange algorithms written once, whatever carries them: a generator per algorithm.

An algorithm here knows the codec and the order of its collectives, not how they travel: it
*yields* each collective it needs (an :class:`Average` request) and is *sent* the result.
A driver issues each request on its :mod:`~hvd_gradcomp.transport` (Horovod's handles, or
``torch.distributed``'s futures) at the moment its own road allows, and sends the result back:

* :class:`hvd_gradcomp.exchange.RoundsExchange` runs :func:`low_rank_rounds` for one tensor on
  ``hvd_gradcomp.DistributedOptimizer`` (``start`` / ``advance`` / ``finish``);
* :func:`hvd_gradcomp.ddp_roads._rounds` runs it for a DDP bucket's matrices, the second
  request issued in bucket order on the hook's second process group.

So PowerSGD's choreography (P averaged, orthogonalised, Q computed from it, Q averaged, the
approximation written) exists once. Nothing here imports Horovod or ``torch.distributed``.

Example, one rank (the average of a tensor is the tensor)::

    >>> from hvd_gradcomp.powersgd import PowerSGD
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
from typing import Any, Generator, List, Sequence, Tuple

import torch


@dataclass(frozen=True)
class Average:
    """A request to the transport: ``tensor`` averaged over the ranks (one allreduce). ``tag``
    names the round (Horovod matches collectives by name; the driver prefixes it)."""

    tensor: torch.Tensor
    tag: str


Algorithm = Generator[Average, torch.Tensor, None]
"""Yields the collectives it needs, is sent each one's result, returns when ``outs`` are written."""


def low_rank_rounds(compressor: Any, segments: Sequence[Tuple[str, torch.Tensor]], outs: Sequence[torch.Tensor],
                    scale: float = 1.0) -> Algorithm:
    """PowerSGD's two dependent rounds (:mod:`hvd_gradcomp.powersgd`) for ``segments`` (name,
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
