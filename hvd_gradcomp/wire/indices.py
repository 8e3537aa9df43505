"""How the indices of a sparse payload are written (see :mod:`hvd_gradcomp.wire.format`): bit packing
(:func:`pack_bits`, :func:`unpack_bits`) and the index sections, delta coded in blocks of
``INDEX_BLOCK`` with a per-block bit width or a bitmap, whichever is smaller (:func:`encode_indices`,
:func:`decode_indices`).
"""
from __future__ import annotations

import sys
from typing import Callable, List, Optional, Tuple

import torch

from .format import INDEX_BITMAP, INDEX_BLOCK, INDEX_DELTA, SectionReader, WireFormatError, padded

# ---------------------------------------------------------------- bit packing
_SHIFTS = {}


def _shifts(width: int, device: torch.device) -> torch.Tensor:
    key = (width, device)
    if key not in _SHIFTS:
        _SHIFTS[key] = torch.arange(width, dtype=torch.int64, device=device)
    return _SHIFTS[key]


def pack_bits(values: torch.Tensor, width: int) -> torch.Tensor:
    """Pack non-negative integers < 2**width into ceil(n*width/8) bytes, little-endian bit order.

    >>> pack_bits(torch.tensor([1, 2, 3, 0]), 2).tolist()   # 0b00_11_10_01
    [57]
    """
    if width == 8:
        return values.to(torch.uint8)
    n = values.numel()
    if width in (1, 2, 4):
        per = 8 // width
        v = values.to(torch.uint8)
        if n % per:
            v = torch.cat([v, v.new_zeros(per - n % per)])
        v = v.view(-1, per)
        out = v[:, 0].clone()
        for j in range(1, per):
            out |= v[:, j] << (j * width)
        return out
    # Generic widths (indices up to 40 bits, QSGD 3/5/6/7 bits), in chunks to bound memory.
    nbits = n * width
    out_bits = torch.empty(nbits + (-nbits) % 8, dtype=torch.uint8, device=values.device)
    out_bits[nbits:] = 0
    chunk = 1 << 20
    sh = _shifts(width, values.device)
    for s in range(0, n, chunk):
        v = values[s:s + chunk].to(torch.int64)
        out_bits[s * width:(s + v.numel()) * width] = ((v.unsqueeze(1) >> sh) & 1).view(-1).to(torch.uint8)
    return pack_bits(out_bits, 1)


