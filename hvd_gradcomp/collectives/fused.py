"""The fused allgather of sparse payloads (TopK, TopKQSGD): several tensors' payloads per Horovod
allgather, behind one index per rank that plays the envelope's part (see :class:`_Group`), decoded
while backward goes on (see :class:`FusedAllgatherExchange`). The allgather of one tensor each
(the stock-Horovod road) is :class:`hvd_gradcomp.collectives.exchange.AllgatherExchange`; both take this
rank's own part as its encoder carried it (:func:`encode_carried`).
"""
from __future__ import annotations

import time
import zlib
from typing import Any, List, Optional, Tuple

import torch

from .. import wire
from ..codecs.compressor import GradientCompressor
from .inflight import FLAG_NONFINITE, Envelope, Pending, _begin, _confirm, _hvd, check_steps, encode_or_flag, is_average
from .reduce import Parts, add_part, finite_at_indices, own_dense, sparse_support, sum_parts, sums_in_place


FUSE_MAGIC = 0x47434655  # "GCFU"
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


_FUSE_BASE = 5     # int64s before the per-member entries: magic, n, prefix bytes, part bytes, step
_FUSE_MEMBER = 4   # int64s per member: payload bytes, header bytes, flags (FLAG_NONFINITE), crc32 of its name


def encode_carried(compressor: GradientCompressor, name: str, grad: torch.Tensor
                   ) -> Tuple[Optional[torch.Tensor], Optional[Tuple[torch.Tensor, torch.Tensor]]]:
    """(payload, this rank's part as its encoder carried it) by
    :meth:`GradientCompressor.compress_carried`: the part only for a sparse payload, so that
    it need not be decoded here; (None, None) when the gradient held NaN/Inf."""
    payload, carried = encode_or_flag(lambda: compressor.compress_carried(name, grad)) or (None, None)
    return payload, carried if isinstance(carried, tuple) and _CARRIED else None


def _head_bytes(shape: torch.Size) -> int:
    return wire.padded(wire.HEADER_BYTES + 8 * len(shape))


def _name_id(name: str) -> int:
    return zlib.crc32(name.encode())


class _Group:
    """Sparse payloads that travel in one allgather, with the index that lets receivers split it.

    The index plays the role of the envelope (:func:`seal`) for the whole group: it carries
    the sender's exchange step once and a non-finite flag per member (a member whose gradient
    held NaN/Inf sends no payload and a zeroed header slot, and decodes to NaN).
    """

    def __init__(self, index: int) -> None:
        self.index = index
        self.members: List[Pending] = []
        self.payloads: List[Optional[torch.Tensor]] = []
        self.raw_bytes = 0
        self.handle: Any = None
        self.decoded = False
        self.prepared = False   # own payloads decoded (see FusedAllgatherExchange._prepare)
        self.joined = 0         # ranks still training while others are in hvd.join(): an allreduce, see _launch

    def prefix_bytes(self) -> int:
        """Size of each rank's prefix: known to every rank from the tensors' shapes alone."""
        return 8 * (_FUSE_BASE + _FUSE_MEMBER * len(self.members)) + sum(_head_bytes(p.shape) for p in self.members)

    def blob(self, step: int, device: torch.device) -> torch.Tensor:
        """prefix (int64: magic, n, prefix bytes, part bytes, step, then (payload bytes, header
        bytes, flags, name id) per member, then a copy of each payload's header) + the payloads."""
        heads = [torch.zeros(_head_bytes(p.shape), dtype=torch.uint8, device=device) if pl is None
                 else pl[:_head_bytes(p.shape)] for p, pl in zip(self.members, self.payloads)]
        sent = [pl for pl in self.payloads if pl is not None]
        prefix = self.prefix_bytes()
        index = [FUSE_MAGIC, len(self.members), prefix, prefix + sum(pl.numel() for pl in sent), step % (1 << 32)]
        for p, pl, h in zip(self.members, self.payloads, heads):
            index += [0 if pl is None else pl.numel(), h.numel(), FLAG_NONFINITE if pl is None else 0, _name_id(p.name)]
        index_bytes = torch.tensor(index, dtype=torch.int64).view(torch.uint8).to(device)
        return torch.cat([index_bytes, *heads, *sent])


