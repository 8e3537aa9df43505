"""Exact byte counts: what went into a compressor and what came out (the number users quote)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List


@dataclass
class ByteStats:
    """Cumulative bytes in and out, in total and per tensor name.

    >>> s = ByteStats(); s.record("w", 400, 10); s.record("w", 400, 10)
    >>> s.bytes_in, s.bytes_out, s.ratio
    (800, 20, 40.0)
    """

    bytes_in: int = 0
    bytes_out: int = 0
    calls: int = 0
    per_tensor: Dict[str, List[int]] = field(default_factory=dict)

    def record(self, name: str, bytes_in: int, bytes_out: int) -> None:
        self.bytes_in += bytes_in
        self.bytes_out += bytes_out
        self.calls += 1
        entry = self.per_tensor.setdefault(name, [0, 0])
        entry[0] += bytes_in
        entry[1] += bytes_out

    @property
    def ratio(self) -> float:
        """bytes_in / bytes_out (how many times smaller the payloads are); 0 before any call."""
        return self.bytes_in / self.bytes_out if self.bytes_out else 0.0

    def reset(self) -> None:
        self.bytes_in = self.bytes_out = self.calls = 0
        self.per_tensor.clear()

    def summary(self) -> str:
        return (f"{self.calls} tensors, {self.bytes_in:,} B in, {self.bytes_out:,} B out, "
                f"ratio {self.ratio:.1f}x")
