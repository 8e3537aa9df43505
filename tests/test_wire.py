"""The wire format: header layout, bit packing, index coding, splitting, and corrupt payloads.

Expected values come from independent oracles written here (Python big integers for bit
packing, the documented header layout parsed with :mod:`struct`, the documented delta-block
size rule), never from the code under test.
"""
import math
import struct
from itertools import pairwise

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hvd_gradcomp import QSGD, TopK, TopKQSGD, WireFormatError, wire

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# The documented header: magic, version, kind, dtype, bits, index_mode, ndim, numel, k,
# total_bytes, bucket_size, reserved (40 bytes, little-endian), then 8 bytes per dimension.
HEADER = struct.Struct("<2sBBBBBBqqqII")
OFF = {"magic": 0, "version": 2, "kind": 3, "dtype": 4, "bits": 5, "index_mode": 6, "ndim": 7,
       "numel": 8, "k": 16, "total": 24, "bucket": 32}
FMT = {"version": "<B", "kind": "<B", "dtype": "<B", "bits": "<B", "index_mode": "<B", "ndim": "<B",
       "numel": "<q", "k": "<q", "total": "<q", "bucket": "<I"}


def parse(payload: torch.Tensor) -> dict:
    raw = payload.numpy().tobytes()
    f = HEADER.unpack_from(raw, 0)
    names = ["magic", "version", "kind", "dtype", "bits", "index_mode", "ndim", "numel", "k", "total",
             "bucket", "reserved"]
    h = dict(zip(names, f))
    h["shape"] = struct.unpack_from(f"<{h['ndim']}q", raw, 40)
    return h


def patched(payload: torch.Tensor, field: str, value) -> torch.Tensor:
    b = bytearray(payload.numpy().tobytes())
    if field == "magic":
        b[0:2] = value
    elif field.startswith("dim"):
        struct.pack_into("<q", b, 40 + 8 * int(field[3:]), value)
    else:
        struct.pack_into(FMT[field], b, OFF[field], value)
    return torch.frombuffer(b, dtype=torch.uint8).clone()


def oracle_pack(values, width: int) -> bytes:
    """Little-endian bit order: value i occupies bits [i*width, (i+1)*width) of the stream."""
    big = 0
    for i, v in enumerate(values):
        big |= int(v) << (i * width)
    return big.to_bytes((len(values) * width + 7) // 8, "little")


def pad8(n: int) -> int:
    return -(-n // 8) * 8


def bit_len(x: int) -> int:
    return int(x).bit_length()


def oracle_delta_bytes(indices) -> int:
    """Documented size of delta-coded indices: blocks of 64 deltas (delta_0 = idx_0,
    delta_j = idx_j - idx_{j-1} - 1), one width byte per block, 64*width bits per block,
    each of the two sections padded to 8 bytes."""
    deltas = [indices[0]] + [b - a - 1 for a, b in pairwise(indices)]
    blocks = [deltas[i:i + 64] for i in range(0, len(deltas), 64)]
    widths = [bit_len(max(b)) for b in blocks]
    return pad8(len(blocks)) + pad8(sum(w * 8 for w in widths))


# ------------------------------------------------------------------ header
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(), (7,), (3, 5), (2, 3, 4, 5)])
@pytest.mark.parametrize("make, kind_bits", [
    (lambda: QSGD(bits=4, bucket_size=16, seed=1), 4),
    (lambda: TopK(ratio=0.3, min_k=1), 0),
    (lambda: TopKQSGD(ratio=0.3, bits=2, bucket_size=8, seed=1, min_k=1), 2),
])
def test_header_follows_documented_layout(make, kind_bits, shape, dtype):
    c = make()
    x = torch.randn(shape).to(dtype)
    p = c.encode(x)
    assert p.dtype == torch.uint8 and p.dim() == 1
    assert p.numel() % 8 == 0
    h = parse(p)
    n = math.prod(shape)
    assert h["magic"] == b"GC"
    assert h["version"] == wire.FORMAT_VERSION
    assert h["dtype"] == DTYPES.index(dtype)
    assert h["bits"] == kind_bits
    assert h["ndim"] == len(shape) and h["shape"] == shape
    assert h["numel"] == n
    assert h["total"] == p.numel()
    expected_k = n if isinstance(c, QSGD) else max(1, math.ceil(0.3 * n - 1e-12))
    assert h["k"] == expected_k


def test_kinds_are_distinct_and_checked():
    x = torch.randn(20)
    kinds = {parse(c.encode(x))["kind"] for c in (QSGD(seed=0), TopK(), TopKQSGD(seed=0))}
    assert len(kinds) == 3
    with pytest.raises(WireFormatError):
        QSGD().decode(TopK().encode(x))
    with pytest.raises(WireFormatError):
        TopK().decode(TopKQSGD(seed=0).encode(x))


