"""Collectives: how each kind of payload crosses the network and comes back averaged.

Three roads, chosen per tensor by :func:`choose_exchange`:

* :class:`DenseExchange`: Horovod's allreduce of the (optionally fp16-cast) tensor. Used
  with no compressor, with Horovod's own compressors, and for small tensors.
* :class:`FusedAllgatherExchange`: sparse payloads (TopK, TopKQSGD), several tensors' per
  allgather (:class:`AllgatherExchange`: one each, the stock-Horovod road). Every rank
  decodes all payloads in rank order and averages, so all ranks end with identical gradients.
* :class:`ScatterReduceExchange`: QSGD's compressed allreduce. Each rank quantises its
  gradient in P chunks; an alltoall sends chunk i to rank i; rank i decodes and sums its
  chunk, re-quantises it (with its own error feedback), and an allgather returns every
  chunk. The bytes a rank sends stay about (1 + 1/P) x its payload, whatever P is.

Each exchange has two phases: ``start`` (at the gradient hook, overlapping backward) and
``finish`` (in ``synchronize``); the QSGD road has a middle phase ``advance`` that launches
the allgather once the alltoall is done. ``bytes_sent`` counts the bytes handed to Horovod.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

import torch

from . import wire
from .compressors import GradientCompressor, QSGD
from .feedback import residual_dtype


@dataclass
class Pending:
    """One tensor in flight."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    handle: Any
    ctx: Any = None
    bytes_sent: int = 0
    stage: int = 1
    finished: bool = False
    extra: dict = field(default_factory=dict)


def _hvd():
    import horovod.torch as hvd
    return hvd


class DenseExchange:
    """Horovod allreduce, through a Horovod-style compressor (``hvd.Compression.none/fp16``)."""

    def __init__(self, op: Any, process_set: Any, compression: Any = None) -> None:
        self.op, self.process_set = op, process_set
        self.compression = compression if compression is not None else _hvd().Compression.none

    def start(self, name: str, grad: torch.Tensor) -> Pending:
        # Horovod's collectives take contiguous tensors only (a channels_last gradient is not).
        tensor, ctx = self.compression.compress(grad.contiguous())
        handle = _hvd().allreduce_async(tensor, name=f"hvdgc.dense.{name}", op=self.op,
                                        process_set=self.process_set)
        return Pending(name, grad.shape, grad.dtype, handle, ctx, tensor.numel() * tensor.element_size())

    def advance(self, p: Pending) -> None:
        pass

    def progress(self, p: Pending) -> None:
        """Nothing to do early: Horovod's allreduce runs in its background thread."""

    def finish(self, p: Pending, out: torch.Tensor) -> None:
        out.copy_(self.compression.decompress(_hvd().synchronize(p.handle), p.ctx).view_as(out))
        p.finished = True


class AllgatherExchange:
    """Sparse payloads: allgather, then every rank decodes all of them in rank order."""

    def __init__(self, compressor: GradientCompressor, op: Any, process_set: Any) -> None:
        self.compressor, self.op, self.process_set = compressor, op, process_set

    def start(self, name: str, grad: torch.Tensor) -> Pending:
        payload = self.compressor.compress_named(name, grad)
        handle = _hvd().allgather_async(payload, name=f"hvdgc.ag.{name}", process_set=self.process_set)
        return Pending(name, grad.shape, grad.dtype, handle, bytes_sent=payload.numel())

    def advance(self, p: Pending) -> None:
        pass

    def progress(self, p: Pending) -> None:
        """Decode now if the allgather is done, overlapping the rest of backward; never blocks.

        Decoded parts wait in ``p.extra``: ``p.grad`` keeps the local gradient until
        synchronize(), as with Horovod.
        """
        if "parts" not in p.extra and _hvd().poll(p.handle):
            self._decode(p)

    def _decode(self, p: Pending) -> None:
        split = wire.split_with_headers(_hvd().synchronize(p.handle))
        p.extra["parts"] = decode_payloads(self.compressor, [pl for pl, _ in split], self.process_set.size(),
                                           p.shape.numel(), [h for _, h in split])

    def finish(self, p: Pending, out: torch.Tensor) -> None:
        if "parts" not in p.extra:
            self._decode(p)
        sum_parts(p.extra.pop("parts"), is_average(self.op), out.numel(), p.dtype, out=out)
        self.compressor.received(p.name, out)
        p.finished = True


Parts = List[Tuple[Optional[torch.Tensor], torch.Tensor]]


