"""The one module that knows Horovod's internals: the compressors inside ``hvd.DistributedOptimizer``
(``compress``/``decompress``, which every compressor calls: :mod:`hvd_gradcomp.codecs.protocol`).

Stock Horovod calls ``compression.compress(grad)`` with no parameter name, allreduces what
comes back, then ``p.grad.set_(decompress(result, ctx))``. An allreduce of packed levels or
sparse indices would be meaningless, so the payload takes another path:

1. ``compress`` finds which parameter the gradient belongs to (the names bound with
   ``named_parameters=``, else Horovod's own ``_parameter_names``), applies error feedback
   and starts an **allgather of the payload**, named after the parameter.
2. It returns an empty tensor: Horovod's allreduce of it moves no data.
3. ``decompress`` waits for the allgather, decodes every rank's payload in rank order and
   averages (or sums): every rank ends with the same bytes, so the same gradient.

Tensors the compressor does not compress (fewer than ``DEFAULT_MIN_COMPRESS_NUMEL`` elements,
``exclude=``, a feedback policy's dense step) go back to Horovod's own allreduce; the float32
ones exempt by size or ``exclude=`` as float16 (``exempt="fp16"``): divided by the number of
ranks first, so Horovod's float16 sum cannot overflow, with error feedback of the cast, and
multiplied back in ``decompress``. With ``op=hvd.Average`` Horovod then divides the float16 sum
by the ranks once more, in float16: one more rounding than on ``hvd_gradcomp.DistributedOptimizer``, which
sums. ``compressor.stats`` counts every tensor ``compress()`` hands to Horovod.

Every wrapper sets the compressor's noise stream to the rank (:func:`bind_noise_stream`), so
ranks draw independent rounding noise even when they share one explicit seed.

Horovod starts every exchange of a step before it finishes the first, so the decompress
that leaves none in flight ends the step for the compressor: what the step changed is kept,
or undone when an averaged gradient came back NaN/Inf (a loss scaler skips that step).

Where this cannot be done right (Adasum, a Horovod whose internals differ
from :data:`HOROVOD_INTERNALS`) it raises :class:`HorovodIntegrationError` at the first step
instead of guessing.

Example::

    >>> import horovod.torch as hvd                                        # doctest: +SKIP
    >>> from hvd_gradcomp import TopKQSGD
    >>> opt = hvd.DistributedOptimizer(                                    # doctest: +SKIP
    ...     opt, named_parameters=model.named_parameters(),
    ...     compression=TopKQSGD(ratio=0.01, bits=8, named_parameters=model.named_parameters()))
"""
from __future__ import annotations

import sys
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch

from .. import codecs, settings
from ..codecs import compressor as compressors
from ..feedback import kernels
from ..codecs.interface import _compressible
from ..codecs.compressor import GradientCompressor
from ..feedback.names import name_map  # noqa: F401  (hvd_gradcomp.horovod.name_map: the one map, re-exported)
from ..collectives.exchange import AllgatherExchange, Pending, allreducible, check_no_joined_ranks
from ..collectives.inflight import is_average
from ..collectives.rounds import HALF, Algorithm, dense_fallback
from ..collectives.rounds import finish as finish_rounds


HOROVOD_CHECKED = "0.28.1"
"""The Horovod release every entry of :data:`HOROVOD_INTERNALS` was read and tested against."""

HOROVOD_INTERNALS: Tuple[Tuple[str, str], ...] = (
    ("horovod/torch/optimizer.py",
     "the file whose frame calls compression.compress(): how compress() knows Horovod is the caller"),
    ("_DistributedOptimizer._allreduce_grad_async(self, p)",
     "frame locals `self` (the optimizer) and `p` (the parameter whose p.grad is being compressed)"),
    ("_DistributedOptimizer._grouped_allreduce_grad_async(self, ps)",
     "groups=: compress(p.grad) runs in a comprehension with `p`; `self` is one frame up"),
    ("_DistributedOptimizer._parameter_names",
     "dict parameter -> name; used only when no names were bound with named_parameters="),
    ("_DistributedOptimizer.op, _DistributedOptimizer.process_set",
     "the reduction (Average/Sum) and the process set the payload allgather must use"),
    ("_DistributedAdasumOptimizer._starting_models",
     "marks Adasum's optimizer, which compresses parameter deltas, not gradients"),
    ("_DistributedOptimizer._allreduce_grad_async: p.grad.to_dense() when sparse_as_dense",
     "frame local `p` whose p.grad is sparse while compress() gets its dense copy"),
    ("horovod/torch/functions.py: broadcast_optimizer_state calls optimizer.step()",
     "on ranks whose optimizer has no state yet, to create it; in_state_broadcast() keeps it local"),
    ("_DistributedOptimizer._compression",
     "the compressor of a stock optimizer, whose residuals GradientAccumulator checkpoints"),
)
"""Each Horovod internal this module relies on, and why (checked against :data:`HOROVOD_CHECKED`)."""

