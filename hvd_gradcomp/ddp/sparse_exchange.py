"""How the DDP driver of the sparse allreduce (issue 62,
:func:`hvd_gradcomp.ddp.exchanges._sparse_allreduce`) frames its collectives; the driver carries
:func:`hvd_gradcomp.collectives.sparse_allreduce.sparse_allreduce` (Ok-Topk's exchange, chosen by
``TopK(..., exchange="allreduce")`` / ``TopKQSGD(..., exchange="allreduce")``) over ``torch.distributed``.

How a bucket's compressed segments travel (bytes per rank O(k), flat in the ranks, but for the
framing below, which is O(P) int64s):

1. In the hook, blocking (small): an ``all_to_all_single`` of each rank's pair counts per
   (owner, segment) (-1: this rank flags the segment, its gradient holds NaN/Inf), then an
   ``all_reduce(MAX)`` of two int64s: the largest gather contribution any owner can have (its
   :func:`~hvd_gradcomp.collectives.sparse_allreduce.owner_budget` of the pairs it receives, known
   from the counts) and whether any rank flagged. Gloo, NCCL and MPI all carry ``all_to_all_single``
   with uneven splits (checked on Gloo, torch 2.13, with a 3-process probe).
2. The route (the algorithm's ``Scatter``): one ``all_to_all_single`` of the pairs with those
   splits, on the hook's group, issued in bucket order from the hook's thread.
3. The gather (its ``Gather``), in bucket order on the second group: every owner's kept pairs, behind
   a header of one int32 per segment (its kept pairs; -1: the owner's sum overflowed), padded to the
   bound of step 1, in one ``all_gather``: no round of sizes after the reduction.

Non-finite: a rank whose bucket holds NaN/Inf encodes nothing (its residuals untouched) and sends
-1 counts; every rank learns it from the MAX of step 1 and skips the route and the gather: the
bucket is NaN on every rank (its dense part still averaged, as on the other drivers) and the ranks
that had selected give what they sent back to their residuals (the algorithm's convention: nothing
of their gradient is lost). An owner whose sum overflows flags its region in the gather header:
the whole bucket is NaN on every rank too.

The region bounds of every tensor come from the state's
:class:`~hvd_gradcomp.collectives.sparse_allreduce.Balancer`, fed the gathered selection: the same on
every rank (it is not checkpointed: a resumed run starts from equal regions again, so a resume is not
bit-identical to an uninterrupted run with this exchange). Under ``model.join()`` a step where some rank
joined travels dense, as for every compressed exchange (:mod:`hvd_gradcomp.ddp.join`).

Ledger: the pairs each rank sends to the other ranks and its own kept pairs (payload), the counts,
the MAX, the gather header and its padding (framing ``(counts+padding)``): what it hands to the
collectives, as the other drivers count (an ``all_gather``'s input once, not the ring's forwarding).
On the wire its pairs are 8 bytes against a top-k payload's ~6 (TopK's delta-coded indices) or ~2.5
(TopKQSGD, 8 bits): it sends fewer bytes per rank than the allgather, which forwards ``P - 1``
payloads, from about 4 (TopK) or 7 (TopKQSGD) ranks on (tests/test_ddp_sparse_allreduce.py measures
the growth from 2 to 3 ranks).
"""
# No `from __future__ import annotations`: as in hvd_gradcomp.ddp.
from typing import List, Optional

import torch

from ..collectives.sparse_allreduce import PAIR_BYTES, owner_budget

Payloads = List[List[Optional[torch.Tensor]]]
"""Payloads per (rank, segment); None: flagged."""


def gather_bound(got: torch.Tensor, world: int) -> int:
    """The bytes of this owner's gather input at most (header, then its
    :func:`~hvd_gradcomp.collectives.sparse_allreduce.owner_budget` of the pairs it receives per segment),
    from the counts it received (bytes per (rank, segment), -1: flagged).

    >>> gather_bound(torch.tensor([[80, -1], [160, 8]]), world=2)   # 30 pairs, 1 pair: 15 + 1 kept at most
    136
    """
    n = got.shape[1]
    pairs = (got.clamp(min=0).sum(dim=0) // PAIR_BYTES).tolist()
    return _header_bytes(n) + PAIR_BYTES * sum(owner_budget(int(c), world) for c in pairs)


def counts_of(route: Optional[Payloads], world: int, n: int, device: torch.device) -> torch.Tensor:
    """Bytes of this rank's pairs per (owner, segment); -1 where it flags (its bucket holds NaN/Inf)."""
    if route is None:
        return torch.full((world, n), -1, dtype=torch.int64, device=device)
    return torch.tensor([[p.numel() if p is not None else -1 for p in to_rank] for to_rank in route],
                        dtype=torch.int64, device=device).view(world, n)


def cut(blob: torch.Tensor, sizes: List[List[int]]) -> Payloads:
    """The routed bytes (rank after rank, segment after segment) as payloads per (rank, segment).

    >>> [[p.tolist() for p in row] for row in cut(torch.arange(5, dtype=torch.uint8), [[2, 0], [1, 2]])]
    [[[0, 1], []], [[2], [3, 4]]]
    """
    flat = [max(b, 0) for row in sizes for b in row]
    parts = list(blob.split(flat)) if flat else []
    return [parts[r * len(row):(r + 1) * len(row)] for r, row in enumerate(sizes)]


def _header_bytes(n: int) -> int:
    return 4 * n


def contribution(mine: List[Optional[torch.Tensor]], cap: int, device: torch.device) -> torch.Tensor:
    """This owner's gather input: a header of its kept pairs per segment (-1: overflowed), its pairs,
    zeros up to ``cap`` (every owner's bound, agreed in the hook)."""
    header = torch.tensor([m.numel() // PAIR_BYTES if m is not None else -1 for m in mine], dtype=torch.int32)
    body = [header.view(torch.uint8).to(device)] + [m for m in mine if m is not None]
    blob = torch.cat(body)
    if blob.numel() > cap:
        raise RuntimeError(f"an owner's kept pairs ({blob.numel()} bytes) exceed the agreed bound ({cap}): "
                           "ranks disagree on the counts")
    padded = torch.zeros(cap, dtype=torch.uint8, device=device)
    padded[:blob.numel()] = blob
    return padded


def uncut(blob: torch.Tensor, n: int) -> List[Optional[torch.Tensor]]:
    """One owner's gather input back into its payloads per segment (None: flagged).

    >>> blob = contribution([torch.arange(8, dtype=torch.uint8), None], cap=16, device=torch.device("cpu"))
    >>> [p if p is None else p.tolist() for p in uncut(blob, 2)]
    [[0, 1, 2, 3, 4, 5, 6, 7], None]
    """
    header = blob[:_header_bytes(n)].clone().view(torch.int32).tolist()
    out: List[Optional[torch.Tensor]] = []
    at = _header_bytes(n)
    for pairs in header:
        if pairs < 0:
            out.append(None)
            continue
        out.append(blob[at:at + pairs * PAIR_BYTES])
        at += pairs * PAIR_BYTES
    return out
