"""The DDP half of ``make bench``: torch's own hooks against hvd-gradcomp's, under ``torchrun``.

Two parts, each a list of 2-rank ``torchrun`` jobs (:func:`hvd_gradcomp.launchers.jobs.run_job`), written to
their own page, ``DOCS_DIR/ddp/BENCHMARKS.md`` (raw figures in ``DOCS_DIR/ddp/data.json``):

1. Speed: ``benchmarks/bench_ddp.py`` on the synthetic model of the Horovod rows (25M
   parameters), one job per setting, inside the same rate-limited network namespace as the
   Horovod rows (:func:`benchmarks.netns.rate_limited_netns`) at every ``--rates`` value:
   DDP uncompressed, torch's fp16 hook, PowerSGD rank 1 and 4, our PowerSGD rank 4, our TopKQSGD(1%, 8),
   our QSGD-8. ``--ddp-settings KEYS`` runs only those rows and merges them into the saved figures,
   keeping the other rows; each merged row names the command, date and load average it ran under.
2. Convergence: ``examples/train_ddp.py`` on the real-data example (character model on the
   standard library's sources) for several seeds: DDP uncompressed, PowerSGD rank 1 and 4,
   TopKQSGD(1%, 8), QSGD-8; held-out loss, paired gap against the same seed uncompressed,
   uncompressed seed spread beside every gap. Not timed (runs anywhere, even a busy machine).

Running one part keeps the other part's last figures on the page (each part says which
command and date it comes from). Targets are the named constants below; the page's verdicts
are computed from the figures (:func:`target_lines`).

``python -m benchmarks --only-ddp`` runs both; ``--skip-speed``/``--skip-convergence`` pick one,
``--skip-ddp`` leaves the DDP half out of ``make bench``.
"""
from __future__ import annotations

import datetime
import json
import os
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from hvd_gradcomp.launchers.command import LaunchSpec, build_command
from hvd_gradcomp.launchers.jobs import BIN

from .netns import LINK_MODES, TBF, in_netns, netns_setup_commands, netns_teardown_command
from .plan import ROOT, TARGET_LOSS_GAP, Plan, Setting, speed_path

BENCH_DDP = ROOT / "benchmarks" / "bench_ddp.py"
TRAIN_DDP = ROOT / "examples" / "train_ddp.py"

# Targets (issue 12), each checked against the figure named beside it at 1gbit (else the first rate).
TARGET_DDP_SPEEDUP = 3.0            # TopKQSGD(1%, 8) step time vs DDP uncompressed: at least this many x
TARGET_DDP_VS_POWERSGD = 1.0        # ... vs PowerSGD at its documented default (rank 1): more than this (faster)
TARGET_DDP_LOSS_GAP = TARGET_LOSS_GAP  # TopKQSGD(1%, 8) mean paired held-out loss gap: within this
POWERSGD_DEFAULT = "powersgd-1"     # PowerSGDState's matrix_approximation_rank defaults to 1
SETTLED = 0.02  # uncompressed held-out loss moving less than this over the last quarter: settled (as benchmarks/results/STUDY.md)

SPEED_SETTINGS = (
    Setting("ddp", "DDP, uncompressed", ()),
    Setting("fp16", "DDP + torch fp16 hook", ()),
    Setting("powersgd-1", "DDP + PowerSGD rank 1", ()),
    Setting("powersgd-4", "DDP + PowerSGD rank 4", ()),
    Setting("gc-powersgd-4", "DDP + hvd-gradcomp PowerSGD rank 4", (), True),
    Setting("topkqsgd", "DDP + TopKQSGD(1%, 8)", (), True),
    Setting("qsgd8", "DDP + QSGD 8-bit", (), True),
    Setting("auto", "DDP + Auto", (), True),  # gc.Auto() in the hook; its start runs in bench_ddp's own warm-up
)
TOPKQSGD = ("--compression", "topk-qsgd", "--ratio", "0.01", "--bits", "8")
CONVERGENCE_SETTINGS = (
    Setting("none", "DDP, uncompressed", ("--compression", "none")),
    Setting("powersgd-1", "DDP + PowerSGD rank 1", ("--compression", "none", "--powersgd-rank", "1"), True),
    Setting("powersgd-4", "DDP + PowerSGD rank 4", ("--compression", "none", "--powersgd-rank", "4"), True),
    # register(..., optimizer=opt): feedback "auto" is DGC momentum correction for train_ddp's momentum SGD
    Setting("topkqsgd", "DDP + TopKQSGD(1%, 8)", TOPKQSGD, True),
    Setting("topkqsgd-classic", "DDP + TopKQSGD(1%, 8), classic EF", (*TOPKQSGD, "--feedback", "classic"), True),
    Setting("qsgd8", "DDP + QSGD 8-bit", ("--compression", "qsgd", "--bits", "8"), True),
)
LABELS = {s.key: s.label for s in SPEED_SETTINGS + CONVERGENCE_SETTINGS}
# The real-data run: one epoch of the text is ~880 steps of 2 x 32 windows, so 800 steps see no window
# twice; the cosine decay lets the held-out loss settle by the end (the page states how much it still moves).
CONVERGENCE = {"steps": 800, "lr": 0.1, "seeds": 3, "evals": 8}
QUICK_CONVERGENCE = {"steps": 40, "lr": 0.1, "seeds": 1, "evals": 2}
QUICK_SETTINGS = ("ddp", "powersgd-1", "topkqsgd", "none")


