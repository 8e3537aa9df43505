"""PowerSGD rank 4, hvd-gradcomp's against torch's hook, on the study's tasks under DDP (issue 46).

For each task and seed, one ``torchrun`` job of 2 ranks (Gloo) runs :mod:`benchmarks.study.ddp_worker`
with three settings in turn: DDP uncompressed (``none``), ``gc.PowerSGD(rank=4)`` through
``hvd_gradcomp.ddp.register`` (``psgd4``) and torch's ``powerSGD_hook`` at rank 4
(``psgd4-torch``), both compressing from DDP's third iteration. The tasks, seeds, models, data,
optimizers and schedules are the study's (:mod:`benchmarks.study.tasks`); the study's Horovod
rows are not reused, so every gap is paired with a DDP uncompressed run of the same seed and code.
Writes one JSON per run into ``docs/data/powersgd_check/`` and the page ``docs/POWERSGD.md``::

    python benchmarks/study/powersgd_check.py --tasks transformer,cnn-sgd,cnn-adam,teacher-mlp --seeds 0,1,2
    python benchmarks/study/powersgd_check.py --render-only       # the page from the JSON files

Finished runs are kept (a rerun skips them), so an interrupted check resumes where it stopped.
Tasks with gradient accumulation (``char-mlp``) are not run: the DDP worker takes none.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "docs" / "data" / "powersgd_check"
PAGE = ROOT / "docs" / "POWERSGD.md"
SETTINGS = ("none", "psgd4", "psgd4-torch")
TASKS = ("transformer", "cnn-sgd", "cnn-adam", "teacher-mlp", "transformer-const", "cnn-adam-const", "cnn-sgd-const")
COMMAND = "python benchmarks/study/powersgd_check.py"

Runs = Dict[Tuple[str, str], Dict[int, dict]]


def command(task: str, seed: int, settings: List[str], out: Path) -> List[str]:
    """The 2-rank torchrun job of one task and seed (the study's DDP worker)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            str(ROOT / "benchmarks/study/ddp_worker.py"), "--task", task, "--seed", str(seed),
            "--settings", ",".join(settings), "--out", str(out)]


def run(tasks: List[str], seeds: List[int], out: Path, timeout: int) -> bool:
    """Every (task, seed) job, seeds outermost; settings already in ``out`` are skipped."""
    ok = True
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    for seed in seeds:
        for task in tasks:
            todo = [s for s in SETTINGS if not (out / f"{task}-ddp-{s}-s{seed}.json").exists()]
            if not todo:
                continue
            t0 = time.time()
            print(f"[powersgd_check] {task} seed {seed}: {', '.join(todo)}", flush=True)
            try:
                res = subprocess.run(command(task, seed, todo, out), cwd=ROOT, env=env, timeout=timeout,
                                     capture_output=True, text=True)
            except subprocess.TimeoutExpired:
                print(f"[powersgd_check] {task} seed {seed}: timed out after {timeout} s", file=sys.stderr, flush=True)
                ok = False
                continue
            for line in res.stdout.splitlines():
                if "held-out loss" in line:
                    print(f"  {line}", flush=True)
            if res.returncode != 0:
                print(f"[powersgd_check] {task} seed {seed} failed ({res.returncode}):\n{res.stdout[-3000:]}\n"
                      f"{res.stderr[-3000:]}", file=sys.stderr, flush=True)
                ok = False
            print(f"  ({time.time() - t0:.0f} s)", flush=True)
    return ok


def load(out: Path = OUT) -> Runs:
    """{(task, setting): {seed: record}} from the JSON files."""
    runs: Runs = {}
    for path in sorted(out.glob("*.json")):
        r = json.loads(path.read_text())
        runs.setdefault((r["task"], r["setting"]), {})[r["seed"]] = r
    return runs


def _mean_sd(xs: List[float]) -> Tuple[float, float]:
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def row(runs: Runs, task: str, setting: str) -> Optional[Dict[str, object]]:
    """One setting of one task: its seeds, held-out loss mean and sd, the paired gap to DDP
    uncompressed of the same seed (mean, smallest, largest), the uncompressed seed spread and the
    bytes ratio over the second half; None when it has no run.

    >>> rec = lambda loss: {"val_loss": loss, "ratio_second_half": 10.0, "label": "x"}
    >>> runs = {("t", "none"): {0: rec(2.0), 1: rec(2.2)}, ("t", "psgd4"): {0: rec(2.02), 1: rec(2.2)}}
    >>> r = row(runs, "t", "psgd4")
    >>> r["seeds"], round(r["gap"], 4), round(r["gap_hi"], 4), round(r["spread"], 4)
    ([0, 1], 0.5, 1.0, 6.7344)
    >>> row(runs, "t", "psgd4-torch") is None
    True
    """
    mine, base = runs.get((task, setting)), runs.get((task, "none"), {})
    if not mine:
        return None
    mean, sd = _mean_sd([r["val_loss"] for r in mine.values()])
    gaps = [(r["val_loss"] / base[s]["val_loss"] - 1) * 100 for s, r in mine.items() if s in base]
    b = [r["val_loss"] for r in base.values()]
    first = next(iter(mine.values()))
    return {"label": first["label"], "seeds": sorted(mine), "mean": mean, "sd": sd,
            "gap": statistics.fmean(gaps) if gaps else None, "gap_lo": min(gaps) if gaps else None,
            "gap_hi": max(gaps) if gaps else None, "paired": len(gaps),
            "spread": statistics.stdev(b) / statistics.fmean(b) * 100 if len(b) > 1 else None,
            "ratio": statistics.fmean(r["ratio_second_half"] for r in mine.values())}


