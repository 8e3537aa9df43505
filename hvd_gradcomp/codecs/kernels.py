"""The codecs' arithmetic: QSGD's stochastic rounding (:func:`qsgd_encode`, :func:`qsgd_decode`),
exact top-k selection (:func:`topk`), and the compiled index decoder the sparse codecs read their
payloads with (:func:`decode_deltas`). Device-agnostic torch code, compiled for large tensors by
:func:`hvd_gradcomp.feedback.kernels.kernel` (``HVDGC_COMPILE``); error feedback's arithmetic, which
these build on, is in :mod:`hvd_gradcomp.feedback.kernels`.

Speed notes (measured by ``benchmarks/bench_compressors.py``):

* Stochastic rounding needs one uniform number per element. ``torch.rand`` alone costs
  about 4x a ``clone()`` on CPU, so the noise is an integer hash of the element index and a
  32-bit seed instead: reproducible from the seed, independent of the device, and fusable.
* Top-k uses a threshold estimated from a strided sample to find a small candidate superset,
  then an exact ``torch.topk`` over the candidates: the result is the exact top-k, at a
  fraction of the cost of ``torch.topk`` over the whole tensor (under error feedback the
  candidates were marked already: :func:`hvd_gradcomp.feedback.kernels.add_marked`).
* Per-payload work on ~42K values (a 1% top-k of a 2048x2048 layer) is dominated by the
  count of eager ops, not by the values: the delta-index decoder is one compiled loop there.
* Inductor's CPU code is slow at some conversions (uint8 -> float32, float selects on
  compares): the kernels go through float or int16 instead. The hash runs in int32 (AVX2 has
  no 64-bit multiply). Kernels write into caller buffers so the short last bucket needs no ``cat``.
"""
from __future__ import annotations

import math
from typing import Callable, Optional, Tuple

import torch

from ..feedback.kernels import SentCodes, abs_at_least, kernel, sample_slice, sample_threshold
from ..feedback.kernels import COMPILE_MIN_NUMEL  # noqa: F401  (codecs/qsgd.py reads it here, with the kernels)
from ..wire import indices

_M32 = 0xFFFFFFFF
_HASH_MUL = 0x045D9F3B


def _uniform_from_hash(start: torch.Tensor, n: int, seed: torch.Tensor, device: torch.device) -> torch.Tensor:
    """n uniforms in [0, 1) from a 32-bit integer hash of (element index + start) xor seed.

    The hash is the 32-bit one ``h ^= h >> 16; h *= 0x045D9F3B`` (twice, then ``h ^= h >> 16``),
    computed in int32: AVX2 has no 64-bit multiply, so int64 arithmetic costs ~3x here. int32
    products wrap modulo 2**32 on every backend (vpmulld, CUDA, Triton), which is exactly the
    32-bit hash; ``& 0xFFFF`` after each right shift undoes the sign extension. ``start`` and
    ``seed`` are int32 tensors holding the low 32 bits, so no value of theirs recompiles.
    """
    idx = torch.arange(n, dtype=torch.int32 if n < 1 << 31 else torch.int64, device=device)
    h = (idx.to(torch.int32) + start) ^ seed
    h = (((h >> 16) & 0xFFFF) ^ h) * _HASH_MUL
    h = (((h >> 16) & 0xFFFF) ^ h) * _HASH_MUL
    h = ((h >> 16) & 0xFFFF) ^ h
    return ((h >> 8) & 0xFFFFFF).to(torch.float32) * (1.0 / (1 << 24))


def _sum_squares(xf: torch.Tensor) -> torch.Tensor:
    """Per-row float64 sum of squares, to be rounded to float32 by its users.

    float32 squares are exact in float64 and the float64 sum is far more precise than float32,
    so the rounded result does not depend on the summation order: the compiled and the eager
    kernel produce the same norms, hence the same payload bytes. (Returned unrounded because
    a separate rounding step would stop inductor from fusing the norm and the quantisation
    into one pass over each bucket.)
    """
    xd = xf.to(torch.float64)
    return (xd * xd).sum(dim=1)


def _norms(sq: torch.Tensor, cap: float) -> torch.Tensor:
    """float32 bucket norms from float64 sums of squares, at most ``cap``.

    The square root is taken in float64: values near 1e19 have squares past float32's range
    although their norm is not. Any scale at least as large as the bucket's largest value
    keeps QSGD unbiased, so a norm past ``cap`` (the largest value the decoded dtype holds,
    see :func:`norm_cap`) is simply lowered to it and no decoded value can overflow; a value
    larger than the cap itself is sent as the cap (its level clamps to s).
    """
    return sq.sqrt().clamp(max=cap).to(torch.float32)


