"""The wire format: the exact bytes a compressed tensor travels as.

A payload is one contiguous ``torch.uint8`` tensor, self-describing, 8-byte aligned::

    header (40 bytes, little-endian)
        magic  b"GC"        2 B
        version             1 B   (FORMAT_VERSION)
        kind                1 B   (KIND_QSGD, KIND_TOPK, KIND_TOPKQSGD; 16..255: a codec's own
                                  layout, :func:`register_layout`)
        dtype               1 B   (index into DTYPES)
        bits                1 B   (QSGD bits per value, 0 when values are raw)
        mode                1 B   index mode (low 4 bits: INDEX_NONE, INDEX_DELTA, INDEX_BITMAP)
                                  | flags (high 4 bits: FLAG_CRC32)
        ndim                1 B
        numel               8 B   elements of the original tensor
        k                   8 B   values sent (numel for QSGD)
        total_bytes         8 B   length of the whole payload, padding included
        bucket_size         4 B   QSGD bucket size (0 when unused)
        crc32               4 B   with FLAG_CRC32: zlib.crc32 of the whole payload with this
                                  field read as zero; else 0
    shape                   8 B per dimension
    sections                each padded to 8 bytes, in this order:
        KIND_QSGD           bucket norms (float32, one per bucket_size values), then the packed
                            codes (bits per value: sign and level)
        KIND_TOPK           the index sections (INDEX_DELTA: a width per block of INDEX_BLOCK
                            deltas, then the packed deltas; INDEX_BITMAP: a bit per element), then
                            the k values (in ``dtype``)
        KIND_TOPKQSGD       the index sections, then the bucket norms and packed codes of the k
                            values, as QSGD
        16..255             a codec's own layout (:func:`register_layout`): its ``pack`` writes
                            the sections, its ``unpack`` reads them in the same order

Because every payload carries ``total_bytes``, payloads gathered from several ranks can be
split apart by walking headers (:func:`split_payloads`) with no extra collective.

Indices of sparse payloads are delta coded in blocks of ``INDEX_BLOCK`` with a per-block bit
width (:func:`encode_indices`), or sent as a bitmap when that is smaller.

Version 1 payloads (the same layout, without flags and checksum) are still read. Every
malformed payload raises :class:`WireFormatError` before a decoder allocates more than a
small multiple of the payload's own size: :func:`read_header` checks that the payload is
large enough for the values its header declares, and the index decoders check what they
decode against ``numel`` and ``k``.
"""
from __future__ import annotations

import math
import struct
import zlib
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch


FORMAT_VERSION = 2
READ_VERSIONS = (1, 2)  # 1: no flags, no checksum
MAGIC = b"GC"
KIND_QSGD, KIND_TOPK, KIND_TOPKQSGD = 1, 2, 3
BUILTIN_KINDS = (KIND_QSGD, KIND_TOPK, KIND_TOPKQSGD)
INDEX_NONE, INDEX_DELTA, INDEX_BITMAP = 0, 1, 2
FLAG_CRC32 = 0x10
_MODE_MASK = 0x0F
_CRC_AT = 36  # offset of the crc32 field
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_NDIM = 64
INDEX_BLOCK = 64  # deltas per block: 64 * width bits is always a whole number of bytes
ALIGN = 8

_HEADER = struct.Struct("<2sBBBBBBqqqII")
HEADER_BYTES = _HEADER.size  # 40


class WireFormatError(ValueError):
    """A payload that is not a valid hvd-gradcomp payload (truncated, wrong version, ...)."""


@dataclass(frozen=True)
class Layout:
    """A payload layout of a codec's own: the sections its ``pack`` writes after the header, as
    the receiving ranks check them before any decoder runs (see :func:`register_layout`).

    * ``name``: for messages;
    * ``min_section_bytes(header)``: the fewest section bytes a valid payload with this header holds
      (what the decoder will read); every count the decoder allocates for must follow from it, so
      a truncated or forged payload is refused before decoding;
    * ``check(header)``: raise :class:`WireFormatError` for header fields the encoder never writes
      (default: ``k`` in ``0..numel``).
    """

    name: str
    min_section_bytes: Callable[["Header"], int]
    check: Optional[Callable[["Header"], None]] = None


