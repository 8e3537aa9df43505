"""Error feedback's arithmetic, and what the codecs' kernels build on: the residual added in the
pass that marks top-k candidates (:func:`add_marked`, momentum correction's :func:`momentum_marked`),
finiteness checks (:func:`all_finite`), the float16 cast's saturating conversion (:func:`to_half_saturated`),
and ``torch.compile`` on demand (:func:`kernel`). Device-agnostic torch code. The codecs' own
kernels (QSGD's rounding, top-k selection) are in :mod:`hvd_gradcomp.codecs.kernels`, one layer up.

Speed notes (measured by ``benchmarks/bench_compressors.py``):

* Large tensors run through ``torch.compile`` (one fused loop on CPU, a Triton kernel on
  CUDA); small ones stay eager, where compiling would cost more than it saves. Set
  ``HVDGC_COMPILE=0`` to never compile, ``=1`` to always. Both paths compute the same values.
  Where "large" starts depends on the kernel (:data:`COMPILE_MIN_NUMEL_OF`): QSGD encoding
  runs ~20 eager ops, so compiling pays from ~8K values (at 42K, the values TopKQSGD keeps of
  a 2048x2048 layer: 0.3 ms instead of 1.2-2 ms); the others pay only from ~128K.
* Top-k selects candidates above a threshold estimated from a strided sample
  (:func:`sample_slice`). Under error feedback the candidate compare runs in the pass that adds
  the residual (:func:`add_marked`; momentum correction's velocity update too,
  :func:`momentum_marked`): each pass over a 4M-value tensor costs ~1-2 ms here, and the
  selection then reads only candidates.
* Finiteness checks (:func:`all_finite`) are one sum, not ``isfinite().all()`` (10x dearer).
* Inductor's CPU code is slow at some conversions (bool masks stored as bytes, uint8 ->
  float32, float selects on compares): the kernels go through float or int16 instead. Kernels
  write into caller buffers so that no result needs a ``cat``.
"""
from __future__ import annotations

import math
import os
import warnings
from typing import Callable, Dict, NamedTuple, Optional, Sequence, Tuple, Union

import torch

COMPILE_MIN_NUMEL = 1 << 20
COMPILE_MIN_NUMEL_OF = {"qsgd_encode": 1 << 15, "unpack_deltas": 1 << 15}
"""Kernels whose compiled form pays from fewer elements than :data:`COMPILE_MIN_NUMEL` (one
process, one thread, ``HVDGC_COMPILE=auto``: eager vs compiled qsgd_encode 1.15 vs 0.27 ms at
32K values, 0.48 vs 0.17 ms at 8K; kept at 32K so that small models and tests compile nothing)."""

_COMPILED: Dict[str, Callable] = {}
_compile_broken = False


def kernel(name: str, numel: int, eager: Callable, fused: Optional[Callable] = None) -> Callable:
    """The kernel to run over ``numel`` values: ``eager`` compiled for large tensors (when allowed
    and working; ``fused``, when given, is what is compiled: the same values written as one loop),
    else ``eager`` itself. ``name`` keys the compiled form and :data:`COMPILE_MIN_NUMEL_OF`.

    >>> kernel("example", 10, torch.add) is torch.add    # small: eager (under HVDGC_COMPILE=auto)
    True
    """
    global _compile_broken
    mode = os.environ.get("HVDGC_COMPILE", "auto")  # documented with every HVDGC_* in hvd_gradcomp.config
    want = mode == "1" or (mode == "auto" and numel >= COMPILE_MIN_NUMEL_OF.get(name, COMPILE_MIN_NUMEL))
    if not want or _compile_broken or not hasattr(torch, "compile"):
        return eager
    if name not in _COMPILED:
        _COMPILED[name] = torch.compile(fused or eager, dynamic=True)
    compiled = _COMPILED[name]

    def run(*args, **kwargs):
        global _compile_broken
        try:
            return compiled(*args, **kwargs)
        except Exception as exc:  # a missing compiler must not stop training: fall back, once, loudly
            _compile_broken = True
            warnings.warn(f"hvd_gradcomp: torch.compile failed ({type(exc).__name__}: {exc}); "
                          "using eager kernels. Set HVDGC_COMPILE=0 to silence this.")
            return eager(*args, **kwargs)
    return run


