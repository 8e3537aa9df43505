"""The DDP hook's state (:class:`GradCompState`): its settings, the compressor bound to the model's
parameter names and to the optimizer, counters and the byte ledger. It is built of parts it owns: the
bucket layouts (:class:`~hvd_gradcomp.ddp.plans.BucketPlans`), what the exchange owes the optimizer when it
steps (:class:`~hvd_gradcomp.ddp.handoff.StepHandOff`), Auto's roads (:class:`~hvd_gradcomp.ddp.auto._AutoExchange`);
the feedback policy is chosen by :func:`hvd_gradcomp.ddp.policy.choose_feedback`, checkpoints are
:mod:`hvd_gradcomp.ddp.checkpoint`'s.
"""
import threading
import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..auto import Auto
from ..codecs.compressor import DEFAULT_MIN_COMPRESS_NUMEL, GradientCompressor, refuse_class
from ..collectives.sparse_allreduce import Balancer
from ..feedback.names import name_map
from ..feedback.registry import HOOK_POLICIES  # noqa: F401  (hvd_gradcomp.ddp.HOOK_POLICIES)
from ..stats import ByteStats
from . import checkpoint
from .auto import _AutoExchange
from .handoff import StepHandOff
from .plans import BucketPlans
from .policy import choose_feedback
from .exchanges import _KEEP_ALIVE, _EXCHANGES, Future, _InOrder, _Plan, _Segment


DENSE_DTYPES = (torch.float16, torch.bfloat16)
STATE_VERSION = checkpoint.STATE_VERSION
_name_map = name_map   # the name this module gave it before hvd_gradcomp.feedback.names held the one map


_CLAIMED: "weakref.WeakSet[Any]" = weakref.WeakSet()


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
            Horovod wrappers do: DGC momentum correction for ``SGD(momentum > 0)`` (each rank sends
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
        self._lock = threading.Lock()   # the compressor is used from the hook and callback threads
        self._names: Dict[torch.Tensor, str] = {}
        self.auto: Optional["_AutoExchange"] = None
        ours = isinstance(compression, (GradientCompressor, Auto))
        if ours:
            self._names = _claim(compression, named_parameters)
            if isinstance(compression, Auto):
                self.auto = _AutoExchange(self, compression)
                compression.note_optimizer(optimizer, self.rank)
            else:
                compression.stream = self.rank  # independent rounding noise on every rank
                compression.whole_step_clipped = True   # clip=: the hook clips the whole step (see _held_until_last)
                choose_feedback(compression, optimizer, self._names, self.rank)
        self._plans = BucketPlans(self._names, self.rank)
        self._handoff = StepHandOff(compression, {n: p for p, n in self._names.items()}, self._lock, self.rank)
        if ours:
            if optimizer is not None:
                self._step_hook = optimizer.register_step_pre_hook(self._handoff.before_step)
            ranks = dist.get_process_group_ranks(self.process_group)
            self._second = dist.new_group(ranks=ranks, backend=dist.get_backend(self.process_group))
            _KEEP_ALIVE.extend([self.process_group, self._second])
        self.iter = 0
        self._held: List[Tuple[dist.GradBucket, Future]] = []   # clip=: this step's buckets, until the last
        self.last_local_norm: Optional[torch.Tensor] = None     # this rank's gradient norm before clip=
        # Bytes this rank hands to the collectives: one ledger, the compressor's own when it has one.
        self.comm_stats = compression.stats if isinstance(compression, GradientCompressor) else ByteStats()
        self.nonfinite_exchanges = 0    # buckets that carried NaN/Inf on some rank
        self._in_order = _InOrder(self._lock)   # second-round collectives, in bucket order
        self._balancer = Balancer(self.world_size)   # the sparse allreduce's regions: the same on every rank

    def __repr__(self) -> str:
        return (f"GradCompState(compression={self.compression!r}, start_compress_iter={self.start_compress_iter}, "
                f"min_compress_numel={self.min_compress_numel}, world_size={self.world_size})")

    # ------------------------------------------------------------ statistics
    @property
    def last_step_bytes(self) -> int:
        """Bytes this rank handed to the collectives in the last finished exchange (all buckets)."""
        return self.comm_stats.at(self.iter - 1).sent

    def _record(self, step: int, name: str, raw: int, payload: int, framing: int = 0) -> None:
        """Where the hook's drivers count bytes (:class:`~hvd_gradcomp.stats.ByteStats`), as each hands
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

    # ------------------------------------------------------------ what the drivers call
    # Methods, not the parts' own, so that Auto's view of the state (ddp.auto._RoadView) runs them with
    # its road's compressor as self.compression.
    def _plan(self, bucket: dist.GradBucket) -> _Plan:
        """The bucket's layout, with this step's choices of the compressor applied (:class:`BucketPlans`)."""
        return self._plans.plan(bucket, self.compression, self.min_compress_numel)

    def _received(self, name: str, avg: torch.Tensor, support: Optional[torch.Tensor] = None) -> None:
        """Hand the average of ``name`` to the feedback policy, now or when the optimizer steps
        (:meth:`hvd_gradcomp.ddp.handoff.DeferredUpdates.received`)."""
        self._handoff.deferred.received(self.compression, name, avg, support)

    def _exchanged_average(self, seg: "_Segment", buffer: torch.Tensor) -> None:
        """Note that the exchange wrote ``seg``'s average into ``buffer``
        (:class:`hvd_gradcomp.ddp.handoff.UnusedGradients`)."""
        self._handoff.unused.note(self.compression.feedback, seg, buffer)

    def _then_in_order(self, deps: List[Future], launch: Callable[[], Optional[Tuple[Future, Callable]]],
                       result: Future, buffer: torch.Tensor, finish_dense: Callable[[], None]) -> None:
        """Run ``launch()`` when ``deps`` are done *and* the previous bucket's launch has run (see
        :class:`hvd_gradcomp.ddp.exchanges._InOrder`). A method, so that Auto's view of the state times it."""
        self._in_order.then(deps, launch, result, buffer, finish_dense)

    @property
    def pending_updates(self) -> int:
        """Averaged updates exchanged but not yet applied (``feedback="frozen"``: applied when the optimizer
        steps). 0 after every ``optimizer.step()``; a checkpoint taken with updates pending would lose them."""
        return self._handoff.deferred.pending


_STATES: "weakref.WeakKeyDictionary[Any, GradCompState]" = weakref.WeakKeyDictionary()
"""The state :func:`register` gave each DDP model (what its accumulator's ``max_grad_norm`` checks)."""


def _claim(compression: Any, named_parameters: Optional[Iterable[Tuple[str, torch.Tensor]]]
           ) -> Dict[torch.Tensor, str]:
    """Claim ``compression`` for one state (its residuals are this model's) and name the parameters."""
    if compression in _CLAIMED:
        raise ValueError(f"this {type(compression).__name__} already serves another hook state (register() "
                         "was called with it before, on this model or another): register once per model, "
                         "and give every model its own compressor (its residuals are per model)")
    if named_parameters is None:
        raise ValueError("named_parameters is required with a compressor (residuals are kept per "
                         "parameter name): pass module.named_parameters() of the wrapped module")
    if not isinstance(compression, Auto) and compression.collective not in _EXCHANGES:
        raise ValueError(f"{type(compression).__name__} declares collective={compression.collective!r}, "
                         f"which the DDP hook cannot carry (it carries {', '.join(_EXCHANGES)}; see "
                         "hvd_gradcomp.codecs)")
    names = name_map(named_parameters)
    _CLAIMED.add(compression)
    return names


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
