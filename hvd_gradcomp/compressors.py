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

    >>> from hvd_gradcomp.topk import TopKQSGD
    >>> c = TopKQSGD(ratio=0.01, bits=8)
    >>> g = torch.randn(1_000_000)
    >>> payload = c.compress_named("fc.weight", g)     # 10,000 values, 8 bits each, + indices
    >>> payload.numel() < g.numel() * 4 / 150
    True
    >>> c.decode(payload).shape
    torch.Size([1000000])
"""
from __future__ import annotations

import math
import os
import re
import warnings
import weakref
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple, Union

import torch

from . import codecs, kernels, wire
from . import feedback as fb
from .feedback import Feedback
from .stats import ByteStats
from .settings import check_ratio

Sent = fb.Sent
DEFAULT_BUCKET = 512
DEFAULT_MIN_COMPRESS_NUMEL = 1024
"""Tensors with fewer elements (biases, norms) go uncompressed on both DistributedOptimizers:
a 1% top-k of a 16-element bias sends one value. Not compressed is not free: the study's
transformer's 3,584 such float32 values are two thirds of its bytes under TopKQSGD(1%, 8)
(``benchmarks/bench_exempt_bytes.py``), hence ``exempt="fp16"``."""
EXEMPT_MODES = ("fp16", "fp32")
"""``exempt=``: how tensors exempt from compression travel (see :class:`GradientCompressor`)."""


@dataclass(frozen=True)
class SparsityWarmup:
    """A ``ratio`` schedule: DGC's sparsity warm-up (Lin et al., 2018). The share sent falls
    geometrically from ``start`` to ``ratio`` over the first ``steps`` exchanges of each tensor
    (optimizer steps), then stays at ``ratio``.

    >>> w = SparsityWarmup(0.01, steps=4)
    >>> [round(w(s), 4) for s in (0, 2, 4, 100)]
    [0.25, 0.05, 0.01, 0.01]
    >>> from hvd_gradcomp.topk import TopKQSGD
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
    lead-in it has, see :class:`~hvd_gradcomp.momentum.MomentumCorrection`).

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

# For this many exchange steps a compressor whose average carries held-back updates (see
# GradientCompressor.carries_held_back) checks that the optimizer steps on the average as it was
# handed over (HandedCheck), on this many sent values per tensor.
HANDED_CHECK_STEPS = 100
HANDED_SAMPLE = 16


class HandedCheck:
    """Whether the user's code scaled, between the exchange and the optimizer's step, the averages a
    compressor whose sent values carry held-back updates handed over
    (:attr:`GradientCompressor.carries_held_back`): ``clip_grad_norm_`` there shrinks every step far
    more than meant (the study's CNN with momentum SGD and ``clip_grad_norm_(1.0)`` on every step
    ended at ~4x uncompressed's held-out loss).

    For :data:`HANDED_CHECK_STEPS` steps the compressor keeps a few nonzero values of each average
    (:meth:`keep`); an optimizer step post-hook compares them with ``p.grad`` (:meth:`check`). One
    factor on all of them that changes from step to step is clipping, said once with the fix
    (``clip=``). Left alone: a power of two (a loss scaler's ``unscale_``, exact in floating point:
    factors are compared by their mantissa), a constant factor (a fixed rescale of every step is a
    different learning rate, which error feedback and momentum correction follow exactly), and
    changes other than one scaling (code adding to the gradients). A warning, not an error: the step
    has been taken, and a threshold that binds only now and then (a safety net) does little harm.
    """

    def __init__(self) -> None:
        self.kept: Dict[str, Tuple[int, torch.Tensor, torch.Tensor]] = {}   # name: (step, indices, values)
        self.left = HANDED_CHECK_STEPS
        self.scaled_steps = 0
        self._first: Optional[float] = None   # the first checked step's mantissa
        self._warned = False

    def __getstate__(self) -> Dict[str, Any]:
        return {**self.__dict__, "kept": {}}   # this step's values only

    def keep(self, name: str, flat: torch.Tensor, support: Optional[torch.Tensor], step: int) -> None:
        """Keep up to :data:`HANDED_SAMPLE` nonzero values of the average ``flat`` handed over at
        exchange ``step`` (at the sent indices ``support`` when given)."""
        idx = support if support is not None else flat.nonzero().view(-1)
        idx = idx[:4 * HANDED_SAMPLE]
        vals = flat[idx]
        nonzero = vals != 0
        self.kept[name] = (step, idx[nonzero][:HANDED_SAMPLE], vals[nonzero][:HANDED_SAMPLE].clone())

    def check(self, comp: "GradientCompressor") -> None:
        """After the optimizer's step: compare what ``comp`` handed over with its parameters' ``p.grad``."""
        kept, self.kept = self.kept, {}
        self.left -= 1
        factor = self._factor(kept, comp)
        if factor is None:
            return   # nothing to compare, or not one scaling of the whole average
        mantissa = 0.5 if abs(factor - 1.0) <= 1e-3 else math.frexp(factor)[0]
        if abs(mantissa - 0.5) > 1e-3:
            self.scaled_steps += 1
        first = self._first = mantissa if self._first is None else self._first
        if abs(mantissa - first) > 1e-3 * first and not self._warned:
            self._warned = True
            warnings.warn(
                f"hvd_gradcomp: the averaged gradients {comp!r} handed to the optimizer were scaled by {factor:.3g} "
                f"before its step, by a factor that changes from step to step (clip_grad_norm_?). Under feedback "
                f"'{comp.feedback.key}' each sent value carries the updates of the steps it was held back, so its norm "
                "is far above a gradient's and clipping it shrinks every step far more than meant (momentum SGD with "
                "clip_grad_norm_(1.0): ~4x uncompressed's held-out loss; docs/PRECISION_AND_CLIPPING.md). Bound each "
                f"rank's gradient before it is compressed instead: {type(comp).__name__}(..., clip=1.0), and do not "
                "clip the averages.", RuntimeWarning, stacklevel=2)

    @staticmethod
    def _factor(kept: Dict[str, Tuple[int, torch.Tensor, torch.Tensor]], comp: "GradientCompressor"
                ) -> Optional[float]:
        """The one factor by which ``p.grad`` differs from the values kept this step; None when none
        were kept or the ratios differ."""
        if comp._binding is None:
            return None
        ratios = []
        for p, name in comp._binding[1].items():
            got = kept.get(name)
            if got is None or got[0] < comp.exchange_step - 1 or got[1].numel() == 0 or p.grad is None \
                    or p.grad.layout is not torch.strided:   # a sparse gradient was not compressed
                continue
            now = p.grad.detach().reshape(-1)[got[1].to(p.grad.device)]
            ratios.append(now.to(torch.float32) / got[2].to(now.device, torch.float32))
        if not ratios:
            return None
        r = torch.cat([x.to(ratios[0].device) for x in ratios])
        lo, hi = torch.stack(r.aminmax()).tolist()   # one read to the host (a device sync on GPU)
        if not (math.isfinite(lo) and math.isfinite(hi)) or lo <= 0 or hi - lo > 1e-3 * hi:
            return None
        return (lo + hi) / 2


