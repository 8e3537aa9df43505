"""The study's configurations: every investigation of benchmarks/study as data, each run by the one
runner, ``python benchmarks/study/study.py --config NAME`` (``--list`` names them).

A configuration (:class:`Config`) names what it trains (the study's tasks, the recipes, or a check's
models and optimizers), the settings and roads it can run, its default seeds and steps, where its
results are kept and the page it writes under benchmarks/results/. Its ``jobs`` plan the 2-rank jobs whose results
are not there yet (an interrupted run resumes); its ``render`` makes the page from the results
(``--report-only`` does only that). Training lives in the workers: ``worker.py`` and
``ddp_worker.py`` (the study's tasks, :mod:`.tasks`), ``recipe_worker.py`` (:mod:`.recipes`) and
``check_worker.py`` (:mod:`.checks`); pages in :mod:`.report`, :mod:`.recipe_report` and :mod:`.pages`.

>>> list(CONFIGS)
['study', 'recipes', 'run-length', 'powersgd', 'wrapper', 'outside', 'small-mlp', 'freeze', 'freeze-01', 'adafactor', 'lightning']
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Dict, List, Sequence, Tuple

from benchmarks.study import ddp_worker, pages, recipe_report, recipes, report
from benchmarks.study.checks import freeze, outside, small_mlp, wrapper
from benchmarks.study.recipe_worker import file_name as result_name
from benchmarks.study.recipe_worker import setting_value
from benchmarks.study.run import Config, Job, Refused, Run
from benchmarks.study.tasks import TASKS
from benchmarks.study.worker import DEFAULT_SETTINGS, SETTINGS

ROOT = Path(__file__).resolve().parents[2]


def two_ranks(launcher: str, argv: Sequence[str]) -> List[str]:
    """``argv`` (a script and its arguments) on 2 local ranks over Gloo under ``launcher``:
    ``horovodrun``, ``torchrun`` or ``hvdgc-launch`` (found next to this Python, else on the PATH).

    >>> two_ranks("torchrun", ["w.py", "--seed", "0"])[1:]
    ['-m', 'torch.distributed.run', '--standalone', '--nproc-per-node', '2', 'w.py', '--seed', '0']
    """
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *argv]
    tool = Path(sys.executable).parent / launcher
    head = [str(tool) if tool.exists() else launcher, "-np", "2"]
    if launcher == "hvdgc-launch":   # it runs the script with this Python itself
        return head + ["--gloo", *argv]
    return head + ["-H", "localhost:2", "--gloo", sys.executable, *argv]


# -- the convergence study, and the run-length and PowerSGD configurations on its workers ----------

# Extra rows: 4-bit QSGD with its default (no error feedback); for Adam and AdamW the previous
# default recipe ("update"), so the gain of the frozen second moment is visible, FrozenVariance's
# defaults before they dropped Adam's momentum and the sparsity warm-up after the freeze ("prev",
# benchmarks/results/FREEZE_CHECK.md), and with the 100-step sparsity warm-up back ("nomom") or Adam's momentum
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
# A study task named "<task>-ddp" is <task> under PyTorch DDP (ddp_worker.py, torchrun).
ALL_TASKS = TASKS + ("transformer-ddp",)


def settings_of(task: str) -> Tuple[str, ...]:
    """The study's rows of ``task``."""
    return ddp_worker.DEFAULT_SETTINGS if task.endswith("-ddp") else TASK_SETTINGS.get(task, DEFAULT_SETTINGS)


def of_task(entry: str, task: str) -> bool:
    """Whether a plan entry (``task-setting-sSEED``) is one of ``task``'s (task names hold dashes).

    >>> of_task("transformer-const-tq1-s0", "transformer-const"), of_task("transformer-const-tq1-s0", "transformer")
    (True, False)
    """
    return entry.startswith(f"{task}-") and entry[len(task) + 1:].rsplit("-s", 1)[0] in SETTINGS


def plan_of(tasks: Sequence[str], seeds: Sequence[int], only: Sequence[str]) -> List[str]:
    """The runs (``task-setting-sSEED``) of ``tasks`` x ``seeds``: each task's settings that are in
    ``only``; ONE_SEED's settings on seed 0 only.

    >>> plan_of(["cnn-adam"], [0, 12], {"none", "tq01", "fp16"})
    ['cnn-adam-none-s0', 'cnn-adam-fp16-s0', 'cnn-adam-tq01-s0', 'cnn-adam-none-s12', 'cnn-adam-tq01-s12']
    """
    return [f"{task}-{s}-s{seed}" for seed in seeds for task in tasks
            for s in settings_of(task) if (seed == 0 or s not in ONE_SEED) and s in only]