class FusedAllgatherExchange:
    """Sparse payloads fused into fewer, larger allgathers, as Horovod's tensor fusion does for
    allreduce: each allgather pays Horovod's negotiation once for many tensors.

    Payloads are encoded as each gradient is ready (the hook) and join the open group; the
    group is launched once it holds ``fusion_bytes`` of raw gradient, or once it holds as many
    tensors as the last step had (so the last group of backward does not wait for
    ``synchronize()``), or at ``synchronize()``. These rules depend only on tensor sizes and
    counts, the same on every rank; a rank whose group holds other tensors (a different
    backward order) fails with an error naming them. Each rank's part of the allgather starts
    with an index (sizes, the sender's exchange step, a non-finite flag per tensor and a copy of
    every payload header: the group's envelope, see :class:`_Group`), read to the host in one
    copy per rank: no header is read twice. Completed groups are decoded in ``progress()`` while
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
        self._open: Optional[_Group] = None
        self._groups_this_step = 0
        self._started = 0
        self._expected: Optional[int] = None

    def start(self, name: str, grad: torch.Tensor) -> Pending:
        _begin(self)
        payload, own = encode_carried(self.compressor, name, grad)
        if self._open is None:
            self._open = _Group(self._groups_this_step)
            self._groups_this_step += 1
        g = self._open
        p = Pending(name, grad.shape, grad.dtype, None, bytes_sent=0 if payload is None else payload.numel(),
                    group=g, device=grad.device)
        if own is not None:   # this rank's part, not decoded from its payload (see _prepare)
            p.own = own
        g.members.append(p)
        g.payloads.append(payload)
        g.raw_bytes += grad.numel() * grad.element_size()
        self._started += 1
        if g.raw_bytes >= self.fusion_bytes or self._started == self._expected:
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
        if self._open is g:
            self._open = None

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
        if self._started:
            self._expected, self._started, self._groups_this_step = self._started, 0, 0
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
            parts, spent = self._gathered_parts(g, blob)
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

    def _gathered_parts(self, g: _Group, blob: torch.Tensor) -> Tuple[List[Parts], List[float]]:
        """Every member's parts from the allgather's ``blob``, in rank order, and the seconds spent on each."""
        names = [m.name for m in g.members]
        n, prefix = len(g.members), g.prefix_bytes()
        ranks = self._split_ranks(blob, names, prefix)
        check_steps(self.compressor, ", ".join(names), [index[4] for _, _, index in ranks])
        spent = [0.0] * n
        parts: List[Parts] = [[] for _ in range(n)]
        me = self.process_set.rank()
        for rank, (pos, raw, index) in enumerate(ranks):
            if index[1] != n or index[2] != prefix:
                raise RuntimeError(f"fused allgather of {names}: rank {rank} sent a group of {index[1]} tensors "
                                   f"(index {index[:3]}): ranks disagree on the tensors fused together (a "
                                   "different backward order?)")
            head_pos, body = 8 * (_FUSE_BASE + _FUSE_MEMBER * n), pos + prefix
            for i, member in enumerate(g.members):
                at = _FUSE_BASE + _FUSE_MEMBER * i
                size_i, head_i, flags_i, id_i = index[at:at + _FUSE_MEMBER]
                if id_i != _name_id(member.name):
                    raise RuntimeError(f"fused allgather of {names}: rank {rank} sent another tensor where this rank "
                                       f"has {member.name!r}: ranks disagree on the tensors fused together (a layer "
                                       "used on some ranks only, whose gradient joins another fusion group there?)")
                t0 = time.perf_counter()
                if flags_i & FLAG_NONFINITE:
                    parts[i].append((None, Envelope(index[4], None, blob.device).nan(member.shape.numel())))
                elif rank == me and member.own is not None:
                    parts[i].append(member.own)   # see _prepare
                    member.own = None
                else:
                    h = wire.parse_header(raw[head_pos:head_pos + head_i], size_i)
                    if h.shape != tuple(member.shape):
                        raise RuntimeError(f"{member.name}: rank {rank} sent a payload of shape {h.shape}, expected "
                                           f"{tuple(member.shape)}: ranks disagree on the tensors fused together")
                    parts[i].append(self.compressor.decode_parts(blob[body:body + size_i], h))
                spent[i] += time.perf_counter() - t0
                head_pos, body = head_pos + head_i, body + size_i
        return parts, spent

    def _split_ranks(self, blob: torch.Tensor, names: List[str], prefix: int) -> List[Tuple[int, bytes, List[int]]]:
        """Each rank's part of a fused allgather as (start, its prefix bytes on the host, its index):
        the one device-to-host copy per rank. Only the fixed fields are checked here, so that the
        steps are compared (:func:`check_steps`) before the group's make-up is."""
        out, pos, words = [], 0, _FUSE_BASE + _FUSE_MEMBER * len(names)
        for rank in range(self.process_set.size()):
            raw = blob[pos:pos + prefix].cpu().numpy().tobytes()
            have = min(len(raw) // 8, words)
            index = torch.frombuffer(bytearray(raw[:8 * have]), dtype=torch.int64).tolist() if have else []
            if have < _FUSE_BASE or index[0] != FUSE_MAGIC or not 8 * _FUSE_BASE <= index[3] <= blob.numel() - pos:
                raise RuntimeError(f"fused allgather of {names}: rank {rank}'s part is truncated or corrupt: ranks "
                                   "disagree on this exchange (run the same hvd-gradcomp version on every rank)")
            out.append((pos, raw, index))
            pos += index[3]
        if pos != blob.numel():
            raise RuntimeError(f"fused allgather of {names}: {blob.numel() - pos} bytes left after "
                               f"{self.process_set.size()} ranks' parts")
        return out

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
