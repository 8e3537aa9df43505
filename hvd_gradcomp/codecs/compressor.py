"""QSGD, TopK and TopK+QSGD: codecs with error feedback and a compact wire format.

Two layers, from low to high (nothing here knows Horovod):

* ``encode(tensor) -> payload`` / ``decode(payload) -> tensor``: the exact bytes that travel
  (see :mod:`hvd_gradcomp.wire`), no state but the random stream.
* ``compress_named(name, grad) -> payload``: the compressor's *feedback policy* around
  ``encode`` (:mod:`hvd_gradcomp.feedback`): e.g. the residual kept for ``name`` is added
  first, and what the payload does not carry becomes the new one. The exchanges hand the
  averaged result back through ``received(name, avg)``.

Horovod's compressor protocol (``compress``/``decompress``) is added on top by
:mod:`hvd_gradcomp.horovod`, whose classes are the ones ``hvd_gradcomp`` exports.

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

import inspect
import math
import re
from dataclasses import dataclass
from typing import Any, Callable, List, NamedTuple, Optional, Tuple, Union

import torch

from .. import codecs
from .. import feedback as fb
from .contract import WireCodec, _check_finite, _check_input
from .exempt import ExemptRoad
from .binding import PolicyBinding
from .steps import StepState
from ..feedback import Feedback
from ..stats import ByteStats
from ..settings import check_ratio
# Defined with the part of GradientCompressor they serve; imported from here by the codecs, the
# roads and codec authors (the codec interface, the tensor-size threshold).
from .contract import Encoded  # noqa: F401
from .exempt import DEFAULT_MIN_COMPRESS_NUMEL  # noqa: F401

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
    (docs/STUDY.md, the 0.1% rows and "Sparsity warm-up at 0.1%"). Which pace: a policy's
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
    """Whether ``compression`` has ``clip=`` set: the roads that can (``hvd_gradcomp.DistributedOptimizer``,
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


class GradientCompressor(WireCodec, ExemptRoad, PolicyBinding, StepState):
    """Base class of the codecs: feedback policy, random stream and byte statistics.

    Arguments shared by every compressor:

    * ``error_feedback``: False is ``feedback="none"``;
    * ``feedback``: ``"auto"`` (chosen from the wrapped optimizer by :meth:`attach`),
      ``"none"``, ``"classic"``, ``"momentum"``, ``"update"``, ``"frozen"`` or a
      :class:`~hvd_gradcomp.feedback.Feedback` instance (see :mod:`hvd_gradcomp.feedback`);
    * ``clip``: local gradient clipping, what ``clip_grad_norm_(model.parameters(), clip)`` means,
      done to each rank's own gradient before anything is compressed: the global L2 norm over
      every tensor of the step (compressed, small and excluded ones) is scaled to at most ``clip``
      (:meth:`clip_local`). ``hvd_gradcomp.DistributedOptimizer`` and the DDP hook then start the
      exchanges once backward is over (the norm needs every gradient); stock
      ``hvd.DistributedOptimizer`` compresses each tensor as its gradient arrives and refuses it;
    * ``exclude``: a regular expression; parameters whose name matches go uncompressed.
    * ``exempt``: how float32 tensors exempt from compression by design travel (fewer elements
      than ``min_compress_numel``, e.g. biases and norms, or matched by ``exclude``):
      ``"fp16"`` (default: as float16, half the bytes, divided by the number of ranks before
      the cast so that the sum cannot overflow, saturated at float16's range, and what the cast
      takes away kept and sent later by error feedback, see
      :class:`~hvd_gradcomp.feedback.HalfPrecision`) or ``"fp32"`` (as they are). float16,
      bfloat16 and float64 gradients always travel as they are, and so do the tensors a feedback
      policy sends dense for a while (``feedback="frozen"``'s warm-up).

    A compressor of your own (see docs/ARCHITECTURE.md, "Add a compressor") subclasses this class,
    declares ``codec_name`` (its registry name, :mod:`hvd_gradcomp.codecs`), ``collective`` (how
    its payload travels: :data:`~hvd_gradcomp.codecs.ALLGATHER` for a sparse payload,
    :data:`~hvd_gradcomp.codecs.COMPRESSED_ALLREDUCE` for a dense quantised one) and ``kind`` (the
    wire layout of its payload, :mod:`hvd_gradcomp.wire`), and implements
    ``pack(flat, dtype, seed, contract, marked) -> Encoded``, ``unpack(header, reader) -> flat
    tensor`` and, for a sparse payload, ``unpack_sparse(header, reader) -> (indices, values)``
    (:mod:`hvd_gradcomp.codecs.contract`, docs/WRITING_A_CODEC.md).
    ``seed`` differs per tensor, step and rank (:meth:`_next_seed`).

    ``checksum``: put a CRC32 of each payload in its header and refuse payloads whose bytes
    changed (True), or not (False). None (default): on for the sparse compressors, where it
    costs under 0.1% of encode time, off for QSGD, whose payloads are a quarter of the
    gradient and where it costs 10-19% (``benchmarks/bench_checksum.py``). A compressor
    that writes checksums also refuses payloads without one: set it alike on every rank.
    Hyperparameters are validated on assignment too (``c.ratio = 0.05`` works, ``c.ratio = 0``
    raises ``ValueError``).

    Here: the feedback policy around the codec (``compress_named``, ``received``). The other parts
    are mixins, one per module: payloads and the codec interface
    (:class:`~hvd_gradcomp.codecs.contract.WireCodec`), which tensors are compressed and the
    float16 road (:class:`~hvd_gradcomp.codecs.exempt.ExemptRoad`), the policy's choice and
    binding to the optimizer (:class:`~hvd_gradcomp.codecs.binding.PolicyBinding`), exchange
    steps, random streams and checkpoints (:class:`~hvd_gradcomp.codecs.steps.StepState`).
    Mixins, not owned objects, because subclasses override their methods and the roads read
    their attributes on the compressor.
    """

    kind: int = 0
    codec_name: str = ""
    collective: str = codecs.ALLGATHER

    def __init__(self, error_feedback: bool = True, seed: Optional[int] = None,
                 feedback: Union[str, Feedback] = "auto", clip: Optional[float] = None,
                 exclude: Optional[str] = None, checksum: Optional[bool] = None, exempt: str = "fp16") -> None:
        if not isinstance(error_feedback, bool):
            raise ValueError(f"error_feedback must be True or False, got {error_feedback!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"seed must be an int or None, got {seed!r}")
        if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float)) or not clip > 0):
            raise ValueError(f"clip must be None or a positive number (the largest global L2 norm of each "
                             f"rank's gradient, as in clip_grad_norm_), got {clip!r}")
        if not error_feedback and feedback not in ("auto", "none"):
            raise ValueError(f"error_feedback=False contradicts feedback={feedback!r}: pass only feedback=")
        if not (isinstance(feedback, Feedback) or feedback == "auto"):
            fb.make(feedback)  # validates the name now, not at the first step
        self.checksum = checksum
        self.exempt = exempt
        self._seed = seed   # None: torch's seed, read at first use (see the seed property)
        self.stream = 0  # set to the rank by hvd_gradcomp.horovod on every road: ranks draw independent noise
        self.clip = clip
        # Set by a road that clips every tensor of a step at once (clip_local) before compressing any:
        # compress() then leaves clipping to it. Unset (a direct compress() call) the one tensor handed
        # is all there is, and is clipped alone.
        self.road_clips = False
        try:
            self.exclude = re.compile(exclude) if exclude is not None else None
        except (re.error, TypeError) as exc:
            raise ValueError(f"exclude must be a regular expression matched against parameter names "
                             f"(e.g. r'embed|norm'), got {exclude!r}: {exc}") from None
        self._step_now, self._name_now = 0, ""  # the tensor being encoded (ratio schedules, min_ratio)
        self.feedback_choice: Union[str, Feedback] = "none" if not error_feedback else feedback
        # Until an optimizer is attached, "auto" means classic error feedback.
        self.feedback = fb.make("classic" if self.feedback_choice == "auto" else self.feedback_choice)
        self._relay = fb.ErrorFeedback()  # re-quantisation in QSGD's compressed allreduce
        self._half = fb.HalfPrecision()   # the float16 road of exempt tensors (see sends_half)
        type(self).check_codec()   # a class never registered is checked (and its layout registered) here
        self._init_binding()
        self.stats = ByteStats()
        self._init_steps()

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
        late = self.clip is None and policy.marks_input and self._selects(name, grad.numel()) is not None
        if not late:
            _check_finite(grad, name)
        return self._compress_finite(name, grad, relay, check=late)

    def _compress_finite(self, name: str, grad: torch.Tensor, relay: bool = False,
                         check: bool = False) -> Tuple[torch.Tensor, Sent]:
        """:meth:`compress_named` for a caller that checked ``grad`` already: a named, dense, finite
        tensor of a dtype the codecs carry (the DDP hook checks a whole bucket in one pass,
        :func:`~hvd_gradcomp.feedback.kernels.all_finite`). ``check``: not checked yet, and the policy
        changes no state in ``prepare`` (:attr:`Feedback.marks_input`): its pass over ``grad``
        also sums it, and the check raises before anything is committed or drawn."""
        prepared = self.prepare_named(name, grad, relay, total=check)
        if check and (prepared.total is None or not bool(torch.isfinite(prepared.total))):
            _check_finite(grad, name)  # exact; a finite sum proved it already
        return self.send_prepared(prepared)

    def prepare_named(self, name: str, grad: torch.Tensor, relay: bool = False, total: bool = False) -> Prepared:
        """The first half of :meth:`_compress_finite`: the policy builds the codec's input (no state
        changes yet when :attr:`Feedback.marks_input`); ``total``: also sum ``grad`` in that pass
        where the policy can. A caller may prepare several tensors, check them all, then
        :meth:`send_prepared` each (the DDP hook: one finiteness verdict per bucket)."""
        policy = self._relay_policy() if relay else self.feedback
        if not relay:
            grad = self.owed_half(name, grad)
        k = self._selects(name, grad.numel())
        if k is None:
            acc, marked = policy.prepare(name, self._clipped(grad)), None
        else:  # a top-k codec: its candidates are marked in the pass that builds acc
            acc, marked = policy.prepare_marked(name, self._clipped(grad), k, total=total)
        return Prepared(name, grad.dtype, tuple(grad.shape), policy, acc, marked)

    def send_prepared(self, prepared: Prepared) -> Tuple[torch.Tensor, Sent]:
        """The second half of :meth:`_compress_finite`: (payload, what it carries, as the policy is
        told: sparse ``(indices, values)`` equal to what a receiver decodes, or the QSGD codes)."""
        p = prepared
        payload, sent = self._encode_flat(p.acc, p.dtype, p.shape, p.name, contract=p.policy.contract,
                                          marked=p.marked)
        p.policy.sent(p.name, p.acc, sent)
        return payload, sent

    def _selects(self, name: str, numel: int) -> Optional[int]:
        """How many entries a top-k codec keeps of tensor ``name`` at its next exchange; None
        for codecs that keep them all."""
        return None

    def _relay_policy(self) -> Feedback:
        return self._relay if self.error_feedback else self.feedback

    @property
    def relay_residuals(self) -> fb.ResidualStore:
        """Residuals of the reduced chunks QSGD's compressed allreduce re-quantises, keyed
        ``"<name>#reduced<rank>"`` (kept apart from :attr:`residuals`, whose policy may differ)."""
        return self._relay_policy().residuals

    def _clipped(self, grad: torch.Tensor) -> torch.Tensor:
        """``grad`` clipped alone (a direct ``compress()`` call, no road); on a road, :meth:`clip_local`
        clipped the whole step already."""
        if self.clip is None or self.road_clips:
            return grad
        norm = float(grad.float().norm())
        return grad if norm <= self.clip else grad * (self.clip / norm)

    def clip_local(self, grads: List[torch.Tensor]) -> Optional[torch.Tensor]:
        """Scale this rank's gradients ``grads``, in place, to a global L2 norm of at most ``clip``, as
        ``clip_grad_norm_`` does; the roads call it with every gradient of the step (compressed, small
        and excluded tensors) before compressing any. Returns the norm before clipping (a tensor: no
        host sync), or None without ``clip``.

        Why the global norm, and every tensor: that is what users mean by clipping. A bound per
        tensor let the total grow with the number of tensors, and tensors too small to compress
        went unclipped: a 2-layer LSTM with SGD lr 20 and ``clip=0.25`` diverged through its
        768-element biases (docs/RECIPES.md, ``lstm``). A NaN or Inf stays non-finite (as with
        ``clip_grad_norm_``), so the step is still skipped on every rank.

        >>> from hvd_gradcomp.codecs.topk import TopKQSGD
        >>> c = TopKQSGD(ratio=0.01, bits=8, clip=1.0)
        >>> a, b = torch.full((4,), 3.0), torch.full((9,), 2.0)    # norms 6 and 6: global 8.49
        >>> round(float(c.clip_local([a, b])), 2), round(float(torch.cat([a, b]).norm()), 4)
        (8.49, 1.0)
        """
        if self.clip is None or not grads:
            return None
        dev = grads[0].device
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32).to(dev)
                                                     for g in grads]))
        coef = torch.clamp(self.clip / (norm + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.device, g.dtype))
        return norm

    def dense_local(self, name: str, grad: torch.Tensor) -> None:
        """``grad``: this rank's own gradient of ``name``, a tensor large enough to compress, where it
        goes uncompressed this step, before the exchange; for the policy (its dense steps, see
        :meth:`hvd_gradcomp.feedback.Feedback.dense_local`). Called by the roads; tensors ``exclude``
        matches never reach the policy (they are never compressed)."""
        if not self._excluded(name):
            self.feedback.dense_local(name, grad)

    def dense_average(self, name: str, avg: torch.Tensor) -> None:
        """``avg``: the average of ``name`` where it went uncompressed (small, excluded, or a dense step
        of its feedback policy), before the user's code between the exchange and the optimizer step
        sees it; for the policy (:meth:`hvd_gradcomp.feedback.Feedback.dense_average`). Called by the roads."""
        self.feedback.dense_average(name, avg)

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
        if self._handed.left > 0 and self._handed_hook is not None and self.carries_held_back:
            self._handed.keep(name, flat, support, self._round)

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
        acc = policy.prepare(name, self._clipped(self.owed_half(name, grad)))
        payloads, sent = [], []
        for i, (b, e) in enumerate(zip(bounds, bounds[1:])):
            payload, what = self._encode_flat(acc[b:e], grad.dtype, (e - b,), f"{name}#{i}", contract=policy.contract)
            payloads.append(payload)
            sent.append((b, e, what))
        policy.sent(name, acc, sent)
        return payloads


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
