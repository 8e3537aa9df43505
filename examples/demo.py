"""``make demo``: two 2-rank training runs of ``examples/train.py`` and a summary.

1. TopKQSGD(1%, 8 bits) with error feedback and gradient accumulation (4 micro-batches of
   16 per rank per step);
2. the same steps, seed and batches, uncompressed.

Each run prints rank 0's progress (plain lines every 10 s: horovodrun prefixes each line) while it trains; at the end a table compares final
loss, samples/s and bytes sent per step. About 2-3 minutes on 2 CPU cores.

Example::

    python examples/demo.py               # what make demo runs
    python examples/demo.py --steps 40    # shorter
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from hvd_gradcomp.launchers.jobs import BIN, local_horovodrun, rank_env, run_job

ROOT = Path(__file__).resolve().parents[1]
RUNS = (
    # Momentum correction (DGC) as in the benchmark's TopK rows: momentum applied before TopK, on each rank.
    ("TopKQSGD(1%, 8) + EF", "demo-topkqsgd", ["--compression", "topk-qsgd", "--ratio", "0.01", "--bits", "8",
                                                "--error-feedback", "--momentum-correction",
                                                "--no-momentum-masking"]),
    ("uncompressed", "demo-none", ["--compression", "none"]),
)


def train_argv(steps: int, accumulate: int, micro_batch: int, seed: int, out_dir: Path, name: str,
               flags: List[str]) -> List[str]:
    """horovodrun command for one 2-rank run of train.py.

    >>> train_argv(5, 4, 16, 0, Path("/o"), "x", ["--compression", "none"])[1:6]
    ['-np', '2', '-H', 'localhost:2', '--gloo']
    """
    return local_horovodrun([sys.executable, str(ROOT / "examples" / "train.py"), "--steps", str(steps),
                             "--accumulate", str(accumulate), "--micro-batch", str(micro_batch), "--seed", str(seed),
                             "--out-dir", str(out_dir), "--run-name", name, *flags])


def run(argv: List[str], timeout: float) -> None:
    """Run with output streaming to this terminal (rank 0's progress as plain lines), killed on timeout."""
    try:
        res = run_job(argv, rank_env(ROOT), timeout, cwd=ROOT)
    except KeyboardInterrupt:
        sys.exit("demo: interrupted")
    if res.timed_out:
        sys.exit(f"demo: the run took longer than {timeout:.0f}s and was stopped")
    if not res.ok:
        sys.exit(f"demo: the run failed (exit {res.returncode}); its output is above")


def summary_table(results: List[Dict[str, Any]]) -> str:
    """A plain-text table of the runs' summaries.

    >>> print(summary_table([{"label": "a", "final_train_loss": 2.0, "val_loss": 2.1, "val_accuracy": 0.3,
    ...     "samples_per_s": 900.0, "bytes_per_step": 3.4e6, "ratio": 1.0}]).splitlines()[2])
    a                        2.0000         2.1000        0.300         900    3,400,000     1.0x
    """
    head = f"{'run':<20} {'train loss':>10} {'held-out loss':>14} {'accuracy':>12} {'samples/s':>11} " \
           f"{'bytes/step':>12} {'ratio':>8}"
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(f"{r['label']:<20} {r['final_train_loss']:>10.4f} {r['val_loss']:>14.4f} "
                     f"{r['val_accuracy']:>12.3f} {r['samples_per_s']:>11.0f} {r['bytes_per_step']:>12,.0f} "
                     f"{r['ratio']:>7.1f}x")
    return "\n".join(lines)


def closing_lines(compressed: Dict[str, Any], plain: Dict[str, Any]) -> List[str]:
    """The demo's conclusion in words, from the two summaries."""
    rel = (compressed["val_loss"] - plain["val_loss"]) / plain["val_loss"]
    return [
        f"TopKQSGD sent {plain['bytes_per_step'] / compressed['bytes_per_step']:.0f}x fewer bytes per step "
        f"({compressed['bytes_per_step']:,.0f} vs {plain['bytes_per_step']:,.0f}) for a held-out loss "
        f"{100 * rel:+.2f}% relative to uncompressed, after {compressed['steps']} steps of "
        f"effective batch {compressed['effective_batch']}.",
        f"Throughput here: {compressed['samples_per_s']:,.0f} vs {plain['samples_per_s']:,.0f} samples/s. Both ranks "
        "share one machine's loopback, so the network costs nothing here and the compressor's CPU time shows; "
        "see benchmarks/results/BENCHMARKS.md for a rate-limited link.",
    ]


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=120, help="optimizer steps per run")
    parser.add_argument("--accumulate", type=int, default=4, help="micro-batches per optimizer step")
    parser.add_argument("--micro-batch", type=int, default=16, help="samples per micro-batch per rank")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", default=str(ROOT / "runs" / "demo"))
    parser.add_argument("--timeout", type=float, default=300, help="seconds allowed per run")
    args = parser.parse_args(argv)
    for flag in ("steps", "accumulate", "micro_batch"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1")
    if not (BIN / "horovodrun").exists():
        parser.error(f"{BIN / 'horovodrun'} not found: run make setup first")
    out = Path(args.out_dir)
    results = []
    for i, (label, name, flags) in enumerate(RUNS, 1):
        print(f"\n=== run {i}/{len(RUNS)}: {label}, {args.steps} steps, 2 ranks ===", flush=True)
        run(train_argv(args.steps, args.accumulate, args.micro_batch, args.seed, out, name, flags), args.timeout)
        summary = json.loads((out / f"{name}.json").read_text())
        results.append({"label": label, **summary})
    print("\n=== summary ===")
    print(summary_table(results))
    print("\n".join(closing_lines(results[0], results[1])))
    print(f"per-step logs: {out}/*.csv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
