"""The hvd-gradcomp compressors for PyTorch ``DistributedDataParallel``: a communication hook.

One call registers the hook on a DDP model and returns its state::

    import torch.distributed as dist
    import hvd_gradcomp as gc
    from hvd_gradcomp import ddp as gc_ddp

    dist.init_process_group("nccl")          # or "gloo" on CPU
    model = torch.nn.parallel.DistributedDataParallel(net, device_ids=[local_rank])
    state = gc_ddp.register(model, compression=gc.TopKQSGD(ratio=0.01, bits=8))
    ...
    loss.backward(); opt.step()
    print(state.comm_stats.summary(), state.last_step_bytes)

Underneath is a hook + state pair in the style of ``torch.distributed.algorithms.ddp_comm_hooks``
(:func:`gradcomp_hook`, :class:`GradCompState`), which can also be registered by hand::

    state = gc_ddp.GradCompState(None, gc.QSGD(bits=8), named_parameters=net.named_parameters())
    model.register_comm_hook(state, gc_ddp.gradcomp_hook)

How each bucket travels (``torch.distributed`` collectives only, so Gloo, NCCL and MPI alike):

* sparse payloads (TopK, TopKQSGD): every parameter of the bucket is compressed on its own
  (error feedback keyed by its name); the payloads are concatenated, the ranks all_gather
  their sizes, then the payloads padded to the largest; every rank decodes all of them in
  rank order, so every rank ends with bit-identical gradients;
* PowerSGD: two ``all_reduce`` rounds of float32 factors (``P``, then ``Q`` from the averaged
  ``P``), as torch's PowerSGD hook, with each parameter's residual and ``Q`` kept by its name;
* QSGD: the compressed allreduce of the Horovod road: each parameter is quantised in P
  chunks, ``all_to_all_single`` sends chunk i to rank i, rank i averages and re-quantises it
  (with its own error feedback) and an ``all_gather`` returns every chunk;
* dense: parameters smaller than ``min_compress_numel`` and dtypes the codecs do not carry
  (float64) are averaged by ``all_reduce`` (float32 ones under ``min_compress_numel`` or
  ``exclude=``d as float16 with error feedback of the cast: the compressor's
  ``exempt="fp16"``), as are whole buckets before ``start_compress_iter`` and with
  ``compression=None``; ``compression=torch.float16`` casts like torch's fp16 hook.
* ``compression=gc.Auto()``: each bucket takes the road that costs least, measured while
  training runs (sparse, QSGD, fp16 or dense; see :class:`_AutoRoads` and docs/AUTO.md), the
  same on every rank; ``state.auto_report()`` says which and why.

The hook returns a future and never waits: second-round collectives are chained on the
first round's futures and issued, in bucket order, on a second process group, so that their
order is the same on every rank whichever thread completes a future first.

Non-finite gradients (NaN/Inf, e.g. a loss-scaler overflow) on any rank make that bucket NaN
on every rank, as uncompressed DDP would, so ``GradScaler`` skips the step everywhere; the
rank with the bad values leaves its residuals untouched and nobody hangs.
"""
# No `from __future__ import annotations`: DDP checks the hook's annotations as real objects.
import copy
import re
import threading
import warnings
import weakref
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from .. import feedback as fb
from .. import codecs, settings, wire
from ..wire import kernels
from ..horovod.accumulate import check_clippable, check_max_grad_norm
from ..auto import Auto
from ..codecs.compressor import DEFAULT_MIN_COMPRESS_NUMEL, GradientCompressor, clips_whole_step, refuse_class
from . import checkpoint, join
from .auto import _AutoRoads
from .roads import _KEEP_ALIVE, _ROADS, Future, _allreduce, _dense_bucket, _InOrder, _Plan, _Segment
from ..feedback.momentum import MomentumCorrection
from ..stats import ByteStats
from ..codecs.topk import TopKQSGD

