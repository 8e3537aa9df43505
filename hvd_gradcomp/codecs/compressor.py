"""QSGD, TopK and TopK+QSGD: codecs with error feedback and a compact wire format.

Two layers, from low to high (nothing here knows Horovod):

* ``encode(tensor) -> payload`` / ``decode(payload) -> tensor``: the exact bytes that travel
  (see :mod:`hvd_gradcomp.wire`), no state but the random stream.
* ``compress_named(name, grad) -> payload``: the compressor's *feedback policy* around
  ``encode`` (:mod:`hvd_gradcomp.feedback`): e.g. the residual kept for ``name`` is added
  first, and what the payload does not carry becomes the new one. The exchanges hand the
  averaged result back through ``received(name, avg)``.

Horovod's compressor protocol (``compress``/``decompress``, ``bind``) is every compressor's too
(:mod:`hvd_gradcomp.codecs.protocol`, done by the Horovod adapter): the classes here are the ones
``hvd_gradcomp`` exports.

Example::

    >>> from hvd_gradcomp.codecs.topk import TopKQSGD
    >>> c = TopKQSGD(ratio=0.01, bits=8)
    >>> g = torch.randn(1_000_000)
    >>> payload = c.compress_named("fc.weight", g)     # 10,000 values, 8 bits each, + indices
    >>> payload.numel() < g.numel() * 4 / 150
    True
    >>> c.decode(payload).shape
    torch.Size([1000000])
"""
from __future__ import annotations

import functools
import inspect
import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, NamedTuple, Optional, Tuple, Union

import torch

from .. import codecs
from .. import feedback as fb
from .interface import WireCodec, _check_finite, _check_input
from .exempt import DEFAULT_MIN_COMPRESS_NUMEL, Exemption  # noqa: F401  (imported from here too)
from .binding import OptimizerBinding, Policies
from .clipping import Clipping
from .steps import Rounds, StepCounter
from . import protocol, steps
from .. import wire
from ..feedback import Feedback
from ..stats import ByteStats
from ..settings import check_ratio
# Defined with the part of GradientCompressor they serve; imported from here by the codecs, the
# wrappers and codec authors (the codec interface, the tensor-size threshold).
from .interface import Encoded  # noqa: F401

Sent = fb.Sent
DEFAULT_BUCKET = 512


@dataclass(frozen=True)
class SparsityWarmup:
    """A ``ratio`` schedule: DGC's sparsity warm-up (Lin et al., 2018). The share sent falls
    geometrically from ``start`` to ``ratio`` over the first ``steps`` exchanges of each tensor
    (optimizer steps), then stays at ``ratio``.

    >>> w = SparsityWarmup(0.01, steps=4)
    >>> [round(w(s), 4) for s in (0, 2, 4, 100)]
    [0.25, 0.05, 0.01, 0.01]
    >>> from hvd_gradcomp.codecs.topk import TopKQSGD
    >>> TopKQSGD(ratio=SparsityWarmup(0.01, steps=100)).ratio      # the target
    0.01
    """

    ratio: float
    steps: int
    start: float = 0.25

    def __post_init__(self) -> None:
        check_ratio(self.ratio)
        check_ratio(self.start)
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 0:
            raise ValueError(f"SparsityWarmup steps must be an int >= 0, got {self.steps!r}")
        if self.start < self.ratio:
            raise ValueError(f"SparsityWarmup start ({self.start}) must be >= ratio ({self.ratio})")

    def __call__(self, step: int) -> float:
        if step >= self.steps:
            return self.ratio
        return self.start * (self.ratio / self.start) ** (step / self.steps)


Ratio = Union[float, Callable[[int], float]]
NamedParameters = Iterable[Tuple[str, torch.Tensor]]   # model.named_parameters(), for stock Horovod (bind)

WARMUP_PACE_RATIO = 0.01
"""The ratio at which a feedback policy's ``sparsity_warmup`` is its length (see :func:`sparsity_warmup_steps`)."""