def abs_at_least(x: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """uint8 mask of |x| >= threshold, through float: inductor stores bool masks ~10x slower."""
    return (x.abs() >= threshold).to(torch.float32).to(torch.uint8)


def _add_marked_eager(flat: torch.Tensor, residual: Optional[torch.Tensor], out: torch.Tensor,
                      threshold: torch.Tensor, total: bool, scale: Optional[torch.Tensor] = None
                      ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """out = flat + residual*scale (or a copy of flat), then the mask of :func:`abs_at_least`:
    two passes (three with a scale); with ``total``, also the float32 sum of ``flat``."""
    _add_into(flat, residual, out, scale)
    return abs_at_least(out, threshold), flat.sum(dtype=torch.float32) if total else None


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
    return abs_at_least(acc, threshold), flat.sum(dtype=torch.float32) if total else None


def _momentum_eager(grad: torch.Tensor, old: Optional[torch.Tensor], residual: Optional[torch.Tensor],
                    u: torch.Tensor, acc: torch.Tensor, m: torch.Tensor, keep: Optional[torch.Tensor],
                    threshold: Optional[torch.Tensor], total: bool, scale: Optional[torch.Tensor] = None
                    ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """u = old*m + grad (``keep``: + grad*keep, dampening's 1-d; ``old`` None: grad), acc = u + residual
    (u when None), then the mask of :func:`abs_at_least` of acc (None without ``threshold``) and, with
    ``total``, grad's float32 sum: three or four passes. Rounded as :func:`_momentum_fused`: the
    product, then the sum (not ``torch.add(alpha=m)``, which fuses them on CPU: the compiled loop
    could not match it)."""
    g = grad.to(u.dtype)
    if old is None:
        u.copy_(g)
    else:
        torch.mul(old, m, out=u).add_(g if keep is None else g * keep)
    _add_into(u, residual, acc, scale)
    mask = None if threshold is None else abs_at_least(acc, threshold)
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
    mask = None if threshold is None else abs_at_least(a, threshold)
    return mask, grad.sum(dtype=torch.float32) if total else None


class SentCodes:
    """A payload's codes that subtract themselves from a residual in one pass, without a decoded
    temporary (:func:`hvd_gradcomp.feedback.residuals.subtract_sent`): QSGD's,
    :class:`hvd_gradcomp.codecs.kernels.QSGDDecoded`. Error feedback knows this much of a codec."""

    def subtract_from(self, acc: torch.Tensor) -> None:
        """acc -= the decoded values, as the receivers see them, in place."""
        raise NotImplementedError

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
    return Marks(threshold, *kernel("add_marked", n, _add_marked_eager, _add_marked_fused)(flat, residual, out,
                                                                                       threshold, total, st))


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
        kernel("momentum_marked", n, _momentum_eager, _momentum_fused)(grad, old, residual, u, acc, m, keep, None,
                                                                        False, st)
        return None
    # The same arithmetic on the sampled positions: the values acc will hold there.
    su, sacc = torch.empty_like(u[sl]), torch.empty_like(acc[sl])
    _momentum_eager(grad[sl], None if old is None else old[sl], None if residual is None else residual[sl],
                    su, sacc, m, keep, None, False, st)
    threshold = sample_threshold(sacc, k, n).to(acc.dtype)
    run = kernel("momentum_marked", n, _momentum_eager, _momentum_fused)
    return Marks(threshold, *run(grad, old, residual, u, acc, m, keep, threshold, total, st))


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

# ---------------------------------------------------------------- the float16 cast
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