def decode_payloads(compressor: GradientCompressor, payloads: List[torch.Tensor], size: int,
                    numel: Optional[int] = None, headers: Optional[List[wire.Header]] = None) -> Parts:
    """Every rank's payload decoded, in rank order, as (indices or None, values).

    With ``numel``, each payload must stand for a tensor of that many elements. ``headers``:
    the payloads' headers when already parsed (see :func:`wire.split_with_headers`); each
    read is a device-to-host copy on GPU, so none is read twice.
    """
    if len(payloads) != size:
        raise RuntimeError(f"expected {size} payloads, got {len(payloads)}: ranks disagree on this exchange")
    headers = headers if headers is not None else [wire.read_header(pl) for pl in payloads]
    if numel is not None:
        for rank, h in enumerate(headers):
            if h.numel != numel:
                raise wire.WireFormatError(f"the payload of rank {rank} holds {h.numel} elements, {numel} expected: "
                                           "ranks disagree on the tensor's shape")
    return [compressor.decode_parts(pl, h) for pl, h in zip(payloads, headers)]


def is_average(op: Any) -> bool:
    """True for ``hvd.Average``, False for ``hvd.Sum``; anything else is refused."""
    hvd = _hvd()
    if op == hvd.Average:
        return True
    if op == hvd.Sum:
        return False
    raise ValueError(f"unsupported reduction op {op}; use hvd.Average or hvd.Sum")


