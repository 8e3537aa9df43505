"""The codec-facing part of :class:`~hvd_gradcomp.compressors.GradientCompressor`: payloads in
and out of the wire format (a mixin, :class:`WireCodec`), and what a codec's ``_encode`` returns
(:class:`Encoded`).

``encode``/``decode`` carry no state but the random stream; a codec (``topk``, ``qsgd``, or one
written outside the package) implements ``_encode``, ``_decode``, for a sparse payload
``_decode_sparse``, and ``payload_size`` (see docs/ARCHITECTURE.md, "Add a compressor").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from . import feedback as fb
from . import kernels, wire

Sent = fb.Sent


@dataclass
class Encoded:
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


class WireCodec:
    """Payloads of one codec: :meth:`encode`, :meth:`decode`, :meth:`decode_parts`, their CRC32
    (``checksum``) and sizes; the methods a codec implements. Mixed into
    :class:`~hvd_gradcomp.compressors.GradientCompressor`, which declares ``kind`` and owns the
    byte statistics (``stats``); the random stream is :meth:`~hvd_gradcomp.compressor_state.StepState._next_seed`."""

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

    def _encode_flat(self, flat: torch.Tensor, dtype: torch.dtype, shape: Tuple[int, ...],
                     name: str, contract: bool = False, marked: fb.Marked = None) -> Tuple[torch.Tensor, Sent]:
        # read before _next_seed counts this exchange: the share of the step being encoded
        self._step_now, self._name_now = self._steps.get(name, 0), name
        enc = self._encode(flat, dtype, self._next_seed(name), contract, marked)
        header = wire.Header(self.kind, dtype, enc.bits, enc.index_mode, shape, flat.numel(), enc.k, 0,
                             enc.bucket_size, self._checksummed)
        payload = wire.assemble(header, enc.sections, flat.device)
        self.stats.record(name, flat.numel() * dtype.itemsize, payload.numel())
        return payload, enc.sent

    def payload_size(self, shape: Tuple[int, ...], dtype: torch.dtype = torch.float32,
                     index_bytes: Optional[int] = None) -> int:
        """Bytes of the payload of a ``shape`` tensor (sparse payloads: given ``index_bytes``, their
        index coding's size). A compressor that cannot tell raises ``NotImplementedError``."""
        raise NotImplementedError(f"{type(self).__name__} does not document its payload size")

    @property
    def ef_scale(self) -> float:
        """Factor applied to what is sent under error feedback (1.0: none), for full buckets;
        buckets of fewer values get the (larger) factor of their size. See :func:`qsgd_ef_scale`."""
        return 1.0

    # ------------------------------------------------------------ to implement
    def _encode(self, flat: torch.Tensor, dtype: torch.dtype, seed: int, contract: bool = False,
                marked: fb.Marked = None) -> Encoded:
        """``marked``: top-k candidates of ``flat`` found while it was built (see
        :meth:`Feedback.prepare_marked`), for the codecs that select."""
        raise NotImplementedError

    def _decode(self, h: wire.Header, reader: wire.SectionReader) -> torch.Tensor:
        raise NotImplementedError


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
    if not kernels.all_finite(tensor):
        bad = int((~torch.isfinite(tensor)).sum())
        raise FloatingPointError(
            f"gradient {name!r} has {bad} NaN/Inf values (of {tensor.numel()}); nothing was sent and its "
            "error-feedback residual is unchanged. Lower the learning rate, use gradient clipping or "
            "a loss scaler that skips such steps.")


def _head_bytes(shape: Tuple[int, ...]) -> int:
    return wire.padded(wire.HEADER_BYTES + 8 * len(shape))
