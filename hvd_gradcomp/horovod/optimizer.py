"""``hvd_gradcomp.DistributedOptimizer``: Horovod's optimizer, with compressed exchanges.

Same signature and behaviour as ``hvd.DistributedOptimizer``; what differs is the road each
gradient takes (see :mod:`hvd_gradcomp.collectives.exchange`):

* gradient hooks (``register_post_accumulate_grad_hook``) start each exchange as soon as the
  gradient is final, so communication overlaps the rest of the backward pass;
* parameter names reach the compressors (error feedback is keyed by them);
* sparse payloads travel by allgather, QSGD by a compressed allreduce (alltoall + allgather);
* tensors smaller than ``min_compress_numel`` (biases, norms) are not compressed and go
  in one fused allreduce per dtype, started from the hook of the last of them (or at
  ``synchronize()`` in a step where one has no gradient); with one of our compressors, float32
  ones (and those matched by its ``exclude=``) travel as float16 with error feedback of the
  cast (the compressor's ``exempt="fp16"``, :class:`~hvd_gradcomp.collectives.exchange.HalfExchange`).

Example::

    import horovod.torch as hvd
    import hvd_gradcomp as gc

    hvd.init()
    opt = torch.optim.SGD(model.parameters(), lr=0.1 * hvd.size())
    opt = gc.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                  compression=gc.TopKQSGD(ratio=0.01, bits=8))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    loss.backward(); opt.step()
    print(opt.comm_stats.summary())     # bytes handed to Horovod, and the ratio

With a loss scaler, Horovod's pattern (an overflow on any rank is a NaN average on every
rank; the compressor then undoes the step, see :meth:`_GradCompOptimizer.synchronize`)::

    scaler.scale(loss).backward()
    opt.synchronize()
    scaler.unscale_(opt)
    with opt.skip_synchronize():
        scaler.step(opt)
    scaler.update()
"""
from __future__ import annotations

import functools
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch

from ..feedback import kernels
from .. import wire
from ..auto import Auto
from ..codecs.compressor import DEFAULT_MIN_COMPRESS_NUMEL, GradientCompressor, clips_whole_step, refuse_class
from ..collectives.exchange import DenseExchange, HalfExchange, JoinGuard, Pending, SparseExchange, choose_exchange
from ..collectives.inflight import is_average
from ..collectives.rounds import HALF, Algorithm, dense_fallback
from ..collectives.rounds import finish as finish_rounds
from ..codecs.steps import state_to_cpu, state_to_device
from .stock import bind_noise_stream, in_state_broadcast, warn_unread_settings
from ..stats import ByteStats



class _ChangeWatch:
    """Each gradient as backward left it (tensor, version): user code changing it before the exchange
    is finished is refused at synchronize() (see :meth:`changed`)."""

    def __init__(self, names: Dict[torch.Tensor, str]) -> None:
        self._names = names   # the optimizer's, which add_param_group extends
        self._final: Dict[torch.Tensor, Optional[Tuple[torch.Tensor, int]]] = {}

    def watch(self, p: torch.Tensor) -> None:
        """Note ``p``'s gradient as final; at the end of this backward pass (an autograd engine callback,
        after the early decodes of :meth:`_GradCompOptimizer._progress` have written what they write),
        its version is taken."""
        if not self._final:
            torch.autograd.Variable._execution_engine.queue_callback(self.backward_done)
        self._final[p] = None

    def backward_done(self) -> None:
        for p in self._final:
            self._final[p] = None if p.grad is None else (p.grad, p.grad._version)

    def changed(self) -> Optional[str]:
        """The name of a gradient that user code changed between ``backward()`` and ``step()`` without
        ``synchronize()`` first (``clip_grad_norm_``, a loss scaler's ``unscale_``, a hand-made decay),
        or None. One read of a version counter per parameter.

        Why: until ``synchronize()`` a gradient's ``p.grad`` holds this rank's gradient or, where its
        exchange was already decoded during backward, the average: which of the two depends on timing.
        Clipping there measured a different norm on each rank and scaled the averages already written
        by a different factor, so the replicas drifted apart, silently; what it did to the local
        gradients was lost (they had been sent)."""
        changed = next((p for p, seen in self._final.items()
                        if seen is not None and (p.grad is not seen[0] or p.grad._version != seen[1])), None)
        self._final.clear()
        return None if changed is None else self._names.get(changed, "?")

    @staticmethod
    def refuse(name: str) -> None:
        raise RuntimeError(
            f"hvd_gradcomp.DistributedOptimizer: the gradient of {name!r} was changed after backward() and before "
            "step() (clip_grad_norm_, a loss scaler's unscale_, or other code writing p.grad) while its exchange "
            "was still open. Until synchronize() p.grad holds this rank's gradient or the average, depending on "
            "timing, so such code scales each rank differently and the replicas drift apart. Call "
            "opt.synchronize(), then change the averaged gradients, then `with opt.skip_synchronize(): "
            "opt.step()` (Horovod's pattern), or clip with GradientAccumulator(opt, steps=..., max_grad_norm=...); "
            "with a TopK compressor bound each rank's gradient with its clip= instead "
            "(docs/PRECISION_AND_CLIPPING.md). This step's exchange was finished; the optimizer did not step.")

    def taken(self) -> bool:
        """Whether this backward pass's versions were taken (its end callback ran)."""
        return bool(self._final) and next(iter(self._final.values())) is not None

    def clear(self) -> None:
        self._final.clear()


