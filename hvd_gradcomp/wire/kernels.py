"""Numerical kernels: QSGD quantisation and top-k selection, device-agnostic torch code.

Speed notes (measured by ``benchmarks/bench_compressors.py``):

* Stochastic rounding needs one uniform number per element. ``torch.rand`` alone costs
  about 4x a ``clone()`` on CPU, so the noise is an integer hash of the element index and a
  32-bit seed instead: reproducible from the seed, independent of the device, and fusable.
* Large tensors run through ``torch.compile`` (one fused loop on CPU, a Triton kernel on
  CUDA); small ones stay eager, where compiling would cost more than it saves. Set
  ``HVDGC_COMPILE=0`` to never compile, ``=1`` to always. Both paths compute the same values.
  Where "large" starts depends on the kernel (:data:`COMPILE_MIN_NUMEL_OF`): QSGD encoding
  runs ~20 eager ops, so compiling pays from ~8K values (at 42K, the values TopKQSGD keeps of
  a 2048x2048 layer: 0.3 ms instead of 1.2-2 ms); the others pay only from ~128K.
* Top-k uses a threshold estimated from a strided sample to find a small candidate superset,
  then an exact ``torch.topk`` over the candidates: the result is the exact top-k, at a
  fraction of the cost of ``torch.topk`` over the whole tensor. Under error feedback the
  candidate compare runs in the pass that adds the residual (:func:`add_marked`; momentum
  correction's velocity update too, :func:`momentum_marked`): each pass over a 4M-value tensor
  costs ~1-2 ms here, and the selection then reads only candidates.
* Per-payload work on ~42K values (a 1% top-k of a 2048x2048 layer) is dominated by the
  count of eager ops, not by the values: the delta-index decoder is one compiled loop there.
* Finiteness checks (:func:`all_finite`) are one sum, not ``isfinite().all()`` (10x dearer).
* Inductor's CPU code is slow at some conversions (bool masks stored as bytes, uint8 ->
  float32, float selects on compares): the kernels go through float or int16 instead. The
  hash runs in int32 (AVX2 has no 64-bit multiply). Kernels write into caller buffers so the
  short last bucket needs no ``cat``.
"""
from __future__ import annotations

import math
import os
import sys
import warnings
from typing import Callable, Dict, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from .format import INDEX_BLOCK
from . import indices

COMPILE_MIN_NUMEL = 1 << 20
COMPILE_MIN_NUMEL_OF = {"qsgd_encode": 1 << 15, "unpack_deltas": 1 << 15}
"""Kernels whose compiled form pays from fewer elements than :data:`COMPILE_MIN_NUMEL` (one
process, one thread, ``HVDGC_COMPILE=auto``: eager vs compiled qsgd_encode 1.15 vs 0.27 ms at
32K values, 0.48 vs 0.17 ms at 8K; kept at 32K so that small models and tests compile nothing)."""
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


