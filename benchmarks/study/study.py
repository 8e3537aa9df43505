"""The one runner of benchmarks/study: ``python benchmarks/study/study.py [--config NAME]`` runs one
of the configurations of :mod:`benchmarks.study.configs` (the convergence study, the recipe study and
every past investigation: what each trains, its settings, roads and seeds, its results and its
page) and writes its page. With no ``--config`` it is the convergence study (``make study``),
benchmarks/results/STUDY.md.

Every job trains on 2 ranks of this machine (Gloo). Results are kept (one JSON per run under
``--out``, or a JSON-lines file), so an interrupted run resumes where it stopped, and
``--report-only`` writes the page from them without training. A page names the command that made
it (less ``--report-only`` and ``--docs``).

    python benchmarks/study/study.py --list                       # every configuration and its page
    python benchmarks/study/study.py                              # the convergence study (about an hour on 2 quiet cores)
    python benchmarks/study/study.py --seeds 0 --tasks cnn-sgd
    python benchmarks/study/study.py --config recipes --tasks lstm --seeds 0    # --recipes: the same
    python benchmarks/study/study.py --config run-length --tasks transformer,transformer-const --report-only
    python benchmarks/study/study.py --config small-mlp --data digits --tasks sgd --settings auto,classic \\
        --steps 1200 --seeds 0,1,2,3,4,5 --section 'Digits MLP, 1200 steps, momentum SGD: which feedback'
"""
from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.study.configs import CONFIGS  # noqa: E402
from benchmarks.study.run import Job, Refused, Run  # noqa: E402

FLAGS = ("data", "cosine", "section")
"""Options a configuration reads only when it has them (:attr:`Config.options`): the others refuse them."""


def seed_list(text: str) -> Tuple[int, ...]:
    """``--seeds``: comma-separated integers."""
    return tuple(int(s) for s in text.split(","))


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="study", help=f"the investigation, of {list(CONFIGS)} (default: study)")
    ap.add_argument("--recipes", action="store_true", help="the same as --config recipes")
    ap.add_argument("--list", action="store_true", help="name every configuration, what it does and its page")
    ap.add_argument("--tasks", help="what to train, comma-separated (default: the configuration's)")
    ap.add_argument("--settings", help="the compression settings (rows), comma-separated; for the study: only "
                                       "these of each task's, e.g. to add seeds to a few rows")
    ap.add_argument("--roads", help="the optimizer wrappers or the DDP hook, comma-separated")
    ap.add_argument("--seeds", type=seed_list, help="comma-separated (default: the configuration's)")
    ap.add_argument("--steps", type=int, help="steps of every run, for the checks (default: the configuration's)")
    ap.add_argument("--out", help="where the results are kept (default: the configuration's)")
    ap.add_argument("--docs", default=str(ROOT / "benchmarks" / "results"), help="where the page is written")
    ap.add_argument("--timeout", type=int, help="seconds per 2-rank job (default: the configuration's)")
    ap.add_argument("--report-only", action="store_true", help="write the page from the results kept; train nothing")
    ap.add_argument("--data", choices=("teacher", "digits"),
                    help="small-mlp: the random-teacher MLP (default) or an MLP on scikit-learn's digits")
    ap.add_argument("--cosine", action="store_true", default=None,
                    help="small-mlp: decay the rate to zero over the run (CosineAnnealingLR), not constant")
    ap.add_argument("--section", metavar="TITLE",
                    help="small-mlp: the table as this section of the page (replaced when there), not its head")
    return ap


def pick(given: Optional[str], known: Sequence[str], default: Sequence[str], what: str, name: str) -> Tuple[str, ...]:
    """``--tasks``, ``--settings`` or ``--roads`` as given (comma-separated), else the configuration's
    default (else all it knows); :class:`Refused` for names it does not know.

    >>> pick("a,c", ("a", "b", "c"), (), "tasks", "x"), pick(None, ("a", "b"), ("b",), "tasks", "x")
    (('a', 'c'), ('b',))
    >>> pick("a,z", ("a", "b"), (), "tasks", "x")
    Traceback (most recent call last):
    benchmarks.study.run.Refused: unknown tasks ['z'] of --config x; choose from ['a', 'b']
    """
    if given is None:
        return tuple(default or known)
    chosen = tuple(x for x in given.split(",") if x)
    unknown = [x for x in chosen if x not in known]
    if unknown:
        raise Refused(f"unknown {what} {unknown} of --config {name}; choose from {list(known)}" if known
                      else f"--config {name} takes no --{what}")
    return chosen


