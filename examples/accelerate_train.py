"""accelerate with the hvd-gradcomp DDP hook (docs/INTEGRATIONS.md).

A small classifier on synthetic data (nothing is downloaded), AdamW, TopKQSGD(1%, 8 bits) with
its own norm clipping, ``accelerator.accumulate``, and ``save_state``/``load_state`` that keep every
rank's hook state. On 2 CPU ranks (``accelerate launch --cpu`` may start one process; torchrun
starts two, and ``Accelerator(cpu=True)`` joins them into one job)::

    pip install 'hvd-gradcomp[accelerate]'
    torchrun --standalone --nproc-per-node 2 examples/accelerate_train.py --epochs 4 --out runs/acc
    torchrun --standalone --nproc-per-node 2 examples/accelerate_train.py --epochs 2 --out runs/acc2 \\
        --resume runs/acc
"""
from __future__ import annotations

import argparse

import torch
import torch.nn as nn
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

import hvd_gradcomp as gc
from hvd_gradcomp.integrations import accelerate as gc_accelerate


def synthetic(n: int = 4096, seed: int = 0) -> TensorDataset:
    """Inputs labelled by a random linear teacher: learnable, and the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 64, generator=g)
    return TensorDataset(x, (x @ torch.randn(64, 10, generator=g)).argmax(1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--out", default="runs/accelerate", help="where save_state writes")
    p.add_argument("--resume", default=None, help="a save_state folder to continue from")
    args = p.parse_args()

    torch.manual_seed(0)
    # without a GPU, accelerate runs several processes as one job (DDP over Gloo) only with cpu=True
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), gradient_accumulation_steps=2)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(synthetic(), batch_size=32, shuffle=True)
    model, opt, loader = accelerator.prepare(model, opt, loader)

    # what prepare() returned, as it is: the DDP model and the AcceleratedOptimizer (its AdamW picks 'frozen')
    state = gc_accelerate.register(model, opt, compression=gc.TopKQSGD(ratio=0.01, bits=8, clip=1.0))
    gc_accelerate.register_for_checkpointing(accelerator, state)   # every rank's residuals in save_state
    if args.resume:
        accelerator.load_state(args.resume)                        # on every process: each takes its own part

    for epoch in range(args.epochs):
        for x, y in loader:
            with accelerator.accumulate(model):                    # no_sync but every 2nd: one exchange per step
                loss = nn.functional.cross_entropy(model(x), y)
                accelerator.backward(loss)
                opt.step()
                opt.zero_grad()
    accelerator.save_state(args.out)                               # on every process (a collective inside)
    accelerator.print(f"loss {loss.item():.4f}")
    accelerator.print(state.comm_stats.summary())


if __name__ == "__main__":
    main()
