"""What a compressor sends and by which collective, and the registry of compressors by name.

Every compressor class declares two class attributes; the exchanges, the DDP hook, the
launcher's settings and the byte statistics read them instead of asking which class it is:

* ``codec_name``: its name in the registry and in ``HVDGC_COMPRESSION`` (``"topk"``,
  ``"qsgd"``, ``"topk-qsgd"``, ``"powersgd"``, or one of your own);
* ``collective``: how its payload travels, one of :data:`COLLECTIVES`:

  - :data:`ALLGATHER`: a payload per rank (sparse: indices and values) that every rank
    decodes in rank order and averages (TopK, TopKQSGD, a random-k of your own);
  - :data:`COMPRESSED_ALLREDUCE`: a dense quantised payload, reduced chunk by chunk (alltoall
    of chunks, each rank sums and re-quantises its chunk, allgather): QSGD;
  - :data:`ALLREDUCE_ROUNDS`: float32 factors allreduced in dependent rounds (PowerSGD: P, then Q).

The registry maps a name to a factory (a class, or any callable returning a compressor) that
takes the launcher's settings as keyword arguments (``ratio``, ``bits``, ``error_feedback``,
``seed``: those its signature accepts are passed). A factory may also be given as
``"module:attribute"``, imported on first use: that is how the built-in compressors are listed
here without importing torch.

>>> names()[:3]
('qsgd', 'topk', 'topk-qsgd')
>>> @register("mine", settings=("ratio",))
... def make_mine(ratio=0.01):
...     return ("a compressor of ratio", ratio)
>>> build("mine", ratio=0.5, bits=4)
('a compressor of ratio', 0.5)
>>> unregister("mine")

This module imports nothing heavy (no torch, no Horovod): :mod:`hvd_gradcomp.config` and the
launcher read it.
"""
from __future__ import annotations

import inspect
from importlib import import_module
from typing import Any, Callable, Dict, Optional, Sequence, Tuple, Union

ALLGATHER = "allgather"
COMPRESSED_ALLREDUCE = "compressed_allreduce"
ALLREDUCE_ROUNDS = "allreduce_rounds"
COLLECTIVES = (ALLGATHER, COMPRESSED_ALLREDUCE, ALLREDUCE_ROUNDS)
"""How a compressor's payload travels (a compressor class's ``collective``)."""

SETTINGS = ("ratio", "bits", "error_feedback", "seed")
"""The settings :func:`build` may pass (the ``HVDGC_*`` ones, see :mod:`hvd_gradcomp.config`)."""

Factory = Union[Callable[..., Any], str]

# name -> (factory, or "module:attribute" imported on first use; the settings it takes, None: by signature)
_REGISTRY: Dict[str, Tuple[Factory, Optional[Tuple[str, ...]]]] = {
    "qsgd": ("hvd_gradcomp.horovod:QSGD", ("bits", "error_feedback", "seed")),
    "topk": ("hvd_gradcomp.horovod:TopK", ("ratio", "error_feedback")),
    "topk-qsgd": ("hvd_gradcomp.horovod:TopKQSGD", ("ratio", "bits", "error_feedback", "seed")),
    "powersgd": ("hvd_gradcomp.horovod:PowerSGD", ("error_feedback", "seed")),
}
_RESERVED = ("none", "fp16", "auto")   # settings of HVDGC_COMPRESSION that are not compressors


def register(name: str, factory: Optional[Factory] = None, *, settings: Optional[Sequence[str]] = None,
             replace: bool = False) -> Any:
    """Register ``factory`` under ``name`` (also usable as a decorator: ``@register("mycodec")``).

    ``settings``: which of :data:`SETTINGS` the factory takes (default: those its signature names).
    A name already taken raises ``ValueError`` unless ``replace=True``; so do the reserved names
    ``none``, ``fp16`` and ``auto``. Returns the factory.

    Example::

        import hvd_gradcomp.codecs as codecs

        @codecs.register("mycodec")
        class MyCodec(GradientCompressor):
            codec_name, collective = "mycodec", codecs.ALLGATHER
            ...

        codecs.build("mycodec", ratio=0.01)   # what HVDGC_COMPRESSION=mycodec builds
    """
    if not isinstance(name, str) or not name or name != name.strip().lower():
        raise ValueError(f"a compressor's name must be a non-empty lower-case string, got {name!r}")
    if name in _RESERVED:
        raise ValueError(f"{name!r} is a setting of HVDGC_COMPRESSION, not a compressor name: choose another")
    unknown = sorted(set(settings or ()) - set(SETTINGS))
    if unknown:
        raise ValueError(f"settings {unknown} are not among {SETTINGS}")

    def add(fn: Factory) -> Factory:
        if not (callable(fn) or (isinstance(fn, str) and ":" in fn)):
            raise ValueError(f"factory must be callable or 'module:attribute', got {fn!r}")
        if name in _REGISTRY and not replace:
            raise ValueError(f"a compressor named {name!r} is registered already ({_describe(name)}): pass "
                             "replace=True to replace it, or choose another name")
        _REGISTRY[name] = (fn, tuple(settings) if settings is not None else None)
        return fn

    return add if factory is None else add(factory)


def unregister(name: str) -> None:
    """Remove ``name`` from the registry (a test's own compressor, say)."""
    _REGISTRY.pop(name, None)


def names() -> Tuple[str, ...]:
    """The registered compressor names, in registration order."""
    return tuple(_REGISTRY)


def lookup(name: str) -> Callable[..., Any]:
    """The factory registered under ``name``; ``KeyError`` naming the known ones otherwise."""
    entry = _REGISTRY.get(name)
    if entry is None:
        raise KeyError(f"no compressor named {name!r}; registered: {', '.join(names())}")
    factory = entry[0]
    if isinstance(factory, str):
        module, attr = factory.split(":")
        factory = getattr(import_module(module), attr)
    return factory


def accepted_settings(name: str) -> Tuple[str, ...]:
    """Which of :data:`SETTINGS` the factory of ``name`` takes."""
    declared = _REGISTRY[name][1] if name in _REGISTRY else None
    if declared is not None:
        return declared
    params = inspect.signature(lookup(name)).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return SETTINGS
    return tuple(s for s in SETTINGS if s in params)


def build(name: str, **settings: Any) -> Any:
    """The compressor ``name`` stands for, given the settings it takes (the others are ignored)."""
    factory = lookup(name)
    taken = accepted_settings(name)
    return factory(**{k: v for k, v in settings.items() if k in taken})


def collective_of(compressor: Any) -> Optional[str]:
    """How ``compressor``'s payload travels (its class's ``collective``); None for something that
    is not a compressor of this library's interface (a Horovod compressor, None)."""
    value = getattr(type(compressor), "collective", None)
    return value if value in COLLECTIVES else None


def name_of(compressor: Any) -> str:
    """``compressor``'s registry name (its class's ``codec_name``), "" when it declares none."""
    return getattr(type(compressor), "codec_name", "") or ""


def _describe(name: str) -> str:
    factory = _REGISTRY[name][0]
    return factory if isinstance(factory, str) else getattr(factory, "__qualname__", repr(factory))
