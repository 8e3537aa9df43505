"""A group of the fused allgather (:class:`hvd_gradcomp.collectives.fused.FusedAllgatherExchange`): the
tensors that travel together (:class:`_Group`), when a group leaves (:class:`Fusion`), and each rank's
part of a group's allgather read back (:class:`GroupReader`). The group's index, written by
:meth:`_Group.blob` and read by :class:`GroupReader`, plays the envelope's part for the whole group.
"""
from __future__ import annotations

import time
import zlib
from typing import Any, List, Optional, Tuple

import torch

from .. import wire
from ..codecs.compressor import GradientCompressor
from .inflight import FLAG_NONFINITE, Envelope, Pending, check_steps
from .reduce import Parts

FUSE_MAGIC = 0x47434655  # "GCFU"
_FUSE_BASE = 5     # int64s before the per-member entries: magic, n, prefix bytes, part bytes, step
_FUSE_MEMBER = 4   # int64s per member: payload bytes, header bytes, flags (FLAG_NONFINITE), crc32 of its name


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


class Fusion:
    """Which group a payload joins and when the group leaves: once it holds ``fusion_bytes`` of raw
    gradient, or as many tensors as the last step had (so the last group of backward does not wait
    for ``synchronize()``). These rules depend only on tensor sizes and counts, the same on every rank.

    >>> f = Fusion(); g = f.group()
    >>> f.add(g, member=None, payload=None, raw_bytes=100, fusion_bytes=64)   # full: launch it
    True
    """

    def __init__(self) -> None:
        self._open: Optional[_Group] = None
        self._groups_this_step = 0
        self._started = 0
        self._expected: Optional[int] = None   # tensors of the last step (None: the first step)

    def group(self) -> _Group:
        """The open group, a new one if none is."""
        if self._open is None:
            self._open = _Group(self._groups_this_step)
            self._groups_this_step += 1
        return self._open

    def add(self, g: _Group, member: Pending, payload: Optional[torch.Tensor], raw_bytes: int,
            fusion_bytes: int) -> bool:
        """``member`` (its ``payload``: None when its gradient was not finite) joins ``g``; whether ``g``
        is to leave now."""
        g.members.append(member)
        g.payloads.append(payload)
        g.raw_bytes += raw_bytes
        self._started += 1
        return g.raw_bytes >= fusion_bytes or self._started == self._expected

    def launched(self, g: _Group) -> None:
        if self._open is g:
            self._open = None

    def step_done(self) -> None:
        """At ``synchronize()``: the step's tensor count is learnt, the next step's groups start at 0."""
        if self._started:
            self._expected, self._started, self._groups_this_step = self._started, 0, 0


class GroupReader:
    """Every member's parts from a group's allgather, each rank's part checked against this rank's
    group (the same tensors, the same exchange step) and decoded by ``compressor``."""

    def __init__(self, compressor: GradientCompressor, process_set: Any) -> None:
        self.compressor, self.process_set = compressor, process_set

    def parts(self, g: _Group, blob: torch.Tensor) -> Tuple[List[Parts], List[float]]:
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
                    parts[i].append(member.own)   # see FusedAllgatherExchange._prepare
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
