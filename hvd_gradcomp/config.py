"""Run settings handed from ``hvdgc-launch`` to every rank through environment variables.

``hvdgc-launch --compression topk-qsgd --ratio 0.01 --bits 8 --accumulate 8 train.py``
exports the variables below, those of the options given only (a variable left unset reads as
its default); a training script turns them into objects with::

    from hvd_gradcomp.config import from_env
    cfg = from_env()                      # defaults when nothing is set
    compression = cfg.make_compressor()   # None for "none"
    steps = cfg.accumulate

Every variable the library or the launcher reads (:data:`VARIABLES` holds the same table):

====================  =======================================================  =======  =====================
variable              meaning                                                  default  read by
====================  =======================================================  =======  =====================
HVDGC_COMPRESSION     none | fp16 | qsgd | topk | topk-qsgd | powersgd | auto  none     the script (from_env)
HVDGC_RATIO           TopK ratio, in (0, 1]                                    0.01     the script (from_env)
HVDGC_BITS            QSGD bits, 2..8                                          8        the script (from_env)
HVDGC_ACCUMULATE      backward passes per optimizer step, >= 1                 1        the script (from_env)
HVDGC_ERROR_FEEDBACK  1 or 0                                                   1        the script (from_env)
HVDGC_SEED            seed of the stochastic rounding                          unset    the script (from_env)
HVDGC_COMPILE         torch.compile the kernels: auto | 0 | 1                  auto     the library (kernels)
HVDGC_CODEC_MODULE    a module to import: it registers codecs of its own       unset    the library (from_env)
====================  =======================================================  =======  =====================

The first six are the script's to read: a script that never calls :func:`from_env` would
ignore them. So when they are set, the script has not read them, and it builds an optimizer
or compressor whose settings differ, the library says so once, on rank 0
(:func:`hvd_gradcomp.settings.unread_settings_message`, emitted by :mod:`hvd_gradcomp.horovod`); it
never applies them behind the script's back. Values are checked by :mod:`hvd_gradcomp.settings`, as
the compressors check their arguments. This module imports neither torch nor Horovod.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from . import codecs, settings
from .settings import (COMPRESSIONS, ENV_ACCUMULATE, ENV_BITS, ENV_COMPILE, ENV_COMPRESSION,  # noqa: F401
                       ENV_ERROR_FEEDBACK, ENV_RATIO, ENV_SEED, VARIABLES)


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
        settings.check_settings(self.compression, self.ratio, self.bits, self.accumulate)

    def make_compressor(self) -> Any:
        """The compressor these settings name (None means: exchange uncompressed).

        >>> CompressionConfig("topk-qsgd", ratio=0.01, bits=8).make_compressor()
        TopKQSGD(ratio=0.01, bits=8, bucket_size=512, error_feedback=True)
        """
        ef = self.error_feedback
        if self.compression == "none":
            return None
        if self.compression == "fp16":
            from .horovod import require_horovod  # only here: the other settings also serve DDP without Horovod
            return require_horovod("compression 'fp16'").Compression.fp16
        if self.compression == "auto":   # ratio and bits are TopKQSGD's on Auto's sparse road
            from . import Auto
            return Auto(ratio=self.ratio, bits=self.bits, error_feedback=ef, seed=self.seed)
        # a compressor from the registry (hvd_gradcomp.codecs), given the settings it takes
        return codecs.build(self.compression, ratio=self.ratio, bits=self.bits, error_feedback=ef, seed=self.seed)

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


def from_env(env: Optional[Mapping[str, str]] = None) -> CompressionConfig:
    """Read the ``HVDGC_*`` variables (``os.environ`` by default) into a :class:`CompressionConfig`.

    Reading ``os.environ`` tells the library that the script owns the settings (no
    "settings have no effect" warning, see the module docstring).

    >>> from_env({"HVDGC_COMPRESSION": "topk", "HVDGC_RATIO": "0.05"}).ratio
    0.05
    """
    if env is None:
        settings.mark_read()
    return CompressionConfig(**settings.parse_env(os.environ if env is None else env))