def unpack_bits(packed: torch.Tensor, width: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the first ``n`` values as int64 (uint8 for width 8)."""
    if width == 8:
        return packed[:n]
    if width in (1, 2, 4):
        per, mask = 8 // width, (1 << width) - 1
        cols = [(packed >> (j * width)) & mask for j in range(per)]
        return torch.stack(cols, dim=1).view(-1)[:n]
    bits = unpack_bits(packed, 1, n * width).to(torch.int64).view(n, width)
    return (bits << _shifts(width, packed.device)).sum(dim=1)


def bit_length(x: torch.Tensor) -> torch.Tensor:
    """Bits needed for each non-negative int64 (0 for 0). Exact below 2**53."""
    return torch.frexp(x.to(torch.float64))[1].to(torch.int64)


# ---------------------------------------------------------------- indices
def _block_layout(widths: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per value of a delta-coded index section: its bit offset in the data and its width.

    Block b starts at byte 8 * sum(widths[:b]) (INDEX_BLOCK = 64 values of widths[b] bits) and
    value j of the block sits at bit j * widths[b] after that, little-endian bit order.
    """
    w = widths.to(torch.int64)
    starts = (torch.cumsum(w, 0) - w) * INDEX_BLOCK  # in bits
    j = torch.arange(INDEX_BLOCK, dtype=torch.int64, device=w.device)
    offsets = starts.unsqueeze(1) + j * w.unsqueeze(1)
    return offsets.view(-1), w.repeat_interleave(INDEX_BLOCK)


# Bytes one value of up to 40 bits can touch, starting at any bit of its first byte.
_SPAN = 6


def _span(widths: torch.Tensor) -> int:
    """Bytes a value of the widest block can touch: fewer byte passes for narrow blocks."""
    return (int(widths.max()) + 14) // 8 if widths.numel() else 1


def delta_index_bytes(indices: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-block widths (uint8) and the packed deltas of sorted, distinct int64 indices.

    delta_0 = idx_0, delta_j = idx_j - idx_{j-1} - 1; blocks of INDEX_BLOCK deltas share the
    smallest width that holds their largest delta, so dense regions cost few bits.

    All blocks are packed at once, whatever their widths: each value is shifted to its bit
    offset and split into the (at most ``_SPAN``) bytes it touches; bits of different values
    never overlap, so adding the byte pieces up is the same as OR-ing them.
    """
    k = indices.numel()
    deltas = torch.zeros(k + (-k) % INDEX_BLOCK, dtype=torch.int64, device=indices.device)
    if k:
        deltas[0] = indices[0]
        deltas[1:k] = indices[1:] - indices[:-1] - 1
    widths = bit_length(deltas.view(-1, INDEX_BLOCK).max(dim=1).values)
    offsets, _ = _block_layout(widths)
    nbytes = int(widths.sum()) * (INDEX_BLOCK // 8)
    shifted = deltas << (offsets & 7)
    first = offsets >> 3
    out = torch.zeros(nbytes + _SPAN, dtype=torch.int64, device=indices.device)
    for b in range(_span(widths)):
        out.index_add_(0, first + b, (shifted >> (8 * b)) & 0xFF)
    return widths.to(torch.uint8), out[:nbytes].to(torch.uint8)


def unpack_deltas(widths: torch.Tensor, starts: torch.Tensor, words: torch.Tensor, out: torch.Tensor) -> None:
    """The deltas of a delta-coded index section (:func:`decode_delta_indices`), in one loop over them:
    the form :func:`hvd_gradcomp.codecs.kernels.decode_deltas` compiles.

    A block of ``INDEX_BLOCK`` (64) values of ``w`` bits is exactly ``w`` little-endian int64
    words, so each value lies in at most two words of its block: two gathers per value, where
    gathering the bytes it touches took up to six (4x slower for 42K indices on CPU, compiled;
    eager, the byte gathers are the faster). ``widths``/``starts``: per block, its bit width and
    first word (int64); ``words``: the section as int64 words. ``>>`` on int64 copies the sign
    bit down: masked off below.
    """
    j = torch.arange(out.numel(), device=out.device)
    blk = j // INDEX_BLOCK
    w = widths[blk]
    bit = (j % INDEX_BLOCK) * w
    # clamped: a zero-width block after the last word (a run of consecutive indices at the end)
    # starts past it; its values are masked to 0 below whatever is read
    word = torch.clamp(starts[blk] + (bit >> 6), max=words.numel() - 1)
    s = bit & 63
    lo = words[word]
    hi = words[torch.clamp(word + 1, max=words.numel() - 1)]
    low = (lo >> s) & ((1 << torch.clamp(64 - s, max=63)) - 1)   # s = 0: 63 bits, more than any width
    high = (hi << 1) << (63 - s)                                  # hi << (64 - s); 0 when s = 0
    out.copy_((low | high) & ((1 << w) - 1))


def decode_delta_indices(widths: torch.Tensor, data: torch.Tensor, k: int,
                         unpack: Optional[Callable[..., None]] = None) -> torch.Tensor:
    """Inverse of :func:`delta_index_bytes`: the k sorted indices.

    Eager, one gather per byte span of the widest block. ``unpack``: a compiled
    :func:`unpack_deltas` (:func:`hvd_gradcomp.codecs.kernels.decode_deltas` passes one for many
    indices), run over the section read as int64 words instead; the same values.

    >>> widths, data = delta_index_bytes(torch.tensor([0, 5, 6, 100]))
    >>> decode_delta_indices(widths, data, 4).tolist()
    [0, 5, 6, 100]
    """
    if unpack is not None and k and data.numel() and sys.byteorder == "little":
        w = widths.to(torch.int64)
        starts = torch.cumsum(w, 0) - w    # in words: block b is 8 * w[b] bytes
        # int64 words need an 8-byte-aligned start (a payload slice may not have one: then a copy)
        words = (data if data.storage_offset() % 8 == 0 else data.clone()).view(torch.int64)
        deltas = torch.empty(k, dtype=torch.int64, device=data.device)
        unpack(w, starts, words, deltas)
        return torch.cumsum(deltas + 1, 0) - 1
    offsets, w = _block_layout(widths)
    offsets, w = offsets[:k], w[:k]
    padded_data = torch.cat([data.to(torch.int64), data.new_zeros(_SPAN, dtype=torch.int64)])
    first = offsets >> 3
    word = torch.zeros(k, dtype=torch.int64, device=data.device)
    for b in range(_span(widths)):
        word |= padded_data.index_select(0, first + b) << (8 * b)
    deltas = (word >> (offsets & 7)) & ((1 << w) - 1)
    return torch.cumsum(deltas + 1, 0) - 1


# Widest delta the decoder reads: a value starting at bit 7 of its first byte must fit the
# ``_SPAN`` bytes gathered for it (7 + 41 bits), i.e. tensors of up to 2**41 elements.
_MAX_DELTA_BITS = 8 * _SPAN - 7

def encode_indices(indices: torch.Tensor, numel: int) -> Tuple[int, List[torch.Tensor]]:
    """Choose the smaller of delta blocks and a bitmap; return (index_mode, sections)."""
    widths, data = delta_index_bytes(indices)
    delta_size = padded(widths.numel()) + padded(data.numel())
    bitmap_size = padded((numel + 7) // 8)
    if bitmap_size < delta_size:
        mask = torch.zeros(numel, dtype=torch.uint8, device=indices.device)
        mask[indices] = 1
        return INDEX_BITMAP, [pack_bits(mask, 1)]
    return INDEX_DELTA, [widths, data]


def decode_indices(reader: SectionReader, mode: int, k: int, numel: int,
                   decode_deltas: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor] = decode_delta_indices
                   ) -> torch.Tensor:
    """Read the index sections written by :func:`encode_indices`: k sorted indices below numel.

    ``decode_deltas``: :func:`decode_delta_indices` or a faster equal (the codecs pass
    :func:`hvd_gradcomp.codecs.kernels.decode_deltas`, which compiles it for many indices).

    Raises :class:`WireFormatError` when the sections cannot hold such indices (a bitmap with
    another count of set bits, a block wider than any index of ``numel``, indices past it).
    """
    if mode == INDEX_BITMAP:
        mask = unpack_bits(reader.take((numel + 7) // 8), 1, numel)
        idx = mask.nonzero().squeeze(1)
        if idx.numel() != k:
            raise WireFormatError(f"corrupt payload: index bitmap has {idx.numel()} entries, the header says {k}")
        return idx
    if mode != INDEX_DELTA:
        raise WireFormatError(f"unknown index mode {mode}")
    nblocks = (k + INDEX_BLOCK - 1) // INDEX_BLOCK
    widths = reader.take(nblocks)
    widest = int(widths.max()) if nblocks else 0
    # No delta exceeds numel - 1; with that bound the int64 sum of k deltas cannot wrap either.
    if widest > min((numel - 1).bit_length(), _MAX_DELTA_BITS) or widest + k.bit_length() > 62:
        raise WireFormatError(f"corrupt payload: {widest}-bit index deltas for a tensor of {numel} elements")
    data = reader.take(int(widths.to(torch.int64).sum()) * (INDEX_BLOCK // 8))
    idx = decode_deltas(widths, data, k)
    if k and int(idx[-1]) >= numel:
        raise WireFormatError(f"corrupt payload: index {int(idx[-1])} out of range for {numel} elements")
    return idx
