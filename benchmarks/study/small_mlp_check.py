"""A quick check as an outside user would write it: a small MLP (64- and 48-wide layers, so
every compressed tensor is near ``min_k``) classifying by a random linear teacher, the README's
two lines with AdamW, Adam and momentum SGD, 3 seeds, constant learning rate, 400 steps.

    horovodrun -np 2 -H localhost:2 --gloo .venv/bin/python benchmarks/study/small_mlp_check.py
    horovodrun -np 2 -H localhost:2 --gloo .venv/bin/python benchmarks/study/small_mlp_check.py \\
        --optimizers adamw --steps 1200 --seeds 6 --feedback auto,update --page docs/SMALL_MLP_CHECK.md

Prints, per optimizer and ``feedback=`` policy, the uncompressed held-out loss (mean over seeds,
with its seed spread) and TopKQSGD(1%, 8)'s gap per seed through
``hvd_gradcomp.DistributedOptimizer``, at the last step and averaged over the last 5 evaluations
(every 10 steps: the last step alone is noisy at a constant rate); checks that the ranks end with
identical parameters. About a minute on 2 cores with the defaults. ``--variants`` adds rows that
change one thing of the default (the ratio, ``min_k``, when Adam's ``v`` is frozen) to see where a
gap comes from; ``--cosine`` decays the learning rate to zero over the run instead of keeping
it constant. ``--data digits`` trains an MLP on scikit-learn's digits instead (real data, wider
layers; ``--optimizers`` also takes ``nesterov``: Nesterov SGD with weight decay). ``--page``
also writes the table, with the command that made it, to a markdown file (``--section TITLE``:
as that section of the page).
"""
from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
from pathlib import Path
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import horovod.torch as hvd
import torch
import torch.nn as nn
import torch.nn.functional as F

import hvd_gradcomp as gc

OPTIMIZERS: Dict[str, Callable] = {
    "adamw": lambda p: torch.optim.AdamW(p, lr=3e-3, weight_decay=0.01),
    "adam": lambda p: torch.optim.Adam(p, lr=3e-3),
    "sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    "sgd-0.02": lambda p: torch.optim.SGD(p, lr=0.02, momentum=0.9),   # Nesterov's rate, without Nesterov
    "nesterov": lambda p: torch.optim.SGD(p, lr=0.02, momentum=0.9, nesterov=True, weight_decay=1e-4)}
TEACHER = torch.randn(20, 3, generator=torch.Generator().manual_seed(8))
X_VAL = torch.randn(512, 20, generator=torch.Generator().manual_seed(7))


class Data(NamedTuple):
    """A task: its model, a batch of 32 from a generator, the fixed held-out set, and what the page says of it."""

    model: Callable[[], nn.Module]
    batch: Callable[[torch.Generator], Tuple[torch.Tensor, torch.Tensor]]
    val: Tuple[torch.Tensor, torch.Tensor]
    text: str


def teacher_data() -> Data:
    """Gaussian inputs classified by a random linear teacher: fresh samples every step."""
    def batch(g: torch.Generator) -> Tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(32, 20, generator=g)
        return x, (x @ TEACHER).argmax(1)
    return Data(lambda: nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 3)),
                batch, (X_VAL, (X_VAL @ TEACHER).argmax(1)), TASK)


def digits_data() -> Data:
    """scikit-learn's digits (ships with it: nothing is downloaded), 80% to train on, 20% held out."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    from data import load_digits_split   # examples/data.py, as the study's CNN tasks load it

    xtr, ytr, xte, yte = load_digits_split(seed=0)

    def batch(g: torch.Generator) -> Tuple[torch.Tensor, torch.Tensor]:
        i = torch.randint(0, len(xtr), (32,), generator=g)
        return xtr[i], ytr[i]
    def model() -> nn.Module:
        return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    return Data(model, batch, (xte, yte), DIGITS_TASK)


DATA: Dict[str, Callable[[], Data]] = {"teacher": teacher_data, "digits": digits_data}
TAIL_EVALS, EVAL_EVERY = 5, 10
VARIANTS: Dict[str, Tuple[str, Callable[[], gc.GradientCompressor]]] = {
    # name: (what the row shows, the compressor); each changes one thing of TopKQSGD(1%, 8)'s default
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


def held_out(model: nn.Module, data: Data) -> float:
    with torch.no_grad():
        return float(F.cross_entropy(model(data.val[0]), data.val[1]))


def train(opt_name: str, seed: int, steps: int, compression: Optional[gc.GradientCompressor],
          cosine: bool = False, data: Optional[Data] = None) -> Tuple[float, float]:
    """Held-out cross-entropy after ``steps`` steps, and its mean over the last evaluations;
    raises if the ranks' parameters differ."""
    data = data or teacher_data()
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


def gaps(comp: List[float], base: List[float]) -> List[float]:
    return [100 * (c / b - 1) for c, b in zip(comp, base)]


