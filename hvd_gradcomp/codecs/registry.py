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
  - :data:`ALLREDUCE_ROUNDS`: float32 factors allreduced in dependent rounds (PowerSGD: P, then Q);
  - :data:`SPARSE_ALLREDUCE`: selected (index, value) pairs routed to the rank that owns their
    index region, summed and re-selected there, the owners' selections gathered (Ok-Topk's exchange,
    :mod:`hvd_gradcomp.collectives.sparse_allreduce`): bytes per rank that do not grow with the
    ranks. A top-k codec takes it per instance: ``TopK(..., exchange="allreduce")``.

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

Codecs of other packages are found two ways, so that ``hvdgc-launch --compression NAME`` and
``HVDGC_COMPRESSION=NAME`` reach them without editing this package:

* a Python entry point in the group :data:`ENTRY_POINTS` (``[project.entry-points."hvd_gradcomp.codecs"]
  mycodec = "mypkg.codec:MyCodec"`` in the package's pyproject.toml), registered on first use of
  the registry and imported when built;
* a module that registers its codecs when imported (``@register("mycodec")``), named by
  ``hvdgc-launch --codec-module mypkg.codec`` or ``HVDGC_CODEC_MODULE`` (:func:`load_module`).

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
SPARSE_ALLREDUCE = "sparse_allreduce"
COLLECTIVES = (ALLGATHER, COMPRESSED_ALLREDUCE, ALLREDUCE_ROUNDS, SPARSE_ALLREDUCE)
"""How a compressor's payload travels (a compressor class's ``collective``; a top-k codec's instance may
choose :data:`SPARSE_ALLREDUCE` instead of its class's :data:`ALLGATHER`)."""

SPARSE, DENSE, LOW_RANK = "sparse", "dense", "low-rank"
NATURES = (SPARSE, DENSE, LOW_RANK)
"""What a codec's payload is, declared by a compressor class as ``nature`` (default: its collective's,
:data:`NATURE_OF_COLLECTIVE`): ``feedback="auto"`` chooses by it. ``sparse``: a few coordinates carry
everything, error feedback holds the rest for many steps (AdamW: ``frozen``; momentum SGD: DGC's
correction); ``dense``: every coordinate every step, an unbiased or nearly exact value (``classic``,
``none`` for low-bit QSGD); ``low-rank``: a projection of every matrix (as sparse)."""
NATURE_OF_COLLECTIVE = {ALLGATHER: SPARSE, COMPRESSED_ALLREDUCE: DENSE, ALLREDUCE_ROUNDS: LOW_RANK,
                        SPARSE_ALLREDUCE: SPARSE}

SETTINGS = ("ratio", "bits", "error_feedback", "seed")
"""The settings :func:`build` may pass (the ``HVDGC_*`` ones, see :mod:`hvd_gradcomp.config`)."""

Factory = Union[Callable[..., Any], str]

# name -> (factory, or "module:attribute" imported on first use; the settings it takes, None: by signature)
_REGISTRY: Dict[str, Tuple[Factory, Optional[Tuple[str, ...]]]] = {
    "qsgd": ("hvd_gradcomp.codecs.qsgd:QSGD", ("bits", "error_feedback", "seed")),
    "topk": ("hvd_gradcomp.codecs.topk:TopK", ("ratio", "error_feedback")),
    "topk-qsgd": ("hvd_gradcomp.codecs.topk:TopKQSGD", ("ratio", "bits", "error_feedback", "seed")),
    "powersgd": ("hvd_gradcomp.codecs.powersgd:PowerSGD", ("error_feedback", "seed")),
}
_RESERVED = ("none", "fp16", "auto")   # settings of HVDGC_COMPRESSION that are not compressors

ENTRY_POINTS = "hvd_gradcomp.codecs"
"""The entry-point group other packages declare their codecs in (name = "module:factory")."""
_entry_points_read = False


def register(name: str, factory: Optional[Factory] = None, *, settings: Optional[Sequence[str]] = None,
             replace: bool = False) -> Any:
    """Register ``factory`` under ``name`` (also usable as a decorator: ``@register("mycodec")``).

    ``settings``: which of :data:`SETTINGS` the factory takes (default: those its signature names).
    A name already taken by another factory raises ``ValueError`` unless ``replace=True`` (the same
    factory again, or the one its entry point names, is kept: a codec module that registers itself
    and is declared as an entry point too); so do the reserved names ``none``, ``fp16`` and ``auto``.
    Returns the factory.

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
        if inspect.isclass(fn):
            _check_class(name, fn)
        if name in _REGISTRY and not replace and not _same_factory(_REGISTRY[name][0], fn):
            raise ValueError(f"a compressor named {name!r} is registered already ({_describe(name)}): pass "
                             "replace=True to replace it, or choose another name")
        _REGISTRY[name] = (fn, tuple(settings) if settings is not None else None)
        return fn

    return add if factory is None else add(factory)


def _check_class(name: str, cls: type) -> None:
    """Refuse, when it is registered, a compressor class the exchanges could not carry: its declared
    ``collective`` and ``codec_name`` are what every wrapper reads (see the module docstring)."""
    collective = getattr(cls, "collective", None)
    if collective is not None and collective not in COLLECTIVES:
        raise ValueError(f"{cls.__qualname__}.collective is {collective!r}: declare one of {COLLECTIVES} "
                         "(how the payload travels; see hvd_gradcomp.codecs)")
    nature = getattr(cls, "nature", None)
    if nature is not None and nature not in NATURES:
        raise ValueError(f"{cls.__qualname__}.nature is {nature!r}: declare one of {NATURES} (what feedback='auto' "
                         "chooses by; see hvd_gradcomp.codecs)")
    declared = getattr(cls, "codec_name", None)
    if declared is not None and declared != name:
        raise ValueError(f"{cls.__qualname__}.codec_name is {declared!r} but it is registered as {name!r}: "
                         f"set codec_name = {name!r} in the class (the wrappers and HVDGC_COMPRESSION use it)")
    check = getattr(cls, "check_codec", None)   # the codec's methods and payload layout (codecs/interface.py)
    if callable(check):
        check()


def _same_factory(known: Factory, fn: Factory) -> bool:
    """Whether ``fn`` is the factory registered already, or the one its entry point names (a codec
    module that registers itself and is also declared as an entry point, imported after they were read)."""
    if known is fn:
        return True
    spelled = f"{getattr(fn, '__module__', '')}:{getattr(fn, '__qualname__', '')}"
    return isinstance(known, str) and known.replace(" ", "") == spelled


def _read_entry_points() -> None:
    """Register, once, the codecs other packages declare in :data:`ENTRY_POINTS` (imported when built;
    a name registered already keeps its factory)."""
    global _entry_points_read
    if _entry_points_read:
        return
    _entry_points_read = True
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINTS):
        if ep.name not in _REGISTRY and ep.name not in _RESERVED and ":" in ep.value:
            _REGISTRY[ep.name] = (ep.value, None)


def load_module(module: str) -> None:
    """Import ``module``, whose import registers codecs of its own (``hvdgc-launch --codec-module``,
    ``HVDGC_CODEC_MODULE``); a clear error when it cannot be imported.

    >>> load_module("hvd_gradcomp.codecs.topk")
    >>> load_module("no_such_module_here")
    Traceback (most recent call last):
    ValueError: cannot import the codec module 'no_such_module_here' (No module named 'no_such_module_here'): install it in this environment, or put its folder on PYTHONPATH
    """
    try:
        import_module(module)
    except ImportError as err:
        raise ValueError(f"cannot import the codec module {module!r} ({err}): install it in this environment, "
                         "or put its folder on PYTHONPATH") from None


def unregister(name: str) -> None:
    """Remove ``name`` from the registry (a test's own compressor, say)."""
    _REGISTRY.pop(name, None)


def names() -> Tuple[str, ...]:
    """The registered compressor names, in registration order (entry points' after the built-in ones)."""
    _read_entry_points()
    return tuple(_REGISTRY)


def lookup(name: str) -> Callable[..., Any]:
    """The factory registered under ``name``; ``KeyError`` naming the known ones otherwise."""
    _read_entry_points()
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
    return signature_settings(lookup(name))


def signature_settings(factory: Callable[..., Any]) -> Tuple[str, ...]:
    """Which of :data:`SETTINGS` ``factory`` takes, by its signature. For a class, ``__init__`` along
    its MRO while each passes ``**kwargs`` on (a subclass whose ``__init__(*args, **kwargs)`` hands
    everything to the codec's own); every setting only for a function that takes ``**kwargs`` itself.

    >>> class Codec:
    ...     def __init__(self, ratio=0.01, error_feedback=True): ...
    >>> class Ready(Codec):
    ...     def __init__(self, *args, named_parameters=None, **kwargs): super().__init__(*args, **kwargs)
    >>> signature_settings(Ready), signature_settings(lambda **kw: None)
    (('ratio', 'error_feedback'), ('ratio', 'bits', 'error_feedback', 'seed'))
    """
    inits = [c.__dict__["__init__"] for c in factory.__mro__ if "__init__" in c.__dict__ and c is not object] \
        if inspect.isclass(factory) else [factory]
    taken = set()
    for fn in inits:
        params = inspect.signature(fn).parameters
        taken |= {s for s in SETTINGS if s in params}
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            return tuple(s for s in SETTINGS if s in taken)
    return SETTINGS if not inspect.isclass(factory) else tuple(s for s in SETTINGS if s in taken)


def build(name: str, **settings: Any) -> Any:
    """The compressor ``name`` stands for, given the settings it takes (the others are ignored)."""
    factory = lookup(name)
    taken = accepted_settings(name)
    return factory(**{k: v for k, v in settings.items() if k in taken})


def collective_of(compressor: Any) -> Optional[str]:
    """How ``compressor``'s payload travels (its ``collective``: its class's, or the one its instance
    chose, ``TopK(exchange="allreduce")``); None for something that is not a compressor of this
    library's interface (a Horovod compressor, None)."""
    if isinstance(compressor, type):
        return None
    value = getattr(compressor, "collective", None)
    return value if value in COLLECTIVES else None


def nature_of(compressor: Any) -> Optional[str]:
    """What ``compressor``'s payload is (:data:`NATURES`): its class's ``nature``, else its collective's.

    >>> class Signs:
    ...     collective, nature = ALLGATHER, DENSE      # one sign per value, gathered: dense all the same
    >>> class Sparse:
    ...     collective = ALLGATHER
    >>> nature_of(Signs()), nature_of(Sparse()), nature_of(None)
    ('dense', 'sparse', None)
    """
    declared = getattr(type(compressor), "nature", None)
    return declared if declared in NATURES else NATURE_OF_COLLECTIVE.get(collective_of(compressor))


def name_of(compressor: Any) -> str:
    """``compressor``'s registry name (its class's ``codec_name``), "" when it declares none."""
    return getattr(type(compressor), "codec_name", "") or ""


def _describe(name: str) -> str:
    factory = _REGISTRY[name][0]
    return factory if isinstance(factory, str) else getattr(factory, "__qualname__", repr(factory))