def command(task: str, seed: int, settings: Sequence[str], out: Path, steps: int = 0) -> List[str]:
    """The study's worker (for a ``<task>-ddp``: the DDP worker) on 2 ranks over one task and seed;
    ``steps``: instead of the task's own (0: the task's)."""
    args = ["--seed", str(seed), "--settings", ",".join(settings), "--out", str(out)] + \
        (["--steps", str(steps)] if steps else [])
    if task.endswith("-ddp"):
        return two_ranks("torchrun", [str(ROOT / "benchmarks/study/ddp_worker.py"), "--task", task[:-4]] + args)
    return two_ranks("horovodrun", [str(ROOT / "benchmarks/study/worker.py"), "--task", task] + args)


def worker_jobs(run: Run, tasks: Sequence[str], settings: Callable[[str, int], Sequence[str]],
                steps: Callable[[str], int] = lambda task: 0) -> List[Job]:
    """One study-worker job per seed (outermost: a partial run covers every task) and task, over the
    settings of ``settings(task, seed)`` picked by ``run`` that have no result under ``run.out`` yet."""
    jobs = []
    for seed in run.seeds:
        for task in tasks:
            todo = [s for s in settings(task, seed)
                    if s in run.settings and not (run.out / f"{task}-{s}-s{seed}.json").exists()]
            if todo:
                jobs.append(Job(f"{task} seed {seed}: {', '.join(todo)}",
                                command(task, seed, todo, run.out, steps(task))))
    return jobs


def study_jobs(run: Run) -> List[Job]:
    """The convergence study's jobs; its plan (every run asked for, done or not: the page's *planned*)
    replaces its tasks' and seeds' part of ``plan.json``."""
    plan = plan_of(run.tasks, run.seeds, run.settings)
    run.out.mkdir(parents=True, exist_ok=True)
    old = run.out / "plan.json"
    kept = [p for p in (json.loads(old.read_text()) if old.exists() else [])
            if not any(of_task(p, task) and p.endswith(f"-s{seed}") for task in run.tasks for seed in run.seeds)]
    old.write_text(json.dumps(kept + plan) + "\n")
    return worker_jobs(run, run.tasks, lambda task, seed: [s for s in settings_of(task) if f"{task}-{s}-s{seed}" in plan])


def render_study(run: Run) -> str:
    """benchmarks/results/STUDY.md (and its plots under ``run.docs``)."""
    return report.render(run.out, run.docs, run.command, (time.time() - run.started) / 60)


# The longer runs: the two tasks whose uncompressed seed spread is small (transformer: AdamW;
# char-mlp: momentum SGD) and transformer-const (its loss still falls at the study's length), for
# 3 times their steps (the same schedule, stretched); "tq1-warm300" freezes Adam's second moment
# after 300 steps instead of 100 (or the end of the rate's warm-up ramp when later), "tq01-nowarm"
# is FrozenVariance() without the sparsity warm-up feedback="auto" gives Adam below ratio 1%.
RUN_LENGTH_SETTINGS = {"transformer": ("tq01", "tq01-nowarm", "tq01-spw100", "tq1", "tq1-warm300"),
                       "char-mlp": ("tq01", "tq01-spw100", "tq1"),
                       "transformer-const": ("tq01", "tq01-nowarm", "tq1", "tq01-mom", "tq1-mom")}


def run_length_jobs(run: Run) -> List[Job]:
    """Each task's runs at ``scale`` times the steps of its run in the study's results."""
    study = report.load(ROOT / run.options["study"])
    missing = [t for t in run.tasks if not study.get((t, "none"))]
    if missing:
        raise Refused(f"no study run of {missing} in {run.options['study']}: run python benchmarks/study/study.py "
                      f"--tasks {','.join(missing)} first")
    return worker_jobs(run, run.tasks, lambda task, seed: ("none",) + RUN_LENGTH_SETTINGS[task],
                       lambda task: run.options["scale"] * study[(task, "none")][0]["steps"])