def sparsity_warmup_steps(steps: int, ratio: float, pace: str = "same") -> int:
    """How many compressed steps a feedback policy's sparsity warm-up of ``steps`` lasts at ``ratio``:
    ``steps`` at ratios of 1% and above; below, longer. ``pace="same"``: the share sent falls by the
    same factor per step as from 25% to 1% in ``steps`` (about a halving every 21 steps);
    ``pace="sqrt"``: the warm-up lasts ``sqrt(1% / ratio)`` times ``steps``, so the share falls
    more slowly than at 1% (3.2x the steps at 0.1%).

    Why longer: DGC's schedule keeps its pace (4x fewer values per epoch) whatever the target, so a
    smaller ratio takes longer to reach. A fixed 100 steps fell 1.7x faster per step at 0.1% than
    at 1%, and TopKQSGD(0.1%, 8) ended further from uncompressed training on the study's tasks
    (benchmarks/results/STUDY.md, the 0.1% rows and "Sparsity warm-up at 0.1%"). Which pace: a policy's
    :attr:`~hvd_gradcomp.feedback.Feedback.warmup_pace` (momentum correction's warm-up is all the
    lead-in it has, see :class:`~hvd_gradcomp.feedback.momentum.MomentumCorrection`).

    >>> sparsity_warmup_steps(100, 0.01), sparsity_warmup_steps(100, 0.001), sparsity_warmup_steps(100, 0.1)
    (100, 172, 100)
    >>> sparsity_warmup_steps(100, 0.01, "sqrt"), sparsity_warmup_steps(100, 0.001, "sqrt")
    (100, 317)
    """
    if steps == 0 or ratio >= WARMUP_PACE_RATIO:
        return steps
    if pace == "sqrt":
        return math.ceil(steps * math.sqrt(WARMUP_PACE_RATIO / ratio))
    if pace != "same":
        raise ValueError(f"sparsity warm-up pace must be 'same' or 'sqrt', got {pace!r}")
    start = SparsityWarmup.start
    return math.ceil(steps * math.log(start / ratio) / math.log(start / WARMUP_PACE_RATIO))


_ASK = object()   # prepare_named(k=...): not given, ask the codec


class Prepared(NamedTuple):
    """A tensor's input to its codec, built by the feedback policy (:meth:`GradientCompressor.prepare_named`)
    and not yet encoded; ``total``: the sum of its gradient when the policy took it in the same
    pass (finite: the gradient is finite), else None."""

    name: str
    dtype: torch.dtype
    shape: Tuple[int, ...]
    policy: Feedback
    acc: torch.Tensor
    marked: fb.Marked

    @property
    def total(self) -> Optional[torch.Tensor]:
        return None if self.marked is None else self.marked.total


def clips_whole_step(compression: Any) -> bool:
    """Whether ``compression`` has ``clip=`` set: the wrappers that can (``hvd_gradcomp.DistributedOptimizer``,
    the DDP hook) then clip each rank's whole gradient (:meth:`GradientCompressor.clip_local`) before
    any exchange starts."""
    return isinstance(compression, GradientCompressor) and compression.clip is not None


_SHARED_REPR = ("seed", "checksum", "feedback", "clip", "exclude", "exempt")
"""Arguments of :class:`GradientCompressor` that its default ``__repr__`` leaves to ``_extra_repr``
(``feedback``, ``clip``, ``exclude``, ``exempt``, printed when not their defaults) or omits (``seed``,
drawn at random unless given, and ``checksum``), as the built-in codecs' reprs do."""


def _init_arguments(cls: type) -> List[str]:
    """The named arguments of ``cls``'s constructor, in order, followed through ``*args``/``**kwargs``
    to the constructors further up the MRO that take them (each name once)."""
    names: List[str] = []
    for klass in cls.__mro__:
        init = vars(klass).get("__init__")
        if init is None or klass is object:
            continue
        try:
            params = inspect.signature(init).parameters.values()
        except (TypeError, ValueError):
            break
        passes_on = False
        for p in list(params)[1:]:   # past self
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                passes_on = True
            elif p.name not in names:
                names.append(p.name)
        if not passes_on:
            break
    return names


def _holds(obj: Any, name: str) -> bool:
    """Whether ``obj`` keeps ``name`` as an attribute: in its ``__dict__``, or a data descriptor of its
    class (a property, a :class:`~hvd_gradcomp.settings.Checked` setting); not a method or class constant."""
    if name in getattr(obj, "__dict__", {}):
        return True
    attr = inspect.getattr_static(type(obj), name, None)
    return attr is not None and hasattr(type(attr), "__set__")