def _count(stats: ByteStats, name: str, raw_bytes: int, pending: Pending) -> None:
    """Where this road counts bytes: once per tensor (or fused group), when its exchange finished."""
    stats.record(name, raw_bytes, pending.bytes_sent - pending.framing_bytes, pending.framing_bytes)


@dataclass
class _Fused:
    """One fused exchange of :class:`_SmallTensors`: its parameters, the algorithm, and its allreduces
    with the exchange that carries each."""

    params: List[torch.Tensor]
    run: Algorithm
    pendings: List[Tuple[Any, Pending]]


class _SmallTensors:
    """The tensors exchanged uncompressed (small, a dtype the wire cannot encode, or excluded by the
    compressor's policy): :func:`~hvd_gradcomp.collectives.rounds.dense_fallback` on Horovod, one
    allreduce per dtype (:class:`~hvd_gradcomp.collectives.exchange.DenseExchange`) and one of the
    float16 casts (:class:`~hvd_gradcomp.collectives.exchange.HalfExchange`) for those the compressor
    sends as float16."""

    def __init__(self, compression: Any, names: Dict[torch.Tensor, str], dense: DenseExchange, joins: JoinGuard) -> None:
        self.compression, self._names, self._dense, self._joins = compression, names, dense, joins
        self._half = HalfExchange(dense.process_set)

    def start(self, params: List[torch.Tensor], min_compress_numel: int, record: Callable[[str, int, Pending], None],
              tag: str = "") -> List[_Fused]:
        """One allreduce per dtype for all ``params``: fewer, larger messages. ``record(name, raw
        bytes, pending)`` counts each; ``tag``: part of the exchanges' names, for a second fused
        exchange in the same step."""
        if not params:
            return []
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        ours = self.compression if isinstance(self.compression, GradientCompressor) else None
        grads = [p.grad for p in params]
        # While ranks are inside hvd.join() (they add zeros): averaged over the ranks still training
        joined = self._joins.joined() if ours is not None else 0
        run = dense_fallback(ours, [(self._names[p], p.grad) for p in params], grads,
                             joined or self._dense.process_set.size(), min_compress_numel, is_average(self._dense.op))
        pendings = []
        for request in next(run).requests:
            road = self._half if request.tag == HALF else self._dense
            name = f"fused{tag}.{request.tag}"
            pending = road.start(name, request.tensor) if road is self._half else road.start(name, request.tensor, joined)
            record(pending.name, request.raw_bytes, pending)
            pendings.append((road, pending))
        return [_Fused(params, run, pendings)]

    def finish(self, fused: List[_Fused]) -> None:
        """Wait for :meth:`start`'s allreduces; the algorithm writes each average into ``p.grad``."""
        for f in fused:
            finish_rounds(f.run, [road.result(pending) for road, pending in f.pendings])


