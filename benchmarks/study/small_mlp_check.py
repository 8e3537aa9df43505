"""A quick check as an outside user would write it: a small MLP (64- and 48-wide layers, so
every compressed tensor is near ``min_k``) classifying by a random linear teacher, the README's
two lines with AdamW, Adam and momentum SGD, 3 seeds, constant learning rate, 400 steps.

    horovodrun -np 2 -H localhost:2 --gloo .venv/bin/python benchmarks/study/small_mlp_check.py

Prints, per optimizer, the uncompressed held-out loss (mean over seeds, with its seed spread) and
TopKQSGD(1%, 8)'s gap per seed through ``hvd_gradcomp.DistributedOptimizer``; checks that the
ranks end with identical parameters. About a minute on 2 cores.
"""
from __future__ import annotations

import statistics
from typing import Optional

import horovod.torch as hvd
import torch
import torch.nn as nn
import torch.nn.functional as F

import hvd_gradcomp as gc

STEPS, SEEDS = 400, (0, 1, 2)
OPTIMIZERS = {"adamw": lambda p: torch.optim.AdamW(p, lr=3e-3, weight_decay=0.01),
              "adam": lambda p: torch.optim.Adam(p, lr=3e-3),
              "sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)}
TEACHER = torch.randn(20, 3, generator=torch.Generator().manual_seed(8))
X_VAL = torch.randn(512, 20, generator=torch.Generator().manual_seed(7))


def train(opt_name: str, seed: int, compression: Optional[gc.GradientCompressor]) -> float:
    """Held-out cross-entropy after STEPS steps; raises if the ranks' parameters differ."""
    torch.manual_seed(seed)
    data = torch.Generator().manual_seed(100 + hvd.rank() + 1000 * seed)
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 3))
    opt = OPTIMIZERS[opt_name](model.parameters())
    hvd.broadcast_parameters(model.state_dict(), 0)
    if compression is None:
        dopt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    else:
        dopt = gc.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=compression)
    for _ in range(STEPS):
        x = torch.randn(32, 20, generator=data)
        dopt.zero_grad()
        F.cross_entropy(model(x), (x @ TEACHER).argmax(1)).backward()
        dopt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    if not torch.equal(flat, hvd.broadcast(flat, 0, name=f"check.{opt_name}.{seed}.{compression is None}")):
        raise RuntimeError("the ranks' parameters differ")
    with torch.no_grad():
        return float(F.cross_entropy(model(X_VAL), (X_VAL @ TEACHER).argmax(1)))


def main() -> None:
    hvd.init()
    torch.set_num_threads(1)
    for opt_name in OPTIMIZERS:
        base = [train(opt_name, s, None) for s in SEEDS]
        comp = [train(opt_name, s, gc.TopKQSGD(ratio=0.01, bits=8)) for s in SEEDS]
        gaps = [100 * (c / b - 1) for c, b in zip(comp, base)]
        if hvd.rank() == 0:
            mean = statistics.mean(base)
            print(f"{opt_name}: uncompressed {mean:.4f} (seed spread +-{100 * statistics.pstdev(base) / mean:.1f}%), "
                  f"TopKQSGD(1%, 8) {statistics.mean(comp):.4f}, gap per seed "
                  f"{', '.join(f'{g:+.1f}%' for g in gaps)}, mean {statistics.mean(gaps):+.1f}%", flush=True)


if __name__ == "__main__":
    main()