@dataclass
class Encoded:
    """What a compressor's ``_encode`` produced: header fields, sections and what was sent.

    ``sent`` is either (indices, values) of a sparse payload or the QSGD codes, subtracted
    from the residual in one pass only when error feedback needs it.
    """

    k: int
    bits: int
    index_mode: int
    bucket_size: int
    sections: List[torch.Tensor]
    sent: Sent



class _Prepared(NamedTuple):
    """A tensor's input to its codec, built by the feedback policy (:meth:`GradientCompressor._prepare`)
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


class GradientCompressor:
    """Base class of the codecs: feedback policy, random stream and byte statistics.

    Arguments shared by every compressor:

    * ``error_feedback``: False is ``feedback="none"``;
    * ``feedback``: ``"auto"`` (chosen from the wrapped optimizer by :meth:`attach`),
      ``"none"``, ``"classic"``, ``"momentum"``, ``"update"``, ``"frozen"`` or a
      :class:`~hvd_gradcomp.feedback.Feedback` instance (see :mod:`hvd_gradcomp.feedback`);
    * ``clip``: local gradient clipping: each rank scales each tensor's gradient to L2 norm
      <= ``clip`` before compression (DGC);
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
    ``_encode(flat, dtype, seed, contract, marked) -> Encoded``, ``_decode(header, reader) -> flat
    tensor`` and, for a sparse payload, ``_decode_sparse(header, reader) -> (indices, values)``.
    ``seed`` differs per tensor, step and rank (:meth:`_next_seed`).

    ``checksum``: put a CRC32 of each payload in its header and refuse payloads whose bytes
    changed (True), or not (False). None (default): on for the sparse compressors, where it
    costs under 0.1% of encode time, off for QSGD, whose payloads are a quarter of the
    gradient and where it costs 10-19% (``benchmarks/bench_checksum.py``). A compressor
    that writes checksums also refuses payloads without one: set it alike on every rank.
    Hyperparameters are validated on assignment too (``c.ratio = 0.05`` works, ``c.ratio = 0``
    raises ``ValueError``).
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
            raise ValueError(f"clip must be None or a positive number (the largest L2 norm of each "
                             f"tensor's local gradient), got {clip!r}")
        if not error_feedback and feedback not in ("auto", "none"):
            raise ValueError(f"error_feedback=False contradicts feedback={feedback!r}: pass only feedback=")
        if not (isinstance(feedback, Feedback) or feedback == "auto"):
            fb.make(feedback)  # validates the name now, not at the first step
        self.checksum = checksum
        self.exempt = exempt
        self.seed = seed if seed is not None else int.from_bytes(os.urandom(4), "little")
        self.stream = 0  # set to the rank by hvd_gradcomp.horovod on every road: ranks draw independent noise
        self.clip = clip
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
        self._attached: Any = None
        self._binding: Optional[Tuple[Any, Dict[Any, str]]] = None   # see bind_groups
        self._groups_bound = 0   # the optimizer's param groups when last bound (see _follow_groups)
        self._rebind_hook: Any = None
        self._handed_hook: Any = None
        self._handed = HandedCheck()
        self.stats = ByteStats()
        self._steps: Dict[str, int] = {}
        self._owner: Optional[weakref.ref] = None
        self._world: Optional[int] = None                  # ranks of the owner's process set
        self._round = 0                                    # exchange steps ended (see end_round)
        self._in_flight: set = set()                       # see exchange_opened
        self._round_ok = True
        self.join_checked = False                          # this step checked hvd.join() (stock road)
        self._undo_steps: Optional[Dict[str, int]] = None  # random streams at the round's start

    @property
    def exempt(self) -> str:
        """How float32 tensors exempt from compression travel: ``"fp16"`` or ``"fp32"`` (see the class)."""
        return self._exempt

    @exempt.setter
    def exempt(self, value: str) -> None:
        if value not in EXEMPT_MODES:
            raise ValueError(f"exempt must be one of {EXEMPT_MODES} (how tensors left uncompressed by size or "
                             f"exclude= travel: float16 with error feedback, or as they are), got {value!r}")
        self._exempt = value

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

    def set_feedback(self, policy: Union[str, Feedback]) -> "GradientCompressor":
        """Choose the feedback policy after construction (as ``feedback=``), before the first
        exchange; returns self.

        >>> from hvd_gradcomp.topk import TopK
        >>> TopK().set_feedback("momentum").feedback.key
        'momentum'
        """
        if self._steps:
            raise ValueError("set the feedback policy before the first exchange: the state of the "
                             f"current one ({self.feedback.key!r}) would be lost")
        policy = policy if isinstance(policy, Feedback) or policy == "auto" else fb.make(policy)
        self.feedback_choice = policy
        self._set_policy(fb.make("classic" if policy == "auto" else policy))
        self._attached = None
        return self

    @property
    def residuals(self) -> fb.ResidualStore:
        """The residuals of the feedback policy (what was not sent yet, per name)."""
        return self.feedback.residuals

    def attach(self, optimizer: Any, names: Dict[Any, str], rank: int = 0) -> None:
        """Bind to the wrapped optimizer: with ``feedback="auto"`` choose the policy from its class
        and settings (:func:`hvd_gradcomp.feedback.choose`) and say so once on rank 0.

        Called by ``hvd_gradcomp.DistributedOptimizer`` and, inside ``hvd.DistributedOptimizer``,
        at the first exchange; ``names`` maps each parameter to its name.
        """
        if self._attached is optimizer:
            return
        self._attached = optimizer
        why = "chosen by the user"
        if self.feedback_choice == "auto" and not self._restored:
            key, why = fb.choose(optimizer, self.collective == codecs.COMPRESSED_ALLREDUCE, self._contracting)
            if key != self.feedback.key:
                self._set_policy(self._auto_policy(key))
        self.bind_groups(optimizer, names)
        if rank == 0:
            fb.announce(f"{self!r} with {type(optimizer).__name__}: feedback '{self.feedback.key}' "
                        f"({self.feedback.describe()}; {why}). Override with feedback='none'|'classic'|"
                        "'momentum'|'update'|'frozen'." + self._caution())

    def bind_groups(self, optimizer: Any, names: Dict[Any, str]) -> None:
        """Bind the feedback policy to each named parameter's param group of ``optimizer`` (the
        policies read the rate, betas, momentum and weight decay there, live), now and again after
        every ``optimizer.load_state_dict()`` and policy change.

        Why again: torch's ``load_state_dict`` replaces the group dicts. A policy still reading the
        old ones kept the rate of before the load for the rest of the run (a resumed run with a
        scheduler stepped at a stale rate, and error feedback rescaled its residuals by it).
        Called by the optimizers and the DDP hook, not by users.
        """
        self._binding = (optimizer, names)
        self._bind_policy()
        if self._rebind_hook is not None:
            self._rebind_hook.remove()
        me = weakref.ref(self)   # the optimizer must not keep alive a compressor it no longer uses

        def rebind(opt: Any) -> None:
            comp = me()
            if comp is not None and comp._binding is not None and comp._binding[0] is opt:
                comp._bind_policy()

        register = getattr(optimizer, "register_load_state_dict_post_hook", None)
        self._rebind_hook = None if register is None else register(rebind)

        def check(opt: Any, args: Any, kwargs: Any) -> None:
            comp = me()
            if comp is not None and comp._handed.kept and comp._binding is not None and comp._binding[0] is opt:
                comp._handed.check(comp)

        if self._handed_hook is not None:
            self._handed_hook.remove()
        register = getattr(optimizer, "register_step_post_hook", None)
        self._handed_hook = None if register is None else register(check)

    def __getstate__(self) -> Dict[str, Any]:
        # The optimizer hooks (see bind_groups) stay with the optimizer they were registered on:
        # a pickled or deep-copied compressor does not carry them (their handles refer to local functions).
        return {**self.__dict__, "_rebind_hook": None, "_handed_hook": None}

    @property
    def policy_settled(self) -> bool:
        """Whether the feedback policy is chosen on a Horovod road: the compressor is attached to the
        wrapped optimizer (``hvd_gradcomp.DistributedOptimizer`` attaches it when built, inside stock
        ``hvd.DistributedOptimizer`` at its first step). The DDP hook chooses in ``register()``."""
        return self._attached is not None

    @property
    def carries_held_back(self) -> bool:
        """Whether each sent value of the average carries the updates of the steps it was held
        back (a sparse compressor under error feedback on gradients or DGC's momentum correction):
        its norm is then far above a gradient's, and ``clip_grad_norm_`` on the average shrinks
        every step far more than meant. False here; see :meth:`TopK.carries_held_back`."""
        return False

    @property
    def scaled_after_exchange(self) -> int:
        """Checked steps whose averages the user's code scaled, other than by a power of two,
        between the exchange and the optimizer's step (see :class:`HandedCheck`)."""
        return self._handed.scaled_steps

    def _follow_groups(self) -> None:
        """Bind the policy to the param groups added to the bound optimizer since it was bound
        (``optimizer.add_param_group`` after wrapping: progressive unfreezing), before a tensor of
        theirs is compressed. Here because every road asks :meth:`compresses` before it compresses
        a tensor; ``hvd_gradcomp.DistributedOptimizer.add_param_group`` binds at once.

        Why: the DDP hook and stock ``hvd.DistributedOptimizer`` do not see the call. Unbound, momentum
        correction ran the new parameters with momentum 0 under SGD(momentum=0.9), and ``"frozen"``
        sent them uncompressed (the DDP hook: parameters outside the optimizer) for good."""
        if self._binding is not None and len(getattr(self._binding[0], "param_groups", ())) != self._groups_bound:
            self._bind_policy()

    def _bind_policy(self) -> None:
        if self._binding is None:
            return
        optimizer, names = self._binding
        self.feedback.share_sent = getattr(self, "share", None)   # a top-k codec's share, for the policy
        self._groups_bound = len(getattr(optimizer, "param_groups", ()))
        for group in getattr(optimizer, "param_groups", []):
            for p in group["params"]:
                if p in names:
                    self.feedback.bind(names[p], group, p, optimizer)

    def _caution(self) -> str:
        """What the user should know about these settings, said with the choice (empty: nothing)."""
        return ""

    def _auto_policy(self, key: str) -> Feedback:
        """The policy ``feedback="auto"`` chose, as this compressor's settings want it (see :meth:`TopK._auto_policy`)."""
        return fb.make(key)

    @property
    def _restored(self) -> bool:
        return getattr(self, "_loaded_policy", False)

    @property
    def _contracting(self) -> bool:
        return False

    def compresses(self, name: str, numel: Optional[int] = None) -> bool:
        """Whether tensor ``name`` (of ``numel`` elements) is compressed; False: ``exclude``
        matches its name, or it has fewer than :data:`DEFAULT_MIN_COMPRESS_NUMEL` elements
        (``hvd_gradcomp.DistributedOptimizer`` takes its ``min_compress_numel`` instead), and it
        goes uncompressed in the dense allreduce; or its feedback policy asks for a dense step
        (:meth:`hvd_gradcomp.feedback.Feedback.dense`).

        >>> from hvd_gradcomp.topk import TopK
        >>> c = TopK(exclude=r"embed|norm")
        >>> c.compresses("tok_embed.weight"), c.compresses("fc.bias", 64), c.compresses("fc.weight", 4096)
        (False, False, True)
        """
        if numel is not None and numel < DEFAULT_MIN_COMPRESS_NUMEL:
            return False
        self._follow_groups()
        if self.feedback.dense(name):  # e.g. feedback="frozen": Adam's dense warm-up
            return False
        return not self._excluded(name)

    def compressible(self, shape: Tuple[int, ...]) -> bool:
        """Whether this codec compresses a tensor of ``shape`` at all (PowerSGD: matrices only); the
        roads send the others uncompressed. True here."""
        return True

    def _excluded(self, name: str) -> bool:
        return self.exclude is not None and self.exclude.search(name) is not None

    def sends_half(self, name: str, dtype: torch.dtype, small: bool) -> bool:
        """Whether tensor ``name``, not compressed, travels as float16 (``exempt="fp16"``): a float32
        gradient exempt by design, ``small`` (under the caller's ``min_compress_numel``) or matched
        by ``exclude``.

        Not the dense steps a feedback policy asks for: ``feedback="frozen"``'s warm-up is there
        for fidelity (exact Adam, whose second moment is then frozen for the rest of the run), so
        it stays float32; it ends after ``warmup`` steps, so it cannot be what the bytes come to.

        >>> from hvd_gradcomp.topk import TopK
        >>> c = TopK(exclude=r"norm")
        >>> c.sends_half("fc.bias", torch.float32, small=True), c.sends_half("norm.weight", torch.float32, False)
        (True, True)
        >>> c.sends_half("fc.weight", torch.float32, False), c.sends_half("fc.bias", torch.bfloat16, True)
        (False, False)
        """
        return self.exempt == "fp16" and dtype == torch.float32 and (small or self._excluded(name))

    def encode_half(self, named: List[Tuple[str, torch.Tensor]], world: int) -> Tuple[torch.Tensor, bool]:
        """The float16 send of tensors :meth:`sends_half` picked, fused: ``(flat float16 tensor,
        finite)`` for a float16 sum over ``world`` ranks, whose result is their average; error
        feedback of the cast per name (:class:`~hvd_gradcomp.feedback.HalfPrecision`)."""
        return self._half.encode(named, world)

    @property
    def half_residuals(self) -> fb.ResidualStore:
        """Residuals of the float16 road (see :meth:`sends_half`), per tensor name."""
        return self._half.residuals

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

    @property
    def checksum(self) -> Optional[bool]:
        """CRC32 in every payload: True, False, or None for this kind's default (see the class)."""
        return self._checksum

    @checksum.setter
    def checksum(self, value: Optional[bool]) -> None:
        if value is not None and not isinstance(value, bool):
            raise ValueError(f"checksum must be True, False or None (default per kind), got {value!r}")
        self._checksum = value

    @property
    def _checksummed(self) -> bool:
        return self.kind != wire.KIND_QSGD if self._checksum is None else self._checksum

    # ------------------------------------------------------------ wire level
    def encode(self, tensor: torch.Tensor, name: str = "") -> torch.Tensor:
        """The payload for ``tensor`` (no error feedback): one 1-D ``torch.uint8`` tensor.

        Each call advances the random stream of ``name``, so repeated calls draw fresh noise.
        """
        _check_input(tensor, name)
        _check_finite(tensor, name)
        return self._encode_flat(tensor.reshape(-1), tensor.dtype, tuple(tensor.shape), name)[0]

    def decode(self, payload: torch.Tensor) -> torch.Tensor:
        """The tensor a payload stands for, in its original shape and dtype.

        Any malformed payload (truncated, corrupted, forged) raises ``WireFormatError``.
        """
        h = self._own_header(payload)
        return self._decode(h, wire.SectionReader(payload, h)).view(h.shape)

    def _own_header(self, payload: torch.Tensor, header: Optional[wire.Header] = None) -> wire.Header:
        h = wire.read_header(payload) if header is None else header
        if h.kind != self.kind:
            raise wire.WireFormatError(f"{type(self).__name__} cannot decode a payload of kind {h.kind}")
        if self._checksummed and not h.checksum:
            raise wire.WireFormatError(f"payload has no CRC32 but this {type(self).__name__} expects one: "
                                       "give every rank the same checksum= setting")
        wire.verify_checksum(payload, h)
        return h

    def decode_parts(self, payload: torch.Tensor, header: Optional[wire.Header] = None
                     ) -> Tuple[Optional[torch.Tensor], torch.Tensor]:
        """(indices, values) of a sparse payload, or (None, flat dense values) of a dense one.

        Summing payloads from many ranks then costs one pass over the output (index_add)
        instead of one dense decode per rank. ``header``: the payload's header when the caller
        already parsed it (each read is a device-to-host copy on GPU).
        """
        sparse = getattr(self, "_decode_sparse", None)
        h = self._own_header(payload, header)
        if sparse is None:
            return None, self._decode(h, wire.SectionReader(payload, h)).reshape(-1)
        return sparse(h, wire.SectionReader(payload, h))

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
        payload. For QSGD, its codes (:class:`~hvd_gradcomp.kernels.QSGDDecoded`).

        >>> from hvd_gradcomp.topk import TopKQSGD
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
        :func:`~hvd_gradcomp.kernels.all_finite`). ``check``: not checked yet, and the policy
        changes no state in ``prepare`` (:attr:`Feedback.marks_input`): its pass over ``grad``
        also sums it, and the check raises before anything is committed or drawn."""
        prepared = self._prepare(name, grad, relay, total=check)
        if check and (prepared.total is None or not bool(torch.isfinite(prepared.total))):
            _check_finite(grad, name)  # exact; a finite sum proved it already
        return self._send(prepared)

    def _prepare(self, name: str, grad: torch.Tensor, relay: bool = False, total: bool = False) -> _Prepared:
        """The first half of :meth:`_compress_finite`: the policy builds the codec's input (no state
        changes yet when :attr:`Feedback.marks_input`); ``total``: also sum ``grad`` in that pass
        where the policy can. A caller may prepare several tensors, check them all, then
        :meth:`_send` each (the DDP hook: one finiteness verdict per bucket)."""
        policy = self._relay_policy() if relay else self.feedback
        k = self._selects(name, grad.numel())
        if k is None:
            acc, marked = policy.prepare(name, self._clipped(grad)), None
        else:  # a top-k codec: its candidates are marked in the pass that builds acc
            acc, marked = policy.prepare_marked(name, self._clipped(grad), k, total=total)
        return _Prepared(name, grad.dtype, tuple(grad.shape), policy, acc, marked)

    def _send(self, prepared: _Prepared) -> Tuple[torch.Tensor, Sent]:
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
        """Local gradient clipping (DGC): each rank scales a tensor's gradient to norm <= clip."""
        if self.clip is None:
            return grad
        norm = float(grad.float().norm())
        return grad if norm <= self.clip else grad * (self.clip / norm)

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
        acc = policy.prepare(name, self._clipped(grad))
        payloads, sent = [], []
        for i, (b, e) in enumerate(zip(bounds, bounds[1:])):
            payload, what = self._encode_flat(acc[b:e], grad.dtype, (e - b,), f"{name}#{i}", contract=policy.contract)
            payloads.append(payload)
            sent.append((b, e, what))
        policy.sent(name, acc, sent)
        return payloads

    def _encode_flat(self, flat: torch.Tensor, dtype: torch.dtype, shape: Tuple[int, ...],
                     name: str, contract: bool = False, marked: fb.Marked = None) -> Tuple[torch.Tensor, Sent]:
        # read before _next_seed counts this exchange: the share of the step being encoded
        self._step_now, self._name_now = self._steps.get(name, 0), name
        enc = self._encode(flat, dtype, self._next_seed(name), contract, marked)
        header = wire.Header(self.kind, dtype, enc.bits, enc.index_mode, shape, flat.numel(), enc.k, 0,
                             enc.bucket_size, self._checksummed)
        payload = wire.assemble(header, enc.sections, flat.device)
        self.stats.record(name, flat.numel() * dtype.itemsize, payload.numel())
        return payload, enc.sent

    def _next_seed(self, name: str) -> int:
        """A 32-bit seed from (seed, stream, name, step): reproducible, distinct per call."""
        step = self._steps.get(name, 0)
        if self._undo_steps is not None:
            self._undo_steps.setdefault(name, step)
        self._steps[name] = step + 1
        return zlib.crc32(f"{self.seed}/{self.stream}/{name}/{step}".encode())

    def payload_size(self, shape: Tuple[int, ...], dtype: torch.dtype = torch.float32,
                     index_bytes: Optional[int] = None) -> int:
        """Bytes of the payload of a ``shape`` tensor (sparse payloads: given ``index_bytes``, their
        index coding's size). A compressor that cannot tell raises ``NotImplementedError``."""
        raise NotImplementedError(f"{type(self).__name__} does not document its payload size")

    @property
    def ef_scale(self) -> float:
        """Factor applied to what is sent under error feedback (1.0: none), for full buckets;
        buckets of fewer values get the (larger) factor of their size. See :func:`qsgd_ef_scale`."""
        return 1.0

    # ------------------------------------------------------------ exchange steps
    def _claim(self, owner: Any, world_size: Optional[int] = None) -> None:
        """Serve ``owner`` (one optimizer) only; called by the optimizers, not by users.

        Residuals and random streams are keyed by parameter name, so two optimizers sharing
        one compressor would mix their residuals. Claiming also makes every exchange step a
        transaction (see :meth:`end_round`). :meth:`attach` (the feedback policy's choice)
        is the other half of binding to an optimizer.
        """
        current = self._owner() if self._owner is not None else None
        if current is not None and current is not owner:
            raise ValueError(
                f"this {type(self).__name__} already compresses the gradients of another optimizer "
                f"({type(current).__name__}); its residuals are keyed by parameter name and would be "
                "mixed. Give each optimizer its own compressor (a new object, or copy.deepcopy(c) "
                "before the first step), or call remove_hooks() on the old optimizer first.")
        self._owner = weakref.ref(owner)
        self._world = world_size
        self._track_rounds()
        if self._undo_steps is None:
            self._undo_steps = {}

    def _track_rounds(self) -> None:
        """Make the residual stores undoable per exchange step once an optimizer is claimed."""
        if self._owner is not None:
            for policy in (self.feedback, self._relay, self._half):
                policy.track_rounds(True)

    def _set_policy(self, policy: Feedback) -> None:
        self.feedback = policy
        self._track_rounds()
        self._bind_policy()   # a policy taken from a checkpoint after attach() needs its groups too

    def detach(self) -> None:
        """Release the compressor from its optimizer (after ``remove_hooks()``)."""
        self.end_round(True)
        self._owner = None

    @property
    def exchange_step(self) -> int:
        """Exchange steps ended so far (it travels in each payload's envelope, see exchange.py)."""
        return self._round

    def end_round(self, ok: bool) -> None:
        """End one exchange step, on every rank alike.

        ``ok=False`` (an averaged gradient of the step was NaN/Inf, so a loss scaler skips
        it): the feedback state (residuals of the policy and of the relay, momentum
        correction's and ``feedback="frozen"``'s velocities) and random streams return to where
        the step began (``frozen`` also left the parameters alone), as if it
        had never run. Not rolled back: the local optimizers of ``feedback="update"``, which
        already applied the step to the parameters (a loss scaler does not fit that policy:
        its local optimizer steps on scaled gradients). Either way the step counter advances:
        the exchange did happen on every rank. A RuntimeWarning says so (each time, or once per
        process under Python's default warning filter).
        """
        self._close_round(ok)
        if not ok:
            # Not an error: a loss scaler (torch.amp.GradScaler) finds the same inf/NaN and skips the
            # step on every rank. Said because without a scaler it would be a silent NaN.
            warnings.warn("hvd_gradcomp: an averaged gradient is not finite (NaN or Inf) this step: the "
                          "compressor's state was kept as before it, and the gradients go to the optimizer as "
                          "they are (a torch.amp.GradScaler skips such a step; without one the parameters become "
                          "NaN). Check the loss and the inputs of this step.", RuntimeWarning, stacklevel=2)

    def _close_round(self, ok: bool) -> None:
        for policy in (self.feedback, self._relay, self._half):
            policy.end_round(ok)
        if not ok and self._undo_steps:
            self._steps.update(self._undo_steps)
        if self._undo_steps is not None:
            self._undo_steps = {}
        self._in_flight.clear()
        self._round_ok = True
        self.join_checked = False
        self._round += 1

    def abandon_round(self) -> None:
        """Undo an unfinished step and restart the step count (elastic reset, checkpoint load)."""
        self._close_round(False)
        self._round = 0

    @property
    def in_step(self) -> bool:
        """Whether exchanges opened by :meth:`exchange_opened` are still in flight."""
        return bool(self._in_flight)

    def exchange_opened(self, name: str) -> None:
        """Step bookkeeping where only single exchanges are seen (inside ``hvd.DistributedOptimizer``).

        A name opened again while still in flight means its step was interrupted (an exception
        went by, an elastic reset): that step is abandoned, see :meth:`abandon_round`.
        """
        if name in self._in_flight:
            self.abandon_round()
        self._in_flight.add(name)

    def exchange_closed(self, name: str, finite: bool) -> None:
        """The exchange of ``name`` finished; the last one of a step ends it (:meth:`end_round`).

        Horovod starts every exchange of a step before it finishes the first, so "none left
        in flight" marks the end of the step on every rank alike.
        """
        self._in_flight.discard(name)
        self._round_ok = self._round_ok and finite
        if not self._in_flight:
            self.end_round(self._round_ok)

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> Dict[str, Any]:
        """Feedback state (residuals, velocities, held rates) and random state: restoring it
        continues the exact same sequence. ``residuals``/``shapes`` are the policy's residuals.

        Also records what the residuals mean (compressor kind and settings, world size), which
        :meth:`load_state_dict` checks.
        """
        state = self.feedback.state_dict()
        return {"compressor": repr(self), "kind": type(self).__name__, "error_feedback": self.error_feedback,
                "world_size": self._world, "seed": self.seed, "stream": self.stream, "steps": dict(self._steps),
                "residuals": state.pop("residuals"), "shapes": state.pop("shapes"),
                "feedback": state, "relay": self._relay.state_dict(), "half": self._half.state_dict()}

    def check_state(self, state: Any) -> None:
        """Raise ``ValueError`` naming every way ``state`` cannot be loaded (:meth:`load_state_dict`
        checks it before changing anything; so does ``GradientAccumulator.load_state_dict``)."""
        _check_compressor_state(self, state)

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; checks everything before changing anything.

        This rank's random stream is kept (each rank draws its own noise). A checkpoint of
        another kind of compressor, another ``error_feedback`` or another world size raises
        ``ValueError`` saying what differs; to restart error feedback from zero instead, load
        the rest of the checkpoint without it (``state["compression"] = None`` for
        :class:`~hvd_gradcomp.GradientAccumulator`).
        """
        self.check_state(state)
        if self._owner is not None and state.get("stream", self.stream) != self.stream:
            warnings.warn(f"compressor state saved by the rank with stream {state['stream']} is loaded "
                          f"on stream {self.stream}: residuals differ per rank, so each rank should load "
                          "its own file (ckpt-rank{hvd.rank()}.pt). Keeping this rank's stream.")
        self.abandon_round()
        self.seed = int(state["seed"])
        self._steps = {str(k): int(v) for k, v in state["steps"].items()}
        extra = dict(state.get("feedback", {"policy": self.feedback.key}))
        policy = extra.get("policy", self.feedback.key)
        if self.feedback_choice == "auto" and policy != self.feedback.key:
            self._set_policy(fb.make(policy))  # "auto" chose it before the checkpoint: keep it
        self._loaded_policy = self.feedback_choice == "auto"
        self.feedback.load_state_dict({**extra, "residuals": state["residuals"], "shapes": state.get("shapes", {})})
        if "relay" in state:
            self._relay.load_state_dict(state["relay"])
        self._half.load_state_dict(state.get("half", {}))

    # ------------------------------------------------------------ to implement
    def _encode(self, flat: torch.Tensor, dtype: torch.dtype, seed: int, contract: bool = False,
                marked: fb.Marked = None) -> Encoded:
        """``marked``: top-k candidates of ``flat`` found while it was built (see
        :meth:`Feedback.prepare_marked`), for the codecs that select."""
        raise NotImplementedError

    def _decode(self, h: wire.Header, reader: wire.SectionReader) -> torch.Tensor:
        raise NotImplementedError


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

    >>> from hvd_gradcomp.topk import TopKQSGD
    >>> refuse_class(TopKQSGD, "DistributedOptimizer")
    Traceback (most recent call last):
    ...
    TypeError: DistributedOptimizer(compression=TopKQSGD) got the class: pass an instance, compression=TopKQSGD(...), e.g. TopKQSGD(ratio=0.01, bits=8)
    """
    if isinstance(compression, type) and compression.__module__.startswith("hvd_gradcomp"):
        name = compression.__name__
        raise TypeError(f"{where}(compression={name}) got the class: pass an instance, compression={name}(...), "
                        "e.g. TopKQSGD(ratio=0.01, bits=8)")


