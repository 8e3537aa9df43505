"""Whether compressed training's gap to uncompressed training changes in longer runs (issue 9).

At a ratio r, each of P ranks sends r * n of a tensor's n values per step, so a run of T steps
sends at most T * r * P values per value of the tensor ("sends per value"): below 1, part of every
tensor is never sent, however good the error feedback (for tensors of more than 32,000 elements:
smaller ones send at least ``min_k`` = 32 values per step, more than r * n). The study's runs
(400-600 steps, chosen so that the uncompressed loss is flat) give TopKQSGD(0.1%, 8) only about one send per value, so its
gap could be an artefact of short runs. This command tests that: it trains the two tasks whose
uncompressed seed spread is small (``transformer``: AdamW; ``char-mlp``: momentum SGD) for
``--scale`` times their steps (the same schedule, stretched), uncompressed, TopKQSGD(0.1%, 8) and
TopKQSGD(1%, 8) (for AdamW also with Adam's second moment frozen after 300 steps instead of the
default's 100, or the end of the rate's warm-up ramp when later: 120 steps at 3x the transformer's
400), and ``transformer-const`` (the transformer at a constant rate, whose loss at the study's length
is still falling) uncompressed and at both ratios, by default and with Adam's momentum kept by
every tensor (``FrozenVariance(momentum=True)``, the default before a tensor at a constant rate
dropped it), and writes ``docs/STUDY_RUN_LENGTH.md``: the gap at the study's length (from ``docs/data/study``,
the same seeds) next to the gap of the longer runs. Finished runs are kept (one JSON per run under
``--out``) and not run again.

    python benchmarks/study/run_length.py                 # ~35 minutes on 2 quiet cores
    python benchmarks/study/run_length.py --report-only   # the page from the saved runs
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Tuple

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.study import report  # noqa: E402
from benchmarks.study.study import job  # noqa: E402

TASKS = ("transformer", "char-mlp", "transformer-const")
# The compressed settings run per task (benchmarks/study/worker.py); "tq1-warm300" freezes Adam's
# second moment after 300 steps instead of the default's 100 (or the ramp's end): only for AdamW, only in
# the longer runs.
# "tq01-nowarm": FrozenVariance() without the sparsity warm-up after the freeze that feedback="auto"
# gives Adam below ratio 1% (the default before), for the AdamW tasks.
TASK_SETTINGS = {"transformer": ("tq01", "tq01-nowarm", "tq01-spw100", "tq1", "tq1-warm300"),
                 "char-mlp": ("tq01", "tq01-spw100", "tq1"),
                 # at a constant rate the study's 400 steps leave the loss falling (6% over the last
                 # quarter): does the gap there close once the loss flattens?
                 "transformer-const": ("tq01", "tq01-nowarm", "tq1", "tq01-mom", "tq1-mom")}
SETTINGS = ("none", "tq01", "tq01-nowarm", "tq01-spw100", "tq1", "tq1-warm300", "tq01-mom", "tq1-mom")
COLUMNS = (("tq01", "TopKQSGD(0.1%, 8)"),
           ("tq01-nowarm", "TopKQSGD(0.1%, 8), no sparsity warm-up after the freeze"),
           ("tq01-spw100", "TopKQSGD(0.1%, 8), 100-step sparsity warm-up"),
           ("tq01-mom", "TopKQSGD(0.1%, 8), Adam's momentum kept"),
           ("tq1", "TopKQSGD(1%, 8)"),
           ("tq1-warm300", "TopKQSGD(1%, 8), v frozen after 300 steps"),
           ("tq1-mom", "TopKQSGD(1%, 8), Adam's momentum kept"))
TARGET = {"tq01": 2.0, "tq01-nowarm": 2.0, "tq01-spw100": 2.0, "tq01-mom": 2.0, "tq1": 1.0, "tq1-warm300": 1.0, "tq1-mom": 1.0}
RATIO, RANKS = 0.001, 2
Runs = Dict[Tuple[str, str], List[dict]]


def sends_per_value(steps: int, ratio: float = RATIO, ranks: int = RANKS) -> float:
    """The most times a run can send each value of a tensor: steps x ratio x ranks.

    >>> sends_per_value(400), sends_per_value(400, ratio=0.01)
    (0.8, 8.0)
    """
    return round(steps * ratio * ranks, 6)


def gap(runs: Runs, task: str, seeds: List[int], setting: str = "tq01") -> Tuple[float, float, float, float]:
    """(uncompressed loss, ``setting``'s loss, gap in %, uncompressed seed spread in %), means over
    the ``seeds`` that ran both; the gap is per seed against the uncompressed run of the same seed
    (:func:`benchmarks.study.report.paired_gap`).

    >>> runs = {("t", "none"): [{"seed": 0, "val_loss": 2.0}, {"seed": 1, "val_loss": 2.2}],
    ...         ("t", "tq01"): [{"seed": 0, "val_loss": 2.1}, {"seed": 1, "val_loss": 2.2}]}
    >>> [round(x, 2) for x in gap(runs, "t", [0, 1])]
    [2.1, 2.15, 2.5, 6.73]
    """
    both = {s for s in seeds if any(r["seed"] == s for r in runs.get((task, "none"), []))} & \
        {r["seed"] for r in runs.get((task, setting), [])}
    kept = {key: [r for r in rs if r["seed"] in both] for key, rs in runs.items() if key[0] == task}
    if not both:
        return (float("nan"),) * 4
    base = [r["val_loss"] for r in kept[(task, "none")]]
    return (statistics.fmean(base), statistics.fmean(r["val_loss"] for r in kept[(task, setting)]),
            report.paired_gap(task, setting, kept)[0], report.spread(base))


def page(study: Runs, longer: Runs, seeds: List[int], command: str) -> str:
    """The markdown page: per task, each setting's gap at the study's length and at the longer one."""
    lines = ["# Compressed training and the length of the run", "",
             f"Generated by `{command}` from the JSON results in `docs/data/study` (the study's runs) and "
             "`docs/data/study-long` (the longer ones); rerun it to regenerate this page. 2 ranks, seeds "
             f"{', '.join(map(str, seeds))}; each gap is the held-out loss against the uncompressed run of the "
             "same seed and length, averaged over the seeds; - : not run at that length.", "",
             "*sends per value at 0.1%* is steps x ratio x ranks: the most times a run at ratio 0.001 can send "
             "each value of a tensor of more than 32,000 elements (see `benchmarks/study/run_length.py`). Below 1, "
             "part of every such tensor is never sent; smaller tensors send at least 32 values per step (`min_k`).", "",
             "| task | steps | sends per value at 0.1% | uncompressed held-out loss | uncompressed: change over the "
             "last quarter | uncompressed seed spread | "
             + " | ".join(f"{label}: gap" for _, label in COLUMNS) + " |",
             "| --- | ---: | ---: | ---: | ---: | ---: | " + " | ".join("---:" for _ in COLUMNS) + " |"]
    verdicts = [""]
    for task in TASKS:
        gaps: Dict[str, List[Tuple[int, float]]] = {}
        for runs in (study, longer):
            rs = runs.get((task, "none"), [])
            if not rs:
                continue
            steps = rs[0]["steps"]
            cells = []
            for key, _ in COLUMNS:
                b, _, g, spread = gap(runs, task, seeds, key)
                cells.append("-" if g != g else f"{g:+.2f}%")
                if g == g:
                    gaps.setdefault(key, []).append((steps, g))
            base = [r["val_loss"] for r in rs if r["seed"] in seeds]
            change = report.last_quarter_change([r for r in rs if r["seed"] in seeds])
            lines.append(f"| {task} | {steps} | {sends_per_value(steps):g} | {statistics.fmean(base):.4f} | "
                         f"{change:.2f}% | +-{report.spread(base):.2f}% | " + " | ".join(cells) + " |")
        for key, label in COLUMNS:
            series = gaps.get(key, [])
            if not series:
                continue
            trail = " -> ".join(f"{g:+.2f}% ({s} steps)" for s, g in series)
            verdicts.append(f"- {task}, {label}: {trail}: "
                            + ("within" if series[-1][1] <= TARGET[key] else "above")
                            + f" the {TARGET[key]:g}% target at the longest")
    return "\n".join(lines + verdicts) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", type=int, default=3, help="times the task's steps")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--tasks", default=",".join(TASKS), help="the tasks to train (the page shows every task's saved runs)")
    ap.add_argument("--study", default=str(ROOT / "docs/data/study"), help="the study's results (the shorter runs)")
    ap.add_argument("--out", default=str(ROOT / "docs/data/study-long"))
    ap.add_argument("--doc", default=str(ROOT / "docs/STUDY_RUN_LENGTH.md"))
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per horovodrun job")
    ap.add_argument("--report-only", action="store_true")
    args = ap.parse_args()
    if args.scale < 1:
        ap.error(f"--scale must be >= 1, got {args.scale}")
    seeds, out, study = [int(s) for s in args.seeds.split(",")], Path(args.out), report.load(Path(args.study))
    tasks = [t for t in args.tasks.split(",") if t]
    unknown = sorted(set(tasks) - set(TASKS))
    if unknown:
        ap.error(f"--tasks: unknown {', '.join(unknown)} (known: {', '.join(TASKS)})")
    ok, t0 = True, time.time()
    for seed in seeds if not args.report_only else []:
        for task in tasks:
            if not study.get((task, "none")):
                ap.error(f"no study run of {task} in {args.study}: run benchmarks/study/study.py first")
            missing = [s for s in ("none",) + TASK_SETTINGS[task] if not (out / f"{task}-{s}-s{seed}.json").exists()]
            if missing:
                print(f"{task} seed {seed}: {', '.join(missing)}", flush=True)
                ok = job(task, seed, missing, out, args.timeout, steps=args.scale * study[(task, "none")][0]["steps"]) \
                    and ok
    command = " ".join(["python benchmarks/study/run_length.py"] + [a for a in sys.argv[1:] if a != "--report-only"])
    Path(args.doc).write_text(page(study, report.load(out), seeds, command))
    print(f"wrote {args.doc} ({(time.time() - t0) / 60:.1f} min)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
