"""Numerical kernels: QSGD quantisation and top-k selection, device-agnostic torch code.

Speed notes (measured by ``benchmarks/bench_compressors.py``):

* Stochastic rounding needs one uniform number per element. ``torch.rand`` alone costs
  about 4x a ``clone()`` on CPU, so the noise is an integer hash of the element index and a
  32-bit seed instead: reproducible from the seed, independent of the device, and fusable.
* Large tensors run through ``torch.compile`` (one fused loop on CPU, a Triton kernel on
  CUDA); small ones stay eager, where compiling would cost more than it saves. Set
  ``HVDGC_COMPILE=0`` to never compile, ``=1`` to always. Both paths compute the same values.
* Top-k uses a threshold estimated from a strided sample to find a small candidate superset,
  then an exact ``torch.topk`` over the candidates: the result is the exact top-k, at a
  fraction of the cost of ``torch.topk`` over the whole tensor.
"""
from __future__ import annotations

import math
import os
import warnings
from typing import Callable, Dict, Tuple

import torch

COMPILE_MIN_NUMEL = 1 << 20
_M32 = 0xFFFFFFFF
_HASH_MUL = 0x045D9F3B


def _uniform_from_hash(start: torch.Tensor, n: int, seed: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """n uniforms in [0, 1) from a 32-bit integer hash of (element index + start) xor seed.

    All products stay below 2**59, so int64 arithmetic never overflows on any backend.
    """
    h = (torch.arange(n, dtype=torch.int64, device=like.device) + start) & _M32
    h = h ^ seed
    h = (((h >> 16) ^ h) * _HASH_MUL) & _M32
    h = (((h >> 16) ^ h) * _HASH_MUL) & _M32
    h = (h >> 16) ^ h
    return (h >> 8).to(torch.float32) * (1.0 / (1 << 24))


def _qsgd_encode(x: torch.Tensor, seed: torch.Tensor, start: torch.Tensor, bits: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """x: (buckets, bucket_size). Returns (float32 norms per bucket, uint8 codes).

    code = sign << (bits-1) | level, level = floor(|x| / norm * s + u), s = 2**(bits-1) - 1,
    u ~ U[0, 1): E[level] = |x| / norm * s, so the decoded value is unbiased.
    """
    s = (1 << (bits - 1)) - 1
    xf = x.to(torch.float32)
    norms = torch.linalg.vector_norm(xf, dim=1)
    safe = torch.where(norms > 0, norms, torch.ones_like(norms))
    u = _uniform_from_hash(start, x.numel(), seed, x).view_as(xf)
    level = torch.floor(xf.abs() * (s / safe).unsqueeze(1) + u).clamp_(max=s)
    code = level.to(torch.uint8) | ((xf < 0).to(torch.uint8) << (bits - 1))
    return norms, code


def _qsgd_decode(norms: torch.Tensor, codes: torch.Tensor, bits: int, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`_qsgd_encode`; codes: (buckets, bucket_size) uint8."""
    s = (1 << (bits - 1)) - 1
    level = (codes & s).to(torch.float32)
    sign = 1.0 - 2.0 * (codes >> (bits - 1)).to(torch.float32)
    return (level * sign * (norms / s).unsqueeze(1)).to(dtype)


def _abs_at_least(x: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    return x.abs() >= threshold


_EAGER: Dict[str, Callable] = {"qsgd_encode": _qsgd_encode, "qsgd_decode": _qsgd_decode,
                               "abs_at_least": _abs_at_least}
_COMPILED: Dict[str, Callable] = {}
_compile_broken = False


def _kernel(name: str, numel: int) -> Callable:
    """The compiled kernel for large tensors (when allowed and working), else the eager one."""
    global _compile_broken
    mode = os.environ.get("HVDGC_COMPILE", "auto")
    want = mode == "1" or (mode == "auto" and numel >= COMPILE_MIN_NUMEL)
    if not want or _compile_broken or not hasattr(torch, "compile"):
        return _EAGER[name]
    if name not in _COMPILED:
        _COMPILED[name] = torch.compile(_EAGER[name], dynamic=True)
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


def qsgd_encode(flat: torch.Tensor, bits: int, bucket_size: int, seed: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantise a 1-D tensor: (float32 norm per bucket, uint8 code per element).

    The last bucket may be shorter than ``bucket_size``.

    >>> norms, codes = qsgd_encode(torch.tensor([3.0, -4.0]), bits=8, bucket_size=2, seed=0)
    >>> norms.tolist(), codes.shape
    ([5.0], torch.Size([2]))
    """
    n = flat.numel()
    full = n // bucket_size * bucket_size
    seed_t = torch.tensor(seed & _M32, dtype=torch.int64, device=flat.device)
    norms, codes = [], []
    if full:
        start = torch.zeros((), dtype=torch.int64, device=flat.device)
        nrm, cd = _kernel("qsgd_encode", full)(flat[:full].view(-1, bucket_size), seed_t, start, bits)
        norms.append(nrm)
        codes.append(cd.view(-1))
    if full < n:
        start = torch.tensor(full, dtype=torch.int64, device=flat.device)
        nrm, cd = _qsgd_encode(flat[full:].view(1, -1), seed_t, start, bits)
        norms.append(nrm)
        codes.append(cd.view(-1))
    if len(norms) == 1:
        return norms[0], codes[0]
    return torch.cat(norms), torch.cat(codes)


def qsgd_decode(norms: torch.Tensor, codes: torch.Tensor, bits: int, bucket_size: int,
                dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`qsgd_encode`: a 1-D tensor of ``dtype``."""
    n = codes.numel()
    full = n // bucket_size * bucket_size
    parts = []
    if full:
        nb = full // bucket_size
        parts.append(_kernel("qsgd_decode", full)(norms[:nb], codes[:full].view(nb, bucket_size), bits, dtype).view(-1))
    if full < n:
        parts.append(_qsgd_decode(norms[-1:], codes[full:].view(1, -1), bits, dtype).view(-1))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def num_selected(ratio: float, numel: int) -> int:
    """k = max(1, ceil(ratio * numel)): how many entries TopK keeps."""
    return max(1, math.ceil(ratio * numel - 1e-9))


def topk_indices(flat: torch.Tensor, k: int, sample_target: int = 1 << 16) -> torch.Tensor:
    """Sorted int64 indices of the k entries of largest magnitude: the exact top-k.

    For large tensors, a threshold taken from a strided sample (aimed at ~1.5k entries)
    selects a candidate superset with one fused compare; ``torch.topk`` then runs over the
    candidates only. If the sample misjudged and fewer than k candidates pass, it falls
    back to ``torch.topk`` over everything, so the result is always exact (ties aside).
    """
    n = flat.numel()
    if k >= n:
        return torch.arange(n, device=flat.device)
    if n < 4 * sample_target or k * 8 > n:
        return _exact_topk(flat, k)
    stride = n // sample_target
    sample = flat[stride // 2::stride].abs().float()
    want = min(sample.numel(), int(1.5 * k * sample.numel() / n) + 8)
    threshold = torch.topk(sample, want, sorted=False).values.min()
    candidates = _kernel("abs_at_least", n)(flat, threshold.to(flat.dtype)).nonzero().squeeze(1)
    if candidates.numel() < k:
        return _exact_topk(flat, k)
    keep = torch.topk(flat[candidates].abs(), k, sorted=False).indices
    return candidates[keep].sort().values


def _exact_topk(flat: torch.Tensor, k: int) -> torch.Tensor:
    return torch.topk(flat.abs(), k, sorted=False).indices.sort().values
