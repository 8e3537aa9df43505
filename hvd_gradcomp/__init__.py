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
import importlib.abc
import importlib.util
import sys
import types
import warnings
from importlib import import_module
from typing import Any, List, Optional

__version__ = "0.1.0"

# Public name -> the module that defines it (see docs/ARCHITECTURE.md).
_LAZY = {
    "Auto": "auto.auto",
    "QSGD": "codecs.qsgd", "TopK": "codecs.topk", "TopKQSGD": "codecs.topk", "PowerSGD": "codecs.powersgd",
    "HorovodIntegrationError": "horovod.stock",
    "GradientCompressor": "codecs.compressor", "SparsityWarmup": "codecs.compressor", "Encoded": "codecs.interface",
    "HorovodCompressor": "horovod.classes",   # deprecated, empty: every GradientCompressor serves stock Horovod
    "ResidualStore": "feedback.residuals", "FrozenVariance": "feedback.frozen", "MomentumCorrection": "feedback.momentum",
    "ByteStats": "stats",
    "WireFormatError": "wire.format",
    "DistributedOptimizer": "horovod.optimizer",
    "GradientAccumulator": "horovod.accumulate",
}

__all__ = [*_LAZY, "__version__"]

# Module paths from before the package was laid out by layer -> where the module lives now. Code
# written against them (a codec of your own importing hvd_gradcomp.compressors, say) keeps working,
# with a DeprecationWarning that names the new path. A module split in two maps to both: its old
# path then gets a module holding the names of both.
_KERNELS = ("codecs.kernels", "feedback.kernels")   # the codecs' arithmetic, error feedback's
MOVED = {
    "kernels": _KERNELS, "wire.kernels": _KERNELS,
    "compressors": "codecs.compressor", "compressor_codec": "codecs.interface",
    "compressor_exempt": "codecs.exempt", "compressor_policy": "codecs.binding", "compressor_state": "codecs.steps",
    "qsgd": "codecs.qsgd", "topk": "codecs.topk", "powersgd": "codecs.powersgd",
    "momentum": "feedback.momentum", "frozen": "feedback.frozen", "frozen_warmup": "feedback.frozen_warmup",
    "frozen_scale": "feedback.frozen_scale", "frozen_momentum": "feedback.frozen_momentum",
    "reduce": "collectives.reduce", "rounds": "collectives.rounds", "transport": "collectives.transport",
    "inflight": "collectives.inflight", "exchange": "collectives.exchange", "fused": "collectives.fused",
    "optimizer": "horovod.optimizer", "accumulate": "horovod.accumulate", "policy": "auto.policy",
    "auto_schedule": "auto.schedule", "auto_measure": "auto.measure", "auto_state": "auto.state",
    "ddp_roads": "ddp.exchanges", "ddp_auto": "ddp.auto",
    "codecs.contract": "codecs.interface", "ddp.roads": "ddp.exchanges",   # renamed: one word per concept
}


def _moved(old: str) -> Any:
    """The module ``hvd_gradcomp.<old>`` became, with a DeprecationWarning naming its new path (for a
    module split in two, a new module object holding the names of both)."""
    news = MOVED[old] if isinstance(MOVED[old], tuple) else (MOVED[old],)
    paths = [f"{__name__}.{new}" for new in news]
    warnings.warn(f"{__name__}.{old} moved to {' and '.join(paths)}: import it from there", DeprecationWarning,
                  stacklevel=3)
    if len(paths) == 1:
        return import_module(paths[0])
    merged = types.ModuleType(f"{__name__}.{old}", f"Deprecated: split into {', '.join(paths)}.")
    for path in reversed(paths):   # the first module's names win
        merged.__dict__.update({k: v for k, v in vars(import_module(path)).items() if not k.startswith("__")})
    return merged


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``import hvd_gradcomp.<old>`` of a :data:`MOVED` path: the module at its new path, under both names."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Optional[Any]:
        if not fullname.startswith(__name__ + ".") or fullname[len(__name__) + 1:] not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: Any) -> Any:
        return _moved(spec.name[len(__name__) + 1:])

    def exec_module(self, module: Any) -> None:
        pass   # the module at its new path ran already


if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
    sys.meta_path.append(_MovedModules())


def __getattr__(name: str) -> Any:
    if name in ("ddp", "feedback", "codecs", "wire"):  # subpackages: the DDP hook (no Horovod), the feedback
        # policies, the codec registry and the wire format
        return import_module(f".{name}", __name__)
    if name in MOVED:
        globals()[name] = _moved(name)   # warned once; later look-ups skip this function
        return globals()[name]
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hvd_gradcomp' has no attribute {name!r}")
    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value   # later look-ups skip this function
    return value


def __dir__() -> List[str]:
    return sorted({*globals(), *_LAZY})
