"""A compressor's binding to the wrapped optimizer (:class:`OptimizerBinding`, a part it owns).

``feedback="auto"`` picks the policy from the wrapped optimizer once it is attached
(:meth:`GradientCompressor.attach <hvd_gradcomp.codecs.compressor.GradientCompressor.attach>`); the
policy reads the rate, betas and momentum of each parameter's param group, live, so it is bound to
the groups again after every ``optimizer.load_state_dict()`` and ``add_param_group``
(:meth:`OptimizerBinding.bind_policy`). :class:`HandedCheck` watches, through the same optimizer, that
the averages handed over reach its step unscaled.
"""
from __future__ import annotations

import math
import warnings
import weakref
from typing import Any, Dict, Optional, Tuple, Union

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
    ``clip_grad_norm_(1.0)`` lost far more than uncompressed; the clipped LSTM of benchmarks/results/RECIPES.md
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

    def check(self, comp: Any) -> None:
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
                "would uncompressed (what that does to training depends on the task: benchmarks/results/RECIPES.md measures both "
                "ways). To clip what clip_grad_norm_(max_norm) means, each rank's whole gradient before it is "
                f"compressed: {type(comp).__name__}(..., clip=max_norm), and do not clip the averages.",
                RuntimeWarning, stacklevel=2)

    @staticmethod
    def _factor(kept: Dict[str, Tuple[int, torch.Tensor, torch.Tensor]], comp: Any
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


class OptimizerBinding:
    """A compressor's binding to the wrapped optimizer: the optimizer it was attached to (``feedback="auto"``
    chooses once per optimizer), the parameters' names and the param groups the feedback policy reads
    (:meth:`bind_policy`: the rate, betas, momentum and weight decay, live), the optimizer hooks that bind
    them again after ``optimizer.load_state_dict()`` and check what the optimizer steps on
    (:class:`HandedCheck`).

    Why bound again: torch's ``load_state_dict`` replaces the group dicts. A policy still reading the old
    ones kept the rate of before the load for the rest of the run. Why :meth:`follow_groups`: the DDP hook
    and stock ``hvd.DistributedOptimizer`` do not see ``add_param_group`` (progressive unfreezing);
    unbound, momentum correction ran the new parameters with momentum 0 under SGD(momentum=0.9).

    >>> import torch
    >>> from hvd_gradcomp import feedback as fb
    >>> w = torch.nn.Parameter(torch.zeros(4)); opt = torch.optim.SGD([w], lr=0.1, momentum=0.9)
    >>> b, policy = OptimizerBinding(), fb.make("momentum")
    >>> b.bind_policy(policy, None)           # not bound yet: nothing to do
    >>> b.bound = (opt, {w: "w"}); b.bind_policy(policy, None); b.groups_bound
    1
    """

    def __init__(self) -> None:
        self.attached: Any = None
        self.bound: Optional[Tuple[Any, Dict[Any, str]]] = None   # (optimizer, {param: name})
        self.groups_bound = 0   # the optimizer's param groups when last bound (see follow_groups)
        self.rebind_hook: Any = None
        self.handed_hook: Any = None
        self.handed = HandedCheck()

    def attach(self, codec: Any, optimizer: Any, names: Dict[Any, str], rank: int = 0) -> None:
        """Bind ``codec`` to the wrapped optimizer: with ``feedback="auto"`` choose the policy from its class
        and settings (:func:`hvd_gradcomp.feedback.choose`, asking the codec: ``_contracting``,
        ``_auto_policy``) and say so once on rank 0 (with the codec's ``_caution``).

        Called by ``hvd_gradcomp.DistributedOptimizer`` and, inside ``hvd.DistributedOptimizer``,
        at the first exchange; ``names`` maps each parameter to its name.
        """
        if self.attached is optimizer:
            return
        self.attached = optimizer
        why = "chosen by the user"
        if codec.feedback_choice == "auto" and not codec._restored:
            key, why = fb.choose(optimizer, codecs.nature_of(codec) == codecs.DENSE, codec._contracting)
            if key != codec.feedback.key:
                codec._set_policy(codec._auto_policy(key))
        codec.bind_groups(optimizer, names)
        if rank == 0:
            fb.announce(f"{codec!r} with {type(optimizer).__name__}: feedback '{codec.feedback.key}' "
                        f"({codec.feedback.describe()}; {why}). Override with feedback='none'|'classic'|"
                        "'momentum'|'update'|'frozen'." + codec._caution())

    def set_feedback(self, codec: Any, policy: Union[str, Feedback]) -> Any:
        """Choose ``codec``'s feedback policy after construction (as ``feedback=``), before its first
        exchange; returns ``codec``.

        >>> from hvd_gradcomp.codecs.topk import TopK
        >>> TopK().set_feedback("momentum").feedback.key
        'momentum'
        """
        if codec._steps:
            raise ValueError("set the feedback policy before the first exchange: the state of the "
                             f"current one ({codec.feedback.key!r}) would be lost")
        policy = policy if isinstance(policy, Feedback) or policy == "auto" else fb.make(policy)
        codec.feedback_choice = policy
        codec._set_policy(fb.make("classic" if policy == "auto" else policy))
        self.attached = None   # the next attach() chooses again
        return codec

    def bind(self, codec: Any, optimizer: Any, names: Dict[Any, str]) -> None:
        """Bind ``codec``'s feedback policy to each named parameter's param group of ``optimizer`` (the
        policies read the rate, betas, momentum and weight decay there, live), now and again after every
        ``optimizer.load_state_dict()`` (its post-hook calls ``codec._bind_policy()``) and policy change;
        an optimizer step post-hook checks the averages handed over (:class:`HandedCheck`). Called by the
        optimizers and the DDP hook, not by users."""
        self.bound = (optimizer, names)
        for hook in (self.rebind_hook, self.handed_hook):
            if hook is not None:
                hook.remove()
        me = weakref.ref(codec)   # the optimizer must not keep alive a compressor it no longer uses

        def rebind(opt: Any) -> None:
            comp = me()
            if comp is not None and comp._binding is not None and comp._binding[0] is opt:
                comp._bind_policy()

        def check(opt: Any, args: Any, kwargs: Any) -> None:
            comp = me()
            if comp is not None and comp._binding is not None and comp._binding[0] is opt:
                comp._check_handed()

        register = getattr(optimizer, "register_load_state_dict_post_hook", None)
        self.rebind_hook = None if register is None else register(rebind)
        register = getattr(optimizer, "register_step_post_hook", None)
        self.handed_hook = None if register is None else register(check)
        codec._bind_policy()

    def check_handed(self, codec: Any) -> None:
        """After the optimizer's step: compare what ``codec`` handed over with ``p.grad`` (:class:`HandedCheck`)."""
        if self.handed.kept:
            self.handed.check(codec)

    def bind_policy(self, policy: Any, share: Any) -> None:
        """Bind ``policy`` to each bound parameter's param group (``share``: a top-k codec's share)."""
        if self.bound is None:
            return
        optimizer, names = self.bound
        policy.share_sent = share
        self.groups_bound = len(getattr(optimizer, "param_groups", ()))
        for group in getattr(optimizer, "param_groups", []):
            for p in group["params"]:
                if p in names:
                    policy.bind(names[p], group, p, optimizer)

    def bind_codec(self, codec: Any) -> None:
        """Bind ``codec``'s feedback policy (:meth:`bind_policy`, with a top-k codec's ``share``)."""
        self.bind_policy(codec.feedback, getattr(codec, "share", None))

    def follow_groups(self, codec: Any) -> None:
        """Bind ``codec``'s policy to the param groups added to the bound optimizer since it was bound
        (``optimizer.add_param_group`` after wrapping: progressive unfreezing), before a tensor of theirs
        is compressed. Called by :meth:`Exemption.compresses <hvd_gradcomp.codecs.exempt.Exemption.compresses>`,
        which every driver asks before it compresses a tensor.

        Why: the DDP hook and stock ``hvd.DistributedOptimizer`` do not see the call. Unbound, momentum
        correction ran the new parameters with momentum 0 under SGD(momentum=0.9), and ``"frozen"``
        sent them uncompressed (the DDP hook: parameters outside the optimizer) for good."""
        if self.bound is not None and len(getattr(self.bound[0], "param_groups", ())) != self.groups_bound:
            codec._bind_policy()

    @property
    def settled(self) -> bool:
        """Whether the feedback policy is chosen under a Horovod wrapper: attached to the wrapped optimizer
        (``hvd_gradcomp.DistributedOptimizer`` attaches when built, stock ``hvd.DistributedOptimizer`` at
        its first step). The DDP hook chooses in ``register()``."""
        return self.attached is not None

    @property
    def scaled_steps(self) -> int:
        """Checked steps whose averages the user's code scaled, other than by a power of two, between the
        exchange and the optimizer's step (see :class:`HandedCheck`)."""
        return self.handed.scaled_steps

    def keep_handed(self, codec: Any, name: str, flat: torch.Tensor, support: Optional[torch.Tensor]) -> None:
        """Keep a few values of the average ``flat`` of ``name`` handed over, for :class:`HandedCheck`,
        while it still watches and where ``codec.carries_held_back``."""
        if self.handed.left > 0 and self.handed_hook is not None and codec.carries_held_back:
            self.handed.keep(name, flat, support, codec.exchange_step)

    def __getstate__(self) -> Dict[str, Any]:
        # The optimizer hooks stay with the optimizer they were registered on: a pickled or deep-copied
        # compressor does not carry them (their handles refer to local functions).
        return {**self.__dict__, "rebind_hook": None, "handed_hook": None}


class Policies:
    """A compressor's feedback policies: its ``feedback=`` choice (``choice``, ``"auto"`` until an optimizer
    is attached), the policy it runs (``policy``), the relay's (``relay``: classic error feedback on QSGD's
    re-quantisation in its compressed allreduce), and whether ``"auto"``'s choice came from a checkpoint
    (``restored``); undoable per round once tracked.

    >>> p = Policies("auto")
    >>> p.policy.key, p.relay_policy().key      # "auto": classic until an optimizer is attached
    ('classic', 'classic')
    >>> p.use(fb.make("none")); p.relay_policy().key
    'none'
    """

    @classmethod
    def chosen(cls, error_feedback: bool, feedback: Union[str, Feedback]) -> "Policies":
        """From a compressor's ``error_feedback=`` and ``feedback=``, checked now, not at the first step.

        >>> Policies.chosen(False, "auto").choice
        'none'
        >>> Policies.chosen(False, "classic")
        Traceback (most recent call last):
        ...
        ValueError: error_feedback=False contradicts feedback='classic': pass only feedback=
        """
        if not isinstance(error_feedback, bool):
            raise ValueError(f"error_feedback must be True or False, got {error_feedback!r}")
        if not error_feedback and feedback not in ("auto", "none"):
            raise ValueError(f"error_feedback=False contradicts feedback={feedback!r}: pass only feedback=")
        return cls("none" if not error_feedback else feedback)

    def __init__(self, choice: Union[str, Feedback]) -> None:
        self.choice = choice
        self.policy: Feedback = fb.make("classic" if choice == "auto" else choice)
        self.relay = fb.ErrorFeedback()
        self.restored = False
        self.tracking = False

    def use(self, policy: Feedback) -> None:
        """Run ``policy`` from now on (its state undoable per round when rounds are tracked)."""
        self.policy = policy
        if self.tracking:
            policy.track_rounds(True)

    @property
    def residuals(self) -> fb.ResidualStore:
        """The residuals of the feedback policy (what was not sent yet, per name)."""
        return self.policy.residuals

    def dense_local(self, codec: Any, name: str, grad: torch.Tensor) -> None:
        """``grad``: this rank's own gradient of ``name``, a tensor large enough to compress, where it
        goes uncompressed this step, before the exchange; for the policy (its dense steps, see
        :meth:`hvd_gradcomp.feedback.Feedback.dense_local`). Called by the drivers; tensors ``codec``
        excludes (``exclude=``) never reach the policy (they are never compressed)."""
        if not codec._excluded(name):
            self.policy.dense_local(name, grad)

    def dense_average(self, name: str, avg: torch.Tensor) -> None:
        """``avg``: the average of ``name`` where it went uncompressed (small, excluded, or a dense step
        of its feedback policy), before the user's code between the exchange and the optimizer step
        sees it; for the policy (:meth:`hvd_gradcomp.feedback.Feedback.dense_average`). Called by the drivers."""
        self.policy.dense_average(name, avg)

    @property
    def relay_residuals(self) -> fb.ResidualStore:
        """Residuals of the reduced chunks QSGD's compressed allreduce re-quantises, keyed
        ``"<name>#reduced<rank>"`` (kept apart from :attr:`residuals`, whose policy may differ)."""
        return self.relay_policy().residuals

    def relay_policy(self) -> Feedback:
        """The relay's policy: classic error feedback, or none when the compressor keeps none."""
        return self.relay if self.policy.key != "none" else self.policy

    def track_rounds(self, on: bool) -> None:
        self.tracking = on
        self.policy.track_rounds(on)
        self.relay.track_rounds(on)

    def end_round(self, ok: bool) -> None:
        self.policy.end_round(ok)
        self.relay.end_round(ok)