FIRST_OWN_KIND = 16
"""Kinds below this are the built-in layouts' (and reserved for them)."""
_LAYOUTS: dict = {}


def register_layout(kind: int, layout: Layout) -> int:
    """Declare the payload layout ``kind`` (``FIRST_OWN_KIND``..255) for a codec of your own, whose
    ``kind`` class attribute names it; returns ``kind``. The same kind with the same layout may be
    registered again (a module imported twice); another layout under a taken kind is refused.

    >>> SIGNS = register_layout(40, Layout("signs", lambda h: padded(4) + padded((h.numel + 7) // 8)))
    >>> SIGNS, layout_name(SIGNS), layout_name(KIND_TOPK)
    (40, 'signs', 'topk')
    >>> register_layout(2, Layout("mine", lambda h: 0))
    Traceback (most recent call last):
    hvd_gradcomp.wire.format.WireFormatError: payload kind 2 is a built-in layout's: choose a kind in 16..255
    """
    if isinstance(kind, bool) or not isinstance(kind, int) or not FIRST_OWN_KIND <= kind <= 255:
        raise WireFormatError(f"payload kind {kind!r} is a built-in layout's: choose a kind in {FIRST_OWN_KIND}..255")
    if not isinstance(layout, Layout) or not callable(layout.min_section_bytes):
        raise WireFormatError(f"register_layout needs a wire.Layout with a callable min_section_bytes, got {layout!r}")
    old = _LAYOUTS.get(kind)
    if old is not None and old != layout:
        raise WireFormatError(f"payload kind {kind} is taken by layout {old.name!r}: choose another kind in "
                              f"{FIRST_OWN_KIND}..255")
    _LAYOUTS[kind] = layout
    return kind


def layout_name(kind: int) -> str:
    """The name of payload kind ``kind`` (built-in or registered); ``WireFormatError`` when unknown."""
    builtin = {KIND_QSGD: "qsgd", KIND_TOPK: "topk", KIND_TOPKQSGD: "topk-qsgd"}
    if kind in builtin:
        return builtin[kind]
    if kind in _LAYOUTS:
        return _LAYOUTS[kind].name
    raise WireFormatError(f"unknown payload kind {kind}: a codec with a layout of its own registers it with "
                          "hvd_gradcomp.wire.register_layout on every rank (import its module before training)")


@dataclass(frozen=True)
class Header:
    kind: int
    dtype: torch.dtype
    bits: int
    index_mode: int
    shape: Tuple[int, ...]
    numel: int
    k: int
    total_bytes: int
    bucket_size: int
    checksum: bool = False

    @property
    def nbytes(self) -> int:
        """Bytes of header plus shape: where the first section starts."""
        return HEADER_BYTES + 8 * len(self.shape)


