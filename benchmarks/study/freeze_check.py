"""Adam and AdamW on a model with the quirks real ones have, around the moment ``feedback="frozen"``
freezes Adam's second moment (step 100): an outside user's script, found to jump after the freeze
with FrozenVariance's defaults of the time (Adam's momentum kept while the rate changes, a
sparsity warm-up after the freeze), which then changed.

    horovodrun -np 2 -H localhost:2 --gloo .venv/bin/python benchmarks/study/freeze_check.py \\
        --seeds 3 --page docs/FREEZE_CHECK.md
    horovodrun -np 2 -H localhost:2 --gloo .venv/bin/python benchmarks/study/freeze_check.py \\
        --seeds 3 --ratio 0.001 --page docs/FREEZE_CHECK_01.md

The model (:class:`Quirky`) applies one hidden layer twice (shared weights), passes through a
frozen layer (``requires_grad=False``) and uses one layer on even steps only, trained for 300
steps through ``hvd_gradcomp.DistributedOptimizer``, by default with ``torch.optim.Adam`` (lr 2e-3)
and ``CosineAnnealingLR`` over the run, 3 micro-batches of 64 per step
(``backward_passes_per_step=3``); the other configurations change one or two of these (see
:data:`CONFIGS`). Rows: uncompressed training, the default ``TopKQSGD(ratio=0.01, bits=8)``,
FrozenVariance's previous defaults (under these schedules they kept ``v`` frozen for good), the
default with one of them put back (Adam's momentum kept, ``momentum=True``; the 100-step sparsity
warm-up, ``sparsity_warmup=100``), and the default with the frozen ``v`` following the gradients'
scale both ways (``follow_scale="both"``: shorter steps where they grew too) or never
(``follow_scale=None``); below ratio 1%, where the default has a sparsity warm-up after the freeze
with Adam's momentum while it is dense, also ``FrozenVariance()`` without it (the default before);
every compressed row at ``--ratio`` (1% unless given). Prints the
held-out loss at the freeze, 50 steps after it, at the end, and the highest of the evaluations
every 10 steps after the freeze (a jump), and checks that the ranks end with identical parameters.
"""
from __future__ import annotations

import argparse
import shlex
import statistics
import sys
from pathlib import Path
from typing import Callable, Dict, List, NamedTuple, Optional

import horovod.torch as hvd
import torch
import torch.nn as nn
import torch.nn.functional as F

import hvd_gradcomp as gc
from hvd_gradcomp.codecs.compressor import WARMUP_PACE_RATIO

STEPS, FREEZE = 300, 100   # FREEZE: FrozenVariance's default warmup
NO_WARMUP = "... FrozenVariance() (no sparsity warm-up after the freeze)"
SETTINGS: Dict[str, Callable[[float], Optional[gc.GradientCompressor]]] = {
    "uncompressed": lambda r: None,
    "default": lambda r: gc.TopKQSGD(ratio=r, bits=8),
    "... previous default (momentum=None, sparsity_warmup=100, follow_scale=None)": lambda r: gc.TopKQSGD(
        ratio=r, bits=8, feedback=gc.FrozenVariance(momentum=None, sparsity_warmup=100, follow_scale=None)),
    "... FrozenVariance(momentum=True)": lambda r: gc.TopKQSGD(
        ratio=r, bits=8, feedback=gc.FrozenVariance(momentum=True)),
    "... FrozenVariance(sparsity_warmup=100)": lambda r: gc.TopKQSGD(
        ratio=r, bits=8, feedback=gc.FrozenVariance(sparsity_warmup=100)),
    "... FrozenVariance(follow_scale='both')": lambda r: gc.TopKQSGD(
        ratio=r, bits=8, feedback=gc.FrozenVariance(follow_scale="both")),
    "... FrozenVariance(follow_scale=None)": lambda r: gc.TopKQSGD(
        ratio=r, bits=8, feedback=gc.FrozenVariance(follow_scale=None)),
    # below ratio 1% the default has a sparsity warm-up after the freeze, with Adam's momentum while it
    # is dense (compressors.LOW_RATIO_FROZEN); this row is the default before (at 1%: the default)
    NO_WARMUP: lambda r: gc.TopKQSGD(ratio=r, bits=8, feedback=gc.FrozenVariance()),
}
"""Row label -> TopKQSGD(ratio, 8) with that feedback policy (``--ratio``; the label "default" is
shown as ``TopKQSGD(<ratio>, 8), default``)."""


def settings_at(ratio: float) -> Dict[str, Callable[[float], Optional[gc.GradientCompressor]]]:
    """The rows run at ``ratio``: all of :data:`SETTINGS`, less :data:`NO_WARMUP` at 1% and above,
    where it is the default.

    >>> NO_WARMUP in settings_at(0.001), NO_WARMUP in settings_at(0.01)
    (True, False)
    """
    low = ratio < WARMUP_PACE_RATIO
    return {k: v for k, v in SETTINGS.items() if low or k != NO_WARMUP}


def row_label(name: str, ratio: float) -> str:
    """A setting's row label at ``ratio``.

    >>> row_label("default", 0.01), row_label("default", 0.001), row_label("uncompressed", 0.001)
    ('TopKQSGD(1%, 8), default', 'TopKQSGD(0.1%, 8), default', 'uncompressed')
    """
    return f"TopKQSGD({ratio * 100:g}%, 8), default" if name == "default" else name


