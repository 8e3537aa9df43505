"""The sparse allreduce (:func:`~hvd_gradcomp.collectives.sparse_allreduce.sparse_allreduce`, issue 62) on
Horovod, for ``hvd_gradcomp.DistributedOptimizer``: a codec built with ``exchange="allreduce"``
(``TopK``, ``TopKQSGD``) declares :data:`~hvd_gradcomp.codecs.SPARSE_ALLREDUCE`, and
:func:`~hvd_gradcomp.collectives.exchange.choose_exchange` gives it a :class:`SparseAllreduceExchange`.

The algorithm's ``"route"`` :class:`~hvd_gradcomp.collectives.rounds.Scatter` goes as one
``hvd.alltoall`` with ``splits=`` (the payloads to each owner differ in size), its ``"gather"``
:class:`~hvd_gradcomp.collectives.rounds.Gather` as one ``hvd.allgather``; every payload travels behind
its envelope (:mod:`hvd_gradcomp.collectives.inflight`: the sender's step, checked on receipt, and the
non-finite flag the algorithm's ``None`` becomes). Stock ``hvd.DistributedOptimizer`` cannot carry it
(:func:`hvd_gradcomp.horovod.stock.refuse_rounds`).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from ..codecs.compressor import GradientCompressor
from .exchange import _Rounds, _TwoCollectives, finish_joined, payloads_of, start_joined
from .inflight import ENVELOPE_BYTES, Pending, _begin, _confirm, _hvd, is_average, seal, unseal
from .rounds import finish as finish_rounds
from .sparse_allreduce import Balancer, decode_pairs, sparse_allreduce


class SparseAllreduceExchange(_TwoCollectives):
    """The sparse allreduce of one tensor on Horovod: ``start`` selects and launches the alltoall of
    this rank's pairs to their owners, ``advance`` hands the owner's received pairs to the algorithm
    and launches the allgather of its kept sums, ``finish`` writes the average and hands it to the
    compressor's ``received`` with the kept indices as support (its feedback policy's rule).

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

    def advance(self, p: Pending) -> None:
        """Stage 2: every rank's pairs of this rank's region to the algorithm, which sums them and keeps
        its budget; launch the allgather of the kept sums."""
        if p.stage != 1:
            return
        hvd = _hvd()
        received, _ = hvd.synchronize(p.handle)
        payloads = payloads_of(self.compressor, unseal(received), self.process_set.size(), p.name)
        gather = p.ctx.run.send(payloads)
        sealed = seal(gather.payloads[0], self.compressor.exchange_step, received.device)
        p.handle = hvd.allgather_async(sealed, name=f"hvdgc.sag.{p.name}", process_set=self.process_set)
        p.bytes_sent += sealed.numel()
        p.framing_bytes += ENVELOPE_BYTES
        p.stage = 2

    def finish(self, p: Pending, out: torch.Tensor) -> None:
        if p.joined:
            finish_joined(p, out, is_average(self.op))
            self.compressor.received(p.name, out)
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

