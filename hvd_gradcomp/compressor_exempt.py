"""Which tensors a compressor compresses, and how the exempt ones travel: the float16 road
(a mixin of :class:`~hvd_gradcomp.compressors.GradientCompressor`, :class:`ExemptRoad`).

Small tensors (biases, norms) and those ``exclude=`` matches go uncompressed; under ``exempt="fp16"``
a float32 one travels as float16 with error feedback of the cast
(:class:`~hvd_gradcomp.feedback.HalfPrecision`, the compressor's ``_half``).
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from . import feedback as fb

DEFAULT_MIN_COMPRESS_NUMEL = 1024
"""Tensors with fewer elements (biases, norms) go uncompressed on both DistributedOptimizers:
a 1% top-k of a 16-element bias sends one value. Not compressed is not free: the study's
transformer's 3,584 such float32 values are two thirds of its bytes under TopKQSGD(1%, 8)
(``benchmarks/bench_exempt_bytes.py``), hence ``exempt="fp16"``."""
EXEMPT_MODES = ("fp16", "fp32")
"""``exempt=``: how tensors exempt from compression travel (see :class:`GradientCompressor`)."""


class ExemptRoad:
    """Which tensors are compressed (:meth:`compresses`) and the float16 road of the float32 ones
    exempt by design (:meth:`sends_half`, :meth:`encode_half`). Mixed into
    :class:`~hvd_gradcomp.compressors.GradientCompressor`, which owns ``exclude``, ``feedback`` and
    ``_half``."""

    @property
    def exempt(self) -> str:
        """How float32 tensors exempt from compression travel: ``"fp16"`` or ``"fp32"`` (see the class)."""
        return self._exempt

    @exempt.setter
    def exempt(self, value: str) -> None:
        if value not in EXEMPT_MODES:
            raise ValueError(f"exempt must be one of {EXEMPT_MODES} (how tensors left uncompressed by size or "
                             f"exclude= travel: float16 with error feedback, or as they are), got {value!r}")
        self._exempt = value

    def compresses(self, name: str, numel: Optional[int] = None) -> bool:
        """Whether tensor ``name`` (of ``numel`` elements) is compressed; False: ``exclude``
        matches its name, or it has fewer than :data:`DEFAULT_MIN_COMPRESS_NUMEL` elements
        (``hvd_gradcomp.DistributedOptimizer`` takes its ``min_compress_numel`` instead), and it
        goes uncompressed in the dense allreduce; or its feedback policy asks for a dense step
        (:meth:`hvd_gradcomp.feedback.Feedback.dense`).

        >>> from hvd_gradcomp.topk import TopK
        >>> c = TopK(exclude=r"embed|norm")
        >>> c.compresses("tok_embed.weight"), c.compresses("fc.bias", 64), c.compresses("fc.weight", 4096)
        (False, False, True)
        """
        if numel is not None and numel < DEFAULT_MIN_COMPRESS_NUMEL:
            return False
        self._follow_groups()
        if self.feedback.dense(name):  # e.g. feedback="frozen": Adam's dense warm-up
            return False
        return not self._excluded(name)

    def compressible(self, shape: Tuple[int, ...]) -> bool:
        """Whether this codec compresses a tensor of ``shape`` at all (PowerSGD: matrices only); the
        roads send the others uncompressed. True here."""
        return True

    def _excluded(self, name: str) -> bool:
        return self.exclude is not None and self.exclude.search(name) is not None

    def sends_half(self, name: str, dtype: torch.dtype, small: bool) -> bool:
        """Whether tensor ``name``, not compressed, travels as float16 (``exempt="fp16"``): a float32
        gradient exempt by design, ``small`` (under the caller's ``min_compress_numel``) or matched
        by ``exclude``.

        Not the dense steps a feedback policy asks for: ``feedback="frozen"``'s warm-up is there
        for fidelity (exact Adam, whose second moment is then frozen for the rest of the run), so
        it stays float32; it ends after ``warmup`` steps, so it cannot be what the bytes come to.

        >>> from hvd_gradcomp.topk import TopK
        >>> c = TopK(exclude=r"norm")
        >>> c.sends_half("fc.bias", torch.float32, small=True), c.sends_half("norm.weight", torch.float32, False)
        (True, True)
        >>> c.sends_half("fc.weight", torch.float32, False), c.sends_half("fc.bias", torch.bfloat16, True)
        (False, False)
        """
        return self.exempt == "fp16" and dtype == torch.float32 and (small or self._excluded(name))

    def encode_half(self, named: List[Tuple[str, torch.Tensor]], world: int) -> Tuple[torch.Tensor, bool]:
        """The float16 send of tensors :meth:`sends_half` picked, fused: ``(flat float16 tensor,
        finite)`` for a float16 sum over ``world`` ranks, whose result is their average; error
        feedback of the cast per name (:class:`~hvd_gradcomp.feedback.HalfPrecision`)."""
        return self._half.encode(named, world)

    @property
    def half_residuals(self) -> fb.ResidualStore:
        """Residuals of the float16 road (see :meth:`sends_half`), per tensor name."""
        return self._half.residuals