def sum_parts(parts: Parts, average: bool, numel: int, dtype: torch.dtype,
              out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The average (``average=True``) or sum of decoded parts; no collective, any backend.

    Every rank runs the same additions in the same order on the same bytes, so every rank
    gets bit-identical results. Sums run in float32 for 16-bit gradients. Sparse parts are
    added straight into one zeroed buffer; with ``out`` (contiguous, of the accumulation
    dtype) the result is written there.
    """
    scale = 1.0 / len(parts) if average else 1.0
    acc_dtype = residual_dtype(dtype)
    direct = out is not None and out.dtype == acc_dtype and out.is_contiguous()
    acc = out.view(-1) if direct else torch.empty(numel, dtype=acc_dtype, device=parts[0][1].device)
    acc.zero_()
    for idx, vals in parts:
        if idx is None:
            acc.add_(vals.to(acc_dtype), alpha=scale)
        else:
            acc.index_add_(0, idx, vals.to(acc_dtype), alpha=scale)
    if out is not None and not direct:
        out.copy_(acc.view_as(out))
        return out
    return acc if acc.dtype == dtype else acc.to(dtype)


def reduce_payloads(compressor: GradientCompressor, payloads: List[torch.Tensor], average: bool, size: int,
                    dtype: torch.dtype, out: Optional[torch.Tensor] = None,
                    headers: Optional[List[wire.Header]] = None) -> torch.Tensor:
    """The average (or sum) of every rank's payload, decoded in rank order (see :func:`sum_parts`)."""
    headers = headers if headers is not None else [wire.read_header(pl) for pl in payloads]
    numel = headers[0].numel if headers else 0
    return sum_parts(decode_payloads(compressor, payloads, size, numel, headers), average, numel, dtype, out)


def chunk_bounds(n: int, parts: int) -> List[int]:
    """Boundaries of ``parts`` nearly equal chunks of n elements: [0, ..., n].

    >>> chunk_bounds(10, 3)
    [0, 4, 7, 10]
    """
    base, extra = divmod(n, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    return bounds


class ScatterReduceExchange:
    """QSGD's compressed allreduce: alltoall of quantised chunks, reduce, allgather."""

    def __init__(self, compressor: QSGD, op: Any, process_set: Any) -> None:
        self.compressor, self.op, self.process_set = compressor, op, process_set

    def start(self, name: str, grad: torch.Tensor) -> Pending:
        size = self.process_set.size()
        bounds = chunk_bounds(grad.numel(), size)
        payloads = self.compressor.compress_chunks(name, grad, bounds)
        splits = torch.tensor([pl.numel() for pl in payloads], dtype=torch.int32)
        handle = _hvd().alltoall_async(torch.cat(payloads), splits=splits, name=f"hvdgc.a2a.{name}",
                                       process_set=self.process_set)
        # The chunk this rank keeps never leaves it: count only what goes to the others, so
        # that alltoall + allgather together send exactly one payload's worth per rank.
        sent = int(splits.sum()) - int(splits[self.process_set.rank()])
        return Pending(name, grad.shape, grad.dtype, handle, bytes_sent=sent, extra={"bounds": bounds})

    def progress(self, p: Pending) -> None:
        """Start stage 2 as soon as the alltoall is done (p.grad is untouched); never blocks."""
        if p.stage == 1 and _hvd().poll(p.handle):
            self.advance(p)

    def advance(self, p: Pending) -> None:
        """Stage 2: reduce my chunk from everybody's payloads, re-quantise, start the allgather."""
        if p.stage != 1:
            return
        hvd = _hvd()
        received, _ = hvd.synchronize(p.handle)
        split = wire.split_with_headers(received)
        mine = reduce_payloads(self.compressor, [pl for pl, _ in split], is_average(self.op), self.process_set.size(),
                               p.dtype, headers=[h for _, h in split])
        rank = self.process_set.rank()
        payload = self.compressor.compress_named(f"{p.name}#reduced{rank}", mine, relay=True)
        p.handle = hvd.allgather_async(payload, name=f"hvdgc.ag2.{p.name}", process_set=self.process_set)
        p.bytes_sent += payload.numel()
        p.stage = 2

    def finish(self, p: Pending, out: torch.Tensor) -> None:
        if p.stage == 1:
            self.advance(p)
        gathered = _hvd().synchronize(p.handle)
        payloads = wire.split_with_headers(gathered)
        bounds = p.extra["bounds"]
        if len(payloads) != len(bounds) - 1:
            raise RuntimeError(f"{p.name}: got {len(payloads)} chunks for {len(bounds) - 1} ranks")
        # A channels_last (or otherwise strided) gradient cannot be viewed flat: fill a flat
        # buffer in the tensor's logical order and copy it over.
        flat = out.view(-1) if out.is_contiguous() else torch.empty(out.numel(), dtype=out.dtype, device=out.device)
        for (payload, h), b, e in zip(payloads, bounds, bounds[1:]):
            chunk = self.compressor.decode_parts(payload, h)[1]
            if chunk.numel() != e - b:
                raise RuntimeError(f"{p.name}: chunk of {chunk.numel()} elements where {e - b} were expected; "
                                   "ranks disagree on the tensor's shape")
            flat[b:e].copy_(chunk)
        if not out.is_contiguous():
            out.copy_(flat.view(out.shape))
        self.compressor.received(p.name, out)
        p.finished = True


FUSE_MAGIC = 0x47434655  # "GCFU"
DEFAULT_FUSION_BYTES = 64 << 20  # raw gradient bytes per fused allgather, as Horovod's fusion buffer


class _Group:
    """Sparse payloads that travel in one allgather, with the index that lets receivers split it."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.members: List[Pending] = []
        self.payloads: List[torch.Tensor] = []
        self.raw_bytes = 0
        self.handle: Any = None
        self.decoded = False

    def prefix_bytes(self) -> int:
        """Size of each rank's prefix: known to every rank from the tensors' shapes alone."""
        return 8 * (4 + 2 * len(self.members)) + sum(wire.padded(wire.HEADER_BYTES + 8 * len(p.shape))
                                                     for p in self.members)

    def blob(self) -> torch.Tensor:
        """prefix (int64: magic, n, prefix bytes, blob bytes, then (payload bytes, header bytes) per
        payload, then a copy of each payload's header) + the payloads."""
        heads = [pl[:wire.padded(wire.HEADER_BYTES + 8 * len(p.shape))] for p, pl in zip(self.members, self.payloads)]
        prefix = self.prefix_bytes()
        total = prefix + sum(pl.numel() for pl in self.payloads)
        index = [FUSE_MAGIC, len(self.members), prefix, total]
        for pl, h in zip(self.payloads, heads):
            index += [pl.numel(), h.numel()]
        device = self.payloads[0].device
        index_bytes = torch.tensor(index, dtype=torch.int64).view(torch.uint8).to(device)
        return torch.cat([index_bytes, *heads, *self.payloads])


class FusedAllgatherExchange:
    """Sparse payloads fused into fewer, larger allgathers, as Horovod's tensor fusion does for
    allreduce: each allgather pays Horovod's negotiation once for many tensors.

    Payloads are encoded as each gradient is ready (the hook) and join the open group; the
    group is launched once it holds ``fusion_bytes`` of raw gradient, or once it holds as many
    tensors as the last step had (so the last group of backward does not wait for
    ``synchronize()``), or at ``synchronize()``. These rules depend only on tensor sizes and
    counts, the same on every rank; a rank whose group holds other tensors (a different
    backward order) fails with an error naming them. Each rank's part of the allgather starts
    with an index (sizes and a copy of every payload header), read to the host in one copy per
    rank: no header is read twice. Completed groups are decoded in ``progress()`` while
    backward goes on; every rank decodes the same bytes in rank order, so gradients are
    bit-identical everywhere.
    """

    def __init__(self, compressor: GradientCompressor, op: Any, process_set: Any,
                 fusion_bytes: int = DEFAULT_FUSION_BYTES) -> None:
        self.compressor, self.op, self.process_set = compressor, op, process_set
        self.fusion_bytes = fusion_bytes
        self._open: Optional[_Group] = None
        self._groups_this_step = 0
        self._started = 0
        self._expected: Optional[int] = None

    def start(self, name: str, grad: torch.Tensor) -> Pending:
        payload = self.compressor.compress_named(name, grad)
        if self._open is None:
            self._open = _Group(self._groups_this_step)
            self._groups_this_step += 1
        g = self._open
        p = Pending(name, grad.shape, grad.dtype, None, bytes_sent=payload.numel(), extra={"group": g})
        g.members.append(p)
        g.payloads.append(payload)
        g.raw_bytes += grad.numel() * grad.element_size()
        self._started += 1
        if g.raw_bytes >= self.fusion_bytes or self._started == self._expected:
            self._launch(g)
        return p

    def _launch(self, g: _Group) -> None:
        blob = g.blob()
        g.members[0].bytes_sent += g.prefix_bytes()  # the index travels once per group
        g.handle = _hvd().allgather_async(blob, name=f"hvdgc.fag.{g.index}", process_set=self.process_set)
        for m in g.members:
            m.handle = g.handle
        g.payloads = []
        if self._open is g:
            self._open = None

    def progress(self, p: Pending) -> None:
        """Decode the whole group as soon as its allgather is done; never blocks."""
        g = p.extra["group"]
        if g.handle is not None and not g.decoded and _hvd().poll(g.handle):
            self._decode(g, p)

    def advance(self, p: Pending) -> None:
        """At synchronize(): launch the group still open; the step's tensor count is learnt."""
        if self._started:
            self._expected, self._started, self._groups_this_step = self._started, 0, 0
        g = p.extra["group"]
        if g.handle is None:
            self._launch(g)

    def _decode(self, g: _Group, caller: Pending) -> None:
        """Decode every member's payloads. The seconds spent on another member are charged to it
        (``extra["codec_s"]``) and noted as ``extra["codec_elsewhere_s"]`` on ``caller``, so that
        :class:`TimedExchange` charges each tensor its own decode."""
        blob = _hvd().synchronize(g.handle)
        spent = [0.0] * len(g.members)
        size, n, prefix = self.process_set.size(), len(g.members), g.prefix_bytes()
        parts: List[Parts] = [[] for _ in range(n)]
        pos = 0
        for rank in range(size):
            if blob.numel() < pos + prefix:
                raise RuntimeError(f"fused allgather of {[m.name for m in g.members]}: rank {rank}'s part is "
                                   "truncated: ranks disagree on this exchange")
            raw = blob[pos:pos + prefix].cpu().numpy().tobytes()  # the one device-to-host copy per rank
            index = torch.frombuffer(bytearray(raw[:8 * (4 + 2 * n)]), dtype=torch.int64).tolist()
            if index[0] != FUSE_MAGIC or index[1] != n or index[2] != prefix:
                raise RuntimeError(f"fused allgather of {[m.name for m in g.members]}: rank {rank} sent a group of "
                                   f"{index[1]} tensors (index {index[:3]}): ranks disagree on the tensors fused "
                                   "together (a different backward order?)")
            head_pos, body = 8 * (4 + 2 * n), pos + prefix
            for i, member in enumerate(g.members):
                size_i, head_i = index[4 + 2 * i], index[5 + 2 * i]
                h = wire.parse_header(raw[head_pos:head_pos + head_i], size_i)
                if h.shape != tuple(member.shape):
                    raise RuntimeError(f"{member.name}: rank {rank} sent a payload of shape {h.shape}, expected "
                                       f"{tuple(member.shape)}: ranks disagree on the tensors fused together")
                t0 = time.perf_counter()
                parts[i].append(self.compressor.decode_parts(blob[body:body + size_i], h))
                spent[i] += time.perf_counter() - t0
                head_pos, body = head_pos + head_i, body + size_i
            pos += index[3]
        if pos != blob.numel():
            raise RuntimeError(f"fused allgather: {blob.numel() - pos} bytes left after {size} ranks' parts")
        g.decoded = True
        for i, member in enumerate(g.members):
            member.extra["parts"] = parts[i]
            if member is not caller:
                member.extra["codec_s"] = member.extra.get("codec_s", 0.0) + spent[i]
                caller.extra["codec_elsewhere_s"] = caller.extra.get("codec_elsewhere_s", 0.0) + spent[i]

    def finish(self, p: Pending, out: torch.Tensor) -> None:
        g = p.extra["group"]
        if g.handle is None:
            self.advance(p)
        if not g.decoded:
            self._decode(g, p)
        sum_parts(p.extra.pop("parts"), is_average(self.op), out.numel(), p.dtype, out=out)
        self.compressor.received(p.name, out)   # the feedback policy sees the average (issue 9)
        p.finished = True


def wait_done(handle: Any) -> float:
    """Block until a Horovod handle is done without consuming it; returns the seconds waited."""
    hvd = _hvd()
    t0 = time.perf_counter()
    while not hvd.poll(handle):
        time.sleep(5e-5)
    return time.perf_counter() - t0


class TimedExchange:
    """Any exchange, with its codec seconds (encode, decode, reduce) apart from its waits.

    Totals: ``codec_s`` (all codec work), ``codec_sync_s`` (the part done inside
    ``synchronize()``: advance/finish) and ``wait_s`` (time blocked on the network there).
    Each pending also carries its own in ``p.extra["codec_s"]`` / ``["wait_s"]``.
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.codec_s = self.codec_sync_s = self.wait_s = 0.0
        # GPU kernels run asynchronously: timing them means synchronising the device, which
        # costs overlap, so only when a caller needs the figures (gc.Auto, while it measures).
        self.device_sync = False

    def _clock(self, device: torch.device) -> float:
        if self.device_sync and device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    def _timed(self, p: Pending, sync: bool, fn: Any, *args: Any) -> Any:
        device = p.extra.get("device", torch.device("cpu"))
        t0 = self._clock(device)
        out = fn(*args)
        dt = self._clock(device) - t0
        p.extra["codec_s"] = p.extra.get("codec_s", 0.0) + dt - p.extra.pop("codec_elsewhere_s", 0.0)
        self.codec_s += dt
        if sync:
            self.codec_sync_s += dt
        return out

    def _wait(self, p: Pending) -> None:
        dt = wait_done(p.handle)
        p.extra["wait_s"] = p.extra.get("wait_s", 0.0) + dt
        self.wait_s += dt

    def start(self, name: str, grad: torch.Tensor) -> Pending:
        t0 = self._clock(grad.device)
        p = self.inner.start(name, grad)
        p.extra["codec_s"] = self._clock(grad.device) - t0
        p.extra["device"] = grad.device
        self.codec_s += p.extra["codec_s"]
        return p

    def progress(self, p: Pending) -> None:
        self._timed(p, False, self.inner.progress, p)

    def advance(self, p: Pending) -> None:
        if isinstance(self.inner, ScatterReduceExchange) and p.stage == 1:
            self._wait(p)  # the alltoall, before the reduce
        self._timed(p, True, self.inner.advance, p)  # launches a fused group still open

    def finish(self, p: Pending, out: torch.Tensor) -> None:
        self.advance(p)
        if p.handle is not None and "parts" not in p.extra:
            self._wait(p)
        self._timed(p, True, self.inner.finish, p, out)


def choose_exchange(compression: Any, op: Any, process_set: Any):
    """The exchange for a compression setting (None / Horovod compressor / ours / a policy such
    as :class:`hvd_gradcomp.Auto`, which builds its own with ``make_exchange``), timed: its
    ``codec_s``, ``codec_sync_s`` and ``wait_s`` say where the exchange time went."""
    make = getattr(compression, "make_exchange", None)
    if make is not None:
        return make(op, process_set)   # times itself (codec_s, codec_sync_s, wait_s)
    if isinstance(compression, QSGD):
        return TimedExchange(ScatterReduceExchange(compression, op, process_set))
    if isinstance(compression, GradientCompressor):
        return TimedExchange(FusedAllgatherExchange(compression, op, process_set))
    return TimedExchange(DenseExchange(op, process_set, compression))

