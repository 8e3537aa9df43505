"""Deprecated: what this module held before every compressor carried Horovod's protocol itself.

``hvd_gradcomp.TopK`` (and ``QSGD``, ``TopKQSGD``, ``PowerSGD``) is the codec's own class,
:class:`hvd_gradcomp.codecs.topk.TopK`: :class:`~hvd_gradcomp.codecs.compressor.GradientCompressor`
provides ``compress``/``decompress``/``bind`` and ``named_parameters=`` (:mod:`hvd_gradcomp.codecs.protocol`),
so one object serves stock ``hvd.DistributedOptimizer``, ``hvd_gradcomp.DistributedOptimizer`` and
the DDP hook. The names below stay importable from here for code (and pickles) that name this module.
"""
from __future__ import annotations

import warnings
from typing import Any

from ..codecs.powersgd import PowerSGD
from ..codecs.qsgd import QSGD
from ..codecs.topk import TopK, TopKQSGD

__all__ = ["HorovodCompressor", "QSGD", "TopK", "TopKQSGD", "PowerSGD"]


class HorovodCompressor:
    """Deprecated, and empty: subclass :class:`~hvd_gradcomp.codecs.compressor.GradientCompressor`
    alone, which provides Horovod's protocol now. A codec written as
    ``class EFSign(HorovodCompressor, GradientCompressor)`` keeps working (this marker adds nothing
    to its MRO but itself) and is warned once, at its definition.

    >>> import warnings
    >>> from hvd_gradcomp.codecs.compressor import GradientCompressor
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     class Old(HorovodCompressor, GradientCompressor):
    ...         codec_name = ""
    >>> caught[0].category.__name__, callable(Old.compress)
    ('DeprecationWarning', True)
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if HorovodCompressor in cls.__bases__:   # the user's own class, not every class built on it
            warnings.warn(f"{cls.__qualname__}: HorovodCompressor is deprecated and does nothing; every "
                          "GradientCompressor provides Horovod's compress/decompress now: subclass "
                          "GradientCompressor alone", DeprecationWarning, stacklevel=2)
