"""The fused allgather of sparse payloads (TopK, TopKQSGD): several tensors' payloads per Horovod
allgather, behind one index per rank that plays the envelope's part (the group and its index:
:mod:`hvd_gradcomp.collectives.fused_group`), decoded while backward goes on (see
:class:`FusedAllgatherExchange`). The allgather of one tensor each
(the stock-Horovod driver) is :class:`hvd_gradcomp.collectives.exchange.AllgatherExchange`; both take this
rank's own part as its encoder carried it (:func:`encode_carried`).
"""
from __future__ import annotations

import time
from typing import Any, List, Optional, Tuple

import torch

from .. import wire
from ..codecs.compressor import GradientCompressor
from .fused_group import FUSE_MAGIC as FUSE_MAGIC, Fusion, GroupReader, _Group, _head_bytes
from .inflight import Pending, _begin, _confirm, _hvd, encode_or_flag, is_average
from .reduce import Parts, add_part, finite_at_indices, own_dense, sparse_support, sum_parts, sums_in_place


# FusedAllgatherExchange._prepare on (False: groups wait for their allgather untouched). Private:
# benchmarks/step_probe.py --ab and the tests compare both paths.
_PREPARE = True
# FusedAllgatherExchange.before_wait on (False: p.grad is zeroed after the wait). Private, as _PREPARE.
_PREZERO = True
# With two ranks, FusedAllgatherExchange.before_wait adds this rank's own part to p.grad before the
# wait (False: every part after it). Private, as _PREPARE.
_ADD_OWN = True
# This rank's sparse parts from what its encoder carried (False: decoded from its payload, as the
# other ranks decode it). Private, as _PREPARE.
_CARRIED = True
# Raw gradient bytes per fused allgather (2M float32 values: a ~40 kB TopKQSGD(1%, 8) payload).
# Small tensors still travel together, but the last group of backward (which nothing overlaps:
# its allgather and decode wait in synchronize()) stays small. 64 MB, Horovod's fusion
# buffer, left half of a 25M-parameter model's exchange to synchronize().
DEFAULT_FUSION_BYTES = 8 << 20


def encode_carried(compressor: GradientCompressor, name: str, grad: torch.Tensor
                   ) -> Tuple[Optional[torch.Tensor], Optional[Tuple[torch.Tensor, torch.Tensor]]]:
    """(payload, this rank's part as its encoder carried it) by
    :meth:`GradientCompressor.compress_carried`: the part only for a sparse payload, so that
    it need not be decoded here; (None, None) when the gradient held NaN/Inf."""
    payload, carried = encode_or_flag(compressor.compress_carried, name, grad) or (None, None)
    return payload, carried if isinstance(carried, tuple) and _CARRIED else None


