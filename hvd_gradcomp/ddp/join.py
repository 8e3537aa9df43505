"""Uneven inputs under DDP's ``model.join()`` (``torch.distributed.algorithms.Join``) with the hook.

Inside ``with model.join():`` a rank that ran out of batches shadows the others: for every backward
pass they still run, DDP's join hook calls the comm hook with zero-filled buckets
(``_match_all_reduce_for_bwd_pass``) and discards what comes back. The compressed exchanges cannot run
so: a joined rank would encode its residual as a gradient and move its feedback state, and the
sparse payloads' sizes would disagree. So, while ``model.join()`` is active (:func:`install`, called by
:func:`hvd_gradcomp.ddp.register`):

* at the first bucket of every step each rank adds 1 (training) or 0 (joined) to a one-float
  allreduce: the ranks still training (:meth:`JoinWatch.count`);
* a step where some rank has joined travels dense (:func:`joined_bucket`): a rank still training encodes
  each compressed parameter as in any step (its residual keeps what the codec did not carry) and sends
  what the payload carries, decoded, with the bucket's uncompressed parameters, in one float32 allreduce
  (Sum) per bucket; a joined rank adds zeros and touches nothing (its residuals, velocities and
  private optimizers stay as they were, for its next step); the sum is divided as uncompressed DDP
  divides: by every rank with ``divide_by_initial_world_size=True`` (torch's default), by the ranks
  still training with ``False``;
* when every rank has joined, after DDP's own broadcast of parameters and buffers from the rank that
  trained last (``post_hook``), every rank takes that rank's shared hook state (the exchange counter,
  the compressor's :meth:`~hvd_gradcomp.codecs.compressor.GradientCompressor.shared_state`) and, given
  ``register(optimizer=...)``, its optimizer state; each keeps its own residuals.
"""
# No `from __future__ import annotations`: as in hvd_gradcomp.ddp.
import weakref
from typing import Any, List, Optional

import torch
import torch.distributed as dist

from .. import codecs
from ..auto import Auto
from ..codecs.compressor import GradientCompressor
from ..codecs.steps import state_to_cpu, state_to_device
from ..collectives.reduce import own_dense
from ..collectives.rounds import finish as finish_rounds
from ..collectives.rounds import low_rank_rounds
from ..feedback import kernels
from .exchanges import Future, _then

State = Any   # hvd_gradcomp.ddp.GradCompState (this module is imported by it)


class JoinWatch:
    """What the hook knows of ``model.join()`` for one DDP model: whether it is active, whether this rank
    has joined (set while DDP's join hook shadows a step), this step's ranks still training and DDP's
    ``divide_by_initial_world_size``."""

    def __init__(self, ddp_model: Any, optimizer: Optional[torch.optim.Optimizer]) -> None:
        self._model = weakref.ref(ddp_model)
        self._optimizer = optimizer
        self.joined = False             # this rank is inside DDP's join hook (a shadow step)
        self.divide_by_initial_world_size = True
        self.training: Optional[int] = None   # this step's ranks still training (None: not counted)
        self.join_steps = 0             # steps this rank exchanged while some rank had joined
        self.ended = False              # the last model.join() ended (torch leaves its config enabled)

    def active(self) -> bool:
        model = self._model()
        return model is not None and not self.ended and \
            bool(getattr(getattr(model, "_join_config", None), "enable", False))

    def count(self, state: State, bucket: dist.GradBucket) -> int:
        """At the first bucket of a step, the ranks still training (a blocking one-float allreduce: a joined
        rank adds 0); every other bucket of the step reuses it."""
        if bucket.index() == 0 or self.training is None:
            flag = torch.zeros(1, device=bucket.buffer().device) if self.joined else \
                torch.ones(1, device=bucket.buffer().device)
            dist.all_reduce(flag, group=state.process_group)
            self.training = int(flag.item())
        return self.training

    def divisor(self, state: State) -> int:
        return state.world_size if self.divide_by_initial_world_size else self.training

    def wrap(self, join_hook: Any) -> Any:
        """DDP's ``join_hook`` factory, whose hooks tell this watch when this rank shadows a step and,
        at the end, sync the hook's state (see the module docstring)."""
        watch = self

        def factory(**kwargs: Any) -> Any:
            hook = join_hook(**kwargs)
            watch.ended = False
            watch.divide_by_initial_world_size = bool(kwargs.get("divide_by_initial_world_size", True))
            main, post = hook.main_hook, hook.post_hook

            def main_hook() -> None:
                watch.joined = True
                try:
                    main()
                finally:
                    watch.joined = False

            def post_hook(is_last_joiner: bool) -> None:
                post(is_last_joiner)
                watch.sync(getattr(watch._model(), "_authoritative_rank", None))
                watch.ended = True   # no step is counted after it (until the next model.join())

            hook.main_hook, hook.post_hook = main_hook, post_hook
            return hook
        return factory

    def sync(self, root: Optional[int]) -> None:
        """Every rank takes ``root``'s shared hook state and optimizer state (DDP broadcast the parameters)."""
        model = self._model()
        state = getattr(model, "_hvdgc_state", None)
        if model is None or root is None or state is None:
            return
        comp = state.compression
        mine = None
        if state.rank == root:
            mine = {"iter": state.iter,
                    "compressor": comp.shared_state() if isinstance(comp, GradientCompressor) else None,
                    "optimizer": self._optimizer.state_dict() if self._optimizer is not None else None}
        box = [state_to_cpu(mine)]
        dist.broadcast_object_list(box, src=dist.get_global_rank(state.process_group, root),
                                   group=state.process_group)
        self.training = None
        if state.rank == root:
            return
        shared = box[0]
        device = next((p.device for p in model.parameters()), None)
        state.iter = shared["iter"]
        if shared["compressor"] is not None:
            comp.load_shared_state(state_to_device(shared["compressor"], device))
        if shared["optimizer"] is not None and self._optimizer is not None:
            self._optimizer.load_state_dict(shared["optimizer"])


