"""The small-MLP check (``study.py --config small-mlp``, benchmarks/results/SMALL_MLP_CHECK.md): a quick check as an
outside user would write it. A small MLP (64- and 48-wide layers, so every compressed tensor is near
``min_k``) classifies by a random linear teacher, the README's two lines with each optimizer of
``--tasks`` (:data:`OPTIMIZERS`), a constant learning rate (``--cosine``: decayed to zero over the
run); ``--data digits`` trains an MLP on scikit-learn's digits instead (real data, wider layers).

Each row of ``--settings`` is TopKQSGD(1%, 8) through ``hvd_gradcomp.DistributedOptimizer``, with a
``feedback=`` policy (:data:`ROWS`: ``auto``, ``classic``, ...) or with one thing of the default
changed (the ratio, ``min_k``, when Adam's ``v`` is frozen: the variants), against uncompressed
training through ``hvd.DistributedOptimizer`` on the same seeds. Each run records the held-out
loss at the last step and averaged over the last 5 evaluations (every 10 steps: the last step alone
is noisy at a constant rate); the ranks' parameters are checked identical after every run.
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import horovod.torch as hvd
import torch
import torch.nn as nn
import torch.nn.functional as F

import hvd_gradcomp as gc
from hvd_gradcomp.feedback import POLICIES

OPTIMIZERS: Dict[str, Callable] = {
    "adamw": lambda p: torch.optim.AdamW(p, lr=3e-3, weight_decay=0.01),
    "adam": lambda p: torch.optim.Adam(p, lr=3e-3),
    "sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    "sgd-0.02": lambda p: torch.optim.SGD(p, lr=0.02, momentum=0.9),   # Nesterov's rate, without Nesterov
    "nesterov": lambda p: torch.optim.SGD(p, lr=0.02, momentum=0.9, nesterov=True, weight_decay=1e-4)}
TEACHER = torch.randn(20, 3, generator=torch.Generator().manual_seed(8))
X_VAL = torch.randn(512, 20, generator=torch.Generator().manual_seed(7))
TAIL_EVALS, EVAL_EVERY = 5, 10
ROWS: Dict[str, Tuple[str, Callable[[], gc.GradientCompressor]]] = {
    **{p: (p, lambda p=p: gc.TopKQSGD(ratio=0.01, bits=8, feedback=p)) for p in ("auto", *POLICIES)},
    # the variants: each changes one thing of TopKQSGD(1%, 8)'s default
    "dense-frozen": ("TopK(ratio=1.0): v frozen, nothing dropped", lambda: gc.TopK(ratio=1.0)),
    "ratio10": ("TopKQSGD(ratio=0.1, bits=8)", lambda: gc.TopKQSGD(ratio=0.1, bits=8)),
    "min-k128": ("TopKQSGD(0.01, 8, min_k=128)", lambda: gc.TopKQSGD(ratio=0.01, bits=8, min_k=128)),
    "freeze300": ("TopKQSGD(0.01, 8), v frozen at step 300",
                  lambda: gc.TopKQSGD(ratio=0.01, bits=8, feedback=gc.FrozenVariance(warmup=300))),
    # Adam and AdamW only: every tensor keeps Adam's first moment (by default every tensor drops it),
    # with the 100-step sparsity warm-up after the freeze that the page's section ran with
    "momentum-kept": ("TopKQSGD(0.01, 8), Adam's momentum kept",
                      lambda: gc.TopKQSGD(ratio=0.01, bits=8,
                                          feedback=gc.FrozenVariance(momentum=True, sparsity_warmup=100))),
}
"""Row (``--settings``) -> (its label in the table, the compressor)."""
TASK = ("A 3-layer MLP (20 -> 64 -> 48 -> 3, ReLU) classifies Gaussian inputs by a random linear teacher, batch 32 "
        "per rank, learning rate AdamW and Adam 3e-3, momentum SGD 0.05 with momentum 0.9, held-out "
        "cross-entropy on 512 fixed inputs; uncompressed through `hvd.DistributedOptimizer`, TopKQSGD(1%, 8) "
        "through `hvd_gradcomp.DistributedOptimizer` with the `feedback=` policy named in the row "
        "(`auto`: the library's default), or the compressor named there; the ranks' parameters are checked "
        "identical after every run.")
DIGITS_TASK = ("An MLP (64 -> 256 -> 256 -> 10, ReLU) classifies scikit-learn's digits (1437 images to train on, 360 "
               "held out), batch 32 per rank sampled with replacement; momentum SGD 0.05 (`sgd-0.02`: 0.02) with momentum "
               "0.9, Nesterov SGD 0.02 with momentum 0.9 and weight decay 1e-4, Adam 3e-3; otherwise as the page's "
               "first table.")


class Data(NamedTuple):
    """A task: its model, a batch of 32 from a generator, the fixed held-out set."""

    model: Callable[[], nn.Module]
    batch: Callable[[torch.Generator], Tuple[torch.Tensor, torch.Tensor]]
    val: Tuple[torch.Tensor, torch.Tensor]


def teacher_data() -> Data:
    """Gaussian inputs classified by a random linear teacher: fresh samples every step."""
    def batch(g: torch.Generator) -> Tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(32, 20, generator=g)
        return x, (x @ TEACHER).argmax(1)
    return Data(lambda: nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 3)),
                batch, (X_VAL, (X_VAL @ TEACHER).argmax(1)))


def digits_data() -> Data:
    """scikit-learn's digits (ships with it: nothing is downloaded), 80% to train on, 20% held out."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))
    from data import load_digits_split   # examples/data.py, as the study's CNN tasks load it

    xtr, ytr, xte, yte = load_digits_split(seed=0)

    def batch(g: torch.Generator) -> Tuple[torch.Tensor, torch.Tensor]:
        i = torch.randint(0, len(xtr), (32,), generator=g)
        return xtr[i], ytr[i]

    def model() -> nn.Module:
        return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    return Data(model, batch, (xte, yte))


