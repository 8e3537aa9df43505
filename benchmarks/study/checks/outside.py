"""The outside check (``study.py --config outside``, benchmarks/results/OUTSIDE_CHECK.md): a check as an outside
user would run one, on a task none of the library's defaults were chosen on, written only with the
README's API, both optimizer wrappers (``--roads gc,hvd``), AdamW and Adam (``--tasks``); each run
is one ``hvdgc-launch -np 2 --gloo`` job.
"""
from __future__ import annotations

from typing import Any, Callable, Dict

TASK = ("The task: an MLP with LayerNorm regresses a fixed random tanh \"teacher\" network on fresh Gaussian "
        "inputs (a little label noise), `OneCycleLR`, held-out MSE on 2048 fixed inputs. Every run is one "
        "``hvdgc-launch -np 2 --gloo`` job; results (one JSON line per run) go to ``--out`` and are kept, so a "
        "rerun only trains what is missing. The table gives each setting's held-out MSE gap to uncompressed "
        "training (``hvd_gradcomp.DistributedOptimizer``, same seed), averaged over seeds, next to the "
        "uncompressed seed spread (population standard deviation over seeds).")

SETTINGS: Dict[str, Callable[[Any], Any]] = {
    "none": lambda gc: None,
    "tq1": lambda gc: gc.TopKQSGD(ratio=0.01, bits=8),
    "topk1": lambda gc: gc.TopK(ratio=0.01),
    "tq5": lambda gc: gc.TopKQSGD(ratio=0.05, bits=8),
    "tq1-warm300": lambda gc: gc.TopKQSGD(ratio=0.01, bits=8, feedback=gc.FrozenVariance(warmup=300)),
    "tq1-warm600": lambda gc: gc.TopKQSGD(ratio=0.01, bits=8, feedback=gc.FrozenVariance(warmup=600)),
    "tq1-at100": lambda gc: gc.TopKQSGD(ratio=0.01, bits=8, feedback=gc.FrozenVariance(max_warmup=1)),
    "tq1-vfrozen": lambda gc: gc.TopKQSGD(ratio=0.01, bits=8, feedback=gc.FrozenVariance(follow_scale=None)),
    "tq1-prev": lambda gc: gc.TopKQSGD(ratio=0.01, bits=8, feedback=gc.FrozenVariance(
        momentum=None, sparsity_warmup=100)),
    "tq1-prev-at100": lambda gc: gc.TopKQSGD(ratio=0.01, bits=8, feedback=gc.FrozenVariance(
        momentum=None, sparsity_warmup=100, max_warmup=1)),
    "ratio1-at100": lambda gc: gc.TopKQSGD(ratio=1.0, bits=8, feedback=gc.FrozenVariance(max_warmup=1)),
    "tq1-window-none": lambda gc: gc.TopKQSGD(ratio=0.01, bits=8, feedback=gc.FrozenVariance(window=None)),
    "tq1-classic": lambda gc: gc.TopKQSGD(ratio=0.01, bits=8, feedback="classic"),
    "ratio1": lambda gc: gc.TopKQSGD(ratio=1.0, bits=8),
    "ratio1-warm300": lambda gc: gc.TopKQSGD(ratio=1.0, bits=8, feedback=gc.FrozenVariance(warmup=300)),
    "ratio1-warm600": lambda gc: gc.TopKQSGD(ratio=1.0, bits=8, feedback=gc.FrozenVariance(warmup=600)),
}
SETTINGS_TEXT = (
    "``tq1`` is the README's ``TopKQSGD(ratio=0.01, bits=8)``; the others take one thing apart (``ratio1``: "
    "nothing dropped, only Adam's second moment frozen and the 8-bit values; ``-warmN``: "
    "``FrozenVariance(warmup=N)``; ``-at100``: frozen after 100 steps even inside OneCycleLR's 360-step ramp, "
    "``FrozenVariance(max_warmup=1)``, the default before it waited for the rate to stop rising; "
    "``window-none``: the freeze before the window average; ``classic``: error feedback on gradients; "
    "``tq1-vfrozen``: ``v`` frozen for good, not following shrinking gradients "
    "(``FrozenVariance(follow_scale=None)``, the default before it did, here under OneCycleLR); ``-prev``: "
    "``FrozenVariance``'s defaults before it dropped Adam's momentum and the sparsity warm-up after the "
    "freeze, ``momentum=None, sparsity_warmup=100``, see benchmarks/results/FREEZE_CHECK.md: the runs of ``tq1`` and "
    "``tq1-at100`` from before that change).")
"""What :data:`SETTINGS` run, as the page says it."""


def train(opt: str, wrapper: str, setting: str, seed: int, steps: int) -> Dict[str, Any]:
    """One run on this rank (inside a Horovod job): optimizer ``opt`` (``adamw``, ``adam``) through
    ``wrapper`` (``gc``: ``hvd_gradcomp.DistributedOptimizer``; ``hvd``: Horovod's) with ``setting``'s
    compressor; the record (held-out MSE), on every rank."""
    import horovod.torch as hvd
    import torch
    import torch.nn as nn

    import hvd_gradcomp as gc

    hvd.init()
    g = torch.Generator().manual_seed(1234)
    teacher = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 8))
    for q in teacher.parameters():
        q.data = torch.randn(q.shape, generator=g) * (1.5 / q.shape[-1] ** 0.5)
    x_test = torch.randn(2048, 64, generator=g)
    y_test = teacher(x_test).detach()
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 512), nn.GELU(), nn.LayerNorm(512), nn.Linear(512, 512), nn.GELU(),
                          nn.Linear(512, 8))
    optimizer = (torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.05, betas=(0.9, 0.98))
                 if opt == "adamw" else torch.optim.Adam(model.parameters(), lr=1e-3))
    comp = SETTINGS[setting](gc)
    kw = {} if comp is None else {"compression": comp}
    wrap = gc.DistributedOptimizer if wrapper == "gc" else hvd.DistributedOptimizer
    optimizer = wrap(optimizer, named_parameters=model.named_parameters(), **kw)
    sched = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=optimizer.param_groups[0]["lr"], total_steps=steps)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    gen = torch.Generator().manual_seed(100 * seed + hvd.rank())
    for _ in range(steps):
        x = torch.randn(64, 64, generator=gen)
        y = teacher(x).detach() + 0.05 * torch.randn(64, 8, generator=gen)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        sched.step()
    with torch.no_grad():
        mse = float(nn.functional.mse_loss(model(x_test), y_test))
    return {"opt": opt, "wrapper": wrapper, "setting": setting, "seed": seed, "steps": steps, "mse": mse}
