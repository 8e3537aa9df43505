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

import copy
import functools
import importlib
import inspect
import logging
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple, Union

import torch

from ..wire import kernels

HALF_DTYPES = (torch.float16, torch.bfloat16)
Sent = Union["kernels.QSGDDecoded", Tuple[Optional[torch.Tensor], torch.Tensor]]
"""What a payload carries (see :class:`hvd_gradcomp.codecs.contract.Encoded`): ``(indices, values)``
of a sparse payload, ``(None, values)`` of a dense one (flat), or QSGD's codes."""
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
    """acc -= what the payload carries (QSGD codes, sparse ``(indices, values)`` or dense
    ``(None, values)``), in place.

    ``sent`` may also be a list of ``(begin, end, what)``: the chunks of one tensor.

    >>> acc = torch.tensor([3.0, -1.0, 2.0])
    >>> subtract_sent(acc, (None, torch.tensor([2.0, -2.0, 2.0]))); acc.tolist()
    [1.0, 1.0, 0.0]
    >>> subtract_sent(acc, (torch.tensor([1]), torch.tensor([1.0]))); acc.tolist()
    [1.0, 0.0, 0.0]
    """
    if isinstance(sent, list):
        for b, e, what in sent:
            subtract_sent(acc[b:e], what)
    elif isinstance(sent, kernels.QSGDDecoded):
        sent.subtract_from(acc)  # one fused pass, no dense decoded temporary
    elif sent[0] is None:
        acc.sub_(sent[1].to(acc.dtype).view_as(acc))
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
        self._taken: Set[str] = set()   # names pop() removed this step: their old residual is not recycled

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
        (:func:`hvd_gradcomp.wire.kernels.add_marked`; None where top-k will not need them);
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

    def __contains__(self, name: str) -> bool:
        return name in self._residuals

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
                if name in self._taken:
                    self._undo.pop(name)
                else:
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
        self._taken.clear()

    def pop(self, name: str) -> Optional[torch.Tensor]:
        """Remove and return the residual of ``name`` (None if there is none): for a caller that
        sends it another way (e.g. :class:`hvd_gradcomp.Auto` switching a tensor's road)."""
        self._spare.pop(name, None)
        if self._undo is not None:
            if name not in self._undo:
                self._undo[name] = self._residuals.get(name)
                self._undo_units[name] = self._units.get(name)
            self._taken.add(name)   # kept: not recycled as a spare buffer (the name may never come back)
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
    one's residual, and casts with :func:`hvd_gradcomp.wire.kernels.to_half_saturated`: divided by the
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
        ``total``: also the sum of ``grad`` (see :class:`hvd_gradcomp.wire.kernels.Marks`)."""
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
    back during a decaying schedule arrives at a smaller rate, or never (docs/STUDY.md).

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
the study's char-MLP closer to uncompressed training: docs/STUDY.md). FrozenVariance has none by
default (it made Adam jump after the freeze: docs/FREEZE_CHECK.md); ``FrozenVariance(sparsity_warmup=100)``
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


FROZEN_VARIANCE_CLASSES = ("Adam", "AdamW")


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


POLICIES = {"none": ":NoFeedback", "classic": ":ErrorFeedback", "update": ":LocalUpdate",
            "momentum": "momentum:MomentumCorrection", "frozen": "frozen:FrozenVariance"}
"""Policy name -> ``"module:class"`` in this package (empty: this module), imported by :func:`make` on first use (the
modules of ``momentum`` and ``frozen`` import this one, so it names them without importing them)."""


def make(policy: Union[str, Feedback]) -> Feedback:
    """A feedback policy from its name (``none``, ``classic``, ``momentum``, ``update``, ``frozen``) or as given.

    >>> make("classic").describe()
    'classic'
    """
    if isinstance(policy, Feedback):
        return policy
    if policy not in POLICIES:
        raise ValueError(f"feedback must be 'auto', one of {sorted(POLICIES)} or a Feedback instance, got {policy!r}")
    module, attr = POLICIES[policy].split(":")
    return getattr(importlib.import_module(f"{__name__}.{module}" if module else __name__), attr)()


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