def install(ddp_model: Any, state: State, optimizer: Optional[torch.optim.Optimizer]) -> None:
    """Let ``state``'s hook follow ``ddp_model.join()`` (see the module docstring)."""
    watch = JoinWatch(ddp_model, optimizer)
    ddp_model.join_hook = watch.wrap(ddp_model.join_hook)   # the instance's: Join() asks it for its hook
    ddp_model._hvdgc_state = state
    state._join = watch


def step_with_joined(state: State, bucket: dist.GradBucket) -> bool:
    """Whether this bucket's step is one where some rank is inside ``model.join()`` (counted at its first
    bucket, only while ``model.join()`` is active)."""
    watch = getattr(state, "_join", None)
    if watch is None or not watch.active():
        return False
    training = watch.count(state, bucket)
    if training < state.world_size and isinstance(state.compression, Auto):
        raise RuntimeError(f"{state.world_size - training} of {state.world_size} ranks are inside model.join(): "
                           "compression=gc.Auto() cannot carry such steps (its measurements need every rank); "
                           "use a fixed compressor, e.g. TopKQSGD(ratio=0.01, bits=8)")
    return training < state.world_size


def joined_bucket(state: State, bucket: dist.GradBucket) -> Future:
    """One bucket of a step where some rank has joined: one float32 allreduce (Sum) of this rank's dense
    part (a joined rank's: zeros, its state untouched), divided as uncompressed DDP divides; PowerSGD's
    two rounds run among the ranks still training first (a joined rank adds zero factors)."""
    watch, buffer, step = state._join, bucket.buffer(), state.iter
    if bucket.is_last():
        state.iter += 1
        with state._lock:
            state.comm_stats.end_step(state.iter)
    comp, joined, divisor = state.compression, watch.joined, watch.divisor(state)
    compressing = isinstance(comp, GradientCompressor) and step >= state.start_compress_iter
    plan = state._plan(bucket) if compressing else None
    compressed, dense = (list(plan.compressed), list(plan.dense)) if plan is not None else ([], [])
    rounds = compressing and comp.collective == codecs.ALLREDUCE_ROUNDS and bool(compressed)
    finite = joined or kernels.all_finite(buffer)
    send = torch.zeros(buffer.numel(), dtype=torch.float32, device=buffer.device)
    if not joined:
        watch.join_steps += int(bucket.index() == 0)
        send.copy_(buffer)
        if not finite:
            send.fill_(float("nan"))   # NaN on every rank; nothing kept from this bucket
    if rounds:   # before the dense allreduce: every rank issues them in the same order
        _low_rank(state, buffer, compressed, joined or not finite, watch.training, divisor)
    elif compressing and not joined and finite:
        with state._lock:
            for s in compressed:
                payload, carried = comp.send_prepared(comp.prepare_named(s.name, s.view(buffer).view(s.shape)))
                own = carried if isinstance(carried, tuple) else None   # sparse (indices, values); else decoded
                s.view(send).copy_(own_dense(comp, payload, s.numel, buffer.device, own))
    if compressing and not joined and finite:
        with state._lock:
            for s in dense:   # as dense_fallback: the policy sees its dense steps (frozen's warm-up)
                if s.numel >= state.min_compress_numel:
                    comp.dense_local(s.name, s.view(buffer).view(s.shape))
    state._record(step, "joined", buffer.numel() * buffer.element_size(), send.numel() * send.element_size())
    fut = dist.all_reduce(send, group=state.process_group, async_op=True).get_future()

    def done(f: Future) -> torch.Tensor:
        f.wait()
        result = send.div_(divisor)
        if rounds and finite:   # the approximations are in the bucket already
            for s in compressed:
                s.view(result).copy_(s.view(buffer))
        buffer.copy_(result)
        if compressing and not joined and kernels.all_finite(buffer):
            with state._lock:
                for s in dense:
                    comp.dense_average(s.name, s.view(buffer).view(s.shape))
                for s in compressed:
                    state._received(s.name, s.view(buffer))
                    state._exchanged_average(s, buffer)
        return buffer

    return _then(fut, done)


def _low_rank(state: State, buffer: torch.Tensor, compressed: List[Any], zeros: bool, training: int,
              divisor: int) -> None:
    """PowerSGD's two rounds (:func:`~hvd_gradcomp.collectives.rounds.low_rank_rounds`) of ``compressed``
    among the ranks still training, blocking: ``P`` averaged over them, ``Q`` divided by ``divisor``; a
    joined rank (or one whose bucket holds NaN/Inf: ``zeros``) adds zero factors and keeps its state."""
    comp, group = state.compression, state.process_group
    shapes = [comp.factors(s.shape) for s in compressed]
    if zeros:
        for size in (sum(n * r for n, _, r in shapes), sum(m * r for _, m, r in shapes)):
            dist.all_reduce(torch.zeros(size, dtype=torch.float32, device=buffer.device), group=group)
        return
    run = low_rank_rounds(comp, [(s.name, s.view(buffer).view(s.shape)) for s in compressed],
                          [s.view(buffer).view(s.shape) for s in compressed])
    with state._lock:
        first = next(run).tensor
    dist.all_reduce(first, group=group)
    with state._lock:
        second = run.send(first.div_(training)).tensor
    dist.all_reduce(second, group=group)
    with state._lock:
        finish_rounds(run, second.div_(divisor))
