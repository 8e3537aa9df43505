"""A compressor written outside the package, against its documented interface only
(docs/ARCHITECTURE.md, "Add a compressor"): random-k sparsification.

Each rank sends k = ceil(ratio * n) coordinates of each tensor, drawn at random (a fresh draw
per tensor, step and rank, from the seed the base class hands ``pack``), with their indices:
a sparse payload in TopK's wire layout, carried by allgather. Error feedback, checkpoints,
byte statistics, the float16 road of small tensors, every exchange road and the Horovod protocol
(stock ``hvd.DistributedOptimizer``) come from
:class:`~hvd_gradcomp.codecs.compressor.GradientCompressor`. Nothing in
``hvd_gradcomp/`` names this class: registering it makes ``HVDGC_COMPRESSION=randomk`` work too.
"""
from __future__ import annotations

import math
from typing import Any, Optional, Tuple

import torch

from hvd_gradcomp import codecs, wire
from hvd_gradcomp.codecs import kernels
from hvd_gradcomp import feedback as fb
from hvd_gradcomp.codecs.compressor import Encoded, GradientCompressor
from hvd_gradcomp.settings import check_ratio


@codecs.register("randomk", settings=("ratio", "error_feedback", "seed"), replace=True)
class RandomK(GradientCompressor):
    """Send ``ceil(ratio * n)`` random coordinates of each tensor, with their indices.

    >>> c = RandomK(ratio=0.1, seed=0)
    >>> payload = c.compress_named("w", torch.arange(100.0))
    >>> idx, vals = c.decode_parts(payload)
    >>> idx.numel(), bool(torch.equal(vals, idx.float()))
    (10, True)
    """

    codec_name = "randomk"
    collective = codecs.ALLGATHER
    kind = wire.KIND_TOPK   # the payload's layout: TopK's (coded indices, then the values)

    def __init__(self, ratio: float = 0.01, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.ratio = check_ratio(ratio)

    def __repr__(self) -> str:
        return f"RandomK(ratio={self.ratio}, error_feedback={self.error_feedback}{self._extra_repr()})"

    def selected(self, numel: int) -> int:
        return min(numel, max(1, math.ceil(self.ratio * numel)))

    def indices(self, numel: int, seed: int, device: torch.device = torch.device("cpu")) -> torch.Tensor:
        """The sorted coordinates sent of an ``numel``-element tensor under ``seed``."""
        g = torch.Generator().manual_seed(seed)
        return torch.randperm(numel, generator=g)[:self.selected(numel)].sort().values.to(device)

    def payload_size(self, shape: Tuple[int, ...], dtype: torch.dtype = torch.float32,
                     index_bytes: Optional[int] = None) -> int:
        if index_bytes is None:
            raise ValueError("sparse payload sizes depend on the index coding: pass index_bytes")
        head = wire.padded(wire.HEADER_BYTES + 8 * len(shape))
        return head + index_bytes + wire.padded(self.selected(math.prod(shape)) * dtype.itemsize)

    def pack(self, flat: torch.Tensor, dtype: torch.dtype, seed: int, contract: bool = False,
                marked: fb.Marked = None) -> Encoded:
        idx = self.indices(flat.numel(), seed, flat.device)
        vals = flat[idx].to(dtype)
        mode, sections = wire.encode_indices(idx, flat.numel())
        return Encoded(idx.numel(), 0, mode, 0, sections + [wire.as_bytes(vals)], (idx, vals))

    def unpack_sparse(self, h: wire.Header, reader: wire.SectionReader) -> Tuple[torch.Tensor, torch.Tensor]:
        idx = wire.decode_indices(reader, h.index_mode, h.k, h.numel, kernels.decode_deltas)
        return idx, wire.from_bytes(reader.take(h.k * h.dtype.itemsize), h.dtype)

    def unpack(self, h: wire.Header, reader: wire.SectionReader) -> torch.Tensor:
        idx, vals = self.unpack_sparse(h, reader)
        out = torch.zeros(h.numel, dtype=h.dtype, device=vals.device)
        out[idx] = vals
        return out


def expected_payload_bytes(comp: RandomK, name: str, shape: Tuple[int, ...], step: int) -> int:
    """The payload of tensor ``name`` at its exchange ``step`` on this rank, computed independently
    of the encoder: the base class's seed rule (seed, stream, name, step), then header + index
    coding + float32 values."""
    import zlib

    seed = zlib.crc32(f"{comp.seed}/{comp.stream}/{name}/{step}".encode())
    n = math.prod(shape)
    _, sections = wire.encode_indices(comp.indices(n, seed), n)
    return comp.payload_size(shape, torch.float32, sum(wire.padded(s.numel()) for s in sections))
