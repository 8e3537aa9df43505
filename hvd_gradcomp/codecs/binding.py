"""The feedback policy's binding to an optimizer, the part of :class:`~hvd_gradcomp.codecs.compressor.GradientCompressor`
that chooses and follows it (a mixin, :class:`PolicyBinding`).

``feedback="auto"`` picks the policy from the wrapped optimizer (:meth:`PolicyBinding.attach`); the
policy reads the rate, betas and momentum of each parameter's param group, live, so it is bound to
the groups again after every ``optimizer.load_state_dict()`` and ``add_param_group``
(:meth:`PolicyBinding.bind_groups`). :class:`HandedCheck` watches, through the same optimizer, that
the averages handed over reach its step unscaled.

A mixin rather than an object the compressor owns: the subclasses (``topk``, ``qsgd``,
``powersgd``) and the roads override and call these methods and attributes on the compressor
itself (``_caution``, ``_auto_policy``, ``_set_policy``), and a pickled compressor keeps its layout.
"""
from __future__ import annotations

import math
import warnings
import weakref
from typing import Any, Dict, Optional, Tuple, TypeVar, Union

import torch

from .. import codecs
from .. import feedback as fb
from ..feedback import Feedback

# For this many exchange steps a compressor whose average carries held-back updates (see
# GradientCompressor.carries_held_back) checks that the optimizer steps on the average as it was
# handed over (HandedCheck), on this many sent values per tensor.
HANDED_CHECK_STEPS = 100
HANDED_SAMPLE = 16


class HandedCheck:
    """Whether the user's code scaled, between the exchange and the optimizer's step, the averages a
    compressor whose sent values carry held-back updates handed over
    (:attr:`GradientCompressor.carries_held_back`): ``clip_grad_norm_`` there measures the norm of
    held-back updates, not of a gradient, so it binds on other steps and by other factors than
    uncompressed. What that costs depends on the task (the study's CNN with momentum SGD and
    ``clip_grad_norm_(1.0)`` lost far more than uncompressed; the clipped LSTM of docs/RECIPES.md
    did not), so the warning states the fact and the fix, not an outcome.

    For :data:`HANDED_CHECK_STEPS` steps the compressor keeps a few nonzero values of each average
    (:meth:`keep`); an optimizer step post-hook compares them with ``p.grad`` (:meth:`check`). One
    factor on all of them that changes from step to step is clipping, said once with the fix
    (``clip=``). Left alone: a power of two (a loss scaler's ``unscale_``, exact in floating point:
    factors are compared by their mantissa), a constant factor (a fixed rescale of every step is a
    different learning rate, which error feedback and momentum correction follow exactly), and
    changes other than one scaling (code adding to the gradients). A warning, not an error: the step
    has been taken, and a threshold that binds only now and then (a safety net) does little harm.
    """

    def __init__(self) -> None:
        self.kept: Dict[str, Tuple[int, torch.Tensor, torch.Tensor]] = {}   # name: (step, indices, values)
        self.left = HANDED_CHECK_STEPS
        self.scaled_steps = 0
        self._first: Optional[float] = None   # the first checked step's mantissa
        self._warned = False

    def __getstate__(self) -> Dict[str, Any]:
        return {**self.__dict__, "kept": {}}   # this step's values only

    def keep(self, name: str, flat: torch.Tensor, support: Optional[torch.Tensor], step: int) -> None:
        """Keep up to :data:`HANDED_SAMPLE` nonzero values of the average ``flat`` handed over at
        exchange ``step`` (at the sent indices ``support`` when given)."""
        idx = support if support is not None else flat.nonzero().view(-1)
        idx = idx[:4 * HANDED_SAMPLE]
        vals = flat[idx]
        nonzero = vals != 0
        self.kept[name] = (step, idx[nonzero][:HANDED_SAMPLE], vals[nonzero][:HANDED_SAMPLE].clone())

    def check(self, comp: "PolicyBinding") -> None:
        """After the optimizer's step: compare what ``comp`` handed over with its parameters' ``p.grad``."""
        kept, self.kept = self.kept, {}
        self.left -= 1
        factor = self._factor(kept, comp)
        if factor is None:
            return   # nothing to compare, or not one scaling of the whole average
        mantissa = 0.5 if abs(factor - 1.0) <= 1e-3 else math.frexp(factor)[0]
        if abs(mantissa - 0.5) > 1e-3:
            self.scaled_steps += 1
        first = self._first = mantissa if self._first is None else self._first
        if abs(mantissa - first) > 1e-3 * first and not self._warned:
            self._warned = True
            warnings.warn(
                f"hvd_gradcomp: the averaged gradients {comp!r} handed to the optimizer were scaled by {factor:.3g} "
                f"before its step, by a factor that changes from step to step (clip_grad_norm_?). Under feedback "
                f"'{comp.feedback.key}' each sent value carries the updates of the steps it was held back, so the "
                "averages' norm is not the gradient's: clipping it binds on other steps, by other factors, than it "
                "would uncompressed (what that does to training depends on the task: docs/RECIPES.md measures both "
                "ways). To clip what clip_grad_norm_(max_norm) means, each rank's whole gradient before it is "
                f"compressed: {type(comp).__name__}(..., clip=max_norm), and do not clip the averages.",
                RuntimeWarning, stacklevel=2)

    @staticmethod
    def _factor(kept: Dict[str, Tuple[int, torch.Tensor, torch.Tensor]], comp: "PolicyBinding"
                ) -> Optional[float]:
        """The one factor by which ``p.grad`` differs from the values kept this step; None when none
        were kept or the ratios differ."""
        if comp._binding is None:
            return None
        ratios = []
        for p, name in comp._binding[1].items():
            got = kept.get(name)
            if got is None or got[0] < comp.exchange_step - 1 or got[1].numel() == 0 or p.grad is None \
                    or p.grad.layout is not torch.strided:   # a sparse gradient was not compressed
                continue
            now = p.grad.detach().reshape(-1)[got[1].to(p.grad.device)]
            ratios.append(now.to(torch.float32) / got[2].to(now.device, torch.float32))
        if not ratios:
            return None
        r = torch.cat([x.to(ratios[0].device) for x in ratios])
        lo, hi = torch.stack(r.aminmax()).tolist()   # one read to the host (a device sync on GPU)
        if not (math.isfinite(lo) and math.isfinite(hi)) or lo <= 0 or hi - lo > 1e-3 * hi:
            return None
        return (lo + hi) / 2