# ------------------------------------------------------------------ bit packing
def test_pack_bits_docstring_example():
    assert wire.pack_bits(torch.tensor([1, 2, 3, 0]), 2).tolist() == [0b00_11_10_01]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(width=st.integers(1, 8), data=st.data())
def test_pack_unpack_round_trip_widths_1_to_8(width, data):
    n = data.draw(st.integers(1, 200))
    vals = data.draw(st.lists(st.integers(0, 2 ** width - 1), min_size=n, max_size=n))
    t = torch.tensor(vals, dtype=torch.int64)
    packed = wire.pack_bits(t, width)
    assert packed.dtype == torch.uint8
    assert packed.numpy().tobytes() == oracle_pack(vals, width)
    assert wire.unpack_bits(packed, width, n).to(torch.int64).tolist() == vals


@pytest.mark.parametrize("width", [9, 13, 24, 33, 40])
def test_pack_unpack_wide_values(width):
    g = torch.Generator().manual_seed(width)
    vals = torch.randint(0, 2 ** width, (131,), generator=g, dtype=torch.int64)
    vals[0], vals[-1] = 0, 2 ** width - 1
    packed = wire.pack_bits(vals, width)
    assert packed.numpy().tobytes() == oracle_pack(vals.tolist(), width)
    assert torch.equal(wire.unpack_bits(packed, width, 131).to(torch.int64), vals)


