"""The DDP hook's state (:class:`GradCompState`): its settings, the compressor bound to the
model's parameter names and to the optimizer (:func:`_choose_feedback` picks the feedback policy),
residuals, counters and the byte ledger, and the step pre-hook that hands the optimizer what the
step's exchange owes it.
"""
import re
import threading
import warnings
import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist

from .. import feedback as fb
from .. import codecs, wire
from ..feedback import kernels
from ..auto import Auto
from ..codecs.compressor import DEFAULT_MIN_COMPRESS_NUMEL, GradientCompressor, refuse_class
from . import checkpoint
from .auto import _AutoRoads
from .roads import _KEEP_ALIVE, _ROADS, Future, _InOrder, _Plan, _Segment
from ..feedback.momentum import MomentumCorrection
from ..stats import ByteStats


DENSE_DTYPES = (torch.float16, torch.bfloat16)
STATE_VERSION = checkpoint.STATE_VERSION


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


_STATES: "weakref.WeakKeyDictionary[Any, GradCompState]" = weakref.WeakKeyDictionary()
"""The state :func:`register` gave each DDP model (what its accumulator's ``max_grad_norm`` checks)."""


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
