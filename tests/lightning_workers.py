"""Rank side of tests/test_integrations_lightning.py: ``python -m torch.distributed.run --nproc-per-node 2
tests/lightning_workers.py JOB OUTDIR``.

Every rank runs every scenario of JOB in order (Lightning's ``Trainer`` under torchrun, Gloo, CPU)
and writes ``OUTDIR/rank<r>.json``. A failing rank prints its traceback and exits at once, so
torchrun stops the other rank instead of letting it wait in a collective.
"""
from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402

import hvd_gradcomp as gc  # noqa: E402
from hvd_gradcomp import ddp as gc_ddp  # noqa: E402
from tests.ddp_workers import main as run_scenarios  # noqa: E402
from hvd_gradcomp.integrations.lightning import CHECKPOINT_KEY, GradCompStrategy  # noqa: E402

SAMPLES = 128       # 64 per rank: 8 batches of 8 per epoch
BATCH = 8
BUCKET_MB = 0.01    # several buckets


class Lit(pl.LightningModule):
    """Weights above min_compress_numel (compressed: 2048 and 4096 values), a small head (dense)."""

    def __init__(self, optimizer: str = "adamw") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
        self.optimizer_name = optimizer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return make_optimizer(self.optimizer_name, self.parameters())


def make_optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2)
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def make_compression(name: str, clip: float = None) -> Any:
    """The compressor of a setting, built anew (each run gets its own, with the same seed)."""
    extra = {"feedback": gc.FrozenVariance(warmup=2)} if name == "adamw" else {}
    return gc.TopKQSGD(ratio=0.05, bits=8, seed=7, clip=clip, **extra)


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(123)
    return TensorDataset(torch.randn(SAMPLES, 32, generator=g), torch.randint(0, 10, (SAMPLES,), generator=g))


def loader() -> DataLoader:
    """Lightning puts a DistributedSampler under a training loader (shuffled, seed 0, set_epoch every epoch)."""
    return DataLoader(dataset(), batch_size=BATCH)


def ddp_loader() -> DataLoader:
    """What Lightning makes of :func:`loader` on this rank, as a plain DDP script writes it."""
    return DataLoader(dataset(), batch_size=BATCH, sampler=DistributedSampler(dataset(), shuffle=True, seed=0))


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


class Watch(Callback):
    """What Lightning does around each optimizer step: the trainer's gradient_clip_val as Lightning reads it,
    and the hook's exchanges so far (state.iter) at each step."""

    def __init__(self) -> None:
        self.clip_vals: List[Any] = []
        self.iters: List[int] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, module: pl.LightningModule, optimizer: Any) -> None:
        self.clip_vals.append(trainer.gradient_clip_val)
        self.iters.append(trainer.strategy.gradcomp_state.iter)


def trainer(strategy: Any, root: str, epochs: int, callbacks: List[Any] = (), **kw: Any) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=epochs, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
                      enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
                      callbacks=list(callbacks), **kw)


# ---------------------------------------------------------------- scenarios
def match_ddp(optimizer: str, accumulate: int, clip: float, epochs: int, root: str) -> Dict[str, Any]:
    """The same compressor, seed and batches through GradCompStrategy and through plain DDP +
    hvd_gradcomp.ddp.register + GradientAccumulator: the weights, bit for bit; one exchange per step."""
    # Lightning
    lit = Lit(optimizer)
    strategy = GradCompStrategy(compression=make_compression(optimizer), bucket_cap_mb=BUCKET_MB)
    watch = Watch()
    t = trainer(strategy, root, epochs, [watch], accumulate_grad_batches=accumulate,
                gradient_clip_val=clip or None)
    t.fit(lit, loader())
    state = strategy.gradcomp_state
    lightning = flat(lit)
    # plain DDP, by hand, on the batches Lightning's DistributedSampler gave this rank
    ref = Lit(optimizer)
    model = DDP(ref, bucket_cap_mb=BUCKET_MB)
    opt = make_optimizer(optimizer, model.parameters())
    ref_state = gc_ddp.register(model, compression=make_compression(optimizer, clip=clip or None), optimizer=opt)
    acc = gc_ddp.GradientAccumulator(model, opt, steps=accumulate)
    data = ddp_loader()
    for epoch in range(epochs):
        data.sampler.set_epoch(epoch)
        for x, y in data:
            with acc.accumulate():
                acc.backward(nn.functional.cross_entropy(model(x), y))
    by_hand = flat(ref)
    return {"identical": bool(torch.equal(lightning, by_hand)),
            "max_diff": float((lightning - by_hand).abs().max()),
            "global_step": t.global_step, "exchanges": state.iter, "ref_exchanges": ref_state.iter,
            "ref_steps": acc.optimizer_steps, "iters_at_steps": watch.iters, "clip_vals_seen": watch.clip_vals,
            "clip_after": t.gradient_clip_val, "compressor_clip": state.compression.clip,
            "feedback": state.compression.feedback.key, "pending": state.pending_updates,
            "compressed_bytes": state.comm_stats.payload_bytes, "raw_bytes": state.comm_stats.bytes_in,
            "optimizer_type": type(state.compression._binding[0]).__name__ if state.compression._binding else None}