def row(opt_name: str, policy: str, base: List[Tuple[float, float]], comp: List[Tuple[float, float]]) -> str:
    """One markdown table row: uncompressed mean +- seed spread, then the gaps, for the last step
    and for the tail average."""
    cells = []
    for i in (0, 1):
        b, c = [r[i] for r in base], [r[i] for r in comp]
        mean = statistics.mean(b)
        g = gaps(c, b)
        cells += [f"{mean:.4f} +-{100 * statistics.pstdev(b) / mean:.1f}%", f"{statistics.mean(c):.4f}",
                  f"**{statistics.mean(g):+.1f}%** ({', '.join(f'{x:+.0f}' for x in g)})"]
    return f"| {opt_name} | {policy} | " + " | ".join(cells) + " |"


def write_page(path: str, section: Optional[str], argv: List[str], steps: int, seeds: int,
               lines: List[str], cosine: bool = False, task: str = TASK) -> None:
    """The table, with the command that made it, as the page's head (its sections kept), or
    (``section``) as the page's section of that title: replaced when there, else appended."""
    command = "horovodrun -np 2 -H localhost:2 --gloo .venv/bin/python benchmarks/study/small_mlp_check.py " + \
        shlex.join(argv)
    table = "\n".join(lines) + "\n"
    rate = ", the learning rate decayed to zero by `CosineAnnealingLR`" if cosine else ", constant learning rate"
    text = Path(path).read_text() if os.path.exists(path) else ""
    if section is None:   # the page's head; its sections stay
        sections = text.find("\n## ")
        with open(path, "w") as f:
            f.write(f"# Small-MLP check\n\nGenerated by `{command}`.\n\n{task} {steps} steps{rate}, seeds "
                    f"0..{seeds - 1}, 2 ranks. Gaps are relative to uncompressed training on the same seed "
                    "(mean, then per seed); the spread is the uncompressed population standard deviation over "
                    "seeds, relative to its mean. *Last 5 evals*: the held-out loss averaged over the last 5 "
                    f"evaluations (every {EVAL_EVERY} steps), less noisy than the last step alone at a constant "
                    "rate.\n\n" + table + (text[sections:] if sections >= 0 else ""))
        return
    head = f"\n## {section}\n"
    start = text.find(head)
    following = text.find("\n## ", start + len(head)) if start >= 0 else -1
    end = following if following >= 0 else len(text)
    about = "" if task == TASK else f"{task}\n\n"
    block = f"{head}\nGenerated by `{command}` ({steps} steps, seeds 0..{seeds - 1}{rate}).\n\n{about}{table}"
    text = text.rstrip("\n") + "\n" + block if start < 0 else text[:start] + block + text[end:]
    with open(path, "w") as f:
        f.write(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--optimizers", default="adamw,adam,sgd", help=f"comma-separated: {', '.join(OPTIMIZERS)}")
    ap.add_argument("--data", default="teacher", choices=sorted(DATA), help="teacher: the random linear teacher "
                    "(the page's first table); digits: an MLP on scikit-learn's digits")
    ap.add_argument("--feedback", default="auto", help="comma-separated feedback= policies for the compressed runs")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1")
    ap.add_argument("--variants", default="", help="comma-separated rows beside the feedback ones, each one change "
                    f"to TopKQSGD(1%%, 8)'s default: {', '.join(VARIANTS)}")
    ap.add_argument("--cosine", action="store_true", help="decay the learning rate to zero over the run "
                    "(CosineAnnealingLR) instead of keeping it constant")
    ap.add_argument("--page", default=None, help="also write the table to this markdown file")
    ap.add_argument("--section", default=None, help="with --page: write the table as this section of the page "
                    "(replaced when there) instead of the whole page")
    args = ap.parse_args()
    unknown = [v for v in filter(None, args.variants.split(",")) if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown --variants {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    unknown = [o for o in args.optimizers.split(",") if o not in OPTIMIZERS]
    if unknown:
        ap.error(f"unknown --optimizers {', '.join(unknown)}; choose from {', '.join(OPTIMIZERS)}")
    if args.section and not (args.page and os.path.exists(args.page)):
        ap.error("--section adds a table to an existing --page: write the page first, without --section")
    hvd.init()
    torch.set_num_threads(1)
    header = ("| optimizer | feedback, or setting | uncompressed, last step | compressed | gap (per seed) "
              "| uncompressed, last 5 evals | compressed | gap (per seed) |\n"
              "| --- | --- | ---: | ---: | --- | ---: | ---: | --- |")
    lines = [header]
    if hvd.rank() == 0:
        print(header, flush=True)
    policies = filter(None, args.feedback.split(","))
    rows = [(p, lambda p=p: gc.TopKQSGD(ratio=0.01, bits=8, feedback=p)) for p in policies]
    rows += [VARIANTS[v] for v in filter(None, args.variants.split(","))]
    data = DATA[args.data]()
    for opt_name in args.optimizers.split(","):
        seeds = range(args.seeds)
        base = [train(opt_name, s, args.steps, None, args.cosine, data) for s in seeds]
        for label, make in rows:
            comp = [train(opt_name, s, args.steps, make(), args.cosine, data) for s in seeds]
            lines.append(row(opt_name, label, base, comp))
            if hvd.rank() == 0:
                print(lines[-1], flush=True)
    if hvd.rank() == 0 and args.page:
        write_page(args.page, args.section, sys.argv[1:], args.steps, args.seeds, lines, args.cosine, data.text)


if __name__ == "__main__":
    main()