def powersgd_jobs(run: Run) -> List[Job]:
    """Each task under DDP (the study's DDP worker): uncompressed, ``gc.PowerSGD(rank=4)`` through the
    hook, torch's ``powerSGD_hook`` at rank 4."""
    return worker_jobs(run, [f"{t}-ddp" for t in run.tasks], lambda task, seed: run.config.settings)


# -- the recipe study --------------------------------------------------------------------------------

RECIPE_VARIANTS = {"lstm": [("gc", ("--setting", "clip=0.25")), ("ddp", ("--setting", "clip=0.25")),
                            ("none", ("--clip", "0.1"))],
                   **{name: [("none", ("--peak", f"{2 * recipes.RECIPES[name].peak:g}"))]
                      for name in ("tied-1e-3", "bert-ft", "cnn-bn")},
                   **{name: [("none", ("--peak", "0.004")), ("none,gc", ("--peak", "0.008")), ("ddp", ("--peak", "0.008"))]
                      for name in ("nanogpt", "tied-2e-3")},
                   "adafactor": [("ddp", ("--setting", "feedback=classic"))]}
"""Recipe rows beyond the default roads: the clipping the library recommends (the compressor's
``clip=``, the recipe's threshold, no clipping by hand), where the recipe clips; and uncompressed
training with a smaller step (the LSTM clipped at 0.1) or a longer one (AdamW and the CNN at twice the peak
rate), which tells whether a compressed road ending below uncompressed took a smaller or a longer
effective step than the recipe's (benchmarks/results/RECIPES.md); and the nanoGPT and tied-embedding recipes at
8e-3, where uncompressed training still learns and the frozen second moment blew up before its step
was bounded by Adam's (hvd_gradcomp.feedback.frozen_adam.AdamBinding.step_bound); and Adafactor's recipe
on the DDP hook with classic error feedback, what the hook ran for it before it ran ``feedback="update"``
(issue 61)."""
PROBE_SEEDS = (0, 1)
"""The seeds of the probes (a recipe at another rate or clipping): two, to fit the study in an hour;
the recipes' own rows and the recommended clipping run on every seed asked for."""


def recipe_plan(names: Sequence[str], seeds: Sequence[int]) -> List[tuple]:
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


def recipe_done(out: Path, name: str, roads: str, args: tuple, seed: int) -> bool:
    """Whether every road of a job has its result under ``out``."""
    opts = dict(zip(args[::2], args[1::2]))
    extra = {k: setting_value(v) for k, v in [opts["--setting"].split("=", 1)]} if "--setting" in opts else {}
    label = name + (f"@{float(opts['--peak']):g}" if "--peak" in opts else "") \
        + (f"@clip{float(opts['--clip']):g}" if "--clip" in opts else "")
    return all((out / result_name(label, road, seed, extra)).exists() for road in roads.split(","))


def recipe_jobs(run: Run) -> List[Job]:
    """Every job of :func:`recipe_plan` not done yet."""
    return [Job(f"{name} seed {seed}: {roads} {' '.join(args)}",
                two_ranks(launcher, [str(ROOT / "benchmarks/study/recipe_worker.py"), "--recipe", name, "--roads", roads,
                                     "--seed", str(seed), "--out", str(run.out), *args]))
            for name, roads, args, seed, launcher in recipe_plan(run.tasks, run.seeds)
            if not recipe_done(run.out, name, roads, args, seed)]


def render_recipes(run: Run) -> str:
    """benchmarks/results/RECIPES.md, which recipe_report.write writes itself (under ``run.docs``)."""
    return recipe_report.write(run.out, run.docs, run.command).read_text()


def render_adafactor(run: Run) -> str:
    """benchmarks/results/ADAFACTOR.md: the recipe study's page, of the Adafactor recipe alone."""
    return recipe_report.write(run.out, run.docs, run.command, page=run.config.page,
                               title="Adafactor: a recipe on every road").read_text()


def lightning_jobs(run: Run) -> List[Job]:
    """One torchrun job per seed, recipe and road (``lightning``; ``ddp`` rerun on the same code) not done yet."""
    return [Job(f"{name} seed {seed}: {road}",
                two_ranks("torchrun", [str(ROOT / "benchmarks/study/recipe_worker.py"), "--recipe", name, "--roads", road,
                                       "--seed", str(seed), "--out", str(run.out)]))
            for seed in run.seeds for name in run.tasks for road in run.roads
            if not (run.out / result_name(name, road, seed, {})).exists()]


