"""The README's headline figures and benchmarks/results/FIGURES.md's tables, generated from the saved results of
the latest runs (never typed).

Reads the raw figures the benchmark and the study wrote:

* Horovod step time at 1 and 10 Gbit/s: ``benchmarks/results/data/bench.json`` (``python -m benchmarks --skip-ddp``);
* DDP against PowerSGD at 1 Gbit/s: ``benchmarks/results/ddp/data.json`` (``python -m benchmarks --only-ddp``);
* convergence targets: ``benchmarks/results/data/study/`` (``make study``);
* recipes as users write them, bytes over the whole run and in its second half: ``benchmarks/results/data/recipes/``
  (``python benchmarks/study/study.py --recipes``);

and rewrites the block between ``<!-- readme_figures: begin -->`` and ``<!-- readme_figures: end -->``
in each file of :data:`PAGES`: README.md gets one compact headline table, benchmarks/results/FIGURES.md every table.

    python benchmarks/readme_figures.py --write      # after a benchmark or study run
    python benchmarks/readme_figures.py --check      # exit 1 if a block is out of date (tests run it)
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.study import recipe_report, report  # noqa: E402
from benchmarks.plan import REFERENCE_KEYS  # noqa: E402

BEGIN, END = "<!-- readme_figures: begin -->", "<!-- readme_figures: end -->"
HOROVOD_ROWS = ("horovod", "fp16", "topkqsgd", "auto", "barrier")   # barrier: the floor, no exchange
DDP_ROWS = ("ddp", "fp16", "powersgd-1", "powersgd-4", "gc-powersgd-4", "topkqsgd", "auto")


# The file each block is written to, and how much of the figures it gets.
PAGES = {"README.md": "headline", "benchmarks/results/FIGURES.md": "full"}


def _load(path: Path) -> Optional[Dict[str, Any]]:
    return json.loads(path.read_text()) if path.exists() else None


def horovod_section(bench: Dict[str, Any]) -> List[str]:
    """Step time per setting at each rate the run measured, and the issue-13 ratios."""
    bound = ", each bound to its own core (`--bind-cores`)" if bench.get("machine", {}).get("bind_cores") else ""
    if bench.get("machine", {}).get("cpu_allocator"):
        bound += " and keeping the memory it frees (`MALLOC_MMAP_MAX_=0`)"
    rounds = int(bench.get("plan", {}).get("rounds", 1))
    fastest, each = (f", each row its fastest of {rounds} rounds timed in turn", ", with every round's time") \
        if rounds > 1 else ("", "")
    lines = [f"Horovod, 2 ranks{bound}, 25M parameters{fastest}, from `{bench['command']}` "
             f"([benchmarks/results/BENCHMARKS.md](benchmarks/results/BENCHMARKS.md){each}):", "",
             "| rate | setting | step time | in synchronize() (of it, waiting for the last rank) | MB per step per rank "
             "| vs uncompressed |",
             "| --- | --- | ---: | ---: | ---: | ---: |"]
    for rate in ("1gbit", "10gbit"):
        res = bench["speed"].get(rate, {}).get("results", {})
        base = res.get("horovod", {}).get("step_s")
        for key in HOROVOD_ROWS:
            r = res.get(key)
            if r is None:
                continue
            speedup = f"{base / r['step_s']:.2f}x" if base and key not in REFERENCE_KEYS else "-"
            wait = f" ({100 * r['imbalance_s'] / r['step_s']:.1f}%)" if r.get("imbalance_s") is not None else ""
            lines.append(f"| {rate} | {r['label']} | {r['step_s'] * 1e3:.0f} ms | "
                         f"{100 * r['comm_s'] / r['step_s']:.1f}%{wait} "
                         f"| {r['bytes_per_step'] / 1e6:.3f} | {speedup} |")
    return lines + [""]


def ddp_section(data: Dict[str, Any]) -> List[str]:
    speed = data.get("speed", {})
    res = speed.get("rates", {}).get("1gbit", {}).get("results", {})
    if not res:
        return []
    base, psgd, psgd4 = (res.get(k, {}).get("step_s") for k in ("ddp", "powersgd-1", "powersgd-4"))
    labels = {"ddp": "DDP, uncompressed", "fp16": "torch fp16 hook", "powersgd-1": "PowerSGD rank 1",
              "powersgd-4": "PowerSGD rank 4", "gc-powersgd-4": "hvd-gradcomp PowerSGD rank 4",
              "topkqsgd": "hvd-gradcomp TopKQSGD(1%, 8)", "auto": "hvd-gradcomp Auto"}
    later: Dict[str, List[str]] = {}   # rows merged in by a later command (--ddp-settings)
    for key in DDP_ROWS:
        if "command" in res.get(key, {}):
            later.setdefault(res[key]["command"], []).append(labels[key])
    shown = [k for k in DDP_ROWS if k in res]
    if len(later) == 1 and len(next(iter(later.values()))) == len(shown):   # every row shown rerun by one command
        source = f"`{next(iter(later))}`"
    else:
        source = f"`{speed.get('command', 'python -m benchmarks --only-ddp')}`" + "".join(
            f"; {', '.join(rows)} from `{cmd}`" for cmd, rows in later.items())
    lines = [f"DDP at 1 Gbit/s, same model, from {source} "
             "([benchmarks/results/ddp/BENCHMARKS.md](benchmarks/results/ddp/BENCHMARKS.md)):", "",
             "| setting | step time | MB per step per rank | vs DDP uncompressed | vs PowerSGD rank 1 | "
             "vs PowerSGD rank 4 |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for key in DDP_ROWS:
        r = res.get(key)
        if r is None:
            continue
        vs = lambda b: f"{b / r['step_s']:.2f}x" if b else "-"  # noqa: E731
        lines.append(f"| {labels[key]} | {r['step_s'] * 1e3:.0f} ms | {r['bytes_per_step'] / 1e6:.3f} | "
                     f"{vs(base)} | {vs(psgd)} | {vs(psgd4)} |")
    return lines + [""]


def study_section(out: Path) -> List[str]:
    runs = report.load(out)
    tasks = [t for t in report.TASK_TEXT if any(k[0] == t for k in runs)]
    if not tasks:
        return []
    body = report.targets(tasks, runs)[2:]  # without its heading
    seeds = sorted({len(rs) for (t, s), rs in runs.items() if t in tasks and s == "tq1"})
    count = f"{seeds[0]}" if len(seeds) == 1 else f"{seeds[0]} to {seeds[-1]}"
    missed = [row.split(" | ")[0].lstrip("| ") for row in body if row.startswith("| ") and row.endswith("| no |")]
    said = ("Every task meets both targets." if not missed else
            "Targets missed (*met?* no): " + ", ".join(missed) + "; each row's gaps say which and by how much, "
            "next to its uncompressed seed spread.")
    return [f"Convergence, {count} seeds (beside each gap), 2 ranks, from `make study` "
            "([benchmarks/results/STUDY.md](benchmarks/results/STUDY.md)):", ""] + body + [said, ""]


RATE_TEXT = {"100mbit": "100 Mbit/s", "1gbit": "1 Gbit/s", "10gbit": "10 Gbit/s"}


def headline_section(bench: Optional[Dict[str, Any]], ddp: Optional[Dict[str, Any]], study: Path,
                     recipes_dir: Path) -> List[str]:
    """README's one table: step time of the main Horovod settings at 1 and 10 Gbit/s and their bytes
    per step, then one sentence each for DDP against PowerSGD and for the convergence study."""
    lines: List[str] = []
    if bench:
        rates = [r for r in ("1gbit", "10gbit") if bench["speed"].get(r, {}).get("results")]
        lines += [f"Horovod, 2 ranks, 25M parameters, a rate-limited link, from `{bench['command']}` "
                  "([benchmarks/results/FIGURES.md](benchmarks/results/FIGURES.md) has every row and setting):", "",
                  "| setting | " + " | ".join(f"step time at {RATE_TEXT[r]} (speed-up)" for r in rates)
                  + f" | MB per step per rank at {RATE_TEXT[rates[0]]} |",
                  "| --- | " + " | ".join("---:" for _ in rates) + " | ---: |"]
        for key in ("horovod", "fp16", "topkqsgd", "auto"):
            first = bench["speed"][rates[0]]["results"].get(key)
            if first is None:
                continue
            cells = []
            for rate in rates:
                res = bench["speed"][rate]["results"]
                r, base = res.get(key), res.get("horovod", {}).get("step_s")
                cells.append("-" if r is None else f"{r['step_s'] * 1e3:.0f} ms ({base / r['step_s']:.2f}x)" if base
                             else f"{r['step_s'] * 1e3:.0f} ms")
            lines.append(f"| {first['label']} | " + " | ".join(cells) + f" | {first['bytes_per_step'] / 1e6:.3f} |")
        lines.append("")
    res = (ddp or {}).get("speed", {}).get("rates", {}).get("1gbit", {}).get("results", {})
    if all(k in res for k in ("ddp", "powersgd-1", "topkqsgd")):
        ms = {k: res[k]["step_s"] * 1e3 for k in ("ddp", "powersgd-1", "topkqsgd")}
        lines += [f"Under DDP at 1 Gbit/s: TopKQSGD(1%, 8) {ms['topkqsgd']:.0f} ms per step, torch's PowerSGD "
                  f"rank 1 {ms['powersgd-1']:.0f} ms, uncompressed {ms['ddp']:.0f} ms.", ""]
    runs = report.load(study)
    tasks = [t for t in report.TASK_TEXT if runs.get((t, "tq1"))]
    if tasks:
        gaps = [report.paired_gap(t, "tq1", runs) for t in tasks]
        ratios = [statistics.fmean(r["ratio_second_half"] for r in runs[(t, "tq1")]) for t in tasks]
        seeds = sorted({n for _, n in gaps})
        count = f"{seeds[0]}" if len(seeds) == 1 else f"{seeds[0]} to {seeds[-1]}"
        rows = [row for row in report.targets(tasks, runs) if row.startswith("| ") and row.endswith(("| yes |", "| no |"))]
        met = sum(row.endswith("| yes |") for row in rows)
        lines += [f"Convergence, from `make study` ({len(tasks)} tasks, {count} seeds each, "
                  "[benchmarks/results/STUDY.md](benchmarks/results/STUDY.md)): TopKQSGD(1%, 8) with its default feedback ended between "
                  f"{min(g for g, _ in gaps):+.2f}% and {max(g for g, _ in gaps):+.2f}% from uncompressed "
                  f"training's held-out loss (negative: below it; each task's gap beside its seed spread in "
                  f"benchmarks/results/FIGURES.md), sending {min(ratios):.0f}x to {max(ratios):.0f}x fewer bytes than float32 in "
                  f"the second half of each run (the steady state); {met} of {len(rows)} tasks meet the study's "
                  "targets.", ""]
    lines += recipes_sentence(recipes_dir)
    return lines


def recipes_sentence(out: Path) -> List[str]:
    """The recipe study in one sentence: rows within target, divergences, and bytes over the whole run
    beside the steady state (AdamW's dense warm-up is in the first), per road and recipe."""
    rows = recipe_report.compressed_rows(recipe_report.load(out))
    if not rows:
        return []
    within = sum(r["verdict"] in ("within", "better (see below)") for r in rows)
    better = sum(r["verdict"] == "better (see below)" for r in rows)
    diverged = sum(r["verdict"] == "**diverged**" for r in rows)
    seeds = sorted({r["seeds"] for r in rows})
    count = f"{seeds[0]}" if len(seeds) == 1 else f"{seeds[0]} to {seeds[-1]}"
    names = sorted({r["recipe"] for r in rows})
    return [f"Recipes as users copy them from well-known training scripts ({len(names)} recipes x 3 compressed "
            f"wrappers, {count} seeds, [benchmarks/results/RECIPES.md](benchmarks/results/RECIPES.md)): {within} of {len(rows)} end within 3% of "
            f"uncompressed training or its seed spread, or below it ({better} of them; benchmarks/results/RECIPES.md measures why), {diverged} "
            f"diverged. TopKQSGD(1%, 8) saved {_span(rows, 'whole', ('gc', 'ddp'))} of the bytes over the whole "
            f"run on `hvd_gradcomp.DistributedOptimizer` and the DDP hook, {_span(rows, 'whole', ('stock',))} on "
            "stock Horovod (AdamW's dense warm-up included: float16 on the first two, float32 on stock), and "
            f"{_span(rows, 'steady', ('stock', 'gc', 'ddp'), 0)} in the second half of each run.", ""]


def _span(rows: List[Dict[str, Any]], key: str, roads: tuple, digits: int = 1) -> str:
    """``"5.8x to 112.0x"``: the range of ``key`` over the rows of ``roads``."""
    xs = [r[key] for r in rows if r["road"] in roads]
    return f"{min(xs):.{digits}f}x to {max(xs):.{digits}f}x" if xs else "-"


def _relative_to_results(lines: List[str]) -> List[str]:
    """The full tables' links, as seen from benchmarks/results/FIGURES.md."""
    return [ln.replace("[benchmarks/results/", "[").replace("](benchmarks/results/", "](") for ln in lines]


def render(root: Path = ROOT, kind: str = "full") -> str:
    """The block for a page of :data:`PAGES`: ``kind`` "headline" (README) or "full" (benchmarks/results/FIGURES.md)."""
    lines = [BEGIN, "<!-- generated by `python benchmarks/readme_figures.py --write`; do not edit by hand -->", ""]
    bench = _load(root / "benchmarks/results/data/bench.json")
    ddp = _load(root / "benchmarks/results/ddp/data.json")
    if kind == "headline":
        lines += headline_section(bench, ddp, root / "benchmarks/results/data/study", root / "benchmarks/results/data/recipes")
    else:
        body: List[str] = []
        if bench:
            body += horovod_section(bench)
        if ddp:
            body += ddp_section(ddp)
        body += study_section(root / "benchmarks/results/data/study")
        body += recipes_sentence(root / "benchmarks/results/data/recipes")
        lines += _relative_to_results(body)
    return "\n".join(lines).rstrip() + "\n" + END


def replace(text: str, block: str) -> str:
    """``text`` with its generated block replaced by ``block``.

    >>> replace("a\\n" + BEGIN + "\\nold\\n" + END + "\\nb", BEGIN + "\\nnew\\n" + END)
    'a\\n<!-- readme_figures: begin -->\\nnew\\n<!-- readme_figures: end -->\\nb'
    """
    if BEGIN not in text or END not in text:
        raise ValueError(f"no {BEGIN} ... {END} block to rewrite")
    start, stop = text.index(BEGIN), text.index(END) + len(END)
    return text[:start] + block + text[stop:]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="rewrite the blocks of README.md and benchmarks/results/FIGURES.md")
    mode.add_argument("--check", action="store_true", help="exit 1 when a block is out of date")
    args = ap.parse_args()
    stale = []
    for rel, kind in PAGES.items():
        path = ROOT / rel
        text = path.read_text()
        new = replace(text, render(ROOT, kind))
        if args.check:
            if new != text:
                stale.append(rel)
            continue
        path.write_text(new)
        print(f"rewrote the figures block of {rel}")
    if stale:
        print(f"{', '.join(stale)}: figures out of date: run python benchmarks/readme_figures.py --write")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