def padded(n: int) -> int:
    """n rounded up to the section alignment."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


def header_bytes(h: Header) -> bytes:
    """Serialise a header (and the shape that follows it)."""
    if h.dtype not in DTYPES:
        raise WireFormatError(f"dtype {h.dtype} cannot be encoded; supported: {DTYPES}")
    mode = h.index_mode | (FLAG_CRC32 if h.checksum else 0)
    head = _HEADER.pack(MAGIC, FORMAT_VERSION, h.kind, DTYPES.index(h.dtype), h.bits, mode,
                        len(h.shape), h.numel, h.k, h.total_bytes, h.bucket_size, 0)
    return head + struct.pack(f"<{len(h.shape)}q", *h.shape)


def read_header(payload: torch.Tensor) -> Header:
    """Parse the header at the start of ``payload`` (reads at most 40 + 8*ndim bytes to the host).

    Checks every field, and that the payload holds at least the bytes its declared values
    need, so that nothing sized from the header can be larger than the payload allows.
    The checksum is verified separately (:func:`verify_checksum`): it reads the whole payload.
    """
    if payload.dtype != torch.uint8 or payload.dim() != 1:
        raise WireFormatError(f"a payload is a 1-D torch.uint8 tensor, got {payload.dtype} of shape "
                              f"{tuple(payload.shape)}")
    if payload.numel() < HEADER_BYTES:
        raise WireFormatError(f"payload of {payload.numel()} bytes is shorter than the {HEADER_BYTES}-byte header")
    raw = payload[:HEADER_BYTES].cpu().numpy().tobytes()
    ndim = raw[7]
    if ndim <= MAX_NDIM and payload.numel() >= HEADER_BYTES + 8 * ndim:
        raw += payload[HEADER_BYTES:HEADER_BYTES + 8 * ndim].cpu().numpy().tobytes()
    return parse_header(raw, payload.numel())


def parse_header(raw: bytes, available: int) -> Header:
    """Parse and check a header from host bytes (40 bytes, then 8 per dimension), for a payload
    of ``available`` bytes: where the header bytes were already copied to the host in bulk (one
    device-to-host copy for many payloads, see :class:`hvd_gradcomp.collectives.exchange.FusedAllgatherExchange`)."""
    if len(raw) < HEADER_BYTES:
        raise WireFormatError(f"payload of {len(raw)} bytes is shorter than the {HEADER_BYTES}-byte header")
    magic, version, kind, dtype, bits, mode, ndim, numel, k, total, bucket, crc = _HEADER.unpack(raw[:HEADER_BYTES])
    if magic != MAGIC:
        raise WireFormatError(f"not an hvd-gradcomp payload (magic {magic!r})")
    if version not in READ_VERSIONS:
        raise WireFormatError(f"payload format version {version}, this build reads {READ_VERSIONS}: "
                              "run the same hvd-gradcomp version on every rank")
    flags = mode & ~_MODE_MASK
    if flags & ~FLAG_CRC32 or (version == 1 and (flags or crc)) or (not flags and crc):
        raise WireFormatError(f"corrupt payload: unknown flags {flags:#x} or stray checksum {crc:#x} "
                              f"in a version {version} header")
    if dtype >= len(DTYPES):
        raise WireFormatError(f"unknown dtype code {dtype}")
    if ndim > MAX_NDIM or available < HEADER_BYTES + 8 * ndim or len(raw) < HEADER_BYTES + 8 * ndim:
        raise WireFormatError(f"corrupt or truncated payload: {ndim} dimensions declared, "
                              f"{available} bytes present")
    shape = struct.unpack(f"<{ndim}q", raw[HEADER_BYTES:HEADER_BYTES + 8 * ndim])
    if any(d < 0 for d in shape) or math.prod(shape) != numel:
        raise WireFormatError(f"corrupt payload: shape {shape} does not hold {numel} elements")
    if not padded(HEADER_BYTES + 8 * ndim) <= total <= available:
        raise WireFormatError(f"corrupt or truncated payload: {total} bytes declared, {available} present")
    h = Header(kind, DTYPES[dtype], bits, mode & _MODE_MASK, tuple(shape), numel, k, total, bucket,
               bool(flags & FLAG_CRC32))
    _check_fields(h)
    need = padded(h.nbytes) + min_section_bytes(h)
    if total < need:
        raise WireFormatError(f"corrupt or truncated payload: {k} values of {numel} need at least {need} "
                              f"bytes, the payload declares {total}")
    return h


def _check_fields(h: Header) -> None:
    """Reject header fields no encoder writes, before they reach a decoder."""
    kind, bits, mode, numel, k, bucket = h.kind, h.bits, h.index_mode, h.numel, h.k, h.bucket_size
    if kind not in BUILTIN_KINDS:
        layout_name(kind)   # unknown: refused, naming the fix
        own = _LAYOUTS[kind]
        if own.check is not None:
            own.check(h)
        elif not 0 <= k <= numel:
            raise WireFormatError(f"corrupt payload: {own.name} payload with k {k} of {numel}")
        return
    quantised = kind in (KIND_QSGD, KIND_TOPKQSGD)
    if quantised and not (2 <= bits <= 8 and bucket >= 1):
        raise WireFormatError(f"corrupt payload: QSGD bits {bits} (2..8), bucket size {bucket} (>= 1)")
    if kind == KIND_TOPK and bits != 0:
        raise WireFormatError(f"corrupt payload: TopK values are raw, bits must be 0, got {bits}")
    if kind == KIND_QSGD and (k != numel or mode != INDEX_NONE):
        raise WireFormatError(f"corrupt payload: QSGD sends every value, k {k} != numel {numel}")
    if kind != KIND_QSGD and (not 1 <= k <= numel or mode not in (INDEX_DELTA, INDEX_BITMAP)):
        raise WireFormatError(f"corrupt payload: sparse payload with k {k} of {numel}, index mode {mode}")


def min_section_bytes(h: Header) -> int:
    """The fewest section bytes a valid payload with this header has (delta-coded index data
    excluded: its size depends on the indices). Every count a decoder allocates for is thus
    bounded by the payload's own size, except the dense output of a delta-coded sparse payload.
    A registered layout says its own (:class:`Layout`).
    """
    if h.kind in _LAYOUTS:
        return int(_LAYOUTS[h.kind].min_section_bytes(h))
    if h.kind == KIND_QSGD:
        values = h.numel
    elif h.index_mode == INDEX_BITMAP:
        values = h.k
        index = padded((h.numel + 7) // 8)
    else:
        values = h.k
        index = padded((h.k + INDEX_BLOCK - 1) // INDEX_BLOCK)
    if h.kind == KIND_TOPK:
        body = padded(values * h.dtype.itemsize)
    else:
        body = padded(4 * ((values + h.bucket_size - 1) // h.bucket_size)) + padded((values * h.bits + 7) // 8)
    return body if h.kind == KIND_QSGD else index + body


def payload_crc32(payload: torch.Tensor) -> int:
    """zlib.crc32 of a payload (copied to the host), with its crc32 field read as zero."""
    data = payload.cpu().numpy()
    crc = zlib.crc32(data[:_CRC_AT])
    crc = zlib.crc32(bytes(4), crc)
    return zlib.crc32(data[_CRC_AT + 4:], crc)


def verify_checksum(payload: torch.Tensor, h: Header) -> None:
    """Raise :class:`WireFormatError` if a checksummed payload's bytes changed on the way."""
    if not h.checksum:
        return
    stored = struct.unpack("<I", payload[_CRC_AT:_CRC_AT + 4].cpu().numpy().tobytes())[0]
    actual = payload_crc32(payload[:h.total_bytes])
    if stored != actual:
        raise WireFormatError(f"corrupt payload: CRC32 {actual:#010x} does not match the header's {stored:#010x} "
                              "(bytes changed in transit or in memory)")