def render_lightning(run: Run) -> str:
    """benchmarks/results/LIGHTNING_CHECK.md: the Lightning runs beside the recipe study's saved rows (``--out`` of ``recipes``)."""
    return recipe_report.lightning_check(run.out, ROOT / run.options["saved"], run.command, run.tasks, run.seeds)


# -- the checks: their own training (benchmarks/study/checks), one check_worker.py job each --------

def check_job(what: str, check: str, launcher: str, result: Path, **job: Any) -> Job:
    """A 2-rank job of ``checks.<check>.train(**job)``, rank 0's return value kept in ``result``."""
    return Job(what, two_ranks(launcher, [str(ROOT / "benchmarks/study/check_worker.py"), check,
                                          json.dumps(job, separators=(",", ":")), str(result)]))


def wrapper_jobs(run: Run) -> List[Job]:
    """One job per seed and road (``ddp`` under torchrun), one JSON each."""
    return [check_job(f"{road} seed {seed}", "wrapper", "torchrun" if road == "ddp" else "horovodrun",
                      run.out / f"{road}-s{seed}.json", road=road, seed=seed)
            for seed in run.seeds for road in run.roads if not (run.out / f"{road}-s{seed}.json").exists()]


def outside_jobs(run: Run) -> List[Job]:
    """One ``hvdgc-launch`` job per seed, optimizer, wrapper and setting not in the results yet, each a
    line of the JSON-lines file; uncompressed training is the same through either wrapper: run once (gc)."""
    done = {(r["opt"], r["wrapper"], r["setting"], r["seed"], r["steps"])
            for r in (pages.records(run.out) if run.out.exists() else [])}
    return [check_job(f"{opt} {road} {setting} seed {seed}", "outside", "hvdgc-launch", run.out,
                      opt=opt, wrapper=road, setting=setting, seed=seed, steps=run.steps)
            for seed in run.seeds for opt in run.tasks for road in run.roads for setting in run.settings
            if not (road == "hvd" and setting == "none") and (opt, road, setting, seed, run.steps) not in done]


def small_mlp_jobs(run: Run) -> List[Job]:
    """One job training every optimizer and row on every seed (seconds each); its results replace the last ones."""
    if run.options["section"] is not None and not run.page.exists():
        raise Refused("--section adds a table to an existing page: write the page first, without --section")
    return [check_job(f"small MLP ({run.options['data']}): {', '.join(run.tasks)} x {', '.join(run.settings)}",
                      "small_mlp", "horovodrun", run.out, optimizers=list(run.tasks), rows=list(run.settings),
                      seeds=list(run.seeds), steps=run.steps, cosine=bool(run.options["cosine"]),
                      data=run.options["data"])]


def freeze_jobs(run: Run) -> List[Job]:
    """One job training every setup and row on every seed; its results replace the last ones."""
    if run.steps <= freeze.FREEZE:
        raise Refused(f"--steps must be above {freeze.FREEZE}, the step at which Adam's second moment is frozen")
    return [check_job(f"freeze check at ratio {run.options['ratio']:g}: {', '.join(run.tasks)}", "freeze",
                      "horovodrun", run.out, tasks=list(run.tasks), rows=list(run.settings), seeds=list(run.seeds),
                      steps=run.steps, ratio=run.options["ratio"])]


FREEZE_CHECK = Config(
    "freeze", "Adam and AdamW around the freeze of their second moment, on a model with real models' quirks, "
    "ratio 1%", "FREEZE_CHECK.md", "runs/freeze.json", freeze_jobs, pages.freeze_check,
    tasks=tuple(freeze.TASKS), settings=tuple(freeze.SETTINGS),
    # at 1% and above the row without the sparsity warm-up is the default row
    default_settings=tuple(s for s in freeze.SETTINGS if s != "nowarm"),
    steps=freeze.STEPS, options=(("ratio", 0.01),), timeout=7200)