DENSE_DTYPES = (torch.float16, torch.bfloat16)
STATE_VERSION = checkpoint.STATE_VERSION
_DEFAULT_COMPRESSION = TopKQSGD(ratio=0.01, bits=8)
_CLAIMED: "weakref.WeakSet[GradientCompressor]" = weakref.WeakSet()
class GradCompState:
    """State of :func:`gradcomp_hook`: settings first, then residuals, counters and statistics.

    Args:
        process_group: the group to average over (None: the default group).
        compression: an hvd-gradcomp compressor (``TopKQSGD``, ``TopK``, ``QSGD``, ``PowerSGD``), ``gc.Auto()``
            (a road per bucket, measured: :meth:`auto_report`), ``None`` (plain averaging
            allreduce) or ``torch.float16`` / ``torch.bfloat16`` (cast, like torch's
            ``fp16_compress_hook``). A compressor belongs to one state: its error
            feedback residuals are this rank's.
        named_parameters: ``module.named_parameters()`` of the wrapped module; needed with a
            compressor, because residuals and random streams are keyed by parameter name.
        start_compress_iter: exchanges before this one go uncompressed (a warm-up knob, as
            PowerSGD's ``start_powerSGD_iter``; counted in exchanges, not micro-batches).
        min_compress_numel: parameters with fewer elements are averaged uncompressed.
        optimizer: the optimizer that steps the wrapped module's parameters. With a compressor
            whose ``feedback`` is ``"auto"`` (the default) it picks the feedback policy, as the
            Horovod road does: DGC momentum correction for ``SGD(momentum > 0)`` (each rank sends
            its own velocity through error feedback, so nothing it drops loses its momentum),
            ``"frozen"`` (:class:`hvd_gradcomp.FrozenVariance`: a dense warm-up, then Adam's second
            moment frozen and each rank's update direction through error feedback) for ``Adam``/``AdamW``,
            ``"update"`` (:class:`hvd_gradcomp.feedback.LocalUpdate`: each rank steps a private copy of
            the optimizer on its own gradient, in the hook, and sends the parameter change through error
            feedback) for other adaptive optimizers (``Adafactor``, ``RMSprop``, ``NAdam``...), classic
            error feedback otherwise; the choice is said once on rank 0. Without it:
            classic. Under ``"frozen"`` and ``"update"`` the parameters move when the optimizer steps (a step
            pre-hook applies the averaged update and hands the optimizer a zero gradient, so
            AdamW only applies its weight decay): between ``backward()`` and ``step()``,
            ``p.grad`` of a compressed parameter holds the averaged update direction, not a
            gradient, and clipping it changes nothing (use the compressor's ``clip=``).

    Why the hook does not have to wait for DDP's bucket rebuild: DDP puts all parameters in
    one bucket for the first iteration and rebuilds its buckets after it, by the order the
    gradients became ready. PowerSGD keeps its error feedback per bucket *index*, so its
    residuals would mix across the rebuild and it refuses ``start_powerSGD_iter < 2``. Here
    every parameter of a bucket is compressed on its own, with its residual and random stream
    keyed by the parameter's name (and its shape checked), so a bucket's layout changes
    nothing: compression is correct from the first exchange, and a checkpoint taken after the
    rebuild resumes bit-identically in a new DDP instance that starts with one bucket again.

    Collective order: a new process group is created for the second round of collectives
    (``dist.new_group``, a collective call: build states on every rank in the same order).

    Example::

        >>> state = GradCompState(None, TopKQSGD(ratio=0.01), named_parameters=net.named_parameters())  # doctest: +SKIP
        >>> ddp_model.register_comm_hook(state, gradcomp_hook)                                        # doctest: +SKIP
    """

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None, compression: Any = None,
                 named_parameters: Optional[Iterable[Tuple[str, torch.Tensor]]] = None,
                 start_compress_iter: int = 0, min_compress_numel: int = DEFAULT_MIN_COMPRESS_NUMEL,
                 optimizer: Optional[torch.optim.Optimizer] = None) -> None:
        optimizer = torch_optimizer(optimizer)
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised: call dist.init_process_group(...) "
                               "before building the DDP model and its hook state")
        _check_compression(compression)
        for label, value, low in (("start_compress_iter", start_compress_iter, 0),
                                  ("min_compress_numel", min_compress_numel, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{label} must be an int >= {low}, got {value!r}")
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self.compression = compression
        self.start_compress_iter = start_compress_iter
        self.rank = dist.get_rank(self.process_group)
        self.world_size = dist.get_world_size(self.process_group)
        self.min_compress_numel = max(min_compress_numel, self.world_size)  # QSGD chunks are never empty
        self._names: Dict[torch.Tensor, str] = {}
        # names whose received() waits for the optimizer step, with their average kept apart (None: left in p.grad)
        self._at_step: Dict[str, Optional[torch.Tensor]] = {}
        self._kept: Dict[str, torch.Tensor] = {}   # one buffer per name, reused every step
        # compressed segments whose average this step's exchange wrote, by name (see _give_unused)
        self._exchanged: Dict[str, Tuple[torch.Tensor, "_Segment"]] = {}
        self._unused_said = False
        self._outside_said = False   # see _outside_optimizer
        self.auto: Optional["_AutoRoads"] = None
        if isinstance(compression, (GradientCompressor, Auto)):
            if compression in _CLAIMED:
                raise ValueError(f"this {type(compression).__name__} already serves another hook state (register() "
                                 "was called with it before, on this model or another): register once per model, "
                                 "and give every model its own compressor (its residuals are per model)")
            if named_parameters is None:
                raise ValueError("named_parameters is required with a compressor (residuals are kept per "
                                 "parameter name): pass module.named_parameters() of the wrapped module")
            if not isinstance(compression, Auto) and compression.collective not in _ROADS:
                raise ValueError(f"{type(compression).__name__} declares collective={compression.collective!r}, "
                                 f"which the DDP hook cannot carry (it carries {', '.join(_ROADS)}; see "
                                 "hvd_gradcomp.codecs)")
            self._names = _name_map(named_parameters)
            _CLAIMED.add(compression)
            if isinstance(compression, Auto):
                self.auto = _AutoRoads(self, compression)
                compression.note_optimizer(optimizer, self.rank)
            else:
                compression.stream = self.rank  # independent rounding noise on every rank
                compression.road_clips = True   # clip=: the hook clips the whole step (see _held_until_last)
                _choose_feedback(compression, optimizer, self._names, self.rank)
            self._by_name = {n: p for p, n in self._names.items()}
            if optimizer is not None:
                self._step_hook = optimizer.register_step_pre_hook(self._before_step)
            ranks = dist.get_process_group_ranks(self.process_group)
            self._second = dist.new_group(ranks=ranks, backend=dist.get_backend(self.process_group))
            _KEEP_ALIVE.extend([self.process_group, self._second])
        self.iter = 0
        self._held: List[Tuple[dist.GradBucket, Future]] = []   # clip=: this step's buckets, until the last
        self.last_local_norm: Optional[torch.Tensor] = None     # this rank's gradient norm before clip=
        # Bytes this rank hands to the collectives: one ledger, the compressor's own when it has one.
        self.comm_stats = compression.stats if isinstance(compression, GradientCompressor) else ByteStats()
        self.nonfinite_exchanges = 0    # buckets that carried NaN/Inf on some rank
        self._plans: Dict[Tuple[int, Tuple[int, ...]], _Plan] = {}
        self._lock = threading.Lock()   # the compressor is used from the hook and callback threads
        self._in_order = _InOrder(self._lock)   # second-round collectives, in bucket order

    def __repr__(self) -> str:
        return (f"GradCompState(compression={self.compression!r}, start_compress_iter={self.start_compress_iter}, "
                f"min_compress_numel={self.min_compress_numel}, world_size={self.world_size})")

    # ------------------------------------------------------------ statistics
    @property
    def last_step_bytes(self) -> int:
        """Bytes this rank handed to the collectives in the last finished exchange (all buckets)."""
        return self.comm_stats.at(self.iter - 1).sent

    def _record(self, step: int, name: str, raw: int, payload: int, framing: int = 0) -> None:
        """Where the hook's roads count bytes (:class:`~hvd_gradcomp.stats.ByteStats`), as each hands
        them to a collective; ``step``: the exchange they belong to (callbacks finish asynchronously)."""
        with self._lock:
            self.comm_stats.record(name, raw, payload, framing, step=step)

    def auto_report(self) -> Dict[str, Any]:
        """With ``compression=gc.Auto()``: :meth:`hvd_gradcomp.Auto.report` of the hook, one
        entry per bucket (named by its compressed parameters, e.g. ``"fc1.weight..fc3.weight (3)"``):
        its road, measured codec milliseconds and payload bytes per road, the probed link."""
        if self.auto is None:
            raise ValueError(f"auto_report() needs compression=gc.Auto(); this state uses {self.compression!r}")
        return self.auto.auto.report()

    # ------------------------------------------------------------ checkpoints
    def state_dict(self, all_ranks: bool = False) -> Dict[str, Any]:
        """Residuals, random streams and the exchange counter (not the process group): this rank's, or with
        ``all_ranks=True`` (a collective: call it on every rank) every rank's in the dict rank 0 gets, for a
        checkpoint rank 0 alone writes (:mod:`hvd_gradcomp.ddp.checkpoint`)::

            hook = state.state_dict(all_ranks=True)                      # every rank
            if dist.get_rank() == 0:
                torch.save({"model": model.state_dict(), "hook": hook}, "ckpt.pt")
        """
        return checkpoint.state_dict(self, all_ranks)

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`: this rank's own file, or (on every rank) the one dict that
        ``state_dict(all_ranks=True)`` gave rank 0; on another number of ranks that one restarts error
        feedback, with a warning (:func:`hvd_gradcomp.ddp.checkpoint.load_state_dict`)."""
        checkpoint.load_state_dict(self, state)

    # ------------------------------------------------------------ bucket layout
    def _plan(self, bucket: dist.GradBucket) -> _Plan:
        """The bucket's layout (cached), with this step's choices of the compressor applied:
        segments it does not compress now (``exclude=``, or its feedback's dense warm-up, e.g.
        ``"frozen"``) join the dense allreduce. The answers come from replicated state, so
        every rank splits the bucket the same way."""
        params = bucket.parameters()
        key = (bucket.index(), tuple(id(p) for p in params))
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._make_plan(bucket, params)
        now_dense = tuple(s for s in plan.compressed if not self.compression.compresses(s.name)
                          or self._outside_optimizer(s.name))
        if not now_dense:
            return plan
        return _Plan(tuple(s for s in plan.compressed if s not in now_dense), plan.dense + now_dense)

    def _outside_optimizer(self, name: str) -> bool:
        """Whether ``name`` goes uncompressed because the feedback policy needs the optimizer's state of it
        and the optimizer passed to :func:`register` does not hold it (an optimizer over a part of the
        model: DDP still averages every parameter); said once, on rank 0."""
        feedback = getattr(self.compression, "feedback", None)
        if feedback is None or not feedback.needs_optimizer_state(name):
            return False
        if not self._outside_said and self.rank == 0:
            self._outside_said = True
            warnings.warn(f"hvd_gradcomp DDP hook: parameter {name!r} is not in the optimizer passed to register(): "
                          f"feedback={feedback.key!r} needs that optimizer's state to compress it, so it is averaged "
                          "uncompressed, as are the others outside it (said once). Pass an optimizer over the whole "
                          "model to compress them, or freeze them (requires_grad_(False)) before wrapping in DDP.",
                          RuntimeWarning, stacklevel=2)
        return True

    def _make_plan(self, bucket: dist.GradBucket, params: List[torch.Tensor]) -> _Plan:
        buffer = bucket.buffer()
        compressed, dense = [], []
        for p, g in zip(params, bucket.gradients()):
            name = self._names.get(p)
            if name is None:
                raise ValueError(f"a parameter of shape {tuple(p.shape)} in DDP bucket {bucket.index()} is not in "
                                 "named_parameters: pass the named_parameters() of the module DDP wraps")
            seg = _Segment(name, (g.data_ptr() - buffer.data_ptr()) // buffer.element_size(), p.numel(),
                           tuple(p.shape))
            small = p.numel() < self.min_compress_numel or buffer.dtype not in wire.DTYPES \
                or not self.compression.compressible(seg.shape)   # e.g. PowerSGD: 1-d tensors
            (dense if small else compressed).append(seg)
        return _Plan(tuple(compressed), tuple(dense))

    # ------------------------------------------------------------ feedback at the optimizer step
    def _received(self, name: str, avg: torch.Tensor, support: Optional[torch.Tensor] = None) -> None:
        """Hand the average of ``name`` to the feedback policy, now or, for a policy that moves
        the parameter itself, when the optimizer steps (not during backward: autograd, clipping
        and a skipped step all expect the parameters to stay put until then). ``support``: see
        :func:`hvd_gradcomp.collectives.reduce.sparse_support`."""
        if not self.compression.feedback.moves_parameters:
            self.compression.received(name, avg, support)
            return
        # The average is an update *direction* (FrozenVariance: momentum or gradient / sqrt(v)), not a gradient:
        # kept apart until the step, and zeros go to p.grad, as on the Horovod road. Left in p.grad,
        # a clip_grad_norm_(model.parameters(), 1.0) before opt.step() saw its norm (far above a
        # gradient's) and shortened every step by as much. A non-finite average stays in p.grad,
        # where the optimizer meets it.
        kept = None
        if kernels.all_finite(avg):
            kept = self._kept.get(name)
            kept = self._kept[name] = avg.clone() if kept is None or kept.shape != avg.shape else kept.copy_(avg)
            avg.zero_()
        self._at_step[name] = kept

    def _exchanged_average(self, seg: "_Segment", buffer: torch.Tensor) -> None:
        """Note that the exchange wrote ``seg``'s average into ``buffer`` (see :meth:`_give_unused`);
        only where the feedback policy keeps state that the optimizer must stay in step with."""
        feedback = self.compression.feedback
        if feedback.key != "none" and not feedback.moves_parameters:
            self._exchanged[seg.name] = (buffer, seg)

    def _give_unused(self) -> None:
        """Before the optimizer steps (:meth:`_before_step`): a compressed parameter that DDP left without a gradient (unused by
        every rank in this step's forward, with ``find_unused_parameters=True``) gets its exchange's
        average as its gradient, as the Horovod road gives one to every parameter.

        Why: the hook ran its error-feedback policy on the zeros DDP put in the bucket (the residual
        and DGC's velocity moved on, what they owed was sent and averaged), and momentum correction
        rewrote the average for SGD's momentum buffer. Skipped by the optimizer, that movement was
        lost and SGD's momentum fell out of step with the correction: momentum SGD through
        TopKQSGD(1%, 8) diverged on a model with a layer used every other step. Only a gradient
        left ``None``: a zero gradient kept by ``zero_grad(set_to_none=False)`` cannot be told
        from the user's own, and is left alone."""
        with self._lock:
            done, self._exchanged = self._exchanged, {}
        for name, (buffer, seg) in done.items():
            p = self._by_name[name]
            if p.grad is not None:
                continue
            p.grad = seg.view(buffer).view(seg.shape).clone()
            if not self._unused_said and self.rank == 0:
                self._unused_said = True
                warnings.warn(
                    f"hvd_gradcomp DDP hook: parameter {name!r} got no gradient from DDP in this step (unused by "
                    "every rank's forward); its compressed exchange still carried what error feedback owed it, "
                    "so that average is set as its gradient and the optimizer steps it, as on the Horovod road "
                    f"(said once). To keep such a parameter out of compression: exclude=r'^{re.escape(name)}$'.",
                    RuntimeWarning, stacklevel=5)   # the user's opt.step(), past torch's step wrapper

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Tuple[Any, ...],
                     kwargs: Dict[str, Any]) -> Optional[Tuple[Tuple[Any, ...], Dict[str, Any]]]:
        """Optimizer step pre-hook: finish this step's exchange for the optimizer (:meth:`_finish_exchange`).

        With ``optimizer.step(closure)`` (Lightning's automatic optimization, LBFGS) the closure runs the
        forward and backward passes *inside* ``step``, after this hook: the exchange it starts is
        finished when the closure returns, before the optimizer's arithmetic, so a step with a closure
        moves the parameters exactly as ``backward()`` then ``step()``. Finished here instead, each
        ``frozen`` update landed one step late and the last one never. Returns the arguments with the
        closure wrapped (torch's step pre-hook protocol)."""
        self._finish_exchange()   # a backward() before step(closure), or no closure at all
        return _after_closure(args, kwargs, self._finish_exchange)

    def _finish_exchange(self) -> None:
        """Hand the optimizer what this step's exchange owes it: the deferred :meth:`_received` calls
        of a policy that moves the parameters (on the averages kept apart or, non-finite, left in
        ``p.grad``), and the averages of parameters DDP left without a gradient (:meth:`_give_unused`)."""
        with self._lock:
            pending, self._at_step = self._at_step, {}
            for name, kept in pending.items():
                avg = kept if kept is not None else self._by_name[name].grad
                if avg is not None:
                    self.compression.received(name, avg)
        self._give_unused()

    @property
    def pending_updates(self) -> int:
        """Averaged updates exchanged but not yet applied (``feedback="frozen"``: applied when the optimizer
        steps). 0 after every ``optimizer.step()``; a checkpoint taken with updates pending would lose them."""
        return len(self._at_step)

    # ------------------------------------------------------------ ordering
    def _then_in_order(self, deps: List[Future], launch: Callable[[], Optional[Tuple[Future, Callable]]],
                       result: Future, buffer: torch.Tensor, finish_dense: Callable[[], None]) -> None:
        """Run ``launch()`` when ``deps`` are done *and* the previous bucket's launch has run (see
        :class:`hvd_gradcomp.ddp.roads._InOrder`). A method, so that Auto's view of the state times it."""
        self._in_order.then(deps, launch, result, buffer, finish_dense)


def gradcomp_hook(state: GradCompState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average ``bucket`` over the ranks with ``state.compression``.

    Args:
        state: a :class:`GradCompState`.
        bucket: the flat gradient bucket DDP hands over.

    Returns:
        A future whose value is the averaged bucket buffer (written in place).

    Example::

        >>> ddp_model.register_comm_hook(state, gradcomp_hook)    # doctest: +SKIP
    """
    if join.step_with_joined(state, bucket):   # some rank is inside model.join(): see hvd_gradcomp.ddp.join
        return join.joined_bucket(state, bucket)
    if clips_whole_step(state.compression):
        return _held_until_last(state, bucket)
    return _hook_now(state, bucket)


def _held_until_last(state: GradCompState, bucket: dist.GradBucket) -> Future:
    """``clip=``: every bucket of the step waits for the last one; then this rank's whole gradient is
    clipped to one global norm (:meth:`GradientCompressor.clip_local`, every tensor, compressed or
    not) and each bucket goes its road, in index order. The exchanges start once backward is over."""
    result: Future = Future()
    if bucket.index() == 0:
        state._held = []   # a new backward pass: nothing left of one that raised before its last bucket
    state._held.append((bucket, result))
    if not bucket.is_last():
        return result
    held, state._held = state._held, []
    state.last_local_norm = state.compression.clip_local([b.buffer() for b, _ in held])
    for b, res in held:
        _relay(_hook_now(state, b), res)
    return result


def _relay(source: Future, target: Future) -> None:
    """Complete ``target`` with ``source``'s value or error."""
    def done(fut: Future) -> None:
        try:
            target.set_result(fut.value())
        except Exception as err:   # noqa: BLE001 - handed on to DDP, which raises it in backward
            target.set_exception(err)
    source.add_done_callback(done)


def _after_closure(args: Tuple[Any, ...], kwargs: Dict[str, Any], then: Callable[[], None]
                   ) -> Optional[Tuple[Tuple[Any, ...], Dict[str, Any]]]:
    """``optimizer.step``'s arguments with its closure (positional or ``closure=``) followed by ``then()`` each
    time the optimizer calls it (LBFGS calls it several times); None without a closure."""
    at_args = len(args) > 1 and args[1] is not None
    closure = args[1] if at_args else kwargs.get("closure")
    if closure is None:
        return None

    def wrapped() -> Any:
        loss = closure()
        then()
        return loss
    return ((args[0], wrapped, *args[2:]), kwargs) if at_args else (args, {**kwargs, "closure": wrapped})


def _hook_now(state: GradCompState, bucket: dist.GradBucket) -> Future:
    """:func:`gradcomp_hook` on one bucket, now."""
    buffer = bucket.buffer()
    step = state.iter
    if bucket.is_last():  # DDP launches buckets in index order: the last one closes the exchange
        state.iter += 1
        with state._lock:   # the roads' callbacks record into the ledger from other threads
            state.comm_stats.end_step(state.iter)
    comp = state.compression
    if state.auto is not None and step >= state.start_compress_iter:
        return state.auto.hook(bucket, buffer, step)
    if not isinstance(comp, GradientCompressor) or step < state.start_compress_iter:
        return _allreduce(state, buffer, step, "dense", comp if comp in DENSE_DTYPES else None)
    plan = state._plan(bucket)
    if not plan.compressed:
        return _dense_bucket(state, buffer, plan, step)
    return _ROADS[comp.collective](state, buffer, plan, step)


# ---------------------------------------------------------------- registration
def register(ddp_model: torch.nn.parallel.DistributedDataParallel,
             compression: Any = _DEFAULT_COMPRESSION, process_group: Optional[dist.ProcessGroup] = None,
             start_compress_iter: int = 0, min_compress_numel: int = DEFAULT_MIN_COMPRESS_NUMEL,
             optimizer: Optional[torch.optim.Optimizer] = None) -> GradCompState:
    """Register :func:`gradcomp_hook` on ``ddp_model`` and return its :class:`GradCompState`.

    ``compression`` defaults to a fresh ``TopKQSGD(ratio=0.01, bits=8)``; ``optimizer`` (the one
    stepping the model) lets its ``feedback="auto"`` choose DGC momentum correction for SGD with
    momentum; see :class:`GradCompState` for the other arguments. Call it on every rank, before
    the first backward pass (DDP allows one hook per model).

    Example::

        >>> model = DistributedDataParallel(net)                                       # doctest: +SKIP
        >>> state = register(model, compression=TopKQSGD(ratio=0.01, bits=8))          # doctest: +SKIP
        >>> loss.backward(); opt.step(); print(state.comm_stats.summary())             # doctest: +SKIP
    """
    if not isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(f"register() takes a torch.nn.parallel.DistributedDataParallel model, got "
                        f"{type(ddp_model).__name__}: wrap it first, DistributedDataParallel(model)")
    if compression is _DEFAULT_COMPRESSION:
        compression = copy.deepcopy(_DEFAULT_COMPRESSION)
    optimizer = torch_optimizer(optimizer)
    _check_compression(compression)   # before the rank-0-only warning reads it: the same error on every rank
    group = process_group if process_group is not None else ddp_model.process_group
    _warn_unread_settings(compression, dist.get_rank(group) if dist.is_initialized() else 0)
    state = GradCompState(group, compression, named_parameters=ddp_model.module.named_parameters(),
                          start_compress_iter=start_compress_iter, min_compress_numel=min_compress_numel,
                          optimizer=optimizer)
    ddp_model.register_comm_hook(state, gradcomp_hook)
    join.install(ddp_model, state, optimizer)
    _STATES[ddp_model] = state
    return state


def compression_from_env(env: Optional[Dict[str, str]] = None) -> Any:
    """The ``compression`` argument the ``HVDGC_*`` settings name (see :mod:`hvd_gradcomp.config`).

    ``hvdgc-launch --launcher torchrun --compression topk-qsgd ... train.py`` exports them;
    ``fp16`` becomes ``torch.float16`` here, since DDP has no Horovod compressor.

    >>> compression_from_env({"HVDGC_COMPRESSION": "qsgd", "HVDGC_BITS": "4"})
    QSGD(bits=4, bucket_size=512, error_feedback=True)
    >>> compression_from_env({"HVDGC_COMPRESSION": "fp16"})
    torch.float16
    """
    from ..config import from_env

    cfg = from_env(env)
    return torch.float16 if cfg.compression == "fp16" else cfg.make_compressor()


_settings_checked = False


def _warn_unread_settings(compression: Any, rank: int) -> None:
    """Once, on rank 0: HVDGC_* settings the script neither read nor matched (see the settings module)."""
    global _settings_checked
    if _settings_checked or rank != 0:
        return
    _settings_checked = True
    message = unread_settings_message(compression)
    if message:
        warnings.warn(message, UserWarning, stacklevel=3)


def unread_settings_message(compression: Any, env: Optional[Dict[str, str]] = None) -> Optional[str]:
    """What :func:`register` warns when ``hvdgc-launch`` set ``HVDGC_*`` but the script built something else.

    >>> print(unread_settings_message(None, {"HVDGC_COMPRESSION": "qsgd"}))  # doctest: +ELLIPSIS
    HVDGC_COMPRESSION=qsgd is set (hvdgc-launch sets them), but this script built hvd_gradcomp.ddp.register(...
    >>> unread_settings_message(TopKQSGD(ratio=0.05), {"HVDGC_COMPRESSION": "topk-qsgd", "HVDGC_RATIO": "0.05"})
    """
    if compression is None or compression in DENSE_DTYPES:
        built: Dict[str, Any] = {"compression": "none" if compression is None else "fp16"}
    elif isinstance(compression, Auto):
        sparse = compression.sparse
        built = {"compression": "auto", "ratio": sparse.ratio, "bits": sparse.bits,
                 "error_feedback": sparse.error_feedback, "seed": sparse.seed}
    else:
        built = {"compression": codecs.name_of(compression), "error_feedback": compression.error_feedback, "seed": compression.seed}
        built.update({k: getattr(compression, k) for k in ("ratio", "bits") if hasattr(compression, k)})
    return settings.unread_settings_message(built, env, f"hvd_gradcomp.ddp.register(compression={compression!r})")


# ---------------------------------------------------------------- accumulation
_STATES: "weakref.WeakKeyDictionary[Any, GradCompState]" = weakref.WeakKeyDictionary()
"""The state :func:`register` gave each DDP model (what its accumulator's ``max_grad_norm`` checks)."""


class GradientAccumulator:
    """N micro-batches, one compressed exchange: DDP's ``no_sync()`` plus loss scaling and tail flush.

    The first N-1 micro-batches of a window run under ``ddp_model.no_sync()`` (gradients add
    up locally, nothing is sent); the N-th runs normally, so the hook compresses and exchanges
    the accumulated gradient once, exactly as it would one N times larger batch. Each loss
    is scaled by 1/N. Forward *and* backward must run inside :meth:`accumulate`, since DDP
    decides at the forward pass whether the backward pass synchronises.

    ``flush()`` ends a partial window of k < N micro-batches (the end of an epoch): their
    gradients never left the rank, so it averages them with one uncompressed allreduce per
    dtype, rescales by N/k and steps. Call it on every rank. (The hook does not see that
    window: under ``feedback="frozen"`` the wrapped Adam steps it with its own state.)

    ``max_grad_norm``: clip the averaged gradients to this norm before each step
    (``last_grad_norm``: the norm before clipping, a tensor). Under ``feedback="frozen"``, after
    a tensor's dense warm-up its ``p.grad`` holds zeros (the update is applied at the step): the
    clipping then covers the uncompressed tensors only; the compressor's ``clip=`` bounds the rest.

    Example::

        acc = gc_ddp.GradientAccumulator(model, opt, steps=8, micro_batch=4)
        for x, y in loader:
            with acc.accumulate():
                acc.backward(loss_fn(model(x), y))      # steps on every 8th call
        acc.flush()
    """

    def __init__(self, ddp_model: torch.nn.parallel.DistributedDataParallel, optimizer: torch.optim.Optimizer,
                 steps: int, micro_batch: Optional[int] = None, max_grad_norm: Optional[float] = None) -> None:
        if not isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel):
            raise TypeError(f"GradientAccumulator takes the DistributedDataParallel model, got "
                            f"{type(ddp_model).__name__}")
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps must be an int >= 1 (micro-batches per optimizer step), got {steps!r}")
        self.model, self.optimizer, self.steps, self.micro_batch = ddp_model, optimizer, steps, micro_batch
        self.max_grad_norm = check_max_grad_norm(max_grad_norm)
        if self.max_grad_norm is not None and ddp_model in _STATES:
            # register() chose the hook's policy: refuse now rather than at the first step (a hook
            # registered after this accumulator is checked then)
            check_clippable(_STATES[ddp_model].compression)
        self.last_grad_norm: Optional[torch.Tensor] = None
        self.pending = 0
        self.optimizer_steps = 0
        self._inside = False

    @contextmanager
    def accumulate(self) -> Iterator[None]:
        """Wrap one micro-batch's forward and backward: no_sync unless it completes the window."""
        self._inside = True
        try:
            with self.model.no_sync() if self.pending + 1 < self.steps else nullcontext():
                yield
        finally:
            self._inside = False

    def backward(self, loss: torch.Tensor) -> bool:
        """``(loss / steps).backward()``; steps and zeroes the gradients on every ``steps``-th call."""
        if not self._inside:
            raise RuntimeError("call backward() inside `with acc.accumulate():`, around the forward pass too "
                               "(DDP decides at the forward pass whether to synchronise)")
        if loss.dim() != 0:
            raise ValueError(f"loss must be a scalar (reduce it with .mean()), got shape {tuple(loss.shape)}")
        (loss / self.steps).backward()
        self.pending += 1
        if self.pending == self.steps:
            self._step()
            return True
        return False

    def flush(self) -> bool:
        """Average, rescale and step on a partial window (see the class docstring); False if empty."""
        if self.pending == 0:
            return False
        params = [p for p in self.model.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        group = self.model.process_group
        scale = self.steps / self.pending / dist.get_world_size(group)
        by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
        for p in params:
            by_dtype.setdefault(p.grad.dtype, []).append(p)
        for dtype in sorted(by_dtype, key=str):  # the same order on every rank
            grads = [p.grad for p in by_dtype[dtype]]
            flat = torch.cat([g.reshape(-1) for g in grads]).mul_(scale)
            dist.all_reduce(flat, group=group)
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
        self._step()
        return True

    def _step(self) -> None:
        if self.max_grad_norm is not None:
            state = _STATES.get(self.model)
            check_clippable(state.compression if state is not None else None)
            self.last_grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.pending = 0
        self.optimizer_steps += 1

    def effective_batch(self) -> Optional[int]:
        """micro_batch x steps x ranks (None when micro_batch is unknown)."""
        if self.micro_batch is None:
            return None
        return self.micro_batch * self.steps * dist.get_world_size(self.model.process_group)


# ---------------------------------------------------------------- helpers
# Feedback policies the hook can run. "frozen" and "update" move the parameters themselves: their
# averages are kept apart and applied when the optimizer steps (GradCompState._received); "update"
# steps each rank's private copy of the optimizer on its local gradient in the hook (the parameters
# it reads stay put until that step).
HOOK_POLICIES = ("none", "classic", "momentum", "frozen", "update")


def _choose_feedback(comp: GradientCompressor, optimizer: Optional[torch.optim.Optimizer],
                     names: Dict[torch.Tensor, str], rank: int) -> None:
    """The compressor's feedback policy for the hook, bound to ``optimizer``'s param groups
    (see ``optimizer`` in :class:`GradCompState`); the choice is said once on rank 0."""
    if comp.feedback.key not in HOOK_POLICIES:
        raise ValueError(f"feedback={comp.feedback.key!r} cannot run in the DDP hook, which runs the policies "
                         f"{', '.join(repr(k) for k in HOOK_POLICIES)}: use feedback='frozen' for Adam/AdamW, "
                         "'update' for other adaptive optimizers, 'momentum' for SGD with momentum, or 'classic'")
    auto = comp.feedback_choice == "auto" and not comp._restored
    dense_codec = codecs.nature_of(comp) == codecs.DENSE   # its choice does not depend on the optimizer (feedback.choose)
    if optimizer is None:
        if isinstance(comp.feedback, MomentumCorrection) and comp.feedback.momentum is None:
            raise ValueError("feedback='momentum' reads the momentum from the optimizer: pass optimizer= to "
                             "register() / GradCompState (or feedback=MomentumCorrection(momentum=m))")
        if comp.feedback.moves_parameters:
            does = "steps a private copy of the optimizer on each rank" if comp.feedback.key == "update" \
                else "freezes and steps the optimizer's Adam state"
            raise ValueError(f"feedback={comp.feedback.key!r} {does}: pass optimizer= to register() / GradCompState")
        if not (auto and dense_codec):   # (low-bit QSGD gets 'none' here too: classic shrank 2-bit averages)
            if auto and rank == 0:  # said once: with Adam/AdamW classic error feedback trains far worse
                fb.announce(f"{comp!r} in the DDP hook: classic error feedback, because no optimizer was given. "
                            "Pass optimizer=opt to register() so the hook picks the policy for it: momentum "
                            "correction for SGD(momentum > 0), 'frozen' for Adam/AdamW, 'update' for other "
                            "adaptive optimizers (see docs/FEEDBACK.md).")
            return
    else:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if not any(p in names for g in optimizer.param_groups for p in g["params"]):
            raise ValueError("the optimizer steps none of the wrapped module's parameters: pass the optimizer "
                             "built on this model's parameters")
    why = "chosen by the user"
    if auto:
        key, why = fb.choose(optimizer, dense_codec, comp._contracting)   # as on the Horovod roads
        if key != comp.feedback.key:
            comp._set_policy(comp._auto_policy(key))
    if optimizer is not None:
        comp.bind_groups(optimizer, names)
    if rank == 0:
        with_opt = f" with {type(optimizer).__name__}" if optimizer is not None else ""
        fb.announce(f"{comp!r} in the DDP hook{with_opt}: feedback '{comp.feedback.key}' "
                    f"({comp.feedback.describe()}; {why})." + comp._caution())


def torch_optimizer(optimizer: Any) -> Optional[torch.optim.Optimizer]:
    """The ``torch.optim.Optimizer`` inside a framework's wrapper (accelerate's ``AcceleratedOptimizer``
    keeps it as ``.optimizer``, Lightning's ``LightningOptimizer`` as ``._optimizer``), or ``optimizer``
    itself. The hook's step pre-hooks go on the torch optimizer, which every wrapper's ``step()`` calls.

    >>> opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    >>> class Wrapper(torch.optim.Optimizer):     # as accelerate's: an Optimizer around an Optimizer
    ...     def __init__(self, optimizer): self.optimizer = optimizer
    >>> torch_optimizer(Wrapper(opt)) is opt, torch_optimizer(opt) is opt, torch_optimizer(None)
    (True, True, None)
    """
    for _ in range(4):   # AcceleratedOptimizer subclasses torch's Optimizer: unwrap by what it holds
        inner = getattr(optimizer, "optimizer", None) or getattr(optimizer, "_optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            break
        optimizer = inner
    return optimizer


def _check_compression(compression: Any) -> None:
    refuse_class(compression, "register")
    if compression is None or isinstance(compression, (GradientCompressor, Auto)) or compression in DENSE_DTYPES:
        return
    hint = " (for Horovod's fp16 compressor use torch.float16)" if "Compress" in type(compression).__name__ or \
        "Compress" in getattr(compression, "__name__", "") else ""
    if isinstance(compression, str):
        hint = (f"; names such as {compression!r} are for hvdgc-launch --compression (HVDGC_COMPRESSION): "
                "hvd_gradcomp.ddp.compression_from_env() builds one from them")
    raise ValueError(f"compression must be an hvd_gradcomp compressor (TopKQSGD, TopK, QSGD, PowerSGD), gc.Auto(), None or "
                     f"torch.float16/torch.bfloat16, got {compression!r}{hint}")


def _name_map(named_parameters: Iterable[Tuple[str, torch.Tensor]]) -> Dict[torch.Tensor, str]:
    named = list(named_parameters)
    if any(not isinstance(t, tuple) or len(t) != 2 for t in named):
        raise ValueError("named_parameters should be (name, parameter) pairs, usually module.named_parameters()")
    names = [n for n, _ in named]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise ValueError(f"parameter names must be unique; duplicated: {dups}")
    return {p: n for n, p in named}


__all__ = ["GradCompState", "gradcomp_hook", "register", "compression_from_env", "GradientAccumulator",
           "torch_optimizer"]