class FusedAllgatherExchange:
    """Sparse payloads fused into fewer, larger allgathers, as Horovod's tensor fusion does for
    allreduce: each allgather pays Horovod's negotiation once for many tensors.

    Payloads are encoded as each gradient is ready (the hook) and join the open group; the
    group is launched once it holds ``fusion_bytes`` of raw gradient, or once it holds as many
    tensors as the last step had, or at ``synchronize()`` (:class:`Fusion`); a rank whose group
    holds other tensors (a different backward order) fails with an error naming them. Each
    rank's part of the allgather starts with an index (sizes, the sender's exchange step, a
    non-finite flag per tensor and a copy of every payload header: the group's envelope, see
    :class:`_Group`), read to the host in one copy per rank: no header is read twice
    (:class:`GroupReader`). Completed groups are decoded in ``progress()`` while
    backward goes on; every rank decodes the same bytes in rank order, so gradients are
    bit-identical everywhere. When the caller names the output (``p.out``, the
    parameter's ``.grad``, whose gradient is final once its exchange started) the average is
    written there as soon as the group is decoded, as Horovod's in-place allreduce writes
    ``p.grad`` from its background thread, and handed to the feedback policy's ``received``
    (unless the policy moves parameters, which must wait for ``synchronize()``):
    ``synchronize()`` is then left with the last groups of backward: their outputs are zeroed
    while the allgather travels (:meth:`before_wait`), and only the other ranks' payloads are
    decoded, this rank's parts being known from its encoding (:meth:`_prepare`).
    """

    join_guard: Any = None   # an exchange.JoinGuard, checked before the allgather (see exchange.choose_exchange)

    def __init__(self, compressor: GradientCompressor, op: Any, process_set: Any,
                 fusion_bytes: int = DEFAULT_FUSION_BYTES) -> None:
        self.compressor, self.op, self.process_set = compressor, op, process_set
        self.fusion_bytes = fusion_bytes
        # Its parts: the group being filled and when it leaves; the allgathers read back.
        self._fusion, self._reader = Fusion(), GroupReader(compressor, process_set)

    def start(self, name: str, grad: torch.Tensor) -> Pending:
        _begin(self)
        payload, own = encode_carried(self.compressor, name, grad)
        g = self._fusion.group()
        p = Pending(name, grad.shape, grad.dtype, None, bytes_sent=0 if payload is None else payload.numel(),
                    group=g, device=grad.device)
        if own is not None:   # this rank's part, not decoded from its payload (see _prepare)
            p.own = own
        if self._fusion.add(g, p, payload, grad.numel() * grad.element_size(), self.fusion_bytes):
            self._launch(g)
        return p

    def _launch(self, g: _Group) -> None:
        # In name order, not arrival order: a tensor without gradient on some rank (a layer used
        # on rank 0 only) arrives there at synchronize(), elsewhere during backward.
        order = sorted(range(len(g.members)), key=lambda i: g.members[i].name)
        g.members, g.payloads = [g.members[i] for i in order], [g.payloads[i] for i in order]
        g.joined = _confirm(self)
        if g.joined:   # ranks inside hvd.join(): no allgather; this rank's parts, dense, in one allreduce (Sum)
            g.handle, g.prepared = _launch_joined(self.compressor, g, self.process_set), True
        else:
            blob = g.blob(self.compressor.exchange_step, g.members[0].device)
            g.members[0].bytes_sent += g.prefix_bytes()  # the index travels once per group
            g.members[0].framing_bytes += g.prefix_bytes()
            g.handle = _hvd().allgather_async(blob, name=f"hvdgc.fag.{g.index}", process_set=self.process_set)
        for m in g.members:
            m.handle = g.handle
        self._fusion.launched(g)

    def progress(self, p: Pending) -> None:
        """Decode the whole group as soon as its allgather is done, else prepare it; never blocks."""
        g = p.group
        if g.handle is None or g.decoded:
            return
        if _hvd().poll(g.handle):
            self._decode(g, p)
        elif not g.prepared and _PREPARE:
            self._prepare(g, p)

    def _prepare(self, g: _Group, caller: Pending) -> None:
        """While the allgather travels, decode this rank's own payloads that its encoder did not
        say the content of (``p.own``, from :meth:`GradientCompressor.compress_carried`:
        a sparse payload's indices and values, the same bits the other ranks decode, so every
        rank sums the same parts and gradients stay bit-identical). Only the other ranks' parts
        are then left once the allgather is done: this takes 1/P of the last group of backward's
        decode (whose allgather nothing else overlaps) out of ``synchronize()``.

        Only payloads that sit on the CPU: elsewhere reading their headers would be a
        device-to-host sync in the middle of backward, so they are decoded with the others, from
        the header copies in the group's index. (``p.grad`` is not touched before the average
        is ready: between backward and ``step()`` it holds the local gradient or the average, as
        with Horovod, never a zeroed or partial sum.)"""
        g.prepared = True
        for member, payload in zip(g.members, g.payloads):
            if payload is not None and payload.device.type == "cpu" and member.own is None:
                t0 = time.perf_counter()
                # host bytes already: parsed here once, and not again from the group's index
                h = wire.parse_header(payload[:_head_bytes(member.shape)].numpy().tobytes(), payload.numel())
                member.own = self.compressor.decode_parts(payload, h)
                _charge(member, caller, time.perf_counter() - t0)
        g.payloads = []

    def before_wait(self, p: Pending) -> None:
        """``synchronize()`` is about to block on ``p``'s group: zero its members' outputs now.

        The scatter of a sparse average into ``p.grad`` starts with a pass that zeroes it (~1.7 ms
        for a 4M-value gradient on CPU, the first layer's, whose group is the last of backward
        and left to ``synchronize()``). Done here, that pass overlaps the allgather still
        in flight and a peer still in backward, instead of following them. Only here: no user code
        runs inside ``synchronize()``, so ``p.grad`` is never seen zeroed (see :meth:`_prepare`).
        With two ranks this rank's own sparse part is added there too (the second pass of the
        scatter, ~0.6-0.8 ms for that gradient, cache-cold), so that only the other rank's part is
        left after the wait. That is exact with two ranks alone: every index holds zero plus at
        most one value from each rank (a part names each index once), and ``x + y == y + x`` in
        IEEE arithmetic, so rank 0's ``(0 + a) + b`` and rank 1's ``(0 + b) + a`` are the same
        bits. With three ranks or more the order of the additions would differ between ranks,
        and so would the last bit of the average: there the parts are summed in rank order,
        after the wait, as before.

        If the exchange then fails (ranks disagree), ``p.grad`` is left zeroed or holding this
        rank's part, not the local gradient: the error stops the step either way.
        """
        g = p.group
        if g.handle is None or g.decoded or not _PREZERO or g.joined:
            return
        add_own = _ADD_OWN and self.process_set.size() == 2
        for m in g.members:
            out = m.out
            if out is not None and not m.zeroed and sums_in_place(out, m.dtype):
                out.zero_()
                m.zeroed = True
                if add_own and m.own is not None:   # scaled as sum_parts scales it
                    add_part(out, m.own, 0.5 if is_average(self.op) else 1.0)
                    m.held = True

    def advance(self, p: Pending) -> None:
        """At synchronize(): launch the group still open; the step's tensor count is learnt."""
        self._fusion.step_done()
        g = p.group
        if g.handle is None:
            self._launch(g)

    def _decode(self, g: _Group, caller: Pending) -> None:
        """Decode every member's payloads. The seconds spent on another member are charged to it
        (``codec_s``) and noted as ``codec_elsewhere_s`` on ``caller``, so that
        :class:`TimedExchange` charges each tensor its own decode."""
        blob = _hvd().synchronize(g.handle)
        n = len(g.members)
        if g.joined:
            parts, spent = _joined_parts(g, blob, is_average(self.op)), [0.0] * n
        else:
            parts, spent = self._reader.parts(g, blob)
        g.decoded = True
        g.payloads = []
        for i, member in enumerate(g.members):
            member.parts = parts[i]
            out = member.out
            if out is not None:   # scatter now, not in synchronize() (see finish)
                t0 = time.perf_counter()
                zeroed, held, member.zeroed, member.held = member.zeroed, member.held, False, False
                sum_parts(parts[i], is_average(self.op), out.numel(), member.dtype, out=out,
                          zeroed=zeroed, held=self.process_set.rank() if held else None)
                member.summed = True
                if not self.compressor.feedback.moves_parameters:
                    # The policy's rewrite too (momentum correction: a clone and two passes over the
                    # gradient), while backward goes on; not a policy that moves the parameter,
                    # which autograd may still need as it was.
                    self.compressor.received(member.name, out, sparse_support(parts[i]))
                    member.received = True
                    # its finiteness too, read where the average can be nonzero: one thing less
                    # for synchronize() to do (~0.1 ms a tensor on CPU)
                    member.finite = finite_at_indices(self.compressor, parts[i], out, member.name)
                spent[i] += time.perf_counter() - t0
            _charge(member, caller, spent[i])
        # Each member points at its group (p.group); the group lets go of its members now,
        # else the pair is a reference cycle holding every member's p.grad (p.out) until
        # Python's cyclic GC runs: with zero_grad(set_to_none=True) several steps of gradients
        # would stay alive, and every new step's gradients fault in fresh pages.
        g.members = []

    def finish(self, p: Pending, out: torch.Tensor) -> None:
        g = p.group
        if g.handle is None:
            self.advance(p)
        if not g.decoded:
            self._decode(g, p)
        parts, early, summed, received = p.parts, p.out, p.summed, p.received
        p.parts, p.summed, p.received = None, False, False
        if received:  # summed and rewritten by the policy in _decode, exactly once per step
            if early is not out:
                out.copy_(early.view_as(out))
        else:
            if not (summed and early is out):
                sum_parts(parts, is_average(self.op), out.numel(), p.dtype, out=out)
            # the feedback policy sees the average
            self.compressor.received(p.name, out, sparse_support(parts))
        if not received:   # else _decode read it, after the same sum and the same received
            p.finite = finite_at_indices(self.compressor, parts, out, p.name)
        p.finished = True


