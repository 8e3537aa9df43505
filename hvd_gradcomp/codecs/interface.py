"""The codec interface of :class:`~hvd_gradcomp.codecs.compressor.GradientCompressor`: payloads in and
out of the wire format (:class:`WireCodec`, the base of the compressor), and what a codec's :meth:`~WireCodec.pack`
returns (:class:`Encoded`).

``encode``/``decode`` carry no state but the random stream; they frame what a codec's public
methods produce. A codec (``topk``, ``qsgd``, or one written outside the package, see
docs/WRITING_A_CODEC.md) implements:

* ``pack(flat, dtype, seed, contract, marked) -> Encoded``: the sections after the header, the
  header fields it sets, and what was sent (for error feedback);
* ``unpack(header, reader) -> flat tensor``: the sections read back, in the order ``pack`` wrote them;
* ``unpack_sparse(header, reader) -> (indices, values)``: for a sparse payload only, so that
  summing many ranks' payloads costs one pass over their values;
* ``payload_size(shape, dtype, index_bytes)``: the bytes of a payload, without encoding one;

and declares ``codec_name``, ``collective``, ``nature`` and ``kind``, with ``layout`` (a
:class:`hvd_gradcomp.wire.Layout`) for a kind of its own. :meth:`WireCodec.check_codec` checks
all of it when the class is registered or first built.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import ClassVar, List, Optional, Set, Tuple

import torch

from .. import codecs, wire
from .. import feedback as fb
from ..feedback import Feedback, kernels

Sent = fb.Sent


@dataclass
class Encoded:
    """What a codec's :meth:`~WireCodec.pack` produced: header fields, sections and what was sent.

    * ``k``: values sent (``numel`` for a dense payload); ``bits``: bits per value (0: raw);
      ``index_mode``: :data:`hvd_gradcomp.wire.INDEX_NONE` unless the sections hold coded
      indices; ``bucket_size``: QSGD's (0 when unused). They go into the header, which
      :meth:`~WireCodec.unpack` is handed back.
    * ``sections``: 1-D ``torch.uint8`` tensors, written after the header in this order, each
      padded to 8 bytes (:func:`hvd_gradcomp.wire.as_bytes` views a tensor's bytes).
    * ``sent``: what the payload carries, as the receiving ranks will decode it, bit for bit;
      error feedback keeps the rest as the residual, and the exchanges sum this rank's own part
      from it instead of decoding its payload. One of:

      - ``(indices, values)``: a sparse payload (each index once);
      - ``(None, values)``: a dense one, ``values`` flat with one entry per element;
      - QSGD's codes (:class:`hvd_gradcomp.codecs.kernels.QSGDDecoded`), subtracted in one fused pass.

    >>> e = Encoded(4, 1, 0, 0, [torch.zeros(8, dtype=torch.uint8)], (None, torch.ones(4)))
    >>> e.sent[0] is None, e.sent[1].tolist()
    (True, [1.0, 1.0, 1.0, 1.0])
    """

    k: int
    bits: int
    index_mode: int
    bucket_size: int
    sections: List[torch.Tensor]
    sent: Sent


class WireCodec:
    """Payloads of one codec: :meth:`encode`, :meth:`decode`, :meth:`decode_parts`, their CRC32
    (``checksum``) and sizes; the methods a codec implements (:meth:`pack`, :meth:`unpack`,
    ``unpack_sparse``, :meth:`payload_size`) and the check of a codec class
    (:meth:`check_codec`); the decisions a codec may override, asked by the compressor's parts
    (:meth:`compressible`, ``_selects``, :attr:`carries_held_back`, ``_caution``, ``_auto_policy``,
    ``_contracting``, :attr:`ef_scale`). The base of :class:`~hvd_gradcomp.codecs.compressor.GradientCompressor`,
    which frames what :meth:`pack` returns into a payload (``encode``) with the seed of its step
    counter; nothing here reads the compressor's parts."""

    kind: ClassVar[int] = 0
    """The payload's layout: a built-in ``wire.KIND_*``, or a kind of the codec's own (16..255)
    declared with :attr:`layout`."""
    layout: ClassVar[Optional[wire.Layout]] = None
    """The sections of a payload of a kind of the codec's own, as receiving ranks check them before
    any decoder runs; registered with :func:`hvd_gradcomp.wire.register_layout` by :meth:`check_codec`."""
    _checked: ClassVar[Set[type]] = set()

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        # Codecs written against the names of releases before the interface was public.
        for old, new in (("_encode", "pack"), ("_decode", "unpack"), ("_decode_sparse", "unpack_sparse")):
            if old in cls.__dict__ and new not in cls.__dict__:
                warnings.warn(f"{cls.__qualname__}.{old} is the old name of the codec method {new}: rename it",
                              DeprecationWarning, stacklevel=2)
                setattr(cls, new, cls.__dict__[old])

    @classmethod
    def check_codec(cls) -> None:
        """Refuse a codec class the exchanges could not carry, naming the fix (``ValueError``); register its
        own payload layout. Called by :func:`hvd_gradcomp.codecs.register` and when the class is
        first built, so a bad codec fails before any rank sends a byte.

        >>> from hvd_gradcomp.codecs.compressor import GradientCompressor
        >>> class NoDecoder(GradientCompressor):
        ...     codec_name, kind = "no-decoder", 99
        ...     def pack(self, flat, dtype, seed, contract=False, marked=None): ...
        >>> NoDecoder.check_codec()
        Traceback (most recent call last):
        ValueError: NoDecoder sends payloads (collective 'allgather') but does not implement unpack(header, reader): the sections read back in the order pack writes them (docs/WRITING_A_CODEC.md)
        """
        if cls in WireCodec._checked:
            return
        name, collective = cls.__qualname__, getattr(cls, "collective", None)
        if collective == codecs.ALLREDUCE_ROUNDS:   # factors in allreduces: no payload, no layout
            missing = [m for m in ("first_round", "second_round", "finish_rounds") if not callable(getattr(cls, m, None))]
            if missing:
                raise ValueError(f"{name} declares collective {collective!r} but does not implement {missing}: "
                                 "see hvd_gradcomp/codecs/powersgd.py")
        else:
            for method, what in (("pack", "pack(flat, dtype, seed, contract, marked) -> Encoded: the sections of "
                                           "a payload and what it carries"),
                                 ("unpack", "unpack(header, reader): the sections read back in the order pack "
                                            "writes them")):
                if getattr(cls, method) is getattr(WireCodec, method):
                    raise ValueError(f"{name} sends payloads (collective {collective!r}) but does not implement "
                                     f"{what} (docs/WRITING_A_CODEC.md)")
            _check_kind(cls)
        WireCodec._checked.add(cls)

    @property
    def checksum(self) -> Optional[bool]:
        """Put a CRC32 of each payload in its header and refuse payloads whose bytes changed (True), or
        not (False). None (default): on for the sparse codecs, where it costs under 0.1% of encode
        time, off for QSGD, whose payloads are a quarter of the gradient and where it costs 10-19%
        (``benchmarks/bench_checksum.py``). A codec that writes checksums also refuses payloads
        without one: set it alike on every rank."""
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
    def decode(self, payload: torch.Tensor) -> torch.Tensor:
        """The tensor a payload stands for, in its original shape and dtype.

        Any malformed payload (truncated, corrupted, forged) raises ``WireFormatError``.
        """
        h = self._own_header(payload)
        return self.unpack(h, wire.SectionReader(payload, h)).view(h.shape)

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
        sparse = getattr(self, "unpack_sparse", None)
        h = self._own_header(payload, header)
        if sparse is None:
            return None, self.unpack(h, wire.SectionReader(payload, h)).reshape(-1)
        return sparse(h, wire.SectionReader(payload, h))

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

    # ------------------------------------------------------------ a codec's decisions (override points)
    def compressible(self, shape: Tuple[int, ...]) -> bool:
        """Whether this codec compresses a tensor of ``shape`` at all (PowerSGD: matrices only); the
        wrappers send the others uncompressed. True here."""
        return True

    def _selects(self, name: str, numel: int) -> Optional[int]:
        """How many entries a top-k codec keeps of tensor ``name`` at its next exchange; None
        for codecs that keep them all."""
        return None

    @property
    def carries_held_back(self) -> bool:
        """Whether each sent value of the average carries the updates of the steps it was held
        back (a sparse compressor under error feedback on gradients or DGC's momentum correction):
        its norm is then far above a gradient's, and ``clip_grad_norm_`` on the average shrinks
        every step far more than meant. False here; see :meth:`TopK.carries_held_back`."""
        return False

    def _caution(self) -> str:
        """What the user should know about these settings, said with the choice (empty: nothing)."""
        return ""

    def _auto_policy(self, key: str) -> Feedback:
        """The policy ``feedback="auto"`` chose, as this compressor's settings want it (see :meth:`TopK._auto_policy`)."""
        return fb.make(key)

    @property
    def _contracting(self) -> bool:
        return False

    # ------------------------------------------------------------ to implement
    def pack(self, flat: torch.Tensor, dtype: torch.dtype, seed: int, contract: bool = False,
             marked: fb.Marked = None) -> Encoded:
        """The payload of ``flat`` (1-D, the error-feedback-compensated gradient, float32 or the
        gradient's dtype), to be sent as ``dtype``: its header fields, its sections and what it
        carries (:class:`Encoded`).

        ``seed``: differs per tensor, exchange step and rank; a random codec draws from it alone,
        so a resumed run draws the same. ``contract``: the feedback policy needs what is sent
        shrunk to a contraction (QSGD's low bit widths; most codecs ignore it). ``marked``: top-k
        candidates of ``flat`` found while it was built (:meth:`Feedback.prepare_marked`), for the
        codecs that select; None otherwise."""
        raise NotImplementedError(f"{type(self).__name__} does not implement pack")

    def unpack(self, h: wire.Header, reader: wire.SectionReader) -> torch.Tensor:
        """The flat tensor (``h.numel`` values of ``h.dtype``) a payload stands for, read from its
        sections in the order :meth:`pack` wrote them (``reader.take(nbytes)``). A sparse codec
        also implements ``unpack_sparse(h, reader) -> (indices, values)``."""
        raise NotImplementedError(f"{type(self).__name__} does not implement unpack")


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


def _check_kind(cls: type) -> None:
    """A codec's ``kind`` names a built-in layout or one it declares (``layout``), registered here."""
    kind, layout, name = getattr(cls, "kind", 0), getattr(cls, "layout", None), cls.__qualname__
    if kind in wire.BUILTIN_KINDS and layout is None:
        return
    if isinstance(kind, bool) or not isinstance(kind, int) or not wire.FIRST_OWN_KIND <= kind <= 255:
        raise ValueError(f"{name}.kind is {kind!r}: use a built-in layout's (wire.KIND_TOPK, wire.KIND_QSGD, "
                         f"wire.KIND_TOPKQSGD) or a kind of your own in {wire.FIRST_OWN_KIND}..255 with "
                         "layout = wire.Layout(...)")
    if layout is None:
        try:
            wire.layout_name(kind)
        except wire.WireFormatError:
            raise ValueError(f"{name}.kind is {kind}, a layout of its own, but it declares none: set "
                             "layout = wire.Layout(name, min_section_bytes) in the class") from None
        return
    try:
        wire.register_layout(kind, layout)
    except wire.WireFormatError as err:
        raise ValueError(f"{name}: {err}") from None


def _head_bytes(shape: Tuple[int, ...]) -> int:
    return wire.padded(wire.HEADER_BYTES + 8 * len(shape))