CONFIGS: Dict[str, Config] = {c.name: c for c in (
    Config("study", "the convergence study: the study's tasks x compression settings against uncompressed "
           "training (make study)", "STUDY.md", "runs/study", study_jobs, render_study,
           tasks=ALL_TASKS, settings=tuple(SETTINGS)),
    Config("recipes", "recipes as users copy them from well-known training scripts, on every road (--recipes)",
           "RECIPES.md", "benchmarks/results/data/recipes", recipe_jobs, render_recipes, tasks=recipes.PAGE_RECIPES),
    Config("run-length", "the study's gaps over 3 times the steps, beside those of the study's runs",
           "STUDY_RUN_LENGTH.md", "benchmarks/results/data/study-long", run_length_jobs, pages.run_length,
           tasks=tuple(RUN_LENGTH_SETTINGS), settings=tuple(dict.fromkeys(
               ("none",) + tuple(s for v in RUN_LENGTH_SETTINGS.values() for s in v))),
           seeds=(0, 1), options=(("scale", 3), ("study", "benchmarks/results/data/study"))),
    Config("powersgd", "PowerSGD rank 4, hvd-gradcomp's against torch's hook, on the study's tasks under DDP",
           "POWERSGD.md", "benchmarks/results/data/powersgd_check", powersgd_jobs, pages.powersgd,
           tasks=("transformer", "cnn-sgd", "cnn-adam", "teacher-mlp", "transformer-const", "cnn-adam-const",
                  "cnn-sgd-const"),   # not char-mlp: the DDP worker takes no gradient accumulation
           default_tasks=("transformer", "cnn-sgd", "cnn-adam", "teacher-mlp"),
           settings=("none", "psgd4", ddp_worker.TORCH_POWERSGD)),
    Config("wrapper", "one compressor through stock Horovod, hvd_gradcomp.DistributedOptimizer and DDP, each "
           "driven as a user drives it", "WRAPPER_CHECK.md", "benchmarks/results/data/wrapper_check", wrapper_jobs,
           pages.wrapper_check, roads=tuple(wrapper.ROADS)),
    Config("outside", "the README's TopKQSGD(1%, 8) on a task nothing was tuned on, through both wrappers",
           "OUTSIDE_CHECK.md", "benchmarks/results/data/outside_check.jsonl", outside_jobs, pages.outside_check,
           tasks=("adamw", "adam"), settings=tuple(outside.SETTINGS),
           default_settings=("none", "tq1", "tq1-vfrozen", "tq1-prev", "tq1-prev-at100"), roads=("gc", "hvd"),
           steps=1200),
    Config("small-mlp", "small MLPs whose gradients keep shrinking, or a digits MLP (--data digits): per "
           "optimizer, TopKQSGD(1%, 8) with each feedback policy or variant", "SMALL_MLP_CHECK.md",
           "runs/small-mlp.json", small_mlp_jobs, pages.small_mlp_check, tasks=tuple(small_mlp.OPTIMIZERS),
           default_tasks=("adamw", "adam", "sgd"), settings=tuple(small_mlp.ROWS), default_settings=("auto",),
           steps=400, options=(("data", "teacher"), ("cosine", False), ("section", None)), timeout=7200),
    FREEZE_CHECK,
    replace(FREEZE_CHECK, name="freeze-01", about="the freeze check at ratio 0.1%, with FrozenVariance() without the "
            "default's sparsity warm-up", page="FREEZE_CHECK_01.md", out="runs/freeze-01.json",
            default_settings=tuple(freeze.SETTINGS), options=(("ratio", 0.001),)),
    Config("adafactor", "issue 61's recipe: a nanoGPT char transformer with torch.optim.Adafactor(lr=1e-2), "
           "clipped at 1.0, on every road (the DDP hook also with its former classic error feedback)",
           "ADAFACTOR.md", "benchmarks/results/data/adafactor", recipe_jobs, render_adafactor, tasks=("adafactor",),
           seeds=(0, 1)),
    Config("lightning", "recipes through Lightning's Trainer with GradCompStrategy (an AdamW and a momentum-SGD "
           "recipe by default), beside the recipe study's saved uncompressed and DDP-hook rows",
           "LIGHTNING_CHECK.md", "benchmarks/results/data/lightning", lightning_jobs, render_lightning, tasks=recipes.PAGE_RECIPES,
           default_tasks=("nanogpt", "cnn-bn"), roads=recipes.TORCHRUN_ROADS, seeds=(0, 1),
           options=(("saved", "benchmarks/results/data/recipes"),)),
)}