@dataclass
class DdpPlan:
    """What the DDP half runs; ``base`` is the Horovod plan (rates, model size, iterations, dirs, timeout)."""

    base: Plan
    speed: List[Setting]
    convergence: List[Setting]
    steps: int
    lr: float
    seeds: List[int]
    eval_every: int
    merge: bool = False   # speed rows of a chosen subset (--ddp-settings): merged into the saved figures
    docs_dir: Path = field(init=False)
    runs_dir: Path = field(init=False)

    def __post_init__(self) -> None:
        self.docs_dir = self.base.docs_dir / "ddp"
        self.runs_dir = self.base.runs_dir / "ddp"

    @property
    def jobs(self) -> int:
        return len(self.base.rates) * len(self.speed) + len(self.seeds) * len(self.convergence)


def build_ddp_plan(base: Plan, quick: bool, skip_speed: bool, skip_convergence: bool,
                   steps: Optional[int] = None, seeds: Optional[int] = None,
                   only: Sequence[str] = ()) -> DdpPlan:
    """The DDP half for the Horovod plan ``base`` (same rates, model size, iterations and seed);
    ``only``: just these speed rows, to be merged into the saved ones (``--ddp-settings``).

    >>> from benchmarks.plan import build_plan
    >>> p = build_ddp_plan(build_plan(True, None, None, None, None, None, 5, False, False, None, 300, "auto"),
    ...                    True, False, False)
    >>> [s.key for s in p.speed], [s.key for s in p.convergence], p.seeds, p.steps, p.jobs
    (['ddp', 'powersgd-1', 'topkqsgd'], ['none', 'powersgd-1', 'topkqsgd'], [5], 40, 6)
    >>> p = build_ddp_plan(p.base, False, False, True, only=["powersgd-4", "gc-powersgd-4"])
    >>> [s.key for s in p.speed], p.merge
    (['powersgd-4', 'gc-powersgd-4'], True)
    """
    conf = QUICK_CONVERGENCE if quick else CONVERGENCE
    unknown = sorted(set(only) - {s.key for s in SPEED_SETTINGS})
    if unknown:
        raise ValueError(f"unknown DDP speed settings {unknown}; choose from {', '.join(s.key for s in SPEED_SETTINGS)}")
    pick = (lambda s: s.key in only) if only else (lambda s: s.key in QUICK_SETTINGS) if quick else (lambda s: True)
    steps = steps or conf["steps"]
    return DdpPlan(base=base, speed=[] if skip_speed else [s for s in SPEED_SETTINGS if pick(s)],
                   convergence=[] if skip_convergence else [s for s in CONVERGENCE_SETTINGS if pick(s)],
                   steps=steps, lr=conf["lr"], seeds=[base.seed + i for i in range(seeds or conf["seeds"])],
                   eval_every=max(1, steps // conf["evals"]), merge=bool(only))


# ---------------------------------------------------------------- command lines (pure)
def torchrun(program: Sequence[str], np: int = 2, bin_dir: Path = BIN) -> List[str]:
    """``torchrun --standalone --nproc-per-node NP --no-python PROGRAM`` of this environment, built
    like ``hvdgc-launch --torchrun`` builds it.

    >>> torchrun(["python", "t.py"], bin_dir=Path("/v/bin"))
    ['/v/bin/torchrun', '--standalone', '--nproc-per-node', '2', '--no-python', 'python', 't.py']
    """
    argv, _ = build_command(LaunchSpec(command=tuple(program), np=np, launcher="torchrun"))
    return [str(bin_dir / argv[0]), *argv[1:]]


def speed_program(plan: DdpPlan, setting: Setting, out_json: Path) -> List[str]:
    """bench_ddp.py for one setting, sized like the Horovod rows."""
    b = plan.base
    return [sys.executable, str(BENCH_DDP), "--settings", setting.key, "--params", f"{b.params:g}",
            "--batch-size", str(b.batch_size), "--warmup", str(max(2, b.warmup)), "--iters", str(b.iters),
            *(["--min-seconds", f"{b.min_seconds:g}"] if b.min_seconds else []), "--json", str(out_json)]


def convergence_program(plan: DdpPlan, setting: Setting, seed: int, out_json: Path) -> List[str]:
    """train_ddp.py for one setting and seed (same steps, lr schedule and evaluations for all)."""
    return [sys.executable, str(TRAIN_DDP), "--steps", str(plan.steps), "--lr", f"{plan.lr:g}", "--cosine",
            "--seed", str(seed), "--eval-every", str(plan.eval_every), "--log-every", str(plan.steps),
            "--out", str(out_json), *setting.flags]


def speed_json(plan: DdpPlan, rate: str, setting: Setting) -> Path:
    return speed_path(plan.runs_dir, rate, setting)


def convergence_json(plan: DdpPlan, setting: Setting, seed: int) -> Path:
    return plan.runs_dir / "convergence" / f"{setting.key}-seed{seed}.json"


def planned_commands(plan: DdpPlan) -> List[str]:
    """Every command of the DDP half, shell-quoted (``--dry-run``)."""
    lines = []
    for rate in plan.base.rates if plan.speed else []:
        lines += [shlex.join(c) for c in netns_setup_commands("NS", rate)]
        lines += [shlex.join(in_netns("NS", torchrun(speed_program(plan, s, speed_json(plan, rate, s)))))
                  for s in plan.speed]
        lines.append(shlex.join(netns_teardown_command("NS")))
    for seed in plan.seeds if plan.convergence else []:
        lines += [shlex.join(torchrun(convergence_program(plan, s, seed, convergence_json(plan, s, seed))))
                  for s in plan.convergence]
    return lines


# ---------------------------------------------------------------- running
def run(plan: DdpPlan, say: Callable[[str], None], bar: Any) -> Dict[str, Any]:
    """Both parts as planned: {"speed": {rate: block} or None, "convergence": {...} or None}."""
    from .runner import JobFailed, run_logged

    def job(argv: List[str], out: Path, what: str) -> Tuple[Optional[Dict[str, Any]], Optional[str]]:
        bar.set_description(what)
        try:
            run_logged(argv, plan.base, out.with_suffix(".log"))
            return json.loads(out.read_text()), None
        except (JobFailed, OSError, ValueError) as exc:
            say(f"{what}: FAILED {exc}")
            return None, str(exc)
        finally:
            bar.update(1)

    speed = _run_speed(plan, say, job) if plan.speed else None
    conv = _run_convergence(plan, say, job) if plan.convergence else None
    return {"speed": speed, "convergence": conv}


def _run_speed(plan: DdpPlan, say: Callable[[str], None], job: Callable) -> Dict[str, Any]:
    from .netns import rate_limited_netns

    start, rates = time.perf_counter(), {}
    for rate in plan.base.rates:
        results, failures = {}, {}
        with rate_limited_netns(rate, say) as ns:
            for s in plan.speed:
                out = speed_json(plan, rate, s)
                load = os.getloadavg()   # what else ran: the page states it beside merged rows
                data, err = job(in_netns(ns, torchrun(speed_program(plan, s, out))), out, f"DDP speed {rate} {s.label}")
                if err is not None:
                    failures[s.key] = err
                    continue
                results[s.key] = dict(data["rows"][0], noop_step_s=data["noop_step_s"], load_avg=list(load))
                r = results[s.key]
                say(f"{rate:>7} {s.label:<24} step {r['step_s'] * 1e3:8.1f} ms, comm {100 * r['comm_share']:5.1f}%, "
                    f"{r['bytes_per_step'] / 1e6:8.3f} MB/step")
            mode = "loopback" if ns else "unthrottled"
        rates[rate] = {"mode": mode, "throttled": ns is not None, "results": results, "failures": failures}
    b = plan.base
    return {"rates": rates, "elapsed_s": time.perf_counter() - start,
            "conditions": {"params": b.params, "batch_size": b.batch_size, "warmup": max(2, b.warmup), "iters": b.iters,
                           "min_seconds": b.min_seconds}}


def _run_convergence(plan: DdpPlan, say: Callable[[str], None], job: Callable) -> Dict[str, Any]:
    start = time.perf_counter()
    results: Dict[str, List[Dict[str, Any]]] = {}
    failures: Dict[str, str] = {}
    for seed in plan.seeds:  # seed-major: an interrupted run still has whole seeds
        for s in plan.convergence:
            out = convergence_json(plan, s, seed)
            data, err = job(torchrun(convergence_program(plan, s, seed, out)), out, f"DDP convergence {s.label} seed {seed}")
            if err is not None:
                failures[f"{s.key} seed {seed}"] = err
                continue
            results.setdefault(s.key, []).append(data)
            say(f"DDP convergence {s.label:<24} seed {seed}: held-out loss {data['val_loss']:.4f}")
    return {"results": results, "failures": failures, "elapsed_s": time.perf_counter() - start,
            "conditions": {"steps": plan.steps, "lr": plan.lr, "seeds": plan.seeds, "eval_every": plan.eval_every}}


# ---------------------------------------------------------------- tables (pure)
def speed_rows(results: Dict[str, Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Rows with speedups over DDP uncompressed and over PowerSGD rank 1 and 4 (None without the baseline).

    >>> r = lambda s: {"step_s": s, "comm_share": 0.5, "bytes_per_step": 8.0, "ratio": 1.0}
    >>> rows = speed_rows({"ddp": r(3.0), "powersgd-1": r(1.5), "topkqsgd": r(1.0)})
    >>> [(x["key"], x["speedup"], x["vs_powersgd-1"], x["vs_powersgd-4"]) for x in rows]
    [('ddp', 1.0, 0.5, None), ('powersgd-1', 2.0, 1.0, None), ('topkqsgd', 3.0, 1.5, None)]
    """
    base = {k: (results.get(k) or {}).get("step_s") for k in ("ddp", "powersgd-1", "powersgd-4")}
    rows = []
    for s in SPEED_SETTINGS:
        r = results.get(s.key)
        if r is None:
            continue
        row = {"key": s.key, "label": s.label, "step_s": r["step_s"], "comm_share": r["comm_share"],
               "bytes_per_step": r["bytes_per_step"], "ratio": r["ratio"],
               "speedup": base["ddp"] / r["step_s"] if base["ddp"] else None}
        row.update({f"vs_{k}": base[k] / r["step_s"] if base[k] else None for k in ("powersgd-1", "powersgd-4")})
        rows.append(row)
    return rows


def _x(v: Optional[float]) -> str:
    return "n/a" if v is None else f"{v:.2f}x"


def render_speed_table(rows: List[Dict[str, Any]]) -> str:
    """Markdown table of :func:`speed_rows`.

    >>> print(render_speed_table([{"label": "A", "step_s": 0.5, "comm_share": 0.25, "bytes_per_step": 2e6,
    ...     "ratio": 50.0, "speedup": 3.0, "vs_powersgd-1": None, "vs_powersgd-4": 1.25}]).splitlines()[2])
    | A | 500.0 | 25.0% | 2.000 | 50.0x | 3.00x | n/a | 1.25x |
    """
    lines = ["| setting | step time (ms) | comm share | MB sent per step per rank | ratio | speedup vs DDP "
             "uncompressed | vs PowerSGD rank 1 | vs PowerSGD rank 4 |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['label']} | {r['step_s'] * 1e3:.1f} | {100 * r['comm_share']:.1f}% | "
              f"{r['bytes_per_step'] / 1e6:.3f} | {r['ratio']:.1f}x | {_x(r['speedup'])} | "
              f"{_x(r['vs_powersgd-1'])} | {_x(r['vs_powersgd-4'])} |" for r in rows]
    return "\n".join(lines)


def _mean_sd(xs: Sequence[float]) -> Tuple[float, float]:
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def convergence_rows(results: Dict[str, List[Dict[str, Any]]]) -> List[Dict[str, Any]]:
    """Per setting: held-out loss over seeds, and the gap to the same seed's uncompressed run.

    ``gap`` is the mean over seeds of ``val_loss / uncompressed val_loss - 1`` (paired by seed),
    ``gap_lo``/``gap_hi`` its smallest and largest; ``spread`` is the uncompressed runs' standard
    deviation over their mean: a gap of that size is what another seed alone would give.

    >>> run = lambda seed, loss: {"seed": seed, "val_loss": loss, "bytes_per_step": 10.0, "ratio": 1.0, "wall_s": 1.0}
    >>> rows = convergence_rows({"none": [run(0, 2.0), run(1, 2.2)], "topkqsgd": [run(0, 2.02), run(1, 2.2)]})
    >>> [(r["key"], round(r["gap"], 4), round(r["gap_hi"], 4), round(r["spread"], 4)) for r in rows]
    [('none', 0.0, 0.0, 0.0673), ('topkqsgd', 0.005, 0.01, 0.0673)]
    >>> convergence_rows({"none": [run(0, 2.0)]})[0]["spread"] is None  # one seed: no spread to state
    True
    """
    base = {r["seed"]: r["val_loss"] for r in results.get("none", [])}
    b_mean, b_sd = _mean_sd(list(base.values())) if base else (None, 0.0)
    rows = []
    for s in CONVERGENCE_SETTINGS:
        runs = results.get(s.key)
        if not runs:
            continue
        mean, sd = _mean_sd([r["val_loss"] for r in runs])
        gaps = [r["val_loss"] / base[r["seed"]] - 1 for r in runs if r["seed"] in base]
        rows.append({"key": s.key, "label": s.label, "seeds": sorted(r["seed"] for r in runs),
                     "feedback": runs[0].get("feedback") or "-",
                     "compression": runs[0].get("compression", ""), "val_mean": mean, "val_sd": sd,
                     "gap": statistics.fmean(gaps) if gaps else None, "gap_lo": min(gaps) if gaps else None,
                     "gap_hi": max(gaps) if gaps else None, "spread": b_sd / b_mean if len(base) > 1 else None,
                     "bytes_per_step": statistics.fmean(r["bytes_per_step"] for r in runs),
                     "ratio": statistics.fmean(r["ratio"] for r in runs),
                     "wall_s": statistics.fmean(r["wall_s"] for r in runs)})
    return rows


def _pct(v: Optional[float]) -> str:
    return "n/a" if v is None else f"{100 * v:+.2f}%"


def render_convergence_table(rows: List[Dict[str, Any]]) -> str:
    """Markdown table of :func:`convergence_rows`."""
    lines = ["| setting | feedback | seeds | held-out loss (mean +- sd) | gap vs uncompressed, paired (mean [min, max]) | "
             "uncompressed seed spread | kB sent per step per rank | ratio | wall time (s) |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        gap = "n/a" if r["gap"] is None else f"{_pct(r['gap'])} [{_pct(r['gap_lo'])}, {_pct(r['gap_hi'])}]"
        spread = "n/a (1 seed)" if r["spread"] is None else f"+-{100 * r['spread']:.2f}%"
        lines.append(f"| {r['label']} | {r['feedback']} | {','.join(map(str, r['seeds']))} | {r['val_mean']:.4f} +- {r['val_sd']:.4f} | "
                     f"{gap} | {spread} | {r['bytes_per_step'] / 1e3:.1f} | {r['ratio']:.1f}x | {r['wall_s']:.1f} |")
    return "\n".join(lines)


def settled(runs: List[Dict[str, Any]], fraction: float = 0.25) -> Optional[float]:
    """Relative change of the seed-mean held-out loss over the last ``fraction`` of the steps
    (how flat the curve is at the end; negative: still falling).

    >>> settled([{"val_curve": [[50, 3.0], [75, 2.02], [100, 2.0]]}])
    -0.00990...
    """
    curves = [{int(s): v for s, v in r.get("val_curve", [])} for r in runs]
    steps = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
    if len(steps) < 2:
        return None
    end = steps[-1]
    start = min(steps, key=lambda s: abs(s - (1 - fraction) * end))
    at = lambda s: statistics.fmean(c[s] for c in curves)  # noqa: E731
    return (at(end) - at(start)) / at(start)


def target_lines(data: Dict[str, Any]) -> List[str]:
    """The issue's DDP targets, each MET or MISSED with the measured figure (from the data only).

    >>> r = lambda s: {"step_s": s, "comm_share": 0.5, "bytes_per_step": 8.0, "ratio": 1.0}
    >>> speed = {"rates": {"1gbit": {"results": {"ddp": r(3.0), "powersgd-1": r(0.9), "topkqsgd": r(1.0)}}}}
    >>> for line in target_lines({"speed": speed}): print(line)
    - DDP + TopKQSGD(1%, 8) step time vs DDP uncompressed at 1gbit: 3.00x (target >= 3x): **MET**
    - DDP + TopKQSGD(1%, 8) step time vs PowerSGD rank 1 (its default) at 1gbit: 0.90x (target > 1x, faster): **MISSED**
    """
    lines = []
    rates = ((data.get("speed") or {}).get("rates")) or {}
    rate = "1gbit" if "1gbit" in rates else next(iter(rates), None)
    rows = {r["key"]: r for r in speed_rows(rates[rate]["results"])} if rate else {}
    t = rows.get("topkqsgd")
    if t is not None:
        what = f"{LABELS['topkqsgd']} step time"
        lines.append(_verdict(f"{what} vs DDP uncompressed at {rate}", t["speedup"],
                              f">= {TARGET_DDP_SPEEDUP:g}x", lambda v: v >= TARGET_DDP_SPEEDUP))
        lines.append(_verdict(f"{what} vs PowerSGD rank 1 (its default) at {rate}", t[f"vs_{POWERSGD_DEFAULT}"],
                              f"> {TARGET_DDP_VS_POWERSGD:g}x, faster", lambda v: v > TARGET_DDP_VS_POWERSGD))
    conv = {r["key"]: r for r in convergence_rows(((data.get("convergence") or {}).get("results")) or {})}
    c = conv.get("topkqsgd")
    if c is not None and c["gap"] is not None:
        spread = "n/a, 1 seed" if c["spread"] is None else f"+-{100 * c['spread']:.2f}%"
        lines.append(f"- {c['label']} held-out loss vs DDP uncompressed (mean paired gap over {len(c['seeds'])} "
                     f"seeds): {_pct(c['gap'])} (uncompressed seed spread {spread}; target within "
                     f"{100 * TARGET_DDP_LOSS_GAP:g}%): **{'MET' if abs(c['gap']) <= TARGET_DDP_LOSS_GAP else 'MISSED'}**")
    return lines


def _verdict(what: str, value: Optional[float], goal: str, ok: Callable[[float], bool]) -> str:
    if value is None:
        return f"- {what}: not measured (baseline missing)"
    return f"- {what}: {value:.2f}x (target {goal}): **{'MET' if ok(value) else 'MISSED'}**"


# ---------------------------------------------------------------- the page
def _min_seconds(c: Dict[str, Any]) -> str:
    """The option as run, or nothing for pages of runs before it existed."""
    return f" --min-seconds {c['min_seconds']:g}" if c.get("min_seconds") else ""


def _speed_section(speed: Dict[str, Any]) -> List[str]:
    c = speed["conditions"]
    out = ["## Step time over a rate-limited link", "", _generated(speed), "",
           f"`benchmarks/bench_ddp.py --params {c['params']:g} --batch-size {c['batch_size']} --warmup {c['warmup']} "
           f"--iters {c['iters']}{_min_seconds(c)} --settings KEY` under `torchrun --standalone --nproc-per-node 2`, one job per setting, "
           "Gloo, the synthetic model of the Horovod rows (square Linear layers, one fixed random batch). Each job "
           "runs as `ip netns exec NS torchrun ...` in a fresh network namespace whose loopback is limited by "
           f"`tc qdisc add dev lo root tbf rate RATE burst {TBF['burst']} latency {TBF['latency']}`, as the Horovod "
           "rows. *Step time*: mean over the timed steps and ranks. *Comm share*: (step time - the step time of the "
           "same job with a no-op hook that sends nothing) / step time. *Bytes*: what each rank hands to the "
           "collectives per step. PowerSGD runs with `start_powerSGD_iter = max(2, warmup)` (torch's docs: at "
           "least 2 with error feedback) so every timed step is compressed, and, under Gloo, with one bucket "
           "(see docs/DDP.md). TopKQSGD, QSGD-8 and hvd-gradcomp's PowerSGD rank 4 (`gc.PowerSGD(rank=4)`, "
           "from the first step, with `--bucket-cap-mb` buckets: its second rounds go on a second process "
           "group, so several buckets work under Gloo) are `hvd_gradcomp.ddp.register` with error feedback.", ""]
    for rate, block in speed["rates"].items():
        title = f"{rate}, {LINK_MODES[block['mode']]}" if block["throttled"] else f"{rate} requested, ran unthrottled"
        out += [f"### {title}", "", render_speed_table(speed_rows(block["results"])), ""]
        out += merged_rows_lines(block["results"])
        out += [f"- {LABELS.get(k, k)}: failed: `{v.splitlines()[0]}`" for k, v in block["failures"].items()]
    return out


def merged_rows_lines(results: Dict[str, Dict[str, Any]]) -> List[str]:
    """A line per command whose rows were merged into the saved ones (``--ddp-settings``): which
    rows, when, and the load average (1, 5, 15 minutes) before each ran; nothing when none were.

    >>> print(merged_rows_lines({"a": {}, "gc-powersgd-4": {"command": "c", "date": "d", "load_avg": [0.51, 1, 2]}})[0])
    - Rerun later by `c` on d: DDP + hvd-gradcomp PowerSGD rank 4 (load average before it: 0.51, 1.00, 2.00); the other rows are from the command above.
    """
    by_command: Dict[Tuple[str, str], List[str]] = {}
    for key, row in results.items():
        if "command" in row:
            load = ", ".join(f"{v:.2f}" for v in row.get("load_avg", []))
            by_command.setdefault((row["command"], row["date"]), []).append(
                f"{LABELS.get(key, key)}" + (f" (load average before it: {load})" if load else ""))
    lines = [f"- Rerun later by `{cmd}` on {date}: {', '.join(rows)}; the other rows are from the command above."
             for (cmd, date), rows in by_command.items()]
    return lines + [""] if lines else []


def _convergence_section(conv: Dict[str, Any]) -> List[str]:
    c = conv["conditions"]
    rows = convergence_rows(conv["results"])
    first = next(iter(conv["results"].values()), [{}])[0]
    flat = settled(conv["results"].get("none", []))
    out = ["## Convergence on real data", "", _generated(conv), "",
           f"`examples/train_ddp.py --steps {c['steps']} --lr {c['lr']:g} --cosine --seed SEED` under `torchrun "
           f"--standalone --nproc-per-node 2` (Gloo, not rate-limited: not timed), seeds {', '.join(map(str, c['seeds']))}: "
           f"the character model of {first.get('params', 0):,} parameters on the standard library's sources, "
           f"micro-batch {first.get('micro_batch', '?')} per rank, SGD momentum {first.get('momentum', '?')}, "
           f"learning rate {c['lr']:g} decayed to 0 by a cosine over the steps; held-out loss on "
           f"{first.get('val_size', 0):,} fixed windows of text not trained on. PowerSGD starts after 10% of the "
           "steps (`start_powerSGD_iter`, its docs' advice); our hook compresses from the first step, with "
           "`register(..., optimizer=opt)`: *feedback* is the policy the run used (`momentum`: DGC momentum "
           "correction, chosen for SGD with momentum; `classic`: classic error feedback, `--feedback classic`).", ""]
    if flat is not None:
        verdict = ("it has settled (less than {:g}%), so a gap below is where a setting ends, not only how fast it "
                   "descends" if abs(flat) < SETTLED else "it has NOT settled (it still moves by {:g}% or more), so a "
                   "gap below may be partly a slower descent").format(100 * SETTLED)
        out += [f"The uncompressed held-out loss (mean over seeds) moved by {100 * flat:+.2f}% over the last quarter "
                f"of the steps: {verdict}.", ""]
    out += [render_convergence_table(rows), "",
            "*gap, paired*: each seed's held-out loss against the uncompressed run of the same seed, mean over seeds "
            "[smallest, largest]; *uncompressed seed spread*: the uncompressed runs' standard deviation over seeds "
            "relative to their mean, the size of a gap that a change of seed alone gives.", ""]
    out += [f"- {k}: failed: `{v.splitlines()[0]}`" for k, v in conv["failures"].items()]
    return out


def _generated(part: Dict[str, Any]) -> str:
    m = part.get("machine", {})
    return (f"Generated by `{part['command']}` on {part['date']} ({m.get('cpu', '?')}, {m.get('cores', '?')} cores, "
            f"PyTorch {m.get('torch', '?')}), {part['elapsed_s'] / 60:.1f} minutes.")


def render_page(data: Dict[str, Any]) -> str:
    """``ddp/BENCHMARKS.md``: whichever parts the data has, then the targets."""
    out = ["# DDP: hvd-gradcomp's hook against torch's hooks", "",
           "Every number on this page comes from the command named in its section (`python -m benchmarks "
           "--only-ddp`, part of `make bench`); raw figures in `data.json` beside this page. See "
           "[docs/DDP.md](../../../docs/DDP.md) for the hook itself.", ""]
    if data.get("speed"):
        out += _speed_section(data["speed"])
    if data.get("convergence"):
        out += _convergence_section(data["convergence"])
    targets = target_lines(data)
    if targets:
        out += ["## Targets", "", *targets, ""]
    return "\n".join(out).rstrip() + "\n"


def write_page(plan: DdpPlan, parts: Dict[str, Any], command: str, machine: Dict[str, str]) -> Path:
    """Merge the parts just run into ``data.json`` (keeping the other part's last figures), write the page."""
    path = plan.docs_dir / "data.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    today = machine.get("date", datetime.date.today().isoformat())
    for key, part in parts.items():
        if part is None:
            continue
        if key == "speed" and plan.merge and data.get("speed"):
            data["speed"] = merge_speed(data["speed"], part, command, today)
        else:
            data[key] = dict(part, command=command, date=today, machine=machine)
    plan.docs_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")
    page = plan.docs_dir / "BENCHMARKS.md"
    page.write_text(render_page(data))
    return page


def merge_speed(saved: Dict[str, Any], part: Dict[str, Any], command: str, date: str) -> Dict[str, Any]:
    """The saved speed part with ``part``'s rows put in (``--ddp-settings``): the other rows, the
    part's command, date and machine stay; each new row carries its own command and date. Rows timed
    under other conditions (model size, batch, iterations) would not compare, so they are refused.

    >>> cond = {"params": 25e6, "batch_size": 4}
    >>> saved = {"conditions": cond, "command": "all", "rates": {"1gbit": {"mode": "loopback", "throttled": True,
    ...          "failures": {"b": "x"}, "results": {"a": {"step_s": 1.0}, "b": {"step_s": 2.0}}}}}
    >>> new = {"conditions": cond, "rates": {"1gbit": {"mode": "loopback", "throttled": True, "failures": {},
    ...        "results": {"b": {"step_s": 3.0}}}}}
    >>> out = merge_speed(saved, new, "some", "2026-12-04")["rates"]["1gbit"]
    >>> out["results"]["a"], out["results"]["b"], out["failures"]
    ({'step_s': 1.0}, {'step_s': 3.0, 'command': 'some', 'date': '2026-12-04'}, {})
    """
    if part["conditions"] != saved["conditions"]:
        raise ValueError(f"--ddp-settings rows ran under {part['conditions']}, the saved ones under "
                         f"{saved['conditions']}: run every row (no --ddp-settings) or the saved conditions")
    merged = json.loads(json.dumps(saved))
    for rate, block in part["rates"].items():
        into = merged["rates"].setdefault(rate, {"mode": block["mode"], "throttled": block["throttled"],
                                                 "results": {}, "failures": {}})
        if (into["mode"], into["throttled"]) != (block["mode"], block["throttled"]):
            raise ValueError(f"{rate}: the saved rows ran {into['mode']}, these {block['mode']}: not comparable")
        for key, row in block["results"].items():
            into["results"][key] = dict(row, command=command, date=date)
            into["failures"].pop(key, None)
        into["failures"].update(block["failures"])
    return merged


def render_saved(docs_dir: Path) -> Optional[Path]:
    """Rewrite ``docs_dir/ddp/BENCHMARKS.md`` from its ``data.json`` (``--render-only``); None if absent."""
    path = docs_dir / "ddp" / "data.json"
    if not path.exists():
        return None
    page = path.parent / "BENCHMARKS.md"
    page.write_text(render_page(json.loads(path.read_text())))
    return page
