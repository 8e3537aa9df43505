"""What a rank keeps of a gradient it did not send: :class:`ResidualStore` (the residuals, keyed by
parameter name, with their spare buffers) and :class:`HalfPrecision` (fp16/bf16 gradients, whose
residuals are kept in fp32), plus the helpers every feedback policy uses on them
(:func:`residual_dtype`, :func:`subtract_sent`).
"""
from __future__ import annotations

import logging
import sys
from typing import Any, Dict, Optional, Sequence, Set, Tuple, Union

import torch

from . import kernels


HALF_DTYPES = (torch.float16, torch.bfloat16)
Sent = Union["kernels.SentCodes", Tuple[Optional[torch.Tensor], torch.Tensor]]
"""What a payload carries (see :class:`hvd_gradcomp.codecs.interface.Encoded`): ``(indices, values)``
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
    elif isinstance(sent, kernels.SentCodes):
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
        (:func:`hvd_gradcomp.feedback.kernels.add_marked`; None where top-k will not need them);
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
    """Error feedback of the float16 cast: float32 tensors a compressor exempts from compression
    (fewer elements than ``min_compress_numel``, or matched by ``exclude=``) travel as float16,
    half the bytes, and what the cast takes away is added to their next send.

    :meth:`encode` takes this rank's gradients (several tensors fused into one send), adds each
    one's residual, and casts with :func:`hvd_gradcomp.feedback.kernels.to_half_saturated`: divided by the
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
