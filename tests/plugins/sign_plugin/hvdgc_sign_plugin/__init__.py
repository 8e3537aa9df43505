"""EF-SignSGD (Karimireddy et al., 2019) as a codec of its own: one sign bit per value and one
scale per tensor, in a payload layout of its own. The walk-through is docs/WRITING_A_CODEC.md.

Each rank sends ``scale * sign(p)``, where ``p`` is its gradient plus what error feedback owes it
and ``scale = mean(|p|)``; error feedback keeps ``p - scale * sign(p)`` for the next step. Every
rank gathers every rank's payload and averages them (the allgather road).

The payload, after hvd_gradcomp's 40-byte header and the shape::

    section 1   the scale: one float32 (4 bytes, padded to 8)
    section 2   the signs: one bit per value, 1 for negative (ceil(n / 8) bytes, padded to 8)

>>> import torch
>>> c = EFSign(seed=0)
>>> payload = c.compress_named("w", torch.tensor([0.5, -1.0, 2.0, -0.5]))
>>> c.decode(payload).tolist()                    # mean |p| = 1.0, with each value's sign
[1.0, -1.0, 1.0, -1.0]
>>> c.residuals.residual("w").tolist()            # what error feedback sends later
[-0.5, 0.0, 1.0, 0.5]
>>> payload.numel(), c.payload_size((4,))         # header + shape 48, scale 8, signs 8
(64, 64)
"""
from __future__ import annotations

import math
from typing import Any, Optional, Tuple

import torch

from hvd_gradcomp import Encoded, GradientCompressor, codecs, wire

KIND = 17
"""This layout's payload kind: kinds 16..255 are for codecs of their own (1..3 are hvd_gradcomp's)."""


def _section_bytes(h: wire.Header) -> int:
    """The fewest bytes after the header a valid payload holds: what ``unpack`` reads. A receiving
    rank refuses a shorter payload before decoding it."""
    return wire.padded(4) + wire.padded((h.numel + 7) // 8)


def _check_header(h: wire.Header) -> None:
    """Refuse header fields ``pack`` never writes."""
    if h.bits != 1 or h.k != h.numel or h.index_mode != wire.INDEX_NONE:
        raise wire.WireFormatError(f"corrupt ef-sign payload: bits {h.bits}, k {h.k} of {h.numel}, "
                                   f"index mode {h.index_mode}")


@codecs.register("ef-sign")
class EFSign(GradientCompressor):
    """Send the sign of every value and one scale per tensor (32x fewer bytes than float32), with
    error feedback. Serves stock ``hvd.DistributedOptimizer(compression=EFSign())``,
    ``hvd_gradcomp.DistributedOptimizer`` and the DDP hook (``hvd_gradcomp.ddp.register``)."""

    codec_name = "ef-sign"                # the name in the registry, HVDGC_COMPRESSION, hvdgc-launch
    collective = codecs.ALLGATHER         # every rank gathers every rank's payload
    nature = codecs.DENSE                 # every value every step: feedback="auto" chooses classic
    kind = KIND
    layout = wire.Layout("ef-sign", _section_bytes, _check_header)

    def __init__(self, error_feedback: bool = True, seed: Optional[int] = None, **kwargs: Any) -> None:
        super().__init__(error_feedback=error_feedback, seed=seed, **kwargs)

    def __repr__(self) -> str:
        return f"EFSign(error_feedback={self.error_feedback}{self._extra_repr()})"

    def pack(self, flat: torch.Tensor, dtype: torch.dtype, seed: int, contract: bool = False,
             marked: Any = None) -> Encoded:
        scale = flat.abs().mean(dtype=torch.float32).reshape(1)
        negative = flat < 0
        sent = _signed(scale, negative, dtype)     # exactly what unpack will rebuild
        sections = [wire.as_bytes(scale), wire.pack_bits(negative.to(torch.uint8), 1)]
        return Encoded(k=flat.numel(), bits=1, index_mode=wire.INDEX_NONE, bucket_size=0,
                       sections=sections, sent=(None, sent))

    def unpack(self, h: wire.Header, reader: wire.SectionReader) -> torch.Tensor:
        scale = wire.from_bytes(reader.take(4), torch.float32)
        negative = wire.unpack_bits(reader.take((h.numel + 7) // 8), 1, h.numel).bool()
        return _signed(scale, negative, h.dtype)

    def payload_size(self, shape: Tuple[int, ...], dtype: torch.dtype = torch.float32,
                     index_bytes: Optional[int] = None) -> int:
        head = wire.padded(wire.HEADER_BYTES + 8 * len(shape))
        return head + wire.padded(4) + wire.padded((math.prod(shape) + 7) // 8)


def _signed(scale: torch.Tensor, negative: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``-scale`` where ``negative``, else ``scale``, as ``dtype``."""
    return torch.where(negative, -scale, scale).to(dtype)
