"""Which tensors a compressor compresses, and how the exempt ones travel: the float16 cast
(:class:`Exemption`, a part of :class:`~hvd_gradcomp.codecs.compressor.GradientCompressor`).

Small tensors (biases, norms) and those ``exclude=`` matches go uncompressed; under ``exempt="fp16"``
a float32 one travels as float16 with error feedback of the cast
(:class:`~hvd_gradcomp.feedback.HalfPrecision`, the part's ``half``).
"""
from __future__ import annotations

import re
from typing import Any, List, Optional, Tuple

import torch

from .. import feedback as fb

DEFAULT_MIN_COMPRESS_NUMEL = 1024
"""Tensors with fewer elements (biases, norms) go uncompressed on both DistributedOptimizers:
a 1% top-k of a 16-element bias sends one value. Not compressed is not free: the study's
transformer's 3,584 such float32 values are two thirds of its bytes under TopKQSGD(1%, 8)
(``benchmarks/bench_exempt_bytes.py``), hence ``exempt="fp16"``."""
EXEMPT_MODES = ("fp16", "fp32")
"""``exempt=``: how tensors exempt from compression travel (see :class:`GradientCompressor`)."""


class Exemption:
    """Which tensors a compressor leaves uncompressed by design, and how they travel: ``exclude`` (a
    regular expression of parameter names) and ``mode`` (``exempt=``: ``"fp16"`` or ``"fp32"``), with the
    float16 cast's own residuals (``half``, :class:`~hvd_gradcomp.feedback.HalfPrecision`: what the cast
    takes away, sent later).

    Exempt by design: float32 tensors with fewer elements than ``min_compress_numel`` (biases, norms)
    or matched by ``exclude``. ``"fp16"`` sends them as float16, half the bytes, divided by the number
    of ranks before the cast so that the sum cannot overflow, saturated at float16's range, and what
    the cast takes away kept and sent later by error feedback; ``"fp32"`` as they are. float16,
    bfloat16 and float64 gradients always travel as they are, and so do the tensors a feedback policy
    sends dense for a while (``feedback="frozen"``'s warm-up).

    >>> e = Exemption(exclude=r"norm")
    >>> e.excluded("norm.weight"), e.excluded("fc.bias")
    (True, False)
    >>> _ = e.encode([("w", torch.tensor([1.0, 1e-9]))], world=1)   # 1e-9: below float16
    >>> f"{e.owed('w', torch.zeros(2))[1].item():.3g}", "w" in e.residuals    # owed once, then gone
    ('1e-09', False)
    """

    def __init__(self, exclude: Optional[str] = None, mode: str = "fp16") -> None:
        self.mode = mode
        try:
            self.exclude = re.compile(exclude) if exclude is not None else None
        except (re.error, TypeError) as exc:
            raise ValueError(f"exclude must be a regular expression matched against parameter names "
                             f"(e.g. r'embed|norm'), got {exclude!r}: {exc}") from None
        self.half = fb.HalfPrecision()

    @property
    def mode(self) -> str:
        return self._mode

    @mode.setter
    def mode(self, value: str) -> None:
        if value not in EXEMPT_MODES:
            raise ValueError(f"exempt must be one of {EXEMPT_MODES} (how tensors left uncompressed by size or "
                             f"exclude= travel: float16 with error feedback, or as they are), got {value!r}")
        self._mode = value

    def excluded(self, name: str) -> bool:
        return self.exclude is not None and self.exclude.search(name) is not None

    def compresses(self, codec: Any, name: str, numel: Optional[int] = None) -> bool:
        """Whether ``codec`` compresses tensor ``name`` (of ``numel`` elements); False: ``exclude``
        matches its name, or it has fewer than :data:`DEFAULT_MIN_COMPRESS_NUMEL` elements
        (``hvd_gradcomp.DistributedOptimizer`` takes its ``min_compress_numel`` instead), and it
        goes uncompressed in the dense allreduce; or its feedback policy asks for a dense step
        (:meth:`hvd_gradcomp.feedback.Feedback.dense`). Binds the policy to param groups added since
        (``codec._follow_groups()``): every driver asks this before it compresses a tensor.

        >>> from hvd_gradcomp.codecs.topk import TopK
        >>> c = TopK(exclude=r"embed|norm")
        >>> c.compresses("tok_embed.weight"), c.compresses("fc.bias", 64), c.compresses("fc.weight", 4096)
        (False, False, True)
        """
        if numel is not None and numel < DEFAULT_MIN_COMPRESS_NUMEL:
            return False
        codec._follow_groups()
        if codec.feedback.dense(name):  # e.g. feedback="frozen": Adam's dense warm-up
            return False
        return not self.excluded(name)

    def sends_half(self, codec: Any, name: str, dtype: torch.dtype, small: bool, dense_steps: bool = True) -> bool:
        """Whether tensor ``name``, not compressed this step, travels as float16 (``exempt="fp16"``,
        with error feedback of the cast): every float32 gradient that goes uncompressed, whether
        exempt by design (``small``: under the caller's ``min_compress_numel``; matched by
        ``exclude``) or for a while (a feedback policy's dense steps: ``feedback="frozen"``'s
        warm-up), the latter only where the wrapper sums the float16 values (``dense_steps``: stock
        Horovod's ``Average`` divides the float16 sum by the ranks once more, a rounding no residual
        keeps, and Adam, which scales every coordinate to the same step, made the small gradients'
        losses count: nanoGPT's recipe ended at 2.79 against 2.02 in float32).

        (``fc.weight`` below: no dense step of its policy, so not float16; a tensor sent dense because
        the policy cannot compress it, outside the optimizer ``"frozen"`` is bound to, goes exactly.)

        Why the warm-up too: it is most of what a run sends (100 dense steps against 56-155x after
        them: a 400-step AdamW run saved 3.9x over the whole run), and Adam's moments of an average
        whose cast error is carried to the next step differ from float32's by float16 rounding
        (benchmarks/results/RECIPES.md: whole-run bytes and held-out loss). What the cast still owes when a tensor
        starts compressing joins its first compressed gradient (:meth:`owed`).

        >>> from hvd_gradcomp.codecs.topk import TopK
        >>> c = TopK(exclude=r"norm")
        >>> c.sends_half("fc.bias", torch.float32, small=True), c.sends_half("norm.weight", torch.float32, False)
        (True, True)
        >>> c.sends_half("fc.weight", torch.float32, False), c.sends_half("fc.bias", torch.bfloat16, True)
        (False, False)
        >>> TopK(exempt="fp32").sends_half("fc.weight", torch.float32, False)
        False
        """
        if self.mode != "fp16" or dtype != torch.float32:
            return False
        # not a tensor sent dense for another reason (outside the optimizer "frozen" is bound to: exact)
        return small or self.excluded(name) or (dense_steps and codec.feedback.dense(name))

    def owed(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        """``grad`` plus what the float16 cast still owes ``name``, which then leaves the cast's residuals."""
        if name not in self.half.residuals:
            return grad
        owed = self.half.residuals.pop(name)
        return grad + owed.view(grad.shape).to(grad.dtype)

    def encode(self, named: List[Tuple[str, torch.Tensor]], world: int) -> Tuple[torch.Tensor, bool]:
        return self.half.encode(named, world)

    @property
    def residuals(self) -> fb.ResidualStore:
        return self.half.residuals

    def track_rounds(self, on: bool) -> None:
        self.half.track_rounds(on)

    def end_round(self, ok: bool) -> None:
        self.half.end_round(ok)
