"""Error feedback: what each rank sends for a gradient, and what the optimizer gets back.

A compressor (the codec: ``encode``/``decode``) is paired with a *feedback policy* that owns
all state that lives across steps (residuals, velocities, held estimates). For every tensor
and step the exchange calls, in this order:

1. ``prepare(name, grad) -> acc``: the flat tensor to encode (e.g. gradient + residual);
2. ``sent(name, acc, what)``: told what the payload *actually* carries (sparse
   ``(indices, values)`` or the QSGD codes), so the policy acts on facts, not on a re-run of
   top-k;
3. ``received(name, avg)``: the average of every rank's decoded payload, identical on all
   ranks; the policy may rewrite it in place into what the wrapped optimizer should see.

Policies (``feedback=`` on every compressor; ``"auto"`` picks one from the wrapped optimizer,
see :func:`choose`):

* :class:`NoFeedback` (``"none"``): send the gradient as it is.
* :class:`ErrorFeedback` (``"classic"``): Seide et al. 2014 / Stich et al. 2018. Invariant,
  checked by the tests: ``sent + new_residual == input + old_residual``.
* :class:`MomentumCorrection` (``"momentum"``): DGC's momentum correction (Lin et al., 2018)
  for ``torch.optim.SGD(momentum=m)``, done at the gradient level so the optimizer is left
  alone: each rank sends its own velocity ``u = m*u + g`` through error feedback; the
  optimizer is handed ``(D_t - m*D_{t-1})/(1-dampening)`` where ``D_t`` is the averaged sent
  velocity, so that SGD's own momentum buffer becomes exactly ``D_t``. At ratio 1 this is
  bit-for-bit momentum SGD (also with weight decay, dampening and Nesterov).
* :class:`FrozenVariance` (``"frozen"``): for ``Adam`` and ``AdamW``: a dense warm-up of exact
  Adam, then its second moment is frozen (identical on every rank, as in 1-bit Adam, Tang et
  al. 2021) and each rank's gradient, divided by it, goes through error feedback, whose residual
  takes the first moment's place; Adam is then linear, so error feedback delays movement but
  loses none.
* :class:`LocalUpdate` (``"update"``): for other adaptive optimizers (RMSprop, Adagrad, ...): each rank
  runs the optimizer's algorithm on its own gradient and the *parameter change* goes through
  error feedback; the wrapped optimizer only applies decoupled weight decay. Adam normalises
  per coordinate, so the spikes of error feedback on gradients (zero for ~1/ratio steps, then
  the sum) shrink its steps; updates keep their total movement.

Residuals are keyed by a stable name (the parameter name), never by tensor identity, so they
survive re-created gradient tensors and checkpoints.
"""
from __future__ import annotations

import functools
import inspect
import logging
import math
import sys
import warnings
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from . import kernels

HALF_DTYPES = (torch.float16, torch.bfloat16)
Sent = Union["kernels.QSGDDecoded", Tuple[torch.Tensor, torch.Tensor]]
Marked = Optional["kernels.Marks"]  # see kernels.add_marked and kernels.topk_indices(marked=)
log = logging.getLogger("hvd_gradcomp")


def residual_dtype(dtype: torch.dtype) -> torch.dtype:
    """Residuals of 16-bit gradients are kept in float32: small leftovers would round away in
    bfloat16 (8 mantissa bits) and error feedback would silently stop working."""
    return torch.float32 if dtype in HALF_DTYPES else dtype


