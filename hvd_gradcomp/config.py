"""Run settings handed from ``hvdgc-launch`` to every rank through environment variables.

``hvdgc-launch --compression topk-qsgd --ratio 0.01 --bits 8 --accumulate 8 train.py``
exports the variables below; a training script turns them into objects with::

    from hvd_gradcomp.config import from_env
    cfg = from_env()                      # defaults when nothing is set
    compression = cfg.make_compressor()   # None for "none"
    steps = cfg.accumulate

=====================  ==========================================  =========
variable               meaning                                     default
=====================  ==========================================  =========
HVDGC_COMPRESSION      none | fp16 | qsgd | topk | topk-qsgd       none
HVDGC_RATIO            TopK ratio, in (0, 1]                       0.01
HVDGC_BITS             QSGD bits, 2..8                             8
HVDGC_ACCUMULATE       backward passes per optimizer step, >= 1    1
HVDGC_ERROR_FEEDBACK   1 or 0                                      1
HVDGC_SEED             seed of the stochastic rounding             unset
=====================  ==========================================  =========
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional

COMPRESSIONS = ("none", "fp16", "qsgd", "topk", "topk-qsgd")

ENV_COMPRESSION = "HVDGC_COMPRESSION"
ENV_RATIO = "HVDGC_RATIO"
ENV_BITS = "HVDGC_BITS"
ENV_ACCUMULATE = "HVDGC_ACCUMULATE"
ENV_ERROR_FEEDBACK = "HVDGC_ERROR_FEEDBACK"
ENV_SEED = "HVDGC_SEED"


@dataclass(frozen=True)
class CompressionConfig:
    """What to compress and how often to step; see the module docstring."""

    compression: str = "none"
    ratio: float = 0.01
    bits: int = 8
    accumulate: int = 1
    error_feedback: bool = True
    seed: Optional[int] = None

    def __post_init__(self) -> None:
        if self.compression not in COMPRESSIONS:
            raise ValueError(f"unknown compression {self.compression!r}; choose one of {', '.join(COMPRESSIONS)}")
        if not 0.0 < self.ratio <= 1.0:
            raise ValueError(f"ratio must be in (0, 1], got {self.ratio}")
        if not 2 <= self.bits <= 8:
            raise ValueError(f"bits must be in 2..8, got {self.bits}")
        if self.accumulate < 1:
            raise ValueError(f"accumulate must be >= 1, got {self.accumulate}")

    def make_compressor(self) -> Any:
        """The compressor these settings name (None means: exchange uncompressed).

        >>> CompressionConfig("topk-qsgd", ratio=0.01, bits=8).make_compressor()
        TopKQSGD(ratio=0.01, bits=8, bucket_size=512, error_feedback=True)
        """
        from . import QSGD, TopK, TopKQSGD

        ef = self.error_feedback
        if self.compression == "none":
            return None
        if self.compression == "fp16":
            import horovod.torch as hvd  # only here: the other settings also serve DDP without Horovod
            return hvd.Compression.fp16
        if self.compression == "qsgd":
            return QSGD(bits=self.bits, error_feedback=ef, seed=self.seed)
        if self.compression == "topk":
            return TopK(ratio=self.ratio, error_feedback=ef)
        return TopKQSGD(ratio=self.ratio, bits=self.bits, error_feedback=ef, seed=self.seed)

    def to_env(self) -> dict:
        """The environment variables that reproduce these settings in another process."""
        env = {
            ENV_COMPRESSION: self.compression,
            ENV_RATIO: repr(self.ratio),
            ENV_BITS: str(self.bits),
            ENV_ACCUMULATE: str(self.accumulate),
            ENV_ERROR_FEEDBACK: "1" if self.error_feedback else "0",
        }
        if self.seed is not None:
            env[ENV_SEED] = str(self.seed)
        return env


def _parse(env: Mapping[str, str], key: str, kind: type, default: Any) -> Any:
    raw = env.get(key)
    if raw is None or raw == "":
        return default
    try:
        return kind(raw)
    except ValueError:
        raise ValueError(f"{key}={raw!r} is not a valid {kind.__name__}; unset it or fix it") from None


def from_env(env: Optional[Mapping[str, str]] = None) -> CompressionConfig:
    """Read the ``HVDGC_*`` variables (``os.environ`` by default) into a :class:`CompressionConfig`.

    >>> from_env({"HVDGC_COMPRESSION": "topk", "HVDGC_RATIO": "0.05"}).ratio
    0.05
    """
    env = os.environ if env is None else env
    ef_raw = env.get(ENV_ERROR_FEEDBACK, "1").strip().lower()
    if ef_raw not in ("1", "0", "true", "false", "yes", "no", "on", "off", ""):
        raise ValueError(f"{ENV_ERROR_FEEDBACK}={ef_raw!r}: use 1 or 0")
    fields = {
        "compression": env.get(ENV_COMPRESSION, "none") or "none",
        "ratio": _parse(env, ENV_RATIO, float, 0.01),
        "bits": _parse(env, ENV_BITS, int, 8),
        "accumulate": _parse(env, ENV_ACCUMULATE, int, 1),
        "error_feedback": ef_raw in ("1", "true", "yes", "on", ""),
        "seed": _parse(env, ENV_SEED, int, None),
    }
    try:
        return CompressionConfig(**fields)
    except ValueError as exc:
        # Name the variable, not the field: the user set the variable.
        var = _FIELD_VARS[str(exc).split()[0]] if str(exc).split()[0] in _FIELD_VARS else "HVDGC_*"
        raise ValueError(f"{var}: {exc}") from None


_FIELD_VARS = {"unknown": ENV_COMPRESSION, "ratio": ENV_RATIO, "bits": ENV_BITS, "accumulate": ENV_ACCUMULATE}
