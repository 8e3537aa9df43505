"""``make bench`` (``python -m benchmarks``): step time over a rate-limited link, and convergence on real data.

1. Speed: ``examples/synthetic_benchmark.py`` (25M parameters by default) on 2 ranks inside a
   network namespace whose loopback is limited by ``tc tbf`` to each ``--rates`` value:
   uncompressed Horovod, Horovod fp16, QSGD 8-bit, QSGD 4-bit, TopK 1%, TopKQSGD(1%, 8), Auto.
   Reports step time, the share spent in ``synchronize()``, bytes per step and speedups.
   With ``--two-hosts`` the two ranks run on the two hosts of ``scripts/two_hosts.sh`` instead
   (network namespaces hvdgc-a and hvdgc-b joined by a veth link limited per direction, as
   between two machines); each table says which way it ran.
2. Convergence: ``examples/train.py`` with the same steps and seed, uncompressed, fp16,
   each compressor with error feedback, and TopKQSGD without; final loss and accuracy.

Writes ``docs/BENCHMARKS.md``, ``docs/img/*.png`` and ``docs/data/bench.json``; raw per-run
files go under ``runs/bench/``. Without the rights to create a namespace (root or
CAP_NET_ADMIN, and ``ip``/``tc`` installed) it says so and runs unthrottled.

Examples::

    make bench                                  # everything (~20 minutes on 2 CPU cores)
    python -m benchmarks --quick                # a small smoke run (< 3 minutes), written under runs/bench-quick
    python -m benchmarks --rates 1gbit --skip-convergence
    python -m benchmarks --two-hosts --skip-convergence   # speed rows across the two-host link
    python -m benchmarks --dry-run              # print the commands, run nothing
"""
from __future__ import annotations

import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Dict, Optional

import click

from .markdown import write_report
from .plan import DEFAULT_RATES, Plan, build_plan, planned_commands
from .runner import machine_description, run_convergence, run_speed


def _positive(ctx: Any, param: Any, value: Any) -> Any:
    if value is not None and value <= 0:
        raise click.BadParameter("must be > 0")
    return value


@click.command(context_settings={"help_option_names": ["-h", "--help"]}, help=__doc__.split("\n\n")[0])
@click.option("--quick", is_flag=True, help="small smoke run (< 3 min), written under runs/bench-quick/")
@click.option("--rates", default=None, help=f"link rates, comma-separated tc units  [default: {DEFAULT_RATES}]")
@click.option("--params", type=float, default=None, callback=_positive, help="synthetic model size [default: 25e6]")
@click.option("--iters", type=int, default=None, callback=_positive, help="timed iterations per setting [default: 10]")
@click.option("--warmup", type=click.IntRange(min=0), default=None, help="warm-up iterations [default: 3]")
@click.option("--steps", type=int, default=None, callback=_positive, help="convergence steps [default: 400]")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--skip-speed", is_flag=True, help="only the convergence comparison")
@click.option("--skip-convergence", is_flag=True, help="only the step-time comparison")
@click.option("--docs-dir", default=None, help="where BENCHMARKS.md, img/ and data/ go [default: docs]")
@click.option("--job-timeout", type=float, default=420, show_default=True, callback=_positive,
              help="seconds before one 2-rank job is killed")
@click.option("--compile", "compile_mode", type=click.Choice(["auto", "0", "1"]), default="auto", show_default=True,
              help="HVDGC_COMPILE for the ranks (torch.compile of the large-tensor kernels)")
@click.option("--two-hosts", is_flag=True,
              help="speed rows with one rank on each host of scripts/two_hosts.sh (network namespaces hvdgc-a and "
                   "hvdgc-b), across their veth link limited to each rate per direction; needs root")
@click.option("--dry-run", is_flag=True, help="print the commands and exit")
@click.option("--render-only", is_flag=True,
              help="rewrite BENCHMARKS.md and the plots from DOCS_DIR/data/bench.json without running anything")
def main(quick: bool, rates: Optional[str], params: Optional[float], iters: Optional[int], warmup: Optional[int],
         steps: Optional[int], seed: int, skip_speed: bool, skip_convergence: bool, docs_dir: Optional[str],
         job_timeout: float, compile_mode: str, two_hosts: bool, dry_run: bool, render_only: bool) -> None:
    """Entry point of ``python -m benchmarks`` (``make bench``)."""
    if skip_speed and skip_convergence:
        raise click.UsageError("--skip-speed and --skip-convergence together leave nothing to run")
    try:
        plan = build_plan(quick, rates, params, iters, warmup, steps, seed, skip_speed, skip_convergence, docs_dir,
                          job_timeout, compile_mode, two_hosts)
    except click.BadParameter as exc:
        raise click.UsageError(f"--rates: {exc.message}") from None
    if dry_run:
        click.echo("\n".join(planned_commands(plan)))
        return
    if render_only:
        render_saved(plan)
        return
    execute(plan, shlex.join(["python", "-m", "benchmarks", *sys.argv[1:]]))


def execute(plan: Plan, command: str) -> Dict[str, Any]:
    """Run the plan, write the report; returns the raw figures."""
    from launchers.progress import progress

    start = time.perf_counter()
    total = len(plan.rates) * len(plan.speed) + len(plan.convergence)
    with progress(total=total, unit="run", desc="benchmark") as bar:
        say = bar.write
        speed = run_speed(plan, say, bar) if plan.speed else {}
        conv = run_convergence(plan, say, bar) if plan.convergence else None
    elapsed = time.perf_counter() - start
    data = {"command": command, "machine": machine_description(), "speed": speed, "convergence": conv,
            "elapsed_s": elapsed, "plan": {k: str(v) if isinstance(v, Path) else v for k, v in vars(plan).items()
                                           if k not in ("speed", "convergence")}}
    write_report(plan, data, command, elapsed)
    return data


def render_saved(plan: Plan) -> None:
    """Re-render the report from a previous run's raw figures (same numbers, current layout)."""
    path = plan.docs_dir / "data" / "bench.json"
    if not path.exists():
        raise click.UsageError(f"{path} not found: run python -m benchmarks first (or pass --docs-dir)")
    data = json.loads(path.read_text())
    saved = data["plan"]
    for key in ("params", "warmup", "iters", "batch_size", "steps", "seed", "compile_mode", "rates"):
        setattr(plan, key, saved[key])
    write_report(plan, data, data["command"], data["elapsed_s"])