def norm_cap(dtype: torch.dtype) -> float:
    """The largest QSGD scale whose levels decode to finite values of ``dtype``.

    Decoding multiplies in float32 (level * (norm / s)), which can round one ulp up: float32
    keeps a 2**-20 margin below its maximum. float16 and bfloat16 values are rounded from
    float32, where their maximum is exact and one ulp above it still rounds back to it.

    >>> norm_cap(torch.float16)
    65504.0
    """
    top = float(torch.finfo(dtype).max)
    return top * (1 - 2 ** -20) if dtype == torch.float32 else top


def _qsgd_encode_into(x: torch.Tensor, codes: torch.Tensor, seed: torch.Tensor, start: torch.Tensor,
                      bits: int, cap: float) -> torch.Tensor:
    """x: (buckets, bucket_size). Writes uint8 codes into ``codes`` (same shape), returns the
    float64 sum of squares per bucket (see :func:`_sum_squares`; norms follow by :func:`_norms`).

    code = sign << (bits-1) | level, level = floor(|x| / norm * s + u), s = 2**(bits-1) - 1,
    u ~ U[0, 1): E[level] = |x| / norm * s, so the decoded value is unbiased. Writing into a
    caller's buffer lets the last, shorter bucket land next to the others without a ``cat``.
    """
    # 2 ** (bits - 1), not 1 << (bits - 1): under torch.compile(dynamic=True) bits is symbolic,
    # and PyTorch 2.11's symbolic shapes cannot evaluate a shift (the kernel fell back to eager).
    s = 2 ** (bits - 1) - 1
    xf = x.to(torch.float32)
    sq = _sum_squares(xf)
    norms = _norms(sq, cap)
    scale = torch.where(norms > 0, s / norms, torch.zeros_like(norms)).unsqueeze(1)
    u = _uniform_from_hash(start, x.numel(), seed, x.device).view_as(xf)
    level = torch.floor(xf.abs() * scale + u).clamp_(max=s)
    # The sign as a float select, then one float->uint8 conversion: storing a boolean mask as
    # bytes is ~10x slower than this in inductor's CPU code.
    codes.copy_(torch.where(xf < 0, level + (s + 1), level).to(torch.uint8))
    return sq


