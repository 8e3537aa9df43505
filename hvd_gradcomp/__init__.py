"""hvd-gradcomp: gradient compression and accumulation for Horovod + PyTorch.

>>> import horovod.torch as hvd                                     # doctest: +SKIP
>>> from hvd_gradcomp import TopKQSGD                               # doctest: +SKIP
>>> opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
...                                compression=TopKQSGD(ratio=0.01, bits=8))  # doctest: +SKIP
"""
from .auto import Auto
from .compressors import QSGD, GradientCompressor, TopK, TopKQSGD
from .feedback import ResidualStore
from .stats import ByteStats
from .wire import WireFormatError

__version__ = "0.1.0"

__all__ = ["Auto", "QSGD", "TopK", "TopKQSGD", "GradientCompressor", "ResidualStore", "ByteStats",
           "WireFormatError", "DistributedOptimizer", "GradientAccumulator", "__version__"]


def __getattr__(name):
    # The Horovod-facing parts import horovod lazily, so the compressors work without it.
    if name == "DistributedOptimizer":
        from .optimizer import DistributedOptimizer
        return DistributedOptimizer
    if name == "GradientAccumulator":
        from .accumulate import GradientAccumulator
        return GradientAccumulator
    raise AttributeError(f"module 'hvd_gradcomp' has no attribute {name!r}")
