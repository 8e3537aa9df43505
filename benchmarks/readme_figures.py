"""The README's headline figures, generated from the saved results of the latest runs (never typed).

Reads the raw figures the benchmark and the study wrote, and rewrites the README section between
``<!-- readme_figures: begin -->`` and ``<!-- readme_figures: end -->``:

* Horovod step time at 1 and 10 Gbit/s: ``docs/data/bench.json`` (``python -m benchmarks --skip-ddp``);
* DDP against PowerSGD at 1 Gbit/s: ``docs/ddp/data.json`` (``python -m benchmarks --only-ddp``);
* convergence targets: ``docs/data/study/`` (``make study``).

    python benchmarks/readme_figures.py --write      # after a benchmark or study run
    python benchmarks/readme_figures.py --check      # exit 1 if the README is out of date (tests run it)
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.study import report  # noqa: E402
from benchmarks.plan import REFERENCE_KEYS  # noqa: E402

BEGIN, END = "<!-- readme_figures: begin -->", "<!-- readme_figures: end -->"
HOROVOD_ROWS = ("horovod", "fp16", "topkqsgd", "auto", "barrier")   # barrier: the floor, no exchange
DDP_ROWS = ("ddp", "fp16", "powersgd-1", "powersgd-4", "topkqsgd", "auto")


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
             f"([docs/BENCHMARKS.md](docs/BENCHMARKS.md){each}):", "",
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
    base, psgd = res.get("ddp", {}).get("step_s"), res.get("powersgd-1", {}).get("step_s")
    lines = [f"DDP at 1 Gbit/s, same model, from `{speed.get('command', 'python -m benchmarks --only-ddp')}` "
             "([docs/ddp/BENCHMARKS.md](docs/ddp/BENCHMARKS.md)):", "",
             "| setting | step time | MB per step per rank | vs DDP uncompressed | vs PowerSGD rank 1 |",
             "| --- | ---: | ---: | ---: | ---: |"]
    labels = {"ddp": "DDP, uncompressed", "fp16": "torch fp16 hook", "powersgd-1": "PowerSGD rank 1",
              "powersgd-4": "PowerSGD rank 4", "topkqsgd": "hvd-gradcomp TopKQSGD(1%, 8)",
              "auto": "hvd-gradcomp Auto"}
    for key in DDP_ROWS:
        r = res.get(key)
        if r is None:
            continue
        vs = lambda b: f"{b / r['step_s']:.2f}x" if b else "-"  # noqa: E731
        lines.append(f"| {labels[key]} | {r['step_s'] * 1e3:.0f} ms | {r['bytes_per_step'] / 1e6:.3f} | "
                     f"{vs(base)} | {vs(psgd)} |")
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
            "([docs/STUDY.md](docs/STUDY.md)):", ""] + body + [said, ""]


def render(root: Path = ROOT) -> str:
    lines = [BEGIN, "<!-- generated by `python benchmarks/readme_figures.py --write`; do not edit by hand -->", ""]
    bench = _load(root / "docs/data/bench.json")
    if bench:
        lines += horovod_section(bench)
    ddp = _load(root / "docs/ddp/data.json")
    if ddp:
        lines += ddp_section(ddp)
    lines += study_section(root / "docs/data/study")
    return "\n".join(lines).rstrip() + "\n" + END


def replace(text: str, block: str) -> str:
    """``text`` with its generated block replaced by ``block``.

    >>> replace("a\\n" + BEGIN + "\\nold\\n" + END + "\\nb", BEGIN + "\\nnew\\n" + END)
    'a\\n<!-- readme_figures: begin -->\\nnew\\n<!-- readme_figures: end -->\\nb'
    """
    if BEGIN not in text or END not in text:
        raise ValueError(f"the README has no {BEGIN} ... {END} block to rewrite")
    start, stop = text.index(BEGIN), text.index(END) + len(END)
    return text[:start] + block + text[stop:]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="rewrite the README block")
    mode.add_argument("--check", action="store_true", help="exit 1 when the README block is out of date")
    args = ap.parse_args()
    readme = ROOT / "README.md"
    text = readme.read_text()
    new = replace(text, render())
    if args.check:
        if new != text:
            print("README.md figures are out of date: run python benchmarks/readme_figures.py --write")
            return 1
        return 0
    readme.write_text(new)
    print(f"rewrote the figures block of {readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