def _compressible(tensor: torch.Tensor) -> bool:
    return (tensor.layout == torch.strided and tensor.is_floating_point() and tensor.dtype in wire.DTYPES
            and tensor.numel() > 0)


def _check_input(tensor: torch.Tensor, name: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor for {name or 'the input'}, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise ValueError(f"tensor {name!r} is sparse ({tensor.layout}), e.g. from nn.Embedding(sparse=True): "
                         "compressors take dense tensors. Build the embedding with sparse=False, or pass "
                         "grad.to_dense() (Horovod's compress() entry point passes sparse tensors through "
                         "uncompressed).")
    if not _compressible(tensor):
        raise ValueError(f"tensor {name!r} of dtype {tensor.dtype} and {tensor.numel()} elements cannot be "
                         f"encoded: supported dtypes are {', '.join(map(str, wire.DTYPES))}, non-empty. "
                         "compress() passes such tensors through unchanged.")


def _check_finite(tensor: torch.Tensor, name: str) -> None:
    if not kernels.all_finite(tensor):
        bad = int((~torch.isfinite(tensor)).sum())
        raise FloatingPointError(
            f"gradient {name!r} has {bad} NaN/Inf values (of {tensor.numel()}); nothing was sent and its "
            "error-feedback residual is unchanged. Lower the learning rate, use gradient clipping or "
            "a loss scaler that skips such steps.")


def _check_compressor_state(comp: GradientCompressor, state: Any) -> None:
    """Raise ValueError naming every way ``state`` cannot be loaded into ``comp``."""
    if not isinstance(state, dict):
        raise ValueError(f"compressor state must be the dict state_dict() returns, got {type(state).__name__}. "
                         "Nothing was changed.")
    missing = [k for k in ("seed", "steps", "residuals") if k not in state]
    if missing:
        raise ValueError(f"compressor state lacks {missing}: not a state_dict() of an hvd_gradcomp compressor. "
                         "Nothing was changed.")
    problems = []
    kind = state.get("kind", type(comp).__name__)
    if kind != type(comp).__name__:
        problems.append(f"it was saved by {state.get('compressor', kind)}, this is {comp!r}")
    if state.get("error_feedback", comp.error_feedback) != comp.error_feedback:
        problems.append(f"error_feedback was {state['error_feedback']}, is {comp.error_feedback}")
    saved_world = state.get("world_size")
    if saved_world is not None and comp._world is not None and saved_world != comp._world:
        problems.append(f"it was saved with {saved_world} ranks, this job has {comp._world} (residuals are "
                        "per rank, and QSGD's per chunk of the ranks)")
    residuals, shapes = state["residuals"], state.get("shapes", {})
    if not isinstance(residuals, dict) or not all(isinstance(r, torch.Tensor) for r in residuals.values()):
        problems.append("'residuals' is not a dict of tensors")
    else:
        bad = [n for n, r in residuals.items() if n in shapes and r.numel() != math.prod(shapes[n][0])]
        if bad:
            problems.append(f"residuals {bad} do not match their recorded shapes")
    saved_policy = state.get("feedback", {}).get("policy", comp.feedback.key) if isinstance(
        state.get("feedback", {}), dict) else None
    if saved_policy is None:
        problems.append("'feedback' is not a dict")
    elif comp.feedback_choice != "auto" and saved_policy != comp.feedback.key:
        problems.append(f"it holds state of feedback policy {saved_policy!r}, this compressor uses "
                        f"{comp.feedback.key!r} (build it with feedback={saved_policy!r})")
    if not isinstance(state["steps"], dict) or not all(isinstance(v, int) for v in state["steps"].values()):
        problems.append("'steps' is not a dict of ints")
    owed = state.get("half", {}).get("residuals") if isinstance(state.get("half", {}), dict) else None
    if owed and comp.exempt != "fp16":
        problems.append(f"it holds the float16 road's residuals of {len(owed)} exempt tensors, this compressor "
                        f"has exempt={comp.exempt!r} and would drop them (build it with exempt='fp16')")
    if problems:
        raise ValueError("cannot load this compressor state: " + "; ".join(problems) + ". Resume with the "
                         "same compressor and number of ranks, or drop the compressor state (error feedback "
                         "then restarts from zero: set state['compression'] = None before "
                         "GradientAccumulator.load_state_dict). Nothing was changed.")


def payload_size(compressor: GradientCompressor, shape: Tuple[int, ...], dtype: torch.dtype = torch.float32,
                 index_bytes: Optional[int] = None) -> int:
    """Documented payload size in bytes (:meth:`GradientCompressor.payload_size`): for QSGD exactly;
    for sparse payloads given the index bytes."""
    return compressor.payload_size(shape, dtype, index_bytes)


def _head_bytes(shape: Tuple[int, ...]) -> int:
    return wire.padded(wire.HEADER_BYTES + 8 * len(shape))
