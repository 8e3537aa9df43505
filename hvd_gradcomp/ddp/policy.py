"""The feedback policy of the DDP hook's compressor (:func:`choose_feedback`): checked against what the hook
can run (:func:`hvd_gradcomp.feedback.registry.check_hook_policy`) and the optimizer it was given, then chosen
as under the Horovod wrappers, by the compressor's public :meth:`attach` (which asks
:func:`hvd_gradcomp.feedback.choose`): one place chooses, for every wrapper.
"""
from typing import Any, Dict, List, Optional

import torch

from .. import codecs
from ..feedback.momentum import MomentumCorrection
from ..feedback.registry import announce, check_hook_policy


class NoOptimizerGiven:
    """What the compressor is attached to when ``register()`` got no optimizer and a dense codec's
    ``feedback="auto"`` still chooses (its choice does not read the optimizer: low-bit QSGD gets ``"none"``,
    since classic error feedback shrank its 2-bit averages). It has no param groups, so nothing is bound.

    >>> NoOptimizerGiven().param_groups
    []
    """

    def __init__(self) -> None:
        self.param_groups: List[Dict[str, Any]] = []


def choose_feedback(comp: Any, optimizer: Optional[torch.optim.Optimizer], names: Dict[torch.Tensor, str],
                    rank: int) -> None:
    """``comp``'s feedback policy in the hook, bound to ``optimizer``'s param groups (see ``optimizer`` in
    :class:`~hvd_gradcomp.ddp.GradCompState`); the choice is said once on rank 0."""
    check_hook_policy(comp.feedback.key)
    auto = comp.feedback_choice == "auto"
    if optimizer is None:
        _refuse_without_optimizer(comp)
        if not (auto and codecs.nature_of(comp) == codecs.DENSE):
            if auto and comp.feedback.key == "classic" and rank == 0:  # said once: with Adam/AdamW classic trains far worse
                announce(f"{comp!r} in the DDP hook: classic error feedback, because no optimizer was given. "
                         "Pass optimizer=opt to register() so the hook picks the policy for it: momentum "
                         "correction for SGD(momentum > 0), 'frozen' for Adam/AdamW, 'update' for other "
                         "adaptive optimizers (see docs/FEEDBACK.md).")
            return
        comp.attach(NoOptimizerGiven(), names, rank)
        return
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if not any(p in names for g in optimizer.param_groups for p in g["params"]):
        raise ValueError("the optimizer steps none of the wrapped module's parameters: pass the optimizer "
                         "built on this model's parameters")
    comp.attach(optimizer, names, rank)   # as under the Horovod wrappers: feedback.choose, bound, said on rank 0


def _refuse_without_optimizer(comp: Any) -> None:
    """A policy that reads or steps the optimizer cannot run without one."""
    if isinstance(comp.feedback, MomentumCorrection) and comp.feedback.momentum is None:
        raise ValueError("feedback='momentum' reads the momentum from the optimizer: pass optimizer= to "
                         "register() / GradCompState (or feedback=MomentumCorrection(momentum=m))")
    if comp.feedback.moves_parameters:
        does = "steps a private copy of the optimizer on each rank" if comp.feedback.key == "update" \
            else "freezes and steps the optimizer's Adam state"
        raise ValueError(f"feedback={comp.feedback.key!r} {does}: pass optimizer= to register() / GradCompState")