def assemble(header: Header, sections: List[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Concatenate header and uint8 sections, each padded to ``ALIGN`` bytes, into one payload.

    ``header.total_bytes`` is ignored and recomputed; with ``header.checksum`` the crc32 field
    is filled in (a copy of the payload to the host when it lives on a GPU).
    """
    sizes = [padded(s.numel()) for s in sections]
    total = padded(header.nbytes) + sum(sizes)
    hdr = Header(**{**header.__dict__, "total_bytes": total})
    out = _reserved_payload(sections, total)
    if out is None:  # empty, not zeros: a large payload is written once, only padding is zeroed
        out = torch.empty(total, dtype=torch.uint8, device=device)
    head = torch.frombuffer(bytearray(header_bytes(hdr)), dtype=torch.uint8)
    pos = padded(hdr.nbytes)
    out[:pos].zero_()
    out[:head.numel()].copy_(head)
    for s, size in zip(sections, sizes):
        if s.data_ptr() != out[pos:].data_ptr():
            out[pos:pos + s.numel()].copy_(s)
        out[pos + s.numel():pos + size].zero_()
        pos += size
    if hdr.checksum:
        crc = torch.frombuffer(bytearray(struct.pack("<I", payload_crc32(out))), dtype=torch.uint8)
        out[_CRC_AT:_CRC_AT + 4].copy_(crc)
    return out


# Room for the largest header (ndim is one byte) in front of reserved sections.
_MAX_HEAD = padded(HEADER_BYTES + 8 * 255)


def reserve(section_bytes: List[int], device: torch.device) -> List[torch.Tensor]:
    """uint8 views, one per section, placed as :func:`assemble` will place them.

    A kernel that writes its output straight into these views saves ``assemble`` a copy of
    it (25 MB for QSGD-8 on 25M values): ``assemble`` then writes the header in front and
    returns a view of this buffer (up to ``_MAX_HEAD`` unused bytes precede it).
    """
    sizes = [padded(n) for n in section_bytes]
    buf = torch.empty(_MAX_HEAD + sum(sizes), dtype=torch.uint8, device=device)
    views, pos = [], _MAX_HEAD
    for n, size in zip(section_bytes, sizes):
        views.append(buf[pos:pos + n])
        pos += size
    return views


def _reserved_payload(sections: List[torch.Tensor], total: int) -> Optional[torch.Tensor]:
    """The payload view of a :func:`reserve` buffer when every section already sits in it."""
    base = sections[0]._base if sections else None
    if base is None or base.dtype != torch.uint8 or base.dim() != 1 or not 0 <= base.numel() - total <= _MAX_HEAD:
        return None
    out = base[base.numel() - total:]
    pos = total - sum(padded(s.numel()) for s in sections)
    for s in sections:
        if s._base is not base or s.data_ptr() != out[pos:].data_ptr():
            return None
        pos += padded(s.numel())
    return out


class SectionReader:
    """Reads the sections of a payload back in the order they were assembled."""

    def __init__(self, payload: torch.Tensor, header: Header) -> None:
        self.payload = payload
        self.pos = padded(header.nbytes)
        self.end = header.total_bytes

    def take(self, nbytes: int) -> torch.Tensor:
        if self.pos + nbytes > self.end:
            raise WireFormatError(f"truncated payload: need {nbytes} bytes at offset {self.pos}, "
                                  f"payload ends at {self.end}")
        out = self.payload[self.pos:self.pos + nbytes]
        self.pos += padded(nbytes)
        return out


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """View a contiguous tensor as flat uint8 (no copy)."""
    return t.contiguous().view(-1).view(torch.uint8)


def from_bytes(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret uint8 bytes as ``dtype``; copies only when the bytes are misaligned."""
    try:
        return b.view(dtype)
    except RuntimeError:
        return b.clone().view(dtype)


def split_payloads(blob: torch.Tensor) -> List[torch.Tensor]:
    """Split concatenated payloads (e.g. the output of an allgather) into single payloads."""
    return [p for p, _ in split_with_headers(blob)]


def split_with_headers(blob: torch.Tensor) -> List[Tuple[torch.Tensor, Header]]:
    """Concatenated payloads as (payload, its header): each header is read once, and the decoder
    reuses it instead of reading it again (a device-to-host copy each, on GPU)."""
    out, pos, n = [], 0, blob.numel()
    while pos < n:
        h = read_header(blob[pos:])
        out.append((blob[pos:pos + h.total_bytes], h))
        pos += h.total_bytes
    return out
