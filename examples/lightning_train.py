"""Lightning with the hvd-gradcomp DDP hook: ``GradCompStrategy`` (docs/INTEGRATIONS.md).

A small classifier on synthetic data (nothing is downloaded), AdamW, TopKQSGD(1%, 8 bits), norm
clipping and gradient accumulation, a checkpoint every epoch. On 2 CPU ranks::

    pip install 'hvd-gradcomp[lightning]'
    torchrun --standalone --nproc-per-node 2 examples/lightning_train.py --epochs 4 --out runs/lit
    torchrun --standalone --nproc-per-node 2 examples/lightning_train.py --epochs 6 --out runs/lit \\
        --resume runs/lit/checkpoints/last.ckpt
"""
from __future__ import annotations

import argparse

import lightning.pytorch as pl
import torch
import torch.nn as nn
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

import hvd_gradcomp as gc
from hvd_gradcomp.integrations.lightning import GradCompStrategy


class Classifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def synthetic(n: int = 4096, seed: int = 0) -> TensorDataset:
    """Inputs labelled by a random linear teacher: learnable, and the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 64, generator=g)
    return TensorDataset(x, (x @ torch.randn(64, 10, generator=g)).argmax(1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--out", default="runs/lightning")
    p.add_argument("--resume", default=None, help="a checkpoint to continue from (ckpt_path=)")
    args = p.parse_args()

    torch.manual_seed(0)
    strategy = GradCompStrategy(compression=gc.TopKQSGD(ratio=0.01, bits=8))
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_epochs=args.epochs,
        gradient_clip_val=1.0,         # becomes the compressor's clip=: each rank's gradient, before compression
        accumulate_grad_batches=2,     # no_sync for the first micro-batch: one exchange per optimizer step
        callbacks=[ModelCheckpoint(dirpath=f"{args.out}/checkpoints", save_last=True)],
        default_root_dir=args.out, logger=False, enable_progress_bar=False,
    )
    trainer.fit(Classifier(), DataLoader(synthetic(), batch_size=32, shuffle=True), ckpt_path=args.resume)
    if trainer.is_global_zero:
        print(f"loss {float(trainer.callback_metrics['loss']):.4f}")
        print(strategy.gradcomp_state.comm_stats.summary())


if __name__ == "__main__":
    main()
