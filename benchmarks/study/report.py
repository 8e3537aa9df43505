"""benchmarks/results/STUDY.md and benchmarks/results/img/study_*.png from the convergence study's JSON results (``study.py``, the
*study* configuration; generated, never typed)."""
from __future__ import annotations

import datetime
import json
import platform
import statistics
from collections import Counter, defaultdict
from pathlib import Path
from typing import Callable, Dict, List, Tuple

TASK_TEXT = {
    "transformer": "4-layer decoder-only character transformer (d=64, 4 heads, context 32) on the standard "
                   "library's sources; AdamW lr 3e-3, weight decay 0.1, 10% linear warm-up then cosine decay; "
                   "`hvd_gradcomp.DistributedOptimizer`",
    "transformer-const": "the transformer task at a constant learning rate (AdamW lr 3e-3, weight decay 0.1, no "
                         "warm-up, no decay): a rate decaying to zero no longer hides error feedback's lag and a "
                         "frozen second moment; `hvd_gradcomp.DistributedOptimizer`",
    "cnn-sgd": "CNN (2 conv + 2 linear) on scikit-learn's digits; SGD lr 0.05, momentum 0.9, 5% warm-up then "
               "cosine; stock `hvd.DistributedOptimizer`",
    "cnn-adam": "the same CNN with Adam lr 2e-3, 5% warm-up then cosine; stock `hvd.DistributedOptimizer`",
    "cnn-adam-const": "the CNN with Adam lr 2e-3 at a constant rate (no warm-up, no decay), through stock "
                      "`hvd.DistributedOptimizer`: the road of *cnn-adam* at the rate of *transformer-const*",
    "cnn-sgd-const": "the CNN with momentum SGD (lr 0.05, momentum 0.9) at a constant rate (no warm-up, no "
                     "decay), through stock `hvd.DistributedOptimizer`: *cnn-sgd* without its schedule",
    "transformer-ddp": "the transformer task under PyTorch DDP (`benchmarks/study/ddp_worker.py`, torchrun, Gloo): "
                       "`hvd_gradcomp.ddp.register(model, compression=..., optimizer=opt)`, the hook's own choice "
                       "of feedback",
    "char-mlp": "the char-level MLP of `examples/train.py` on the standard library's sources; SGD lr 0.05, "
                "momentum 0.9, cosine decay, 2 micro-batches accumulated per step (`GradientAccumulator`); "
                "`hvd_gradcomp.DistributedOptimizer`",
    "char-mlp-const": "the char-level MLP at a constant rate (SGD lr 0.05, momentum 0.9, no decay, 2 micro-batches "
                      "accumulated per step); `hvd_gradcomp.DistributedOptimizer`",
    "teacher-mlp": "MLP (64 -> 512 -> LayerNorm -> 512 -> 10) learning the classes of a fixed random tanh "
                   "network on fresh Gaussian inputs (batch 64 per rank); AdamW lr 2e-3, weight decay 0.05, "
                   "betas (0.9, 0.98), 30% linear warm-up then cosine decay; `hvd_gradcomp.DistributedOptimizer`. "
                   "Added after the recipes were chosen, with nothing tuned for it",
}
ORDER = ["none", "fp16", "qsgd8", "qsgd4", "topk", "tq1", "tq01", "tq01-spw100", "tq01-spw172", "tq01-out1", "tq1-classic",
         "tq1-fixedlr", "tq1-update", "tq1-prev", "tq01-prev", "tq01-nowarm", "tq1-mom", "tq01-mom", "tq1-nomom", "tq01-nomom",
         "tq1-warm200", "tq1-momentum", "tq1-nospw", "tq1-vfrozen"]


def load(out: Path) -> Dict[Tuple[str, str], List[dict]]:
    runs: Dict[Tuple[str, str], List[dict]] = defaultdict(list)
    for path in sorted(out.glob("*-s*.json")):
        r = json.loads(path.read_text())
        runs[(r["task"], r["setting"])].append(r)
    return runs


