"""``make study``: the convergence study of issue 9, then docs/STUDY.md and its plots.

Every (task, seed) is one ``horovodrun -np 2`` job that trains all settings in turn
(:mod:`benchmarks.study.worker`); finished results (one JSON per run under ``--out``) are
kept, so an interrupted study resumes where it stopped. Seeds run outermost: a partial study
covers every task.

    python benchmarks/study/study.py                      # everything (about an hour on 2 quiet cores)
    python benchmarks/study/study.py --seeds 0 --tasks cnn-sgd
    python benchmarks/study/study.py --report-only        # regenerate docs/STUDY.md from runs/study

``--recipes`` runs the recipe study instead (:mod:`benchmarks.study.recipes`: recipes as users copy
them from well-known training scripts, on every road; one job per recipe, seed and launcher,
:mod:`benchmarks.study.recipe_worker`) and writes docs/RECIPES.md:

    python benchmarks/study/study.py --recipes                        # every recipe, seeds 0-2 (about an hour)
    python benchmarks/study/study.py --recipes --tasks lstm --seeds 0
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.study import recipe_report, recipes, report  # noqa: E402
from benchmarks.study.recipe_worker import setting_value  # noqa: E402
from benchmarks.study.recipe_worker import file_name as result_name  # noqa: E402
from benchmarks.study.tasks import TASKS  # noqa: E402
from benchmarks.study import ddp_worker  # noqa: E402
from benchmarks.study.worker import DEFAULT_SETTINGS, SETTINGS  # noqa: E402

# Extra rows: 4-bit QSGD with its default (no error feedback); for Adam and AdamW the previous
# default recipe ("update"), so the gain of the frozen second moment is visible, FrozenVariance's
# defaults before they dropped Adam's momentum and the sparsity warm-up after the freeze ("prev",
# docs/FREEZE_CHECK.md), and with the 100-step sparsity warm-up back ("nomom") or Adam's momentum
# kept by every tensor as well ("mom", at a constant rate); for momentum SGD momentum correction
# without its sparsity warm-up, and at 0.1% with the 172 steps it had before it lasted
# sqrt(1%/ratio) times longer, and at a constant rate (cnn-sgd-const, char-mlp-const) classic error
# feedback beside momentum correction; for the char-MLP, its output layer kept at 1% at ratio 0.1%
# (min_ratio=: the other tasks' output layers are at min_k's floor already); for the CNN with Adam,
# Adam's second moment frozen after a third of the run ("warm200") rather than the default 100 steps,
# and v frozen for good ("vfrozen": the default before the frozen v followed shrinking gradients);
# at 0.1% with Adam, FrozenVariance without the sparsity warm-up after the freeze ("tq01-nowarm": the
# default before it had one below 1%).
PREVIOUS = ("tq1-prev", "tq01-prev", "tq01-nowarm")   # tq01-nowarm: Adam tasks only
TASK_SETTINGS = {"char-mlp": DEFAULT_SETTINGS + ("qsgd4", "tq1-nospw", "tq01-spw172", "tq01-out1"),
                 "transformer": DEFAULT_SETTINGS + ("tq1-update", "tq1-nomom", "tq01-nomom") + PREVIOUS,
                 "transformer-const": ("none", "tq1", "tq01", "tq1-mom", "tq01-mom", "tq1-update") + PREVIOUS,
                 "cnn-adam-const": ("none", "tq1", "tq01", "tq1-mom", "tq01-mom", "tq1-warm200", "tq1-vfrozen") + PREVIOUS,
                 "cnn-sgd-const": ("none", "tq1", "tq01", "tq1-classic"),
                 "char-mlp-const": ("none", "tq1", "tq01", "tq1-classic"),
                 "cnn-adam": DEFAULT_SETTINGS + ("tq1-update", "tq1-nomom", "tq01-nomom", "tq1-warm200", "tq1-vfrozen")
                 + PREVIOUS,
                 "teacher-mlp": DEFAULT_SETTINGS + ("tq1-nomom", "tq01-nomom") + PREVIOUS,
                 "cnn-sgd": DEFAULT_SETTINGS + ("tq1-nospw", "tq01-spw172")}
# Run on the first seed only, to fit the study in about an hour: fp16 matched uncompressed to 4
# digits in every earlier run, and TopK 1% matched TopKQSGD(1%, 8).
ONE_SEED = ("fp16", "topk")
# Tasks also trained under PyTorch DDP (benchmarks/study/ddp_worker.py, torchrun), as "<task>-ddp".
DDP_TASKS = {"transformer-ddp": "transformer"}
ALL_TASKS = TASKS + tuple(DDP_TASKS)


def settings_of(task: str) -> tuple:
    if task in DDP_TASKS:
        return ddp_worker.DEFAULT_SETTINGS
    return TASK_SETTINGS.get(task, DEFAULT_SETTINGS)


def of_task(entry: str, task: str) -> bool:
    """Whether a plan entry (``task-setting-sSEED``) is one of ``task``'s (task names hold dashes).

    >>> of_task("transformer-const-tq1-s0", "transformer-const"), of_task("transformer-const-tq1-s0", "transformer")
    (True, False)
    """
    return entry.startswith(f"{task}-") and entry[len(task) + 1:].rsplit("-s", 1)[0] in SETTINGS


def plan_of(tasks: list, seeds: list, only: set = frozenset()) -> list:
    """The runs (``task-setting-sSEED``) of ``tasks`` x ``seeds``: each task's settings, or those of
    them in ``only`` when given; ONE_SEED's settings on seed 0 only.

    >>> plan_of(["cnn-adam"], [0, 12], {"none", "tq01", "fp16"})
    ['cnn-adam-none-s0', 'cnn-adam-fp16-s0', 'cnn-adam-tq01-s0', 'cnn-adam-none-s12', 'cnn-adam-tq01-s12']
    """
    return [f"{task}-{s}-s{seed}" for seed in seeds for task in tasks
            for s in settings_of(task) if (seed == 0 or s not in ONE_SEED) and (not only or s in only)]


def command(task: str, seed: int, settings: list, out: Path, steps: int = 0) -> list:
    """horovodrun (or, for a DDP task, torchrun) with 2 ranks over one task and seed; ``steps``:
    instead of the task's own (0: the task's)."""
    venv_bin = Path(sys.executable).parent
    args = ["--seed", str(seed), "--settings", ",".join(settings), "--out", str(out)] + \
        (["--steps", str(steps)] if steps else [])
    if task in DDP_TASKS:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                str(ROOT / "benchmarks/study/ddp_worker.py"), "--task", DDP_TASKS[task]] + args
    horovodrun = venv_bin / "horovodrun"
    return [str(horovodrun if horovodrun.exists() else "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo",
            sys.executable, str(ROOT / "benchmarks/study/worker.py"), "--task", task] + args


RECIPE_VARIANTS = {"lstm": [("gc", ("--setting", "clip=0.25")), ("ddp", ("--setting", "clip=0.25")),
                            ("none", ("--clip", "0.1"))],
                   **{name: [("none", ("--peak", f"{2 * recipes.RECIPES[name].peak:g}"))]
                      for name in ("tied-1e-3", "bert-ft", "cnn-bn")},
                   **{name: [("none", ("--peak", "0.004")), ("none,gc", ("--peak", "0.008")), ("ddp", ("--peak", "0.008"))]
                      for name in ("nanogpt", "tied-2e-3")}}
"""Recipe rows beyond the default roads: the clipping the library recommends (the compressor's
``clip=``, the recipe's threshold, no clipping by hand), where the recipe clips; and uncompressed
training with a smaller step (the LSTM clipped at 0.1) or a longer one (AdamW and the CNN at twice the peak
rate), which tells whether a compressed road ending below uncompressed took a smaller or a longer
effective step than the recipe's (docs/RECIPES.md); and the nanoGPT and tied-embedding recipes at
8e-3, where uncompressed training still learns and the frozen second moment blew up before its step
was bounded by Adam's (hvd_gradcomp.feedback.frozen.FrozenVariance._step_bound)."""


def recipe_plan(names: list, seeds: list) -> list:
    """The recipe study's jobs: ``(recipe, roads, worker arguments, seed, launcher)``, seeds outermost;
    the Horovod roads share one horovodrun job, the DDP hook runs under torchrun.

    >>> [j[:3] for j in recipe_plan(["lstm"], [0])][1:]
    [('lstm', 'ddp', ()), ('lstm', 'gc', ('--setting', 'clip=0.25')), ('lstm', 'ddp', ('--setting', 'clip=0.25')), ('lstm', 'none', ('--clip', '0.1'))]
    """
    jobs = []
    for seed in seeds:
        for name in names:
            jobs += [(name, ",".join(recipes.HOROVOD_ROADS), (), seed, "horovodrun"), (name, "ddp", (), seed, "torchrun")]
            jobs += [(name, road, args, seed, "torchrun" if road == "ddp" else "horovodrun")
                     for road, args in RECIPE_VARIANTS.get(name, [])
                     if "--setting" in args or seed in PROBE_SEEDS]
    return jobs


PROBE_SEEDS = (0, 1)
"""The seeds of the probes (a recipe at another rate or clipping): two, to fit the study in an hour;
the recipes' own rows and the recommended clipping run on every seed asked for."""


def recipe_command(name: str, roads: str, args: tuple, seed: int, launcher: str, out: Path) -> list:
    """One 2-rank job of the recipe study."""
    argv = [str(ROOT / "benchmarks/study/recipe_worker.py"), "--recipe", name, "--roads", roads,
            "--seed", str(seed), "--out", str(out), *args]
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"] + argv
    horovodrun = Path(sys.executable).parent / "horovodrun"
    return [str(horovodrun if horovodrun.exists() else "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo",
            sys.executable] + argv


def recipe_done(out: Path, name: str, roads: str, args: tuple, seed: int) -> bool:
    """Whether every road of a job has its result under ``out`` (an interrupted study resumes)."""
    opts = dict(zip(args[::2], args[1::2]))
    extra = {k: setting_value(v) for k, v in [opts["--setting"].split("=", 1)]} if "--setting" in opts else {}
    label = name + (f"@{float(opts['--peak']):g}" if "--peak" in opts else "") \
        + (f"@clip{float(opts['--clip']):g}" if "--clip" in opts else "")
    return all((out / result_name(label, road, seed, extra)).exists() for road in roads.split(","))


def run_recipes(names: list, seeds: list, out: Path, docs: Path, timeout: int) -> bool:
    """The recipe study: every job not done yet, then docs/RECIPES.md."""
    ok = True
    out.mkdir(parents=True, exist_ok=True)
    for name, roads, args, seed, launcher in recipe_plan(names, seeds):
        if recipe_done(out, name, roads, args, seed):
            continue
        print(f"{name} seed {seed}: {roads} {' '.join(args)}", flush=True)
        ok = run(recipe_command(name, roads, args, seed, launcher, out), f"{name} seed {seed}", timeout) and ok
    ran = [a for a in sys.argv[1:] if a != "--report-only"]   # the page names the command that ran the study
    path = recipe_report.write(out, docs, command=" ".join(["python benchmarks/study/study.py"] + ran))
    print(f"wrote {path}")
    return ok


def job(task: str, seed: int, settings: list, out: Path, timeout: int, steps: int = 0) -> bool:
    """Run one 2-rank job; False (and its output on stderr) when it failed or timed out."""
    return run(command(task, seed, settings, out, steps), f"{task} seed {seed}", timeout)


def run(cmd: list, what: str, timeout: int) -> bool:
    """Run one 2-rank job's command; False (and its output on stderr) when it failed or timed out."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        print(f"  {what}: timed out after {timeout}s\n{exc.stdout or ''}{exc.stderr or ''}",
              file=sys.stderr, flush=True)
        return False
    lines = [ln for ln in proc.stdout.splitlines() if "held-out loss" in ln]
    print("\n".join(f"  {ln}" for ln in lines), f"\n  ({time.time() - t0:.0f}s)", flush=True)
    if proc.returncode != 0:
        print(f"  {what} failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}",
              file=sys.stderr, flush=True)
        return False
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", default=",".join(ALL_TASKS))
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--settings", default="",
                    help="only these of each task's settings, comma-separated (default: all of them), "
                         "e.g. to add seeds to a few rows")
    ap.add_argument("--out", default=str(ROOT / "runs/study"))
    ap.add_argument("--docs", default=str(ROOT / "docs"))
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per horovodrun job")
    ap.add_argument("--report-only", action="store_true")
    ap.add_argument("--recipes", action="store_true",
                    help=f"the recipe study (--tasks: of {list(recipes.RECIPES)}; --out default docs/data/recipes)")
    args = ap.parse_args()
    if args.recipes:
        names = list(recipes.RECIPES) if args.tasks == ap.get_default("tasks") else args.tasks.split(",")
        if set(names) - set(recipes.RECIPES):
            ap.error(f"unknown recipes {sorted(set(names) - set(recipes.RECIPES))}; choose from {list(recipes.RECIPES)}")
        out = Path(args.out) if args.out != ap.get_default("out") else ROOT / "docs/data/recipes"
        seeds = [] if args.report_only else [int(x) for x in args.seeds.split(",")]
        return 0 if run_recipes(names, seeds, out, Path(args.docs), args.timeout) else 1
    out = Path(args.out)
    tasks = args.tasks.split(",")
    unknown = sorted(set(tasks) - set(ALL_TASKS))
    if unknown:
        ap.error(f"unknown tasks {unknown}; choose from {list(ALL_TASKS)}")
    only = set(args.settings.split(",")) - {""}
    if only - set(SETTINGS):
        ap.error(f"unknown settings {sorted(only - set(SETTINGS))}; choose from {list(SETTINGS)}")
    t0 = time.time()
    ok = True
    if not args.report_only:
        seeds = [int(x) for x in args.seeds.split(",")]
        plan = plan_of(tasks, seeds, only)
        out.mkdir(parents=True, exist_ok=True)
        old = out / "plan.json"  # a run over some tasks and seeds replaces their part of the plan
        kept = [p for p in (json.loads(old.read_text()) if old.exists() else [])   # (plan's entries are theirs too)
                if not any(of_task(p, task) and p.endswith(f"-s{seed}") for task in tasks for seed in seeds)]
        (out / "plan.json").write_text(json.dumps(kept + plan) + "\n")
        for seed in seeds:
            for task in tasks:
                settings = [s for s in settings_of(task)
                            if f"{task}-{s}-s{seed}" in plan and not (out / f"{task}-{s}-s{seed}.json").exists()]
                if not settings:
                    continue
                print(f"{task} seed {seed}: {', '.join(settings)}", flush=True)
                ok = job(task, seed, settings, out, args.timeout) and ok
    report.write(out, Path(args.docs), command=" ".join(["python benchmarks/study/study.py"] + sys.argv[1:]),
                 minutes=(time.time() - t0) / 60)
    print(f"wrote {Path(args.docs) / 'STUDY.md'}")
    return 0 if ok else 1


if __name__ == "__main__":
    assert set(SETTINGS) >= set(DEFAULT_SETTINGS)
    sys.exit(main())
