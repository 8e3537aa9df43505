"""The wrapper check (``study.py --config wrapper``, benchmarks/results/WRAPPER_CHECK.md): the same compressor
through every road, each driven the way the README shows a user would. A 2-layer character
transformer (437,760 parameters) trained with AdamW for :data:`STEPS` steps, the rate set each step
through ``param_groups[i]["lr"]`` (:data:`SCHEDULE`), a plain ``zero_grad()`` / ``backward()`` /
``step()`` loop, and on the Horovod roads the optimizer wrapped, then ``hvd.broadcast_parameters``
and ``hvd.broadcast_optimizer_state``.

Roads (:data:`ROADS`): uncompressed ``hvd.DistributedOptimizer``; ``TopKQSGD(ratio=0.01, bits=8,
seed=s)`` inside stock ``hvd.DistributedOptimizer``; the same through
``hvd_gradcomp.DistributedOptimizer``; the same as a DDP communication hook
(``hvd_gradcomp.ddp.register(model, ..., optimizer=opt)``, under torchrun). Feedback is left to its
default everywhere ('frozen' for AdamW).

The one-off probes of issue 48's search for a gap between ``hvd_gradcomp.DistributedOptimizer``
and stock ``hvd.DistributedOptimizer`` (none was found) are not kept as options: what they varied
is trained on every road by the recipe study (``study.py --config recipes``): nanoGPT's blocks,
parameter groups and betas (``nanogpt``), a tied embedding (``tied-*``), a post-norm encoder with
dropout (``bert-ft``); gradient accumulation by the study's ``char-mlp`` task.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, Dict, List

from benchmarks.study.recipes import Recipe

ROOT = Path(__file__).resolve().parents[3]
ROADS = {"none": "uncompressed `hvd.DistributedOptimizer`",
         "stock": "stock `hvd.DistributedOptimizer(compression=TopKQSGD)`",
         "gc": "`hvd_gradcomp.DistributedOptimizer(compression=TopKQSGD)`",
         "ddp": "DDP, `hvd_gradcomp.ddp.register(compression=TopKQSGD, optimizer=opt)`"}
STEPS, WARMUP, PEAK, CONTEXT, BATCH = 300, 30, 2e-3, 64, 16
SCHEDULE = Recipe("wrapper", STEPS, PEAK, WARMUP, "cosine10", 0.0, "adamw")
"""Linear warm-up to ``PEAK`` over ``WARMUP`` steps, then cosine to a tenth of it at ``STEPS``.

>>> [round(SCHEDULE.lr_at(s) / PEAK, 4) for s in (0, WARMUP - 1, STEPS)]
[0.0333, 1.0, 0.1]
"""


def _model() -> Any:
    import torch.nn as nn

    from benchmarks.study.tasks import CharTransformer

    model = CharTransformer(d=128, layers=2, heads=4, context=CONTEXT)
    model.head = nn.Linear(128, model.head.out_features, bias=False)   # as the user wrote it
    return model


def train(road: str, seed: int) -> Dict[str, Any]:
    """One run of ``road`` on this rank (horovodrun, or torchrun for ``ddp``); the record, on every rank."""
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, str(ROOT / "examples"))
    import data as datasets
    import hvd_gradcomp as gc
    from benchmarks.study.loop import wrap_as_user
    from benchmarks.study.recipe_worker import Comm, counter

    comm = Comm(ddp=road == "ddp")
    torch.manual_seed(seed)
    net = _model()
    text, val = datasets.load_text(400_000)
    g = torch.Generator().manual_seed(1000 * seed + comm.rank)
    starts = torch.randint(0, len(val) - CONTEXT - 1, (512,), generator=torch.Generator().manual_seed(1))
    offs = torch.arange(CONTEXT)
    vx, vy = val[starts[:, None] + offs], val[starts[:, None] + offs + 1]
    opt = torch.optim.AdamW(net.parameters(), lr=PEAK, weight_decay=0.1)
    comp = None if road == "none" else gc.TopKQSGD(ratio=0.01, bits=8, seed=seed)
    model, opt, state = wrap_as_user(road, net, opt, comp, None if road == "ddp" else comm.hvd)
    raw = sum(p.numel() * p.element_size() for p in net.parameters())
    count = counter(road, opt, comp, state, raw)
    sent: List[int] = []
    t0 = time.perf_counter()
    for step in range(STEPS):
        for group in opt.param_groups:
            group["lr"] = SCHEDULE.lr_at(step)
        s = torch.randint(0, len(text) - CONTEXT - 1, (BATCH,), generator=g)
        x, y = text[s[:, None] + offs], text[s[:, None] + offs + 1]
        opt.zero_grad()
        out = model(x)
        F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1)).backward()
        opt.step()
        sent.append(count())
    wall = time.perf_counter() - t0
    with torch.no_grad():
        net.eval()
        out = net(vx)
        val_loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), vy.reshape(-1)).item()
    half = sent[len(sent) // 2:]
    return {"road": road, "seed": seed, "steps": STEPS, "val_loss": val_loss,
            "parameters": sum(p.numel() for p in net.parameters()), "identical": comm.identical(net),
            "ratio_second_half": raw * len(half) / max(1, sum(half)), "wall_s": wall,
            "feedback": getattr(getattr(comp, "feedback", None), "key", None)}