def _all_finite(params: List[torch.Tensor], known: Dict[torch.Tensor, Optional[torch.Tensor]]) -> bool:
    """Whether every averaged gradient is finite: the same answer on every rank, since every
    rank holds the same averages (one host sync for all of them). ``known``: the answer for
    a parameter where its exchange had it cheaper than a pass over the whole gradient
    (:func:`hvd_gradcomp.collectives.exchange.finite_at_indices`)."""
    known_ok = [known[p] for p in params if known.get(p) is not None]
    rest = [p.grad.coalesce().values() if p.grad.is_sparse else p.grad for p in params if known.get(p) is None]
    # One sum per gradient, not isfinite().all(), which costs ~10x more on CPU (kernels.all_finite)...
    checks = known_ok + ([kernels.sums_finite(rest)] if rest else [])
    if not checks or bool(torch.stack([c.to(checks[0].device) for c in checks]).all()):
        return True
    # ...and where a sum is not finite (a NaN/Inf, or finite values whose sum overflowed), exactly.
    exact = known_ok + [torch.isfinite(g).all() for g in rest]
    return bool(torch.stack([c.to(exact[0].device) for c in exact]).all())


def _synchronizing(closure: Callable[[], Any], synchronize: Callable[[], None]) -> Callable[[], Any]:
    """``closure`` then ``synchronize()``, each time the optimizer calls it (LBFGS calls it several times).

    Why: the closure runs forward and backward inside ``step``, so the exchange its backward starts must be
    finished before the optimizer's arithmetic reads ``p.grad`` (and, under ``frozen``/``update``, before the
    averaged update is applied). Horovod's own optimizer synchronizes before it runs the closure and steps
    on this rank's gradient."""
    def wrapped() -> Any:
        loss = closure()
        synchronize()
        return loss
    return wrapped


def sync_after_join(self: Any, root_rank: int) -> None:
    """After ``hvd.join()``, on every rank (a collective): the optimizer's state, its parameters and the
    compressor's shared state from ``root_rank``, the rank that trained last (``hvd.join()`` returns it);
    each rank keeps its own residuals for its next step::

        opt.sync_after_join(hvd.join())
        hvd.broadcast_parameters(model.state_dict(), root_rank=...)   # buffers (BatchNorm), as uncompressed

    Why: a rank inside ``hvd.join()`` steps no more, while the others go on (their steps after a join
    travel dense among them, see :class:`~hvd_gradcomp.collectives.exchange.JoinGuard`): its weights, its
    optimizer's state and the state every rank must hold alike (the exchange step, momentum
    correction's last average, ``frozen``'s ``v``, PowerSGD's ``Q``) stayed behind. Uncompressed Horovod
    leaves the weights apart the same way; here the next compressed exchange would also stop with
    :class:`~hvd_gradcomp.collectives.exchange.RankDivergenceError` (the exchange steps differ)."""
    from .stock import require_horovod
    hvd = require_horovod("sync_after_join")
    if not self._included:
        return
    if self._pending or self._sparse_pending or self._early_fused is not None:
        raise RuntimeError("sync_after_join() was called with exchanges in flight: call it after step() (or "
                           "synchronize()), once hvd.join() has returned on every rank")
    # The state first: Horovod creates a missing one by a step of zero gradients, which weight decay would
    # see in parameters broadcast before it.
    hvd.broadcast_optimizer_state(self, root_rank=root_rank)
    params = [p for g in self.param_groups for p in g["params"]]
    hvd.broadcast_parameters([(f"hvdgc.join.{self._parameter_names[p]}", p.data) for p in params], root_rank)
    if isinstance(self.compression, GradientCompressor):
        mine = self.compression.shared_state() if hvd.rank() == root_rank else None
        shared = hvd.broadcast_object(state_to_cpu(mine), root_rank, name="hvdgc.join.compressor")
        if hvd.rank() != root_rank:
            self.compression.load_shared_state(state_to_device(shared, params[0].device if params else None))