# ------------------------------------------------------------------ index coding
@st.composite
def index_sets(draw):
    """Sorted distinct indices built from gaps: dense runs (gap 0), small gaps, huge gaps."""
    gap = st.one_of(st.just(0), st.integers(0, 7), st.integers(0, 5000), st.integers(0, 2 ** 40))
    start = draw(st.one_of(st.just(0), st.integers(0, 2 ** 40)))
    gaps = draw(st.lists(gap, min_size=0, max_size=300))
    idx = [start]
    for g_ in gaps:
        idx.append(idx[-1] + g_ + 1)
    return idx


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(idx=index_sets(), tail=st.integers(0, 3))
def test_index_coding_round_trip(idx, tail):
    numel = idx[-1] + 1 + tail  # tail 0: the last index is numel - 1
    t = torch.tensor(idx, dtype=torch.int64)
    mode, sections = wire.encode_indices(t, numel)
    k = len(idx)
    values = torch.zeros(4 * k, dtype=torch.uint8)
    payload = wire.assemble(wire.Header(wire.KIND_TOPK, torch.float32, 0, mode, (numel,), numel, k, 0, 0),
                            sections + [values], torch.device("cpu"))
    h = wire.read_header(payload)
    got = wire.decode_indices(wire.SectionReader(payload, h), h.index_mode, k, numel)
    assert got.tolist() == idx
    index_bytes = payload.numel() - 48 - pad8(4 * k)
    bitmap = pad8((numel + 7) // 8)
    assert index_bytes == min(oracle_delta_bytes(idx), bitmap)


@pytest.mark.parametrize("idx, numel", [
    ([0], 1), ([0], 10 ** 6), ([10 ** 6 - 1], 10 ** 6), (list(range(1000)), 1000),
    ([0, 2 ** 40], 2 ** 40 + 1), (list(range(64 * 5)) + [2 ** 40 - 1], 2 ** 40),
    ([3, 4, 5, 100, 101, 102, 10 ** 9], 10 ** 9 + 1),
])
def test_index_coding_edge_sets(idx, numel):
    t = torch.tensor(idx, dtype=torch.int64)
    widths, data = wire.delta_index_bytes(t)
    assert wire.decode_delta_indices(widths, data, len(idx)).tolist() == idx
    mode, sections = wire.encode_indices(t, numel)
    values = torch.zeros(4 * len(idx), dtype=torch.uint8)
    payload = wire.assemble(wire.Header(wire.KIND_TOPK, torch.float32, 0, mode, (numel,), numel, len(idx), 0, 0),
                            sections + [values], torch.device("cpu"))
    h = wire.read_header(payload)
    assert wire.decode_indices(wire.SectionReader(payload, h), mode, len(idx), numel).tolist() == idx


def test_dense_index_set_uses_the_smaller_bitmap():
    g = torch.Generator().manual_seed(0)
    idx = torch.randperm(4000, generator=g)[:2000].sort().values
    mode, sections = wire.encode_indices(idx, 4000)
    assert mode == wire.INDEX_BITMAP
    assert sum(-(-s.numel() // 8) * 8 for s in sections) == 504 < oracle_delta_bytes(idx.tolist())  # 4000 bits, padded


# ------------------------------------------------------------------ splitting
def _mixed_payloads():
    g = torch.Generator().manual_seed(3)
    return [
        QSGD(bits=8, seed=1).encode(torch.randn(100, generator=g)),
        TopK(ratio=0.05).encode(torch.randn(7, 9, generator=g).to(torch.float16)),
        TopKQSGD(ratio=0.5, bits=3, bucket_size=4, seed=2).encode(torch.randn(33, generator=g).to(torch.bfloat16)),
        QSGD(bits=2, bucket_size=5, seed=4).encode(torch.randn((), generator=g)),
    ]


def test_split_payloads_recovers_each_payload():
    parts = _mixed_payloads()
    got = wire.split_payloads(torch.cat(parts))
    assert len(got) == len(parts)
    for a, b in zip(got, parts):
        assert torch.equal(a, b)
    assert wire.split_payloads(torch.zeros(0, dtype=torch.uint8)) == []


def test_split_payloads_of_truncated_blob_raises():
    blob = torch.cat(_mixed_payloads())
    for cut in (1, 8, 39, 41, 100):
        with pytest.raises(WireFormatError):
            wire.split_payloads(blob[:-cut])


@pytest.mark.timeout(3, method="signal")
def test_split_payloads_rejects_zero_length_payload():
    """A corrupt total_bytes of 0 must raise, not loop forever."""
    p = patched(QSGD(seed=0).encode(torch.randn(16)), "total", 0)
    with pytest.raises(WireFormatError):
        wire.split_payloads(p)


@pytest.mark.parametrize("offset", [1, 3, 4])
def test_decode_payload_at_misaligned_offset(offset):
    x = torch.randn(50)
    for c in (QSGD(seed=5), TopK(ratio=0.1), TopKQSGD(ratio=0.2, seed=5)):
        p = c.encode(x)
        shifted = torch.cat([torch.zeros(offset, dtype=torch.uint8), p])[offset:]
        assert torch.equal(c.decode(shifted), c.decode(p.clone()))


# ------------------------------------------------------------------ corrupt payloads
@pytest.mark.parametrize("make", [lambda: QSGD(bits=4, bucket_size=8, seed=0), lambda: TopK(ratio=0.2),
                                  lambda: TopKQSGD(ratio=0.2, bits=3, seed=0)])
def test_every_truncation_raises(make):
    c = make()
    p = c.encode(torch.randn(3, 20))
    for n in range(p.numel()):
        with pytest.raises(WireFormatError):
            c.decode(p[:n].clone())


@pytest.mark.parametrize("bad", [torch.zeros(64, dtype=torch.int8), torch.zeros(8, 8, dtype=torch.uint8),
                                 torch.zeros(64, dtype=torch.float32)])
def test_payload_must_be_1d_uint8(bad):
    with pytest.raises(WireFormatError):
        QSGD().decode(bad)


QSGD_CORRUPTIONS = [
    ("magic", b"XX"), ("version", 3), ("version", 0), ("kind", 9), ("dtype", 3), ("dtype", 255),
    ("ndim", 9), ("ndim", 200), ("numel", 13), ("total", 8), ("total", 10 ** 6), ("total", -8),
    ("k", 5), ("bits", 0), ("bits", 1), ("bits", 9), ("bucket", 0),
]


@pytest.mark.parametrize("field, value", QSGD_CORRUPTIONS, ids=[f"{f}={v!r}" for f, v in QSGD_CORRUPTIONS])
def test_corrupt_qsgd_header_raises(field, value):
    p = QSGD(bits=4, bucket_size=8, seed=0).encode(torch.randn(3, 4))
    with pytest.raises(WireFormatError):
        QSGD().decode(patched(p, field, value))


TOPK_CORRUPTIONS = [("index_mode", 7), ("k", 13), ("k", 0), ("k", -1), ("ndim", 9)]


@pytest.mark.parametrize("field, value", TOPK_CORRUPTIONS, ids=[f"{f}={v!r}" for f, v in TOPK_CORRUPTIONS])
def test_corrupt_topk_header_raises(field, value):
    p = TopK(ratio=0.2).encode(torch.randn(3, 4))
    with pytest.raises(WireFormatError):
        TopK().decode(patched(p, field, value))


def test_negative_dimensions_raise():
    """Two negative dimensions whose product equals numel must not pass the shape check."""
    p = patched(patched(QSGD(seed=0).encode(torch.randn(3, 4)), "dim0", -3), "dim1", -4)
    with pytest.raises(WireFormatError):
        QSGD().decode(p)


def test_wire_format_error_is_a_value_error():
    assert issubclass(WireFormatError, ValueError)