_Self = TypeVar("_Self", bound="PolicyBinding")


class PolicyBinding:
    """The feedback policy of a compressor and its binding to the wrapped optimizer: the choice of
    ``feedback="auto"`` (:meth:`attach`), the param groups the policy reads (:meth:`bind_groups`) and
    the check of what the optimizer steps on (:class:`HandedCheck`). Mixed into
    :class:`~hvd_gradcomp.codecs.compressor.GradientCompressor`, which sets ``feedback`` and
    ``feedback_choice``."""

    def _init_binding(self) -> None:
        self._attached: Any = None
        self._binding: Optional[Tuple[Any, Dict[Any, str]]] = None   # see bind_groups
        self._groups_bound = 0   # the optimizer's param groups when last bound (see _follow_groups)
        self._rebind_hook: Any = None
        self._handed_hook: Any = None
        self._handed = HandedCheck()

    @property
    def error_feedback(self) -> bool:
        """Whether anything the payload did not carry is kept (any policy but ``none``)."""
        return self.feedback.key != "none"

    @error_feedback.setter
    def error_feedback(self, on: bool) -> None:
        if not isinstance(on, bool):
            raise ValueError(f"error_feedback must be True or False, got {on!r}")
        if on != self.error_feedback:
            self.feedback_choice = "auto" if on else "none"
            self._set_policy(fb.make("classic" if on else "none"))

    def set_feedback(self: _Self, policy: Union[str, Feedback]) -> _Self:
        """Choose the feedback policy after construction (as ``feedback=``), before the first
        exchange; returns self.

        >>> from hvd_gradcomp.codecs.topk import TopK
        >>> TopK().set_feedback("momentum").feedback.key
        'momentum'
        """
        if self._steps:
            raise ValueError("set the feedback policy before the first exchange: the state of the "
                             f"current one ({self.feedback.key!r}) would be lost")
        policy = policy if isinstance(policy, Feedback) or policy == "auto" else fb.make(policy)
        self.feedback_choice = policy
        self._set_policy(fb.make("classic" if policy == "auto" else policy))
        self._attached = None
        return self

    @property
    def residuals(self) -> fb.ResidualStore:
        """The residuals of the feedback policy (what was not sent yet, per name)."""
        return self.feedback.residuals

    def attach(self, optimizer: Any, names: Dict[Any, str], rank: int = 0) -> None:
        """Bind to the wrapped optimizer: with ``feedback="auto"`` choose the policy from its class
        and settings (:func:`hvd_gradcomp.feedback.choose`) and say so once on rank 0.

        Called by ``hvd_gradcomp.DistributedOptimizer`` and, inside ``hvd.DistributedOptimizer``,
        at the first exchange; ``names`` maps each parameter to its name.
        """
        if self._attached is optimizer:
            return
        self._attached = optimizer
        why = "chosen by the user"
        if self.feedback_choice == "auto" and not self._restored:
            key, why = fb.choose(optimizer, codecs.nature_of(self) == codecs.DENSE, self._contracting)
            if key != self.feedback.key:
                self._set_policy(self._auto_policy(key))
        self.bind_groups(optimizer, names)
        if rank == 0:
            fb.announce(f"{self!r} with {type(optimizer).__name__}: feedback '{self.feedback.key}' "
                        f"({self.feedback.describe()}; {why}). Override with feedback='none'|'classic'|"
                        "'momentum'|'update'|'frozen'." + self._caution())

    def bind_groups(self, optimizer: Any, names: Dict[Any, str]) -> None:
        """Bind the feedback policy to each named parameter's param group of ``optimizer`` (the
        policies read the rate, betas, momentum and weight decay there, live), now and again after
        every ``optimizer.load_state_dict()`` and policy change.

        Why again: torch's ``load_state_dict`` replaces the group dicts. A policy still reading the
        old ones kept the rate of before the load for the rest of the run (a resumed run with a
        scheduler stepped at a stale rate, and error feedback rescaled its residuals by it).
        Called by the optimizers and the DDP hook, not by users.
        """
        self._binding = (optimizer, names)
        self._bind_policy()
        if self._rebind_hook is not None:
            self._rebind_hook.remove()
        me = weakref.ref(self)   # the optimizer must not keep alive a compressor it no longer uses

        def rebind(opt: Any) -> None:
            comp = me()
            if comp is not None and comp._binding is not None and comp._binding[0] is opt:
                comp._bind_policy()

        register = getattr(optimizer, "register_load_state_dict_post_hook", None)
        self._rebind_hook = None if register is None else register(rebind)

        def check(opt: Any, args: Any, kwargs: Any) -> None:
            comp = me()
            if comp is not None and comp._handed.kept and comp._binding is not None and comp._binding[0] is opt:
                comp._handed.check(comp)

        if self._handed_hook is not None:
            self._handed_hook.remove()
        register = getattr(optimizer, "register_step_post_hook", None)
        self._handed_hook = None if register is None else register(check)

    def __getstate__(self) -> Dict[str, Any]:
        # The optimizer hooks (see bind_groups) stay with the optimizer they were registered on:
        # a pickled or deep-copied compressor does not carry them (their handles refer to local functions).
        return {**self.__dict__, "_rebind_hook": None, "_handed_hook": None}

    @property
    def policy_settled(self) -> bool:
        """Whether the feedback policy is chosen on a Horovod road: the compressor is attached to the
        wrapped optimizer (``hvd_gradcomp.DistributedOptimizer`` attaches it when built, inside stock
        ``hvd.DistributedOptimizer`` at its first step). The DDP hook chooses in ``register()``."""
        return self._attached is not None

    @property
    def carries_held_back(self) -> bool:
        """Whether each sent value of the average carries the updates of the steps it was held
        back (a sparse compressor under error feedback on gradients or DGC's momentum correction):
        its norm is then far above a gradient's, and ``clip_grad_norm_`` on the average shrinks
        every step far more than meant. False here; see :meth:`TopK.carries_held_back`."""
        return False

    @property
    def scaled_after_exchange(self) -> int:
        """Checked steps whose averages the user's code scaled, other than by a power of two,
        between the exchange and the optimizer's step (see :class:`HandedCheck`)."""
        return self._handed.scaled_steps

    def _follow_groups(self) -> None:
        """Bind the policy to the param groups added to the bound optimizer since it was bound
        (``optimizer.add_param_group`` after wrapping: progressive unfreezing), before a tensor of
        theirs is compressed. Here because every road asks :meth:`compresses` before it compresses
        a tensor; ``hvd_gradcomp.DistributedOptimizer.add_param_group`` binds at once.

        Why: the DDP hook and stock ``hvd.DistributedOptimizer`` do not see the call. Unbound, momentum
        correction ran the new parameters with momentum 0 under SGD(momentum=0.9), and ``"frozen"``
        sent them uncompressed (the DDP hook: parameters outside the optimizer) for good."""
        if self._binding is not None and len(getattr(self._binding[0], "param_groups", ())) != self._groups_bound:
            self._bind_policy()

    def _bind_policy(self) -> None:
        if self._binding is None:
            return
        optimizer, names = self._binding
        self.feedback.share_sent = getattr(self, "share", None)   # a top-k codec's share, for the policy
        self._groups_bound = len(getattr(optimizer, "param_groups", ()))
        for group in getattr(optimizer, "param_groups", []):
            for p in group["params"]:
                if p in names:
                    self.feedback.bind(names[p], group, p, optimizer)

    def _caution(self) -> str:
        """What the user should know about these settings, said with the choice (empty: nothing)."""
        return ""

    def _auto_policy(self, key: str) -> Feedback:
        """The policy ``feedback="auto"`` chose, as this compressor's settings want it (see :meth:`TopK._auto_policy`)."""
        return fb.make(key)

    @property
    def _restored(self) -> bool:
        return getattr(self, "_loaded_policy", False)

    @property
    def _contracting(self) -> bool:
        return False

    def _set_policy(self, policy: Feedback) -> None:
        self.feedback = policy
        self._track_rounds()
        self._bind_policy()   # a policy taken from a checkpoint after attach() needs its groups too
