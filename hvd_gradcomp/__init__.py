"""hvd-gradcomp: gradient compression and accumulation for Horovod + PyTorch.

>>> import horovod.torch as hvd                                     # doctest: +SKIP
>>> from hvd_gradcomp import TopKQSGD                               # doctest: +SKIP
>>> opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
...                                compression=TopKQSGD(ratio=0.01, bits=8))  # doctest: +SKIP

Importing the package imports neither torch nor Horovod: each public name is loaded from
its module on first use (PEP 562), so ``hvdgc-launch`` can read :mod:`hvd_gradcomp.config`
without them.

Horovod is an extra (``pip install 'hvd-gradcomp[horovod]'``, see docs/INSTALL.md): the
compressors, the DDP hook (:mod:`hvd_gradcomp.ddp`) and ``hvdgc-launch`` work without it;
:func:`DistributedOptimizer` then raises one ImportError that names the extra.
"""
from importlib import import_module
from typing import Any, List

__version__ = "0.1.0"

# Public name -> the module that defines it (see docs/ARCHITECTURE.md).
_LAZY = {
    "Auto": "auto",
    "QSGD": "horovod", "TopK": "horovod", "TopKQSGD": "horovod", "PowerSGD": "horovod",
    "HorovodIntegrationError": "horovod",
    "GradientCompressor": "codecs.compressor", "SparsityWarmup": "codecs.compressor", "Encoded": "codecs.contract",
    "HorovodCompressor": "horovod",   # a codec of your own serves stock hvd.DistributedOptimizer with it
    "ResidualStore": "feedback", "FrozenVariance": "feedback.frozen", "MomentumCorrection": "feedback.momentum",
    "ByteStats": "stats",
    "WireFormatError": "wire",
    "DistributedOptimizer": "horovod.optimizer",
    "GradientAccumulator": "horovod.accumulate",
}

__all__ = [*_LAZY, "__version__"]


def __getattr__(name: str) -> Any:
    if name in ("ddp", "feedback", "codecs", "wire"):  # subpackages: the DDP hook (no Horovod), the feedback
        # policies, the codec registry and the wire format
        return import_module(f".{name}", __name__)
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hvd_gradcomp' has no attribute {name!r}")
    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value   # later look-ups skip this function
    return value


def __dir__() -> List[str]:
    return sorted({*globals(), *_LAZY})