_OPTIMIZER_FILE = HOROVOD_INTERNALS[0][0]
_FUNCTIONS_FILE = "horovod/torch/functions.py"
_FRAMES_TO_SEARCH = 6
_LOCAL = "local"   # decompress() context of a direct compress(tensor, name=...) call


class HorovodIntegrationError(RuntimeError):
    """The compressor cannot run correctly inside this Horovod call; the message says what to change."""


class UnreadSettingsWarning(UserWarning):
    """``HVDGC_*`` settings are set, but the script built something else without reading them."""


HOROVOD_HOW = ("pip install 'hvd-gradcomp[horovod]' (on torch >= 2.1 Horovod 0.28.1 must be built with C++17: "
               "see docs/INSTALL.md or scripts/setup.sh)")


def require_horovod(what: str) -> Any:
    """``horovod.torch`` for a wrapper that needs it, or one ImportError that says how to install it.

    Horovod is an extra (``hvd-gradcomp[horovod]``): the compressors, the DDP hook and the
    launcher work without it, so only the Horovod wrappers ask for it, when they are used.

    >>> require_horovod("hvd_gradcomp.DistributedOptimizer")     # doctest: +SKIP
    ImportError: hvd_gradcomp.DistributedOptimizer needs Horovod: pip install 'hvd-gradcomp[horovod]' ...
    """
    try:
        import horovod.torch as hvd
    except ModuleNotFoundError as exc:
        if exc.name not in ("horovod", "horovod.torch"):
            raise
        raise ImportError(f"{what} needs Horovod: {HOROVOD_HOW}") from None
    except ImportError as exc:   # installed, but built against another torch (C++ ABI) or without PyTorch
        raise ImportError(f"{what} needs Horovod, which is installed but does not import ({exc}); rebuild it "
                          f"against this torch: {HOROVOD_HOW}") from exc
    return hvd


@dataclass
class HorovodCall:
    """What compress() learned from Horovod's call: the parameter name, reduction and process set."""

    name: str
    op: Any
    process_set: Any
    optimizer: Any = None
    names: Optional[Dict[torch.Tensor, str]] = None


@dataclass
class StockContext:
    """decompress()'s context: the allgather in flight for one parameter."""

    exchange: AllgatherExchange
    pending: Pending
    device: torch.device


# ---------------------------------------------------------------- noise stream
def bind_noise_stream(compressor: GradientCompressor) -> None:
    """Set the compressor's noise stream to this process's Horovod rank (no-op before ``hvd.init()``).

    The rounding noise is a function of (seed, stream, tensor name, step): with the stream set
    to the rank, ranks that share one explicit seed still draw independent noise, so QSGD's
    variance shrinks with the number of ranks. Called by every wrapper that goes through Horovod.
    """
    hvd = sys.modules.get("horovod.torch")   # never import Horovod for a compressor used without it
    if hvd is not None and hvd.is_initialized():
        compressor.stream = hvd.rank()


# ---------------------------------------------------------------- state broadcast
def in_state_broadcast(depth: int = _FRAMES_TO_SEARCH) -> bool:
    """True inside the ``step()`` that ``hvd.broadcast_optimizer_state`` runs to create the state
    of an optimizer that has none.

    Horovod runs it only on ranks without state (after a rank-0-only resume, some ranks only)
    and skips synchronisation only for its own optimizer class; in
    ``hvd_gradcomp.DistributedOptimizer`` that step must stay local too, or it would wait
    forever for the ranks that skip it (and count bytes no training step sent).
    """
    frame = sys._getframe(1)
    for _ in range(depth):
        frame = frame.f_back
        if frame is None:
            return False
        code = frame.f_code
        if code.co_name == "broadcast_optimizer_state" and \
                code.co_filename.replace("\\", "/").endswith(_FUNCTIONS_FILE):
            return True
    return False


