"""Parameter names: the one map from each parameter to its name (:func:`name_map`).

Residuals, random streams and a policy's state are keyed by the parameter's name, never by the
tensor's identity, so every wrapper (the Horovod optimizers, the DDP hook, ``gc.Auto``) builds
the map here, from ``model.named_parameters()``, with the same checks and the same errors.
No Horovod and no ``torch.distributed`` here: the lowest layer that keys state by name.
"""
from __future__ import annotations

from typing import Dict, Iterable, Tuple

import torch


def name_map(named_parameters: Iterable[Tuple[str, torch.Tensor]]) -> Dict[torch.Tensor, str]:
    """``{parameter: name}`` from ``model.named_parameters()``; errors say what to pass instead.

    >>> m = torch.nn.Linear(2, 2)
    >>> sorted(name_map(m.named_parameters()).values())
    ['bias', 'weight']
    >>> name_map([("w", m.weight), ("w", m.bias)])
    Traceback (most recent call last):
    ...
    ValueError: parameter names must be unique; duplicated: ['w']
    """
    named = list(named_parameters)
    if any(not isinstance(t, tuple) or len(t) != 2 or not isinstance(t[1], torch.Tensor) for t in named):
        raise ValueError("named_parameters should be a sequence of (name, parameter) tuples, "
                         "usually model.named_parameters()")
    names = [n for n, _ in named]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise ValueError(f"parameter names must be unique; duplicated: {dups}")
    return {p: n for n, p in named}
