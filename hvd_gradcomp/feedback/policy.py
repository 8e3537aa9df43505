"""The feedback policies every compressor can run (see :mod:`hvd_gradcomp.feedback`): the
:class:`Feedback` protocol (``prepare`` / ``sent`` / ``received``), :class:`NoFeedback` (``"none"``),
:class:`ErrorFeedback` (``"classic"``) with its undo of a round that did not finish (:class:`_RoundUndo`),
and :class:`LocalUpdate` (``"update"``).
"""
from __future__ import annotations

import copy
import functools
import inspect
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .residuals import Marked, ResidualStore, Sent, residual_dtype, spare_or_new, subtract_sent


def plain_class(optimizer: Any) -> type:
    """The user's optimizer class under a DistributedOptimizer (ours or Horovod's, both
    subclass it at run time).

    >>> plain_class(torch.optim.AdamW([torch.zeros(1, requires_grad=True)])).__name__
    'AdamW'
    """
    for cls in type(optimizer).__mro__:
        if not cls.__module__.startswith(("hvd_gradcomp", "horovod")):
            return cls
    raise TypeError(f"cannot find the optimizer class under {type(optimizer)!r}")


def _clone_tensors(d: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in d.items()}


class Feedback:
    """Base policy: no state, the gradient goes out as it is (see the module docstring).

    ``contract``: whether lossy dense codecs (low-bit QSGD) must shrink what they send so that
    the residual stays bounded (see :func:`hvd_gradcomp.codecs.compressor.qsgd_ef_scale`).
    ``moves_parameters``: whether :meth:`received` moves the parameter itself (and hands the
    optimizer a zero gradient); a caller that receives averages during backward (the DDP hook)
    must then defer :meth:`received` to the optimizer step.
    ``uses_support``: whether :meth:`received` wants the ``support`` of a sparse average (else it
    is called with ``name`` and ``avg`` alone).
    ``sparsity_warmup``: over a tensor's first this many compressed exchanges, a TopK-type
    compressor whose ``ratio`` has no schedule of its own sends a share falling geometrically
    from 25% to its ratio (DGC's sparsity warm-up, see
    :class:`hvd_gradcomp.codecs.compressor.SparsityWarmup`; at ratios below 1% over more exchanges:
    :func:`hvd_gradcomp.codecs.compressor.sparsity_warmup_steps`); 0: none.
    ``warmup_pace``: how much longer below 1%: ``"same"`` (the share falls at the pace it has at
    1%) or ``"sqrt"`` (``sqrt(1% / ratio)`` times the steps).
    ``share_sent``: set by a top-k compressor on the policy it binds: the share of tensor ``name``
    it sends at the exchange being prepared (its ratio, its schedule's value, a sparsity warm-up's);
    None for a dense codec.
    ``rank_own_state``: the keys of :meth:`state_dict` that hold this rank's own state (what its own
    gradients made: residuals' units, velocities, private optimizers); every other key must be the
    same on every rank. After ``hvd.join()`` the ranks take the rank that trained last's state but
    these (``hvd_gradcomp.DistributedOptimizer.sync_after_join``); a policy of one's own declares them.
    """

    key = "none"
    rank_own_state: Tuple[str, ...] = ("units",)
    contract = False
    moves_parameters = False
    sparsity_warmup = 0
    warmup_pace = "same"
    uses_support = False

    def __init__(self) -> None:
        self.residuals = ResidualStore()  # also the per-name shape check of every policy
        self.share_sent: Optional[Callable[[str], float]] = None

    def prepare(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        """The flat tensor to encode for ``grad`` (``grad`` itself is never modified)."""
        self.residuals.check_shape(name, grad)
        return grad.reshape(-1)

    @property
    def marks_input(self) -> bool:
        """Whether :meth:`prepare_marked` marks top-k candidates (and can sum ``grad``) in the pass
        that builds its result. Such a policy changes no state in ``prepare``, so a caller may
        check ``grad``'s finiteness after it."""
        return False

    def prepare_marked(self, name: str, grad: torch.Tensor, k: int, total: bool = False
                       ) -> Tuple[torch.Tensor, Marked]:
        """:meth:`prepare`, plus the candidates of a top-k of k entries where the policy can find
        them in the pass that builds its result (else None: the codec finds them itself);
        ``total``: also the sum of ``grad`` (see :class:`hvd_gradcomp.feedback.kernels.Marks`)."""
        return self.prepare(name, grad), None

    def sent(self, name: str, acc: torch.Tensor, what: Sent) -> None:
        """``acc`` (from :meth:`prepare`) went out as ``what``."""

    def received(self, name: str, avg: torch.Tensor, support: Optional[torch.Tensor] = None) -> None:
        """``avg``: flat average of all ranks' payloads for ``name``; rewrite it in place if needed.
        ``support``: when the caller knows it (a sparse exchange), indices outside which ``avg``
        is zero (in any order, possibly repeated: every rank's sent indices, concatenated), so a
        policy can work on those alone; None: dense."""

    def received_terms(self, name: str) -> Optional[List[Tuple[torch.Tensor, torch.Tensor]]]:
        """What the last :meth:`received` of ``name`` did to a sparse average besides leaving it: ``[]``
        when it left the average as summed (the default :meth:`received`); else ``(indices, values)``
        pairs such that every value it changed sits at those indices or at the average's support,
        and is bounded in magnitude by the average's plus these values'; None: unknown (the caller
        then checks the whole average for NaN/Inf, a pass over the tensor in ``synchronize()``).

        Why: the exchange proves the average finite from the values sent
        (:func:`hvd_gradcomp.collectives.reduce.finite_at_indices`) instead of reading all of it. Asked through
        :func:`known_terms`, which answers None for a ``received`` overridden below the class that
        says what it does.
        """
        return []

    def dense(self, name: str) -> bool:
        """True: send ``name`` uncompressed this step (in the dense allreduce, like small tensors).
        Must give the same answer on every rank (decide from replicated state only)."""
        return False

    def needs_optimizer_state(self, name: str) -> bool:
        """True: this policy cannot compress ``name``, which the wrapped optimizer does not hold (under
        DDP, every parameter of the model is exchanged, also those an optimizer over a part of it does
        not step). The DDP hook then averages it uncompressed. False for policies that need nothing of
        the optimizer's state."""
        return False

    def dense_average(self, name: str, avg: torch.Tensor) -> None:
        """``avg``: the average of a tensor that went uncompressed (:meth:`dense`, or small), as the
        exchange delivered it, before the user's code between the exchange and the optimizer step
        (gradient clipping) sees it. Called by every wrapper; most policies ignore it."""

    def dense_local(self, name: str, grad: torch.Tensor) -> None:
        """``grad``: this rank's own gradient of a tensor that goes uncompressed this step (:meth:`dense`,
        or small), before the exchange. Called by every wrapper; most policies ignore it."""

    def bind(self, name: str, group: Dict[str, Any], param: Optional[torch.Tensor] = None,
             optimizer: Any = None) -> None:
        """The optimizer's param group of tensor ``name`` (read live: schedulers change it), the
        parameter and the optimizer."""

    def describe(self) -> str:
        return self.key

    def track_rounds(self, on: bool) -> None:
        """Make every exchange step undoable by :meth:`end_round` (inside an optimizer)."""
        self.residuals.track_rounds(on)

    def end_round(self, keep: bool) -> None:
        """Keep this exchange step's changes, or (``keep=False``: a non-finite step a loss
        scaler skips) put back the state it replaced."""
        self.residuals.end_round(keep)

    def state_dict(self) -> Dict[str, Any]:
        return {"policy": self.key, **self.residuals.state_dict()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if state.get("policy", self.key) != self.key:
            raise ValueError(f"checkpoint holds state of feedback policy {state['policy']!r} but this "
                             f"compressor uses {self.key!r}: build the compressor with "
                             f"feedback={state['policy']!r} to resume it")
        self.residuals.load_state_dict({"residuals": state.get("residuals", {}), "units": state.get("units", {}),
                                         "shapes": state.get("shapes", {})})


class NoFeedback(Feedback):
    """Send every gradient as it is; what the codec drops is lost (``feedback="none"``).

    >>> NoFeedback().prepare("w", torch.ones(2, 2)).shape
    torch.Size([4])
    """


class ErrorFeedback(Feedback):
    """Classic error feedback (``feedback="classic"``): what was not sent is added next step.

    The residual follows the learning rate (``follow_lr``): when a scheduler changes the rate
    of a tensor's param group, what that tensor left unsent is rescaled by old/new rate, so it
    moves the parameter as far as it would have when it was computed. Without it, mass held
    back during a decaying schedule arrives at a smaller rate, or never (benchmarks/results/STUDY.md).

    >>> ef = ErrorFeedback()
    >>> acc = ef.prepare("w", torch.tensor([3.0, 1.0]))
    >>> ef.sent("w", acc, (torch.tensor([0]), torch.tensor([3.0])))
    >>> ef.residuals.residual("w").tolist()
    [0.0, 1.0]
    """

    key = "classic"
    contract = True
    follow_lr = True

    def __init__(self) -> None:
        super().__init__()
        self._groups: Dict[str, Dict[str, Any]] = {}   # each name's param group, read live

    def bind(self, name: str, group: Dict[str, Any], param: Optional[torch.Tensor] = None,
             optimizer: Any = None) -> None:
        self._groups[name] = group

    def _lr(self, name: str) -> Optional[float]:
        """The learning rate ``name``'s residual is expressed in this step (None: not bound, or a
        policy whose residual does not follow the rate)."""
        group = self._groups.get(name) if self.follow_lr else None
        return None if group is None or "lr" not in group else float(group["lr"])

    def prepare(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        return self.residuals.compensate(name, grad, self._lr(name))

    @property
    def marks_input(self) -> bool:
        return type(self).prepare is ErrorFeedback.prepare  # a subclass builds its input its own way

    def prepare_marked(self, name: str, grad: torch.Tensor, k: int, total: bool = False
                       ) -> Tuple[torch.Tensor, Marked]:
        if not self.marks_input:
            return self.prepare(name, grad), None
        return self.residuals.compensate_marked(name, grad, k, total, self._lr(name))

    def sent(self, name: str, acc: torch.Tensor, what: Sent) -> None:
        subtract_sent(acc, what)
        self.residuals.commit(name, acc, self._lr(name))


class _RoundUndo:
    """Per-name state beyond the residuals (the dicts named in ``_round_stores``) that an undone
    exchange step puts back: each value is replaced, never modified in place, so the undo log
    holds references, not copies. Mixed in before :class:`ErrorFeedback`."""

    _round_stores: Tuple[str, ...] = ()
    _undo: Optional[Dict[str, Tuple[Any, ...]]] = None
    _spares: Optional[Dict[Tuple[str, str], torch.Tensor]] = None

    def _remember(self, name: str) -> None:
        if self._undo is not None and name not in self._undo:
            self._undo[name] = tuple(getattr(self, store).get(name) for store in self._round_stores)

    def _buffer(self, store: str, name: str, like: torch.Tensor) -> torch.Tensor:
        """An uninitialised tensor shaped as ``like`` for the next value of ``store[name]``: the
        value that one retired (:meth:`_replace`) if it fits. Why: on CPU a fresh gradient-sized
        tensor per step costs ~3x a pass into a warm one (its pages fault in), and momentum
        correction made three per tensor per step (see :meth:`ResidualStore._recycle`)."""
        return spare_or_new((self._spares or {}).pop((store, name), None), like.shape, like.dtype, like.device)

    def _replace(self, store: str, name: str, value: Any) -> None:
        """``store[name] = value``. The value replaced is retired (the buffer of the next
        :meth:`_buffer`) unless this step's undo log still holds it. These stores are private:
        their tensors are never handed out (state_dict clones them), so nobody else holds one."""
        self._remember(name)
        old = getattr(self, store).get(name)
        getattr(self, store)[name] = value
        if self._undo is None:
            self._retire(store, name, old)

    def _retire(self, store: str, name: str, old: Any) -> None:
        if isinstance(old, torch.Tensor) and old.device.type == "cpu":  # accelerators' allocators reuse
            if self._spares is None:
                self._spares = {}
            self._spares[(store, name)] = old

    def track_rounds(self, on: bool) -> None:
        super().track_rounds(on)  # type: ignore[misc]
        self._undo = None if not on else ({} if self._undo is None else self._undo)

    def end_round(self, keep: bool) -> None:
        super().end_round(keep)  # type: ignore[misc]
        if self._undo is None:
            return
        for name, olds in self._undo.items():
            for store, old in zip(self._round_stores, olds):
                now = getattr(self, store).get(name)
                if now is old:
                    continue
                if keep:  # the values this step replaced are retired
                    self._retire(store, name, old)
                    continue
                self._retire(store, name, now)
                if old is None:
                    getattr(self, store).pop(name, None)
                else:
                    getattr(self, store)[name] = old
        self._undo.clear()


SPARSITY_WARMUP = 100
"""MomentumCorrection's default sparsity warm-up (DGC's: the share sent falls geometrically from
25% to the ratio over a tensor's first this many compressed steps; at ratios below 1% over more
steps: :func:`hvd_gradcomp.codecs.compressor.sparsity_warmup_steps`), from the first step (it brought
the study's char-MLP closer to uncompressed training: benchmarks/results/STUDY.md). FrozenVariance has none by
default (it made Adam jump after the freeze: benchmarks/results/FREEZE_CHECK.md); ``FrozenVariance(sparsity_warmup=100)``
starts one after its dense warm-up."""


def known_terms(policy: Feedback, name: str) -> Optional[List[Tuple[torch.Tensor, torch.Tensor]]]:
    """``policy.received_terms(name)`` when the class that says what ``received`` does is the one
    whose ``received`` runs; None otherwise (a subclass's own rewrite, e.g. "update", or a user's
    policy overriding ``received``: its effect is unknown, the average is checked in full).

    >>> from hvd_gradcomp.feedback.momentum import MomentumCorrection
    >>> class Doubled(MomentumCorrection):
    ...     def received(self, name, avg, support=None):
    ...         super().received(name, avg, support); avg.mul_(2.0)
    >>> known_terms(Feedback(), "w"), known_terms(Doubled(), "w"), known_terms(LocalUpdate(), "w")
    ([], None, None)
    """
    return policy.received_terms(name) if _terms_owner_runs(type(policy)) else None


@functools.lru_cache(maxsize=None)
def _terms_owner_runs(cls: type) -> bool:
    said = next(c for c in cls.__mro__ if "received_terms" in vars(c))
    runs = next(c for c in cls.__mro__ if "received" in vars(c))
    return said is runs


def check_sparsity_warmup(value: Any, owner: str) -> int:
    """``value`` if it is an int >= 0, else a ValueError naming ``owner``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{owner} sparsity_warmup must be an int >= 0 (compressed steps over which the share sent "
                         f"falls from 25% to the ratio; 0: none), got {value!r}")
    return value


class LocalUpdate(ErrorFeedback):
    """Compress the optimizer's update, not the gradient (``feedback="update"``), for Adam-type
    optimizers.

    Each rank runs the wrapped optimizer's own algorithm (a private instance of its class, with
    the param group's live hyperparameters: learning-rate schedules apply) on its *local*
    gradient, and sends the parameter change through error feedback. The average of what
    arrives is added to the parameter, identically on every rank, and the wrapped optimizer is
    handed a zero gradient for it, so it only applies decoupled weight decay (AdamW) and
    otherwise leaves the parameter alone (its moments stay zero).

    Why: Adam normalises each coordinate by its recent magnitude. Error feedback on gradients
    hands it one spike every ~1/ratio steps, which it turns into one normalised step: the
    parameter moves ~sqrt(ratio) times as far as without compression. Sending the update
    instead keeps every coordinate's total movement (error feedback delays it, never drops it).
    Each rank's moments are computed from its own gradient (a smaller batch), and are part of
    this compressor's ``state_dict()``.

    The change is applied when the exchange finishes (in ``synchronize()``), so anything done
    to ``p.grad`` between ``synchronize()`` and ``step()`` (clipping, unscaling) no longer
    reaches compressed tensors: use the compressor's ``clip=`` (local clipping) instead.

    In the DDP hook (``hvd_gradcomp.ddp.register(..., optimizer=opt)``) the private optimizers
    step in :meth:`prepare`, during the backward pass, under the hook's lock; they read the
    parameters, which stay put until ``opt.step()``, where a step pre-hook applies the averaged
    change (:meth:`received`). A rank whose bucket holds NaN/Inf does not prepare it: its private
    optimizers are left as they were, as are its residuals.
    """

    key = "update"
    rank_own_state = ("units", "local")
    follow_lr = False   # its residual is a parameter change already: the rate is inside it
    moves_parameters = True

    def __init__(self) -> None:
        super().__init__()
        self._bound: Dict[str, Tuple[torch.Tensor, Dict[str, Any]]] = {}
        self._factory: Any = None
        self._local: Dict[str, Any] = {}
        self._pending_state: Dict[str, Any] = {}

    def bind(self, name: str, group: Dict[str, Any], param: Optional[torch.Tensor] = None,
             optimizer: Any = None) -> None:
        if param is not None:
            self._bound[name] = (param, group)
        if optimizer is not None:
            self._factory = (plain_class(optimizer), dict(optimizer.defaults))

    def needs_optimizer_state(self, name: str) -> bool:
        """The private optimizer of ``name`` is built from the wrapped optimizer's class and param group:
        a tensor outside the bound optimizer has none (the DDP hook averages it uncompressed)."""
        return name not in self._bound or self._factory is None

    def _optimizer_for(self, name: str, param: torch.Tensor) -> Any:
        local = self._local.get(name)
        if local is None:
            cls, defaults = self._factory
            shadow = torch.zeros_like(param, dtype=residual_dtype(param.dtype))
            accepted = inspect.signature(cls.__init__).parameters
            kwargs = {k: v for k, v in defaults.items()
                      if k in accepted and k not in ("foreach", "fused", "capturable", "differentiable")}
            local = self._local[name] = cls([shadow], **kwargs)
            if name in self._pending_state:
                local.load_state_dict(self._pending_state.pop(name))
        return local

    def prepare(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        if self.needs_optimizer_state(name):   # the DDP hook sends such a tensor dense instead
            raise RuntimeError(f"feedback='update' needs the wrapped optimizer to know parameter {name!r}: "
                               "use it through hvd_gradcomp.DistributedOptimizer, hvd.DistributedOptimizer or "
                               "hvd_gradcomp.ddp.register(..., optimizer=opt)")
        self.residuals.check_shape(name, grad)
        param, group = self._bound[name]
        local = self._optimizer_for(name, param)
        lg = local.param_groups[0]
        for k in lg:
            if k != "params" and k in group:
                lg[k] = group[k]
        lg["weight_decay"] = 0.0  # decoupled decay stays with the wrapped optimizer (dense, exact)
        shadow = lg["params"][0]
        with torch.no_grad():
            shadow.copy_(param)
            shadow.grad = grad.detach().to(shadow.dtype).reshape(shadow.shape)
            local.step()
            shadow.grad = None
            delta = shadow.reshape(-1) - param.reshape(-1).to(shadow.dtype)
        res = self.residuals.residual(name)
        return delta if res is None else delta.add_(res)

    def received(self, name: str, avg: torch.Tensor, support: Optional[torch.Tensor] = None) -> None:
        param, _ = self._bound[name]
        with torch.no_grad():
            param.add_(avg.view(param.shape).to(param.dtype))
        avg.zero_()

    def describe(self) -> str:
        return "compress the update (each rank steps its own copy of the optimizer; error feedback on the change)"

    def state_dict(self) -> Dict[str, Any]:
        """The residuals and each private optimizer's state, copied (torch's ``state_dict()`` holds the
        live tensors, which the next step changes in place: a checkpoint kept in memory moved on)."""
        local = {name: opt.state_dict() for name, opt in self._local.items()}
        return {**super().state_dict(), "local": copy.deepcopy({**self._pending_state, **local})}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._local.clear()
        # copied: torch's load_state_dict keeps tensors it need not cast (the step count, stepped in place)
        self._pending_state = copy.deepcopy(dict(state.get("local", {})))
