"""QSGD (Alistarh et al., 2017): each bucket of values sent as its norm and one stochastically
rounded level per value; :class:`Quantiser` is the part QSGD and TopKQSGD share."""
from __future__ import annotations

import math
from typing import Optional, Tuple, Union

import torch

from .. import codecs, wire
from . import kernels
from .. import feedback as fb
from .interface import _head_bytes
from .compressor import (DEFAULT_BUCKET, Encoded, GradientCompressor, NamedParameters, PartAttribute, qsgd_ef_scale,
                         qsgd_variance_bound)
from ..feedback import Feedback
from ..settings import Checked, check_bits, check_bucket_size


class Quantiser:
    """What QSGD and TopKQSGD share, a part each owns: bits and bucket size (checked on every assignment)
    and the error-feedback scale they imply.

    >>> q = Quantiser(bits=4, bucket_size=512)
    >>> round(q.ef_scale(contract=True), 3), q.ef_scale(contract=False), q.contracting
    (0.236, 1.0, True)
    """

    bits = Checked(check_bits, "Bits per value: 1 sign bit + level bits, 2 to 8.")
    bucket_size = Checked(check_bucket_size, "Values sharing one norm, 1 to 2**32 - 1.")

    def __init__(self, bits: int, bucket_size: int) -> None:
        self.bits = bits
        self.bucket_size = bucket_size

    def ef_scale(self, contract: bool) -> float:
        """The factor on what is sent when the feedback policy needs a contraction (``contract``)."""
        return qsgd_ef_scale(self.bits, self.bucket_size) if contract else 1.0

    @property
    def contracting(self) -> bool:
        return qsgd_ef_scale(self.bits, self.bucket_size) < 1.0


class QSGD(GradientCompressor):
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
    codec_name = "qsgd"
    collective = codecs.COMPRESSED_ALLREDUCE
    bits = PartAttribute("_quant", "bits", Quantiser.bits.__doc__)
    bucket_size = PartAttribute("_quant", "bucket_size", Quantiser.bucket_size.__doc__)

    def __init__(self, bits: int = 8, bucket_size: int = DEFAULT_BUCKET, error_feedback: bool = True,
                 seed: Optional[int] = None, feedback: Union[str, Feedback] = "auto", clip: Optional[float] = None,
                 exclude: Optional[str] = None, checksum: Optional[bool] = None, exempt: str = "fp16",
                 named_parameters: Optional[NamedParameters] = None) -> None:
        super().__init__(error_feedback, seed, feedback, clip, exclude, checksum, exempt, named_parameters)
        self._quant = Quantiser(bits, bucket_size)

    @property
    def ef_scale(self) -> float:
        return self._quant.ef_scale(self.feedback.contract)

    @property
    def _contracting(self) -> bool:
        return self._quant.contracting

    def __repr__(self) -> str:
        return (f"QSGD(bits={self.bits}, bucket_size={self.bucket_size}, error_feedback={self.error_feedback}"
                f"{self._extra_repr()})")

    def payload_size(self, shape: Tuple[int, ...], dtype: torch.dtype = torch.float32,
                     index_bytes: Optional[int] = None) -> int:
        """Exact: ``40 + 8*ndim`` (padded) + the norms + the packed codes.

        >>> QSGD(bits=8).payload_size((1024,))
        1080
        """
        n = math.prod(shape)
        nb = (n + self.bucket_size - 1) // self.bucket_size
        return _head_bytes(shape) + wire.padded(4 * nb) + wire.padded((n * self.bits + 7) // 8)

    def pack(self, flat: torch.Tensor, dtype: torch.dtype, seed: int, contract: bool = False,
                marked: fb.Marked = None) -> Encoded:
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
        return Encoded(n, self.bits, wire.INDEX_NONE, self.bucket_size, sections, sent)

    def unpack(self, h: wire.Header, reader: wire.SectionReader) -> torch.Tensor:
        return _read_qsgd(reader, h.k, h.bits, h.bucket_size, h.dtype)

    def _caution(self) -> str:
        """Said with the start-up choice where the rounding noise dwarfs the gradient.

        Why: unbiased is not enough at a learning rate tuned for uncompressed training. In an outside
        check (session 32, a small MLP on 2 ranks, not kept in the repo) 2-bit QSGD with 512-value
        buckets (noise up to 4.8x a bucket's norm) diverged with momentum SGD at lr 0.05, where 3- and
        4-bit QSGD (up to 2.7x and 1.8x) trained.

        >>> "Note: at 2 bits" in QSGD(bits=2)._caution(), QSGD(bits=4)._caution()
        (True, '')
        """
        w = qsgd_variance_bound(self.bits, self.bucket_size)
        if w < QSGD_NOISY:
            return ""
        return (f" Note: at {self.bits} bits with buckets of {self.bucket_size} values, each bucket a rank sends "
                f"carries rounding noise of up to {math.sqrt(w):.1f}x its norm (unbiased, Alistarh et al. 2017): at a "
                "learning rate tuned for uncompressed training this can diverge. Lower the learning rate, or "
                "use more bits (4 or 8) or a smaller bucket_size.")


# QSGD's variance bound w (E||Q(v) - v||^2 <= w ||v||^2) from which the start-up message cautions
# (QSGD._caution): 2 bits at 512 values (22.6) diverged in a check, 3 bits (7.5) trained.
QSGD_NOISY = 10.0


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