DATA: Dict[str, Callable[[], Data]] = {"teacher": teacher_data, "digits": digits_data}
DATA_TEXT = {"teacher": TASK, "digits": DIGITS_TASK}
"""``--data`` -> what the page says of it."""


def held_out(model: nn.Module, data: Data) -> float:
    with torch.no_grad():
        return float(F.cross_entropy(model(data.val[0]), data.val[1]))


def train_one(opt_name: str, seed: int, steps: int, compression: Optional[gc.GradientCompressor],
              cosine: bool, data: Data) -> Tuple[float, float]:
    """Held-out cross-entropy after ``steps`` steps, and its mean over the last evaluations;
    raises if the ranks' parameters differ."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(100 + hvd.rank() + 1000 * seed)
    model = data.model()
    opt = OPTIMIZERS[opt_name](model.parameters())
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps) if cosine else None
    hvd.broadcast_parameters(model.state_dict(), 0)
    if compression is None:
        dopt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    else:
        dopt = gc.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=compression)
    tail: List[float] = []
    for step in range(1, steps + 1):
        x, y = data.batch(gen)
        dopt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        dopt.step()
        if sched is not None:
            sched.step()
        if step > steps - TAIL_EVALS * EVAL_EVERY and step % EVAL_EVERY == 0:
            tail.append(held_out(model, data))
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    if not torch.equal(flat, hvd.broadcast(flat, 0, name=f"check.{opt_name}.{seed}.{compression!r}")):
        raise RuntimeError("the ranks' parameters differ")
    return held_out(model, data), statistics.mean(tail)


def train(optimizers: List[str], rows: List[str], seeds: List[int], steps: int, cosine: bool,
          data: str) -> List[Dict[str, Any]]:
    """Every optimizer uncompressed (row ``uncompressed``), then through each row, on every seed:
    one record per run (``opt``, ``row`` label, ``seed``, held-out loss ``last`` and ``tail``)."""
    hvd.init()
    task = DATA[data]()
    out = []
    for opt in optimizers:
        for label, make in [("uncompressed", lambda: None)] + [ROWS[r] for r in rows]:
            out += [dict(zip(("opt", "row", "seed", "last", "tail"),
                             (opt, label, s, *train_one(opt, s, steps, make(), cosine, task)))) for s in seeds]
    return out
