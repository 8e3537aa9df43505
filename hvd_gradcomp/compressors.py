"""QSGD, TopK and TopK+QSGD: codecs with error feedback and a compact wire format.

Two layers, from low to high (nothing here knows Horovod):

* ``encode(tensor) -> payload`` / ``decode(payload) -> tensor``: the exact bytes that travel
  (see :mod:`hvd_gradcomp.wire`), no state but the random stream.
* ``compress_named(name, grad) -> payload``: error feedback around ``encode``: the residual
  kept for ``name`` is added first, and what the payload does not carry becomes the new one.

Horovod's compressor protocol (``compress``/``decompress``) is added on top by
:mod:`hvd_gradcomp.horovod`, whose classes are the ones ``hvd_gradcomp`` exports.

Example::

    >>> c = TopKQSGD(ratio=0.01, bits=8)
    >>> g = torch.randn(1_000_000)
    >>> payload = c.compress_named("fc.weight", g)     # 10,000 values, 8 bits each, + indices
    >>> payload.numel() < g.numel() * 4 / 150
    True
    >>> c.decode(payload).shape
    torch.Size([1000000])
"""
from __future__ import annotations

import math
import os
import zlib
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

from . import kernels, wire
from .feedback import ResidualStore
from .stats import ByteStats
from .settings import check_bits, check_bucket_size, check_ratio

Sent = Union[kernels.QSGDDecoded, Tuple[torch.Tensor, torch.Tensor]]
DEFAULT_BUCKET = 512
# A delta-coded sparse payload may stand for this many elements per payload byte, whatever
# the decoder's ratio (ratios down to ~5e-6 stay below it); beyond, only as many as the
# decoder's own ratio explains. A forged ``numel`` cannot make decode() allocate more.
MAX_EXPANSION = 1 << 16


@dataclass
class _Encoded:
    """What a compressor's ``_encode`` produced: header fields, sections and what was sent.

    ``sent`` is either (indices, values) of a sparse payload or the QSGD codes, subtracted
    from the residual in one pass only when error feedback needs it.
    """

    k: int
    bits: int
    index_mode: int
    bucket_size: int
    sections: List[torch.Tensor]
    sent: Sent


