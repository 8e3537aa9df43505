"""``hvd_gradcomp.DistributedOptimizer``: Horovod's optimizer, with compressed exchanges.

Same signature and behaviour as ``hvd.DistributedOptimizer``; what differs is the exchange each
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
from typing import Any, Callable, Dict, Iterable, List, Optional

import torch

from ..feedback import kernels
from ..auto import Auto
from ..codecs.compressor import DEFAULT_MIN_COMPRESS_NUMEL, GradientCompressor, clips_whole_step, refuse_class
from ..collectives.exchange import DenseExchange, JoinGuard, Pending, SparseExchange, choose_exchange
from ..codecs.steps import state_to_cpu, state_to_device
from .exchanges import StepExchanges
from .hooks import GradientHooks
from .small import SmallTensors
from .stock import bind_noise_stream, in_state_broadcast, warn_unread_settings
from .watch import ChangeWatch
from ..stats import ByteStats

_SmallTensors = SmallTensors   # the old name: benchmarks/step_probe.py times its finish()



def _count(stats: ByteStats, name: str, raw_bytes: int, pending: Pending) -> None:
    """Where this wrapper counts bytes: once per tensor (or fused group), when its exchange finished."""
    stats.record(name, raw_bytes, pending.bytes_sent - pending.framing_bytes, pending.framing_bytes)


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
    if self._exchanges.busy():
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
    """Mixed into the user's optimizer class by :func:`DistributedOptimizer`; built of parts it owns: the
    hooks (:class:`~hvd_gradcomp.horovod.hooks.GradientHooks`), this step's exchanges
    (:class:`~hvd_gradcomp.horovod.exchanges.StepExchanges`, with the small-tensor fuser
    :class:`~hvd_gradcomp.horovod.small.SmallTensors`), the change watch
    (:class:`~hvd_gradcomp.horovod.watch.ChangeWatch`) and the join guard."""

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
        _bind_compression(self, compression, backward_passes_per_step)
        # Ranks inside hvd.join() counted once per step, asynchronously (see JoinGuard): the steps after
        # a join go dense among the ranks still training (gc.Auto refuses them).
        self._join = JoinGuard(process_set, falls_back=not isinstance(compression, Auto),
                               counts=isinstance(compression, (GradientCompressor, Auto)))
        # Bytes this rank hands to Horovod: one ledger, the compressor's own when it has one.
        self.comm_stats = compression.stats if isinstance(compression, GradientCompressor) else ByteStats()
        record = functools.partial(_count, self.comm_stats)
        dense = DenseExchange(op, process_set, None if isinstance(compression, GradientCompressor) else compression)
        small = SmallTensors(compression, self._parameter_names, dense, self._join, self.min_compress_numel, record)
        self._exchanges = StepExchanges(choose_exchange(compression, op, process_set, self._join),
                                        SparseExchange(op, process_set), small, record, self._parameter_names,
                                        sparse_as_dense)
        self._hooks = GradientHooks(backward_passes_per_step, self._hook)
        self._synchronized = False
        self._should_synchronize = True
        self.comm_wait_s = 0.0          # time synchronize() spent waiting for the network
        self.exchange_timing = self._exchanges.compressed  # .codec_s / .codec_sync_s / .wait_s, all steps
        self.last_local_norm: Optional[torch.Tensor] = None   # this rank's gradient norm before clip= (a tensor)
        self._changes = ChangeWatch(self._parameter_names)   # user code changing a gradient before synchronize()
        if self._included:
            self._hooks.register(self.param_groups)

    # What tests, tools and horovod/elastic.py read of the exchanges (they are the part's).
    _compressed = property(lambda self: self._exchanges.compressed,
                           lambda self, exchange: setattr(self._exchanges, "compressed", exchange))
    _pending = property(lambda self: self._exchanges.pending)
    _early_fused = property(lambda self: self._exchanges.early_fused)

    # ------------------------------------------------------------ hooks
    def remove_hooks(self) -> None:
        """Detach this optimizer from the parameters (before wrapping them in a new one)."""
        self._hooks.remove()
        if isinstance(self.compression, GradientCompressor):
            self.compression.detach()

    def _hook(self, p: torch.Tensor) -> None:
        if self._exchanges.started(p):
            self._changes.backward_done()   # this error, not the watch's, names what went wrong
            raise AssertionError(
                "Gradients were computed more than backward_passes_per_step "
                f"({self.backward_passes_per_step}) times before step()/synchronize(). Increase "
                "backward_passes_per_step to accumulate gradients locally, or call step() more often.")
        self._synchronized = False
        self._join.begin()   # the step's count of ranks still training, read before its first collective
        if not self._hooks.count(p):
            return
        self._changes.watch(p)
        if clips_whole_step(self.compression):
            return   # clip=: the global norm needs every gradient, so synchronize() starts the exchanges
        if self._exchanges.gradient_final(p, self._hooks.params):
            self._progress()

    def _progress(self) -> None:
        """Decode the exchanges already done while backward goes on, instead of all at synchronize()."""
        self._exchanges.progress()
        if self._changes.taken():
            self._changes.backward_done()   # called after backward: what it wrote is this optimizer's, not user code's

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
        # Parameters unfrozen since: hooked from now on, exchanged now (backward is over: their gradient is final)
        self._hooks.adopt(self.param_groups)
        if clips_whole_step(self.compression):   # this rank's whole step, compressed or small tensors (not sparse ones)
            self.last_local_norm = self.compression.clip_local(
                [p.grad for p in self._hooks.params() if p.grad is not None and not p.grad.is_sparse])
        exchanged, known = self._exchanges.finish(self._hooks.params())
        self._join.end_step()
        if isinstance(self.compression, GradientCompressor):
            self.compression.end_round(self._all_finite(exchanged, known))
        self._exchanges.end_step()
        self._hooks.rearm()
        self.comm_stats.end_step()
        self.comm_wait_s += time.perf_counter() - t0
        self._synchronized = True
        if changed is not None:
            self._synchronized = False
            self._changes.refuse(changed)

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
        _name_added(names, self.param_groups[-1]["params"], self._auto_names)
        if isinstance(self.compression, GradientCompressor):
            self.compression.bind_groups(self, names)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Torch's ``load_state_dict``, after dropping exchanges left in flight (an elastic reset
        interrupted a step) and undoing what they changed in the compressor, as Horovod does."""
        super(self.__class__, self).load_state_dict(state_dict)
        self._exchanges.clear()
        self._hooks.rearm()
        self._synchronized = False
        self._should_synchronize = True
        self._join.reset()
        self._changes.clear()
        if isinstance(self.compression, GradientCompressor):
            self.compression.abandon_round()

    def zero_grad(self, set_to_none: bool = True):
        if self._exchanges.busy():
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but before "
                                 "optimizer.step() or optimizer.synchronize(): the gradients in flight "
                                 "would be lost. Call step() (or synchronize()) first.")
        return super(self.__class__, self).zero_grad(set_to_none)