def _signed_levels(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """+-level of each code, as float32.

    Integer arithmetic in int16, converted once: in inductor's CPU code a uint8 -> float32
    conversion, or a float select on a compare, runs 1.5-4x slower than this.
    """
    s = 2 ** (bits - 1) - 1   # not a shift: see _qsgd_encode_into
    c = codes.to(torch.int16)
    return ((c & s) * (1 - 2 * (c >> (bits - 1)))).to(torch.float32)


def _qsgd_decode_into(out: torch.Tensor, step: torch.Tensor, codes: torch.Tensor, bits: int) -> None:
    """Inverse of :func:`_qsgd_encode_into`: out[b, i] = +-level * step[b], step = norm / s."""
    out.copy_((_signed_levels(codes, bits) * step.unsqueeze(1)).to(out.dtype))


def _qsgd_subtract_into(acc: torch.Tensor, step: torch.Tensor, codes: torch.Tensor, bits: int,
                        dtype: torch.dtype) -> None:
    """acc -= decoded codes as the receiver sees them (rounded to ``dtype``), in one pass."""
    acc.sub_((_signed_levels(codes, bits) * step.unsqueeze(1)).to(dtype).to(acc.dtype))

def _seed_tensors(seed: int, start: int, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """Seed and start as int32 tensors of their low 32 bits (tensors: new values never recompile)."""
    def low32(v: int) -> int:
        v &= _M32
        return v - (1 << 32) if v >= 1 << 31 else v
    return (torch.tensor(low32(seed), dtype=torch.int32, device=device),
            torch.tensor(low32(start), dtype=torch.int32, device=device))


def qsgd_encode(flat: torch.Tensor, bits: int, bucket_size: int, seed: int,
                codes: Optional[torch.Tensor] = None,
                dtype: torch.dtype = torch.float32) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantise a 1-D tensor: (float32 norm per bucket, uint8 code per element).

    The last bucket may be shorter than ``bucket_size``. ``codes``, when given, is the uint8
    buffer the codes are written to (e.g. a payload section, see :func:`wire.reserve`).
    ``dtype`` is what the values will be decoded to: norms are capped so that every decoded
    value is finite in it (see :func:`norm_cap`).

    >>> norms, codes = qsgd_encode(torch.tensor([3.0, -4.0]), bits=8, bucket_size=2, seed=0)
    >>> norms.tolist(), codes.shape
    ([5.0], torch.Size([2]))
    """
    n = flat.numel()
    full = n // bucket_size * bucket_size
    if codes is None:
        codes = torch.empty(n, dtype=torch.uint8, device=flat.device)
    cap = norm_cap(dtype)
    sums = []
    if full:
        seed_t, start = _seed_tensors(seed, 0, flat.device)
        sums.append(kernel("qsgd_encode", full, _qsgd_encode_into)(flat[:full].view(-1, bucket_size),
                                                                   codes[:full].view(-1, bucket_size), seed_t,
                                                                   start, bits, cap))
    if full < n:
        seed_t, start = _seed_tensors(seed, full, flat.device)
        sums.append(_qsgd_encode_into(flat[full:].view(1, -1), codes[full:].view(1, -1), seed_t, start, bits,
                                      cap))
    sq = sums[0] if len(sums) == 1 else torch.cat(sums)
    return _norms(sq, cap), codes


def _run_dense(name: str, eager: Callable, target: torch.Tensor, norms: torch.Tensor, codes: torch.Tensor,
               bits: int, bucket_size: int, *extra: torch.dtype) -> None:
    """Run a decode-shaped kernel (``eager``, compiled as ``name`` when large) over whole buckets,
    then eagerly over the short tail."""
    n = codes.numel()
    full = n // bucket_size * bucket_size
    step = norms.to(torch.float32) / ((1 << (bits - 1)) - 1)
    if full:
        nb = full // bucket_size
        kernel(name, full, eager)(target[:full].view(nb, bucket_size), step[:nb], codes[:full].view(nb, bucket_size),
                                  bits, *extra)
    if full < n:
        eager(target[full:].view(1, -1), step[-1:], codes[full:].view(1, -1), bits, *extra)


def qsgd_decode(norms: torch.Tensor, codes: torch.Tensor, bits: int, bucket_size: int,
                dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`qsgd_encode`: a 1-D tensor of ``dtype``."""
    out = torch.empty(codes.numel(), dtype=dtype, device=codes.device)
    _run_dense("qsgd_decode", _qsgd_decode_into, out, norms, codes, bits, bucket_size)
    return out


def qsgd_subtract(acc: torch.Tensor, norms: torch.Tensor, codes: torch.Tensor, bits: int, bucket_size: int,
                  dtype: torch.dtype) -> None:
    """acc -= qsgd_decode(norms, codes, ..., dtype), in place and in one pass (no decoded temporary)."""
    _run_dense("qsgd_subtract", _qsgd_subtract_into, acc, norms, codes, bits, bucket_size, dtype)


class QSGDDecoded(SentCodes):
    """What a QSGD payload carries, built only on demand (error feedback's ``sent``).

    :meth:`subtract_from` updates a residual in one fused pass instead of materialising the
    decoded tensor first.
    """

    def __init__(self, norms: torch.Tensor, codes: torch.Tensor, bits: int, bucket_size: int,
                 dtype: torch.dtype) -> None:
        self.norms, self.codes, self.bits, self.bucket_size, self.dtype = norms, codes, bits, bucket_size, dtype

    def subtract_from(self, acc: torch.Tensor) -> None:
        qsgd_subtract(acc, self.norms, self.codes, self.bits, self.bucket_size, self.dtype)


def num_selected(ratio: float, numel: int) -> int:
    """k = max(1, ceil(ratio * numel)): how many entries TopK keeps.

    The relative slack absorbs float error: 0.07 * 3e9 lands just above 210000000 and a fixed
    1e-9 slack would round it up one too many.
    """
    return max(1, math.ceil(ratio * numel * (1 - 1e-12)))


def topk_indices(flat: torch.Tensor, k: int, marked: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
                 ) -> torch.Tensor:
    """Sorted int64 indices of the k entries of largest magnitude: the exact top-k.

    For large tensors, a threshold taken from a strided sample (:func:`sample_slice`) selects a
    candidate superset with one fused compare; the k-th largest magnitude among the candidates,
    compared against them, keeps the result in index order without a sort. If the sample
    misjudged and fewer than k candidates pass, it falls back to ``torch.topk`` over
    everything, so the result is always exact (ties aside). ``marked``: (threshold, uint8 mask
    of ``|flat| >= threshold``) computed by the pass that built ``flat`` (:func:`hvd_gradcomp.feedback.kernels.add_marked`),
    for a threshold from this tensor's :func:`sample_slice`.
    """
    return topk(flat, k, marked)[0]


def topk(flat: torch.Tensor, k: int, marked: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
         ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(:func:`topk_indices`, ``flat`` at them). The values come from the candidates already
    gathered, not from a second gather of k scattered entries of ``flat`` (a cache miss each).

    >>> topk(torch.tensor([0.5, -3.0, 2.0, 1.0]), 2)
    (tensor([1, 2]), tensor([-3.,  2.]))
    """
    n = flat.numel()
    if k >= n:
        return torch.arange(n, device=flat.device), flat.clone()  # a copy, as flat[idx] was: never an alias of flat
    sl = sample_slice(n, k)
    if sl is None:
        idx = _exact_topk(flat, k)
        return idx, flat.index_select(0, idx)
    if marked is None:
        threshold = sample_threshold(flat[sl], k, n).to(flat.dtype)
        marked = threshold, kernel("abs_at_least", n, abs_at_least)(flat, threshold)
    candidates = _mask_indices(marked[1])
    if candidates.numel() < k:
        idx = _exact_topk(flat, k)
        return idx, flat.index_select(0, idx)
    values = flat.index_select(0, candidates)
    keep = _top_of(values.abs(), k)
    return candidates.index_select(0, keep), values.index_select(0, keep)


def _top_of(mags: torch.Tensor, k: int) -> torch.Tensor:
    """Ascending positions of the k largest of ``mags`` (k <= mags.numel()).

    The k-th largest comes from whichever ``torch.topk`` is shorter (the k largest, or the
    n - k + 1 smallest: 1.5x the cost apart at the usual 2:3); on a tie at it, ``torch.topk``'s
    own choice of k decides, as it always did.
    """
    c = mags.numel()
    if k <= c - k + 1:
        kth = torch.topk(mags, k, sorted=False).values.min()
    else:
        kth = torch.topk(mags, c - k + 1, largest=False, sorted=False).values.max()
    keep = (mags >= kth).nonzero().squeeze(1)
    if keep.numel() != k:
        keep = torch.topk(mags, k, sorted=False).indices.sort().values
    return keep


def _mask_indices(mask: torch.Tensor) -> torch.Tensor:
    """Ascending indices of the non-zero bytes of a uint8 mask.

    ``nonzero`` over a byte mask of 25M entries costs more than the compare; viewing the mask
    as int64 words finds the few words holding a candidate 8x faster, and only their bytes are
    searched again.
    """
    n = mask.numel()
    n8 = n // 8 * 8
    packed = mask[:n8].view(torch.int64)
    words = packed.nonzero().squeeze(1)
    hits = packed.index_select(0, words).view(torch.uint8).nonzero().squeeze(1)
    found = words.index_select(0, hits >> 3) * 8 + (hits & 7)
    if n8 < n:
        found = torch.cat([found, mask[n8:].nonzero().squeeze(1) + n8])
    return found


def _exact_topk(flat: torch.Tensor, k: int) -> torch.Tensor:
    return torch.topk(flat.abs(), k, sorted=False).indices.sort().values


def decode_deltas(widths: torch.Tensor, data: torch.Tensor, k: int) -> torch.Tensor:
    """:func:`hvd_gradcomp.wire.decode_delta_indices` (the same values), its word loop
    (:func:`hvd_gradcomp.wire.unpack_deltas`) compiled for many indices: eager, its ~20 small
    passes cost ~1 ms per 42K indices, paid once per rank's payload. The sparse codecs hand it to
    :func:`hvd_gradcomp.wire.decode_indices`.

    >>> widths, data = indices.delta_index_bytes(torch.tensor([3, 7, 8]))
    >>> decode_deltas(widths, data, 3).tolist()
    [3, 7, 8]
    """
    unpack = kernel("unpack_deltas", k, indices.unpack_deltas)
    return indices.decode_delta_indices(widths, data, k, None if unpack is indices.unpack_deltas else unpack)
