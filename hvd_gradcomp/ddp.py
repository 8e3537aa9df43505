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
import atexit
import copy
import re
import threading
import time
import warnings
import weakref
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from . import feedback as fb
from . import codecs, kernels, settings, wire
from .accumulate import check_clippable, check_max_grad_norm
from .auto import Auto
from .compressors import DEFAULT_MIN_COMPRESS_NUMEL, GradientCompressor, TopKQSGD, payload_size, refuse_class
from .exchange import chunk_bounds, decode_payloads, reduce_payloads, sparse_support, sum_parts
from .policy import DENSE, FP16, QSGD_AR, SPARSE
from .stats import ByteStats

DENSE_DTYPES = (torch.float16, torch.bfloat16)
STATE_VERSION = 1
_DEFAULT_COMPRESSION = TopKQSGD(ratio=0.01, bits=8)
_CLAIMED: "weakref.WeakSet[GradientCompressor]" = weakref.WeakSet()
# Process groups a hook uses stay referenced here. Callbacks run on the groups' worker threads;
# if one of them dropped the last reference (the user let go of model and state while a
# callback was unwinding), the group would be destroyed from its own worker thread, which
# aborts the process ("Resource deadlock avoided").
_KEEP_ALIVE: List[Any] = []

Future = torch.futures.Future


# This module's callbacks still held by a collective's worker thread: weak references, so an
# entry leaves when its thread releases the callback, after running it (see _drain_at_exit).
_PENDING: "weakref.WeakSet[Callable[[Future], Any]]" = weakref.WeakSet()


def _then(fut: Future, fn: Callable[[Future], Any]) -> Future:
    """``fut.then(fn)``, with the callback counted in ``_PENDING`` until its thread lets go of it.

    Example::

        >>> f = Future(); g = _then(f, lambda done: done.value() + 1); f.set_result(1); g.wait()
        2
    """
    def run(done: Future) -> Any:  # a callable of our own: ``fn`` may be shared or not weak-referenceable
        return fn(done)

    _PENDING.add(run)
    return fut.then(run)


def _drain_at_exit(timeout: float = 5.0, settle: float = 0.02) -> None:
    """At interpreter exit, let the collectives' worker threads finish with this module's callbacks.

    Why: after a callback hands DDP its result, the worker thread that ran it still needs the
    GIL, to release the callback and then the collective's tensors. DDP already returned, so the
    main thread may be exiting; a thread that asks for the GIL once Python has begun shutting
    down is stopped inside C++ and the process aborts ("terminate called without an active
    exception", SIGABRT, pytorch/pytorch#190489) after training that succeeded: a failed job
    to its launcher. ``atexit`` runs while other threads may still take the GIL: wait (the
    GIL released) until every callback was released, at most ``timeout`` seconds (a collective
    whose peer died never completes), then ``settle`` seconds for the tensors' release.
    """
    if not _PENDING and not _KEEP_ALIVE:
        return
    deadline = time.monotonic() + timeout
    while _PENDING and time.monotonic() < deadline:
        time.sleep(0.001)
    time.sleep(settle)


atexit.register(_drain_at_exit)
# all_gather_into_tensor was renamed all_gather_single (torch 2.10); both gather equal-sized tensors.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class _Segment:
    """One parameter's gradient inside a bucket's flat buffer."""

    name: str
    offset: int
    numel: int
    shape: Tuple[int, ...]

    def view(self, buffer: torch.Tensor) -> torch.Tensor:
        return buffer[self.offset:self.offset + self.numel]


@dataclass(frozen=True)
class _Plan:
    """A bucket split into compressed and dense segments."""

    compressed: Tuple[_Segment, ...]
    dense: Tuple[_Segment, ...]


