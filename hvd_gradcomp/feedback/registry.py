"""Feedback policies by name: :data:`POLICIES` and :func:`make` (``feedback="classic"``), and
:func:`choose`, the policy ``feedback="auto"`` picks from the wrapped optimizer, and
:data:`HOOK_POLICIES`, those the DDP hook can run (:func:`check_hook_policy`).
"""
from __future__ import annotations

import importlib
import sys
from typing import Any, Tuple, Union

from .policy import Feedback, plain_class
from .residuals import log


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
"""Policy name -> ``"module:class"`` in this package (empty: the package itself), imported by :func:`make` on first use (the
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
    return getattr(importlib.import_module(f"{__package__}.{module}" if module else __package__), attr)()


ADAPTIVE = {"Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad", "Adadelta", "Adafactor", "Lion"}


def choose(optimizer: Any, codec_is_dense: bool, contracting: bool) -> Tuple[str, str]:
    """The policy ``feedback="auto"`` applies, and why, from the wrapped optimizer's class and settings.

    * low-bit QSGD (4 and 2 bits), whose error feedback would need shrinking the payload:
      ``none`` (QSGD is unbiased; plain QSGD trains, see benchmarks/results/STUDY.md);
    * other dense codecs (QSGD-8): ``classic``;
    * ``Adam`` and ``AdamW`` (without coupled weight decay): ``frozen`` (:class:`FrozenVariance`);
    * other Adam-type optimizers (normalising per coordinate) without coupled weight decay:
      ``update``;
    * ``SGD`` with momentum (dampening < 1): ``momentum`` (DGC momentum correction, no masking);
    * everything else (plain SGD, Adam with coupled L2 weight decay, unknown optimizers):
      ``classic``.

    >>> import torch
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


HOOK_POLICIES = ("none", "classic", "momentum", "frozen", "update")
"""The policies the DDP hook can run. ``"frozen"`` and ``"update"`` move the parameters themselves: the hook
keeps their averages apart and applies them when the optimizer steps; ``"update"`` steps each rank's
private copy of the optimizer on its local gradient in the hook (the parameters it reads stay put until
that step)."""


def check_hook_policy(key: str) -> None:
    """Refuse a policy the DDP hook cannot run (not in :data:`HOOK_POLICIES`), naming the ones it can.

    >>> check_hook_policy("frozen")
    >>> check_hook_policy("pipelined")
    Traceback (most recent call last):
    ...
    ValueError: feedback='pipelined' cannot run in the DDP hook, which runs the policies 'none', 'classic', 'momentum', 'frozen', 'update': use feedback='frozen' for Adam/AdamW, 'update' for other adaptive optimizers, 'momentum' for SGD with momentum, or 'classic'
    """
    if key not in HOOK_POLICIES:
        raise ValueError(f"feedback={key!r} cannot run in the DDP hook, which runs the policies "
                         f"{', '.join(repr(k) for k in HOOK_POLICIES)}: use feedback='frozen' for Adam/AdamW, "
                         "'update' for other adaptive optimizers, 'momentum' for SGD with momentum, or 'classic'")


def announce(message: str) -> None:
    """Say once, on rank 0, what the library chose: through logging, or on stderr when the
    application configured no logging (so it is never silent)."""
    log.info(message)
    if not log.hasHandlers():
        print(f"hvd_gradcomp: {message}", file=sys.stderr, flush=True)
