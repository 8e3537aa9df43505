"""The freeze check (``study.py --config freeze``, benchmarks/results/FREEZE_CHECK.md; ``--config freeze-01`` at
ratio 0.1%, benchmarks/results/FREEZE_CHECK_01.md): Adam and AdamW on a model with the quirks real ones have,
around the moment ``feedback="frozen"`` freezes Adam's second moment (step 100). An outside user's
script, found to jump after the freeze with FrozenVariance's defaults of the time (Adam's momentum
kept while the rate changes, a sparsity warm-up after the freeze), which then changed.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import horovod.torch as hvd
import torch
import torch.nn as nn
import torch.nn.functional as F

import hvd_gradcomp as gc

STEPS, FREEZE = 300, 100   # FREEZE: FrozenVariance's default warmup
ABOUT = (
    "The model (:class:`Quirky`) applies one hidden layer twice (shared weights), passes through a frozen "
    "layer (``requires_grad=False``) and uses one layer on even steps only, trained for 300 steps through "
    "``hvd_gradcomp.DistributedOptimizer``, by default with ``torch.optim.Adam`` (lr 2e-3) and "
    "``CosineAnnealingLR`` over the run, 3 micro-batches of 64 per step (``backward_passes_per_step=3``); the "
    "other configurations change one or two of these (see :data:`TASKS`, ``--tasks``). Rows: uncompressed "
    "training, the default ``TopKQSGD(ratio=0.01, bits=8)``, FrozenVariance's previous defaults (under these "
    "schedules they kept ``v`` frozen for good), the default with one of them put back (Adam's momentum kept, "
    "``momentum=True``; the 100-step sparsity warm-up, ``sparsity_warmup=100``), and the default with the "
    "frozen ``v`` following the gradients' scale both ways (``follow_scale=\"both\"``: shorter steps where they "
    "grew too) or never (``follow_scale=None``); below ratio 1%, where the default has a sparsity warm-up "
    "after the freeze with Adam's momentum while it is dense, also ``FrozenVariance()`` without it (the "
    "default before); every compressed row at the configuration's ratio (*freeze*: 1%, *freeze-01*: 0.1%). "
    "Prints the held-out loss at the freeze, 50 steps after it, at the end, and the highest of the "
    "evaluations every 10 steps after the freeze (a jump), and checks that the ranks end with identical "
    "parameters.")
"""What the check trains, as its pages say it."""
SETTINGS: Dict[str, Tuple[str, Callable[[float], gc.GradientCompressor]]] = {
    "default": ("default", lambda r: gc.TopKQSGD(ratio=r, bits=8)),
    "prev": ("... previous default (momentum=None, sparsity_warmup=100, follow_scale=None)", lambda r: gc.TopKQSGD(
        ratio=r, bits=8, feedback=gc.FrozenVariance(momentum=None, sparsity_warmup=100, follow_scale=None))),
    "momentum": ("... FrozenVariance(momentum=True)",
                 lambda r: gc.TopKQSGD(ratio=r, bits=8, feedback=gc.FrozenVariance(momentum=True))),
    "spw100": ("... FrozenVariance(sparsity_warmup=100)",
               lambda r: gc.TopKQSGD(ratio=r, bits=8, feedback=gc.FrozenVariance(sparsity_warmup=100))),
    "follow-both": ("... FrozenVariance(follow_scale='both')",
                    lambda r: gc.TopKQSGD(ratio=r, bits=8, feedback=gc.FrozenVariance(follow_scale="both"))),
    "follow-none": ("... FrozenVariance(follow_scale=None)",
                    lambda r: gc.TopKQSGD(ratio=r, bits=8, feedback=gc.FrozenVariance(follow_scale=None))),
    # below ratio 1% the default has a sparsity warm-up after the freeze, with Adam's momentum while it
    # is dense (compressors.LOW_RATIO_FROZEN); this row is the default before (at 1%: the default)
    "nowarm": ("... FrozenVariance() (no sparsity warm-up after the freeze)",
               lambda r: gc.TopKQSGD(ratio=r, bits=8, feedback=gc.FrozenVariance())),
}
"""Row (``--settings``) -> (its label, TopKQSGD(ratio, 8) with that feedback policy); every row runs
beside uncompressed training."""


def row_label(label: str, ratio: float) -> str:
    """A row's label at ``ratio``: "default" names the compressor.

    >>> row_label("default", 0.01), row_label("default", 0.001), row_label("uncompressed", 0.001)
    ('TopKQSGD(1%, 8), default', 'TopKQSGD(0.1%, 8), default', 'uncompressed')
    """
    return f"TopKQSGD({ratio * 100:g}%, 8), default" if label == "default" else label


class Setup(NamedTuple):
    """One training setup: optimizer class, peak rate, schedule, micro-batches per step."""
    optimizer: str = "Adam"
    lr: float = 2e-3
    schedule: str = "cosine"
    accumulate: int = 3

    def describe(self) -> str:
        """The setup in words, for the table.

        >>> Setup().describe()
        'Adam, cosine, lr 0.002, 3 micro-batches'
        """
        return f"{self.optimizer}, {self.schedule}, lr {self.lr:g}, {self.accumulate} micro-batch" + \
            ("es" if self.accumulate > 1 else "")


TASKS = {
    "adam": Setup(),
    "adamw-one-cycle": Setup("AdamW", schedule="one-cycle"),
    "adamw-linear": Setup("AdamW", 1e-3, "linear"),
    "adam-no-accumulation": Setup(accumulate=1),
    "adam-lr4e-3": Setup(lr=4e-3),
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
    """When the held-out loss is read: every 10 steps, and at the freeze, 50 steps after it and at the end.

    >>> eval_steps(300)[:3], eval_steps(110)
    ([10, 20, 30], [10, 20, 30, 40, 50, 60, 70, 80, 90, 100, 110])
    """
    return sorted(set(range(10, steps + 1, 10)) | {min(FREEZE, steps), min(FREEZE + 50, steps), steps})


def make_optimizer(setup: Setup, model: nn.Module, steps: int) -> tuple:
    """The setup's optimizer over the trainable parameters, and its scheduler."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=setup.lr, weight_decay=0.05) if setup.optimizer == "AdamW" else \
        torch.optim.Adam(params, lr=setup.lr)
    return opt, {"cosine": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, steps),
                 "one-cycle": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=setup.lr, total_steps=steps),
                 "linear": lambda o: torch.optim.lr_scheduler.LinearLR(o, 1.0, 0.01, steps)}[setup.schedule]