class _GradCompOptimizer(torch.optim.Optimizer):
    """Mixed into the user's optimizer class by :func:`DistributedOptimizer`."""

    def __init__(self, params, named_parameters, compression, backward_passes_per_step, op,
                 process_set, min_compress_numel, sparse_as_dense):
        super(self.__class__, self).__init__(params)
        self.compression = compression
        self.sparse_as_dense = sparse_as_dense
        self.backward_passes_per_step = backward_passes_per_step
        self.op = op
        self.process_set = process_set
        # A rank outside the process set trains locally, as with Horovod: no hooks, no exchange.
        self._included = process_set.included()
        self.min_compress_numel = max(min_compress_numel, process_set.size() if self._included else 1)
        self._auto_names = named_parameters is None
        self._parameter_names = _name_parameters(self.param_groups, named_parameters)
        if isinstance(compression, GradientCompressor):
            compression._claim(self, process_set.size() if self._included else None)
            compression.road_clips = True   # clip=: synchronize() clips the whole step (clips_whole_step)
            bind_noise_stream(compression)  # independent rounding noise on each rank
            # The feedback policy ("auto") is chosen from this optimizer's class and settings.
            # A rank outside the process set has no rank in it (and compresses nothing): it stays quiet.
            compression.attach(self, self._parameter_names, process_set.rank() if self._included else -1)
        elif isinstance(compression, Auto):
            compression.note_optimizer(self, process_set.rank() if self._included else -1)
        warn_unread_settings(compression, backward_passes_per_step,
                             f"DistributedOptimizer(compression={compression!r}, "
                             f"backward_passes_per_step={backward_passes_per_step})")
        # Ranks inside hvd.join() counted once per step, asynchronously (see JoinGuard): the steps after
        # a join go dense among the ranks still training (gc.Auto refuses them).
        self._join = JoinGuard(process_set, falls_back=not isinstance(compression, Auto),
                               counts=isinstance(compression, (GradientCompressor, Auto)))
        self._compressed = choose_exchange(compression, op, process_set, self._join)
        self._dense = DenseExchange(op, process_set, None if isinstance(compression, GradientCompressor)
                                    else compression)
        self._sparse = SparseExchange(op, process_set)
        self._small_road = _SmallTensors(compression, self._parameter_names, self._dense, self._join)
        self._delay: Dict[torch.Tensor, int] = {}
        self._pending: Dict[torch.Tensor, Pending] = {}
        self._sparse_pending: Dict[torch.Tensor, Pending] = {}
        self._densified: List[torch.Tensor] = []   # sparse gradients exchanged dense (sparse_as_dense)
        self._small: Optional[List[torch.Tensor]] = None   # tensors of the fused allreduce (see _hook)
        self._small_ready = 0
        self._early_fused: Optional[List[_Fused]] = None
        self._synchronized = False
        self._should_synchronize = True
        # Bytes this rank hands to Horovod: one ledger, the compressor's own when it has one.
        self.comm_stats = compression.stats if isinstance(compression, GradientCompressor) else ByteStats()
        self._record = functools.partial(_count, self.comm_stats)
        self.comm_wait_s = 0.0          # time synchronize() spent waiting for the network
        self.exchange_timing = self._compressed  # .codec_s / .codec_sync_s / .wait_s, all steps
        self.last_local_norm: Optional[torch.Tensor] = None   # this rank's gradient norm before clip= (a tensor)
        self._hook_handles: List[Any] = []
        self._changes = _ChangeWatch(self._parameter_names)   # user code changing a gradient before synchronize()
        if self._included:
            self._register_hooks()

    # ------------------------------------------------------------ hooks
    def _register_hooks(self) -> None:
        self._hook_handles = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    self._delay[p] = self.backward_passes_per_step
                    self._hook_handles.append(p.register_post_accumulate_grad_hook(self._hook))

    def remove_hooks(self) -> None:
        """Detach this optimizer from the parameters (before wrapping them in a new one)."""
        for h in self._hook_handles:
            h.remove()
        self._hook_handles = []
        if isinstance(self.compression, GradientCompressor):
            self.compression.detach()

    def _hook(self, p: torch.Tensor) -> None:
        if p in self._pending or p in self._sparse_pending:
            self._changes.backward_done()   # this error, not the watch's, names what went wrong
            raise AssertionError(
                "Gradients were computed more than backward_passes_per_step "
                f"({self.backward_passes_per_step}) times before step()/synchronize(). Increase "
                "backward_passes_per_step to accumulate gradients locally, or call step() more often.")
        self._synchronized = False
        self._join.begin()   # the step's count of ranks still training, read before its first collective
        self._delay[p] -= 1
        if self._delay[p] == 0:
            self._changes.watch(p)
        if self._delay[p] == 0 and clips_whole_step(self.compression):
            return   # clip=: the global norm needs every gradient, so synchronize() starts the exchanges
        if self._delay[p] == 0 and (p.grad.is_sparse or not self._is_small(p)):
            self._start(p)
            self._progress()
        elif self._delay[p] == 0 and not self.sparse_as_dense:
            self._small_ready += 1
            if self._small is None:   # this step's: requires_grad may have changed since the last
                self._small = [q for q in self._delay if self._is_small(q) and q.requires_grad]
            if self._small_ready == len(self._small):
                # Every small gradient is final: their fused allreduce leaves now, overlapping the
                # rest of backward, instead of from synchronize(). (A step where one has no gradient
                # never gets here: synchronize() starts it, with zeros for the missing ones.)
                self._early_fused = self._small_road.start(self._small, self.min_compress_numel, self._record)

    def _progress(self) -> None:
        """Decode the exchanges already done while backward goes on, instead of all at synchronize()."""
        for pending in self._pending.values():
            if not pending.finished:
                self._compressed.progress(pending)
        if self._changes.taken():
            self._changes.backward_done()   # called after backward: what it wrote is this optimizer's, not user code's

    def _is_small(self, p: torch.Tensor) -> bool:
        """Exchanged uncompressed: small, of a dtype the wire cannot encode (float64: it travels as it
        is, as on stock Horovod's road), or excluded by the compressor's policy."""
        if p.dtype not in wire.DTYPES or p.numel() < self.min_compress_numel:
            return True
        return isinstance(self.compression, GradientCompressor) and \
            not self.compression.compresses(self._parameter_names[p])

    def _start(self, p: torch.Tensor) -> None:
        if p.grad is None:  # unused on this rank: others may have a gradient, so send zeros
            p.grad = torch.zeros_like(p)
        name = self._parameter_names[p]
        if p.grad.is_sparse:
            if not self.sparse_as_dense:  # already small: Horovod's sparse allreduce, uncompressed
                self._sparse_pending[p] = self._sparse.start(name, p.grad)
                return
            p.grad = p.grad.to_dense()
            self._densified.append(p)
            if self._is_small(p):
                return  # joins the fused allreduce of small tensors
        pending = self._pending[p] = self._compressed.start(name, p.grad)
        pending.out = p.grad   # final for this step: an exchange may write the average early

    # ------------------------------------------------------------ synchronize / step
    def synchronize(self) -> None:
        """Finish every exchange and write the averaged gradients into ``p.grad``.

        When a rank's gradient held NaN/Inf, the averaged gradient is non-finite on every rank
        (a loss scaler then skips the step everywhere) and the compressor's residuals and
        random streams are put back as they were before this step.
        """
        if not self._included:
            self._synchronized = True
            return
        t0 = time.perf_counter()
        changed = self._changes.changed()   # refused once the exchanges are finished: every rank takes part
        self._adopt_unfrozen()
        if clips_whole_step(self.compression):   # this rank's whole step, compressed or small tensors (not sparse ones)
            self.last_local_norm = self.compression.clip_local(
                [p.grad for p in self._delay if p.grad is not None and not p.grad.is_sparse])
        small = []
        for p in self._delay:
            if p in self._pending or p in self._sparse_pending:
                continue
            if p.grad is None and not p.requires_grad:
                continue   # frozen since this optimizer was built: not exchanged, not stepped, as in PyTorch
            if self._is_small(p) and not (p.grad is not None and p.grad.is_sparse):
                small.append(p)
            else:  # partial window (flush) or a parameter without gradient this step
                self._start(p)
        small += [p for p in self._densified if p not in self._pending and p not in small]
        if self._early_fused is None:
            fused = self._small_road.start(small, self.min_compress_numel, self._record)
        else:   # launched during backward; a parameter adopted just now goes in a fused exchange of its own
            early = {p for f in self._early_fused for p in f.params}
            fused = self._early_fused + self._small_road.start([p for p in small if p not in early],
                                                               self.min_compress_numel, self._record, tag="late")
        for pending in self._pending.values():
            if not pending.finished:
                self._compressed.advance(pending)
        for p, pending in self._pending.items():
            if not pending.finished:
                self._compressed.finish(pending, p.grad)
            # Counted once finished: the QSGD road adds its allgather's bytes in advance().
            self._record(pending.name, p.numel() * p.element_size(), pending)
        self._small_road.finish(fused)
        for p, pending in self._sparse_pending.items():
            self._sparse.finish(pending, p.grad)
            self._record(pending.name, pending.bytes_sent, pending)
        self._join.end_step()
        if isinstance(self.compression, GradientCompressor):
            known = {p: pending.finite for p, pending in self._pending.items()}
            self.compression.end_round(self._all_finite([*self._pending, *self._sparse_pending,
                                                         *(p for f in fused for p in f.params)], known))
        for p in self._densified:  # the optimizer (SparseAdam, ...) expects the sparse layout back
            p.grad = p.grad.to_sparse()
        self._densified.clear()
        self._pending.clear()
        self._sparse_pending.clear()
        for p in self._delay:
            self._delay[p] = self.backward_passes_per_step
        self._early_fused, self._small, self._small_ready = None, None, 0
        self.comm_stats.end_step()
        self.comm_wait_s += time.perf_counter() - t0
        self._synchronized = True
        if changed is not None:
            self._synchronized = False
            self._changes.refuse(changed)

    def _adopt_unfrozen(self) -> None:
        """Parameters with ``requires_grad=False`` when this optimizer was built that have a gradient now
        (a layer unfrozen to fine-tune it): hooked from now on, and exchanged by this synchronize()
        (backward is over: their gradient is final). Without this each rank stepped them on its own
        gradient and the ranks drifted apart, silently (stock ``hvd.DistributedOptimizer`` does that)."""
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and p not in self._delay:
                    self._delay[p] = self.backward_passes_per_step
                    self._hook_handles.append(p.register_post_accumulate_grad_hook(self._hook))

    _all_finite = staticmethod(_all_finite)   # an attribute: benchmarks/step_probe.py times it
    sync_after_join = sync_after_join

    @property
    def last_step_bytes(self) -> int:
        """Bytes this rank handed to Horovod in the last ``synchronize()`` (``comm_stats.last_step``)."""
        return self.comm_stats.last_step.sent

    @contextmanager
    def skip_synchronize(self):
        """Use after an explicit ``synchronize()`` (e.g. to clip gradients) so step() does not repeat it."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        """Finish the exchange, then step; with a ``closure`` (LBFGS, Lightning) after each call of it (see
        :func:`_synchronizing`): the weights of ``backward()`` then ``step()``."""
        if in_state_broadcast():  # hvd.broadcast_optimizer_state creating state: local, no exchange
            return super(self.__class__, self).step(closure)
        if closure is not None:   # its backward pass makes new gradients: whatever was synchronized is superseded
            try:
                return super(self.__class__, self).step(_synchronizing(closure, self.synchronize))
            finally:
                self._synchronized = False
        if self._should_synchronize:
            if self._synchronized:
                # Horovod's warning. Horovod then exchanges again; here a second exchange would
                # only re-compress gradients already averaged, so the step uses them as they are.
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context "
                              "after optimizer.synchronize(): the gradients already synchronized are "
                              "used. Wrap step() in `with optimizer.skip_synchronize():` after an "
                              "explicit synchronize().")
            else:
                self.synchronize()
        self._synchronized = False
        return super(self.__class__, self).step(closure)

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """Torch's ``add_param_group``; on a wrapped optimizer (progressive unfreezing: a backbone added
        after the head trained) the new parameters are named and the compressor's feedback policy is
        bound to their group, as for the first ones (its hooks come at their first gradient, see
        :meth:`synchronize`).

        Why: the policy reads each group's rate, betas and momentum. Unbound, ``feedback="frozen"``
        (Adam, AdamW) stopped at the new parameters' first compressed step, and DGC's momentum
        correction ran without the group's momentum."""
        super(self.__class__, self).add_param_group(param_group)
        names = getattr(self, "_parameter_names", None)
        if names is None:
            return   # torch's __init__ adding the first groups: named next, in __init__
        for q in self.param_groups[-1]["params"]:
            if q not in names:
                if not self._auto_names:
                    raise ValueError(f"a parameter of shape {tuple(q.shape)} added to the optimizer has no name in the "
                                     "named_parameters this DistributedOptimizer was built with: pass "
                                     "model.named_parameters() of the whole model (it may hold parameters the "
                                     "optimizer has not yet)")
                names[q] = f"param.{len(names)}"   # the same on every rank adding the same groups
        if isinstance(self.compression, GradientCompressor):
            self.compression.bind_groups(self, names)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Torch's ``load_state_dict``, after dropping exchanges left in flight (an elastic reset
        interrupted a step) and undoing what they changed in the compressor, as Horovod does."""
        super(self.__class__, self).load_state_dict(state_dict)
        self._pending.clear()
        self._sparse_pending.clear()
        self._densified.clear()
        for p in self._delay:
            self._delay[p] = self.backward_passes_per_step
        self._early_fused, self._small, self._small_ready = None, None, 0
        self._synchronized = False
        self._should_synchronize = True
        self._join.reset()
        self._changes.clear()
        if isinstance(self.compression, GradientCompressor):
            self.compression.abandon_round()

    def zero_grad(self, set_to_none: bool = True):
        if self._pending or self._sparse_pending or self._early_fused is not None:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but before "
                                 "optimizer.step() or optimizer.synchronize(): the gradients in flight "
                                 "would be lost. Call step() (or synchronize()) first.")
        return super(self.__class__, self).zero_grad(set_to_none)


def _name_parameters(param_groups: List[dict], named_parameters: Optional[Iterable]) -> Dict[torch.Tensor, str]:
    """Map each parameter to a stable name; errors name the problem and the fix."""
    all_params = [p for g in param_groups for p in g["params"]]
    if named_parameters is None:
        return {p: f"param.{i}" for i, p in enumerate(all_params)}
    from ..feedback.names import name_map  # the one check of (name, parameter) pairs, on every road

    mapping = name_map(named_parameters)
    missing = [i for i, p in enumerate(all_params) if p not in mapping]
    if missing:
        raise ValueError(f"{len(missing)} optimizer parameters have no name in named_parameters "
                         "(pass model.named_parameters() of the model the optimizer was built on)")
    return mapping


def _check_compression(compression: Any) -> None:
    """Refuse, before any hook is registered, what is not a compressor: a name such as "topk"
    would otherwise fail only inside the first backward, and leave hooks on the parameters.

    >>> _check_compression("topk")
    Traceback (most recent call last):
    ...
    ValueError: compression must be an hvd_gradcomp compressor (e.g. TopKQSGD(ratio=0.01, bits=8), QSGD(bits=8)), hvd_gradcomp.Auto(), a Horovod compressor (hvd.Compression.none / fp16) or None, got 'topk' (str); names such as 'topk' are for hvdgc-launch --compression (HVDGC_COMPRESSION): hvd_gradcomp.config.from_env().make_compressor() builds one from them
    """
    refuse_class(compression, "DistributedOptimizer")
    if compression is None or isinstance(compression, (GradientCompressor, Auto)) \
            or (callable(getattr(compression, "compress", None)) and callable(getattr(compression, "decompress", None))):
        return
    hint = ""
    if isinstance(compression, str):
        hint = (f"; names such as {compression!r} are for hvdgc-launch --compression (HVDGC_COMPRESSION): "
                "hvd_gradcomp.config.from_env().make_compressor() builds one from them")
    raise ValueError("compression must be an hvd_gradcomp compressor (e.g. TopKQSGD(ratio=0.01, bits=8), QSGD(bits=8)), "
                     "hvd_gradcomp.Auto(), a Horovod compressor (hvd.Compression.none / fp16) or None, got "
                     f"{compression!r} ({type(compression).__name__}){hint}")


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters: Optional[Iterable] = None,
                         compression: Any = None, backward_passes_per_step: int = 1, op: Any = None,
                         gradient_predivide_factor: float = 1.0, process_set: Any = None,
                         min_compress_numel: int = DEFAULT_MIN_COMPRESS_NUMEL,
                         **unsupported: Any) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that ``step()`` applies gradients averaged over all ranks.

    Arguments are those of ``hvd.DistributedOptimizer``; ``compression`` takes an
    hvd-gradcomp compressor (QSGD, TopK, TopKQSGD), a Horovod compressor
    (``hvd.Compression.none`` / ``fp16``) or None. ``min_compress_numel``: tensors with
    fewer elements are exchanged uncompressed in one fused allreduce.
    ``op`` is ``hvd.Average`` (default) or ``hvd.Sum``; Adasum is rejected. Sparse gradients
    (``nn.Embedding(sparse=True)``) go through Horovod's sparse allreduce, uncompressed, or
    dense and compressed with ``sparse_as_dense=True``, as with ``hvd.DistributedOptimizer``.
    A ``process_set`` that excludes this rank makes it train locally, as with Horovod.
    ``hvd.join()`` (uneven data) works: once a rank has joined, the ranks still training encode as
    in any step and carry their parts dense in allreduces (Horovod refuses allgathers then), the
    average divided by the ranks that contributed; a joined rank's residuals wait for its next
    step. After ``hvd.join()`` returns, call :func:`sync_after_join` on every rank
    (``opt.sync_after_join(hvd.join())``). ``gc.Auto`` refuses it with
    :class:`~hvd_gradcomp.collectives.exchange.JoinNotSupportedError`.

    >>> opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),      # doctest: +SKIP
    ...                            named_parameters=model.named_parameters(),
    ...                            compression=TopKQSGD(ratio=0.01, bits=8),
    ...                            backward_passes_per_step=4)
    """
    from .stock import require_horovod
    hvd = require_horovod("hvd_gradcomp.DistributedOptimizer")

    if unsupported.get("groups") not in (None, 0) or unsupported.get("num_groups") not in (None, 0):
        raise ValueError("groups/num_groups are not supported: small tensors are fused automatically "
                         "(see min_compress_numel)")
    sparse_as_dense = bool(unsupported.get("sparse_as_dense", False))
    unknown = set(unsupported) - {"groups", "num_groups", "sparse_as_dense"}
    if unknown:
        raise TypeError(f"DistributedOptimizer() got unexpected arguments {sorted(unknown)}")
    op = hvd.Average if op is None else op
    if op == hvd.Adasum:
        raise ValueError("op=hvd.Adasum is not supported with gradient compression; use hvd.Average or hvd.Sum")
    if op not in (hvd.Average, hvd.Sum):
        raise ValueError(f"op must be hvd.Average or hvd.Sum, got {op}")
    if gradient_predivide_factor != 1.0:
        raise ValueError("gradient_predivide_factor is not supported; averaging is done in float32 after decoding")
    if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int) \
            or backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be an int >= 1, got {backward_passes_per_step!r}")
    _check_compression(compression)
    if hasattr(optimizer, "_compressed") and hasattr(optimizer, "_pending"):
        raise ValueError("optimizer is already an hvd_gradcomp.DistributedOptimizer; wrap the plain optimizer once")
    process_set = hvd.global_process_set if process_set is None else process_set
    from .elastic import register
    register()   # hvd.elastic.TorchState(optimizer=opt) carries the compressor's state too
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), dict(_GradCompOptimizer.__dict__))
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step, op,
               process_set, min_compress_numel, sparse_as_dense)
