"""The DDP driver of the sparse allreduce (issue 62): :func:`_sparse_allreduce` carries
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
"""
# No `from __future__ import annotations`: as in hvd_gradcomp.ddp.
from typing import Any, Callable, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..collectives.rounds import finish as finish_rounds
from ..collectives.sparse_allreduce import PAIR_BYTES, owner_budget, sparse_allreduce
from ..collectives.transport import all_gather_single as _all_gather_single
from ..feedback import kernels
from .exchanges import Future, State, _nonfinite, _Plan, _start_dense

Payloads = List[List[Optional[torch.Tensor]]]


def _sparse_allreduce(state: State, buffer: torch.Tensor, plan: _Plan, step: int) -> Future:
    """The sparse allreduce of the bucket's compressed segments (see the module docstring)."""
    comp, world, rank = state.compression, state.world_size, state.rank
    segs, device = plan.compressed, buffer.device
    n = len(segs)
    views = [s.view(buffer) for s in segs]
    run = sparse_allreduce(comp, [(s.name, v.view(s.shape)) for s, v in zip(segs, views)], views, world, rank,
                           average=True, flags=True, balancer=state._balancer)
    with state._lock:
        finite = kernels.all_finite(buffer)   # a host sync: what is sent depends on it
        route: Optional[Payloads] = next(run).payloads if finite else None
    counts = _counts(route, world, n, device)
    received = torch.empty(world * n, dtype=torch.int64, device=device)
    dist.all_to_all_single(received, counts.view(-1), group=state.process_group)
    got = received.view(world, n)
    own = _header_bytes(n) + PAIR_BYTES * sum(owner_budget(int(got[:, j].clamp(min=0).sum()) // PAIR_BYTES, world)
                                              for j in range(n))
    agreed = torch.tensor([own, int(bool((counts < 0).any()))], dtype=torch.int64, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=state.process_group)
    cap, flagged = agreed.tolist()
    state._record(step, "(counts+padding)", 0, 0, 8 * n * (world - 1) + 16)
    dense_futs, copy_back = _start_dense(state, buffer, plan, step, finite)
    if flagged:
        for s in segs:
            state._record(step, s.name, s.numel * buffer.element_size(), 0)
        return _skipped(state, run if route is not None else None, world, n, dense_futs, buffer, copy_back)
    assert route is not None   # no rank flagged: this one selected
    send = torch.cat([p for to_rank in route for p in to_rank]) if n else torch.empty(0, dtype=torch.uint8)
    send_splits = counts.sum(dim=1).tolist()
    recv_splits = got.sum(dim=1).tolist()
    pairs_in = torch.empty(sum(recv_splits), dtype=torch.uint8, device=device)
    a2a = dist.all_to_all_single(pairs_in, send, recv_splits, send_splits, group=state.process_group,
                                 async_op=True).get_future()
    to_others = [int(counts[:, j].sum() - counts[rank, j]) for j in range(n)]

    def launch() -> Tuple[Future, Callable]:
        from_rank = _cut(pairs_in, got.tolist())
        with state._lock:
            mine = run.send(from_rank).payloads
        blob = _contribution(mine, cap, device)
        for s, m, out in zip(segs, mine, to_others):
            state._record(step, s.name, s.numel * buffer.element_size(), out + (m.numel() if m is not None else 0))
        state._record(step, "(counts+padding)", 0, 0, cap - sum(m.numel() for m in mine if m is not None))
        gathered = torch.empty(world * cap, dtype=torch.uint8, device=device)
        work = _all_gather_single(gathered, blob, group=state._second, async_op=True)

        def decode() -> None:   # under state._lock (_InOrder)
            kept = finish_rounds(run, [_uncut(gathered[r * cap:(r + 1) * cap], n) for r in range(world)])
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


def _skipped(state: State, run: Optional[Any], world: int, n: int, dense_futs: List[Future],
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


def _counts(route: Optional[Payloads], world: int, n: int, device: torch.device) -> torch.Tensor:
    """Bytes of this rank's pairs per (owner, segment); -1 where it flags (its bucket holds NaN/Inf)."""
    if route is None:
        return torch.full((world, n), -1, dtype=torch.int64, device=device)
    return torch.tensor([[p.numel() if p is not None else -1 for p in to_rank] for to_rank in route],
                        dtype=torch.int64, device=device).view(world, n)


def _cut(blob: torch.Tensor, sizes: List[List[int]]) -> Payloads:
    """The routed bytes (rank after rank, segment after segment) as payloads per (rank, segment)."""
    flat = [max(b, 0) for row in sizes for b in row]
    parts = list(blob.split(flat)) if flat else []
    return [parts[r * len(row):(r + 1) * len(row)] for r, row in enumerate(sizes)]


def _header_bytes(n: int) -> int:
    return 4 * n


def _contribution(mine: List[Optional[torch.Tensor]], cap: int, device: torch.device) -> torch.Tensor:
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


def _uncut(blob: torch.Tensor, n: int) -> List[Optional[torch.Tensor]]:
    """One owner's gather input back into its payloads per segment (None: flagged)."""
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
