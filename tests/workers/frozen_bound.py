"""Rank-side code of tests/test_frozen_bound.py: an embedding row that had no gradient during
``feedback="frozen"``'s dense warm-up gets a large one after the freeze."""
from __future__ import annotations

from typing import Any, Dict

import horovod.torch as hvd
import torch
import torch.nn as nn
import torch.nn.functional as F

import hvd_gradcomp as gc
from hvd_gradcomp.feedback.frozen import FrozenVariance

LR = 1e-2


def rare_row(road: str = "gc", betas=(0.9, 0.99), compressed: bool = True) -> Dict[str, Any]:
    """AdamW over an embedding (64 rows, 2048 values: compressed) and a small head; rows 0-31 used
    for 7 steps (the freeze after 5), then row 63, for the first time, with the loss scaled 1000x.
    Returns how far row 63 moved in that step, in units of the rate, and whether ranks agree."""
    torch.manual_seed(0)
    emb, head = nn.Embedding(64, 32), nn.Linear(32, 4)
    named = [*(("emb." + n, p) for n, p in emb.named_parameters()), *(("head." + n, p) for n, p in head.named_parameters())]
    opt = torch.optim.AdamW([p for _, p in named], lr=LR, betas=tuple(betas), weight_decay=0.0)
    if compressed:
        comp = gc.TopK(ratio=1.0, feedback=FrozenVariance(warmup=5, max_warmup=1))
        wrap = gc.DistributedOptimizer if road == "gc" else hvd.DistributedOptimizer
        opt = wrap(opt, named_parameters=named, compression=comp)
    else:
        opt = hvd.DistributedOptimizer(opt, named_parameters=named)
    g = torch.Generator().manual_seed(hvd.rank())
    for step in range(8):
        rare = step == 7
        tokens = torch.full((16,), 63) if rare else torch.randint(0, 32, (16,), generator=g)
        labels = torch.randint(0, 4, (16,), generator=g)
        opt.zero_grad()
        ((1000.0 if rare else 1.0) * F.cross_entropy(head(emb(tokens)), labels)).backward()
        before = emb.weight[63].detach().clone()
        opt.step()
    moved = float((emb.weight[63].detach() - before).abs().max()) / LR
    every = hvd.allgather(torch.cat([emb.weight.detach().reshape(-1), head.weight.detach().reshape(-1)])[None])
    return {"moved": moved, "identical": bool(torch.equal(every[0], every[-1]))}