def train_one(seed: int, compression: Optional[gc.GradientCompressor], steps: int, setup: Setup) -> Dict[int, float]:
    """The held-out loss at each of :func:`eval_steps`; raises if the ranks' parameters differ."""
    torch.manual_seed(seed)
    model = Quirky()
    opt, schedule = make_optimizer(setup, model, steps)
    extra = {} if compression is None else {"compression": compression}
    opt = gc.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                  backward_passes_per_step=setup.accumulate, **extra)
    sched = schedule(opt)   # built on the wrapper, as users do: the scheduler changes its groups' rates
    hvd.broadcast_parameters(model.state_dict(), 0)
    losses = {}
    for step in range(steps):
        for micro in range(setup.accumulate):
            x, y = batch(seed, step * setup.accumulate + micro)
            (F.cross_entropy(model(x, step), y) / setup.accumulate).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        if step + 1 in eval_steps(steps):
            losses[step + 1] = held_out(model)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    if not torch.equal(flat, hvd.broadcast(flat, 0, name=f"freeze_check.{seed}.{compression!r}")):
        raise RuntimeError("the ranks' parameters differ")
    return losses


def train(tasks: List[str], rows: List[str], seeds: List[int], steps: int, ratio: float) -> List[Dict[str, Any]]:
    """Each setup of ``tasks`` uncompressed, then with each row at ``ratio``, on every seed: one record
    per run (``task``, ``row`` label, ``seed``, ``evals``: [step, held-out loss] pairs)."""
    hvd.init()
    labelled = [("uncompressed", lambda r: None)] + [SETTINGS[row] for row in rows]
    return [{"task": task, "row": row_label(label, ratio), "seed": seed,
             "evals": sorted(train_one(seed, make(ratio), steps, TASKS[task]).items())}
            for task in tasks for label, make in labelled for seed in seeds]
