"""Running the plan: every speed setting at every rate, then every convergence setting,
each a 2-rank job through :func:`hvd_gradcomp.launchers.jobs.run_job`; a failed job is recorded, not fatal.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

from hvd_gradcomp.launchers.jobs import rank_env, run_job, tail

from .netns import in_netns, rate_limited_netns
from .plan import (BIND_CORES, CPU_ALLOCATOR, ROOT, Plan, Setting, fastest, horovodrun, repeats, speed_path,
                   speed_program, train_program)
from .two_hosts import horovodrun_across, two_hosts


class JobFailed(RuntimeError):
    """A rank job exited non-zero or ran past its timeout; carries the log's tail."""


def run_logged(argv: List[str], plan: Plan, log_path: Path) -> float:
    """One job, output to ``log_path``; returns its seconds, raises :class:`JobFailed`."""
    res = run_job(argv, rank_env(ROOT, {"HVDGC_COMPILE": plan.compile_mode, **CPU_ALLOCATOR}), plan.job_timeout, cwd=ROOT,
                  output=log_path)
    if res.timed_out:
        raise JobFailed(f"timed out after {plan.job_timeout:.0f}s (log: {log_path})\n{tail(res.output)}")
    if not res.ok:
        raise JobFailed(f"exited {res.returncode} (log: {log_path})\n{tail(res.output)}")
    return res.seconds


@contextmanager
def speed_link(plan: Plan, rate: str, say: Any) -> Iterator[Tuple[Any, str]]:
    """``(wrap, mode)`` for the speed jobs at ``rate``: ``wrap(program)`` is the command to run,
    ``mode`` a key of :data:`benchmarks.netns.LINK_MODES` (the link the traffic crosses)."""
    if plan.two_hosts:
        with two_hosts(rate, say) as ok:
            if ok:
                yield horovodrun_across, "two-hosts"
                return
        say("falling back to one rate-limited namespace")
    with rate_limited_netns(rate, say) as ns:
        yield (lambda program: in_netns(ns, horovodrun(program))), ("loopback" if ns else "unthrottled")


def run_speed(plan: Plan, say: Any, bar: Any) -> Dict[str, Any]:
    """Every speed setting at every rate, in ``plan.rounds`` rounds (every setting once per round, in
    turn; later rounds only the rows :func:`~benchmarks.plan.repeats` names), each row's fastest round
    kept: {rate: {"throttled": bool, "mode": str, "results": {key: json}, "failures": {key: text}}}."""
    out: Dict[str, Any] = {}
    for rate in plan.rates:
        with speed_link(plan, rate, say) as (wrap, mode):
            rounds: Dict[str, List[Dict[str, Any]]] = {}
            failures: Dict[str, str] = {}
            for n in range(plan.rounds):
                for setting in plan.speed:
                    first = rounds.get(setting.key, [None])[0]   # None: its first round failed
                    if n == 0 or (setting.key not in failures and repeats(first)):
                        bar.set_description(f"speed {rate} {setting.label}, round {n + 1}/{plan.rounds}")
                        _time_row(plan, rate, setting, n, wrap, rounds, failures, say)
                    bar.update(1)
            results = {key: fastest(runs) for key, runs in rounds.items()}
            out[rate] = {"throttled": mode != "unthrottled", "mode": mode, "results": results, "failures": failures}
    return out


def _time_row(plan: Plan, rate: str, setting: Setting, round_no: int, wrap: Any,
              rounds: Dict[str, List[Dict[str, Any]]], failures: Dict[str, str], say: Any) -> None:
    """One round of one speed row: its JSON appended to ``rounds[key]``, or its failure recorded."""
    path = speed_path(plan.runs_dir, rate, setting, round_no)
    tag = f" (round {round_no + 1}/{plan.rounds})" if plan.rounds > 1 else ""
    try:
        run_logged(wrap(speed_program(plan, setting, path)), plan, path.with_suffix(".log"))
        result = json.loads(path.read_text())
        rounds.setdefault(setting.key, []).append(result)
        say(_speed_line(rate, setting, result) + tag)
    except JobFailed as exc:
        failures[setting.key] = f"round {round_no + 1}: {exc}" if round_no else str(exc)
        say(f"{rate} {setting.label}{tag}: FAILED {exc}")


def _speed_line(rate: str, setting: Setting, r: Dict[str, Any]) -> str:
    return (f"{rate:>7} {setting.label:<22} step {r['step_s'] * 1e3:8.1f} ms, comm {100 * r['comm_share']:5.1f}%, "
            f"{r['bytes_per_step'] / 1e6:8.3f} MB/step")


def run_convergence(plan: Plan, say: Any, bar: Any) -> Dict[str, Any]:
    """train.py for every convergence setting, inside the first rate's namespace."""
    rate = plan.rates[0]
    out_dir = plan.runs_dir / "convergence"
    results, failures = {}, {}
    with rate_limited_netns(rate, say) as ns:
        for setting in plan.convergence:
            bar.set_description(f"convergence {setting.label}")
            argv = in_netns(ns, horovodrun(train_program(plan, setting, out_dir)))
            try:
                run_logged(argv, plan, out_dir / f"{setting.key}.log")
                summary = json.loads((out_dir / f"{setting.key}.json").read_text())
                summary["curve"] = _read_curve(out_dir / f"{setting.key}.csv")
                results[setting.key] = summary
                say(f"convergence {setting.label:<36} held-out loss {summary['val_loss']:.4f}, "
                    f"accuracy {summary['val_accuracy']:.3f}")
            except JobFailed as exc:
                failures[setting.key] = str(exc)
                say(f"convergence {setting.label}: FAILED {exc}")
            bar.update(1)
        throttled = ns is not None
    return {"rate": rate, "throttled": throttled, "results": results, "failures": failures}


def _read_curve(path: Path) -> Dict[str, List[float]]:
    import csv

    with open(path) as fh:
        rows = list(csv.DictReader(fh))
    return {k: [float(r[k]) for r in rows] for k in ("step", "loss", "wall_s")}


def machine_description() -> Dict[str, str]:
    """CPU, cores, memory, OS and library versions of this machine."""
    import torch

    cpu = platform.processor() or "unknown"
    try:
        names = [ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                 if ln.startswith("model name")]
        cpu = names[0] if names else cpu
        mem = next(ln.split()[1] for ln in Path("/proc/meminfo").read_text().splitlines() if ln.startswith("MemTotal"))
        mem_gib = f"{int(mem) / 2**20:.1f} GiB"
    except (OSError, StopIteration):
        mem_gib = "unknown"
    try:
        from importlib.metadata import version
        hvd_version = version("horovod")
    except Exception:
        hvd_version = "unknown"
    return {"date": datetime.date.today().isoformat(), "cpu": cpu, "cores": str(os.cpu_count()), "memory": mem_gib, "os": _os_name(),
            "python": platform.python_version(), "torch": torch.__version__, "horovod": hvd_version,
            "gpu": "none" if not torch.cuda.is_available() else torch.cuda.get_device_name(0),
            "bind_cores": BIND_CORES, "cpu_allocator": CPU_ALLOCATOR}


def _os_name() -> str:
    try:
        for ln in Path("/etc/os-release").read_text().splitlines():
            if ln.startswith("PRETTY_NAME="):
                return ln.split("=", 1)[1].strip('"')
    except OSError:
        pass
    return platform.platform()


