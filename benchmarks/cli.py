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
3. DDP (:mod:`benchmarks.ddp`, ``--skip-ddp`` leaves it out, ``--only-ddp`` runs only it): the same
   speed rows under ``torchrun`` for DDP uncompressed, torch's fp16 and PowerSGD hooks and our hook,
   and a several-seed convergence comparison on the real-data example; its own page, ``benchmarks/results/ddp/``.

Writes ``benchmarks/results/BENCHMARKS.md``, ``benchmarks/results/img/*.png`` and ``benchmarks/results/data/bench.json``; raw per-run
files go under ``runs/bench/``. Without the rights to create a namespace (root or
CAP_NET_ADMIN, and ``ip``/``tc`` installed) it says so and runs unthrottled.

Examples::

    make bench                                  # everything (~20 minutes on 2 CPU cores)
    python -m benchmarks --quick                # a small smoke run (< 3 minutes), written under runs/bench-quick
    python -m benchmarks --rates 1gbit --skip-convergence
    python -m benchmarks --two-hosts --skip-convergence   # speed rows across the two-host link
    python -m benchmarks --dry-run              # print the commands, run nothing
    python -m benchmarks --only-ddp --rates 1gbit       # only the DDP rows and convergence (benchmarks/results/ddp/)
    python -m benchmarks --only-ddp --skip-speed        # only the DDP convergence comparison (~12 min)
    python -m benchmarks --only-ddp --skip-convergence --rates 1gbit --ddp-settings powersgd-4,gc-powersgd-4
                                                # two DDP rows, merged into the saved ones (benchmarks/results/ddp/)
"""
from __future__ import annotations

import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Dict, Optional

import click

from . import ddp as ddp_half
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
@click.option("--rounds", type=int, default=None, callback=_positive,
              help="speed rounds: every row timed once per round in turn, the fastest kept; rows of steps "
                   "over 1 s only once [default: 3; 1 with --quick or --iters]")
@click.option("--steps", type=int, default=None, callback=_positive, help="convergence steps [default: 400]")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--skip-speed", is_flag=True, help="only the convergence comparison")
@click.option("--skip-convergence", is_flag=True, help="only the step-time comparison")
@click.option("--docs-dir", default=None, help="where BENCHMARKS.md, img/ and data/ go [default: benchmarks/results]")
@click.option("--job-timeout", type=float, default=420, show_default=True, callback=_positive,
              help="seconds before one 2-rank job is killed")
@click.option("--compile", "compile_mode", type=click.Choice(["auto", "0", "1"]), default="auto", show_default=True,
              help="HVDGC_COMPILE for the ranks (torch.compile of the large-tensor kernels)")
@click.option("--two-hosts", is_flag=True,
              help="speed rows with one rank on each host of scripts/two_hosts.sh (network namespaces hvdgc-a and "
                   "hvdgc-b), across their veth link limited to each rate per direction; needs root")
@click.option("--skip-ddp", is_flag=True, help="leave out the DDP rows and convergence (benchmarks/ddp.py)")
@click.option("--only-ddp", is_flag=True, help="only the DDP rows and convergence; writes DOCS_DIR/ddp/ only")
@click.option("--ddp-settings", default=None,
              help="only these DDP speed rows (comma-separated keys of benchmarks/ddp.py's SPEED_SETTINGS), "
                   "merged into DOCS_DIR/ddp/data.json, keeping its other rows")
@click.option("--dry-run", is_flag=True, help="print the commands and exit")
@click.option("--render-only", is_flag=True,
              help="rewrite BENCHMARKS.md and the plots from DOCS_DIR/data/bench.json without running anything")
def main(quick: bool, rates: Optional[str], params: Optional[float], iters: Optional[int], warmup: Optional[int],
         rounds: Optional[int], steps: Optional[int], seed: int, skip_speed: bool, skip_convergence: bool,
         docs_dir: Optional[str], job_timeout: float, compile_mode: str, two_hosts: bool, skip_ddp: bool, only_ddp: bool,
         ddp_settings: Optional[str], dry_run: bool, render_only: bool) -> None:
    """Entry point of ``python -m benchmarks`` (``make bench``)."""
    if skip_speed and skip_convergence:
        raise click.UsageError("--skip-speed and --skip-convergence together leave nothing to run")
    if skip_ddp and only_ddp:
        raise click.UsageError("--skip-ddp and --only-ddp together leave nothing to run")
    try:
        plan = build_plan(quick, rates, params, iters, warmup, steps, seed, skip_speed, skip_convergence, docs_dir,
                          job_timeout, compile_mode, two_hosts, rounds)
    except click.BadParameter as exc:
        raise click.UsageError(f"--rates: {exc.message}") from None
    only = [k.strip() for k in (ddp_settings or "").split(",") if k.strip()]
    if only and (skip_ddp or skip_speed):
        raise click.UsageError("--ddp-settings picks DDP speed rows: not with --skip-ddp or --skip-speed")
    try:
        ddp = None if skip_ddp else ddp_half.build_ddp_plan(plan, quick, skip_speed, skip_convergence, only=only)
    except ValueError as exc:
        raise click.UsageError(f"--ddp-settings: {exc}") from None
    if only_ddp:
        plan.speed, plan.convergence = [], []
    if dry_run:
        click.echo("\n".join(planned_commands(plan) + (ddp_half.planned_commands(ddp) if ddp else [])))
        return
    if render_only:
        render_saved(plan, only_ddp)
        return
    execute(plan, shlex.join(["python", "-m", "benchmarks", *sys.argv[1:]]), ddp)


def execute(plan: Plan, command: str, ddp: Optional[ddp_half.DdpPlan] = None) -> Dict[str, Any]:
    """Run the plan (and the DDP half, when given), write the report(s); returns the raw figures."""
    from hvd_gradcomp.launchers.progress import progress

    start = time.perf_counter()
    total = len(plan.rates) * len(plan.speed) * plan.rounds + len(plan.convergence) + (ddp.jobs if ddp else 0)
    with progress(total=total, unit="run", desc="benchmark") as bar:
        say = bar.write
        speed = run_speed(plan, say, bar) if plan.speed else {}
        conv = run_convergence(plan, say, bar) if plan.convergence else None
        ddp_parts = ddp_half.run(ddp, say, bar) if ddp and ddp.jobs else None
    elapsed = time.perf_counter() - start
    if ddp_parts:
        page = ddp_half.write_page(ddp, ddp_parts, command, machine_description())
        click.echo(page.read_text())
        click.echo(f"wrote {page} and its raw figures {page.parent / 'data.json'}")
    if not (plan.speed or plan.convergence):
        return {"ddp": ddp_parts}
    data = {"command": command, "machine": machine_description(), "speed": speed, "convergence": conv,
            "elapsed_s": elapsed, "plan": {k: str(v) if isinstance(v, Path) else v for k, v in vars(plan).items()
                                           if k not in ("speed", "convergence")}}
    write_report(plan, data, command, elapsed)
    return data


def render_saved(plan: Plan, only_ddp: bool = False) -> None:
    """Re-render the report from a previous run's raw figures (same numbers, current layout)."""
    page = ddp_half.render_saved(plan.docs_dir)
    if page is not None:
        click.echo(f"rewrote {page}")
    if only_ddp:
        return
    path = plan.docs_dir / "data" / "bench.json"
    if not path.exists():
        raise click.UsageError(f"{path} not found: run python -m benchmarks first (or pass --docs-dir)")
    data = json.loads(path.read_text())
    saved = data["plan"]
    for key in ("params", "warmup", "iters", "batch_size", "steps", "seed", "compile_mode", "rates"):
        setattr(plan, key, saved[key])
    plan.min_seconds = saved.get("min_seconds", 0.0)
    plan.rounds = saved.get("rounds", 1)
    write_report(plan, data, data["command"], data["elapsed_s"])