def _pct(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:+.2f}%"


def table(runs: Runs, task: str) -> List[str]:
    """The task's rows: uncompressed, ours, torch's."""
    lines = ["| setting | seeds | held-out loss (mean +- sd) | gap vs DDP uncompressed, paired (mean [min, max]) | "
             "uncompressed seed spread | bytes ratio, 2nd half |", "| --- | --- | ---: | ---: | ---: | ---: |"]
    for setting in SETTINGS:
        r = row(runs, task, setting)
        if r is None:
            continue
        gap = "-" if setting == "none" or r["gap"] is None else \
            f"{_pct(r['gap'])} [{_pct(r['gap_lo'])}, {_pct(r['gap_hi'])}]"
        spread = "n/a (1 seed)" if r["spread"] is None else f"+-{r['spread']:.2f}%"
        lines.append(f"| {r['label']} | {','.join(map(str, r['seeds']))} | {r['mean']:.4f} +- {r['sd']:.4f} | "
                     f"{gap} | {spread} | {r['ratio']:.0f}x |")
    return lines


def summary(runs: Runs, tasks: List[str]) -> List[str]:
    """One line per task: both gaps and the spread, side by side."""
    lines = ["| task | seeds | hvd-gradcomp PowerSGD rank 4: gap | torch's PowerSGD hook, rank 4: gap | "
             "ours - torch's (held-out loss, mean) | uncompressed seed spread |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for task in tasks:
        ours, torch_, base = (row(runs, f"{task}-ddp", s) for s in ("psgd4", "psgd4-torch", "none"))
        if not (ours and torch_ and base):
            continue
        diff = (ours["mean"] / torch_["mean"] - 1) * 100
        spread = "n/a" if base["spread"] is None else f"+-{base['spread']:.2f}%"
        lines.append(f"| {task} | {min(ours['paired'], torch_['paired'])} | {_pct(ours['gap'])} | "
                     f"{_pct(torch_['gap'])} | {diff:+.2f}% | {spread} |")
    return lines


def render(runs: Runs) -> str:
    """docs/POWERSGD.md from the runs."""
    tasks = [t for t in TASKS if (f"{t}-ddp", "none") in runs]
    versions = sorted({r.get("code", "unknown") for by_seed in runs.values() for r in by_seed.values()})
    out = ["# PowerSGD rank 4: hvd-gradcomp's against torch's hook", "",
           f"Generated by `{COMMAND}` from the JSON results in `docs/data/powersgd_check/` (`--render-only` "
           "redraws it from them); do not edit by hand. Code version(s) of the runs: "
           f"{', '.join(versions) or '-'}.", "",
           "The study's tasks ([STUDY.md](STUDY.md), `benchmarks/study/tasks.py`: the same models, data, "
           "optimizers, schedules and seeds) trained under PyTorch DDP, 2 ranks on one machine (Gloo, "
           "`benchmarks/study/ddp_worker.py` under torchrun, 1 thread per rank), three ways: DDP uncompressed, "
           "`hvd_gradcomp.ddp.register(model, compression=gc.PowerSGD(rank=4), optimizer=opt, "
           "start_compress_iter=2)` and torch's `powerSGD_hook` with `PowerSGDState(matrix_approximation_rank=4, "
           "start_powerSGD_iter=2, random_seed=seed)` (one bucket under Gloo, see [DDP.md](DDP.md)). Both "
           "start compressing at DDP's third iteration, the earliest torch's hook allows with error feedback; "
           "both keep their defaults otherwise (warm start, error feedback, `min_compression_rate` 2). "
           "Not timed: step times at 1 Gbit/s are in [ddp/BENCHMARKS.md](ddp/BENCHMARKS.md).", "",
           "*gap, paired*: each seed's held-out loss (last step) against the DDP uncompressed run of the same "
           "seed, in %, mean over seeds [smallest, largest]; *uncompressed seed spread*: the uncompressed "
           "runs' standard deviation over seeds relative to their mean, the size of a gap a change of seed alone "
           "gives; *bytes ratio*: fp32 gradient bytes over the bytes each rank handed to the collectives, "
           "second half of the run.", "", "## Summary", "", *summary(runs, tasks), ""]
    for task in tasks:
        first = next(iter(runs[(f"{task}-ddp", "none")].values()))
        out += [f"## {task}", "", f"{first['steps']} optimizer steps, {first['optimizer']}.", "",
                *table(runs, f"{task}-ddp"), ""]
    return "\n".join(out).rstrip() + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", default=",".join(TASKS[:4]), help=f"comma-separated, of {list(TASKS)}")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per torchrun job")
    ap.add_argument("--render-only", action="store_true")
    args = ap.parse_args()
    ok = True
    if not args.render_only:
        tasks = args.tasks.split(",")
        bad = sorted(set(tasks) - set(TASKS))
        if bad:
            ap.error(f"unknown tasks {bad}; choose from {list(TASKS)}")
        ok = run(tasks, [int(s) for s in args.seeds.split(",")], OUT, args.timeout)
    PAGE.write_text(render(load()))
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