# ---------------------------------------------------------------- settings nobody read
_settings_checked = False


def describe(compression: Any) -> Dict[str, Any]:
    """The :class:`~hvd_gradcomp.config.CompressionConfig` fields a compression object stands for
    (empty for one this library does not know).

    >>> from hvd_gradcomp import TopKQSGD
    >>> describe(TopKQSGD(ratio=0.05, bits=4, seed=1))
    {'compression': 'topk-qsgd', 'error_feedback': True, 'seed': 1, 'ratio': 0.05, 'bits': 4}
    >>> describe(None)
    {'compression': 'none'}
    """
    if compression is None:
        return {"compression": "none"}
    if isinstance(compression, GradientCompressor):
        kind = codecs.name_of(compression)
        fields = {"compression": kind, "error_feedback": compression.error_feedback, "seed": compression.seed}
        fields.update({k: getattr(compression, k) for k in ("ratio", "bits") if hasattr(compression, k)})
        return fields if kind else {}
    hvd = sys.modules.get("horovod.torch")
    known = {} if hvd is None else {hvd.Compression.none: "none", hvd.Compression.fp16: "fp16"}
    return {"compression": known[compression]} if compression in known else {}


def warn_unread_settings(compression: Any, accumulate: Optional[int] = None, what: str = "an optimizer") -> None:
    """Once per process, on rank 0: warn when ``HVDGC_*`` settings are set but what the script
    built ignores them (see :func:`hvd_gradcomp.settings.unread_settings_message`)."""
    global _settings_checked
    hvd = sys.modules.get("horovod.torch")
    if _settings_checked or hvd is None or not hvd.is_initialized():
        return
    _settings_checked = True
    built = describe(compression)
    if accumulate is not None:
        built["accumulate"] = accumulate
    message = settings.unread_settings_message(built, what=what) if hvd.rank() == 0 else None
    if message:
        warnings.warn(message, UnreadSettingsWarning, stacklevel=3)


def compressor_of(optimizer: Any) -> Any:
    """The compression object of a DistributedOptimizer: ours (``.compression``) or Horovod's
    (``._compression``, see :data:`HOROVOD_INTERNALS`); None when it has none."""
    return getattr(optimizer, "compression", None) or getattr(optimizer, "_compression", None)


# ---------------------------------------------------------------- names
def _param_of(tensor: torch.Tensor, params: Iterable[torch.Tensor]) -> Optional[torch.Tensor]:
    return next((q for q in params if q.grad is tensor), None)


# ---------------------------------------------------------------- finding Horovod's call
def find_horovod_call(tensor: torch.Tensor, names: Optional[Dict[torch.Tensor, str]] = None,
                      depth: int = _FRAMES_TO_SEARCH) -> Optional[HorovodCall]:
    """The parameter name, op and process set of the Horovod optimizer call that passed
    ``tensor`` to ``compress``; None when the caller is not Horovod's optimizer.

    ``names`` (bound by the user) wins over Horovod's private ``_parameter_names``.
    """
    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return None
        if frame.f_code.co_filename.replace("\\", "/").endswith(_OPTIMIZER_FILE):
            return _call_from_frame(frame, tensor, names)
        frame = frame.f_back
    return None


def _call_from_frame(frame: Any, tensor: torch.Tensor, names: Optional[Dict[torch.Tensor, str]]) -> HorovodCall:
    import horovod.torch as hvd

    opt = frame.f_locals.get("self")
    if opt is None and frame.f_back is not None:   # groups=: the comprehension's frame has no self
        opt = frame.f_back.f_locals.get("self")
    if hasattr(opt, "_starting_models") or getattr(opt, "op", None) == hvd.Adasum:
        raise HorovodIntegrationError(
            "hvd_gradcomp compressors do not support op=hvd.Adasum (Adasum reduces dense parameter "
            "deltas, not gradients); use op=hvd.Average or hvd.Sum")
    p = frame.f_locals.get("p")
    densified = isinstance(p, torch.Tensor) and p.grad is not None and p.grad.is_sparse
    if densified and not (getattr(opt, "sparse_as_dense", False) and tensor.shape == p.shape):
        raise HorovodIntegrationError(_advice("a sparse gradient reached compress() in an unexpected way"))
    table = names if names is not None else getattr(opt, "_parameter_names", None)
    if table is None:
        raise HorovodIntegrationError(_advice(
            f"this Horovod's optimizer has no _parameter_names (checked with Horovod {HOROVOD_CHECKED})"))
    if not (isinstance(p, torch.Tensor) and (p.grad is tensor or densified)):
        p = _param_of(tensor, table)
    if p is None or p not in table:
        where = "the named_parameters bound to this compressor" if names is not None else "Horovod's optimizer"
        raise HorovodIntegrationError(_advice(f"the tensor handed to compress() is not the .grad of any "
                                              f"parameter in {where}"))
    if not hasattr(opt, "op") or not hasattr(opt, "process_set"):
        raise HorovodIntegrationError(_advice(
            f"this Horovod's optimizer has no op/process_set (checked with Horovod {HOROVOD_CHECKED})"))
    return HorovodCall(table[p], opt.op, opt.process_set, opt, table)