def _bind_compression(opt: torch.optim.Optimizer, compression: Any, backward_passes_per_step: int) -> None:
    """Claim ``compression`` for ``opt`` and bind its feedback policy to ``opt``'s groups and names."""
    included, process_set = opt._included, opt.process_set
    if isinstance(compression, GradientCompressor):
        compression._claim(opt, process_set.size() if included else None)
        compression.whole_step_clipped = True   # clip=: synchronize() clips the whole step (clips_whole_step)
        bind_noise_stream(compression)  # independent rounding noise on each rank
        # The feedback policy ("auto") is chosen from this optimizer's class and settings.
        # A rank outside the process set has no rank in it (and compresses nothing): it stays quiet.
        compression.attach(opt, opt._parameter_names, process_set.rank() if included else -1)
    elif isinstance(compression, Auto):
        compression.note_optimizer(opt, process_set.rank() if included else -1)
    warn_unread_settings(compression, backward_passes_per_step,
                         f"DistributedOptimizer(compression={compression!r}, "
                         f"backward_passes_per_step={backward_passes_per_step})")


def _name_added(names: Dict[torch.Tensor, str], params: List[torch.Tensor], auto_names: bool) -> None:
    """Name the parameters of a group added after the optimizer was built (``add_param_group``)."""
    for q in params:
        if q not in names:
            if not auto_names:
                raise ValueError(f"a parameter of shape {tuple(q.shape)} added to the optimizer has no name in the "
                                 "named_parameters this DistributedOptimizer was built with: pass "
                                 "model.named_parameters() of the whole model (it may hold parameters the "
                                 "optimizer has not yet)")
            names[q] = f"param.{len(names)}"   # the same on every rank adding the same groups


def _name_parameters(param_groups: List[dict], named_parameters: Optional[Iterable]) -> Dict[torch.Tensor, str]:
    """Map each parameter to a stable name; errors name the problem and the fix."""
    all_params = [p for g in param_groups for p in g["params"]]
    if named_parameters is None:
        return {p: f"param.{i}" for i, p in enumerate(all_params)}
    from ..feedback.names import name_map  # the one check of (name, parameter) pairs, under every wrapper

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
