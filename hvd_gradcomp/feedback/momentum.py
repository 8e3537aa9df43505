"""DGC's momentum correction (Lin et al., 2018) for ``torch.optim.SGD(momentum=m)``: the
``feedback="momentum"`` policy (see :mod:`hvd_gradcomp.feedback` for the protocol every policy follows).
"""
from __future__ import annotations

import warnings
from typing import Any, Dict, List, NamedTuple, Optional, Tuple, Union

import torch

from . import kernels
from .policy import SPARSITY_WARMUP, ErrorFeedback, _clone_tensors, _RoundUndo, check_sparsity_warmup
from .residuals import Marked, Sent, residual_dtype


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
    coordinates sent); off by default, it measured worse (benchmarks/results/STUDY.md). ``sparsity_warmup``:
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
    rank_own_state = ("units", "velocity")   # "delivered" (the averaged velocity) is the same on every rank
    uses_support = True
    # Below 1% the warm-up lasts sqrt(1%/ratio) times longer (317 steps at 0.1%), not 172 at 1%'s pace:
    # unlike "frozen", whose dense warm-up comes first, this warm-up is all the lead-in momentum SGD gets.
    # The study's char-MLP and CNN with momentum SGD at 0.1%: rows "172-step sparsity warm-up" (benchmarks/results/STUDY.md).
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
        (:func:`hvd_gradcomp.feedback.kernels.momentum_marked`). The new velocity is kept by :meth:`sent`,
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
            idx = what[0] if what[0] is not None else slice(None)   # a dense payload sent every value
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