def _launch_joined(compressor: GradientCompressor, g: _Group, process_set: Any) -> Any:
    """The allreduce (Sum) of this rank's parts of ``g``'s members, dense and concatenated (float32, see
    :func:`~hvd_gradcomp.collectives.reduce.own_dense`), while ranks inside ``hvd.join()`` leave an allgather
    impossible: a joined rank adds zeros, :func:`_joined_parts` divides by ``g.joined``. Every member was
    encoded as in any step (its residual and random stream moved on alike); only the carriage differs."""
    dense = [own_dense(compressor, pl, m.shape.numel(), m.device, m.own) for m, pl in zip(g.members, g.payloads)]
    for m, d in zip(g.members, dense):
        m.bytes_sent, m.framing_bytes, m.own, m.joined = d.numel() * d.element_size(), 0, None, g.joined
    return _hvd().allreduce_async(torch.cat(dense), name=f"hvdgc.joined.fag.{g.index}", op=_hvd().Sum,
                                  process_set=process_set)


def _joined_parts(g: _Group, total: torch.Tensor, average: bool) -> List[Parts]:
    """Each member's part from :func:`_launch_joined`'s sum: one dense part, already the average over the
    ``g.joined`` ranks that contributed (so that :func:`sum_parts`, which divides by the parts, keeps it)."""
    if average:
        total = total.div_(g.joined)
    sizes = [m.shape.numel() for m in g.members]
    return [[(None, piece)] for piece in total.split(sizes)]


def _charge(member: Pending, caller: Pending, seconds: float) -> None:
    """Charge codec seconds spent on ``member`` while serving ``caller`` (a group's decode runs
    inside one member's call), so that :class:`TimedExchange` charges each tensor its own."""
    if member is not caller:
        member.codec_s += seconds
        caller.codec_elsewhere_s += seconds