def settings_repr(codec: "GradientCompressor") -> str:
    """``ClassName(setting=value, ...)``: how a codec prints in log lines, warnings and ``describe``.

    :class:`GradientCompressor`'s default ``__repr__``, so that a codec of one's own need not write
    one (the built-in codecs write theirs): the arguments of its constructor that the instance holds
    as attributes (set in ``__init__``, or a property or checked setting of the class), in the
    constructor's order; an argument it does not store is left out. Through ``**kwargs`` the
    constructors it hands them to are read too, down to GradientCompressor's: ``error_feedback`` is
    printed, the shared ``feedback``, ``clip``, ``exclude`` and ``exempt`` as the built-in codecs
    print them (only when not their defaults), ``seed`` and ``checksum`` not at all.

    >>> from hvd_gradcomp import wire
    >>> class Scaled(GradientCompressor):
    ...     codec_name, kind = "scaled-doc", wire.KIND_TOPK
    ...     def __init__(self, scale=0.5, window=3, **kwargs):
    ...         super().__init__(**kwargs)
    ...         self.scale = scale            # window is not kept: not printed
    ...     def pack(self, *a): ...
    ...     def unpack(self, *a): ...
    >>> Scaled(scale=0.25, window=4, clip=1.0)
    Scaled(scale=0.25, error_feedback=True, clip=1.0)
    """
    shown = []
    for name in _init_arguments(type(codec)):
        if name in _SHARED_REPR or not _holds(codec, name):
            continue
        try:
            value = getattr(codec, name)
        except Exception:   # a property that cannot answer yet (an object half built)
            continue
        shown.append(f"{name}={value!r}")
    try:
        extra = codec._extra_repr()
    except AttributeError:   # the base constructor has not run (yet)
        extra = ""
    return f"{type(codec).__name__}({', '.join(shown)}{extra})"


