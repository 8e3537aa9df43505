"""Adam under a cosine schedule on a model with the quirks real ones have, around the moment
``feedback="frozen"`` freezes Adam's second moment (step 100): an outside user's script, found
to jump after the freeze on some seeds.

    horovodrun -np 2 -H localhost:2 --gloo .venv/bin/python benchmarks/study/freeze_check.py \\
        --seeds 3 --page docs/FREEZE_CHECK.md

The model (:class:`Quirky`) applies one hidden layer twice (shared weights), passes through a
frozen layer (``requires_grad=False``) and uses one layer on even steps only; ``torch.optim.Adam``
(lr 2e-3) with ``CosineAnnealingLR`` over the run (300 steps), 3 micro-batches of 64 per step
(``backward_passes_per_step=3``), through ``hvd_gradcomp.DistributedOptimizer``. Rows: the
default ``TopKQSGD(ratio=0.01, bits=8)`` and the same with one part of ``FrozenVariance`` turned
off (its sparsity warm-up after the freeze; Adam's momentum). Prints, per seed, the held-out loss
after the freeze's step and at the end, and checks that the ranks end with identical parameters.
"""
from __future__ import annotations

import argparse
import shlex
import statistics
import sys
from pathlib import Path
from typing import Callable, Dict, List, Optional

import horovod.torch as hvd
import torch
import torch.nn as nn
import torch.nn.functional as F

import hvd_gradcomp as gc

STEPS, ACCUMULATE, FREEZE = 300, 3, 100   # FREEZE: FrozenVariance's default warmup
SETTINGS: Dict[str, Callable[[], Optional[gc.GradientCompressor]]] = {
    "uncompressed": lambda: None,
    "TopKQSGD(1%, 8), default": lambda: gc.TopKQSGD(ratio=0.01, bits=8),
    "... FrozenVariance(sparsity_warmup=0)": lambda: gc.TopKQSGD(
        ratio=0.01, bits=8, feedback=gc.FrozenVariance(sparsity_warmup=0)),
    "... FrozenVariance(momentum=False)": lambda: gc.TopKQSGD(
        ratio=0.01, bits=8, feedback=gc.FrozenVariance(momentum=False)),
}


class Quirky(nn.Module):
    """A 4-class MLP with a shared layer applied twice, a frozen layer and a layer used on even steps."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.frozen, self.hid = nn.Linear(32, 128), nn.Linear(128, 128), nn.Linear(128, 128)
        self.sometimes, self.out = nn.Linear(128, 128), nn.Linear(128, 4)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor, step: int = 0) -> torch.Tensor:
        h = F.relu(self.inp(x))
        h = F.relu(self.frozen(h)) + h
        h = F.relu(self.hid(F.relu(self.hid(h))))
        if step % 2 == 0:
            h = h + self.sometimes(h)
        return self.out(h)


def batch(seed: int, index: int, n: int = 64) -> tuple:
    """This rank's micro-batch ``index``: Gaussian inputs, the class from the signs of two sums."""
    g = torch.Generator().manual_seed(1_000_003 * seed + 10 * index + hvd.rank())
    x = torch.randn(n, 32, generator=g)
    return x, (x[:, :4].sum(1) > 0).long() + 2 * (x[:, 4:8].sum(1) > 0).long()


def held_out(model: nn.Module) -> float:
    g = torch.Generator().manual_seed(999)
    x = torch.randn(2048, 32, generator=g)
    y = (x[:, :4].sum(1) > 0).long() + 2 * (x[:, 4:8].sum(1) > 0).long()
    with torch.no_grad():
        return float(F.cross_entropy(model(x), y))


def eval_steps(steps: int) -> List[int]:
    """When the held-out loss is read: at the freeze, 50 steps after it and at the end.

    >>> eval_steps(300), eval_steps(110)
    ([100, 150, 300], [100, 110])
    """
    return sorted({min(FREEZE, steps), min(FREEZE + 50, steps), steps})


def train(seed: int, compression: Optional[gc.GradientCompressor], steps: int = STEPS) -> List[float]:
    """The held-out loss at each of :func:`eval_steps`; raises if the ranks' parameters differ."""
    torch.manual_seed(seed)
    model = Quirky()
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=2e-3)
    extra = {} if compression is None else {"compression": compression}
    opt = gc.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                  backward_passes_per_step=ACCUMULATE, **extra)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    hvd.broadcast_parameters(model.state_dict(), 0)
    losses = []
    for step in range(steps):
        for micro in range(ACCUMULATE):
            x, y = batch(seed, step * ACCUMULATE + micro)
            (F.cross_entropy(model(x, step), y) / ACCUMULATE).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        if step + 1 in eval_steps(steps):
            losses.append(held_out(model))
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    if not torch.equal(flat, hvd.broadcast(flat, 0, name=f"freeze_check.{seed}.{compression!r}")):
        raise RuntimeError("the ranks' parameters differ")
    return losses


def table(results: Dict[str, List[List[float]]], steps: int = STEPS) -> List[str]:
    """Per setting: the held-out loss at each evaluation step (mean over seeds), and the gap of the
    last one to uncompressed training per seed."""
    base = [r[-1] for r in results["uncompressed"]]
    at = eval_steps(steps)
    lines = ["| setting | " + " | ".join(f"held-out loss, step {s}" for s in at) + " | gap at the end (per seed) |",
             "| --- | " + " | ".join("---:" for _ in at) + " | --- |"]
    for label, runs in results.items():
        means = [statistics.mean(r[i] for r in runs) for i in range(len(at))]
        gaps = [100 * (r[-1] / b - 1) for r, b in zip(runs, base)]
        lines.append(f"| {label} | " + " | ".join(f"{m:.4f}" for m in means) +
                     f" | **{statistics.mean(gaps):+.1f}%** ({', '.join(f'{g:+.0f}' for g in gaps)}) |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1")
    ap.add_argument("--steps", type=int, default=STEPS, help="optimizer steps (the cosine decays over them)")
    ap.add_argument("--page", default=None, help="also write the table to this markdown file")
    args = ap.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    if args.steps <= FREEZE:
        ap.error(f"--steps must be above {FREEZE}, the step at which Adam's second moment is frozen")
    results = {label: [train(seed, make(), args.steps) for seed in range(args.seeds)] for label, make in SETTINGS.items()}
    lines = table(results, args.steps)
    if hvd.rank() == 0:
        print("\n".join(lines), flush=True)
        if args.page:
            command = "horovodrun -np 2 -H localhost:2 --gloo .venv/bin/python benchmarks/study/freeze_check.py " + \
                shlex.join(sys.argv[1:])
            Path(args.page).write_text(
                f"# Adam around the freeze: a check\n\nGenerated by `{command}`.\n\n"
                + __doc__.split("\n\n", 2)[2].replace("\n", " ").strip() + f" Seeds 0..{args.seeds - 1}, 2 ranks; "
                "the gap is the held-out loss at the end relative to uncompressed training on the same seed "
                "(mean, then per seed).\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
