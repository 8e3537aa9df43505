"""The wire format: the exact bytes a compressed tensor travels as (the layout is described in
:mod:`hvd_gradcomp.wire.format`).

* :mod:`~hvd_gradcomp.wire.format`: the versioned, validated payload: its header, its sections,
  codecs' own layouts (:func:`register_layout`), checksums, splitting gathered payloads apart;
* :mod:`~hvd_gradcomp.wire.indices`: bit packing and the index sections of sparse payloads (delta
  blocks or a bitmap).

The arithmetic that fills the sections is not here: the codecs' (QSGD's rounding, top-k selection)
is in :mod:`hvd_gradcomp.codecs.kernels`, error feedback's in :mod:`hvd_gradcomp.feedback.kernels`.

Every name of ``format`` and ``indices`` is importable from here (``from hvd_gradcomp import wire;
wire.read_header(...)``).
"""
from .format import (FORMAT_VERSION, READ_VERSIONS, MAGIC, KIND_QSGD, KIND_TOPK, KIND_TOPKQSGD, BUILTIN_KINDS,
                     INDEX_NONE, INDEX_DELTA, INDEX_BITMAP, FLAG_CRC32, DTYPES, MAX_NDIM, INDEX_BLOCK, ALIGN,
                     HEADER_BYTES, WireFormatError, Layout, FIRST_OWN_KIND, register_layout, layout_name, Header,
                     padded, header_bytes, read_header, parse_header, min_section_bytes, payload_crc32, verify_checksum,
                     assemble, reserve, SectionReader, as_bytes, from_bytes, split_payloads, split_with_headers)
from .indices import (pack_bits, unpack_bits, bit_length, delta_index_bytes, unpack_deltas, decode_delta_indices,
                      encode_indices, decode_indices)

__all__ = ["FORMAT_VERSION", "READ_VERSIONS", "MAGIC", "KIND_QSGD", "KIND_TOPK", "KIND_TOPKQSGD", "BUILTIN_KINDS",
           "INDEX_NONE", "INDEX_DELTA", "INDEX_BITMAP", "FLAG_CRC32", "DTYPES", "MAX_NDIM", "INDEX_BLOCK", "ALIGN",
           "HEADER_BYTES", "WireFormatError", "Layout", "FIRST_OWN_KIND", "register_layout", "layout_name", "Header",
           "padded", "header_bytes", "read_header", "parse_header", "min_section_bytes", "payload_crc32",
           "verify_checksum", "assemble", "reserve", "SectionReader", "as_bytes", "from_bytes", "split_payloads",
           "split_with_headers", "pack_bits", "unpack_bits", "bit_length", "delta_index_bytes", "unpack_deltas",
           "decode_delta_indices", "encode_indices", "decode_indices"]
