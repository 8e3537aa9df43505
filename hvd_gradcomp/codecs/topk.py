"""TopK sparsification, and TopKQSGD (the kept values QSGD-quantised)."""
from __future__ import annotations

import math
import re
from typing import Callable, Dict, List, Mapping, Optional, Tuple, Union

import torch

from .. import codecs, wire
from . import kernels
from .. import feedback as fb
from .compressor import (DEFAULT_BUCKET, WARMUP_PACE_RATIO, Encoded, GradientCompressor, NamedParameters,
                         PartAttribute, Ratio, SparsityWarmup, sparsity_warmup_steps)
from .interface import _head_bytes
from ..feedback import Feedback
from ..feedback.frozen import WHILE_DENSE, FrozenVariance
from . import qsgd
from .qsgd import Quantiser, _shrunk
from ..settings import MIN_SELECTED, Checked, check_min_k, check_min_ratio, check_ratio


LOW_RATIO_FROZEN = {"sparsity_warmup": 100, "momentum": WHILE_DENSE}
"""``feedback="auto"``'s ``FrozenVariance`` settings below :data:`WARMUP_PACE_RATIO` (see :meth:`TopK._auto_policy`)."""

# A delta-coded sparse payload may stand for this many elements per payload byte, whatever
# the decoder's ratio (ratios down to ~5e-6 stay below it); beyond, only as many as the
# decoder's own ratio explains. A forged ``numel`` cannot make decode() allocate more.
MAX_EXPANSION = 1 << 16
# The smallest top-k ratio that matched uncompressed held-out loss on every task of the study
# (benchmarks/results/STUDY.md); a smaller one is cautioned about at start-up (TopK._caution).
MEASURED_RATIO = 0.01