def _abs_at_least(x: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """uint8 mask of |x| >= threshold, through float: inductor stores bool masks ~10x slower."""
    return (x.abs() >= threshold).to(torch.float32).to(torch.uint8)


def _add_marked_eager(flat: torch.Tensor, residual: Optional[torch.Tensor], out: torch.Tensor,
                      threshold: torch.Tensor, total: bool, scale: Optional[torch.Tensor] = None
                      ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """out = flat + residual*scale (or a copy of flat), then the mask of :func:`_abs_at_least`:
    two passes (three with a scale); with ``total``, also the float32 sum of ``flat``."""
    _add_into(flat, residual, out, scale)
    return _abs_at_least(out, threshold), flat.sum(dtype=torch.float32) if total else None


def _add_into(flat: torch.Tensor, residual: Optional[torch.Tensor], out: torch.Tensor,
              scale: Optional[torch.Tensor] = None) -> None:
    """out = flat + residual (``scale``: + residual*scale, the product rounded first, as compiled)."""
    if residual is None:
        out.copy_(flat)
    elif scale is None:
        torch.add(flat, residual, out=out)  # computed in out's dtype: flat is widened first
    else:
        torch.mul(residual, scale, out=out).add_(flat)


def _scaled(residual: torch.Tensor, scale: Optional[torch.Tensor]) -> torch.Tensor:
    return residual if scale is None else residual * scale


def _add_marked_fused(flat: torch.Tensor, residual: Optional[torch.Tensor], out: torch.Tensor,
                      threshold: torch.Tensor, total: bool, scale: Optional[torch.Tensor] = None
                      ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """:func:`_add_marked_eager` as one loop when compiled: the sum is compared while in registers,
    not read back from memory, and ``flat``'s total is summed as it streams by."""
    acc = flat.to(out.dtype) if residual is None else flat.to(out.dtype) + _scaled(residual, scale)
    out.copy_(acc)
    return _abs_at_least(acc, threshold), flat.sum(dtype=torch.float32) if total else None


def _momentum_eager(grad: torch.Tensor, old: Optional[torch.Tensor], residual: Optional[torch.Tensor],
                    u: torch.Tensor, acc: torch.Tensor, m: torch.Tensor, keep: Optional[torch.Tensor],
                    threshold: Optional[torch.Tensor], total: bool, scale: Optional[torch.Tensor] = None
                    ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """u = old*m + grad (``keep``: + grad*keep, dampening's 1-d; ``old`` None: grad), acc = u + residual
    (u when None), then the mask of :func:`_abs_at_least` of acc (None without ``threshold``) and, with
    ``total``, grad's float32 sum: three or four passes. Rounded as :func:`_momentum_fused`: the
    product, then the sum (not ``torch.add(alpha=m)``, which fuses them on CPU: the compiled loop
    could not match it)."""
    g = grad.to(u.dtype)
    if old is None:
        u.copy_(g)
    else:
        torch.mul(old, m, out=u).add_(g if keep is None else g * keep)
    _add_into(u, residual, acc, scale)
    mask = None if threshold is None else _abs_at_least(acc, threshold)
    return mask, grad.sum(dtype=torch.float32) if total else None


def _momentum_fused(grad: torch.Tensor, old: Optional[torch.Tensor], residual: Optional[torch.Tensor],
                    u: torch.Tensor, acc: torch.Tensor, m: torch.Tensor, keep: Optional[torch.Tensor],
                    threshold: Optional[torch.Tensor], total: bool, scale: Optional[torch.Tensor] = None
                    ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """:func:`_momentum_eager` as one loop when compiled: grad, the old velocity and the residual are
    read once; the velocity, the sum and the mask are written in the same pass."""
    g = grad.to(u.dtype)
    v = g if old is None else old * m + (g if keep is None else g * keep)
    a = v if residual is None else v + _scaled(residual, scale)
    u.copy_(v)
    acc.copy_(a)
    mask = None if threshold is None else _abs_at_least(a, threshold)
    return mask, grad.sum(dtype=torch.float32) if total else None


def _unpack_deltas(widths: torch.Tensor, starts: torch.Tensor, words: torch.Tensor, out: torch.Tensor) -> None:
    """The deltas of :func:`hvd_gradcomp.wire.decode_delta_indices`, in one loop over them.

    A block of ``wire.INDEX_BLOCK`` (64) values of ``w`` bits is exactly ``w`` little-endian int64
    words, so each value lies in at most two words of its block: two gathers per value, where
    gathering the bytes it touches took up to six (4x slower for 42K indices on CPU).
    ``widths``/``starts``: per block, its bit width and first word (int64); ``words``: the
    section as int64 words. ``>>`` on int64 copies the sign bit down: masked off below.
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


def decode_delta_indices(widths: torch.Tensor, data: torch.Tensor, k: int) -> torch.Tensor:
    """:func:`hvd_gradcomp.wire.decode_delta_indices` (same values), compiled for many indices:
    eager, its ~20 small passes cost ~1 ms per 42K indices, paid once per rank's payload."""
    kernel = _kernel("unpack_deltas", k)
    if kernel is _EAGER["unpack_deltas"] or not k or not data.numel() or sys.byteorder != "little":
        return indices.decode_delta_indices(widths, data, k)
    w = widths.to(torch.int64)
    starts = torch.cumsum(w, 0) - w    # in words: block b is 8 * w[b] bytes
    # int64 words need an 8-byte-aligned start (a payload slice may not have one: then a copy)
    words = (data if data.storage_offset() % 8 == 0 else data.clone()).view(torch.int64)
    deltas = torch.empty(k, dtype=torch.int64, device=data.device)
    kernel(w, starts, words, deltas)
    return torch.cumsum(deltas + 1, 0) - 1


_EAGER: Dict[str, Callable] = {"unpack_deltas": _unpack_deltas, "qsgd_encode": _qsgd_encode_into, "qsgd_decode": _qsgd_decode_into,
                               "qsgd_subtract": _qsgd_subtract_into, "abs_at_least": _abs_at_least,
                               "add_marked": _add_marked_eager, "momentum_marked": _momentum_eager}
_TO_COMPILE: Dict[str, Callable] = {"add_marked": _add_marked_fused, "momentum_marked": _momentum_fused}
"""Kernels whose compiled form is written differently (fused) from their eager form; same values."""
_COMPILED: Dict[str, Callable] = {}
_compile_broken = False


def _kernel(name: str, numel: int) -> Callable:
    """The compiled kernel for large tensors (when allowed and working), else the eager one."""
    global _compile_broken
    mode = os.environ.get("HVDGC_COMPILE", "auto")  # documented with every HVDGC_* in hvd_gradcomp.config
    want = mode == "1" or (mode == "auto" and numel >= COMPILE_MIN_NUMEL_OF.get(name, COMPILE_MIN_NUMEL))
    if not want or _compile_broken or not hasattr(torch, "compile"):
        return _EAGER[name]
    if name not in _COMPILED:
        _COMPILED[name] = torch.compile(_TO_COMPILE.get(name, _EAGER[name]), dynamic=True)
    compiled = _COMPILED[name]

    def run(*args, **kwargs):
        global _compile_broken
        try:
            return compiled(*args, **kwargs)
        except Exception as exc:  # a missing compiler must not stop training: fall back, once, loudly
            _compile_broken = True
            warnings.warn(f"hvd_gradcomp: torch.compile failed ({type(exc).__name__}: {exc}); "
                          "using eager kernels. Set HVDGC_COMPILE=0 to silence this.")
            return _EAGER[name](*args, **kwargs)
    return run


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
        sums.append(_kernel("qsgd_encode", full)(flat[:full].view(-1, bucket_size),
                                                 codes[:full].view(-1, bucket_size), seed_t, start, bits, cap))
    if full < n:
        seed_t, start = _seed_tensors(seed, full, flat.device)
        sums.append(_qsgd_encode_into(flat[full:].view(1, -1), codes[full:].view(1, -1), seed_t, start, bits,
                                      cap))
    sq = sums[0] if len(sums) == 1 else torch.cat(sums)
    return _norms(sq, cap), codes


def _run_dense(name: str, target: torch.Tensor, norms: torch.Tensor, codes: torch.Tensor, bits: int,
               bucket_size: int, *extra: torch.dtype) -> None:
    """Run a decode-shaped kernel over whole buckets (compiled when large) and the short tail."""
    n = codes.numel()
    full = n // bucket_size * bucket_size
    step = norms.to(torch.float32) / ((1 << (bits - 1)) - 1)
    if full:
        nb = full // bucket_size
        _kernel(name, full)(target[:full].view(nb, bucket_size), step[:nb], codes[:full].view(nb, bucket_size), bits,
                              *extra)
    if full < n:
        _EAGER[name](target[full:].view(1, -1), step[-1:], codes[full:].view(1, -1), bits, *extra)


def qsgd_decode(norms: torch.Tensor, codes: torch.Tensor, bits: int, bucket_size: int,
                dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`qsgd_encode`: a 1-D tensor of ``dtype``."""
    out = torch.empty(codes.numel(), dtype=dtype, device=codes.device)
    _run_dense("qsgd_decode", out, norms, codes, bits, bucket_size)
    return out


def qsgd_subtract(acc: torch.Tensor, norms: torch.Tensor, codes: torch.Tensor, bits: int, bucket_size: int,
                  dtype: torch.dtype) -> None:
    """acc -= qsgd_decode(norms, codes, ..., dtype), in place and in one pass (no decoded temporary)."""
    _run_dense("qsgd_subtract", acc, norms, codes, bits, bucket_size, dtype)


class QSGDDecoded:
    """What a QSGD payload carries, built only on demand (error feedback's ``sent``).

    :meth:`subtract_from` updates a residual in one fused pass instead of materialising the
    decoded tensor first.
    """

    def __init__(self, norms: torch.Tensor, codes: torch.Tensor, bits: int, bucket_size: int,
                 dtype: torch.dtype) -> None:
        self.norms, self.codes, self.bits, self.bucket_size, self.dtype = norms, codes, bits, bucket_size, dtype

    def subtract_from(self, acc: torch.Tensor) -> None:
        qsgd_subtract(acc, self.norms, self.codes, self.bits, self.bucket_size, self.dtype)


def all_finite(tensors: Union[torch.Tensor, Sequence[torch.Tensor]]) -> bool:
    """Whether a tensor (or every tensor of a sequence) holds no NaN and no +-Inf, in one
    reduction per tensor and one host sync in all (the answer decides what is sent or kept).

    ``torch.isfinite(t).all()`` makes four passes and a bool temporary, ~10x a ``clone()`` on
    CPU; one sum costs half a clone (:func:`sums_finite`). A non-finite sum is checked again
    exactly (a second sync, on that rare path only): finite values whose sum overflowed are
    finite.

    >>> all_finite(torch.tensor([1.0, 2.0])), all_finite([torch.ones(2), torch.tensor([float("nan")])])
    (True, False)
    >>> all_finite(torch.tensor([3e38, 3e38]))          # the sum overflows, the values do not
    True
    """
    ts = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    return bool(sums_finite(ts)) or bool(torch.stack([torch.isfinite(t).all() for t in ts]).all())


def sums_finite(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """0-dim bool tensor, no host sync: whether every tensor's sum is finite. NaN and +-Inf make
    a sum non-finite, so True proves every value finite; False may also mean that a sum of
    finite values overflowed (:func:`all_finite` then checks exactly)."""
    sums = [t.sum(dtype=torch.float64 if t.dtype == torch.float64 else torch.float32).double()
            for t in tensors if t.numel()]
    sums = [s.to(sums[0].device) for s in sums]  # no-ops unless the tensors sit on several devices
    if not sums:
        return torch.tensor(True)
    return torch.isfinite(sums[0] if len(sums) == 1 else torch.stack(sums)).all()


def num_selected(ratio: float, numel: int) -> int:
    """k = max(1, ceil(ratio * numel)): how many entries TopK keeps.

    The relative slack absorbs float error: 0.07 * 3e9 lands just above 210000000 and a fixed
    1e-9 slack would round it up one too many.
    """
    return max(1, math.ceil(ratio * numel * (1 - 1e-12)))


class Marks(NamedTuple):
    """What :func:`add_marked` found: the sampled threshold, the uint8 mask of the values that
    reach it, and (when asked) the float32 sum of the input, whose finiteness proves the input
    finite (see :func:`sums_finite`)."""

    threshold: torch.Tensor
    mask: torch.Tensor
    total: Optional[torch.Tensor] = None


def add_marked(flat: torch.Tensor, residual: Optional[torch.Tensor], out: torch.Tensor,
               k: int, total: bool = False, scale: Optional[float] = None) -> Optional[Marks]:
    """Writes ``out = flat + residual`` (``residual`` None: ``flat`` in ``out``'s dtype; ``scale``:
    ``flat + residual * scale``, in the same pass: a residual at another learning rate) and returns
    what :func:`topk_indices` of ``out`` would compute first, (threshold, mask), or None where it
    would not sample (then only the sum is written). ``total``: also sum ``flat`` in the same
    pass (the finiteness check of :func:`all_finite`, without a pass of its own).

    Why: error feedback's sum and top-k's candidate compare each read the whole tensor; here
    the threshold is estimated first from the *inputs* at the sampled positions (the same
    float32 sums ``out`` will hold there) and one compiled loop writes the sum and the mask.

    >>> out = torch.empty(3)
    >>> add_marked(torch.tensor([1.0, -4.0, 2.0]), torch.tensor([0.5, 0.5, 0.5]), out, k=1) is None
    True
    >>> out.tolist()
    [1.5, -3.5, 2.5]
    """
    n = flat.numel()
    sl = sample_slice(n, k)
    st = _scale_tensor(scale, residual, out)
    if sl is None:
        _add_into(flat, residual, out, st)
        return None
    sample = flat[sl].to(out.dtype) if residual is None else flat[sl].to(out.dtype) + _scaled(residual[sl], st)
    threshold = sample_threshold(sample, k, n).to(out.dtype)
    return Marks(threshold, *_kernel("add_marked", n)(flat, residual, out, threshold, total, st))


def _scale_tensor(scale: Optional[float], residual: Optional[torch.Tensor], like: torch.Tensor
                  ) -> Optional[torch.Tensor]:
    """The residual's scale as a 0-dim tensor (a Python float would recompile the compiled loop
    for every new value), or None where there is nothing to scale."""
    if scale is None or residual is None or scale == 1.0:
        return None
    return torch.tensor(scale, dtype=like.dtype, device=like.device)


def momentum_marked(grad: torch.Tensor, old: Optional[torch.Tensor], residual: Optional[torch.Tensor],
                    u: torch.Tensor, acc: torch.Tensor, momentum: float, dampening: float = 0.0,
                    k: Optional[int] = None, total: bool = False, scale: Optional[float] = None
                    ) -> Optional[Marks]:
    """Momentum correction's input in one pass (:class:`hvd_gradcomp.feedback.momentum.MomentumCorrection`):
    writes the new velocity ``u = momentum*old + (1-dampening)*grad`` (``grad`` when ``old`` is
    None) and ``acc = u + residual`` (``u`` when None; ``scale``: ``u + residual * scale``), both flat,
    in the caller's buffers; returns,
    as :func:`add_marked` does, the candidates of a top-k of ``k`` entries of ``acc`` (None where
    :func:`topk_indices` would not sample, or ``k`` is None) with, when ``total``, ``grad``'s sum.

    Each product is rounded before it is added (eager and compiled alike; a GPU compiler may fuse
    a multiply-add, one rounding fewer: the velocities then differ by at most an ulp, never
    between ranks' payloads, which every rank decodes from the same bytes).

    >>> u, acc = torch.empty(3), torch.empty(3)
    >>> momentum_marked(torch.ones(3), torch.tensor([2.0, 0.0, -2.0]), torch.full((3,), 0.5), u, acc, 0.5) is None
    True
    >>> u.tolist(), acc.tolist()
    ([2.0, 1.0, 0.0], [2.5, 1.5, 0.5])
    """
    n = grad.numel()
    m = torch.tensor(momentum, dtype=u.dtype, device=u.device)
    keep = None if not dampening else torch.tensor(1.0 - dampening, dtype=u.dtype, device=u.device)
    sl = None if k is None else sample_slice(n, k)
    st = _scale_tensor(scale, residual, acc)
    if sl is None:
        _kernel("momentum_marked", n)(grad, old, residual, u, acc, m, keep, None, False, st)
        return None
    # The same arithmetic on the sampled positions: the values acc will hold there.
    su, sacc = torch.empty_like(u[sl]), torch.empty_like(acc[sl])
    _momentum_eager(grad[sl], None if old is None else old[sl], None if residual is None else residual[sl],
                    su, sacc, m, keep, None, False, st)
    threshold = sample_threshold(sacc, k, n).to(acc.dtype)
    return Marks(threshold, *_kernel("momentum_marked", n)(grad, old, residual, u, acc, m, keep, threshold, total,
                                                            st))


SAMPLE_TARGET = 1 << 13
"""Values sampled to estimate a top-k threshold. The sample only decides how many candidates
the exact selection looks at, never which entries it keeps: 8K samples aim at ~130 values
above the threshold, whose count varies by ~9%, well inside the 1.5x margin (a sample costs a
cache miss per value: 16K of them cost ~0.5 ms more per 4M-value tensor)."""


def sample_slice(n: int, k: int, sample_target: int = SAMPLE_TARGET) -> Optional[slice]:
    """The positions :func:`topk_indices` samples its threshold from, or None where it runs an
    exact ``torch.topk`` instead (small tensors, k > n/8, k >= n).

    The stride is odd: an even one (e.g. 256 on a 2048-wide matrix) samples the same few
    columns of every row, and a Linear layer's gradient (an outer product) differs far more
    between columns than a sample of 8 of them shows.
    """
    if k >= n or n < 4 * sample_target or k * 8 > n:
        return None
    stride = n // sample_target | 1
    return slice(stride // 2, None, stride)


def sample_threshold(sample: torch.Tensor, k: int, n: int) -> torch.Tensor:
    """A magnitude that ~1.5k of the n values reach, from values at :func:`sample_slice` (0-dim,
    float32; no host sync)."""
    mags = sample.abs().float()
    want = min(mags.numel(), int(1.5 * k * mags.numel() / n) + 8)
    return torch.topk(mags, want, sorted=False).values.min()


def topk_indices(flat: torch.Tensor, k: int, marked: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
                 ) -> torch.Tensor:
    """Sorted int64 indices of the k entries of largest magnitude: the exact top-k.

    For large tensors, a threshold taken from a strided sample (:func:`sample_slice`) selects a
    candidate superset with one fused compare; the k-th largest magnitude among the candidates,
    compared against them, keeps the result in index order without a sort. If the sample
    misjudged and fewer than k candidates pass, it falls back to ``torch.topk`` over
    everything, so the result is always exact (ties aside). ``marked``: (threshold, uint8 mask
    of ``|flat| >= threshold``) computed by the pass that built ``flat`` (:func:`add_marked`),
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
        marked = threshold, _kernel("abs_at_least", n)(flat, threshold)
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


# ---------------------------------------------------------------- the float16 road
HALF_MAX = 65504.0
"""float16's largest finite value."""
_HALF_UNIT = 2.0 ** -11   # float16's unit roundoff: one rounding moves a value by at most this share


def half_bound(world: int) -> float:
    """The largest magnitude each of ``world`` ranks may put into a float16 sum (an allreduce of
    float16 values) so that the sum stays finite, whatever the order of its additions.

    A float16 allreduce rounds each value once (the cast) and each of the ``world - 1``
    additions once, each by at most 2**-11 of its value: ``world`` values of at most ``b`` sum
    to at most ``world * b * (1 + 2**-11) ** world <= world * b * exp(world * 2**-11)``, which
    this bound keeps at 65504.

    >>> round(half_bound(1), 1), round(half_bound(2), 1), round(half_bound(64) * 64, 1)
    (65472.0, 32720.0, 63488.7)
    """
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be an int >= 1 (the ranks that sum the values), got {world!r}")
    return HALF_MAX / (world * math.exp(world * _HALF_UNIT))


def to_half_saturated(x: torch.Tensor, world: int) -> Tuple[torch.Tensor, bool]:
    """``(x / world as float16, whether x is all finite)``, finite values saturated at
    ``+-half_bound(world)``: the float16 sum of ``world`` such tensors (an allreduce) is finite
    and stands for the average of the ``x``. What saturation and rounding take away is the
    caller's to keep (error feedback: :class:`hvd_gradcomp.feedback.HalfPrecision`).

    NaN/Inf values are not saturated: they stay non-finite in the sum on every rank, as in an
    uncompressed allreduce (a loss scaler then skips the step everywhere).

    >>> half, finite = to_half_saturated(torch.tensor([1.0, 1e6, -1e6]), world=2)
    >>> half.dtype, half.tolist(), finite
    (torch.float16, [0.5, 32720.0, -32720.0], True)
    >>> to_half_saturated(torch.tensor([1.0, float("inf")]), world=2)[0].tolist()
    [0.5, inf]
    """
    finite = all_finite(x)
    y = x.to(torch.float32) / world   # a new tensor: x is left as it was
    bound = half_bound(world)
    if finite:
        y.clamp_(-bound, bound)
    else:   # the rare path: clamp would turn +-inf into +-bound
        y = torch.where(torch.isfinite(y), y.clamp(-bound, bound), y)
    return y.to(torch.float16), finite