def mean_sd(xs: List[float]) -> Tuple[float, float]:
    """Mean and standard deviation (0 for one value)."""
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def last_quarter_change(runs: List[dict]) -> float:
    """Relative change of the seed-mean held-out loss over the last quarter of the steps (%)."""
    curves = [{e["step"]: e["val_loss"] for e in r["evals"]} for r in runs]
    steps = sorted(set.intersection(*(set(c) for c in curves)))
    end = steps[-1]
    q = min(steps, key=lambda s: abs(s - 0.75 * end))
    at = lambda s: statistics.fmean(c[s] for c in curves)  # noqa: E731
    return (at(q) - at(end)) / at(end) * 100


def tail_mean(run: dict) -> float:
    """The run's held-out loss averaged over the evaluations of its last quarter of steps: at a
    constant rate the last evaluation alone swings from one evaluation to the next.

    >>> tail_mean({"evals": [{"step": s, "val_loss": v} for s, v in [(0, 9.0), (50, 3.0), (80, 2.0), (100, 1.0)]]})
    1.5
    """
    end = run["evals"][-1]["step"]
    return statistics.fmean(e["val_loss"] for e in run["evals"] if e["step"] >= 0.75 * end)


def table(task: str, runs: Dict[Tuple[str, str], List[dict]]) -> List[str]:
    base = runs.get((task, "none"), [])
    b_mean, b_sd = mean_sd([r["val_loss"] for r in base]) if base else (float("nan"), 0.0)
    spread = b_sd / b_mean * 100 if base else float("nan")
    lines = ["| setting | feedback (auto) | seeds | held-out loss | accuracy | gap vs uncompressed | "
             "uncompressed seed spread | gap, last-quarter mean | bytes ratio, 2nd half |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for setting in ORDER:
        rs = runs.get((task, setting))
        if not rs:
            continue
        lm, ls = mean_sd([r["val_loss"] for r in rs])
        am, as_ = mean_sd([r["val_accuracy"] for r in rs])
        gap, tail = (_pct_or_dash(*paired_gap(task, setting, runs, measure)) for measure in (_final, tail_mean))
        ratio = statistics.fmean(r["ratio_second_half"] for r in rs)
        seeds = ",".join(str(r["seed"]) for r in sorted(rs, key=lambda r: r["seed"]))
        lines.append(f"| {rs[0]['label']} | {rs[0]['feedback'] or '-'} | {seeds} | {lm:.4f} +- {ls:.4f} | "
                     f"{am:.3f} +- {as_:.3f} | {gap} | +-{spread:.2f}% | {tail} | {ratio:.0f}x |")
    return lines


def spread(losses: List[float]) -> float:
    """Standard deviation over seeds relative to the mean, in % (NaN with fewer than 2 seeds)."""
    return statistics.stdev(losses) / statistics.fmean(losses) * 100 if len(losses) > 1 else float("nan")


def _final(run: dict) -> float:
    return run["val_loss"]


def _pct_or_dash(gap: float, seeds: int) -> str:
    return f"{gap:+.2f}%" if seeds else "-"


def paired_gap(task: str, setting: str, runs: Dict[Tuple[str, str], List[dict]],
               measure: Callable[[dict], float] = _final) -> Tuple[float, int]:
    """(mean over seeds of each seed's held-out loss against the uncompressed run of the same
    seed, in %; how many seeds had both). ``measure``: which held-out loss of a run (the last
    step's by default, :func:`tail_mean` for the last quarter's)."""
    base = {r["seed"]: measure(r) for r in runs.get((task, "none"), [])}
    gaps = [(measure(r) / base[r["seed"]] - 1) * 100 for r in runs.get((task, setting), []) if r["seed"] in base]
    return (statistics.fmean(gaps) if gaps else float("nan")), len(gaps)


def targets(tasks: List[str], runs: Dict[Tuple[str, str], List[dict]]) -> List[str]:
    """The issue's targets against the library's default rows (``feedback="auto"``)."""
    lines = ["## Against the targets", "",
             "Targets: TopKQSGD(1%, 8) within 1% of uncompressed held-out loss, TopKQSGD(0.1%, 8) within 2%, "
             ">= 100x fewer bytes than fp32 over the second half (50x where small tensors go uncompressed). "
             "A negative gap means the compressed run ended *below* uncompressed.", "",
             "| task | TopKQSGD(1%, 8) default: gap (seeds) | policy | bytes ratio | uncompressed seed spread | "
             "TopKQSGD(1%, 8) classic EF: gap | TopKQSGD(1%, 8) residual not following the rate: gap | "
             "TopKQSGD(1%, 8) previous default (Adam's momentum kept under a schedule, sparsity warm-up): gap | "
             "TopKQSGD(0.1%, 8): gap | TopKQSGD(0.1%, 8) 100-step sparsity warm-up: gap | met? |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for task in tasks:
        if not runs.get((task, "tq1")):
            continue  # not run (yet)
        g1, n1 = paired_gap(task, "tq1", runs)
        gc_, _ = paired_gap(task, "tq1-classic", runs)
        gfix, _ = paired_gap(task, "tq1-fixedlr", runs)
        gprev, _ = paired_gap(task, "tq1-prev", runs)   # "-" where it did not run (momentum SGD)
        g01, _ = paired_gap(task, "tq01", runs)
        g01w, _ = paired_gap(task, "tq01-spw100", runs)
        rs = runs.get((task, "tq1"), [])
        ratio = statistics.fmean(r["ratio_second_half"] for r in rs) if rs else float("nan")
        pol = rs[0]["feedback"] if rs else "-"
        sd = spread([r["val_loss"] for r in runs.get((task, "none"), [])])
        met = "yes" if g1 <= 1 and g01 <= 2 and ratio >= 50 else "no"
        lines.append(f"| {task} | {pct(g1)} ({n1}) | {pol} | {ratio:.0f}x | +-{sd:.2f}% | {pct(gc_)} | "
                     f"{pct(gfix)} | {pct(gprev)} | {pct(g01)} | {pct(g01w)} | {met} |")
    return lines + [""]


def gap_pairs(runs: Dict[Tuple[str, str], List[dict]], now: str, before: str) -> str:
    """Each task that ran ``before``: its gap (mean over seeds, paired with uncompressed) with ``now``
    against with ``before``, and the seed counts.

    >>> runs = {("t", "none"): [{"seed": 0, "val_loss": 2.0}], ("t", "a"): [{"seed": 0, "val_loss": 2.02}],
    ...         ("t", "b"): [{"seed": 0, "val_loss": 2.2}]}
    >>> gap_pairs(runs, "a", "b")
    '*t* +1.00% against +10.00% (seeds 1/1)'
    """
    out = []
    for task in sorted({t for t, s in runs if s == before}):
        g, n = paired_gap(task, now, runs)
        p, m = paired_gap(task, before, runs)
        out.append(f"*{task}* {pct(g)} against {pct(p)} (seeds {n}/{m})")
    return "; ".join(out)


def scale_bullet(runs: Dict[Tuple[str, str], List[dict]]) -> str:
    """The findings bullet on the frozen v following shrinking gradients, with the gaps of the tasks
    that ran it both ways (*v frozen for good* rows), from the results."""
    return ("* **The frozen second moment follows shrinking gradients, under a schedule too.** The CNN with "
            "Adam ended above the 1% target on every seed with v frozen for good after step 100 (the default "
            "then, under a schedule): its gradients' mean square keeps falling long after the freeze, so every "
            "later step was shorter than Adam's, and error feedback only delays movement, it cannot make a "
            "short step longer. Now each rank averages its own gradient's mean square over v's 50-step window "
            "at any rate, and while that average is below its value at the freeze divides what it sends by "
            "sqrt(s_t / s_freeze) more (`FrozenVariance(follow_scale=\"down\")`); where gradients grow, v stays "
            "frozen (following them up too, `follow_scale=\"both\"`, ended further from uncompressed training on "
            "the freeze check's model, benchmarks/results/FREEZE_CHECK.md). The gap to uncompressed training, default against "
            "v frozen for good (*v frozen for good* rows): TopKQSGD(1%, 8): " + gap_pairs(runs, "tq1", "tq1-vfrozen")
            + ".")


def previous_default_bullet(runs: Dict[Tuple[str, str], List[dict]]) -> str:
    """The findings bullet on ``FrozenVariance``'s defaults, with each Adam task's gaps (mean over
    seeds, paired with uncompressed) now and with the previous defaults, at 1% and 0.1%, from the results."""
    return ("* **Adam's momentum and the sparsity warm-up dropped after the freeze.** On a model with the "
            "quirks real ones have (a layer applied twice, a frozen layer, a layer used every other step; "
            "benchmarks/results/FREEZE_CHECK.md, `study.py --config freeze`), `frozen` with its previous defaults made "
            "the held-out loss jump after the freeze and swing to the end, with Adam and AdamW under cosine, "
            "linear and one-cycle schedules; with each rank's gradient sent from the first compressed step at "
            "the full ratio it ended near uncompressed training in every configuration there. So that is the "
            "default now (`FrozenVariance(momentum=False, sparsity_warmup=0)`; below ratio 1%, see the last point). The gap to uncompressed "
            "training, default against previous default (*previous default* rows; the seed spreads are in "
            "the targets table): TopKQSGD(1%, 8): " + gap_pairs(runs, "tq1", "tq1-prev") + ". TopKQSGD(0.1%, 8): "
            + gap_pairs(runs, "tq01", "tq01-prev") + ".")


def low_ratio_bullet(runs: Dict[Tuple[str, str], List[dict]]) -> str:
    """The findings bullet on ``frozen``'s sparsity warm-up below ratio 1%, with each Adam task's
    TopKQSGD(0.1%, 8) gap with it (the default) and without (*no sparsity warm-up after the freeze*
    rows), from the results."""
    return ("* **Below ratio 1%, a sparsity warm-up after the freeze, with Adam's momentum while it is "
            "dense.** At 0.1% a coordinate is sent at most about once in these runs "
            "(benchmarks/results/STUDY_RUN_LENGTH.md), and TopKQSGD(0.1%, 8) without a warm-up trailed uncompressed "
            "training on the transformer at a constant rate. A warm-up from 25% after the freeze sends "
            "most coordinates early, but each rank's gradient over the frozen v, sent at a 25% share, "
            "made the freeze check's model jump (benchmarks/results/FREEZE_CHECK_01.md): nothing averages its noise at "
            "that share, as Adam's momentum does. So `feedback=\"auto\"` now gives Adam and AdamW below 1% "
            "`FrozenVariance(sparsity_warmup=100, momentum=\"while dense\")`: each rank sends Adam's "
            "momentum while the share is above 1 - b1 (a coordinate then goes out more often than the "
            "momentum's span), its gradient after. At 1% nothing changed. The gap to uncompressed "
            "training, TopKQSGD(0.1%, 8) default against without the warm-up: "
            + gap_pairs(runs, "tq01", "tq01-nowarm") + ".")


def pct(v: float) -> str:
    """A gap in %, signed; "-" for NaN (not run).

    >>> pct(1.234), pct(float("nan"))
    ('+1.23%', '-')
    """
    return "-" if v != v else f"{v:+.2f}%"


def plot(task: str, runs: Dict[Tuple[str, str], List[dict]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for setting in ORDER:
        rs = runs.get((task, setting))
        if not rs:
            continue
        curves = [{e["step"]: e["val_loss"] for e in r["evals"]} for r in rs]
        steps = sorted(set.intersection(*(set(c) for c in curves)))[1:]
        ax.plot(steps, [statistics.fmean(c[s] for c in curves) for s in steps], label=rs[0]["label"],
                lw=2.2 if setting in ("none", "tq1") else 1.2, ls="--" if setting == "tq1-classic" else "-")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("held-out loss (mean over seeds)")
    ax.set_yscale("log")
    ax.set_title(task)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def render(out: Path, docs: Path, command: str, minutes: float) -> str:
    """benchmarks/results/STUDY.md from the results under ``out`` (``command`` made them, ``minutes`` this invocation
    took); its plots go into ``benchmarks/results/img``."""
    runs = load(out)
    tasks = [t for t in TASK_TEXT if any(k[0] == t for k in runs)]
    n_runs = sum(len(v) for v in runs.values())
    plan = out / "plan.json"
    planned = len(json.loads(plan.read_text())) if plan.exists() else n_runs
    wall = sum(r["wall_s"] for v in runs.values() for r in v) / 60
    try:
        import horovod
        import torch
        versions = f"PyTorch {torch.__version__}, Horovod {horovod.__version__}"
    except ImportError:
        versions = ""
    lines = [
        "# Convergence study: compressed against uncompressed training",
        "",
        f"Generated by `{command}` (`make study`) on {datetime.date.today()}: {n_runs} runs, "
        f"{wall:.0f} minutes of training (this invocation: {minutes:.0f} minutes). Every number and plot on this "
        f"page comes from the JSON results in `{shown(out)}/` (`make study` writes `runs/study/`; a copy of "
        "this page's results is kept in `benchmarks/results/data/study/`); rerun the command to regenerate it. "
        f"2 ranks (Gloo) on one machine, Python {platform.python_version()}, {versions}, 1 thread per rank. "
        f"Planned: {planned} runs; finished: {n_runs}. Each row lists the seeds it has.",
        "",
        versions_line(runs),
        "",
        "Every compressed row uses the library as the README shows it: `compression=...` in the "
        "DistributedOptimizer, nothing else. The column *feedback (auto)* is the error-feedback policy the "
        "library chose from the wrapped optimizer (`feedback=\"auto\"`, see `hvd_gradcomp/feedback/__init__.py`); "
        "the *classic EF* rows force `feedback=\"classic\"` (error feedback on gradients: the recipe "
        "before issue 9) and, with Adam and AdamW, the *compress the update* rows force `feedback=\"update\"` "
        "(the default before `frozen`), the *previous default* rows run `FrozenVariance` with its defaults "
        "before they changed (`momentum=None`: each tensor sends Adam's momentum while its rate changes and its "
        "gradient once the rate has stayed the same for 50 steps; `sparsity_warmup=100`; see "
        "benchmarks/results/FREEZE_CHECK.md): they are the runs of the default rows from before the change. The *sparsity "
        "warm-up after the freeze* rows put that warm-up back on the default (`FrozenVariance(sparsity_warmup=100)`), "
        "and the *Adam's momentum kept* rows keep Adam's first moment on every tensor as well "
        "(`FrozenVariance(momentum=True, sparsity_warmup=100)`); "
        "and the *residual not following the rate* rows keep the policy `auto` chose "
        "but hold each residual at the learning rate it was computed at (`follow_lr = False`, the recipe before "
        "residuals followed the schedule), and the *100-step sparsity warm-up* rows give TopKQSGD(0.1%, 8) the "
        "warm-up of 100 steps it had before the warm-up lasted longer below ratio 1% "
        "(`hvd_gradcomp.codecs.compressor.sparsity_warmup_steps`), as a `ratio=SparsityWarmup(0.001, steps=100)` "
        "schedule, so the gain is visible; with momentum SGD the *172-step sparsity warm-up* rows give it the "
        "172 steps it had next (the pace of 1%, as `frozen` still has), before `momentum`'s warm-up lasted "
        "`sqrt(1% / ratio)` times its 100 steps (317 at 0.1%). On the char-MLP, the *output layer at 1%* row keeps that layer "
        "(`out.weight`, 65,536 values: 66 a step at 0.1%) at 1% while the rest send 0.1% "
        "(`min_ratio={r\"^out\\.\": 0.01}`, a setting of the user's; the other tasks' output layers, of 1,280 to "
        "8,192 values, already send `min_k` = 32 values a step at 0.1%, 0.4% to 2.5% of them). On the CNN "
        "with Adam, the *second moment frozen after 200 steps* rows end Adam's dense warm-up after a third of "
        "the run instead of the default 100 steps (`FrozenVariance(warmup=200)`, the user's option the start-up "
        "message points to for long runs; the second half of the run is compressed either way), and the "
        "*v frozen for good* rows keep Adam's second moment as frozen, never following the gradients' scale "
        "(`FrozenVariance(follow_scale=None)`: under a schedule, the default before it followed shrinking "
        "gradients, bit for bit). A row not rerun after a change of the default it builds on keeps its older "
        "runs (the versions line below counts the runs per commit). "
        "fp16 and TopK 1% ran on the first seed only, "
        "to fit the study in about an hour.",
        "",
        "Columns: held-out loss and accuracy are mean +- standard deviation over the seeds listed, at the last "
        "step; *gap* is the held-out loss relative to the uncompressed run of the same seed, averaged over "
        "seeds; "
        "*uncompressed seed spread* is the uncompressed standard deviation over seeds relative to its mean "
        "(a gap inside it is noise); *gap, last-quarter mean* is the same paired gap of each run's held-out "
        "loss averaged over the evaluations of its last quarter of steps (less noisy than the last step where "
        "the loss still swings from one evaluation to the next, as at a constant rate; the targets are read "
        "from *gap*); *bytes ratio* is fp32 gradient bytes over the bytes each rank handed to "
        "Horovod, in the second half of the run.",
        "",
    ]
    lines += targets(tasks, runs)
    for task in tasks:
        base = runs.get((task, "none"), [])
        lines += [f"## {task}", "", TASK_TEXT[task] + ".", ""]
        if base:
            r0 = base[0]
            lines += [f"{r0['steps']} optimizer steps. Uncompressed held-out loss changed by "
                      f"{last_quarter_change(base):.2f}% over the last quarter of the run (seed mean).", ""]
        lines += table(task, runs) + ["", f"![held-out loss, {task}](img/study_{task}.png)", ""]
        plot(task, runs, docs / "img" / f"study_{task}.png")
    lines += choice_section(docs, runs)
    return "\n".join(lines) + "\n"


def versions_line(runs: Dict[Tuple[str, str], List[dict]]) -> str:
    """Which code versions (commits) produced the runs: reruns after a change keep the rest.

    >>> versions_line({("t", "a"): [{"code": "abc"}, {}], ("t", "b"): [{"code": "abc"}]})
    'Code versions of the runs (`git describe` of the checkout): abc: 2 runs; before the version was recorded: 1 run.'
    """
    counts = Counter(r.get("code") for v in runs.values() for r in v)
    parts = [f"{c}: {n} run{'s' if n != 1 else ''}" for c, n in sorted(counts.items(), key=lambda kv: -kv[1])
             if c is not None]
    if counts.get(None):
        parts.append(f"before the version was recorded: {counts[None]} run{'s' if counts[None] != 1 else ''}")
    return "Code versions of the runs (`git describe` of the checkout): " + "; ".join(parts) + "."


def shown(path: Path) -> str:
    """``path`` relative to the checkout when inside it (for the page), else as given."""
    try:
        return str(path.resolve().relative_to(Path(__file__).resolve().parents[2]))
    except ValueError:
        return str(path)


def choice_section(docs: Path, runs: Dict[Tuple[str, str], List[dict]]) -> List[str]:
    """How the policies were chosen: the simulator's figures (benchmarks/results/data/study_simulator.txt), and a
    bullet on FrozenVariance's defaults with the gaps read from ``runs``."""
    sim = docs / "data" / "study_simulator.txt"
    lines = [
        "## How the recipe was chosen",
        "",
        "Candidates were first compared with `benchmarks/study/simulate.py`: 2 ranks simulated in one "
        "process (each batch split in two shards, per-rank policy state, the library's own codecs), "
        "TopKQSGD(1%, 8), 300 steps unless said. Its raw output is below. What it showed:",
        "",
        "* **Adam/AdamW, first attempt.** Error feedback on gradients hands Adam, for each coordinate, zero "
        "for ~1/ratio steps and then the accumulated sum; Adam normalises that spike into one step, so "
        "coordinates move about sqrt(ratio) times as far as without compression. Every gradient-level "
        "variant tried kept a large gap (EF21, EF21 with momentum, spreading or holding each arrival as a "
        "rate). Compressing the optimizer's *update* (`feedback=\"update\"`: each rank runs Adam on its own "
        "gradient, the parameter change goes through error feedback) halved the gap, but at ratio 1 "
        "(nothing dropped) it was still +18% on the CNN: each rank's second moment comes from half the batch, "
        "so every step is too short.",
        "* **Adam/AdamW, the default now** (`feedback=\"frozen\"`, 1-bit Adam's recipe): exact Adam, dense, "
        "for the first 100 steps of each tensor (longer while the learning rate still rises, at most 1000 "
        "steps: only teacher-mlp's 720-step ramp outlasts 100 steps here); then Adam's second moment "
        "(identical on every rank) is "
        "frozen, which makes Adam linear in the gradient, and each rank's update direction (its momentum "
        "divided by the frozen sqrt(v)) goes through top-k and error feedback, like DGC's momentum "
        "correction. In the simulator (`frozen` lines below; `--warm` is the dense share of the steps) "
        "freezing alone cost nothing on the transformer (ratio 1: 2.1967 against 2.2170 uncompressed) and "
        "the CNN ended below uncompressed; what remains at 1% on the transformer is the lag of sparse "
        "exchanges. Selecting on the direction rather than on the momentum (`frozenw` against `frozen`) "
        "took that from +2.8% to +1.6% (one seed, 300 steps) and helped the CNN on both seeds. A floor on "
        "sqrt(v) (0.1 x its tensor mean) keeps coordinates that had no gradient in the warm-up from "
        "taking lr/eps steps (without it the CNN diverged).",
        "* **Momentum SGD.** In the simulator classic error feedback on gradients was better than DGC momentum "
        "correction on the CNN (with masking much worse); the char-level example had measured the opposite "
        "for correction without masking (benchmarks/results/BENCHMARKS.md), and so did real 2-rank runs of this study's "
        "cnn-sgd task. `auto` picks `momentum` (no masking) for momentum SGD.",
        "* **Momentum SGD at a constant rate.** *cnn-sgd-const* and *char-mlp-const* are the study's two "
        "momentum-SGD tasks without their schedules (6 seeds each), with classic error feedback beside the "
        "default (the *classic EF* rows). On the char-MLP momentum correction meets both targets and classic "
        "error feedback ends further from uncompressed training, on every seed. On the CNN, both end inside "
        "that task's seed spread, which is ten times the 1% target (the targets table); its compressed runs, "
        "and those of *cnn-sgd*, were rerun at the commit named above after the earlier ones turned out to come "
        "from working copies that were never committed (*cnn-sgd*'s seed 0 at 9a463a1, a commit of that time, "
        "ends exactly as it ends now). Neither has flattened by the issue's measure: at a constant rate "
        "the char-MLP's held-out loss still falls at the end and the CNN's rises again (it over-fits the "
        "digits). Outside the study, the MLP on the digits of benchmarks/results/SMALL_MLP_CHECK.md at momentum SGD's rate "
        "0.05 is where the default trails uncompressed training by more than the seed spread, and there "
        "classic error feedback ends closer (its section *Digits MLP, 1200 steps, momentum SGD: which "
        "feedback*); on the teacher MLP at the same rate classic error feedback ends further at the last "
        "step and alike over the last evaluations (*Momentum SGD at a constant rate: which feedback*). No "
        "rule separates the digits MLP from the other three, so `auto` keeps momentum correction at every "
        "rate.",
        "* **Sparsity warm-up** helped classic SGD and the frozen-variance recipe on the transformer "
        "(+2.5% against +3.95%, one seed). Rerun over 3 seeds at the study's length (`SPW=...` lines below: "
        "400 steps, dense for the first 100, then the share sent falls from 25% to 1% over the next 40 or "
        "100 steps): the transformer's gap went from +2.86% (mean of 3 seeds, no warm-up) to +2.04% (40 "
        "steps) and +1.61% (100 steps); on the CNN with Adam (2 seeds) the change was inside its seed noise. So "
        "`frozen` did it by default after its dense warm-up, until the model of benchmarks/results/FREEZE_CHECK.md jumped "
        "after the freeze with it (next point): now it is an option there (`FrozenVariance(sparsity_warmup=100)`, "
        "the *sparsity warm-up after the freeze* rows). `momentum` does it from its first step (the *no "
        "sparsity warm-up* rows); for classic error "
        "feedback it stays an option (`ratio=SparsityWarmup(...)`). Below ratio 1% the warm-up lasts longer: "
        "`frozen`'s, when asked for, at the pace it has at 1% (172 steps at 0.1%), after its 100 dense steps; `momentum`'s, "
        "which has no dense steps before it, `sqrt(1% / ratio)` times as long (317 steps at 0.1%; the "
        "*172-step sparsity warm-up* rows are the pace of 1%).",
        "* **Low-bit QSGD.** Error feedback on 4/2-bit QSGD diverged or needed its payloads shrunk; plain "
        "(unbiased) QSGD trained: `auto` turns error feedback off below 8 bits.",
        "* **Residuals follow the learning rate.** Every task here decays its rate (cosine), so "
        "what error feedback held back at a high rate arrived later at a lower one, shortened, and what was "
        "still held at the end never arrived. Now a residual is rescaled by old/new rate whenever the "
        "scheduler changes it (EF-SGD's formulation, which accumulates `lr * g`): the held-back movement is "
        "kept whole. The column *residual not following the rate* of the targets table is the same default "
        "policy without it (`follow_lr = False`).",
        "* **At a constant rate, the frozen second moment follows the gradients' scale.** Every task above "
        "except *transformer-const* decays its rate to zero; a small MLP trained at a constant rate "
        "(benchmarks/results/SMALL_MLP_CHECK.md) showed what the decay had hidden: where gradients keep shrinking (a "
        "classifier driving its loss towards zero) a v frozen for good makes each later step shorter than "
        "Adam's, and TopKQSGD(1%, 8) ended far above uncompressed training there (the page's section on the "
        "frozen v before this change). While the rate stays constant, each rank now keeps the b2-average of "
        "its own gradient's mean square from its first step on and divides what it sends by "
        "sqrt(s_t / s_freeze) more (`FrozenVariance`): one number per tensor, so v keeps its frozen shape "
        "and no byte is added; each rank scales only what it sends, so the average every rank applies stays "
        "identical. Under a schedule that changes the rate from the first step v then stayed frozen for "
        "good: with the rate decayed, following the scale that way (Adam's slow average, both ways) ended "
        "further from uncompressed training on that MLP (a trial of the page's `--cosine` command). The "
        "last point below follows it under a schedule too, over v's 50-step window, where gradients shrink. "
        "* **At a constant rate, error feedback's residual takes the place of Adam's first moment.** "
        "*transformer-const* is the study's transformer at a constant rate. With each rank's momentum sent "
        "through error feedback (*Adam's momentum kept*, the default before this rule) TopKQSGD(1%, 8) trailed "
        "uncompressed training there, at every length tried (benchmarks/results/STUDY_RUN_LENGTH.md); with nothing dropped "
        "(TopK(ratio=1)) the gap had been within the 1% target, and five times the bytes (TopKQSGD(5%, 8)) "
        "closed only part of it: the gap came with dropping values. Most of each gradient's share of the "
        "momentum enters the residual after its coordinate was sent (0.9 of it over the next steps, at "
        "b1 = 0.9) and waits there for the next send, about 1/ratio steps later; a decaying rate shortens "
        "that late movement, a constant one does not. Now a tensor whose rate has stayed the same for 50 "
        "steps sends its gradient divided by the frozen v instead (`FrozenVariance(momentum=None)`, the "
        "default until every tensor dropped the momentum: next point): the "
        "residual sums each coordinate's gradients until they are sent, as the momentum averaged them, and "
        "no share of a gradient arrives after its coordinate's next send. Under a schedule the momentum "
        "stayed. "
        "*cnn-adam-const*, the CNN with Adam at a constant rate (through stock `hvd.DistributedOptimizer`, "
        "6 seeds), ended above uncompressed training either way while the frozen v followed the gradients' "
        "scale as Adam averages it, over ~1000 steps: too slowly for gradients that shrink as fast as its do "
        "(the last point below; its *Adam's momentum kept* and *previous default* rows are runs of that time).",
        previous_default_bullet(runs),
        scale_bullet(runs),
        low_ratio_bullet(runs),
        "",
    ]
    if sim.exists():
        lines += ["```", sim.read_text().rstrip(), "```", ""]
    return lines