class PartAttribute:
    """An attribute of a compressor that one of its parts keeps (``part``: the compressor's attribute
    holding it, ``name``: the part's own): read, and set unless ``readonly``, through the compressor,
    the one object the wrappers talk to.

    >>> class Part: size = 3
    >>> class Owner:
    ...     size = PartAttribute("_part", "size", "The part's size.")
    ...     def __init__(self): self._part = Part()
    >>> o = Owner(); o.size = 4; o.size, o._part.size
    (4, 4)
    """

    def __init__(self, part: str, name: str, doc: str = "", readonly: bool = False) -> None:
        self.part, self.name, self.readonly, self.__doc__ = part, name, readonly, doc

    def __get__(self, obj: Any, owner: Optional[type] = None) -> Any:
        return self if obj is None else getattr(getattr(obj, self.part), self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        if self.readonly:
            raise AttributeError(f"{self.name} is read-only")
        setattr(getattr(obj, self.part), self.name, value)


class PartMethod(PartAttribute):
    """A method of a compressor that one of its parts carries out: the part's method ``name``, called
    with the compressor first (the codec whose decisions the part asks), then the caller's arguments."""

    def __get__(self, obj: Any, owner: Optional[type] = None) -> Any:
        return self if obj is None else functools.partial(getattr(getattr(obj, self.part), self.name), obj)


class GradientCompressor(WireCodec):
    """Base class of the codecs: a codec's ``pack``/``unpack`` with its feedback policy, composed of parts.

    Arguments shared by every compressor, each checked and kept by the part it configures:

    * ``error_feedback``: False is ``feedback="none"``; ``feedback``: ``"auto"`` (chosen from the
      wrapped optimizer by :meth:`attach`), ``"none"``, ``"classic"``, ``"momentum"``, ``"update"``,
      ``"frozen"`` or a :class:`~hvd_gradcomp.feedback.Feedback` (:class:`~hvd_gradcomp.codecs.binding.Policies`);
    * ``clip``: each rank's whole gradient clipped before anything is compressed, as
      ``clip_grad_norm_(model.parameters(), clip)`` does (:class:`~hvd_gradcomp.codecs.clipping.Clipping`;
      stock ``hvd.DistributedOptimizer`` refuses it);
    * ``exclude`` (a regular expression of parameter names left uncompressed) and ``exempt`` (``"fp16"``,
      the default, or ``"fp32"``: how float32 tensors exempt by design travel)
      (:class:`~hvd_gradcomp.codecs.exempt.Exemption`);
    * ``seed``: of the rounding noise (:class:`~hvd_gradcomp.codecs.steps.StepCounter`);
    * ``checksum``: a CRC32 in each payload's header (:attr:`~hvd_gradcomp.codecs.interface.WireCodec.checksum`);
    * ``named_parameters``: the model's ``named_parameters()``, for stock ``hvd.DistributedOptimizer``
      (:meth:`bind`), so it never needs Horovod's private parameter table.

    A compressor of your own (see docs/ARCHITECTURE.md, "Add a compressor") subclasses this class,
    declares ``codec_name`` (its registry name, :mod:`hvd_gradcomp.codecs`), ``collective`` (how
    its payload travels: :data:`~hvd_gradcomp.codecs.ALLGATHER` for a sparse payload,
    :data:`~hvd_gradcomp.codecs.COMPRESSED_ALLREDUCE` for a dense quantised one) and ``kind`` (the
    wire layout of its payload, :mod:`hvd_gradcomp.wire`), and implements
    ``pack(flat, dtype, seed, contract, marked) -> Encoded``, ``unpack(header, reader) -> flat
    tensor`` and, for a sparse payload, ``unpack_sparse(header, reader) -> (indices, values)``
    (:class:`~hvd_gradcomp.codecs.interface.WireCodec`, docs/WRITING_A_CODEC.md).
    ``seed`` differs per tensor, step and rank (:meth:`_next_seed`).
    Hyperparameters are validated on assignment too (``c.ratio = 0.05`` works, ``c.ratio = 0``
    raises ``ValueError``).

    Here: the feedback policy around the codec (``compress_named``, ``received``). The rest is parts it
    builds in ``__init__`` and owns, each a small class with its own state, none reading another's:
    the feedback policies (:class:`~hvd_gradcomp.codecs.binding.Policies`: ``feedback=``'s choice, the
    policy and the relay's), the binding to the optimizer (:class:`~hvd_gradcomp.codecs.binding.OptimizerBinding`),
    which tensors are exempt and their float16 cast (:class:`~hvd_gradcomp.codecs.exempt.Exemption`),
    local clipping (:class:`~hvd_gradcomp.codecs.clipping.Clipping`), random streams
    (:class:`~hvd_gradcomp.codecs.steps.StepCounter`) and exchange steps as transactions
    (:class:`~hvd_gradcomp.codecs.steps.Rounds`, which ends a round on every part with round state).
    The compressor is the one object the wrappers talk to: what they call (:data:`WRAPPER_SURFACE`) delegates
    to a part, which asks the codec handed to it for the codec's decisions (the override points of
    :class:`~hvd_gradcomp.codecs.interface.WireCodec`: ``_selects``, ``_auto_policy``, ``carries_held_back``...).
    """

    kind: int = 0
    codec_name: str = ""
    collective: str = codecs.ALLGATHER

    def __init__(self, error_feedback: bool = True, seed: Optional[int] = None,
                 feedback: Union[str, Feedback] = "auto", clip: Optional[float] = None,
                 exclude: Optional[str] = None, checksum: Optional[bool] = None, exempt: str = "fp16",
                 named_parameters: Optional[NamedParameters] = None) -> None:
        # Until an optimizer is attached, "auto" means classic error feedback.
        self._policies = Policies.chosen(error_feedback, feedback)
        self._clipping = Clipping(clip)
        self.checksum = checksum
        self._exemption = Exemption(exclude, exempt)
        self._counter = StepCounter(seed)
        self._step_now, self._name_now = 0, ""  # the tensor being encoded (ratio schedules, min_ratio)
        type(self).check_codec()   # a class never registered is checked (and its layout registered) here
        self._binder = OptimizerBinding()
        self._rounds = Rounds([self._policies, self._exemption, self._counter])   # the parts with round state
        self.stats = ByteStats()
        self._names: Optional[Dict[torch.Tensor, str]] = None   # bind()'s, for stock Horovod
        if named_parameters is not None:
            self.bind(named_parameters)

    # Horovod's compressor protocol, so one object serves stock hvd.DistributedOptimizer too
    # (functions that name the Horovod adapter without importing it: see codecs/protocol.py)
    compress = protocol.compress
    decompress = protocol.decompress
    bind = protocol.bind

    def __repr__(self) -> str:
        return settings_repr(self)   # a codec of one's own need not write one; the built-in ones do

    def _extra_repr(self) -> str:
        extra = ""
        if self.feedback_choice not in ("auto", "none"):
            extra += f", feedback={self.feedback.key!r}"
        if self.clip is not None:
            extra += f", clip={self.clip}"
        if self.exclude is not None:
            extra += f", exclude={self.exclude.pattern!r}"
        if self.exempt != "fp16":
            extra += f", exempt={self.exempt!r}"
        return extra

    # ------------------------------------------------------------ error feedback
    def compress_named(self, name: str, grad: torch.Tensor, relay: bool = False) -> torch.Tensor:
        """Payload for the gradient of tensor ``name``, through the feedback policy.

        Raises ``FloatingPointError`` (feedback state and random stream untouched) when ``grad``
        holds NaN or Inf; the exchanges turn that into a non-finite average on every rank.
        ``relay``: a re-quantisation inside QSGD's compressed allreduce (classic error
        feedback, or none, whatever the policy).
        """
        return self.compress_carried(name, grad, relay)[0]

    def compress_carried(self, name: str, grad: torch.Tensor, relay: bool = False) -> Tuple[torch.Tensor, Sent]:
        """:meth:`compress_named`, and what its payload carries, as the feedback policy was told.

        For a sparse payload (TopK, TopKQSGD) that is its ``(indices, values)``: the same values,
        bit for bit, that :meth:`decode_parts` returns for it (each index once; the order may
        differ), so an exchange sums this rank's own part from them instead of decoding its own
        payload. For QSGD, its codes (:class:`~hvd_gradcomp.codecs.kernels.QSGDDecoded`).

        >>> from hvd_gradcomp.codecs.topk import TopKQSGD
        >>> c = TopKQSGD(ratio=0.01, bits=8)
        >>> payload, (idx, vals) = c.compress_carried("fc.weight", torch.randn(100_000))
        >>> d_idx, d_vals = c.decode_parts(payload)
        >>> order, d_order = idx.argsort(), d_idx.argsort()
        >>> torch.equal(idx[order], d_idx[d_order]), torch.equal(vals[order], d_vals[d_order])
        (True, True)
        """
        _check_input(grad, name)
        if not name:
            raise ValueError("compress_named needs a non-empty tensor name")
        policy = self._relay_policy() if relay else self.feedback
        k = self._selects(name, grad.numel())   # asked once per tensor: prepare_named takes it
        late = self.clip is None and policy.marks_input and k is not None
        if not late:
            _check_finite(grad, name)
        return self._compress_finite(name, grad, relay, check=late, k=k)

    def _compress_finite(self, name: str, grad: torch.Tensor, relay: bool = False,
                         check: bool = False, k: Any = _ASK) -> Tuple[torch.Tensor, Sent]:
        """:meth:`compress_named` for a caller that checked ``grad`` already: a named, dense, finite
        tensor of a dtype the codecs carry (the DDP hook checks a whole bucket in one pass,
        :func:`~hvd_gradcomp.feedback.kernels.all_finite`). ``check``: not checked yet, and the policy
        changes no state in ``prepare`` (:attr:`Feedback.marks_input`): its pass over ``grad``
        also sums it, and the check raises before anything is committed or drawn."""
        prepared = self.prepare_named(name, grad, relay, total=check, k=k)
        if check and (prepared.total is None or not bool(torch.isfinite(prepared.total))):
            _check_finite(grad, name)  # exact; a finite sum proved it already
        return self.send_prepared(prepared)

    def prepare_named(self, name: str, grad: torch.Tensor, relay: bool = False, total: bool = False,
                      k: Any = _ASK) -> Prepared:
        """The first half of :meth:`_compress_finite`: the policy builds the codec's input (no state
        changes yet when :attr:`Feedback.marks_input`); ``total``: also sum ``grad`` in that pass
        where the policy can. A caller may prepare several tensors, check them all, then
        :meth:`send_prepared` each (the DDP hook: one finiteness verdict per bucket)."""
        policy = self._relay_policy() if relay else self.feedback
        if not relay:
            grad = self.owed_half(name, grad)
        if k is _ASK:   # how many values a top-k codec selects (None: not a top-k codec)
            k = self._selects(name, grad.numel())
        if k is None:
            acc, marked = policy.prepare(name, self._clipping.clipped(grad)), None
        else:  # a top-k codec: its candidates are marked in the pass that builds acc
            acc, marked = policy.prepare_marked(name, self._clipping.clipped(grad), k, total=total)
        return Prepared(name, grad.dtype, tuple(grad.shape), policy, acc, marked)

    def send_prepared(self, prepared: Prepared) -> Tuple[torch.Tensor, Sent]:
        """The second half of :meth:`_compress_finite`: (payload, what it carries, as the policy is
        told: sparse ``(indices, values)`` equal to what a receiver decodes, or the QSGD codes)."""
        p = prepared
        payload, sent = self._encode_flat(p.acc, p.dtype, p.shape, p.name, contract=p.policy.contract,
                                          marked=p.marked)
        p.policy.sent(p.name, p.acc, sent)
        return payload, sent

    def received(self, name: str, avg: torch.Tensor, support: Optional[torch.Tensor] = None) -> None:
        """The average of all ranks' payloads for ``name`` (same on every rank), rewritten in place
        by the feedback policy into what the optimizer sees. ``support``: see
        :meth:`hvd_gradcomp.feedback.Feedback.received` (a sparse exchange's sent indices)."""
        flat = avg.view(-1) if avg.is_contiguous() else avg.reshape(-1)
        if support is not None and self.feedback.uses_support:
            self.feedback.received(name, flat, support)
        else:  # a policy of the user's own may predate ``support``
            self.feedback.received(name, flat)
        if flat.data_ptr() != avg.data_ptr():
            avg.copy_(flat.view_as(avg))
        self._binder.keep_handed(self, name, flat, support)

    def compress_chunks(self, name: str, grad: torch.Tensor, bounds: List[int]) -> List[torch.Tensor]:
        """One payload per chunk ``grad[bounds[i]:bounds[i+1]]`` (flattened), with the feedback
        policy on the whole tensor: the chunks of QSGD's compressed allreduce.

        ``bounds`` must cover the tensor and every chunk must be non-empty.
        """
        _check_input(grad, name)
        _check_finite(grad, name)
        return self._compress_chunks_finite(name, grad, bounds)

    def _compress_chunks_finite(self, name: str, grad: torch.Tensor, bounds: List[int]) -> List[torch.Tensor]:
        """:meth:`compress_chunks` for a caller that checked ``grad`` already (see :meth:`_compress_finite`)."""
        if bounds[0] != 0 or bounds[-1] != grad.numel() or any(b >= e for b, e in zip(bounds, bounds[1:])):
            raise ValueError(f"chunk bounds {bounds} do not split {grad.numel()} elements into non-empty chunks")
        policy = self.feedback
        acc = policy.prepare(name, self._clipping.clipped(self.owed_half(name, grad)))
        payloads, sent = [], []
        for i, (b, e) in enumerate(zip(bounds, bounds[1:])):
            payload, what = self._encode_flat(acc[b:e], grad.dtype, (e - b,), f"{name}#{i}", contract=policy.contract)
            payloads.append(payload)
            sent.append((b, e, what))
        policy.sent(name, acc, sent)
        return payloads

    # ------------------------------------------------------------ the codec's payloads
    def encode(self, tensor: torch.Tensor, name: str = "") -> torch.Tensor:
        """The payload for ``tensor`` (no error feedback): one 1-D ``torch.uint8`` tensor.

        Each call advances the random stream of ``name``, so repeated calls draw fresh noise.
        """
        _check_input(tensor, name)
        _check_finite(tensor, name)
        return self._encode_flat(tensor.reshape(-1), tensor.dtype, tuple(tensor.shape), name)[0]

    def _encode_flat(self, flat: torch.Tensor, dtype: torch.dtype, shape: Tuple[int, ...],
                     name: str, contract: bool = False, marked: fb.Marked = None) -> Tuple[torch.Tensor, Sent]:
        # read before _next_seed counts this exchange: the share of the step being encoded
        self._step_now, self._name_now = self._steps.get(name, 0), name
        enc = self.pack(flat, dtype, self._next_seed(name), contract, marked)
        header = wire.Header(self.kind, dtype, enc.bits, enc.index_mode, shape, flat.numel(), enc.k, 0,
                             enc.bucket_size, self._checksummed)
        payload = wire.assemble(header, enc.sections, flat.device)
        return payload, enc.sent

    # ------------------------------------------------------------ checkpoints: assembled from the parts
    state_dict = steps.compressor_state
    shared_state = steps.shared_state
    load_shared_state = steps.load_shared_state
    check_state = steps._check_compressor_state
    load_state_dict = steps.load_state

    # ------------------------------------------------------------ the feedback policy
    @property
    def error_feedback(self) -> bool:
        """Whether anything the payload did not carry is kept (any policy but ``none``)."""
        return self.feedback.key != "none"

    @error_feedback.setter
    def error_feedback(self, on: bool) -> None:
        if not isinstance(on, bool):
            raise ValueError(f"error_feedback must be True or False, got {on!r}")
        if on != self.error_feedback:
            self.feedback_choice = "auto" if on else "none"
            self._set_policy(fb.make("classic" if on else "none"))

    def _set_policy(self, policy: Feedback) -> None:
        self._policies.use(policy)
        self._bind_policy()   # a policy taken from a checkpoint after attach() needs its groups too



WRAPPER_SURFACE = {
    # What the wrappers and their drivers (and users) read, set and call on a compressor, kept by its parts: the compressor is
    # the one object they talk to. Each entry is the part's own attribute or method (PartMethod: called
    # with the compressor, whose decisions the part asks); the parts' docstrings say what they do.
    "seed": PartAttribute("_counter", "seed", "Seed of the rounding noise (:attr:`StepCounter.seed "
                          "<hvd_gradcomp.codecs.steps.StepCounter.seed>`): ``seed=``, or torch's initial seed."),
    "stream": PartAttribute("_counter", "stream", "This rank's random stream (set to the rank by every wrapper)."),
    "_steps": PartAttribute("_counter", "steps"),
    "exchange_step": PartAttribute("_rounds", "round", "Exchange steps ended so far (in each payload's envelope).",
                                   readonly=True),
    "_round": PartAttribute("_rounds", "round"),
    "_world": PartAttribute("_rounds", "world"),
    "join_checked": PartAttribute("_rounds", "join_checked", "This step checked hvd.join() (stock Horovod)."),
    "elastic_synced": PartAttribute("_rounds", "elastic_synced", "hvd.elastic's sync set every rank's step."),
    "in_step": PartAttribute("_rounds", "in_step", "Whether exchanges opened are still in flight.", readonly=True),
    "detach": PartAttribute("_rounds", "detach", ":meth:`Rounds.detach <hvd_gradcomp.codecs.steps.Rounds.detach>`",
                            readonly=True),
    "end_round": PartAttribute("_rounds", "end_round", ":meth:`Rounds.end_round "
                               "<hvd_gradcomp.codecs.steps.Rounds.end_round>`: one exchange step ends, on every "
                               "part with round state.", readonly=True),
    "_close_round": PartAttribute("_rounds", "close", readonly=True),
    "_claim": PartMethod("_rounds", "claim", ":meth:`Rounds.claim <hvd_gradcomp.codecs.steps.Rounds.claim>`: serve "
                         "one optimizer only (called by the optimizers)."),
    "follow_world": PartMethod("_rounds", "follow_world", ":meth:`Rounds.follow_world "
                               "<hvd_gradcomp.codecs.steps.Rounds.follow_world>`: an hvd.elastic reset."),
    "_next_seed": PartAttribute("_counter", "next_seed", readonly=True),
    "_relay_policy": PartAttribute("_policies", "relay_policy", readonly=True),
    "relay_residuals": PartAttribute("_policies", "relay_residuals", "Residuals of the chunks QSGD's compressed "
                                     "allreduce re-quantises, keyed ``<name>#reduced<rank>``.", readonly=True),
    "dense_local": PartMethod("_policies", "dense_local", ":meth:`Policies.dense_local "
                              "<hvd_gradcomp.codecs.binding.Policies.dense_local>` (called by the drivers)"),
    "dense_average": PartAttribute("_policies", "dense_average", ":meth:`Policies.dense_average "
                                   "<hvd_gradcomp.codecs.binding.Policies.dense_average>` (called by the drivers)",
                                   readonly=True),
    "_bind_policy": PartMethod("_binder", "bind_codec"),
    "_check_handed": PartMethod("_binder", "check_handed"),
    "abandon_round": PartAttribute("_rounds", "abandon_round", ":meth:`Rounds.abandon_round "
                                   "<hvd_gradcomp.codecs.steps.Rounds.abandon_round>`", readonly=True),
    "exchange_opened": PartAttribute("_rounds", "exchange_opened", ":meth:`Rounds.exchange_opened "
                                     "<hvd_gradcomp.codecs.steps.Rounds.exchange_opened>`", readonly=True),
    "exchange_closed": PartAttribute("_rounds", "exchange_closed", ":meth:`Rounds.exchange_closed "
                                     "<hvd_gradcomp.codecs.steps.Rounds.exchange_closed>`", readonly=True),
    "feedback": PartAttribute("_policies", "policy", "The feedback policy run now (:mod:`hvd_gradcomp.feedback`).",
                              readonly=True),
    "feedback_choice": PartAttribute("_policies", "choice", "``feedback=`` as given (``\"auto\"``: chosen by attach)."),
    "_relay": PartAttribute("_policies", "relay", readonly=True),
    "_loaded_policy": PartAttribute("_policies", "restored"),
    "_restored": PartAttribute("_policies", "restored", readonly=True),
    "_binding": PartAttribute("_binder", "bound", readonly=True),
    "clip": PartAttribute("_clipping", "clip", "``clip=``: see :class:`~hvd_gradcomp.codecs.clipping.Clipping`."),
    "whole_step_clipped": PartAttribute("_clipping", "whole_step_clipped", "Set by a wrapper that clips the "
                                        "whole step (clip_local)."),
    "clip_local": PartAttribute("_clipping", "local", ":meth:`Clipping.local "
                                "<hvd_gradcomp.codecs.clipping.Clipping.local>`: the wrappers' clip of a whole step.",
                                readonly=True),
    "exempt": PartAttribute("_exemption", "mode", "How float32 tensors exempt from compression travel: "
                            "``\"fp16\"`` or ``\"fp32\"``."),
    "exclude": PartAttribute("_exemption", "exclude", "``exclude=``, compiled (None: none)."),
    "_half": PartAttribute("_exemption", "half", readonly=True),
    "half_residuals": PartAttribute("_exemption", "residuals", "Residuals of the float16 cast, per tensor name.",
                                    readonly=True),
    "owed_half": PartAttribute("_exemption", "owed", ":meth:`Exemption.owed <hvd_gradcomp.codecs.exempt.Exemption"
                               ".owed>`: ``grad`` plus what the float16 cast owes ``name``.", readonly=True),
    "encode_half": PartAttribute("_exemption", "encode", "The float16 send of the tensors :meth:`sends_half` "
                                 "picked, fused: ``(flat float16 tensor, finite)``.", readonly=True),
    "_excluded": PartAttribute("_exemption", "excluded", readonly=True),
    "compresses": PartMethod("_exemption", "compresses", ":meth:`Exemption.compresses "
                             "<hvd_gradcomp.codecs.exempt.Exemption.compresses>`: whether ``name`` is compressed."),
    "sends_half": PartMethod("_exemption", "sends_half", ":meth:`Exemption.sends_half "
                             "<hvd_gradcomp.codecs.exempt.Exemption.sends_half>`: whether ``name`` travels as float16."),
    "residuals": PartAttribute("_policies", "residuals", "The residuals of the feedback policy, per name.",
                               readonly=True),
    "attach": PartMethod("_binder", "attach", ":meth:`OptimizerBinding.attach "
                         "<hvd_gradcomp.codecs.binding.OptimizerBinding.attach>`: bind to the wrapped optimizer."),
    "bind_groups": PartMethod("_binder", "bind", ":meth:`OptimizerBinding.bind "
                              "<hvd_gradcomp.codecs.binding.OptimizerBinding.bind>`: bind the policy to the groups."),
    "set_feedback": PartMethod("_binder", "set_feedback", ":meth:`OptimizerBinding.set_feedback "
                               "<hvd_gradcomp.codecs.binding.OptimizerBinding.set_feedback>`; returns the compressor."),
    "_follow_groups": PartMethod("_binder", "follow_groups"),
    "policy_settled": PartAttribute("_binder", "settled", "Whether the feedback policy is chosen (attached).",
                                    readonly=True),
    "scaled_after_exchange": PartAttribute("_binder", "scaled_steps", "Checked steps whose averages were scaled "
                                           "after the exchange (:class:`~hvd_gradcomp.codecs.binding.HandedCheck`).",
                                           readonly=True),
}
for _name, _attr in WRAPPER_SURFACE.items():
    setattr(GradientCompressor, _name, _attr)


# ---------------------------------------------------------------- helpers
def qsgd_ef_scale(bits: int, bucket_size: int) -> float:
    """Scale of QSGD payloads under error feedback: 1/(1+w) when w >= 1, else 1.

    QSGD is unbiased with variance E||Q(v)-v||^2 <= w ||v||^2, w = min(d/s^2, sqrt(d)/s)
    (Alistarh et al., Lemma 3.1; d = bucket size, s = 2**(bits-1) - 1). Error feedback is
    stable only when what is left behind is smaller than what came in: w < 1. At 8 bits
    with 512-value buckets w = 0.03 and nothing changes; at 4 bits w = 3.2 and at 2 bits
    w = 22.6, where the residual would grow without bound. Scaling by 1/(1+w) makes the
    compressor a contraction (Stich & Karimireddy, 2019), so the residual stays bounded;
    what is not sent stays in the residual and goes out in later steps.

    >>> qsgd_ef_scale(8, 512), round(qsgd_ef_scale(4, 512), 3)
    (1.0, 0.236)
    """
    w = qsgd_variance_bound(bits, bucket_size)
    return 1.0 if w < 1.0 else 1.0 / (1.0 + w)




def qsgd_variance_bound(bits: int, bucket_size: int) -> float:
    """QSGD's w in E||Q(v)-v||^2 <= w ||v||^2: min(d/s^2, sqrt(d)/s), d the bucket size,
    s = 2**(bits-1) - 1 levels (Alistarh et al., Lemma 3.1).

    >>> round(qsgd_variance_bound(4, 512), 1), round(qsgd_variance_bound(2, 512), 1)
    (3.2, 22.6)
    """
    s = (1 << (bits - 1)) - 1
    return min(bucket_size / s**2, math.sqrt(bucket_size) / s)


def refuse_class(compression: Any, where: str) -> None:
    """Refuse an hvd_gradcomp compressor class where an instance belongs: the optimizer wrapper and the
    DDP hook call it when built, instead of failing at the first step on a method called without ``self``.

    >>> from hvd_gradcomp.codecs.topk import TopKQSGD
    >>> refuse_class(TopKQSGD, "DistributedOptimizer")
    Traceback (most recent call last):
    ...
    TypeError: DistributedOptimizer(compression=TopKQSGD) got the class: pass an instance, compression=TopKQSGD(...), e.g. TopKQSGD(ratio=0.01, bits=8)
    """
    if isinstance(compression, type) and compression.__module__.startswith("hvd_gradcomp"):
        name = compression.__name__
        raise TypeError(f"{where}(compression={name}) got the class: pass an instance, compression={name}(...), "
                        "e.g. TopKQSGD(ratio=0.01, bits=8)")


def payload_size(compressor: GradientCompressor, shape: Tuple[int, ...], dtype: torch.dtype = torch.float32,
                 index_bytes: Optional[int] = None) -> int:
    """Documented payload size in bytes (:meth:`GradientCompressor.payload_size`): for QSGD exactly;
    for sparse payloads given the index bytes."""
    return compressor.payload_size(shape, dtype, index_bytes)
