"""The DDP hook and the ``HVDGC_*`` settings ``hvdgc-launch`` exports: :func:`compression_from_env`
builds the compression they name, and :func:`register` warns (once, on rank 0) when the script
built something else (:func:`unread_settings_message`).
"""
import warnings
from typing import Any, Dict, Optional

import torch

from .. import codecs, settings
from ..auto import Auto
from .state import DENSE_DTYPES


def compression_from_env(env: Optional[Dict[str, str]] = None) -> Any:
    """The ``compression`` argument the ``HVDGC_*`` settings name (see :mod:`hvd_gradcomp.config`).

    ``hvdgc-launch --launcher torchrun --compression topk-qsgd ... train.py`` exports them;
    ``fp16`` becomes ``torch.float16`` here, since DDP has no Horovod compressor.

    >>> compression_from_env({"HVDGC_COMPRESSION": "qsgd", "HVDGC_BITS": "4"})
    QSGD(bits=4, bucket_size=512, error_feedback=True)
    >>> compression_from_env({"HVDGC_COMPRESSION": "fp16"})
    torch.float16
    """
    from ..config import from_env

    cfg = from_env(env)
    return torch.float16 if cfg.compression == "fp16" else cfg.make_compressor()


_settings_checked = False


def _warn_unread_settings(compression: Any, rank: int) -> None:
    """Once, on rank 0: HVDGC_* settings the script neither read nor matched (see the settings module)."""
    global _settings_checked
    if _settings_checked or rank != 0:
        return
    _settings_checked = True
    message = unread_settings_message(compression)
    if message:
        warnings.warn(message, UserWarning, stacklevel=3)


def unread_settings_message(compression: Any, env: Optional[Dict[str, str]] = None) -> Optional[str]:
    """What :func:`register` warns when ``hvdgc-launch`` set ``HVDGC_*`` but the script built something else.

    >>> print(unread_settings_message(None, {"HVDGC_COMPRESSION": "qsgd"}))  # doctest: +ELLIPSIS
    HVDGC_COMPRESSION=qsgd is set (hvdgc-launch sets them), but this script built hvd_gradcomp.ddp.register(...
    >>> from hvd_gradcomp import TopKQSGD
    >>> unread_settings_message(TopKQSGD(ratio=0.05), {"HVDGC_COMPRESSION": "topk-qsgd", "HVDGC_RATIO": "0.05"})
    """
    if compression is None or compression in DENSE_DTYPES:
        built: Dict[str, Any] = {"compression": "none" if compression is None else "fp16"}
    elif isinstance(compression, Auto):
        sparse = compression.sparse
        built = {"compression": "auto", "ratio": sparse.ratio, "bits": sparse.bits,
                 "error_feedback": sparse.error_feedback, "seed": sparse.seed}
    else:
        built = {"compression": codecs.name_of(compression), "error_feedback": compression.error_feedback, "seed": compression.seed}
        built.update({k: getattr(compression, k) for k in ("ratio", "bits") if hasattr(compression, k)})
    return settings.unread_settings_message(built, env, f"hvd_gradcomp.ddp.register(compression={compression!r})")
