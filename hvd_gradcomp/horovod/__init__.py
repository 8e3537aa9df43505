"""Horovod's wrappers: hvd_gradcomp's compressors inside stock ``hvd.DistributedOptimizer``, and
hvd_gradcomp's own optimizer.

The package spans two layers (docs/ARCHITECTURE.md). The adapter, below :mod:`hvd_gradcomp.auto`:

* :mod:`~hvd_gradcomp.horovod.stock`: the one module that knows Horovod's internals
  (:data:`HOROVOD_INTERNALS`): ``compress``/``decompress`` inside stock ``hvd.DistributedOptimizer``,
  finding the parameter from Horovod's frames, :class:`HorovodIntegrationError`. Every compressor's
  ``compress``/``decompress`` call it (:mod:`hvd_gradcomp.codecs.protocol`); it refuses a codec whose
  payload travels in dependent rounds (PowerSGD);
* :mod:`~hvd_gradcomp.horovod.classes`: deprecated names kept importable: ``QSGD``, ``TopK``,
  ``TopKQSGD``, ``PowerSGD`` (the codecs' own classes) and ``HorovodCompressor`` (an empty marker).

The optimizers, above it: :mod:`~hvd_gradcomp.horovod.optimizer` (``gc.DistributedOptimizer``),
:mod:`~hvd_gradcomp.horovod.accumulate` (``GradientAccumulator``) and :mod:`~hvd_gradcomp.horovod.elastic`.
This ``__init__`` re-exports the adapter's names only.
"""
from .stock import (HOROVOD_CHECKED, HOROVOD_INTERNALS, HorovodIntegrationError, UnreadSettingsWarning, HOROVOD_HOW,
                    require_horovod, HorovodCall, StockContext, bind_noise_stream, in_state_broadcast, describe,
                    warn_unread_settings, compressor_of, name_map, find_horovod_call, refuse_closures, compress,
                    DenseContext, decompress, refuse_rounds)
from .classes import HorovodCompressor, QSGD, TopK, TopKQSGD, PowerSGD

__all__ = ["HOROVOD_CHECKED", "HOROVOD_INTERNALS", "HorovodIntegrationError", "UnreadSettingsWarning", "HOROVOD_HOW",
           "require_horovod", "HorovodCall", "StockContext", "bind_noise_stream", "in_state_broadcast", "describe",
           "warn_unread_settings", "compressor_of", "name_map", "find_horovod_call", "refuse_closures", "compress",
           "DenseContext", "decompress", "refuse_rounds", "HorovodCompressor", "QSGD", "TopK", "TopKQSGD", "PowerSGD"]