class GradCompState:
    """State of :func:`gradcomp_hook`: settings first, then residuals, counters and statistics.

    Args:
        process_group: the group to average over (None: the default group).
        compression: an hvd-gradcomp compressor (``TopKQSGD``, ``TopK``, ``QSGD``), ``gc.Auto()``
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
            classic error feedback otherwise; the choice is said once on rank 0. Without it:
            classic. Under ``"frozen"`` the parameters move when the optimizer steps (a step
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
                _choose_feedback(compression, optimizer, self._names, self.rank)
                if compression.feedback.moves_parameters:  # "frozen": applied at the optimizer step
                    self._step_hook = optimizer.register_step_pre_hook(self._apply_at_step)
            self._by_name = {n: p for p, n in self._names.items()}
            if optimizer is not None:
                self._unused_hook = optimizer.register_step_pre_hook(self._give_unused)
            ranks = dist.get_process_group_ranks(self.process_group)
            self._second = dist.new_group(ranks=ranks, backend=dist.get_backend(self.process_group))
            _KEEP_ALIVE.extend([self.process_group, self._second])
        self.iter = 0
        self.comm_stats = ByteStats()   # bytes this rank hands to the collectives, all exchanges
        self.nonfinite_exchanges = 0    # buckets that carried NaN/Inf on some rank
        self._step_bytes: Dict[int, int] = {}
        self._plans: Dict[Tuple[int, Tuple[int, ...]], _Plan] = {}
        self._lock = threading.Lock()   # the compressor is used from the hook and callback threads
        self._launched: Future = _done(None)

    def __repr__(self) -> str:
        return (f"GradCompState(compression={self.compression!r}, start_compress_iter={self.start_compress_iter}, "
                f"min_compress_numel={self.min_compress_numel}, world_size={self.world_size})")

    # ------------------------------------------------------------ statistics
    @property
    def last_step_bytes(self) -> int:
        """Bytes this rank handed to the collectives in the last finished exchange (all buckets)."""
        return self._step_bytes.get(self.iter - 1, 0)

    def _record(self, step: int, name: str, raw: int, sent: int) -> None:
        with self._lock:
            self.comm_stats.record(name, raw, sent)
            self._step_bytes[step] = self._step_bytes.get(step, 0) + sent
            for old in [s for s in self._step_bytes if s < step - 1]:
                del self._step_bytes[old]

    def auto_report(self) -> Dict[str, Any]:
        """With ``compression=gc.Auto()``: :meth:`hvd_gradcomp.Auto.report` of the hook, one
        entry per bucket (named by its compressed parameters, e.g. ``"fc1.weight..fc3.weight (3)"``):
        its road, measured codec milliseconds and payload bytes per road, the probed link."""
        if self.auto is None:
            raise ValueError(f"auto_report() needs compression=gc.Auto(); this state uses {self.compression!r}")
        return self.auto.auto.report()

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> Dict[str, Any]:
        """Residuals, random streams and the exchange counter (not the process group).

        Residuals differ between ranks: save one file per rank, e.g.
        ``torch.save(state.state_dict(), f"hook-rank{dist.get_rank()}.pt")``.
        """
        comp = self.compression
        ours = isinstance(comp, (GradientCompressor, Auto))
        return {"version": STATE_VERSION, "iter": self.iter, "rank": self.rank, "world_size": self.world_size,
                "compressor": type(comp).__name__ if ours else repr(comp),
                "compression": comp.state_dict() if ours else None}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`; the same rank must load its own file."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"hook state of version {state.get('version')!r}; this library reads {STATE_VERSION}")
        if (state["rank"], state["world_size"]) != (self.rank, self.world_size):
            raise ValueError(f"hook state saved by rank {state['rank']} of {state['world_size']} loaded on rank "
                             f"{self.rank} of {self.world_size}: residuals are per rank; load each rank's own file "
                             "with the same number of ranks")
        comp = self.compression
        ours = isinstance(comp, (GradientCompressor, Auto))
        mine = type(comp).__name__ if ours else repr(comp)
        if state["compressor"] != mine:
            raise ValueError(f"hook state was saved with compression {state['compressor']}, this state uses "
                             f"{mine}; build the state with the same compression")
        if ours:
            comp.load_state_dict(state["compression"])
        self.iter = int(state["iter"])

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
        :func:`hvd_gradcomp.exchange.sparse_support`."""
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

    def _give_unused(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Optimizer step pre-hook: a compressed parameter that DDP left without a gradient (unused by
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
                    RuntimeWarning, stacklevel=3)   # the user's opt.step(), past torch's step wrapper

    def _apply_at_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Optimizer step pre-hook: the deferred :meth:`_received` calls, on the averages kept
        apart (or, non-finite, left in ``p.grad``)."""
        with self._lock:
            pending, self._at_step = self._at_step, {}
            for name, kept in pending.items():
                avg = kept if kept is not None else self._by_name[name].grad
                if avg is not None:
                    self.compression.received(name, avg)

    # ------------------------------------------------------------ ordering
    def _then_in_order(self, deps: List[Future], launch: Callable[[], Optional[Tuple[Future, Callable]]],
                       result: Future, buffer: torch.Tensor, finish_dense: Callable[[], None]) -> None:
        """Run ``launch()`` when ``deps`` are done *and* the previous bucket's launch has run.

        ``launch`` issues the second-round collective and returns (its future, decode); it
        returns None when the bucket carries non-finite values. ``result`` gets the buffer.
        """
        previous, mine = self._launched, Future()
        self._launched = mine

        def fail(err: BaseException) -> None:
            if not result.done():
                result.set_exception(err)

        def complete(fut: Optional[Future], decode: Optional[Callable]) -> None:
            try:
                if fut is not None:
                    fut.wait()
                    with self._lock:
                        decode()
                else:
                    buffer.fill_(float("nan"))
                for d in deps:
                    d.wait()  # this callback's CUDA stream too must wait for the dense allreduces
                finish_dense()
                result.set_result(buffer)
            except BaseException as err:  # noqa: BLE001 -- handed to DDP, which raises it in backward
                fail(err)

        def ready(_: Future) -> None:
            try:
                for d in deps:
                    d.wait()  # raises a failed first round (e.g. a peer died)
                launched = launch()
            except BaseException as err:  # noqa: BLE001
                mine.set_result(None)
                fail(err)
                return
            mine.set_result(None)
            if launched is None:
                complete(None, None)
            else:
                _then(launched[0], lambda f: complete(f, launched[1]))

        _then(torch.futures.collect_all(deps + [previous]), ready)


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
    buffer = bucket.buffer()
    step = state.iter
    if bucket.is_last():  # DDP launches buckets in index order: the last one closes the exchange
        state.iter += 1
    comp = state.compression
    if state.auto is not None and step >= state.start_compress_iter:
        return state.auto.hook(bucket, buffer, step)
    if not isinstance(comp, GradientCompressor) or step < state.start_compress_iter:
        return _allreduce(state, buffer, step, "dense", comp if comp in DENSE_DTYPES else None)
    plan = state._plan(bucket)
    if not plan.compressed:
        return _dense_bucket(state, buffer, plan, step)
    return _ROADS[comp.collective](state, buffer, plan, step)


# ---------------------------------------------------------------- dense
def _allreduce(state: GradCompState, flat: torch.Tensor, step: int, name: str,
               cast: Optional[torch.dtype]) -> Future:
    """Average ``flat`` in place by one allreduce (of a ``cast`` copy when given)."""
    send = flat.to(cast) if cast is not None else flat
    send.div_(state.world_size)
    state._record(step, name, flat.numel() * flat.element_size(), send.numel() * send.element_size())
    fut = dist.all_reduce(send, group=state.process_group, async_op=True).get_future()

    def done(f: Future) -> torch.Tensor:
        f.wait()
        if send is not flat:
            flat.copy_(send)
        return flat

    return _then(fut, done)


def _start_dense(state: GradCompState, buffer: torch.Tensor, plan: _Plan, step: int,
                 finite: bool) -> Tuple[List[Future], Callable[[], None]]:
    """The parameters of a compressed bucket that go uncompressed: one allreduce, and one of
    the float16 ones (:func:`_start_half`); returns (futures, copy-back). ``finite``: whether
    this rank's bucket is all finite."""
    _dense_locals(state, buffer, plan.dense)
    half = tuple(s for s in plan.dense if _sends_half(state, s, buffer.dtype))
    full = tuple(s for s in plan.dense if s not in half)
    futs, backs = [], []
    if full:
        flat = torch.cat([s.view(buffer) for s in full])
        futs.append(_allreduce(state, flat, step, "dense", None))
        backs.append((full, flat))
    if half:
        fut, sent = _start_half(state, buffer, half, step, finite)
        futs.append(fut)
        backs.append((half, sent))

    def copy_back() -> None:
        for segs, flat in backs:
            offset = 0
            for s in segs:
                s.view(buffer).copy_(flat[offset:offset + s.numel])
                offset += s.numel
        _dense_averages(state, buffer, plan.dense)

    return futs, copy_back


def _dense_locals(state: GradCompState, buffer: torch.Tensor, segments: Iterable[_Segment]) -> None:
    """Hand this rank's own gradients of the segments that go uncompressed to the feedback policy,
    before their allreduce overwrites them (see
    :meth:`hvd_gradcomp.compressors.GradientCompressor.dense_local`)."""
    with state._lock:
        for s in segments:
            if s.numel >= state.min_compress_numel:   # the policy's dense steps, not the small tensors
                state.compression.dense_local(s.name, s.view(buffer))


def _dense_averages(state: GradCompState, buffer: torch.Tensor, segments: Iterable[_Segment]) -> None:
    """Hand the averages of the segments that went uncompressed to the feedback policy (see
    :meth:`hvd_gradcomp.compressors.GradientCompressor.dense_average`)."""
    for s in segments:
        state.compression.dense_average(s.name, s.view(buffer))


def _sends_half(state: GradCompState, seg: _Segment, dtype: torch.dtype) -> bool:
    """Whether a segment the bucket does not compress travels as float16 (the compressor's
    ``exempt="fp16"``: small or excluded, not a feedback policy's dense warm-up)."""
    return state.compression.sends_half(seg.name, dtype, seg.numel < state.min_compress_numel)


def _start_half(state: GradCompState, buffer: torch.Tensor, segs: Tuple[_Segment, ...], step: int,
                finite: bool) -> Tuple[Future, torch.Tensor]:
    """One allreduce (sum) of the float16 cast of ``segs``, pre-divided by the ranks, with error
    feedback of the cast (:meth:`GradientCompressor.encode_half`): (its future, the float16
    tensor, which holds the average once done). A rank whose bucket holds NaN/Inf
    sends the cast alone and keeps its residuals, as the compressed segments do."""
    with state._lock:
        if finite:
            half, _ = state.compression.encode_half([(s.name, s.view(buffer).view(s.shape)) for s in segs],
                                                    state.world_size)
        else:
            half, _ = kernels.to_half_saturated(torch.cat([s.view(buffer) for s in segs]), state.world_size)
    state._record(step, "exempt.fp16", sum(s.numel for s in segs) * buffer.element_size(),
                  half.numel() * half.element_size())
    return dist.all_reduce(half, group=state.process_group, async_op=True).get_future(), half


def _dense_bucket(state: GradCompState, buffer: torch.Tensor, plan: _Plan, step: int) -> Future:
    """A bucket with nothing to compress this step: one allreduce, or those of
    :func:`_start_dense` when some of it travels as float16."""
    if not any(_sends_half(state, s, buffer.dtype) for s in plan.dense):
        _dense_locals(state, buffer, plan.dense)

        def deliver(f: Future) -> torch.Tensor:
            _dense_averages(state, buffer, plan.dense)
            return f.value()
        return _then(_allreduce(state, buffer, step, "dense", None), deliver)
    futs, copy_back = _start_dense(state, buffer, plan, step, kernels.all_finite(buffer))
    return _when_all(futs, buffer, copy_back)


def _when_all(futs: List[Future], buffer: torch.Tensor, finish: Callable[[], None] = lambda: None) -> Future:
    """A future of ``buffer``, set once every future in ``futs`` is done and ``finish()`` ran.

    Why not ``collect_all(futs).then(...)``: collect_all's future carries no CUDA events. Its
    callback runs on whatever stream the thread that completed the last future had current
    (a callback stream of a ``then``, say), so DDP, waiting on such a future, would not wait
    for that stream: it could read the bucket before ``finish`` wrote the average into it
    (seen on a GPU: ranks drifted apart). Here each future is ``wait()``ed (making the current
    stream wait for its events; value() does not) and the result is a device future, which
    records the callback's stream for DDP to wait on.
    """
    result = Future(devices=[buffer.device]) if buffer.is_cuda else Future()

    def done(f: Future) -> None:
        try:
            for x in f.value():
                x.wait()   # raises a failed collective
            finish()
            result.set_result(buffer)
        except BaseException as err:  # noqa: BLE001 -- handed to DDP, which raises it in backward
            result.set_exception(err)

    _then(torch.futures.collect_all(futs), done)
    return result


def _meta(state: GradCompState, value: int, device: torch.device) -> Tuple[torch.Tensor, Future]:
    """all_gather of one int64 per rank: a payload size, or -1 for non-finite gradients."""
    mine = torch.tensor([value], dtype=torch.int64, device=device)
    out = torch.empty(state.world_size, dtype=torch.int64, device=device)
    work = _all_gather_single(out, mine, group=state.process_group, async_op=True)
    return out, work.get_future()


# ---------------------------------------------------------------- sparse: all_gather
def _allgather(state: GradCompState, buffer: torch.Tensor, plan: _Plan, step: int) -> Future:
    comp, world = state.compression, state.world_size
    with state._lock:
        finite, sends = _encode_sparse(state, buffer, plan)
    payloads = [pl for pl, _ in sends]
    blob = torch.cat(payloads) if payloads else torch.empty(0, dtype=torch.uint8, device=buffer.device)
    sizes, meta_fut = _meta(state, blob.numel() if finite else -1, buffer.device)
    dense_futs, copy_back = _start_dense(state, buffer, plan, step, finite)
    for s, pl in zip(plan.compressed, payloads):
        state._record(step, s.name, s.numel * buffer.element_size(), pl.numel())

    def launch() -> Optional[Tuple[Future, Callable]]:
        counts = sizes.tolist()
        if min(counts) < 0:
            _nonfinite(state)
            return None
        cap = max(counts)
        padded = torch.zeros(cap, dtype=torch.uint8, device=buffer.device)
        padded[:blob.numel()] = blob
        gathered = torch.empty(world * cap, dtype=torch.uint8, device=buffer.device)
        state._record(step, "(sizes+padding)", 0, 8 + cap - blob.numel())
        work = _all_gather_single(gathered, padded, group=state._second, async_op=True)

        def decode() -> None:
            # This rank's own payload is not decoded: what it carries is known from its encoding
            # (the same indices and values, bit for bit, that the other ranks decode from it).
            per_rank = [None if r == state.rank else _split(gathered[r * cap:r * cap + counts[r]],
                                                            len(plan.compressed)) for r in range(world)]
            for j, s in enumerate(plan.compressed):
                others = decode_payloads(comp, [per_rank[r][j] for r in range(world) if r != state.rank],
                                         world - 1, s.numel)
                mine = sends[j][1]
                if buffer.is_cuda:  # made on the hook's stream, read on this callback's: keep them till done
                    for t in mine:
                        t.record_stream(torch.cuda.current_stream(buffer.device))
                parts = others[:state.rank] + [mine] + others[state.rank:]
                sum_parts(parts, True, s.numel, buffer.dtype, out=s.view(buffer))
                # momentum correction: what SGD should see
                state._received(s.name, s.view(buffer), sparse_support(parts))
                state._exchanged_average(s, buffer)

        return work.get_future(), decode

    result = Future(devices=[buffer.device]) if buffer.is_cuda else Future()
    state._then_in_order([meta_fut] + dense_futs, launch, result, buffer, copy_back)
    return result


def _encode_sparse(state: GradCompState, buffer: torch.Tensor, plan: _Plan
                   ) -> Tuple[bool, List[Tuple[torch.Tensor, Any]]]:
    """Whether this rank's bucket is all finite and, if so, (payload, what it carries) per
    compressed segment; nothing is kept from a non-finite bucket.

    Where the feedback policy builds every segment's input and its sum in one pass
    (:attr:`~hvd_gradcomp.feedback.Feedback.marks_input`), all segments are prepared first and
    the verdict is read from those sums (and one sum per other segment): no separate pass over
    the bucket. Either way one host sync (on GPU) decides, for the whole bucket.
    """
    comp = state.compression
    grads = [(s.name, s.view(buffer).view(s.shape)) for s in plan.compressed]
    if comp.clip is not None or not comp.feedback.marks_input:
        if not kernels.all_finite(buffer):  # a host sync: what is sent depends on it
            return False, []
        return True, [comp._send(comp._prepare(name, grad)) for name, grad in grads]
    prepared = [comp._prepare(name, grad, total=True) for name, grad in grads]
    totals = [p.total for p in prepared if p.total is not None]
    rest = [s.view(buffer) for s, p in zip(plan.compressed, prepared) if p.total is None] + \
        [s.view(buffer) for s in plan.dense]
    checks = [torch.isfinite(torch.stack(totals)).all()] if totals else []
    if rest:
        checks.append(kernels.sums_finite(rest))
    # A host sync; a non-finite sum of finite values (an overflow) is told apart exactly.
    if not (bool(torch.stack(checks).all()) or kernels.all_finite(buffer)):
        return False, []   # nothing was kept: the policies keep their state until sent()
    return True, [comp._send(p) for p in prepared]


# ---------------------------------------------------------------- QSGD: compressed allreduce
def _scatter_reduce(state: GradCompState, buffer: torch.Tensor, plan: _Plan, step: int) -> Future:
    comp, world, rank = state.compression, state.world_size, state.rank
    bounds = [chunk_bounds(s.numel, world) for s in plan.compressed]
    # QSGD payload sizes follow from the chunk sizes alone, so no sizes travel.
    sizes = [[payload_size(comp, (e - b,)) for b, e in zip(bd, bd[1:])] for bd in bounds]
    per_dest = [sum(sz[r] for sz in sizes) for r in range(world)]
    with state._lock:
        finite = kernels.all_finite(buffer)  # a host sync: what is sent depends on it
        if finite:
            chunks = [comp._compress_chunks_finite(s.name, s.view(buffer).view(s.shape), bd)
                      for s, bd in zip(plan.compressed, bounds)]
            send = torch.cat([pl for r in range(world) for pls in chunks for pl in pls[r:r + 1]])
        else:
            send = torch.zeros(sum(per_dest), dtype=torch.uint8, device=buffer.device)
    if send.numel() != sum(per_dest):
        raise RuntimeError(f"QSGD payloads of {send.numel()} bytes where the size formula gives {sum(per_dest)}")
    received = torch.empty(world * per_dest[rank], dtype=torch.uint8, device=buffer.device)
    a2a = dist.all_to_all_single(received, send, [per_dest[rank]] * world, per_dest,
                                 group=state.process_group, async_op=True).get_future()
    flags, meta_fut = _meta(state, 1 if finite else -1, buffer.device)
    dense_futs, copy_back = _start_dense(state, buffer, plan, step, finite)
    cap = max(per_dest)
    state._record(step, "(flags)", 0, 8)

    def launch() -> Optional[Tuple[Future, Callable]]:
        if min(flags.tolist()) < 0:
            _nonfinite(state)
            return None
        n = len(plan.compressed)
        from_rank = [_split(received[r * per_dest[rank]:(r + 1) * per_dest[rank]], n) for r in range(world)]
        with state._lock:
            reduced = []
            for j, s in enumerate(plan.compressed):
                mine = reduce_payloads(comp, [from_rank[r][j] for r in range(world)], True, world, buffer.dtype)
                reduced.append(comp.compress_named(f"{s.name}#reduced{rank}", mine, relay=True))
        padded = torch.zeros(cap, dtype=torch.uint8, device=buffer.device)
        padded[:per_dest[rank]] = torch.cat(reduced)
        gathered = torch.empty(world * cap, dtype=torch.uint8, device=buffer.device)
        for j, s in enumerate(plan.compressed):
            to_others = sum(sizes[j]) - sizes[j][rank]
            state._record(step, s.name, s.numel * buffer.element_size(), to_others + reduced[j].numel())
        state._record(step, "(flags+padding)", 0, cap - per_dest[rank])
        work = _all_gather_single(gathered, padded, group=state._second, async_op=True)

        def decode() -> None:
            for r in range(world):
                pls = _split(gathered[r * cap:r * cap + per_dest[r]], n)
                for s, bd, pl in zip(plan.compressed, bounds, pls):
                    chunk = comp.decode(pl).reshape(-1)
                    if chunk.numel() != bd[r + 1] - bd[r]:
                        raise RuntimeError(f"{s.name}: chunk of {chunk.numel()} elements where "
                                           f"{bd[r + 1] - bd[r]} were expected; ranks disagree on the model")
                    s.view(buffer)[bd[r]:bd[r + 1]].copy_(chunk)
            for s in plan.compressed:
                state._received(s.name, s.view(buffer))
                state._exchanged_average(s, buffer)

        return work.get_future(), decode

    result = Future(devices=[buffer.device]) if buffer.is_cuda else Future()
    state._then_in_order([a2a, meta_fut] + dense_futs, launch, result, buffer, copy_back)
    return result


# ---------------------------------------------------------------- PowerSGD: two allreduce rounds
def _rounds(state: GradCompState, buffer: torch.Tensor, plan: _Plan, step: int) -> Future:
    """Low-rank factors (:mod:`hvd_gradcomp.powersgd`): one ``all_reduce`` of every segment's ``P``,
    then, in bucket order on the second group, one of every ``Q`` computed from the averaged ``P``;
    the approximations are written into the bucket. A rank whose bucket holds NaN/Inf sends zeros and
    its flag: the bucket is NaN on every rank and nobody's residual or ``Q`` changes."""
    comp, world = state.compression, state.world_size
    shapes = [comp.factors(s.shape) for s in plan.compressed]   # all matrices: see _make_plan
    with state._lock:
        finite = kernels.all_finite(buffer)  # a host sync: what is sent depends on it
        works = [comp.first_round(s.name, s.view(buffer).view(s.shape)) for s in plan.compressed] if finite else []
    first = torch.cat([w.send.reshape(-1) for w in works]) if works else \
        torch.zeros(sum(n * r for n, _, r in shapes), dtype=torch.float32, device=buffer.device)
    first_fut = dist.all_reduce(first, group=state.process_group, async_op=True).get_future()
    flags, meta_fut = _meta(state, 1 if finite else -1, buffer.device)
    dense_futs, copy_back = _start_dense(state, buffer, plan, step, finite)
    for s, (n, m, r) in zip(plan.compressed, shapes):
        state._record(step, s.name, s.numel * buffer.element_size(), (n + m) * r * 4)
    state._record(step, "(flags)", 0, 8)

    def launch() -> Optional[Tuple[Future, Callable]]:
        if min(flags.tolist()) < 0:
            _nonfinite(state)
            return None
        averaged, seconds, at = first.div_(world), [], 0
        with state._lock:
            for w, (n, _, r) in zip(works, shapes):
                seconds.append(comp.second_round(w, averaged[at:at + n * r]).reshape(-1))
                at += n * r
        second = torch.cat(seconds)
        work = dist.all_reduce(second, group=state._second, async_op=True)

        def decode() -> None:
            averaged, at = second.div_(world), 0
            for w, s, (_, m, r) in zip(works, plan.compressed, shapes):
                comp.finish_rounds(w, averaged[at:at + m * r], s.view(buffer).view(s.shape))
                at += m * r
                state._received(s.name, s.view(buffer))
                state._exchanged_average(s, buffer)

        return work.get_future(), decode

    result = Future(devices=[buffer.device]) if buffer.is_cuda else Future()
    state._then_in_order([first_fut, meta_fut] + dense_futs, launch, result, buffer, copy_back)
    return result


_ROADS: Dict[str, Callable[[GradCompState, torch.Tensor, _Plan, int], Future]] = {
    codecs.ALLGATHER: _allgather, codecs.COMPRESSED_ALLREDUCE: _scatter_reduce,
    codecs.ALLREDUCE_ROUNDS: _rounds}
"""A compressor's declared ``collective`` (:mod:`hvd_gradcomp.codecs`) -> the road of its buckets."""


# ---------------------------------------------------------------- Auto: a road per bucket
class _TorchComm:
    """:class:`hvd_gradcomp.Auto`'s collectives over a ``torch.distributed`` group (the same
    methods as :class:`hvd_gradcomp.auto.HorovodComm`), on the buckets' device."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device) -> None:
        self.group, self.device = group, device
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self._root = dist.get_global_rank(group, 0) if group is not dist.group.WORLD else 0

    def mean(self, t: torch.Tensor, tag: str) -> torch.Tensor:
        t = t.to(self.device, copy=True)
        dist.all_reduce(t, group=self.group)
        return t.div_(self.size).cpu()

    def broadcast(self, t: torch.Tensor, tag: str) -> torch.Tensor:
        t = t.to(self.device, copy=True)
        dist.broadcast(t, src=self._root, group=self.group)
        return t.cpu()

    def allreduce(self, t: torch.Tensor, tag: str) -> None:
        dist.all_reduce(t, group=self.group)
        self._sync()

    def allgather(self, t: torch.Tensor, tag: str) -> None:
        out = torch.empty(self.size * t.numel(), dtype=t.dtype, device=t.device)
        _all_gather_single(out, t, group=self.group)
        self._sync()

    def _sync(self) -> None:  # the probe times the collective, not its launch
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


class _RoadView:
    """The hook state as one of Auto's compressed roads sees it: ``compression`` is that road's
    compressor, everything else (counters, locks, the bucket order) is the state's own. It also
    times the road's codec work for Auto: what runs in the hook (encode), in the second round's
    launch (QSGD's reduce and re-quantisation) and in the decode, and sums the bytes sent.

    Why a view: the road functions (:func:`_allgather`, :func:`_scatter_reduce`) take their
    compressor from the state; a view lets Auto reuse them unchanged, one road per bucket.
    """

    _OWN = ("_state", "compression", "codec_s", "inline_s", "sent", "_clock", "_thread")

    def __init__(self, state: GradCompState, compressor: GradientCompressor, clock: Callable[[], float]) -> None:
        own = {"_state": state, "compression": compressor, "codec_s": 0.0, "inline_s": 0.0, "sent": 0,
               "_clock": clock, "_thread": threading.get_ident()}
        for name, value in own.items():
            object.__setattr__(self, name, value)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(type(self._state), name, None)
        if isinstance(attr, property):
            return attr.fget(self)
        if callable(attr):  # a method: bound to the view, so that it sees the road's compressor
            return attr.__get__(self)
        return getattr(self._state, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self._state, name, value)

    def _record(self, step: int, name: str, raw: int, sent: int) -> None:
        object.__setattr__(self, "sent", self.sent + sent)
        self._state._record(step, name, raw, sent)

    def _timed(self, fn: Callable[[], Any]) -> Any:
        t0 = self._clock()
        try:
            return fn()
        finally:
            dt = self._clock() - t0
            object.__setattr__(self, "codec_s", self.codec_s + dt)
            if threading.get_ident() == self._thread:   # ran inside the hook call: counted once
                object.__setattr__(self, "inline_s", self.inline_s + dt)

    def time_call(self, fn: Callable[..., Future], *args: Any) -> Future:
        """``fn(self, *args)`` (a road function), its own time in the hook added to ``codec_s``."""
        t0 = self._clock()
        fut = fn(self, *args)
        hook_s = self._clock() - t0 - self.inline_s
        object.__setattr__(self, "codec_s", self.codec_s + max(hook_s, 0.0))
        return fut

    def _then_in_order(self, deps: List[Future], launch: Callable[[], Optional[Tuple[Future, Callable]]],
                       result: Future, buffer: torch.Tensor, finish_dense: Callable[[], None]) -> None:
        def timed_launch() -> Optional[Tuple[Future, Callable]]:
            launched = self._timed(launch)
            if launched is None:
                return None
            fut, decode = launched
            return fut, lambda: self._timed(decode)

        self._state._then_in_order(deps, timed_launch, result, buffer, finish_dense)


KEY_SEP = "+"


def _bucket_key(plan: _Plan) -> str:
    """Auto's name for a bucket: its compressed parameters' names joined by ``+`` (so the road of
    each parameter can be read back from Auto's decisions alone, e.g. after a checkpoint)."""
    return KEY_SEP.join(s.name for s in plan.compressed)


class _AutoRoads:
    """The hook's side of :class:`hvd_gradcomp.Auto`: a road per bucket (its compressed
    parameters; the small ones always go dense), decided by Auto from measured codec seconds,
    payload bytes and the probed link, the same on every rank (measurements averaged over the
    ranks, rank 0's decisions broadcast: :meth:`Auto.decide`).

    Roads: ``sparse`` (Auto's TopKQSGD, :func:`_allgather`), ``qsgd`` (Auto's QSGD compressed
    allreduce, :func:`_scatter_reduce`), ``fp16`` (allreduce of an fp16 cast), ``dense``. A
    residual left by one road is added to the parameter's next send on whatever road it takes
    (:meth:`Auto.flush_residuals`), only once the bucket is known finite, so a non-finite step
    loses nothing.

    DDP changes its buckets once, after its first iteration (one bucket first, then buckets in
    the order gradients became ready), and again after a restart. While exploring, a new layout
    starts the exploration again (every road is measured on the buckets that stay). A bucket
    Auto has not decided for (the first iteration after a checkpoint) sends each parameter on
    the road decided for it, one collective per road, so a resumed run is bit-identical.
    """

    def __init__(self, state: GradCompState, auto: Auto) -> None:
        self.state, self.auto = state, auto
        self._step_seen = -1
        self._keys: Dict[str, None] = {}       # buckets of the current step
        self._last_keys: Dict[str, None] = {}  # buckets of the previous step

    def hook(self, bucket: dist.GradBucket, buffer: torch.Tensor, step: int) -> Future:
        state, auto = self.state, self.auto
        if auto._setup is None:
            auto.configure("ddp", _TorchComm(state.process_group, buffer.device), average=True)
        if step != self._step_seen:
            self._begin_step(step)
        clock = self._clock(buffer.device)
        sparse = _RoadView(state, auto.sparse, clock)
        plan = sparse._plan(bucket)
        if not plan.compressed:
            return _allreduce(state, buffer, step, "dense", None)
        key = _bucket_key(plan)
        self._keys[key] = None
        if not auto.exploring and key not in auto.decisions:
            return self._per_parameter(buffer, plan, step)
        road = auto.road_of(key)
        self._flush(plan, buffer, road)
        numel = sum(s.numel for s in plan.compressed)
        itemsize = buffer.element_size()
        # On GPU the codec is timed only while Auto measures (the clock then synchronises).
        timed = buffer.device.type != "cuda" or auto.measuring
        if road in (DENSE, FP16):
            t0 = clock()
            fut = _allreduce(state, buffer, step, road, torch.float16 if road == FP16 else None)
            codec, payload = clock() - t0, numel * (2 if road == FP16 else itemsize)
            return _then(fut, lambda f: self._done(f, key, road, numel, itemsize, codec, payload, timed))
        view = sparse if road == SPARSE else _RoadView(state, auto.qsgd, clock)
        fut = view.time_call(_allgather if road == SPARSE else _scatter_reduce, buffer, plan, step)

        def done(f: Future) -> torch.Tensor:
            payload = (sum(payload_size(auto.qsgd, (s.numel,)) for s in plan.compressed) if road == QSGD_AR
                       else view.sent)
            return self._done(f, key, road, numel, itemsize, view.codec_s, payload, timed)

        return _then(fut, done)

    def _begin_step(self, step: int) -> None:
        """The first bucket of a step (the previous step's exchanges are done on every rank):
        Auto's step begins, and decides when due (a collective)."""
        auto = self.auto
        changed = bool(self._last_keys) and bool(self._keys) and set(self._keys) != set(self._last_keys)
        if self._keys:
            auto.keep_only(list(self._keys) + [k for k in auto.decisions if k not in self._keys and not changed])
        if changed and auto.exploring:   # DDP rebuilt its buckets: measure every road on the new ones
            auto.restart()
        self._step_seen, self._last_keys, self._keys = step, self._keys or self._last_keys, {}
        auto.start_step()

    def _per_parameter(self, buffer: torch.Tensor, plan: _Plan, step: int) -> Future:
        """A bucket Auto did not decide for: each parameter on the road decided for it (dense if
        none), one collective per road; unmeasured."""
        roads = {n: road for key, road in self.auto.decisions.items() for n in key.split(KEY_SEP)}
        by_road: Dict[str, List[_Segment]] = {}
        for s in plan.compressed:
            by_road.setdefault(roads.get(s.name, DENSE), []).append(s)
        for road, segs in by_road.items():
            self._flush(_Plan(tuple(segs), ()), buffer, road)
        state, auto, clock = self.state, self.auto, time.perf_counter
        dense = plan.dense + tuple(by_road.pop(DENSE, ()))
        futs: List[Future] = []
        for road, comp, fn in ((SPARSE, auto.sparse, _allgather), (QSGD_AR, auto.qsgd, _scatter_reduce)):
            if road in by_road:   # the dense segments ride with the first compressed road
                futs.append(fn(_RoadView(state, comp, clock), buffer, _Plan(tuple(by_road[road]), dense), step))
                dense = ()
        for segs, cast in ((by_road.get(FP16, ()), torch.float16), (dense, None)):
            if segs:
                futs.append(_allreduce_segments(state, buffer, tuple(segs), step, cast))
        return _when_all(futs, buffer)

    def _done(self, fut: Future, key: str, road: str, numel: int, itemsize: int, codec_s: float,
              payload: float, timed: bool) -> torch.Tensor:
        out = fut.value()   # raises a failed exchange
        with self.state._lock:
            self.auto.record(key, road, numel, itemsize, codec_s, 0.0, payload, measured=timed)
        return out

    def _flush(self, plan: _Plan, buffer: torch.Tensor, road: str) -> None:
        """Residuals other roads hold for the bucket's parameters go into this send."""
        owed = [s for s in plan.compressed if self.auto.owes(s.name, road)]
        if not owed or not kernels.all_finite(buffer):   # a non-finite step keeps them for the next one
            return
        with self.state._lock:
            for s in owed:
                view = s.view(buffer)
                flushed = self.auto.flush_residuals(s.name, view, road)
                if flushed is not view:
                    view.copy_(flushed.reshape(-1))

    def _clock(self, device: torch.device) -> Callable[[], float]:
        """perf_counter, after the device's queued work while Auto measures (GPU kernels run
        asynchronously: without a sync the codec would look free)."""
        if device.type == "cuda" and self.auto.measuring:
            return lambda: (torch.cuda.synchronize(device), time.perf_counter())[1]
        return time.perf_counter


def _allreduce_segments(state: GradCompState, buffer: torch.Tensor, segs: Tuple[_Segment, ...], step: int,
                        cast: Optional[torch.dtype]) -> Future:
    """Average some segments of ``buffer`` by one allreduce (of a ``cast`` copy when given)."""
    flat = torch.cat([s.view(buffer) for s in segs])

    def copy_back(f: Future) -> torch.Tensor:
        f.value()
        offset = 0
        for s in segs:
            s.view(buffer).copy_(flat[offset:offset + s.numel])
            offset += s.numel
        return buffer

    return _then(_allreduce(state, flat, step, "fp16" if cast is not None else "dense", cast), copy_back)


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
    _check_compression(compression)   # before the rank-0-only warning reads it: the same error on every rank
    group = process_group if process_group is not None else ddp_model.process_group
    _warn_unread_settings(compression, dist.get_rank(group) if dist.is_initialized() else 0)
    state = GradCompState(group, compression, named_parameters=ddp_model.module.named_parameters(),
                          start_compress_iter=start_compress_iter, min_compress_numel=min_compress_numel,
                          optimizer=optimizer)
    ddp_model.register_comm_hook(state, gradcomp_hook)
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
    from .config import from_env

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
# Feedback policies the hook can run ("frozen" through an optimizer step pre-hook, see
# GradCompState._received); "update" needs a private optimizer per rank, the Horovod roads only.
HOOK_POLICIES = ("none", "classic", "momentum", "frozen")


def _choose_feedback(comp: GradientCompressor, optimizer: Optional[torch.optim.Optimizer],
                     names: Dict[torch.Tensor, str], rank: int) -> None:
    """The compressor's feedback policy for the hook, bound to ``optimizer``'s param groups
    (see ``optimizer`` in :class:`GradCompState`); the choice is said once on rank 0."""
    if comp.feedback.key not in HOOK_POLICIES:
        raise ValueError(f"feedback={comp.feedback.key!r} cannot run in the DDP hook ('update' steps a private "
                         "copy of the optimizer on each rank, which only the Horovod roads do): use feedback="
                         "'frozen' for Adam/AdamW, 'momentum' for SGD with momentum, or 'classic'")
    auto = comp.feedback_choice == "auto" and not comp._restored
    dense_codec = comp.collective == codecs.COMPRESSED_ALLREDUCE   # its choice does not depend on the optimizer (feedback.choose)
    if optimizer is None:
        if isinstance(comp.feedback, fb.MomentumCorrection) and comp.feedback.momentum is None:
            raise ValueError("feedback='momentum' reads the momentum from the optimizer: pass optimizer= to "
                             "register() / GradCompState (or feedback=MomentumCorrection(momentum=m))")
        if comp.feedback.moves_parameters:
            raise ValueError(f"feedback={comp.feedback.key!r} freezes and steps the optimizer's Adam state: pass "
                             "optimizer= to register() / GradCompState")
        if not (auto and dense_codec):   # (low-bit QSGD gets 'none' here too: classic shrank 2-bit averages)
            if auto and rank == 0:  # said once: with Adam/AdamW classic error feedback trains far worse
                fb.announce(f"{comp!r} in the DDP hook: classic error feedback, because no optimizer was given. "
                            "Pass optimizer=opt to register() so the hook picks the policy for it: momentum "
                            "correction for SGD(momentum > 0), 'frozen' for Adam/AdamW (see docs/STUDY.md).")
            return
    else:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if not any(p in names for g in optimizer.param_groups for p in g["params"]):
            raise ValueError("the optimizer steps none of the wrapped module's parameters: pass the optimizer "
                             "built on this model's parameters")
    why = "chosen by the user"
    if auto:
        key, why = fb.choose(optimizer, dense_codec, comp._contracting)
        if key not in HOOK_POLICIES:  # 'update' (adaptive optimizers other than Adam/AdamW)
            key, why = "classic", (f"{why}; the Horovod road would use feedback {key!r}, which steps a private "
                                   "copy of the optimizer on each rank; in the DDP hook error feedback is classic")
        if key != comp.feedback.key:
            comp._set_policy(comp._auto_policy(key))
    if optimizer is not None:
        comp.bind_groups(optimizer, names)
    if rank == 0:
        with_opt = f" with {type(optimizer).__name__}" if optimizer is not None else ""
        fb.announce(f"{comp!r} in the DDP hook{with_opt}: feedback '{comp.feedback.key}' "
                    f"({comp.feedback.describe()}; {why})." + comp._caution())


def _check_compression(compression: Any) -> None:
    refuse_class(compression, "register")
    if compression is None or isinstance(compression, (GradientCompressor, Auto)) or compression in DENSE_DTYPES:
        return
    hint = " (for Horovod's fp16 compressor use torch.float16)" if "Compress" in type(compression).__name__ or \
        "Compress" in getattr(compression, "__name__", "") else ""
    if isinstance(compression, str):
        hint = (f"; names such as {compression!r} are for hvdgc-launch --compression (HVDGC_COMPRESSION): "
                "hvd_gradcomp.ddp.compression_from_env() builds one from them")
    raise ValueError(f"compression must be an hvd_gradcomp compressor (TopKQSGD, TopK, QSGD), gc.Auto(), None or "
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


def _nonfinite(state: GradCompState) -> None:
    state.nonfinite_exchanges += 1
    warnings.warn("a gradient bucket held NaN/Inf on some rank: it is NaN on every rank for this step "
                  "(a GradScaler skips such steps; otherwise lower the learning rate or clip)", RuntimeWarning)


def _split(blob: torch.Tensor, expected: int) -> List[torch.Tensor]:
    payloads = wire.split_payloads(blob) if blob.numel() else []
    if len(payloads) != expected:
        raise RuntimeError(f"got {len(payloads)} payloads where {expected} were expected: ranks disagree on "
                           "the model or its buckets")
    return payloads


def _done(value: Any) -> Future:
    fut: Future = Future()
    fut.set_result(value)
    return fut


__all__ = ["GradCompState", "gradcomp_hook", "register", "compression_from_env", "GradientAccumulator"]