class TopK(GradientCompressor):
    r"""TopK sparsification: send the k = max(min_k, ceil(ratio * n)) entries of largest magnitude
    (all n when n <= min_k; ``min_k`` defaults to :data:`~hvd_gradcomp.settings.MIN_SELECTED`, 32:
    fewer values than that save almost no bytes, since each payload carries its header, 56 bytes
    for a matrix, and starve the tensor).

    ``min_ratio``: ``{regular expression: share}``; a tensor whose name matches sends at least
    that share (the largest of the matching ones), e.g. an output layer that trains worse than
    the rest at a small ratio. The rest follow ``ratio`` (and its warm-up or schedule). Names are
    those of ``model.named_parameters()`` (under DDP, of the module it wraps), as for ``exclude``.

    Selection is exact (see :func:`hvd_gradcomp.codecs.kernels.topk_indices`). Values travel in the
    gradient's dtype; indices are delta coded with per-block bit widths, or as a bitmap when
    that is smaller (ratios above ~1/10). Under error feedback a float16/bfloat16 gradient's
    residual is float32 and can exceed the dtype's range: such values are sent clamped to the
    largest finite value and the rest stays in the residual, so nothing decodes to inf.

    >>> TopK(ratio=0.01)
    TopK(ratio=0.01, error_feedback=True)
    >>> TopK(ratio=0.001).selected(4096), TopK(ratio=0.001).selected(1_000_000), TopK(0.001, min_k=1).selected(4096)
    (32, 1000, 5)
    >>> c = TopK(ratio=0.001, min_ratio={r"^out\.": 0.01})
    >>> c.share("out.weight"), c.share("fc1.weight")
    (0.01, 0.001)
    """

    kind = wire.KIND_TOPK
    codec_name = "topk"
    collective = codecs.ALLGATHER
    ratio = Checked(check_ratio, "The share of entries sent, in (0, 1] (the target, with a schedule).")
    min_k = Checked(check_min_k, "The fewest values sent of a compressed tensor (all of them when it has fewer).")

    def __init__(self, ratio: Ratio = 0.01, error_feedback: bool = True, seed: Optional[int] = None,
                 feedback: Union[str, Feedback] = "auto", clip: Optional[float] = None,
                 exclude: Optional[str] = None, checksum: Optional[bool] = None, exempt: str = "fp16",
                 min_k: int = MIN_SELECTED, min_ratio: Optional[Mapping[str, float]] = None,
                 named_parameters: Optional[NamedParameters] = None, exchange: str = "allgather") -> None:
        super().__init__(error_feedback, seed, feedback, clip, exclude, checksum, exempt, named_parameters)
        self.exchange = exchange
        self.schedule: Optional[Callable[[int], float]] = None
        if callable(ratio):
            self.schedule = ratio
            ratio = getattr(ratio, "ratio", None) or ratio(0)
        self.ratio = ratio
        self.min_k = min_k
        self.min_ratio = min_ratio

    @property
    def exchange(self) -> str:
        """How the payloads travel: ``"allgather"`` (default: every rank's selection to every rank, bytes
        per rank growing with the ranks) or ``"allreduce"`` (:data:`~hvd_gradcomp.codecs.SPARSE_ALLREDUCE`,
        Ok-Topk's sparse allreduce: bytes per rank that stay O(k) as ranks are added).

        >>> TopK(ratio=0.01, exchange="allreduce").collective
        'sparse_allreduce'
        """
        return "allreduce" if self.collective == codecs.SPARSE_ALLREDUCE else "allgather"

    @exchange.setter
    def exchange(self, value: str) -> None:
        if value not in ("allgather", "allreduce"):
            raise ValueError(f"exchange must be 'allgather' or 'allreduce' (the sparse allreduce, whose bytes per "
                             f"rank do not grow with the ranks), got {value!r}")
        self.collective = codecs.SPARSE_ALLREDUCE if value == "allreduce" else codecs.ALLGATHER

    @property
    def min_ratio(self) -> Dict[str, float]:
        """Per-name floors of the share sent, ``{regular expression: share}`` (checked on assignment)."""
        return dict(self._min_ratio)

    @min_ratio.setter
    def min_ratio(self, value: Optional[Mapping[str, float]]) -> None:
        self._min_ratio = check_min_ratio(value)

    @property
    def carries_held_back(self) -> bool:
        """True under ``classic`` error feedback and ``momentum`` correction (what they hand the
        optimizer is each sent coordinate's held-back sum); ``frozen`` and ``update`` move the
        parameters themselves.

        >>> TopK().carries_held_back, TopK().set_feedback("frozen").carries_held_back
        (True, False)
        """
        return self.feedback.key in ("classic", "momentum")

    def selected(self, numel: int, ratio: Optional[float] = None) -> int:
        """How many of a ``numel``-element tensor's entries are sent at ``ratio`` (default: the target
        ratio): ``max(min_k, ceil(ratio * numel))``, at most ``numel``."""
        share = self.ratio if ratio is None else ratio
        return min(numel, max(self.min_k, kernels.num_selected(share, numel)))

    def __repr__(self) -> str:
        return f"TopK(ratio={self._ratio_repr()}, error_feedback={self.error_feedback}{self._extra_repr()})"

    def payload_size(self, shape: Tuple[int, ...], dtype: torch.dtype = torch.float32,
                     index_bytes: Optional[int] = None) -> int:
        """Header + ``index_bytes`` (the index coding's size, which depends on the indices) + the values."""
        if index_bytes is None:
            raise ValueError("sparse payload sizes depend on the index coding: pass index_bytes")
        return _head_bytes(shape) + index_bytes + self._values_bytes(self.selected(math.prod(shape)), dtype)

    def _values_bytes(self, k: int, dtype: torch.dtype) -> int:
        return wire.padded(k * dtype.itemsize)

    def _extra_repr(self) -> str:
        extra = f", min_k={self.min_k}" if self.min_k != MIN_SELECTED else ""
        if self._min_ratio:
            extra += f", min_ratio={self._min_ratio!r}"
        if self.exchange != "allgather":
            extra += f", exchange={self.exchange!r}"
        return super()._extra_repr() + extra

    def _auto_policy(self, key: str) -> Feedback:
        """``feedback="auto"``'s policy; with Adam (``"frozen"``) below ratio 1% and without a ratio
        schedule of the user's: :data:`LOW_RATIO_FROZEN`'s sparsity warm-up after the freeze, sending
        Adam's momentum while it is dense.

        Why below 1% only: at 0.1% each coordinate is sent at most about once in the study's runs
        (benchmarks/results/STUDY_RUN_LENGTH.md), and starting from 25% after the freeze sends most of them early
        (benchmarks/results/STUDY.md: TopKQSGD(0.1%, 8) against its *no sparsity warm-up after the freeze* rows);
        with each rank's gradient sent at that share the freeze check's model jumped, hence the
        momentum while the share is above 1 - b1 (see
        :func:`hvd_gradcomp.feedback.frozen_momentum.dense_share`, benchmarks/results/FREEZE_CHECK_01.md). At 1%
        the default without a warm-up meets every target.

        >>> low = TopK(ratio=0.001)._auto_policy("frozen")
        >>> low.sparsity_warmup, low.momentum
        (100, 'while dense')
        >>> TopK(ratio=0.01)._auto_policy("frozen").sparsity_warmup
        0
        """
        if key != "frozen" or self.schedule is not None or self.ratio >= WARMUP_PACE_RATIO:
            return fb.make(key)
        return FrozenVariance(**LOW_RATIO_FROZEN)

    def _caution(self) -> str:
        if self.ratio >= MEASURED_RATIO:
            return ""
        # at 0.1% one of the study's tasks ends more than 2% above uncompressed at its length,
        # some in 3x longer runs; say it once rather than let a user find out at the end of a run
        return (f" Note: ratio {self.ratio:g} is below {MEASURED_RATIO:g}, the ratio hvd-gradcomp's study measures every task "
                "at (benchmarks/results/STUDY.md); below it the held-out loss ended more than 2% above "
                "uncompressed training on some tasks, at the study's length or in 3x longer runs (benchmarks/results/STUDY.md, "
                "benchmarks/results/STUDY_RUN_LENGTH.md)." + self._warmup_note() + ("" if self._min_ratio else
                " A layer that trains worse than the rest, often the output layer, can keep a larger share: "
                "min_ratio={name pattern: share}."))

    def _policy_warmup_steps(self) -> int:
        """The feedback policy's sparsity warm-up at this ratio: longer below 1% (its ``warmup_pace``)."""
        return sparsity_warmup_steps(self.feedback.sparsity_warmup, self.ratio, self.feedback.warmup_pace)

    def _warmup_note(self) -> str:
        """How long the policy's sparsity warm-up lasts at this ratio (below 1% it is longer than the
        ``sparsity_warmup`` the start-up message names; a short run may end inside it)."""
        warm = self._policy_warmup_steps()
        if self.schedule is not None or warm == 0:
            return ""
        return (f" At this ratio the sparsity warm-up lasts {warm} compressed steps per tensor (the share sent "
                f"falls from {SparsityWarmup.start:.0%} to {self.ratio:g}).")

    def _ratio_repr(self) -> str:
        return repr(self.schedule) if self.schedule is not None else repr(self.ratio)

    def ratio_at(self, step: int) -> float:
        """The share sent at exchange ``step`` (0-based, counted per tensor): ``ratio``, or the schedule's value.

        >>> TopK(ratio=SparsityWarmup(0.01, steps=4)).ratio_at(2)
        0.05

        Without a schedule, the feedback policy's ``sparsity_warmup`` applies (``"momentum"``: the
        share falls from 25% to the ratio over 100 steps; ``"frozen"``: none unless asked for, then
        after Adam's dense warm-up; at ratios below 1% over more: :func:`sparsity_warmup_steps`):

        >>> from hvd_gradcomp import FrozenVariance
        >>> c = TopK(ratio=0.01, feedback=FrozenVariance(sparsity_warmup=4))
        >>> [round(c.ratio_at(s), 4) for s in (0, 2, 4)]
        [0.25, 0.05, 0.01]
        >>> c = TopK(ratio=0.001, feedback=FrozenVariance(sparsity_warmup=4))
        >>> [round(c.ratio_at(s), 4) for s in (0, 4, 7)]     # over 7 steps, near 1% after 4 as above
        [0.25, 0.0107, 0.001]
        """
        if self.schedule is not None:
            return check_ratio(self.schedule(step))
        warm = self._policy_warmup_steps()   # the policy's own (e.g. "frozen", after its dense warm-up)
        if step < warm:
            return SparsityWarmup(self.ratio, warm, start=max(self.ratio, SparsityWarmup.start))(step)
        return self.ratio

    def share(self, name: str, step: Optional[int] = None) -> float:
        """The share of tensor ``name`` sent at its exchange ``step`` (default: its next one):
        :meth:`ratio_at`, raised to the largest ``min_ratio`` whose pattern matches ``name``."""
        share = self.ratio_at(self._steps.get(name, 0) if step is None else step)
        for pattern, floor in self._min_ratio.items():
            if floor > share and re.search(pattern, name):
                share = floor
        return share

    def _selects(self, name: str, numel: int) -> Optional[int]:
        return self.selected(numel, self.share(name))

    def _select(self, flat: torch.Tensor, marked: fb.Marked = None
                ) -> Tuple[torch.Tensor, torch.Tensor, int, List[torch.Tensor]]:
        """(indices, flat at them, index mode, index sections) of the top-k."""
        idx, vals = kernels.topk(flat, self.selected(flat.numel(), self.share(self._name_now, self._step_now)), marked)
        mode, sections = wire.encode_indices(idx, flat.numel())
        return idx, vals, mode, sections

    def pack(self, flat: torch.Tensor, dtype: torch.dtype, seed: int, contract: bool = False,
                marked: fb.Marked = None) -> Encoded:
        idx, vals, mode, sections = self._select(flat, marked)
        vals = _in_range(vals, dtype)
        return Encoded(idx.numel(), 0, mode, 0, sections + [wire.as_bytes(vals)], (idx, vals))

    def unpack(self, h: wire.Header, reader: wire.SectionReader) -> torch.Tensor:
        if h.index_mode == wire.INDEX_DELTA:
            self._check_expansion(h)
        return _scatter(*self.unpack_sparse(h, reader), h.numel)

    def _check_expansion(self, h: wire.Header) -> None:
        """Refuse a payload whose dense output is out of proportion to it (see MAX_EXPANSION)."""
        limit = max(MAX_EXPANSION * h.total_bytes, math.ceil(4 * h.k / self.ratio))
        if h.numel > limit:
            raise wire.WireFormatError(f"corrupt payload: {h.k} values of a {h.numel}-element tensor in "
                                       f"{h.total_bytes} bytes, far sparser than ratio={self.ratio}")

    def unpack_sparse(self, h: wire.Header, reader: wire.SectionReader) -> Tuple[torch.Tensor, torch.Tensor]:
        idx = wire.decode_indices(reader, h.index_mode, h.k, h.numel, kernels.decode_deltas)
        vals = wire.from_bytes(reader.take(h.k * h.dtype.itemsize), h.dtype)
        if not bool(torch.isfinite(vals).all()):  # encoders never send them (inputs are checked)
            raise wire.WireFormatError("corrupt payload: non-finite values")
        return idx, vals