class GradientCompressor:
    """Base class of the codecs: error feedback, random stream and byte statistics.

    Subclasses implement ``_encode(flat, seed) -> _Encoded`` and
    ``_decode(header, reader) -> flat tensor``.

    ``checksum``: put a CRC32 of each payload in its header and refuse payloads whose bytes
    changed (True), or not (False). None (default): on for the sparse compressors, where it
    costs under 0.1% of encode time, off for QSGD, whose payloads are a quarter of the
    gradient and where it costs 10-19% (``benchmarks/bench_checksum.py``). A compressor
    that writes checksums also refuses payloads without one: set it alike on every rank.
    Hyperparameters are validated on assignment too (``c.ratio = 0.05`` works, ``c.ratio = 0``
    raises ``ValueError``).
    """

    kind: int = 0

    def __init__(self, error_feedback: bool = True, seed: Optional[int] = None,
                 checksum: Optional[bool] = None) -> None:
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"seed must be an int or None, got {seed!r}")
        self.error_feedback = error_feedback
        self.checksum = checksum
        self.seed = seed if seed is not None else int.from_bytes(os.urandom(4), "little")
        self.stream = 0  # set to the rank by hvd_gradcomp.horovod on every road: ranks draw independent noise
        self.residuals = ResidualStore()
        self.stats = ByteStats()
        self._steps: Dict[str, int] = {}

    @property
    def error_feedback(self) -> bool:
        """Keep what a step did not send and add it to the next gradient of the same name."""
        return self._error_feedback

    @error_feedback.setter
    def error_feedback(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise ValueError(f"error_feedback must be True or False, got {value!r}")
        self._error_feedback = value

    @property
    def checksum(self) -> Optional[bool]:
        """CRC32 in every payload: True, False, or None for this kind's default (see the class)."""
        return self._checksum

    @checksum.setter
    def checksum(self, value: Optional[bool]) -> None:
        if value is not None and not isinstance(value, bool):
            raise ValueError(f"checksum must be True, False or None (default per kind), got {value!r}")
        self._checksum = value

    @property
    def _checksummed(self) -> bool:
        return self.kind != wire.KIND_QSGD if self._checksum is None else self._checksum

    # ------------------------------------------------------------ wire level
    def encode(self, tensor: torch.Tensor, name: str = "") -> torch.Tensor:
        """The payload for ``tensor`` (no error feedback): one 1-D ``torch.uint8`` tensor.

        Each call advances the random stream of ``name``, so repeated calls draw fresh noise.
        """
        _check_input(tensor, name)
        _check_finite(tensor, name)
        return self._encode_flat(tensor.reshape(-1), tensor.dtype, tuple(tensor.shape), name)[0]

    def decode(self, payload: torch.Tensor) -> torch.Tensor:
        """The tensor a payload stands for, in its original shape and dtype.

        Any malformed payload (truncated, corrupted, forged) raises ``WireFormatError``.
        """
        h = self._own_header(payload)
        return self._decode(h, wire.SectionReader(payload, h)).view(h.shape)

    def _own_header(self, payload: torch.Tensor, header: Optional[wire.Header] = None) -> wire.Header:
        h = wire.read_header(payload) if header is None else header
        if h.kind != self.kind:
            raise wire.WireFormatError(f"{type(self).__name__} cannot decode a payload of kind {h.kind}")
        if self._checksummed and not h.checksum:
            raise wire.WireFormatError(f"payload has no CRC32 but this {type(self).__name__} expects one: "
                                       "give every rank the same checksum= setting")
        wire.verify_checksum(payload, h)
        return h

    def decode_parts(self, payload: torch.Tensor, header: Optional[wire.Header] = None
                     ) -> Tuple[Optional[torch.Tensor], torch.Tensor]:
        """(indices, values) of a sparse payload, or (None, flat dense values) of a dense one.

        Summing payloads from many ranks then costs one pass over the output (index_add)
        instead of one dense decode per rank. ``header``: the payload's header when the caller
        already parsed it (each read is a device-to-host copy on GPU).
        """
        sparse = getattr(self, "_decode_sparse", None)
        h = self._own_header(payload, header)
        if sparse is None:
            return None, self._decode(h, wire.SectionReader(payload, h)).reshape(-1)
        return sparse(h, wire.SectionReader(payload, h))

    # ------------------------------------------------------------ error feedback
    def compress_named(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        """Payload for the gradient of tensor ``name``, with error feedback when enabled.

        Raises ``FloatingPointError`` (residual untouched) when ``grad`` holds NaN or Inf.
        """
        _check_input(grad, name)
        if not name:
            raise ValueError("compress_named needs a non-empty tensor name")
        _check_finite(grad, name)
        if not self.error_feedback:
            self.residuals.check_shape(name, grad)
            return self._encode_flat(grad.reshape(-1), grad.dtype, tuple(grad.shape), name)[0]
        acc = self.residuals.compensate(name, grad)
        payload, sent = self._encode_flat(acc, grad.dtype, tuple(grad.shape), name, contract=True)
        _subtract_sent(acc, sent)
        self.residuals.commit(name, acc)
        return payload

    def compress_chunks(self, name: str, grad: torch.Tensor, bounds: List[int]) -> List[torch.Tensor]:
        """One payload per chunk ``grad[bounds[i]:bounds[i+1]]`` (flattened), with error feedback
        on the whole tensor: the chunks of QSGD's compressed allreduce.

        ``bounds`` must cover the tensor and every chunk must be non-empty.
        """
        _check_input(grad, name)
        _check_finite(grad, name)
        if bounds[0] != 0 or bounds[-1] != grad.numel() or any(b >= e for b, e in zip(bounds, bounds[1:])):
            raise ValueError(f"chunk bounds {bounds} do not split {grad.numel()} elements into non-empty chunks")
        if self.error_feedback:
            acc = self.residuals.compensate(name, grad)
        else:
            self.residuals.check_shape(name, grad)
            acc = grad.reshape(-1)
        payloads = []
        for i, (b, e) in enumerate(zip(bounds, bounds[1:])):
            part = acc[b:e]
            payload, sent = self._encode_flat(part, grad.dtype, (e - b,), f"{name}#{i}",
                                              contract=self.error_feedback)
            if self.error_feedback:
                _subtract_sent(part, sent)
            payloads.append(payload)
        if self.error_feedback:
            self.residuals.commit(name, acc)
        return payloads

    def _encode_flat(self, flat: torch.Tensor, dtype: torch.dtype, shape: Tuple[int, ...],
                     name: str, contract: bool = False) -> Tuple[torch.Tensor, Sent]:
        enc = self._encode(flat, dtype, self._next_seed(name), contract)
        header = wire.Header(self.kind, dtype, enc.bits, enc.index_mode, shape, flat.numel(), enc.k, 0,
                             enc.bucket_size, self._checksummed)
        payload = wire.assemble(header, enc.sections, flat.device)
        self.stats.record(name, flat.numel() * dtype.itemsize, payload.numel())
        return payload, enc.sent

    def _next_seed(self, name: str) -> int:
        """A 32-bit seed from (seed, stream, name, step): reproducible, distinct per call."""
        step = self._steps.get(name, 0)
        self._steps[name] = step + 1
        return zlib.crc32(f"{self.seed}/{self.stream}/{name}/{step}".encode())

    @property
    def ef_scale(self) -> float:
        """Factor applied to what is sent under error feedback (1.0: none), for full buckets;
        buckets of fewer values get the (larger) factor of their size. See :func:`qsgd_ef_scale`."""
        return 1.0

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> Dict[str, Any]:
        """Residuals and random state: restoring it continues the exact same sequence."""
        res = self.residuals.state_dict()
        return {"seed": self.seed, "stream": self.stream, "steps": dict(self._steps),
                "residuals": res["residuals"], "shapes": res["shapes"]}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.seed = int(state["seed"])
        self.stream = int(state["stream"])
        self._steps = dict(state["steps"])
        self.residuals.load_state_dict({"residuals": state["residuals"], "shapes": state.get("shapes", {})})

    # ------------------------------------------------------------ to implement
    def _encode(self, flat: torch.Tensor, dtype: torch.dtype, seed: int, contract: bool = False) -> _Encoded:
        raise NotImplementedError

    def _decode(self, h: wire.Header, reader: wire.SectionReader) -> torch.Tensor:
        raise NotImplementedError


class _Quantiser:
    """What QSGD and TopKQSGD share: bits, bucket size and the error-feedback scale."""

    bits: int
    bucket_size: int
    error_feedback: bool

    def _init_quantiser(self, bits: int, bucket_size: int) -> None:
        self.bits = bits
        self.bucket_size = bucket_size

    @property
    def bits(self) -> int:
        """Bits per value: 1 sign bit + level bits, 2 to 8."""
        return self._bits

    @bits.setter
    def bits(self, value: int) -> None:
        self._bits = check_bits(value)

    @property
    def bucket_size(self) -> int:
        """Values sharing one norm, 1 to 2**32 - 1."""
        return self._bucket_size

    @bucket_size.setter
    def bucket_size(self, value: int) -> None:
        self._bucket_size = check_bucket_size(value)

    @property
    def ef_scale(self) -> float:
        return qsgd_ef_scale(self.bits, self.bucket_size) if self.error_feedback else 1.0


class QSGD(_Quantiser, GradientCompressor):
    """QSGD (Alistarh et al., 2017): norm-scaled stochastic quantisation, unbiased.

    Per bucket of ``bucket_size`` values, each value is sent as a sign and a level in
    0..s (s = 2**(bits-1) - 1) of ``|x| / ||bucket||_2``, rounded up or down at random so
    that E[decode(encode(x))] = x. Levels are bit-packed (8 bits: 1 per byte, 4 bits: 2 per
    byte, 2 bits: 4 per byte) with one float32 norm per bucket.

    Payload bytes: 40 + 8*ndim + pad8(4 * ceil(n / bucket_size)) + pad8(ceil(n * bits / 8)).

    >>> QSGD(bits=4)
    QSGD(bits=4, bucket_size=512, error_feedback=True)
    """

    kind = wire.KIND_QSGD

    def __init__(self, bits: int = 8, bucket_size: int = DEFAULT_BUCKET, error_feedback: bool = True,
                 seed: Optional[int] = None, checksum: Optional[bool] = None) -> None:
        super().__init__(error_feedback, seed, checksum)
        self._init_quantiser(bits, bucket_size)

    def __repr__(self) -> str:
        return f"QSGD(bits={self.bits}, bucket_size={self.bucket_size}, error_feedback={self.error_feedback})"

    def _encode(self, flat: torch.Tensor, dtype: torch.dtype, seed: int, contract: bool = False) -> _Encoded:
        n = flat.numel()
        if self.bits == 8 and n >= kernels.COMPILE_MIN_NUMEL:
            # Codes are the payload bytes: write them in place, sparing assemble a copy.
            nb = (n + self.bucket_size - 1) // self.bucket_size
            norm_bytes, code_bytes = wire.reserve([4 * nb, n], flat.device)
            norms, codes = kernels.qsgd_encode(flat, 8, self.bucket_size, seed, codes=code_bytes, dtype=dtype)
            norms = _shrunk(norms, contract, self.bits, min(n, self.bucket_size))
            norm_bytes.view(torch.float32).copy_(norms)
            sections = [norm_bytes, code_bytes]
        else:
            norms, codes = kernels.qsgd_encode(flat, self.bits, self.bucket_size, seed, dtype=dtype)
            norms = _shrunk(norms, contract, self.bits, min(n, self.bucket_size))
            sections = [wire.as_bytes(norms), wire.pack_bits(codes, self.bits)]
        sent = kernels.QSGDDecoded(norms, codes, self.bits, self.bucket_size, dtype)
        return _Encoded(n, self.bits, wire.INDEX_NONE, self.bucket_size, sections, sent)

    def _decode(self, h: wire.Header, reader: wire.SectionReader) -> torch.Tensor:
        return _read_qsgd(reader, h.k, h.bits, h.bucket_size, h.dtype)


class TopK(GradientCompressor):
    """TopK sparsification: send the k = max(1, ceil(ratio * n)) entries of largest magnitude.

    Selection is exact (see :func:`hvd_gradcomp.kernels.topk_indices`). Values travel in the
    gradient's dtype; indices are delta coded with per-block bit widths, or as a bitmap when
    that is smaller (ratios above ~1/10). Under error feedback a float16/bfloat16 gradient's
    residual is float32 and can exceed the dtype's range: such values are sent clamped to the
    largest finite value and the rest stays in the residual, so nothing decodes to inf.

    >>> TopK(ratio=0.01)
    TopK(ratio=0.01, error_feedback=True)
    """

    kind = wire.KIND_TOPK

    def __init__(self, ratio: float = 0.01, error_feedback: bool = True, seed: Optional[int] = None,
                 checksum: Optional[bool] = None) -> None:
        super().__init__(error_feedback, seed, checksum)
        self.ratio = ratio

    @property
    def ratio(self) -> float:
        """The share of entries sent, in (0, 1]."""
        return self._ratio

    @ratio.setter
    def ratio(self, value: float) -> None:
        self._ratio = check_ratio(value)

    def __repr__(self) -> str:
        return f"TopK(ratio={self.ratio}, error_feedback={self.error_feedback})"

    def _select(self, flat: torch.Tensor) -> Tuple[torch.Tensor, int, List[torch.Tensor]]:
        idx = kernels.topk_indices(flat, kernels.num_selected(self.ratio, flat.numel()))
        mode, sections = wire.encode_indices(idx, flat.numel())
        return idx, mode, sections

    def _encode(self, flat: torch.Tensor, dtype: torch.dtype, seed: int, contract: bool = False) -> _Encoded:
        idx, mode, sections = self._select(flat)
        vals = _in_range(flat[idx], dtype)
        return _Encoded(idx.numel(), 0, mode, 0, sections + [wire.as_bytes(vals)], (idx, vals))

    def _decode(self, h: wire.Header, reader: wire.SectionReader) -> torch.Tensor:
        if h.index_mode == wire.INDEX_DELTA:
            self._check_expansion(h)
        return _scatter(*self._decode_sparse(h, reader), h.numel)

    def _check_expansion(self, h: wire.Header) -> None:
        """Refuse a payload whose dense output is out of proportion to it (see MAX_EXPANSION)."""
        limit = max(MAX_EXPANSION * h.total_bytes, math.ceil(4 * h.k / self.ratio))
        if h.numel > limit:
            raise wire.WireFormatError(f"corrupt payload: {h.k} values of a {h.numel}-element tensor in "
                                       f"{h.total_bytes} bytes, far sparser than ratio={self.ratio}")

    def _decode_sparse(self, h: wire.Header, reader: wire.SectionReader) -> Tuple[torch.Tensor, torch.Tensor]:
        idx = wire.decode_indices(reader, h.index_mode, h.k, h.numel)
        vals = wire.from_bytes(reader.take(h.k * h.dtype.itemsize), h.dtype)
        if not bool(torch.isfinite(vals).all()):  # encoders never send them (inputs are checked)
            raise wire.WireFormatError("corrupt payload: non-finite values")
        return idx, vals


class TopKQSGD(_Quantiser, TopK):
    """TopK, then QSGD on the kept values: the headline setting is ratio 0.01 with 8 bits.

    >>> TopKQSGD()
    TopKQSGD(ratio=0.01, bits=8, bucket_size=512, error_feedback=True)
    """

    kind = wire.KIND_TOPKQSGD

    def __init__(self, ratio: float = 0.01, bits: int = 8, bucket_size: int = DEFAULT_BUCKET,
                 error_feedback: bool = True, seed: Optional[int] = None, checksum: Optional[bool] = None) -> None:
        super().__init__(ratio, error_feedback, seed, checksum)
        self._init_quantiser(bits, bucket_size)

    def __repr__(self) -> str:
        return (f"TopKQSGD(ratio={self.ratio}, bits={self.bits}, bucket_size={self.bucket_size}, "
                f"error_feedback={self.error_feedback})")

    def _encode(self, flat: torch.Tensor, dtype: torch.dtype, seed: int, contract: bool = False) -> _Encoded:
        idx, mode, sections = self._select(flat)
        vals = flat[idx]
        norms, codes = kernels.qsgd_encode(vals, self.bits, self.bucket_size, seed, dtype=dtype)
        norms = _shrunk(norms, contract, self.bits, min(vals.numel(), self.bucket_size))
        sent_vals = kernels.qsgd_decode(norms, codes, self.bits, self.bucket_size, dtype)
        sections += [wire.as_bytes(norms), wire.pack_bits(codes, self.bits)]
        return _Encoded(idx.numel(), self.bits, mode, self.bucket_size, sections, (idx, sent_vals))

    def _decode_sparse(self, h: wire.Header, reader: wire.SectionReader) -> Tuple[torch.Tensor, torch.Tensor]:
        idx = wire.decode_indices(reader, h.index_mode, h.k, h.numel)
        return idx, _read_qsgd(reader, h.k, h.bits, h.bucket_size, h.dtype)


# ---------------------------------------------------------------- helpers
def qsgd_ef_scale(bits: int, bucket_size: int) -> float:
    """Scale of QSGD payloads under error feedback: 1/(1+w) when w >= 1, else 1.

    QSGD is unbiased with variance E||Q(v)-v||^2 <= w ||v||^2, w = min(d/s^2, sqrt(d)/s)
    (Alistarh et al., Lemma 3.1; d = bucket size, s = 2**(bits-1) - 1). Error feedback is
    stable only when what is left behind is smaller than what came in: w < 1. At 8 bits
    with 512-value buckets w = 0.03 and nothing changes; at 4 bits w = 3.2 and at 2 bits
    w = 22.6, where the residual would grow without bound. Scaling by 1/(1+w) makes the
    compressor a contraction (Stich & Karimireddy, 2019), so the residual stays bounded;
    what is not sent stays in the residual and goes out in later steps.

    >>> qsgd_ef_scale(8, 512), round(qsgd_ef_scale(4, 512), 3)
    (1.0, 0.236)
    """
    s = (1 << (bits - 1)) - 1
    w = min(bucket_size / s**2, math.sqrt(bucket_size) / s)
    return 1.0 if w < 1.0 else 1.0 / (1.0 + w)


def _shrunk(norms: torch.Tensor, contract: bool, bits: int, bucket: int) -> torch.Tensor:
    """Norms scaled by :func:`qsgd_ef_scale` when error feedback needs a contraction."""
    scale = qsgd_ef_scale(bits, bucket) if contract else 1.0
    return norms if scale == 1.0 else norms * scale


def _read_qsgd(reader: wire.SectionReader, n: int, bits: int, bucket: int, dtype: torch.dtype) -> torch.Tensor:
    nb = (n + bucket - 1) // bucket
    norms = wire.from_bytes(reader.take(4 * nb), torch.float32)
    # Encoders write norms in [0, norm_cap]: anything else (NaN too) would decode to inf/NaN.
    if not bool(((norms >= 0) & (norms <= kernels.norm_cap(dtype))).all()):
        raise wire.WireFormatError(f"corrupt payload: a QSGD norm is negative, non-finite or beyond {dtype}'s range")
    codes = wire.unpack_bits(reader.take((n * bits + 7) // 8), bits, n).to(torch.uint8)
    return kernels.qsgd_decode(norms, codes, bits, bucket, dtype)


def _subtract_sent(acc: torch.Tensor, sent: Sent) -> None:
    """acc -= what the payload carries (dense QSGD codes or sparse (indices, values)), in place."""
    if isinstance(sent, kernels.QSGDDecoded):
        sent.subtract_from(acc)  # one fused pass, no dense decoded temporary
    else:
        idx, vals = sent
        acc[idx] -= vals.to(acc.dtype)


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


def _compressible(tensor: torch.Tensor) -> bool:
    return (tensor.layout == torch.strided and tensor.is_floating_point() and tensor.dtype in wire.DTYPES
            and tensor.numel() > 0)


def _check_input(tensor: torch.Tensor, name: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor for {name or 'the input'}, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise ValueError(f"tensor {name!r} is sparse ({tensor.layout}), e.g. from nn.Embedding(sparse=True): "
                         "compressors take dense tensors. Build the embedding with sparse=False, or pass "
                         "grad.to_dense() (Horovod's compress() entry point passes sparse tensors through "
                         "uncompressed).")
    if not _compressible(tensor):
        raise ValueError(f"tensor {name!r} of dtype {tensor.dtype} and {tensor.numel()} elements cannot be "
                         f"encoded: supported dtypes are {', '.join(map(str, wire.DTYPES))}, non-empty. "
                         "compress() passes such tensors through unchanged.")


def _check_finite(tensor: torch.Tensor, name: str) -> None:
    # One reduction instead of isfinite().all(): NaN and +-Inf both make the sum non-finite.
    if not torch.isfinite(tensor.sum(dtype=torch.float32)):
        bad = int((~torch.isfinite(tensor)).sum())
        if not bad:  # large finite values whose sum overflowed
            return
        raise FloatingPointError(
            f"gradient {name!r} has {bad} NaN/Inf values (of {tensor.numel()}); nothing was sent and its "
            "error-feedback residual is unchanged. Lower the learning rate, use gradient clipping or "
            "a loss scaler that skips such steps.")


def payload_size(compressor: GradientCompressor, shape: Tuple[int, ...], dtype: torch.dtype = torch.float32,
                 index_bytes: Optional[int] = None) -> int:
    """Documented payload size in bytes, for QSGD exactly; for sparse payloads given the index bytes."""
    n = 1
    for d in shape:
        n *= d
    head = wire.padded(wire.HEADER_BYTES + 8 * len(shape))
    if isinstance(compressor, QSGD):
        nb = (n + compressor.bucket_size - 1) // compressor.bucket_size
        return head + wire.padded(4 * nb) + wire.padded((n * compressor.bits + 7) // 8)
    k = kernels.num_selected(compressor.ratio, n)
    if index_bytes is None:
        raise ValueError("sparse payload sizes depend on the index coding: pass index_bytes")
    if isinstance(compressor, TopKQSGD):
        nb = (k + compressor.bucket_size - 1) // compressor.bucket_size
        return head + index_bytes + wire.padded(4 * nb) + wire.padded((k * compressor.bits + 7) // 8)
    return head + index_bytes + wire.padded(k * dtype.itemsize)