def spare_or_new(spare: Optional[torch.Tensor], shape: Tuple[int, ...], dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
    """``spare`` (a retired buffer, see :meth:`ResidualStore._recycle`) if it has this shape,
    dtype and device, else a new uninitialised contiguous tensor."""
    if spare is not None and spare.shape == shape and spare.dtype == dtype and spare.device == device:
        return spare
    return torch.empty(shape, dtype=dtype, device=device)


def subtract_sent(acc: torch.Tensor, sent: Any) -> None:
    """acc -= what the payload carries (dense QSGD codes or sparse (indices, values)), in place.

    ``sent`` may also be a list of ``(begin, end, what)``: the chunks of one tensor.
    """
    if isinstance(sent, list):
        for b, e, what in sent:
            subtract_sent(acc[b:e], what)
    elif isinstance(sent, kernels.QSGDDecoded):
        sent.subtract_from(acc)  # one fused pass, no dense decoded temporary
    else:
        idx, vals = sent
        # One pass over the k entries (indices are distinct): ``acc[idx] -= vals`` gathers,
        # subtracts and scatters back in three. acc + (-1 * v) rounds exactly as acc - v.
        acc.index_add_(0, idx, vals.to(acc.dtype), alpha=-1)


class ResidualStore:
    """Per-name residuals, plus the shape each name was first used with.

    A residual may carry the learning rate it is expressed in (``lr`` of :meth:`commit`):
    read back at another rate (``lr`` of :meth:`residual`), it is rescaled by old/new, so what
    was left unsent moves the parameter as far as when it was computed, whatever a scheduler
    did meanwhile (EF-SGD's formulation, Karimireddy et al. 2019, accumulates ``lr * g``).

    >>> store = ResidualStore()
    >>> acc = store.compensate("w", torch.ones(3))        # first step: nothing to add
    >>> store.commit("w", acc - torch.tensor([1.0, 0.0, 0.0]))
    >>> store.residual("w").tolist()
    [0.0, 1.0, 1.0]
    """

    def __init__(self) -> None:
        self._residuals: Dict[str, torch.Tensor] = {}
        self._units: Dict[str, float] = {}   # the learning rate each residual is expressed in
        self._shapes: Dict[str, Tuple[Tuple[int, ...], torch.dtype]] = {}
        # Residuals (and their units) as they were when the current exchange step began, kept
        # only inside an optimizer (track_rounds): an overflow step is undone by putting them
        # back. The residual tensors are never modified in place, so this holds references.
        self._undo: Optional[Dict[str, Optional[torch.Tensor]]] = None
        self._undo_units: Dict[str, Optional[float]] = {}
        # A retired residual per name (CPU only), the buffer of its next compensate (see _recycle).
        self._spare: Dict[str, torch.Tensor] = {}

    def check_shape(self, name: str, tensor: torch.Tensor) -> None:
        """Raise if ``name`` was used before with another shape: residuals would mix."""
        seen = self._shapes.setdefault(name, (tuple(tensor.shape), tensor.dtype))
        if seen[0] != tuple(tensor.shape):
            raise ValueError(f"tensor name {name!r} was used with shape {seen[0]} and now with "
                             f"{tuple(tensor.shape)}: give every tensor its own name (e.g. the "
                             "parameter names from model.named_parameters())")

    def residual(self, name: str, lr: Optional[float] = None) -> Optional[torch.Tensor]:
        """The residual of ``name`` (None if none); with ``lr``, expressed at that learning rate
        (a new tensor when it was committed at another one; as stored when ``lr`` <= 0, at which
        nothing moves).

        >>> store = ResidualStore()
        >>> store.commit("w", torch.tensor([2.0]), lr=0.1)
        >>> store.residual("w", lr=0.05).tolist()     # at half the rate, twice the value: same movement
        [4.0]
        """
        res, scale = self.scaled(name, lr)
        return res if scale is None else res * scale

    def scaled(self, name: str, lr: Optional[float]) -> Tuple[Optional[torch.Tensor], Optional[float]]:
        """(the residual as stored, the factor that expresses it at ``lr``; None: as it is), for a
        kernel that multiplies in the pass that reads it (see :meth:`residual`)."""
        res = self._residuals.get(name)
        unit = self._units.get(name)
        if res is None or lr is None or unit is None or lr <= 0.0 or unit == lr:
            return res, None
        return res, unit / lr

    def compensate(self, name: str, grad: torch.Tensor, lr: Optional[float] = None) -> torch.Tensor:
        """grad + residual (at ``lr``, see :meth:`residual`), as a flat tensor of the residual
        dtype that no residual shares (grad is not modified): the caller may change it and
        :meth:`commit` it."""
        self.check_shape(name, grad)
        return self.add_flat(name, grad.reshape(-1), lr)

    def add_flat(self, name: str, flat: torch.Tensor, lr: Optional[float] = None) -> torch.Tensor:
        """:meth:`compensate` of an already flat tensor, without the shape check (a policy that
        checked the gradient's shape and sends something derived from it, e.g. a velocity)."""
        res, scale = self.scaled(name, lr)
        out = self.buffer(name, flat)
        if res is None:
            return out.copy_(flat)
        # One pass into the buffer, instead of a copy and then an in-place add.
        return torch.add(flat, res.to(flat.device), alpha=1.0 if scale is None else scale, out=out)

    def compensate_marked(self, name: str, grad: torch.Tensor, k: int, total: bool = False,
                          lr: Optional[float] = None) -> Tuple[torch.Tensor, Marked]:
        """:meth:`compensate`, and in the same pass the candidates of a top-k of k entries
        (:func:`hvd_gradcomp.kernels.add_marked`; None where top-k will not need them);
        ``total``: with the sum of ``grad`` (a finiteness check)."""
        self.check_shape(name, grad)
        res, scale = self.scaled(name, lr)
        flat = grad.reshape(-1)
        out = self.buffer(name, flat)
        marked = kernels.add_marked(flat, None if res is None else res.to(flat.device), out, k, total, scale)
        return out, marked

    def buffer(self, name: str, flat: torch.Tensor) -> torch.Tensor:
        """An uninitialised flat tensor, of the residual dtype of ``flat``, to become the next
        residual of ``name`` (no residual shares it; see :meth:`_recycle`)."""
        return spare_or_new(self._spare.pop(name, None), (flat.numel(),), residual_dtype(flat.dtype), flat.device)

    def _recycle(self, name: str, old: Optional[torch.Tensor]) -> None:
        """Keep ``old``, a residual that just left the store for good, as the buffer of the next
        :meth:`compensate` of ``name``.

        Why: on CPU a fresh gradient-sized tensor per step costs ~3x a copy into a warm one (new
        pages fault in: glibc returns large blocks to the system on free), which made the
        error-feedback add a third of TopKQSGD's encode. Costs one spare gradient-sized buffer
        per name between steps (during a step the undo log holds as much). Not on accelerators,
        whose caching allocators already reuse blocks. Never a tensor that someone else still
        holds (a caller of :meth:`residual`, a view of it): call as
        ``self._recycle(name, <expression>)``, with no other reference to ``old`` in the caller.
        """
        if old is None or old.device.type != "cpu" or not old.is_contiguous():
            return
        # References: this frame's ``old`` and getrefcount's argument; storage users: ``old`` and
        # the temporary storage object (a view of ``old`` would add one).
        if sys.getrefcount(old) == 2 and _storage_users(old) == 2:
            self._spare[name] = old

    def commit(self, name: str, new_residual: torch.Tensor, lr: Optional[float] = None) -> None:
        """``new_residual`` becomes the residual of ``name``, expressed at learning rate ``lr``
        (None: at none, never rescaled; <= 0: at the old residual's, as :meth:`residual` left it)."""
        if self._undo is None:
            self._recycle(name, self._residuals.pop(name, None))
        elif name not in self._undo:
            self._undo[name] = self._residuals.get(name)
            self._undo_units[name] = self._units.get(name)
        elif self._residuals.get(name) is not self._undo[name]:  # committed twice in one step
            self._recycle(name, self._residuals.pop(name, None))
        self._residuals[name] = new_residual
        if lr is None:
            self._units.pop(name, None)
        elif lr > 0.0:
            self._units[name] = float(lr)

    def track_rounds(self, on: bool) -> None:
        """Keep what each exchange step replaced until :meth:`end_round` (costs, during a step,
        the memory of the residuals it replaced)."""
        if not on:
            self._undo = None
        elif self._undo is None:
            self._undo = {}

    def end_round(self, keep: bool) -> None:
        """Keep the residuals this step committed, or (``keep=False``) put the old ones back."""
        if self._undo is None:
            return
        for name in list(self._undo):
            unit = self._undo_units.pop(name, None)
            if keep:  # the residuals the step replaced are retired
                self._recycle(name, self._undo.pop(name))
                continue
            old = self._undo.pop(name)
            self._recycle(name, self._residuals.pop(name, None))
            if old is not None:
                self._residuals[name] = old
            if unit is None:
                self._units.pop(name, None)
            else:
                self._units[name] = unit

    def pop(self, name: str) -> Optional[torch.Tensor]:
        """Remove and return the residual of ``name`` (None if there is none): for a caller that
        sends it another way (e.g. :class:`hvd_gradcomp.Auto` switching a tensor's road)."""
        self._spare.pop(name, None)
        if self._undo is not None:
            if name not in self._undo:
                self._undo[name] = self._residuals.get(name)
                self._undo_units[name] = self._units.get(name)
        self._units.pop(name, None)
        return self._residuals.pop(name, None)

    def clear(self) -> None:
        self._residuals.clear()
        self._units.clear()
        self._undo_units.clear()
        self._shapes.clear()
        self._spare.clear()
        if self._undo is not None:
            self._undo.clear()

    def state_dict(self) -> Dict[str, Any]:
        """Residuals and the shape each name was used with (so the shape check survives a restart)."""
        return {"residuals": {name: r.detach().clone() for name, r in self._residuals.items()},
                "units": dict(self._units),
                "shapes": {name: (list(shape), str(dtype).replace("torch.", ""))
                           for name, (shape, dtype) in self._shapes.items()}}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self._residuals = {name: r.detach().clone() for name, r in state["residuals"].items()}
        self._units = {name: float(u) for name, u in state.get("units", {}).items()}
        self._spare.clear()
        if self._undo is not None:
            self._undo.clear()
        self._undo_units.clear()
        self._shapes = {name: (tuple(shape), getattr(torch, dtype))
                        for name, (shape, dtype) in state["shapes"].items()}


class HalfPrecision:
    """Error feedback of the float16 road: float32 tensors a compressor exempts from compression
    (fewer elements than ``min_compress_numel``, or matched by ``exclude=``) travel as float16,
    half the bytes, and what the cast takes away is added to their next send.

    :meth:`encode` takes this rank's gradients (several tensors fused into one send), adds each
    one's residual, and casts with :func:`hvd_gradcomp.kernels.to_half_saturated`: divided by the
    ``world`` ranks that sum them (so the float16 sum is the average and cannot overflow) and
    saturated at its bound. The new residual is exactly what did not go out, in gradient units:
    ``sent * world + residual == gradient + old residual`` (to float32 rounding), so a value
    beyond float16's range is delivered over several steps instead of as inf, and a value below
    its resolution is delivered once enough of it has accumulated. A tensor holding NaN/Inf is
    sent as it is (non-finite on every rank after the sum) and no residual changes.

    Residuals are kept per tensor name in a :class:`ResidualStore` (checkpointed, undone with the
    exchange step like the policies' own). The rounding of the float16 *sum* itself (one per
    addition, at most 2**-11 of the partial sum) happens after the ranks' values have met, and no
    rank can keep it.

    >>> hp = HalfPrecision()
    >>> half, finite = hp.encode([("ln.weight", torch.tensor([1.0, 1e6, 1e-4]))], world=2)
    >>> finite, half[:2].tolist()     # 1e6 / 2 saturated at half_bound(2)
    (True, [0.5, 32720.0])
    >>> hp.residuals.residual("ln.weight")[1].item()      # owed: 1e6 - 2 * 32720
    934560.0
    >>> torch.allclose(half.float() * 2 + hp.residuals.residual("ln.weight"), torch.tensor([1.0, 1e6, 1e-4]))
    True
    """

    def __init__(self) -> None:
        self.residuals = ResidualStore()

    def encode(self, named: Sequence[Tuple[str, torch.Tensor]], world: int) -> Tuple[torch.Tensor, bool]:
        """One flat float16 tensor for ``named`` (``(name, float32 gradient)`` pairs, in order),
        for a float16 allreduce (sum) over ``world`` ranks; and whether it is all finite (if
        not, no residual changed)."""
        acc = self._compensated(named)
        half, finite = kernels.to_half_saturated(acc, world)
        if finite:
            # acc is ours (a fresh buffer, see _compensated): it becomes the residuals, one view each.
            acc.sub_(half.to(acc.dtype), alpha=world)
            offset = 0
            for name, grad in named:
                n = grad.numel()
                self.residuals.commit(name, acc[offset:offset + n])
                offset += n
        return half, finite

    def _compensated(self, named: Sequence[Tuple[str, torch.Tensor]]) -> torch.Tensor:
        """The gradients, flat and concatenated, plus their residuals: a new float32 tensor."""
        if len(named) == 1:
            return self.residuals.compensate(*named[0])
        for name, grad in named:
            self.residuals.check_shape(name, grad)
        acc = torch.cat([grad.reshape(-1) for _, grad in named]).to(torch.float32)
        offset = 0
        for name, grad in named:
            res = self.residuals.residual(name)
            if res is not None:
                acc[offset:offset + grad.numel()].add_(res.to(acc.device))
            offset += grad.numel()
        return acc

    def track_rounds(self, on: bool) -> None:
        self.residuals.track_rounds(on)

    def end_round(self, keep: bool) -> None:
        self.residuals.end_round(keep)

    def state_dict(self) -> Dict[str, Any]:
        return self.residuals.state_dict()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.residuals.load_state_dict({"residuals": state.get("residuals", {}), "units": state.get("units", {}),
                                         "shapes": state.get("shapes", {})})


def _storage_users(t: torch.Tensor) -> int:
    """How many tensors and storage objects share ``t``'s memory (a large number when this torch
    cannot tell, so that nothing is reused)."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    return count(t.untyped_storage()._cdata) if count is not None else 1 << 30


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
    the residual stays bounded (see :func:`hvd_gradcomp.compressors.qsgd_ef_scale`).
    ``moves_parameters``: whether :meth:`received` moves the parameter itself (and hands the
    optimizer a zero gradient); a caller that receives averages during backward (the DDP hook)
    must then defer :meth:`received` to the optimizer step.
    ``uses_support``: whether :meth:`received` wants the ``support`` of a sparse average (else it
    is called with ``name`` and ``avg`` alone).
    ``sparsity_warmup``: over a tensor's first this many compressed exchanges, a TopK-type
    compressor whose ``ratio`` has no schedule of its own sends a share falling geometrically
    from 25% to its ratio (DGC's sparsity warm-up, see
    :class:`hvd_gradcomp.compressors.SparsityWarmup`; at ratios below 1% over more exchanges:
    :func:`hvd_gradcomp.compressors.sparsity_warmup_steps`); 0: none.
    ``warmup_pace``: how much longer below 1%: ``"same"`` (the share falls at the pace it has at
    1%) or ``"sqrt"`` (``sqrt(1% / ratio)`` times the steps).
    ``share_sent``: set by a top-k compressor on the policy it binds: the share of tensor ``name``
    it sends at the exchange being prepared (its ratio, its schedule's value, a sparsity warm-up's);
    None for a dense codec.
    """

    key = "none"
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
        ``total``: also the sum of ``grad`` (see :class:`hvd_gradcomp.kernels.Marks`)."""
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
        (:func:`hvd_gradcomp.reduce.finite_at_indices`) instead of reading all of it. Asked through
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
        (gradient clipping) sees it. Called by every road; most policies ignore it."""

    def dense_local(self, name: str, grad: torch.Tensor) -> None:
        """``grad``: this rank's own gradient of a tensor that goes uncompressed this step (:meth:`dense`,
        or small), before the exchange. Called by every road; most policies ignore it."""

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
    back during a decaying schedule arrives at a smaller rate, or never (issue 9, docs/STUDY.md).

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
steps: :func:`hvd_gradcomp.compressors.sparsity_warmup_steps`), from the first step (the study's
char-MLP: +1.89% -> +1.31%, 3 seeds). FrozenVariance has none by default (it made Adam jump after
the freeze: docs/FREEZE_CHECK.md); ``FrozenVariance(sparsity_warmup=100)`` starts one after its
dense warm-up (the default before)."""


def known_terms(policy: Feedback, name: str) -> Optional[List[Tuple[torch.Tensor, torch.Tensor]]]:
    """``policy.received_terms(name)`` when the class that says what ``received`` does is the one
    whose ``received`` runs; None otherwise (a subclass's own rewrite, e.g. "update", or a user's
    policy overriding ``received``: its effect is unknown, the average is checked in full).

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