class TopKQSGD(TopK):
    """TopK, then QSGD on the kept values: the headline setting is ratio 0.01 with 8 bits.

    >>> TopKQSGD()
    TopKQSGD(ratio=0.01, bits=8, bucket_size=512, error_feedback=True)
    """

    kind = wire.KIND_TOPKQSGD
    codec_name = "topk-qsgd"
    bits = PartAttribute("_quant", "bits", Quantiser.bits.__doc__)
    bucket_size = PartAttribute("_quant", "bucket_size", Quantiser.bucket_size.__doc__)

    def __init__(self, ratio: Ratio = 0.01, bits: int = 8, bucket_size: int = DEFAULT_BUCKET,
                 error_feedback: bool = True, seed: Optional[int] = None, feedback: Union[str, Feedback] = "auto",
                 clip: Optional[float] = None, exclude: Optional[str] = None,
                 checksum: Optional[bool] = None, exempt: str = "fp16", min_k: int = MIN_SELECTED,
                 min_ratio: Optional[Mapping[str, float]] = None,
                 named_parameters: Optional[NamedParameters] = None, exchange: str = "allgather") -> None:
        super().__init__(ratio, error_feedback, seed, feedback, clip, exclude, checksum, exempt, min_k, min_ratio,
                         named_parameters, exchange)
        self._quant = Quantiser(bits, bucket_size)

    @property
    def ef_scale(self) -> float:
        return self._quant.ef_scale(self.feedback.contract)

    @property
    def _contracting(self) -> bool:
        return self._quant.contracting

    def __repr__(self) -> str:
        return (f"TopKQSGD(ratio={self._ratio_repr()}, bits={self.bits}, bucket_size={self.bucket_size}, "
                f"error_feedback={self.error_feedback}{self._extra_repr()})")

    def _values_bytes(self, k: int, dtype: torch.dtype) -> int:
        nb = (k + self.bucket_size - 1) // self.bucket_size
        return wire.padded(4 * nb) + wire.padded((k * self.bits + 7) // 8)

    def pack(self, flat: torch.Tensor, dtype: torch.dtype, seed: int, contract: bool = False,
                marked: fb.Marked = None) -> Encoded:
        idx, vals, mode, sections = self._select(flat, marked)
        norms, codes = kernels.qsgd_encode(vals, self.bits, self.bucket_size, seed, dtype=dtype)
        norms = _shrunk(norms, contract, self.bits, min(vals.numel(), self.bucket_size))
        sent_vals = kernels.qsgd_decode(norms, codes, self.bits, self.bucket_size, dtype)
        sections += [wire.as_bytes(norms), wire.pack_bits(codes, self.bits)]
        return Encoded(idx.numel(), self.bits, mode, self.bucket_size, sections, (idx, sent_vals))

    def unpack_sparse(self, h: wire.Header, reader: wire.SectionReader) -> Tuple[torch.Tensor, torch.Tensor]:
        idx = wire.decode_indices(reader, h.index_mode, h.k, h.numel, kernels.decode_deltas)
        return idx, qsgd._read_qsgd(reader, h.k, h.bits, h.bucket_size, h.dtype)


def _in_range(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """values as ``dtype``, clamped to its finite range when they come from a wider dtype."""
    if values.dtype != dtype:
        top = torch.finfo(dtype).max
        values = values.clamp(-top, top)
    return values.to(dtype)


def _scatter(idx: torch.Tensor, vals: torch.Tensor, numel: int) -> torch.Tensor:
    out = torch.zeros(numel, dtype=vals.dtype, device=vals.device)
    out[idx] = vals
    return out