_CLOSURES_REFUSED: "weakref.WeakSet[Any]" = weakref.WeakSet()
_STEP_WITH_CLOSURE = (
    "stock hvd.DistributedOptimizer.step(closure) cannot carry hvd_gradcomp compression: Horovod {v} "
    "synchronizes before it runs the closure, so the closure's backward pass starts exchanges that the step "
    "does not wait for, and the optimizer steps on this rank's own gradient (each average lands a step late, "
    "compressed or not). Use hvd_gradcomp.DistributedOptimizer (same arguments), which finishes the exchange "
    "each time the closure returns, or call loss.backward() and then optimizer.step() without a closure.")


def refuse_closures(optimizer: Any) -> None:
    """Refuse ``step(closure)`` on a stock Horovod optimizer (see :data:`_STEP_WITH_CLOSURE`), once per optimizer:
    now if this gradient comes from a closure inside its ``step`` (found on the stack, where backward runs on
    this thread, as on CPU), and at every later step through a step pre-hook, before Horovod synchronizes."""
    if optimizer in _CLOSURES_REFUSED:
        return
    _CLOSURES_REFUSED.add(optimizer)

    def pre_hook(opt: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        if (len(args) > 1 and args[1] is not None) or kwargs.get("closure") is not None:
            if not in_state_broadcast():
                raise HorovodIntegrationError(_STEP_WITH_CLOSURE.format(v=HOROVOD_CHECKED))

    optimizer.register_step_pre_hook(pre_hook)
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "step" and frame.f_locals.get("self") is optimizer \
                and frame.f_locals.get("closure") is not None and frame.f_code.co_filename.replace(
                    "\\", "/").endswith(_OPTIMIZER_FILE):
            raise HorovodIntegrationError(_STEP_WITH_CLOSURE.format(v=HOROVOD_CHECKED))
        frame = frame.f_back


def _advice(why: str) -> str:
    return (f"hvd_gradcomp cannot tell which parameter this gradient belongs to: {why}. Pass "
            "named_parameters=model.named_parameters() to the compressor (of the model the optimizer "
            "wraps), or use hvd_gradcomp.DistributedOptimizer(...) (same arguments), which passes names explicitly.")


# ---------------------------------------------------------------- Horovod's compressor protocol
def refuse_rounds(compressor: GradientCompressor) -> None:
    """Refuse a codec whose exchange needs more than the one allreduce stock Horovod gives what
    ``compress()`` returns, with what to use instead: its declared collective is
    :data:`~hvd_gradcomp.codecs.ALLREDUCE_ROUNDS` (PowerSGD: ``Q`` is computed from the averaged ``P``)
    or :data:`~hvd_gradcomp.codecs.SPARSE_ALLREDUCE` (``exchange="allreduce"``: an alltoall, then an
    allgather).

    >>> from hvd_gradcomp.codecs.powersgd import PowerSGD
    >>> refuse_rounds(PowerSGD(rank=4))
    Traceback (most recent call last):
    ...
    hvd_gradcomp.horovod.stock.HorovodIntegrationError: PowerSGD(rank=4, error_feedback=True) cannot run inside hvd.DistributedOptimizer(compression=...): Horovod allreduces what compress() returns once, and PowerSGD needs two dependent allreduces (P, then Q computed from the averaged P). Use hvd_gradcomp.DistributedOptimizer(...) (same arguments) or, with PyTorch DDP, hvd_gradcomp.ddp.register(model, compression=...).
    >>> from hvd_gradcomp.codecs.topk import TopK
    >>> refuse_rounds(TopK(ratio=0.01, exchange="allreduce"))   # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    hvd_gradcomp.horovod.stock.HorovodIntegrationError: TopK(...) cannot run inside hvd.DistributedOptimizer(compression=...): Horovod allreduces what compress() returns once, and exchange="allreduce" (the sparse allreduce) needs an alltoall of each rank's (index, value) pairs to their owners, then an allgather of what the owners kept. Use hvd_gradcomp.DistributedOptimizer(...) (same arguments) or, with PyTorch DDP, hvd_gradcomp.ddp.register(model, compression=...); or exchange="allgather" (the default) here.
    """
    collective = codecs.collective_of(compressor)
    if collective == codecs.ALLREDUCE_ROUNDS:
        needs = (f"{type(compressor).__name__} needs two dependent allreduces (P, then Q computed from the "
                 "averaged P)")
    elif collective == codecs.SPARSE_ALLREDUCE:
        needs = ('exchange="allreduce" (the sparse allreduce) needs an alltoall of each rank\'s (index, value) '
                 "pairs to their owners, then an allgather of what the owners kept")
    else:
        return
    also = '; or exchange="allgather" (the default) here' if collective == codecs.SPARSE_ALLREDUCE else ""
    raise HorovodIntegrationError(
        f"{compressor!r} cannot run inside hvd.DistributedOptimizer(compression=...): Horovod allreduces what "
        f"compress() returns once, and {needs}. Use hvd_gradcomp.DistributedOptimizer(...) (same arguments) or, "
        f"with PyTorch DDP, hvd_gradcomp.ddp.register(model, compression=...){also}.")


def compress(compressor: GradientCompressor, tensor: torch.Tensor, name: Optional[str] = None,
             names: Optional[Dict[torch.Tensor, str]] = None) -> Tuple[torch.Tensor, Any]:
    """Horovod's ``compress``: see :func:`hvd_gradcomp.codecs.protocol.compress` (every compressor's
    ``compress``); ``names``: those bound with ``named_parameters=``."""
    refuse_rounds(compressor)
    if not _compressible(tensor):
        return tensor, None
    bind_noise_stream(compressor)
    if name is not None:
        return compressor.compress_named(name, tensor), _LOCAL
    call = find_horovod_call(tensor, names)
    if call is not None and compressor.clip is not None:
        raise ValueError(
            f"{compressor!r}: clip= bounds the global norm of each rank's whole gradient (every tensor, as "
            "clip_grad_norm_ does), so it needs every gradient before the first is compressed; stock "
            "hvd.DistributedOptimizer compresses each tensor as soon as its gradient is ready. Use "
            "hvd_gradcomp.DistributedOptimizer (same arguments) or the DDP hook, which clip the whole step first.")
    if call is not None:
        warn_unread_settings(compressor, what=f"hvd.DistributedOptimizer(compression={compressor!r})")
        compressor._claim(call.optimizer, call.process_set.size())
        # The feedback policy ("auto") is chosen from Horovod's optimizer (the user's class
        # underneath), before asking whether to compress: the policy may ask for a dense step.
        compressor.attach(call.optimizer, call.names, call.process_set.rank())
        refuse_closures(call.optimizer)
        if not compressor.compresses(call.name, tensor.numel()):
            # Small, excluded or dense this step: Horovod's own allreduce takes it (as float16 if exempt).
            return _compress_dense(compressor, call, tensor)
        if not compressor.join_checked:  # the step's first allgather (float16 allreduces work with join)
            check_no_joined_ranks(call.process_set)
        compressor.exchange_opened(call.name)
        compressor.join_checked = True
        exchange = AllgatherExchange(compressor, call.op, call.process_set)
        placeholder = allreducible(tensor.new_empty(0))   # Horovod allreduces it: a dtype it takes
        return placeholder, StockContext(exchange, exchange.start(call.name, tensor), tensor.device)
    if compressor.error_feedback:
        raise ValueError(f"{type(compressor).__name__}.compress() needs name= when called outside "
                         "hvd.DistributedOptimizer with error_feedback=True (the residual is kept per name)")
    return compressor.encode(tensor), _LOCAL


@dataclass
class DenseContext:
    """decompress()'s context of a tensor Horovod allreduced uncompressed: its
    :func:`~hvd_gradcomp.collectives.rounds.dense_fallback`, which writes the average into
    ``outs[0]`` (set by decompress), and whether it went as float16 (``half``)."""

    name: str
    run: Algorithm
    outs: List[Optional[torch.Tensor]]
    shape: torch.Size
    dtype: torch.dtype
    half: bool
    average: bool
    world: int


def _compress_dense(compressor: GradientCompressor, call: HorovodCall, tensor: torch.Tensor
                    ) -> Tuple[torch.Tensor, DenseContext]:
    """A tensor the compressor does not compress this step, for Horovod's allreduce, by
    :func:`~hvd_gradcomp.collectives.rounds.dense_fallback`: as float16 if exempt (divided by the ranks
    that sum it, with error feedback of the cast, part of the compressor's exchange step: what the
    cast kept back is undone with the rest when an average comes back NaN/Inf), else as it is.
    A policy's dense steps stay float32 (``dense_steps=False``: Horovod's ``Average`` divides the
    float16 sum once more, a rounding no residual sees)."""
    average, world = is_average(call.op), call.process_set.size()
    outs: List[Optional[torch.Tensor]] = [None]
    run = dense_fallback(compressor, [(call.name, tensor)], outs, world, compressors.DEFAULT_MIN_COMPRESS_NUMEL,
                         average, dense_steps=False, opening=compressor.exchange_opened)
    request = next(run).requests[0]
    sent = allreducible(request.tensor)   # decompress() casts back
    _count(compressor, call.name, request.raw_bytes, sent.numel() * sent.element_size())
    return sent, DenseContext(call.name, run, outs, tensor.shape, tensor.dtype, request.tag == HALF, average, world)


def _decompress_dense(compressor: GradientCompressor, tensor: torch.Tensor, ctx: DenseContext) -> torch.Tensor:
    """The average of a tensor :func:`_compress_dense` sent, from Horovod's output ``tensor``."""
    # Horovod's output (flat: the algorithm sends tensors flat) is the average itself when it needs no
    # cast back: the algorithm then finds it in place and copies nothing
    fits = not ctx.half and tensor.dtype == ctx.dtype and tensor.is_contiguous()
    out = ctx.outs[0] = tensor.view(ctx.shape) if fits else torch.empty(ctx.shape, dtype=ctx.dtype, device=tensor.device)
    # The algorithm wants the sum of what the ranks sent for the float16 request: Horovod's Average
    # divided it by the ranks once more (its Sum left it as it is).
    finish_rounds(ctx.run, [tensor.to(out.dtype).mul_(ctx.world) if ctx.half and ctx.average else tensor])
    if ctx.half and compressor.exchange_closed(ctx.name, kernels.all_finite(out)):
        compressor.stats.end_step()
    return out


def _count(compressor: GradientCompressor, name: str, raw: int, payload: int, framing: int = 0) -> None:
    """Where the stock wrapper counts bytes (:class:`~hvd_gradcomp.stats.ByteStats`): as ``compress()``
    hands a tensor to Horovod, or, for an allgathered payload, once its exchange finished. The end of a
    compressed step closes the ledger's step; a step of dense tensors alone (``feedback="frozen"``'s
    warm-up) is closed by the next one's first tensor, since each tensor travels once per step."""
    if compressor.stats.recorded_in_step(name):
        compressor.stats.end_step()
    compressor.stats.record(name, raw, payload, framing)


def decompress(compressor: GradientCompressor, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
    """Horovod's ``decompress``: see :func:`hvd_gradcomp.codecs.protocol.decompress`."""
    refuse_rounds(compressor)
    if ctx is None:
        return tensor
    if isinstance(ctx, DenseContext):
        return _decompress_dense(compressor, tensor, ctx)
    if isinstance(ctx, StockContext):
        out = torch.empty(ctx.pending.shape, dtype=ctx.pending.dtype, device=ctx.device)
        p = ctx.pending
        ctx.exchange.finish(p, out)
        _count(compressor, p.name, out.numel() * out.element_size(), p.bytes_sent - p.framing_bytes, p.framing_bytes)
        # Horovod starts every exchange of a step before it finishes the first, so the last one
        # to finish ends the step: kept, or undone when an average came back NaN/Inf.
        known = p.finite  # read at the payloads' indices only, when that suffices
        if compressor.exchange_closed(p.name, bool(known) if known is not None else kernels.all_finite(out)):
            compressor.stats.end_step()
        return out
    if ctx == _LOCAL:
        return compressor.decode(tensor)
    raise ValueError(f"decompress() got a context it did not make ({type(ctx).__name__}); pass the ctx "
                     "that compress() returned with its tensor")