class Config(NamedTuple):
    """One training configuration: optimizer class, peak rate, schedule, micro-batches per step."""
    optimizer: str = "Adam"
    lr: float = 2e-3
    schedule: str = "cosine"
    accumulate: int = 3

    def describe(self) -> str:
        """The configuration in words, for the table.

        >>> Config().describe()
        'Adam, cosine, lr 0.002, 3 micro-batches'
        """
        return f"{self.optimizer}, {self.schedule}, lr {self.lr:g}, {self.accumulate} micro-batch" + \
            ("es" if self.accumulate > 1 else "")


CONFIGS = {
    "adam": Config(),
    "adamw-one-cycle": Config("AdamW", schedule="one-cycle"),
    "adamw-linear": Config("AdamW", 1e-3, "linear"),
    "adam-no-accumulation": Config(accumulate=1),
    "adam-lr4e-3": Config(lr=4e-3),
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


def shown_steps(steps: int) -> List[int]:
    """The evaluations the table shows: at the freeze, 50 steps after it and at the end."""
    return sorted({min(FREEZE, steps), min(FREEZE + 50, steps), steps})


def make_optimizer(config: Config, model: nn.Module, steps: int) -> tuple:
    """The configuration's optimizer over the trainable parameters, and its scheduler."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.05) if config.optimizer == "AdamW" else \
        torch.optim.Adam(params, lr=config.lr)
    return opt, {"cosine": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, steps),
                 "one-cycle": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=config.lr, total_steps=steps),
                 "linear": lambda o: torch.optim.lr_scheduler.LinearLR(o, 1.0, 0.01, steps)}[config.schedule]


def train(seed: int, compression: Optional[gc.GradientCompressor], steps: int = STEPS,
          config: Config = Config()) -> Dict[int, float]:
    """The held-out loss at each of :func:`eval_steps`; raises if the ranks' parameters differ."""
    torch.manual_seed(seed)
    model = Quirky()
    opt, schedule = make_optimizer(config, model, steps)
    extra = {} if compression is None else {"compression": compression}
    opt = gc.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                  backward_passes_per_step=config.accumulate, **extra)
    sched = schedule(opt)   # built on the wrapper, as users do: the scheduler changes its groups' rates
    hvd.broadcast_parameters(model.state_dict(), 0)
    losses = {}
    for step in range(steps):
        for micro in range(config.accumulate):
            x, y = batch(seed, step * config.accumulate + micro)
            (F.cross_entropy(model(x, step), y) / config.accumulate).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        if step + 1 in eval_steps(steps):
            losses[step + 1] = held_out(model)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    if not torch.equal(flat, hvd.broadcast(flat, 0, name=f"freeze_check.{seed}.{compression!r}")):
        raise RuntimeError("the ranks' parameters differ")
    return losses


def table(results: Dict[str, Dict[str, List[Dict[int, float]]]], steps: int = STEPS) -> List[str]:
    """Per configuration and setting: the held-out loss at :func:`shown_steps` and the highest after
    the freeze (means over seeds), and the gap of the last one to uncompressed training per seed."""
    at = shown_steps(steps)
    lines = ["| configuration | setting | " + " | ".join(f"held-out loss, step {s}" for s in at) +
             " | highest after the freeze | gap at the end (per seed) |",
             "| --- | --- | " + " | ".join("---:" for _ in at) + " | ---: | --- |"]
    for config, by_setting in results.items():
        base = [r[steps] for r in by_setting["uncompressed"]]
        for label, runs in by_setting.items():
            means = [statistics.mean(r[s] for r in runs) for s in at]
            highest = statistics.mean(max(v for s, v in r.items() if s > FREEZE) for r in runs)
            gaps = [100 * (r[steps] / b - 1) for r, b in zip(runs, base)]
            lines.append(f"| {CONFIGS[config].describe()} | {label} | " + " | ".join(f"{m:.4f}" for m in means)
                         + f" | {highest:.4f} | **{statistics.mean(gaps):+.1f}%** "
                         f"({', '.join(f'{g:+.0f}' for g in gaps)}) |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1")
    ap.add_argument("--steps", type=int, default=STEPS, help="optimizer steps (the cosine decays over them)")
    ap.add_argument("--configs", default="all", help="comma-separated names of CONFIGS, or 'all'")
    ap.add_argument("--page", default=None, help="also write the table to this markdown file")
    ap.add_argument("--ratio", type=float, default=0.01, help="TopKQSGD's ratio in every compressed row (default 1%%)")
    args = ap.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    if not 0 < args.ratio <= 1:
        ap.error(f"--ratio must be in (0, 1], got {args.ratio}")
    if args.steps <= FREEZE:
        ap.error(f"--steps must be above {FREEZE}, the step at which Adam's second moment is frozen")
    names = list(CONFIGS) if args.configs == "all" else args.configs.split(",")
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        ap.error(f"--configs: unknown {unknown}; choose from {list(CONFIGS)} or 'all'")
    results = {name: {row_label(setting, args.ratio): [train(seed, make(args.ratio), args.steps, CONFIGS[name])
                                                   for seed in range(args.seeds)]
                      for setting, make in settings_at(args.ratio).items()} for name in names}
    lines = table(results, args.steps)
    if hvd.rank() == 0:
        print("\n".join(lines), flush=True)
        if args.page:
            command = "horovodrun -np 2 -H localhost:2 --gloo .venv/bin/python benchmarks/study/freeze_check.py " + \
                shlex.join(sys.argv[1:])
            Path(args.page).write_text(
                f"# Adam around the freeze: a check at top-k ratio {args.ratio * 100:g}%\n\n"
                f"Generated by `{command}`.\n\n"
                + __doc__.split("\n\n", 2)[2].replace("\n", " ").strip() + f" Seeds 0..{args.seeds - 1}, 2 ranks; "
                "the gap is the held-out loss at the end relative to uncompressed training on the same seed "
                "(mean, then per seed); every loss is a mean over the seeds.\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