def command_of(argv: Sequence[str]) -> str:
    """The command a page names: the runner with ``argv``, less what changes only where the page goes
    or whether training runs (``--report-only``, ``--docs``).

    >>> command_of(["--config", "wrapper", "--report-only", "--docs", "/tmp/d", "--section", "A b"])
    "python benchmarks/study/study.py --config wrapper --section 'A b'"
    """
    kept: List[str] = []
    for a in argv:
        if kept[-1:] == ["--docs"]:   # a is its value: drop both
            kept.pop()
        elif a != "--report-only" and not a.startswith("--docs="):
            kept.append(a)
    return shlex.join(["python", "benchmarks/study/study.py", *kept])


def make_run(argv: Sequence[str]) -> Run:
    """The invocation ``argv`` asks for; :class:`Refused`, naming the choices, for what its configuration lacks."""
    args = parser().parse_args(argv)
    name = "recipes" if args.recipes else args.config
    if name not in CONFIGS:
        raise Refused(f"unknown configuration {name!r}; choose from {list(CONFIGS)} (study.py --list)")
    c = CONFIGS[name]
    options = dict(c.options)
    for flag in (f for f in FLAGS if getattr(args, f) is not None):
        if flag not in options:
            raise Refused(f"--{flag} is an option of {[n for n, k in CONFIGS.items() if flag in dict(k.options)]}, "
                          f"not of --config {name}")
        options[flag] = getattr(args, flag)
    if args.steps is not None and not c.steps:
        raise Refused(f"--config {name} trains each task for its own steps: it takes no --steps")
    return Run(c, pick(args.tasks, c.tasks, c.default_tasks, "tasks", name),
               pick(args.settings, c.settings, c.default_settings, "settings", name),
               pick(args.roads, c.roads, (), "roads", name), args.seeds or c.seeds, args.steps or c.steps,
               Path(args.out) if args.out else ROOT / c.out, Path(args.docs), command_of(argv), options)


def listing() -> str:
    """One line per configuration: its name, what it does, its page."""
    return "\n".join(f"{c.name:<11} {c.about} (benchmarks/results/{c.page})" for c in CONFIGS.values())


def run_job(job: Job, timeout: int) -> bool:
    """Run one 2-rank job (its held-out losses and time printed after); False, with its output on
    stderr, when it failed or timed out."""
    print(job.what, flush=True)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    t0 = time.time()
    try:
        proc = subprocess.run(job.argv, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        print(f"  {job.what}: timed out after {timeout}s\n{exc.stdout or ''}{exc.stderr or ''}",
              file=sys.stderr, flush=True)
        return False
    lines = [f"  {ln}" for ln in proc.stdout.splitlines() if "held-out loss" in ln]
    print("\n".join(lines + [f"  ({time.time() - t0:.0f}s)"]), flush=True)
    if proc.returncode != 0:
        print(f"  {job.what} failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}",
              file=sys.stderr, flush=True)
        return False
    return True


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = parser()
    args = ap.parse_args(argv)
    if args.list:
        print(listing())
        return 0
    try:
        run = make_run(argv)
        jobs = [] if args.report_only else run.config.jobs(run)
    except Refused as exc:
        ap.error(str(exc))
    failed = [job.what for job in jobs if not run_job(job, args.timeout or run.config.timeout)]
    if failed:   # a page of some runs would not say which are missing: resume first
        print(f"not writing {run.page}: {len(failed)} job(s) failed ({'; '.join(failed)}); rerun the same command "
              "to resume, or add --report-only for a page of the results kept", file=sys.stderr)
        return 1
    run.page.parent.mkdir(parents=True, exist_ok=True)
    run.page.write_text(run.config.render(run))
    print(f"wrote {run.page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