class SparseValues(NamedTuple):
    """A flat tensor of ``numel`` values, zero except at ``indices`` (an index may repeat, with
    the same value each time: writes and gathers then need no de-duplication).

    >>> SparseValues(4, torch.tensor([1, 3]), torch.tensor([2.0, 5.0])).dense().tolist()
    [0.0, 2.0, 0.0, 5.0]
    """

    numel: int
    indices: torch.Tensor
    values: torch.Tensor

    def dense(self) -> torch.Tensor:
        out = self.values.new_zeros(self.numel)
        out[self.indices] = self.values
        return out


class MomentumCorrection(_RoundUndo, ErrorFeedback):
    """DGC momentum correction for ``torch.optim.SGD(momentum=m)`` (``feedback="momentum"``).

    Each rank keeps its velocity ``u = m*u + (1-dampening)*g`` (``u = g`` on the first step,
    as SGD's buffer) and sends ``u`` through error feedback; the optimizer receives
    ``(D_t - m*D_{t-1}) / (1-dampening)`` (``D_t``: averaged sent velocity), which makes
    SGD's momentum buffer equal ``D_t`` (weight decay is added by SGD on top, exactly). ``m``
    and ``dampening`` are read from the optimizer's param group at every step, so momentum
    schedules work. ``masking``: DGC's momentum factor masking (zero the velocity of the
    coordinates sent); off by default, it measured worse (docs/STUDY.md). ``sparsity_warmup``:
    DGC's sparsity warm-up, the share a TopK-type compressor sends falls geometrically from 25%
    to its ratio over each tensor's first this many compressed steps (default
    :data:`SPARSITY_WARMUP`; at ratios below 1%, ``sqrt(1% / ratio)`` times as many: 317 steps at
    0.1%; 0: none; a ``ratio=SparsityWarmup(...)`` of the user's own takes precedence). Chosen by
    ``feedback="auto"`` for ``SGD(momentum > 0)``.

    With ratio 1 (nothing dropped), training is exactly momentum SGD:

    >>> mc = MomentumCorrection(momentum=0.9)
    >>> for g in (torch.tensor([1.0]), torch.tensor([2.0])):
    ...     acc = mc.prepare("w", g); what = acc.clone(); mc.sent("w", acc, (torch.tensor([0]), what))
    ...     out = what.clone(); mc.received("w", out)
    >>> out.tolist()      # SGD then forms buffer 0.9 * 1 + 2 = 2.9, as without compression
    [2.0]
    """

    key = "momentum"
    uses_support = True
    # Below 1% the warm-up lasts sqrt(1%/ratio) times longer (317 steps at 0.1%), not 172 at 1%'s pace:
    # unlike "frozen", whose dense warm-up comes first, this warm-up is all the lead-in momentum SGD gets.
    # The study's char-MLP and CNN with momentum SGD at 0.1%: rows "172-step sparsity warm-up" (docs/STUDY.md).
    warmup_pace = "sqrt"
    _round_stores = ("velocity", "delivered")

    def __init__(self, momentum: Optional[float] = None, dampening: float = 0.0, masking: bool = False,
                 sparsity_warmup: int = SPARSITY_WARMUP) -> None:
        super().__init__()
        self.momentum, self.dampening, self.masking = momentum, dampening, masking
        self.sparsity_warmup = check_sparsity_warmup(sparsity_warmup, "MomentumCorrection")
        self.velocity: Dict[str, torch.Tensor] = {}
        self.delivered: Dict[str, Union[torch.Tensor, SparseValues]] = {}
        # The velocity a prepare() computed, kept by sent(): a prepare whose input turns out
        # non-finite (checked after it, see marks_input) leaves the state as it was.
        self._pending: Dict[str, torch.Tensor] = {}
        self._terms: Dict[str, Optional[List[Tuple[torch.Tensor, torch.Tensor]]]] = {}   # see received_terms
        self._undo = None  # see _RoundUndo
        self._said_no_momentum = False

    def bind(self, name: str, group: Dict[str, Any], param: Optional[torch.Tensor] = None,
             optimizer: Any = None) -> None:
        """As :meth:`ErrorFeedback.bind`; warns once when the momentum is read from an optimizer that
        has none (Adam, AdamW, RMSprop...): correction with momentum 0 is classic error feedback.

        >>> w = torch.zeros(4, requires_grad=True); opt = torch.optim.AdamW([w])
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always"); MomentumCorrection().bind("w", opt.param_groups[0], w, opt)
        >>> "AdamW has no momentum" in str(caught[0].message)
        True
        """
        super().bind(name, group, param, optimizer)
        if self.momentum is None and optimizer is not None and "momentum" not in group and not self._said_no_momentum:
            self._said_no_momentum = True
            warnings.warn(f"feedback='momentum' reads the momentum from the optimizer, and {type(optimizer).__name__} "
                          "has no momentum: it runs as classic error feedback. For Adam and AdamW leave "
                          "feedback='auto' (it picks 'frozen'); for SGD build SGD(momentum=m).", UserWarning, stacklevel=2)

    def _coefficients(self, name: str) -> Tuple[float, float]:
        group = self._groups.get(name, {})
        m = self.momentum if self.momentum is not None else float(group.get("momentum", 0.0))
        d = float(group.get("dampening", self.dampening)) if self.momentum is None else self.dampening
        if not 0.0 <= m < 1.0 or not 0.0 <= d < 1.0:
            raise ValueError(f"momentum correction needs 0 <= momentum < 1 and 0 <= dampening < 1 for "
                             f"{name!r}, got momentum={m}, dampening={d}: use feedback='classic'")
        return m, d

    def prepare(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        return self._velocity_input(name, grad, None)[0]

    @property
    def marks_input(self) -> bool:
        return type(self).prepare_marked is MomentumCorrection.prepare_marked

    def prepare_marked(self, name: str, grad: torch.Tensor, k: int, total: bool = False
                       ) -> Tuple[torch.Tensor, Marked]:
        """The velocity update, the residual add and top-k's candidate compare in one pass
        (:func:`hvd_gradcomp.kernels.momentum_marked`). The new velocity is kept by :meth:`sent`,
        so a non-finite ``grad`` found after this changes nothing."""
        return self._velocity_input(name, grad, k, total)

    def _velocity_input(self, name: str, grad: torch.Tensor, k: Optional[int], total: bool = False
                        ) -> Tuple[torch.Tensor, Marked]:
        self.residuals.check_shape(name, grad)
        m, d = self._coefficients(name)
        flat = grad.reshape(-1)
        old = self.velocity.get(name)
        # A new tensor, not old.mul_: the old velocity is what an undone step puts back.
        stale = self._pending.pop(name, None)  # left by a prepare that was never sent: a spare now
        if stale is not None:
            self._retire("velocity", name, stale)
        u = self._buffer("velocity", name, old) if old is not None else \
            torch.empty(flat.shape, dtype=residual_dtype(flat.dtype), device=flat.device)
        acc, (res, scale) = self.residuals.buffer(name, flat), self.residuals.scaled(name, self._lr(name))
        marked = kernels.momentum_marked(flat, None if old is None else old.to(flat.device),
                                         None if res is None else res.to(flat.device), u, acc, m, d, k, total, scale)
        self._pending[name] = u
        return acc, marked

    def sent(self, name: str, acc: torch.Tensor, what: Sent) -> None:
        u = self._pending.pop(name, None)
        if u is not None:
            self._replace("velocity", name, u)
        super().sent(name, acc, what)
        if self.masking and isinstance(what, tuple):
            idx = what[0]
            self.velocity[name][idx] = 0
            acc[idx] = 0

    def received(self, name: str, avg: torch.Tensor, support: Optional[torch.Tensor] = None) -> None:
        m, d = self._coefficients(name)
        prev = self.delivered.get(name)
        # What this rewrite adds, for received_terms: m * D_{t-1} at D_{t-1}'s indices, |m| < 1; none
        # known when D_{t-1} was dense, or when dampening scales the result up.
        self._terms[name] = [] if prev is None else \
            [(prev.indices, prev.values)] if isinstance(prev, SparseValues) and not d else None
        # D_t, kept sparse when the exchange says where it is nonzero: then this rewrite costs
        # O(sent values) instead of two passes over the tensor (a third of TopK's codec time).
        now: Any = (SparseValues(avg.numel(), support, avg[support].clone()) if support is not None
                    else self._buffer("delivered", name, avg).copy_(avg.detach()))
        if prev is not None:
            if isinstance(prev, SparseValues):
                # Gather, subtract, scatter: the same arithmetic (and rounding) as the dense sub_.
                avg[prev.indices] = avg[prev.indices].sub_(prev.values.to(avg.dtype), alpha=m)
            else:
                avg.sub_(prev.to(avg.dtype), alpha=m)
            if d:  # dampening is 0 for nearly everyone: skip a pass over the tensor
                avg.div_(1.0 - d)
        self._replace("delivered", name, now)

    def received_terms(self, name: str) -> Optional[List[Tuple[torch.Tensor, torch.Tensor]]]:
        """The previous step's averaged velocity, subtracted times ``m`` at its indices (see
        :meth:`Feedback.received_terms`).

        >>> mc = MomentumCorrection(momentum=0.9)
        >>> avg = torch.tensor([0.0, 2.0, 0.0]); mc.received("w", avg, torch.tensor([1]))
        >>> mc.received_terms("w")
        []
        >>> avg = torch.tensor([4.0, 0.0, 0.0]); mc.received("w", avg, torch.tensor([0]))
        >>> avg.tolist(), [(i.tolist(), v.tolist()) for i, v in mc.received_terms("w")]
        ([4.0, -1.7999999523162842, 0.0], [([1], [2.0])])
        """
        return self._terms.get(name)

    def describe(self) -> str:
        m = "from the optimizer" if self.momentum is None else self.momentum
        return (f"momentum correction (DGC; momentum {m}, masking {'on' if self.masking else 'off'}, "
                f"sparsity warm-up {self.sparsity_warmup} steps, sqrt(1%/ratio) times more below ratio 1%)")

    def state_dict(self) -> Dict[str, Any]:
        return {**super().state_dict(), "velocity": _clone_tensors(self.velocity),
                "delivered": _clone_tensors({n: v.dense() if isinstance(v, SparseValues) else v
                                             for n, v in self.delivered.items()}),
                "sparsity_warmup": self.sparsity_warmup}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.velocity = _clone_tensors(state.get("velocity", {}))
        self.delivered = _clone_tensors(state.get("delivered", {}))
        self._pending.clear()
        # Checkpoints from before the warm-up was the default ran without one: they resume so.
        self.sparsity_warmup = int(state.get("sparsity_warmup", 0))
        if self._undo is not None:
            self._undo.clear()


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
    """

    key = "update"
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
        if name not in self._bound or self._factory is None:
            raise RuntimeError(f"feedback='update' needs the wrapped optimizer to know parameter {name!r}: "
                               "use it through hvd_gradcomp.DistributedOptimizer or hvd.DistributedOptimizer")
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
        local = {name: opt.state_dict() for name, opt in self._local.items()}
        return {**super().state_dict(), "local": {**self._pending_state, **local}}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._local.clear()
        self._pending_state = dict(state.get("local", {}))




class FrozenVariance(_RoundUndo, ErrorFeedback):
    """Adam and AdamW with their second moment frozen after a dense warm-up (1-bit Adam, Tang et
    al. 2021), then each rank's update direction sent through error feedback (``feedback="frozen"``).

    * For the first ``warmup`` optimizer steps of a tensor, :meth:`dense` is True: the tensor
      goes uncompressed through the dense allreduce and the wrapped optimizer runs exact Adam.
      Steps where no rank had a gradient for it (a layer first used later, sent as zeros) do not
      count: it gets ``warmup`` steps with gradients (see :meth:`dense_average`).
      While the learning rate still rises from one step to the next (a scheduler's warm-up:
      ``LinearLR``, ``OneCycleLR``, a ``LambdaLR`` ramp), the dense warm-up goes on, up to
      ``max_warmup`` steps (``warmup`` when larger): the gradients' scale settles with the rate,
      and a ``v`` frozen in the middle of the ramp is the wrong one for the rest of the run (with Adam and OneCycleLR's
      360-step ramp, freezing at step 100 was most of TopKQSGD(1%, 8)'s gap to uncompressed
      training: the ``-at100`` rows of docs/OUTSIDE_CHECK.md). ``max_warmup=1`` freezes after
      ``warmup`` steps whatever the rate does.
    * Then Adam's second moment ``v`` (identical on every rank, since it came from averaged
      gradients) is frozen: ``denom = max(sqrt(v_hat), floor * mean(sqrt(v_hat))) + eps``, where
      ``v_hat`` is the average of the warm-up's last ``window`` squared averaged gradients
      (recovered from Adam's own ``v``, step by step; ``window=None``: Adam's bias-corrected ``v``,
      which at step 100 still mostly remembers the first, largest gradients). The
      floor keeps coordinates that had (almost) no gradient during the warm-up (rare tokens'
      embedding rows, dead units) from taking ``lr/eps``-sized steps later.
    * Frozen, ``v`` keeps its shape, and its level follows the gradients where they shrink
      (``follow_scale="down"``): each rank keeps the average of its gradient's mean square over
      about ``window`` steps (the span the frozen ``v`` averages; ``window=None``: Adam's ``b2``),
      from its first step on (the warm-up's included), and while that average ``s_t`` is below its
      value at the freeze, divides what it sends by ``denom * sqrt(s_t / s_freeze)``. Why: where
      gradients keep shrinking after the freeze (a classifier driving its loss towards zero), a
      ``v`` frozen for good makes every later step shorter than Adam's, and error feedback cannot
      give that movement back: TopKQSGD(1%, 8) then ended above uncompressed training on every seed
      of the study's CNN with Adam, with a schedule and without (docs/STUDY.md, cnn-adam and
      cnn-adam-const, the *v frozen for good* rows), and on a small MLP at a constant rate
      (docs/SMALL_MLP_CHECK.md). Where gradients grow, ``v`` stays frozen: following them up as well
      (``follow_scale="both"``) made the steps of the freeze check's model shorter, and ended further
      from uncompressed training (docs/FREEZE_CHECK.md). ``follow_scale=None`` keeps ``v`` frozen
      for good (and skips the average: one pass over each gradient less). Each rank scales only
      what it sends, so the average every rank applies stays the same on all.
    * With ``v`` frozen, Adam is linear in the gradient: each rank sends the update direction
      ``g / denom`` through error feedback (top-k on the direction, not on ``g``, picks the
      coordinates that would move most: in the simulator this took the transformer's gap from
      +2.8% to +1.6%), and the parameter moves by ``-lr * D`` (``D``: the averaged sent
      direction, identical on every rank). Error feedback's residual plays the part of Adam's
      first moment: it sums each coordinate's gradients until they are sent, as the momentum
      averages them. The wrapped optimizer is handed a zero gradient with its first moment
      cleared, so it moves nothing but its decoupled weight decay (AdamW), exactly.
    * From the first compressed step, each tensor sends ``ratio`` (``sparsity_warmup=0``: no
      share falling from 25% after the freeze) and its gradient, not Adam's momentum
      (``momentum=False``). Why: on a model with the quirks real ones have (a layer applied
      twice, a frozen layer, a layer used every other step; docs/FREEZE_CHECK.md) the previous
      defaults (Adam's momentum sent through error feedback while the rate changes, a sparsity
      warm-up after the freeze) made the held-out loss jump after the freeze and end above
      uncompressed training, on every seed, with Adam and AdamW under cosine, linear and
      one-cycle schedules; the momentum alone ended far above it in most configurations, the
      warm-up alone jumped after the freeze. With neither, that model ended close to
      uncompressed training in every configuration. On the study's transformer
      (docs/STUDY.md) TopKQSGD(1%, 8) also ended closer to uncompressed training without the
      momentum; on its CNN with Adam further (above the 1% target on every seed, inside
      that task's seed spread, while ``v`` stayed frozen for good under a schedule; the
      *previous default* and *v frozen for good* rows).
      ``momentum="while dense"`` keeps it while a sparsity warm-up sends more than ``1 - b1`` of
      a tensor, then sends the gradient (see :meth:`_dense_share`): below ratio 1%,
      ``feedback="auto"`` chooses ``FrozenVariance(sparsity_warmup=100, momentum="while dense")``
      (:meth:`hvd_gradcomp.compressors.TopK._auto_policy`).
      ``momentum=True`` keeps Adam's momentum for every tensor: each rank's
      ``u = b1*u + (1-b1)*g``, started from Adam's, sends ``u / denom``, and the parameter
      moves by ``-lr * D / (1 - b1**t)`` (1-bit Adam's and DGC's way; at ratio 1 this is
      exactly Adam with ``v`` frozen). ``momentum=None`` (the default before, with
      ``sparsity_warmup=100``) keeps it while the learning rate changes and drops it for good
      once a tensor's rate has stayed the same :data:`FLAT_RATE_STEPS` steps.

    Why not plain error feedback on gradients: Adam divides each coordinate by its recent
    magnitude, so the spikes of error feedback (zero for ~1/ratio steps, then the sum) become
    single normalised steps and most of the movement is lost. Why not "update" (each rank runs
    Adam on its own gradient): each rank's ``v`` then sees a P-times-smaller batch, so every
    step is too short (+18% held-out loss on the study's CNN even with nothing dropped). With
    ``v`` frozen, nothing is lost but time: every coordinate's total movement arrives, delayed.
    At ratio 1 with the momentum kept this is exactly Adam with ``v`` frozen at the end of the
    warm-up (without it: the same without the first moment).

    Like "update", the change is applied when the exchange finishes (in ``synchronize()``), so
    clipping ``p.grad`` between ``synchronize()`` and ``step()`` does not reach it: use the
    compressor's ``clip=``. A non-finite average moves nothing and is passed on, so a loss
    scaler skips the step everywhere (and the step's state is put back).

    >>> w = torch.nn.Parameter(torch.ones(4))
    >>> opt = torch.optim.AdamW([w], lr=0.1)
    >>> fv = FrozenVariance(warmup=1)
    >>> fv.bind("w", opt.param_groups[0], w, opt)
    >>> fv.dense("w")                       # no Adam step yet: the warm-up is dense
    True
    >>> w.grad = torch.full((4,), 0.5); opt.step()
    >>> fv.dense("w")
    False
    """

    key = "frozen"
    moves_parameters = True
    _round_stores = ("velocity", "steps", "scale")  # velocity, steps: set at the freeze, before _remember

    def __init__(self, warmup: int = 100, floor: float = 0.1, sparsity_warmup: int = 0,
                 window: Optional[int] = 50, max_warmup: int = 1000, momentum: Optional[bool] = False,
                 follow_scale: Optional[str] = "down") -> None:
        super().__init__()
        if follow_scale not in FOLLOW_SCALE:
            raise ValueError(f"FrozenVariance follow_scale must be one of {list(FOLLOW_SCALE)} ('down': longer steps "
                             f"where the gradients shrank since the freeze; 'both': shorter ones too where they grew; "
                             f"None: v frozen for good), got {follow_scale!r}")
        self.follow_scale = follow_scale
        if momentum is not None and not isinstance(momentum, bool) and momentum != WHILE_DENSE:
            raise ValueError(f"FrozenVariance momentum must be None (Adam's first moment kept while the learning rate "
                             f"changes), {WHILE_DENSE!r} (kept while the sparsity warm-up sends more than 1 - b1 of "
                             f"a tensor), True (always kept) or False (never: error feedback's residual sums the "
                             f"gradients), got {momentum!r}")
        self.momentum = momentum
        self._flat: Dict[str, Tuple[float, int]] = {}   # each tensor's rate, and the step it was first seen at
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
            raise ValueError(f"FrozenVariance warmup must be an int >= 1 (dense Adam steps before v is frozen), "
                             f"got {warmup!r}")
        if isinstance(max_warmup, bool) or not isinstance(max_warmup, int) or max_warmup < 1:
            raise ValueError(f"FrozenVariance max_warmup must be an int >= 1 (the most dense steps while the learning "
                             f"rate still rises; never fewer than warmup), got {max_warmup!r}")
        self.max_warmup = max_warmup
        self._lr_seen: Dict[str, Tuple[int, float, bool]] = {}    # step, its rate, rose since the step before
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 2):
            raise ValueError(f"FrozenVariance window must be an int >= 2 (the warm-up's last steps that the frozen v "
                             f"averages) or None (Adam's own v), got {window!r}")
        self.window = window
        self._last_v: Dict[str, Tuple[int, torch.Tensor]] = {}     # Adam's v at the step last seen
        self._recent: Dict[str, Tuple[torch.Tensor, int]] = {}     # EMA of the squared average, samples
        self._delivered: Dict[str, Tuple[int, torch.Tensor]] = {}  # step, squared norm of the average exchanged
        self._rescaled: Dict[str, torch.Tensor] = {}               # least ratio seen: clipped / exchanged
        self._idle: Dict[str, torch.Tensor] = {}                   # dense steps with an all-zero average
        self._scale_checked: set = set()                            # tensors checked for a loss scale
        self.clipping_seen = False
        self.sparsity_warmup = check_sparsity_warmup(sparsity_warmup, "FrozenVariance")
        if not 0.0 <= floor <= 1.0:
            raise ValueError(f"FrozenVariance floor must be in [0, 1] (share of the mean of sqrt(v)), got {floor!r}")
        self.warmup, self.floor = warmup, floor
        self._bound: Dict[str, Tuple[torch.Tensor, Dict[str, Any], Any]] = {}
        self.velocity: Dict[str, torch.Tensor] = {}
        self.denom: Dict[str, torch.Tensor] = {}
        self.steps: Dict[str, int] = {}
        # This rank's b2-average of its gradient's mean square (0-dim tensors, on the gradient's
        # device: no host sync), and its value when v was frozen: see _follow_scale.
        self.scale: Dict[str, torch.Tensor] = {}
        self.scale_at_freeze: Dict[str, torch.Tensor] = {}
        self._undo = None  # see _RoundUndo

    def bind(self, name: str, group: Dict[str, Any], param: Optional[torch.Tensor] = None,
             optimizer: Any = None) -> None:
        if param is None or optimizer is None:
            return
        check_frozen_variance(optimizer)
        super().bind(name, group, param, optimizer)
        self._bound[name] = (param, group, optimizer)

    def dense(self, name: str) -> bool:
        if name in self.denom:
            return False
        if name not in self._bound:
            return False  # not bound (yet): prepare() says what is missing
        param, group, optimizer = self._bound[name]
        state = optimizer.state.get(param, {})
        if self.window is not None and "exp_avg_sq" in state and not group.get("amsgrad") \
                and state["exp_avg_sq"].dtype in (torch.float32, torch.float64):
            # Not from a float16/bfloat16 v (a half-precision model's Adam state): each step's squared
            # gradient, recovered as v_t - b2 * v_(t-1), is lost to rounding there (a spurious "scaled
            # by the user's code" warning showed it); Adam's own v is frozen instead (see _frozen_v).
            self._track(name, state, group)
        t = int(state.get("step", 0))
        rising = self._lr_rising(name, t, float(group["lr"]))
        if t < self.warmup or "exp_avg_sq" not in state or (rising and t < self._longest_warmup):
            return True
        idle = self._idle.get(name)
        if idle is not None and t - int(idle) < self.warmup:
            return True   # fewer than warmup steps with a gradient (a layer unused at first): see dense_average
        return not bool(state["exp_avg_sq"].any())  # no gradient yet: nothing to freeze

    def needs_optimizer_state(self, name: str) -> bool:
        """Adam's state of ``name`` is what is frozen: a tensor outside the bound optimizer cannot be."""
        return name not in self._bound

    @property
    def _longest_warmup(self) -> int:
        return max(self.warmup, self.max_warmup)

    def _lr_rising(self, name: str, t: int, lr: float) -> bool:
        """Whether the rate of the coming step ``t`` (the optimizer's completed steps) is higher than
        step ``t - 1``'s. The same on every rank: the rate comes from the same scheduler there.
        Unknown (the first call after a resume) counts as rising: one more dense step to find out."""
        seen = self._lr_seen.get(name)
        if seen is not None and seen[0] == t:
            return seen[2]   # asked again in the same step
        rising = seen is None or seen[0] != t - 1 or lr > seen[1] * (1.0 + 1e-9)
        self._lr_seen[name] = (t, lr, rising)
        self._note_rate(name, t, lr)
        return rising

    def _note_rate(self, name: str, t: int, lr: float) -> None:
        """Remember since which step ``t`` (completed optimizer steps) ``name``'s rate is ``lr``."""
        seen = self._flat.get(name)
        if seen is None or seen[0] != lr:
            self._flat[name] = (lr, t)

    def _track(self, name: str, state: Dict[str, Any], group: Dict[str, Any]) -> None:
        """Once per optimizer step of the warm-up: the squared averaged gradient of Adam's last step,
        recovered from its second moment (``v_t = b2 * v_(t-1) + (1 - b2) * g_t**2``, so no extra
        communication), into an average over about ``window`` steps."""
        t = int(state["step"])
        last = self._last_v.get(name)
        if last is not None and last[0] == t:
            return   # this step was seen (dense() is asked more than once a step)
        v = state["exp_avg_sq"].detach().reshape(-1).to(torch.float32, copy=True)
        if last is not None and last[0] == t - 1:
            b2 = group["betas"][1]
            squared = torch.sub(v, last[1], alpha=b2).div_(1.0 - b2).clamp_(min=0.0)
            self._unscale(name, t, squared)
            recent, n = self._recent.get(name, (torch.zeros_like(squared), 0))
            self._recent[name] = (recent.lerp_(squared, 1.0 / self.window), n + 1)
        self._last_v[name] = (t, v)

    def dense_local(self, name: str, grad: torch.Tensor) -> None:
        """A warm-up step's own gradient (a tensor not frozen yet goes dense: :meth:`dense`): its scale is
        followed from the first step (see :meth:`_follow_scale`)."""
        if name in self._bound and name not in self.denom:
            self._follow_scale(name, grad)

    def _follow_scale(self, name: str, grad: torch.Tensor) -> None:
        """Average this rank's gradient mean square over about ``window`` steps (weight ``1 / window``,
        the span the frozen ``v`` averages; ``window=None``: Adam's ``1 - b2``), started at the first
        value, from the tensor's first step on, at any rate. A non-finite gradient (a step the loss
        scaler skips) leaves the average as it was. Nothing with ``follow_scale=None``: the average
        would never be read (:meth:`_scale_factor`), and it costs a pass over the gradient."""
        if self.follow_scale is None:
            return
        weight = 1.0 / self.window if self.window is not None else 1.0 - float(self._bound[name][1]["betas"][1])
        ms = _squared_norm(grad) / max(grad.numel(), 1)
        old = self.scale.get(name)
        if old is None:
            new = torch.where(torch.isfinite(ms), ms, torch.zeros_like(ms))
        else:
            new = torch.lerp(old, ms.to(old.device), weight)
            new = torch.where(torch.isfinite(new), new, old)
        self._replace("scale", name, new)

    def _scale_factor(self, name: str) -> Optional[torch.Tensor]:
        """``sqrt(s_freeze / s_t)`` where the gradients shrank since the freeze, else 1: how much longer
        this rank's step is than with ``v`` frozen for good (1 where either average is zero: a tensor
        without gradient); None while the scale has not moved since the freeze.

        >>> fv = FrozenVariance()
        >>> fv.scale_at_freeze["w"] = torch.tensor(4.0)
        >>> fv.scale["w"] = torch.tensor(1.0); float(fv._scale_factor("w"))     # gradients 2x smaller
        2.0
        >>> fv.scale["w"] = torch.tensor(9.0); float(fv._scale_factor("w"))     # larger: v stays frozen
        1.0
        """
        now, then = self.scale.get(name), self.scale_at_freeze.get(name)
        if self.follow_scale is None or now is None or then is None or now is then:
            return None
        ok = (now > 0) & (then > 0)
        ratio = torch.where(ok, then / torch.where(ok, now, torch.ones_like(now)), torch.ones_like(now))
        return (ratio.clamp(min=1.0) if self.follow_scale == "down" else ratio).sqrt()

    def dense_average(self, name: str, avg: torch.Tensor) -> None:
        """Keep the squared norm of a warm-up step's average as exchanged (see :meth:`_unscale`), and
        count the warm-up steps whose average was all zero (no rank had a gradient: a layer not used
        yet, sent as zeros), which :meth:`dense` does not count as warm-up.

        Why: Adam steps such a tensor (``exp_avg_sq`` stays zero, ``step`` grows), so a layer first
        used after ``warmup`` steps froze after its first gradient, its ``v`` a tenth of the
        gradient's square: each compressed step then moved it about ten times too far (its weights
        20x uncompressed training's within 10 steps). On the device, no host sync here."""
        if name in self._lr_seen and name not in self.denom:   # asked by dense(): a tensor to freeze
            zero = (avg == 0).all().to(torch.int64)
            idle = self._idle.get(name)
            self._idle[name] = zero if idle is None else idle + zero.to(idle.device)
        if name in self._last_v and name not in self.denom and self.window is not None:
            param, _, optimizer = self._bound[name]
            t = int(optimizer.state.get(param, {}).get("step", 0)) + 1   # the Adam step about to use it
            self._delivered[name] = (t, _squared_norm(avg))

    def _unscale(self, name: str, t: int, squared: torch.Tensor) -> None:
        """Undo, in the squared gradient of Adam's step ``t``, a scaling done by the user's code
        between the exchange and that step: ``clip_grad_norm_`` in Horovod's pattern
        (``synchronize()``, clip, ``step()``) or before ``step()`` under DDP.

        Why: after the freeze the update is made from the gradients as exchanged, where such code
        no longer reaches them (compressed tensors hand the optimizer zeros). A ``v`` frozen from
        clipped gradients then divides unclipped ones: every compressed step too long. The scale
        is the ratio of the squared sums, left alone within :data:`CLIP_DETECT_TOLERANCE` (float32
        recovery errors are orders of magnitude below it, so runs without clipping are unchanged,
        bit for bit)."""
        got = self._delivered.pop(name, None)
        if got is None or got[0] != t:
            return
        ratio = squared.sum() / got[1].to(squared.device)
        if name not in self._scale_checked:   # once per tensor: one read to the host
            self._scale_checked.add(name)
            self._refuse_loss_scale(name, float(ratio))
        scaled = (ratio - 1.0).abs() > CLIP_DETECT_TOLERANCE
        squared.div_(torch.where(scaled & (ratio > 0), ratio, torch.ones_like(ratio)))
        least = self._rescaled.get(name)
        self._rescaled[name] = ratio if least is None else torch.minimum(least, ratio)

    def _refuse_loss_scale(self, name: str, ratio: float) -> None:
        """Refuse, in the warm-up's first steps, gradients exchanged over :data:`SCALED_GRADIENT_RATIO`
        times larger than the optimizer then used, by a power of two (``ratio``: the squared sums'
        quotient): a loss scaler's ``unscale_``. Why here: after the warm-up this policy applies the
        update itself, before the scaler unscales; :meth:`_check_scale` refuses it then, but only after
        ``warmup`` steps (up to ``max_warmup`` under a rising rate) of a run that cannot go on. The
        averages and Adam's state are the same on every rank, so every rank raises at the same step."""
        # A loss scale is a power of two (GradScaler's growth and backoff factors are 2 and 0.5); a
        # clip_grad_norm_ of a huge gradient, also >1000x, is not, and is said at the freeze instead.
        power = math.log2(ratio) if ratio > 0.0 else 0.5
        if ratio * SCALED_GRADIENT_RATIO ** 2 < 1.0 and abs(power - round(power)) < 1e-2:
            raise ValueError(
                f"feedback='frozen': the gradients of {name!r} were exchanged {ratio ** -0.5:.3g}x larger than the "
                "optimizer used them: a loss scaler's unscale_ (torch.amp.GradScaler)? After its dense warm-up this "
                "policy applies the update itself, before the scaler unscales, so it cannot follow a loss scale. "
                "Use bf16 autocast without a scaler, or build the compressor with feedback='classic'.")

    def _frozen_v(self, name: str, v: torch.Tensor, b2: float, t: int) -> torch.Tensor:
        """The second moment to freeze: the average of the warm-up's last ~``window`` squared
        gradients when it saw enough of them (a fifth of the window), else Adam's own, bias-corrected.

        Why not Adam's own: with ``b2 = 0.999`` Adam's v at step 100 is close to a plain average of
        all 100 steps, dominated by the first ones, whose gradients are large and differently
        shaped. Adam itself forgets them over the next ~1000 steps; a frozen v never does. With
        AdamW over 1200 steps, freezing Adam's v at step 100 ended above the 1% target, the last
        50 steps' average within it (docs/STUDY_RUN_LENGTH.md)."""
        recent, n = self._recent.pop(name, (None, 0))
        self._last_v.pop(name, None)
        self._lr_seen.pop(name, None)
        self._delivered.pop(name, None)
        self._idle.pop(name, None)
        if recent is not None and self.window is not None and n >= max(2, self.window // 5):
            return (recent / (1.0 - (1.0 - 1.0 / self.window) ** n)).to(v.dtype)
        return v / (1.0 - b2 ** t)

    def _say_if_clipped(self, name: str) -> None:
        """At the freeze, once per policy: say that the warm-up saw the user's code scale the gradients
        (see :meth:`_unscale`), and what bounds them from now on."""
        least = self._rescaled.pop(name, None)
        if least is None or self.clipping_seen or not float(least) < 1.0 - CLIP_DETECT_TOLERANCE:
            return
        self.clipping_seen = True
        warnings.warn(
            f"feedback='frozen': during Adam's dense warm-up the gradients of {name!r} were scaled (down to "
            f"{float(least) ** 0.5:.3g}x) between the exchange and the optimizer step, as clip_grad_norm_ does. The "
            "second moment is frozen from the gradients as exchanged, and from now on such code does not reach "
            "the compressed tensors (their update is applied from the exchange; p.grad holds zeros): to bound "
            "the gradients, use the compressor's clip= (e.g. TopKQSGD(ratio=0.01, bits=8, clip=1.0)), which "
            "clips each rank's gradient before it is sent.", RuntimeWarning, stacklevel=3)

    def _freeze(self, name: str) -> None:
        self._say_if_clipped(name)
        param, group, optimizer = self._bound[name]
        state = optimizer.state[param]
        b1, b2 = group["betas"]
        t = int(state["step"])
        v = state["max_exp_avg_sq"] if group.get("amsgrad") else state["exp_avg_sq"]
        v = v.detach().to(residual_dtype(param.dtype)).reshape(-1)
        root = self._frozen_v(name, v, b2, t).sqrt()
        self.denom[name] = root.clamp(min=self.floor * float(root.mean())).add_(group["eps"])
        if self._keeps_momentum(name, t):
            self.velocity[name] = state["exp_avg"].detach().to(root.dtype).reshape(-1).clone()
        self.steps[name] = t

    def _keeps_momentum(self, name: str, t: int) -> bool:
        """Whether ``name`` sends Adam's momentum at step ``t`` (see :data:`FLAT_RATE_STEPS`)."""
        if self.momentum == WHILE_DENSE:
            return self._dense_share(name)
        if self.momentum is not None:
            return self.momentum
        since = self._flat.get(name)
        return since is None or t - since[1] < FLAT_RATE_STEPS

    def _dense_share(self, name: str) -> bool:
        """Whether the exchange being prepared sends more than ``1 - b1`` of ``name`` (``momentum="while
        dense"``). Why that line: above it a coordinate goes out more often than every ``1 / (1 - b1)``
        steps, the span Adam's momentum averages, so the residual no longer averages its gradient's
        noise as the momentum would: each rank's gradient over ``denom`` sent at a 25% share made the
        freeze check's model jump right after the freeze (docs/FREEZE_CHECK_01.md), as plain SGD does
        at a rate that heavy-ball momentum takes in its stride. Below it, the momentum sent through
        error feedback is late twice (the momentum's own delay, then the residual's) and swung the
        same model's loss; the gradient is not.

        >>> fv = FrozenVariance(momentum="while dense")
        >>> fv._bound["w"] = (None, {"betas": (0.9, 0.999)}, None)
        >>> fv.share_sent = lambda name: 0.25; fv._dense_share("w")
        True
        >>> fv.share_sent = lambda name: 0.01; fv._dense_share("w")
        False
        """
        if self.share_sent is None:
            return False   # a dense codec: no warm-up
        return self.share_sent(name) > 1.0 - float(self._bound[name][1]["betas"][0])

    def prepare(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        if self.needs_optimizer_state(name):   # the DDP hook sends such a tensor dense instead
            raise RuntimeError(f"feedback='frozen' needs the wrapped optimizer to know parameter {name!r}: "
                               "use it through hvd_gradcomp.DistributedOptimizer, hvd.DistributedOptimizer or "
                               "hvd_gradcomp.ddp.register(..., optimizer=opt)")
        self.residuals.check_shape(name, grad)
        if name not in self.denom:
            self._freeze(name)
            self._check_scale(name, grad)
            param, _, optimizer = self._bound[name]
            optimizer.state[param]["exp_avg"].zero_()  # from now on it moves nothing but weight decay
        if name not in self.scale_at_freeze and name in self.scale:
            # the scale at the freeze: the warm-up's (none when the road did not show the warm-up's
            # gradients: then the first compressed step's, taken at the next one)
            self.scale_at_freeze[name] = self.scale[name]
        self._follow_scale(name, grad)
        u = self._direction(name, grad)
        # What goes out is the update direction u / denom, not u: top-k then picks the coordinates
        # that would move most, and the residual is kept in the units of movement.
        acc, res = self.residuals.buffer(name, u), self.residuals.residual(name, self._lr(name))
        factor = self._scale_factor(name)
        if factor is not None:
            u = u * factor.to(u.dtype)
        return torch.div(u, self.denom[name], out=acc) if res is None else \
            torch.addcdiv(res, u, self.denom[name], out=acc)

    def _direction(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        """What is divided by ``denom`` and sent: the new first moment while the tensor keeps Adam's
        momentum, else the gradient (see the class docstring)."""
        denom = self.denom[name]
        t = self.steps[name]
        self._note_rate(name, t, float(self._bound[name][1]["lr"]))
        if name in self.velocity and not self._keeps_momentum(name, t):
            self._remember(name)          # an undone step puts the velocity back
            del self.velocity[name]       # for good: the rate has stayed the same
        if name not in self.velocity:
            return grad.reshape(-1).to(denom.dtype)
        b1 = self._bound[name][1]["betas"][0]
        old = self.velocity[name]
        # A new tensor, not old.mul_: the old velocity is what an undone step puts back.
        # b1*u + (1-b1)*g in one pass.
        u = torch.lerp(grad.reshape(-1).to(old.dtype), old, b1, out=self._buffer("velocity", name, old))
        self._replace("velocity", name, u)
        return u

    def _check_scale(self, name: str, grad: torch.Tensor) -> None:
        """Refuse gradients far larger than the warm-up's (a loss scaler's scaled gradients): the
        update is applied before the scaler unscales, so it would be that many times too large.
        Called once per tensor, at its first compressed step, before any state changes."""
        rms_g = float(grad.detach().float().pow(2).mean().sqrt())
        rms_v = float((self.denom[name] - self._bound[name][1]["eps"]).pow(2).mean().sqrt())
        if rms_v > 0 and rms_g > SCALED_GRADIENT_RATIO * rms_v:
            del self.denom[name], self.steps[name]
            self.velocity.pop(name, None)
            raise ValueError(
                f"feedback='frozen': the gradient of {name!r} is {rms_g / rms_v:.3g}x larger than during Adam's "
                "dense warm-up; is it scaled by a loss scaler (torch.amp.GradScaler)? This policy applies the "
                "update in synchronize(), before the scaler unscales. Use bf16 autocast without a scaler, or "
                "build the compressor with feedback='classic'.")

    def received(self, name: str, avg: torch.Tensor, support: Optional[torch.Tensor] = None) -> None:
        if not kernels.all_finite(avg):
            return  # passed on as it is: the loss scaler skips this step on every rank
        param, group, _ = self._bound[name]
        self._remember(name)
        t = self.steps[name] = self.steps[name] + 1
        lr = float(group["lr"])
        # Adam's bias correction, of the first moment only
        scale = -lr / (1.0 - group["betas"][0] ** t) if name in self.velocity else -lr
        if group.get("maximize", False):
            scale = -scale
        # The wrapped optimizer decays the parameter after this (decoupled weight decay,
        # p *= 1 - lr*wd): pre-divide so the result is p*(1 - lr*wd) + step, as in AdamW.
        decay = 1.0 - lr * float(group.get("weight_decay", 0.0))
        if decay > 0.0:
            scale /= decay
        with torch.no_grad():
            param.add_(avg.view(param.shape).to(param.dtype), alpha=scale)
        avg.zero_()

    def received_terms(self, name: str) -> Optional[List[Tuple[torch.Tensor, torch.Tensor]]]:
        """``[]``: :meth:`received` zeroes a finite average and leaves a non-finite one as it was, so
        the exchange's check at the sent indices holds (see :meth:`Feedback.received_terms`); before,
        every compressed tensor of AdamW got a full pass more in ``synchronize()``, over zeros."""
        return []

    def describe(self) -> str:
        # issue 9: with AdamW over 1200 steps, freezing after 300 steps (a quarter of the run, 1-bit
        # Adam's advice) ended closest to uncompressed (docs/STUDY_RUN_LENGTH.md); the run's length
        # is not known here, so the user is told once rather than the default guessed. The frozen v
        # follows the gradients where they shrink (see the class docstring)
        return (f"Adam's second moment frozen after {self.warmup} dense steps per tensor (more while the learning "
                f"rate still rises, at most {self._longest_warmup}), "
                + {True: "each rank's momentum through error feedback (1-bit Adam style)",
                   False: "each rank's gradient through error feedback, whose residual takes the first moment's place",
                   None: "each rank's momentum through error feedback (1-bit Adam style) while the learning rate "
                         f"changes, its gradient once the rate has stayed the same {FLAT_RATE_STEPS} steps (error "
                         "feedback's residual then takes the first moment's place: docs/STUDY.md, transformer-const)",
                   WHILE_DENSE: "each rank's momentum through error feedback while the sparsity warm-up sends more than "
                                "1 - b1 of a tensor, its gradient after (whose residual takes the first moment's place)"
                   }[self.momentum]
                + {"down": ", the frozen v following the gradients' scale where it shrinks (docs/STUDY.md)",
                   "both": ", the frozen v following the gradients' scale", None: ", v frozen for good"
                   }[self.follow_scale]
                + f"; for a run much longer than {4 * self.warmup} steps, freeze "
                "later: feedback=FrozenVariance(warmup=a quarter of the run's steps) (docs/STUDY_RUN_LENGTH.md)")

    def state_dict(self) -> Dict[str, Any]:
        # The warm-up's window (running average, Adam's last v) and the rates seen are saved too, so
        # a run resumed inside the warm-up freezes the same v at the same step as one that never
        # stopped (two gradient-sized tensors per tensor still in its warm-up; none after it).
        return {**super().state_dict(), "velocity": _clone_tensors(self.velocity), "denom": _clone_tensors(self.denom),
                "steps": dict(self.steps), "warmup": self.warmup, "floor": self.floor,
                "sparsity_warmup": self.sparsity_warmup, "window": self.window,
                "max_warmup": self.max_warmup, "momentum": self.momentum, "flat": dict(self._flat),
                "follow_scale": self.follow_scale,
                "recent": {n: (r.clone(), k) for n, (r, k) in self._recent.items()},
                "last_v": {n: (t, v.clone()) for n, (t, v) in self._last_v.items()},
                "lr_seen": dict(self._lr_seen),
                "delivered": {n: (t, x.clone()) for n, (t, x) in self._delivered.items()},
                "rescaled": _clone_tensors(self._rescaled), "clipping_seen": self.clipping_seen,
                "scale": _clone_tensors(self.scale), "scale_at_freeze": _clone_tensors(self.scale_at_freeze),
                "idle": _clone_tensors(self._idle)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.velocity = _clone_tensors(state.get("velocity", {}))
        self.denom = _clone_tensors(state.get("denom", {}))
        self.steps = dict(state.get("steps", {}))
        self.warmup, self.floor = int(state.get("warmup", self.warmup)), float(state.get("floor", self.floor))
        self.window = state.get("window", self.window)
        self.max_warmup = int(state.get("max_warmup", self.max_warmup))
        # Checkpoints from before the choice was saved: this policy's (tensors frozen then have a velocity)
        self.momentum = state.get("momentum", self.momentum)
        self.follow_scale = state.get("follow_scale", self.follow_scale)
        self._flat = {n: (float(lr), int(t)) for n, (lr, t) in state.get("flat", {}).items()}
        # Checkpoints from before the window was saved have none: the warm-up's window starts again.
        self._recent = {n: (r.clone(), int(k)) for n, (r, k) in state.get("recent", {}).items()}
        self._last_v = {n: (int(t), v.clone()) for n, (t, v) in state.get("last_v", {}).items()}
        self._lr_seen = {n: (int(t), float(lr), bool(up)) for n, (t, lr, up) in state.get("lr_seen", {}).items()}
        self._delivered = {n: (int(t), x.clone()) for n, (t, x) in state.get("delivered", {}).items()}
        self._rescaled = _clone_tensors(state.get("rescaled", {}))
        # Checkpoints from before idle steps were counted: those steps count as warm-up, as they did.
        self._idle = _clone_tensors(state.get("idle", {}))
        self.clipping_seen = bool(state.get("clipping_seen", False))
        # Checkpoints from before the scale was followed (or followed at a constant rate only, averaged
        # as Adam averages; their "scale_rate" is ignored): followed from the next step on.
        self.scale = _clone_tensors(state.get("scale", {}))
        # the same tensor when the scale has not moved since the freeze (see _scale_factor)
        self.scale_at_freeze = {n: self.scale[n] if n in self.scale and torch.equal(t, self.scale[n]) else t.detach().clone()
                                for n, t in state.get("scale_at_freeze", {}).items()}
        self.sparsity_warmup = int(state.get("sparsity_warmup", self.sparsity_warmup))
        if self._undo is not None:
            self._undo.clear()


FOLLOW_SCALE = ("down", "both", None)
"""The choices of :class:`FrozenVariance`'s ``follow_scale`` (see its docstring)."""
WHILE_DENSE = "while dense"
"""``FrozenVariance(momentum=WHILE_DENSE)``: Adam's momentum while the share sent is above ``1 - b1``."""

FLAT_RATE_STEPS = 50
"""Steps at one learning rate after which a tensor under :class:`FrozenVariance` (``momentum=None``)
sends its gradient rather than Adam's momentum (see the class docstring). Why 50: a schedule that
changes the rate every step (cosine, linear, exponential, OneCycleLR) never gets there, nor does the
end of a warm-up ramp pass for a constant rate; and it is shorter than the 100-step dense warm-up, so
at a rate constant from the start the momentum is dropped from the first compressed step on."""

CLIP_DETECT_TOLERANCE = 1e-2
"""A squared gradient sum recovered from Adam's ``v`` this far from the exchanged one's (relative)
counts as scaled by the user's code (see :meth:`FrozenVariance._unscale`); float32 recovery
errors stay well under it."""

FROZEN_VARIANCE_CLASSES = ("Adam", "AdamW")
SCALED_GRADIENT_RATIO = 1000.0
"""A first compressed gradient this many times the warm-up's RMS is taken for a loss-scaled one."""


def check_frozen_variance(optimizer: Any) -> None:
    """Raise unless ``optimizer`` is Adam or AdamW without coupled weight decay (what
    :class:`FrozenVariance` can freeze exactly).

    >>> check_frozen_variance(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1))
    Traceback (most recent call last):
    ...
    ValueError: feedback='frozen' needs torch.optim.Adam or AdamW, got SGD: use feedback='momentum' for SGD with momentum, 'classic' for plain SGD, and for other adaptive optimizers 'update' (the Horovod wrappers) or 'classic' (the DDP hook)
    """
    why = frozen_variance_unsupported(optimizer)
    if why:
        raise ValueError(f"feedback='frozen' needs torch.optim.Adam or AdamW, got {why}: use feedback='momentum' "
                         "for SGD with momentum, 'classic' for plain SGD, and for other adaptive optimizers 'update' "
                         "(the Horovod wrappers) or 'classic' (the DDP hook)")


def frozen_variance_unsupported(optimizer: Any) -> str:
    """Why :class:`FrozenVariance` cannot run ``optimizer`` ('' when it can)."""
    cls = plain_class(optimizer)
    if cls.__name__ not in FROZEN_VARIANCE_CLASSES:
        return cls.__name__
    groups = getattr(optimizer, "param_groups", [])
    if cls.__name__ == "Adam" and any(float(g.get("weight_decay", 0.0)) != 0.0
                                      and not g.get("decoupled_weight_decay", False) for g in groups):
        return "Adam with coupled weight decay (AdamW decouples it)"
    return ""


POLICIES = {"none": NoFeedback, "classic": ErrorFeedback, "momentum": MomentumCorrection, "update": LocalUpdate,
            "frozen": FrozenVariance}


def make(policy: Union[str, Feedback]) -> Feedback:
    """A feedback policy from its name (``none``, ``classic``, ``momentum``, ``update``, ``frozen``) or as given.

    >>> make("classic").describe()
    'classic'
    """
    if isinstance(policy, Feedback):
        return policy
    if policy not in POLICIES:
        raise ValueError(f"feedback must be 'auto', one of {sorted(POLICIES)} or a Feedback instance, got {policy!r}")
    return POLICIES[policy]()


ADAPTIVE = {"Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad", "Adadelta", "Adafactor", "Lion"}


def choose(optimizer: Any, codec_is_dense: bool, contracting: bool) -> Tuple[str, str]:
    """The policy ``feedback="auto"`` applies, and why, from the wrapped optimizer's class and settings.

    * low-bit QSGD (4 and 2 bits), whose error feedback would need shrinking the payload:
      ``none`` (QSGD is unbiased; plain QSGD trains, see docs/STUDY.md);
    * other dense codecs (QSGD-8): ``classic``;
    * ``Adam`` and ``AdamW`` (without coupled weight decay): ``frozen`` (:class:`FrozenVariance`);
    * other Adam-type optimizers (normalising per coordinate) without coupled weight decay:
      ``update``;
    * ``SGD`` with momentum (dampening < 1): ``momentum`` (DGC momentum correction, no masking);
    * everything else (plain SGD, Adam with coupled L2 weight decay, unknown optimizers):
      ``classic``.

    >>> w = [torch.zeros(1, requires_grad=True)]
    >>> choose(torch.optim.AdamW(w), False, False)[0], choose(torch.optim.SGD(w, lr=0.1, momentum=0.9), False, False)[0]
    ('frozen', 'momentum')
    >>> choose(torch.optim.RMSprop(w), False, False)[0]
    'update'
    """
    name = type(optimizer).__name__
    if codec_is_dense:
        if contracting:
            return "none", "low-bit QSGD is unbiased; error feedback on it would need shrinking every payload"
        return "classic", "dense codec"
    names = {c.__name__ for c in type(optimizer).__mro__}
    if names & ADAPTIVE:
        groups = getattr(optimizer, "param_groups", [])
        decoupled = "AdamW" in names or all(g.get("decoupled_weight_decay", False) for g in groups)
        if not decoupled and any(float(g.get("weight_decay", 0.0)) != 0.0 for g in groups):
            return "classic", (f"{name} with coupled weight decay (the update cannot be sent apart from it; "
                               "AdamW decouples it)")
        if not frozen_variance_unsupported(optimizer):
            return "frozen", f"{plain_class(optimizer).__name__}: v is frozen after a dense warm-up, then Adam is linear"
        return "update", f"{name} normalises per coordinate"
    if "SGD" in names and any(float(g.get("momentum", 0.0)) > 0 for g in getattr(optimizer, "param_groups", [])):
        if all(float(g.get("dampening", 0.0)) < 1.0 for g in optimizer.param_groups):
            return "momentum", f"{name} with momentum"
    return "classic", name


def announce(message: str) -> None:
    """Say once, on rank 0, what the library chose: through logging, or on stderr when the
    application configured no logging (so it is never silent)."""
    log.info(message)
    if not log.hasHandlers():
        print(f"hvd_gradcomp: {message}", file=sys.stderr, flush=True)


def _squared_norm(t: torch.Tensor) -> torch.Tensor:
    """The squared L2 norm of ``t`` as a float32 0-dim tensor, summed in float32 or wider, whatever
    ``t``'s floating dtype. Why not ``vector_norm(t, dtype=torch.float32)``: it refuses to narrow a
    float64 tensor (a float64 layer goes uncompressed, but its dense steps still reach the policy).

    >>> _squared_norm(torch.tensor([3.0, 4.0], dtype=torch.float64)), _squared_norm(torch.tensor([3.0, 4.0]).half())
    (tensor(25.), tensor(25.))
    """
    t = t.detach()
    return torch.linalg.vector_norm(t, dtype=None if t.dtype == torch.float64 else torch.float32).float().square()
