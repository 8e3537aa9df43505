"""Rank-side code of tests/test_wrappers_agree.py: AdamW trained the way the README shows a user
would, through either Horovod wrapper: the optimizer wrapped, then ``hvd.broadcast_parameters``
and ``hvd.broadcast_optimizer_state``, a warm-up then cosine schedule set each step through
``param_groups[i]["lr"]``, and a plain ``zero_grad()`` / ``backward()`` / ``step()`` loop (no
GradientAccumulator, no scheduler object)."""
from __future__ import annotations

import math
from typing import Any, Dict, List

import horovod.torch as hvd
import torch
import torch.nn.functional as F

import hvd_gradcomp as gc
from tests.workers.integration import all_ranks_equal

IN, HIDDEN, OUT = 32, 256, 10


def _data(seed: int, n: int):
    """Labels from a fixed random teacher network (the same on every rank and run)."""
    teacher = torch.randn(IN, OUT, generator=torch.Generator().manual_seed(99))
    x = torch.randn(n, IN, generator=torch.Generator().manual_seed(seed))
    return x, (torch.tanh(x) @ teacher).argmax(1)


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warm-up to ``peak``, then cosine down to a tenth of it."""
    if step < warmup:
        return peak * (step + 1) / warmup
    done = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.45 * (1.0 + math.cos(math.pi * done)))


def train(wrapper: str, compression: str, seed: int, steps: int = 260, warmup: int = 26) -> Dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.GELU(), torch.nn.LayerNorm(HIDDEN),
                                torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.GELU(), torch.nn.Linear(HIDDEN, OUT))
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.1)
    kw: Dict[str, Any] = dict(named_parameters=model.named_parameters())
    comp = gc.TopKQSGD(ratio=0.01, bits=8, seed=seed) if compression == "topkqsgd" else None
    if comp is not None:
        kw["compression"] = comp
    opt = gc.DistributedOptimizer(opt, **kw) if wrapper == "gc" else hvd.DistributedOptimizer(opt, **kw)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, 2e-3, warmup)
        x, y = _data(1_000_003 * seed + 1000 * hvd.rank() + step, 32)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    vx, vy = _data(424_242, 4096)
    with torch.no_grad():
        val = F.cross_entropy(model(vx), vy).item()
    return {"val_loss": val, "feedback": getattr(getattr(comp, "feedback", None), "key", None),
            "identical": all(all_ranks_equal(p.detach()) for p in model.parameters())}


def battery(runs: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    return [train(**run) for run in runs]