def resume(optimizer: str, accumulate: int, clip: float, root: str) -> Dict[str, Any]:
    """4 epochs straight against 2 epochs, a ModelCheckpoint (written by rank 0), and a new Trainer resumed
    with fit(ckpt_path=...) for 2 more: bit-identical weights, the hook's exchanges counted on."""
    rank = dist.get_rank()
    kw = {"accumulate_grad_batches": accumulate, "gradient_clip_val": clip or None}
    lit = Lit(optimizer)
    t = trainer(GradCompStrategy(compression=make_compression(optimizer)), f"{root}/straight", 4, **kw)
    t.fit(lit, loader())
    straight = flat(lit)

    ckpt_dir = f"{root}/ckpt"
    lit = Lit(optimizer)
    first = GradCompStrategy(compression=make_compression(optimizer))
    t = trainer(first, f"{root}/first", 2, [ModelCheckpoint(dirpath=ckpt_dir, save_last=True)], **kw)
    t.fit(lit, loader())
    saved_iter = first.gradcomp_state.iter
    path = f"{ckpt_dir}/last.ckpt"
    dist.barrier()
    files = sorted(os.listdir(ckpt_dir))
    saved = torch.load(path, weights_only=False)[CHECKPOINT_KEY] if rank == 0 else None

    lit = Lit(optimizer)
    torch.manual_seed(99)   # a resumed process starts elsewhere: the checkpoint must carry what matters
    second = GradCompStrategy(compression=make_compression(optimizer))
    t = trainer(second, f"{root}/second", 4, **kw)
    t.fit(lit, loader(), ckpt_path=path)
    resumed = flat(lit)
    state = second.gradcomp_state
    return {"identical": bool(torch.equal(straight, resumed)), "max_diff": float((straight - resumed).abs().max()),
            "files": files, "saved_iter": saved_iter, "iter": state.iter, "global_step": t.global_step,
            "saved_ranks": None if saved is None else len(saved["ranks"]),
            "saved_all_ranks": None if saved is None else bool(saved.get("all_ranks")),
            "summary": state.comm_stats.summary()}


def refit(root: str) -> Dict[str, Any]:
    """fit() twice on one Trainer (as Lightning's tuner does): the second setup registers the hook on the new
    DDP model with a compressor of its own, carrying on from this rank's state; the clip moves again."""
    lit = Lit("sgd")
    strategy = GradCompStrategy(compression=make_compression("sgd"))
    t = trainer(strategy, root, 1, gradient_clip_val=1.0)
    t.fit(lit, loader())
    first = strategy.gradcomp_state
    after_first = (first.iter, t.gradient_clip_val)
    t.fit_loop.max_epochs = 2
    t.fit(lit, loader())
    state = strategy.gradcomp_state
    return {"after_first": after_first, "iter": state.iter, "global_step": t.global_step,
            "new_state": state is not first, "new_compressor": state.compression is not first.compression,
            "clip": state.compression.clip, "clip_after": t.gradient_clip_val}


def refusals(root: str) -> Dict[str, Any]:
    """Settings the strategy cannot honour fail on every rank at fit() with a message that says why."""
    out = {}
    for label, kw in (("value", {"gradient_clip_val": 0.5, "gradient_clip_algorithm": "value"}),):
        lit = Lit("sgd")
        t = trainer(GradCompStrategy(compression=make_compression("sgd")), f"{root}/{label}", 1, **kw)
        try:
            t.fit(lit, loader())
            out[label] = None
        except ValueError as err:
            out[label] = str(err)
    return out


SCENARIOS: Dict[str, Callable[..., Dict[str, Any]]] = {
    "match_ddp": match_ddp, "resume": resume, "refit": refit, "refusals": refusals,
}


def main() -> None:
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*log_every_n_steps.*")
    run_scenarios(SCENARIOS)   # Lightning uses the process group as it is


if __name__ == "__main__":
    main()
