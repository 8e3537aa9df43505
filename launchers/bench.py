"""``hvdgc-bench``: step time over a rate-limited link, and convergence on real data.

1. Speed: ``examples/synthetic_benchmark.py`` (25M parameters by default) on 2 ranks inside a
   network namespace whose loopback is limited by ``tc tbf`` to each ``--rates`` value:
   uncompressed Horovod, Horovod fp16, QSGD 8-bit, QSGD 4-bit, TopK 1%, TopKQSGD(1%, 8).
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

    hvdgc-bench                        # everything (~20 minutes on 2 CPU cores)
    hvdgc-bench --quick                # a small smoke run (< 3 minutes), written under runs/bench-quick
    hvdgc-bench --rates 1gbit --skip-convergence
    hvdgc-bench --two-hosts --skip-convergence   # speed rows across the two-host link
    hvdgc-bench --dry-run              # print the commands, run nothing
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import click

from .two_hosts import horovodrun_across, two_hosts, up_command

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
RATE_RE = re.compile(r"^\d+(\.\d+)?(kbit|mbit|gbit)$")
TBF = {"burst": "256kb", "latency": "50ms"}


@dataclass(frozen=True)
class Setting:
    """One configuration under test: a key, a label for tables, and the example's flags."""

    key: str
    label: str
    flags: Tuple[str, ...]
    error_feedback: Optional[bool] = None


SPEED_SETTINGS = (
    Setting("horovod", "Horovod, uncompressed", ("--optimizer", "stock", "--compression", "none")),
    Setting("fp16", "Horovod fp16", ("--optimizer", "stock", "--compression", "fp16")),
    Setting("qsgd8", "QSGD 8-bit", ("--compression", "qsgd", "--bits", "8"), True),
    Setting("qsgd4", "QSGD 4-bit", ("--compression", "qsgd", "--bits", "4"), True),
    Setting("topk", "TopK 1%", ("--compression", "topk", "--ratio", "0.01"), True),
    Setting("topkqsgd", "TopKQSGD(1%, 8)", ("--compression", "topk-qsgd", "--ratio", "0.01", "--bits", "8"), True),
    # Auto explores 2 steps per road (8 steps) during warm-up, then keeps its decisions.
    Setting("auto", "Auto", ("--compression", "auto", "--ratio", "0.01", "--bits", "8", "--warmup", "9"), True),
)
# DGC momentum correction (see train.py --help) for the TopK rows: each rank applies SGD's momentum
# to its own gradient before TopK, error feedback accumulates that velocity, and the wrapped SGD
# runs without momentum. Same lr and momentum as every row; uncompressed it is exactly momentum SGD.
MOMENTUM_CORRECTION = ("--momentum-correction", "--no-momentum-masking")
CONVERGENCE_SETTINGS = (
    Setting("none", "uncompressed", ("--compression", "none")),
    Setting("fp16", "fp16", ("--compression", "fp16")),
    Setting("qsgd8", "QSGD 8-bit", ("--compression", "qsgd", "--bits", "8", "--error-feedback"), True),
    Setting("qsgd4", "QSGD 4-bit", ("--compression", "qsgd", "--bits", "4", "--error-feedback"), True),
    Setting("topk", "TopK 1%", (*MOMENTUM_CORRECTION, "--compression", "topk", "--ratio", "0.01",
                                "--error-feedback"), True),
    Setting("topkqsgd", "TopKQSGD(1%, 8)",
            (*MOMENTUM_CORRECTION, "--compression", "topk-qsgd", "--ratio", "0.01", "--bits", "8",
             "--error-feedback"), True),
    Setting("topkqsgd-noef", "TopKQSGD(1%, 8), no error feedback",
            ("--compression", "topk-qsgd", "--ratio", "0.01", "--bits", "8", "--no-error-feedback"), False),
)
QUICK_SPEED = ("horovod", "fp16", "topkqsgd", "auto")
QUICK_CONVERGENCE = ("none", "topkqsgd")


@dataclass
class Plan:
    """Everything one ``hvdgc-bench`` run will do (built from the options, before running)."""

    rates: List[str]
    speed: List[Setting]
    convergence: List[Setting]
    params: float
    warmup: int
    iters: int
    batch_size: int
    steps: int
    seed: int
    docs_dir: Path
    runs_dir: Path
    job_timeout: float
    compile_mode: str
    extra: Dict[str, Any] = field(default_factory=dict)
    two_hosts: bool = False  # speed rows: one rank per host of scripts/two_hosts.sh, across its veth link


# ---------------------------------------------------------------- pure command builders
def netns_setup_commands(name: str, rate: str, burst: str = TBF["burst"], latency: str = TBF["latency"]) -> List[List[str]]:
    """Commands that create namespace ``name`` with a loopback limited to ``rate``.

    >>> netns_setup_commands("ns", "1gbit")[-1]
    ['ip', 'netns', 'exec', 'ns', 'tc', 'qdisc', 'add', 'dev', 'lo', 'root', 'tbf', 'rate', '1gbit', 'burst', '256kb', 'latency', '50ms']
    """
    return [
        ["ip", "netns", "add", name],
        ["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"],
        ["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo", "root", "tbf",
         "rate", rate, "burst", burst, "latency", latency],
    ]


def netns_teardown_command(name: str) -> List[str]:
    """The command that deletes namespace ``name`` (and its qdisc with it).

    >>> netns_teardown_command("ns")
    ['ip', 'netns', 'del', 'ns']
    """
    return ["ip", "netns", "del", name]


def in_netns(name: Optional[str], argv: Sequence[str]) -> List[str]:
    """``argv`` run inside namespace ``name`` (unchanged when ``name`` is None).

    >>> in_netns("ns", ["horovodrun", "-np", "2"])
    ['ip', 'netns', 'exec', 'ns', 'horovodrun', '-np', '2']
    """
    return list(argv) if name is None else ["ip", "netns", "exec", name, *argv]


def horovodrun(program: Sequence[str], np: int = 2, bin_dir: Path = Path(sys.executable).parent) -> List[str]:
    """``horovodrun -np 2 -H localhost:2 --gloo <program>`` with the venv's horovodrun."""
    return [str(bin_dir / "horovodrun"), "-np", str(np), "-H", f"localhost:{np}", "--gloo", *program]


def speed_program(plan: Plan, setting: Setting, out_json: Path) -> List[str]:
    """The synthetic benchmark's command line for one setting."""
    return [sys.executable, str(EXAMPLES / "synthetic_benchmark.py"), "--params", f"{plan.params:g}",
            "--batch-size", str(plan.batch_size), "--warmup", str(plan.warmup), "--iters", str(plan.iters),
            "--seed", str(plan.seed), "--label", setting.label, "--json", str(out_json), *setting.flags]


def train_program(plan: Plan, setting: Setting, out_dir: Path) -> List[str]:
    """train.py's command line for one convergence setting (same steps and seed for all)."""
    return [sys.executable, str(EXAMPLES / "train.py"), "--steps", str(plan.steps), "--seed", str(plan.seed),
            "--out-dir", str(out_dir), "--run-name", setting.key, "--no-progress", *setting.flags]


def rank_env(compile_mode: str, base: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """Environment of the ranks: repo importable, Open MPI allowed as root, one thread, no stray HVDGC_*."""
    env = {k: v for k, v in (base if base is not None else os.environ).items() if not k.startswith("HVDGC_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    env["OMP_NUM_THREADS"] = "1"
    env["HVDGC_COMPILE"] = compile_mode
    return env


def parse_rates(text: str) -> List[str]:
    """``"1gbit,10gbit"`` -> ``["1gbit", "10gbit"]``; tc's units kbit/mbit/gbit.

    >>> parse_rates("1gbit, 10gbit")
    ['1gbit', '10gbit']
    """
    rates = [r.strip().lower() for r in text.split(",") if r.strip()]
    bad = [r for r in rates if not RATE_RE.match(r)]
    if not rates or bad:
        raise click.BadParameter(f"expected rates like 1gbit,10gbit,500mbit; got {text!r}")
    return rates


# ---------------------------------------------------------------- running
class JobFailed(RuntimeError):
    """A rank job exited non-zero or ran past its timeout; carries the log's tail."""


def run_job(argv: List[str], env: Dict[str, str], timeout: float, log_path: Path) -> float:
    """Run argv in its own process group, output to ``log_path``; returns seconds. Kills it on timeout."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        log.write(f"$ {shlex.join(argv)}\n")
        log.flush()
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise JobFailed(f"timed out after {timeout:.0f}s (log: {log_path})\n{_tail(log_path)}") from None
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
    if rc != 0:
        raise JobFailed(f"exited {rc} (log: {log_path})\n{_tail(log_path)}")
    return time.perf_counter() - t0


def _tail(path: Path, lines: int = 15) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _quiet(argv: List[str], timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)


@contextmanager
def rate_limited_netns(rate: str, say: Any) -> Iterator[Optional[str]]:
    """A namespace limited to ``rate`` for the duration (always deleted), or None when not allowed."""
    name = f"hvdgc-{uuid.uuid4().hex[:8]}"
    reason = _netns_unavailable()
    if reason is None:
        for cmd in netns_setup_commands(name, rate):
            res = _quiet(cmd)
            if res.returncode != 0:
                reason = f"`{shlex.join(cmd)}` failed: {res.stdout.strip()}"
                break
    if reason is not None:
        _quiet(netns_teardown_command(name))
        say(f"cannot create a rate-limited network namespace ({reason}); running UNTHROTTLED")
        yield None
        return
    try:
        yield name
    finally:
        _quiet(netns_teardown_command(name))


def _netns_unavailable() -> Optional[str]:
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not installed (apt-get install iproute2)"
    if hasattr(os, "geteuid") and os.geteuid() != 0:
        return "needs root (CAP_NET_ADMIN)"
    return None


# How the speed rows of one table ran: the link their traffic crossed.
LINK_MODES = {
    "two-hosts": "two hosts: one rank in each of two network namespaces, across a veth link rate-limited per "
                 "direction",
    "loopback": "one namespace: both ranks on one rate-limited loopback, shared by both directions",
    "unthrottled": "unthrottled: the host's loopback, no rate limit",
}


@contextmanager
def speed_link(plan: Plan, rate: str, say: Any) -> Iterator[Tuple[Any, str]]:
    """``(wrap, mode)`` for the speed jobs at ``rate``: ``wrap(program)`` is the command to run."""
    if plan.two_hosts:
        with two_hosts(rate, say) as ok:
            if ok:
                yield horovodrun_across, "two-hosts"
                return
        say("falling back to one rate-limited namespace")
    with rate_limited_netns(rate, say) as ns:
        yield (lambda program: in_netns(ns, horovodrun(program))), ("loopback" if ns else "unthrottled")


def run_speed(plan: Plan, say: Any, bar: Any) -> Dict[str, Any]:
    """Every speed setting at every rate: {rate: {"throttled": bool, "mode": str, "results": {key: json}}}."""
    out: Dict[str, Any] = {}
    for rate in plan.rates:
        with speed_link(plan, rate, say) as (wrap, mode):
            results, failures = {}, {}
            for setting in plan.speed:
                bar.set_description(f"speed {rate} {setting.label}")
                path = plan.runs_dir / "speed" / f"{rate}-{setting.key}.json"
                argv = wrap(speed_program(plan, setting, path))
                try:
                    run_job(argv, rank_env(plan.compile_mode), plan.job_timeout, path.with_suffix(".log"))
                    results[setting.key] = json.loads(path.read_text())
                    say(_speed_line(rate, setting, results[setting.key]))
                except JobFailed as exc:
                    failures[setting.key] = str(exc)
                    say(f"{rate} {setting.label}: FAILED {exc}")
                bar.update(1)
            out[rate] = {"throttled": mode != "unthrottled", "mode": mode, "results": results, "failures": failures}
    return out


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
                run_job(argv, rank_env(plan.compile_mode), plan.job_timeout, out_dir / f"{setting.key}.log")
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


# ---------------------------------------------------------------- reporting (pure)
def speed_rows(results: Dict[str, Dict[str, Any]], settings: Sequence[Setting]) -> List[Dict[str, Any]]:
    """Table rows with speedups over uncompressed Horovod and over fp16 (None when a baseline is missing).

    >>> rs = speed_rows({"horovod": {"step_s": 2.0, "comm_s": 1.0, "bytes_per_step": 8, "ratio": 1.0,
    ...                  "samples_per_s_total_mean": 4.0, "samples_per_s_total_conf": 0.1}},
    ...                 SPEED_SETTINGS[:1])
    >>> rs[0]["speedup"], rs[0]["comm_share"]
    (1.0, 0.5)
    """
    base = results.get("horovod", {}).get("step_s")
    fp16 = results.get("fp16", {}).get("step_s")
    rows = []
    for s in settings:
        r = results.get(s.key)
        if r is None:
            continue
        codec = r.get("codec_s", 0.0)
        exposed = r.get("exposed_comm_s", r["comm_s"])
        rows.append({"key": s.key, "label": s.label, "step_s": r["step_s"], "comm_s": r["comm_s"],
                     "codec_s": codec, "exposed_s": exposed, "compute_s": max(r["step_s"] - codec - exposed, 0.0),
                     "auto": (r.get("auto") or {}).get("summary"),
                     "comm_share": r["comm_s"] / r["step_s"], "bytes_per_step": r["bytes_per_step"],
                     "ratio": r["ratio"], "samples_s": r["samples_per_s_total_mean"],
                     "samples_s_conf": r["samples_per_s_total_conf"],
                     "speedup": base / r["step_s"] if base else None,
                     "speedup_fp16": fp16 / r["step_s"] if fp16 else None})
    return rows


def _x(v: Optional[float]) -> str:
    return "n/a" if v is None else f"{v:.2f}x"


def render_speed_table(rows: List[Dict[str, Any]]) -> str:
    """Markdown table of :func:`speed_rows`.

    >>> print(render_speed_table([{"label": "A", "step_s": 1.0, "comm_s": 0.25, "comm_share": 0.25,
    ...     "bytes_per_step": 2e6, "ratio": 50.0, "samples_s": 8.0, "samples_s_conf": 1.0,
    ...     "speedup": 3.0, "speedup_fp16": None}]).splitlines()[2])
    | A | 1000.0 | 250.0 | 25.0% | 2.000 | 50.0x | 8.0 +- 1.0 | 3.00x | n/a |
    """
    lines = ["| setting | step time (ms) | in synchronize() (ms) | comm share | MB sent per step per rank | "
             "ratio | samples/s, total (+- 1.96 sigma) | speedup vs uncompressed | speedup vs fp16 |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['label']} | {r['step_s'] * 1e3:.1f} | {r['comm_s'] * 1e3:.1f} | "
                     f"{100 * r['comm_share']:.1f}% | {r['bytes_per_step'] / 1e6:.3f} | {r['ratio']:.1f}x | "
                     f"{r['samples_s']:.1f} +- {r['samples_s_conf']:.1f} | {_x(r['speedup'])} | "
                     f"{_x(r['speedup_fp16'])} |")
    return "\n".join(lines)


def convergence_rows(results: Dict[str, Dict[str, Any]], settings: Sequence[Setting]) -> List[Dict[str, Any]]:
    """Rows with the relative difference of the held-out loss against the uncompressed run.

    >>> rows = convergence_rows({"none": {"val_loss": 2.0, "final_train_loss": 2.1, "val_accuracy": 0.4,
    ...     "bytes_per_step": 100.0, "ratio": 1.0, "wall_s": 10.0, "samples_per_s": 5.0, "steps": 3}},
    ...     CONVERGENCE_SETTINGS[:1])
    >>> rows[0]["val_rel"]
    0.0
    """
    base = results.get("none", {}).get("val_loss")
    rows = []
    for s in settings:
        r = results.get(s.key)
        if r is None:
            continue
        # The policy the run actually used (feedback="auto" turns error feedback off for low-bit QSGD).
        ef = r["feedback"] not in (None, "none") if "feedback" in r else s.error_feedback
        rows.append({"key": s.key, "label": s.label, "ef": ef, "steps": r["steps"],
                     "train_loss": r["final_train_loss"], "val_loss": r["val_loss"], "val_acc": r["val_accuracy"],
                     "val_rel": (r["val_loss"] - base) / base if base else None,
                     "bytes_per_step": r["bytes_per_step"], "ratio": r["ratio"], "wall_s": r["wall_s"],
                     "samples_s": r["samples_per_s"]})
    return rows


def render_convergence_table(rows: List[Dict[str, Any]]) -> str:
    """Markdown table of :func:`convergence_rows`."""
    ef = {None: "-", True: "on", False: "off"}
    lines = ["| setting | error feedback | steps | final train loss | held-out loss | vs uncompressed | "
             "held-out accuracy | kB sent per step per rank | ratio | samples/s | wall time (s) |",
             "| --- | :---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        rel = "n/a" if r["val_rel"] is None else f"{100 * r['val_rel']:+.2f}%"
        lines.append(f"| {r['label']} | {ef[r['ef']]} | {r['steps']} | {r['train_loss']:.4f} | {r['val_loss']:.4f} | "
                     f"{rel} | {r['val_acc']:.3f} | {r['bytes_per_step'] / 1e3:.1f} | {r['ratio']:.1f}x | "
                     f"{r['samples_s']:.0f} | {r['wall_s']:.1f} |")
    return "\n".join(lines)


def target_lines(speed: Dict[str, Any], conv_rows: List[Dict[str, Any]]) -> List[str]:
    """The issue's targets, each marked MET or MISSED with the measured figure."""
    lines = []
    rate = "1gbit" if "1gbit" in speed else next(iter(speed), None)
    rows = {r["key"]: r for r in speed_rows(speed[rate]["results"], SPEED_SETTINGS)} if rate else {}
    t = rows.get("topkqsgd")
    if t is not None:
        lines.append(_target(f"TopKQSGD(1%, 8) step time vs uncompressed Horovod at {rate}", t["speedup"], 3.0, "x"))
        lines.append(_target(f"TopKQSGD(1%, 8) step time vs Horovod fp16 at {rate}", t["speedup_fp16"], 1.5, "x"))
        share = t["comm_share"]
        lines.append(f"- TopKQSGD(1%, 8) communication share of the step at {rate}: {100 * share:.1f}% "
                     f"(target < 5%): **{'MET' if share < 0.05 else 'MISSED'}**")
    lines += auto_target_lines(speed)
    c = {r["key"]: r for r in conv_rows}
    if "topkqsgd" in c and c["topkqsgd"]["val_rel"] is not None:
        rel = c["topkqsgd"]["val_rel"]
        lines.append(f"- TopKQSGD with error feedback, held-out loss relative to uncompressed: {100 * rel:+.2f}% "
                     f"(target within 2%): **{'MET' if abs(rel) <= 0.02 else 'MISSED'}**")
    return lines


def auto_target_lines(speed: Dict[str, Any]) -> List[str]:
    """Auto against the best fixed setting at 1gbit and against uncompressed Horovod at 10gbit (within 5%).

    >>> r = lambda s: {"step_s": s, "comm_s": 0.0, "bytes_per_step": 1, "ratio": 1.0,
    ...                "samples_per_s_total_mean": 1.0, "samples_per_s_total_conf": 0.0}
    >>> auto_target_lines({"10gbit": {"results": {"horovod": r(1.0), "topkqsgd": r(1.2), "auto": r(1.04)}}})
    ['- Auto step time vs uncompressed Horovod at 10gbit: 0.96x (target >= 0.95x): **MET**']
    """
    lines = []
    for rate, against in (("1gbit", "best"), ("10gbit", "horovod")):
        results = speed.get(rate, {}).get("results", {})
        if "auto" not in results:
            continue
        fixed = {k: v["step_s"] for k, v in results.items() if k != "auto"}
        key = min(fixed, key=fixed.get) if against == "best" and fixed else against
        if key not in fixed:
            continue
        what = f"best fixed setting ({SPEED_LABELS.get(key, key)})" if against == "best" else "uncompressed Horovod"
        lines.append(_target(f"Auto step time vs {what} at {rate}", fixed[key] / results["auto"]["step_s"], 0.95, "x"))
    return lines


def _target(what: str, value: Optional[float], goal: float, unit: str) -> str:
    if value is None:
        return f"- {what}: not measured (baseline missing)"
    return f"- {what}: {value:.2f}{unit} (target >= {goal:g}{unit}): **{'MET' if value >= goal else 'MISSED'}**"


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
    return {"cpu": cpu, "cores": str(os.cpu_count()), "memory": mem_gib, "os": _os_name(),
            "python": platform.python_version(), "torch": torch.__version__, "horovod": hvd_version,
            "gpu": "none" if not torch.cuda.is_available() else torch.cuda.get_device_name(0)}


def _os_name() -> str:
    try:
        for ln in Path("/etc/os-release").read_text().splitlines():
            if ln.startswith("PRETTY_NAME="):
                return ln.split("=", 1)[1].strip('"')
    except OSError:
        pass
    return platform.platform()


def render_markdown(plan: Plan, machine: Dict[str, str], speed: Dict[str, Any], conv: Optional[Dict[str, Any]],
                    command: str, elapsed_s: float, images: Dict[str, str]) -> str:
    """The whole BENCHMARKS.md."""
    conv_rows = convergence_rows(conv["results"], CONVERGENCE_SETTINGS) if conv else []
    out = [
        "# Benchmarks", "",
        f"Generated by `{command}` on {datetime.date.today().isoformat()} in {elapsed_s / 60:.1f} minutes. "
        "Every number on this page comes from that run; rerun the command to regenerate the page, the plots "
        f"(`{_rel(plan.docs_dir)}/img/`) and the raw figures (`{_rel(plan.docs_dir)}/data/bench.json`).", "",
        "## Machine", "",
        f"- CPU: {machine['cpu']}, {machine['cores']} cores, {machine['memory']} memory, GPU: {machine['gpu']}",
        f"- {machine['os']}, Python {machine['python']}, PyTorch {machine['torch']}, Horovod {machine['horovod']} (Gloo)",
        f"- 2 ranks on this one machine, `torch.set_num_threads(1)` per rank, `HVDGC_COMPILE={plan.compile_mode}`", "",
        "## Conditions", "",
        *_condition_lines(plan, speed, conv), "",
    ]
    if speed:
        out += _speed_section(plan, speed, images)
    if conv:
        out += _convergence_section(plan, conv, conv_rows, images)
    targets = target_lines(speed, conv_rows) if speed or conv_rows else []
    if targets:
        out += ["## Targets", "", *targets, ""]
    return "\n".join(out).rstrip() + "\n"


def _rel(path: Path) -> str:
    """``path`` relative to the repository when inside it."""
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def _condition_lines(plan: Plan, speed: Dict[str, Any], conv: Optional[Dict[str, Any]]) -> List[str]:
    throttled = all(v["throttled"] for v in speed.values()) and (conv is None or conv["throttled"])
    if throttled:
        link = (f"Each setting runs as `ip netns exec NS horovodrun -np 2 -H localhost:2 --gloo ...` in a fresh "
                f"network namespace whose loopback is limited by `tc qdisc add dev lo root tbf rate RATE "
                f"burst {TBF['burst']} latency {TBF['latency']}`; both ranks' traffic (both directions) "
                "crosses that one link.")
    else:
        link = ("**Unthrottled**: the network namespace could not be created (see the command's output), so "
                "the ranks talked over the host's loopback and the rate labels below do not apply.")
    if any(block.get("mode") == "two-hosts" for block in speed.values()):
        link = ("Tables titled *two hosts* ran as `bash scripts/two_hosts.sh exec hvdgc-a horovodrun -np 2 "
                "-H hvdgc-a:1,hvdgc-b:1 --network-interface hvdgc0 --gloo ...` (`hvdgc-bench --two-hosts`): one "
                "rank in each of two network namespaces joined by a veth pair, each end limited by `tc qdisc "
                f"replace dev hvdgc0 root tbf rate RATE burst {TBF['burst']} latency {TBF['latency']}`, so each "
                "direction has its own link, as between two machines. " + link)
    return [
        f"- {link}",
        f"- Speed: `examples/synthetic_benchmark.py --params {plan.params:g} --batch-size {plan.batch_size} "
        f"--warmup {plan.warmup} --iters {plan.iters}`: square 2048-wide Linear layers, one fixed random batch. "
        "Step time is the mean over timed steps and ranks; *in synchronize()* is the time the optimizer "
        "waited for exchanges to finish and decoded them (exposed communication); bytes are those each rank "
        "handed to Horovod per step. Horovod rows use `hvd.DistributedOptimizer`, the others "
        "`hvd_gradcomp.DistributedOptimizer`.",
        f"- Convergence: `examples/train.py --steps {plan.steps} --seed {plan.seed}` (character-level MLP on the "
        "standard library's sources, micro-batch 32, SGD lr 0.05 momentum 0.9) on 2 ranks, at "
        f"{conv['rate'] if conv else '-'}; the held-out loss is on 4,096 fixed windows of text not trained on. "
        "Every row uses the same steps, seed, lr and momentum; every tensor of at least 1,024 elements is "
        "compressed and there is no sparsity warm-up.",
        f"- TopK 1% and TopKQSGD(1%, 8) with error feedback pass `{' '.join(MOMENTUM_CORRECTION)}`: DGC's "
        "momentum correction (Lin et al., 2018): each rank applies the momentum 0.9 to its own gradient "
        "before TopK, error feedback accumulates that velocity, and the wrapped SGD has no momentum of its "
        "own (uncompressed, this is exactly momentum SGD: held-out loss 2.4927 either way). Measured separately "
        "when this was chosen, with the momentum applied after the exchange instead (plain `torch.optim.SGD`, "
        "as the other rows), TopKQSGD(1%, 8) with error feedback ended at 2.5611 (+2.74%), with it at 2.5217 "
        "(+1.16%); TopK 1%: +2.78% and +1.29%.",
        "- Noise: at 400 steps the loss still falls by ~0.1 per 100 steps and compressed runs lag by a roughly "
        "constant number of steps, so one run's gap moves with its trajectory: uncompressed runs with seeds "
        "0, 1, 2 end at 2.4927, 2.4644, 2.5245 (about +-1.2%).",
    ]


def _speed_section(plan: Plan, speed: Dict[str, Any], images: Dict[str, str]) -> List[str]:
    out = ["## Step time over a rate-limited link", ""]
    if "step_time" in images:
        out += [f"![step time per setting]({images['step_time']})", ""]
    for rate, block in speed.items():
        mode = block.get("mode", "loopback" if block["throttled"] else "unthrottled")
        title = f"{rate}, {LINK_MODES[mode]}" if mode != "unthrottled" else f"{rate} requested, ran unthrottled"
        rows = speed_rows(block["results"], plan.speed)
        out += [f"### {title}", "", render_speed_table(rows), ""]
        out += [f"- Auto's decisions: {r['auto']}" for r in rows if r.get("auto")]
        out += [f"- {SPEED_LABELS.get(k, k)}: failed: `{v.splitlines()[0]}`" for k, v in block["failures"].items()]
    return out


def _convergence_section(plan: Plan, conv: Dict[str, Any], rows: List[Dict[str, Any]],
                         images: Dict[str, str]) -> List[str]:
    out = ["## Convergence on real data", "", render_convergence_table(rows), "",
           "*final train loss*: mean of the last 10% of steps' training loss (averaged over ranks); "
           "*vs uncompressed*: relative difference of the held-out loss.", ""]
    for key in ("loss_vs_step", "loss_vs_time"):
        if key in images:
            out += [f"![{key.replace('_', ' ')}]({images[key]})", ""]
    out += [f"- {CONVERGENCE_LABELS.get(k, k)}: failed: `{v.splitlines()[0]}`" for k, v in conv["failures"].items()]
    if conv["failures"]:
        out.append("")
    return out


SPEED_LABELS = {s.key: s.label for s in SPEED_SETTINGS}
CONVERGENCE_LABELS = {s.key: s.label for s in CONVERGENCE_SETTINGS}


# ---------------------------------------------------------------- plots
def plot_all(speed: Dict[str, Any], conv: Optional[Dict[str, Any]], img_dir: Path, params: float) -> Dict[str, Path]:
    """PNG plots: step time per setting, loss against step and against wall time."""
    import matplotlib
    matplotlib.use("Agg")
    img_dir.mkdir(parents=True, exist_ok=True)
    paths: Dict[str, Path] = {}
    if speed:
        paths["step_time"] = _plot_step_time(speed, img_dir / "step_time.png", params)
    if conv and conv["results"]:
        paths["loss_vs_step"] = _plot_curves(conv["results"], "step", "optimizer step", img_dir / "loss_vs_step.png")
        paths["loss_vs_time"] = _plot_curves(conv["results"], "wall_s", "wall time (s)", img_dir / "loss_vs_time.png")
    return paths


def _plot_step_time(speed: Dict[str, Any], path: Path, params: float) -> Path:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    rates = list(speed)
    keys = [s.key for s in SPEED_SETTINGS if any(s.key in speed[r]["results"] for r in rates)]
    width = 0.8 / max(len(rates), 1)
    hatches = {"compute_s": "", "codec_s": "//", "exposed_s": ".."}
    names = {"compute_s": "compute", "codec_s": "codec", "exposed_s": "exposed comm"}
    for i, rate in enumerate(rates):
        rows = speed_rows(speed[rate]["results"], SPEED_SETTINGS)
        xs = [keys.index(r["key"]) + (i - (len(rates) - 1) / 2) * width for r in rows]
        bottom = [0.0] * len(rows)
        for part in ("compute_s", "codec_s", "exposed_s"):
            vals = [r[part] for r in rows]
            ax.bar(xs, vals, width, bottom=bottom, color=f"C{i}", hatch=hatches[part], edgecolor="black",
                   linewidth=0.3, alpha=1.0 if part == "compute_s" else 0.55,
                   label=f"{rate}: {names[part]}")
            bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xticks(range(len(keys)), [SPEED_LABELS[k] for k in keys], rotation=15, fontsize=8)
    ax.set_ylabel("step time (s): compute, codec, exposed communication")
    ax.set_title(f"{params / 1e6:g}M-parameter synthetic model, 2 ranks: step time per setting")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_curves(results: Dict[str, Any], x_key: str, xlabel: str, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for key, r in results.items():
        curve = r["curve"]
        label = CONVERGENCE_LABELS.get(key, key)
        ax.plot(curve[x_key], _smooth(curve["loss"]), label=label, linewidth=1.2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("training loss (moving average of 10 steps)")
    ax.set_title("Character-level LM on stdlib sources, 2 ranks")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _smooth(values: List[float], window: int = 10) -> List[float]:
    """Trailing moving average.

    >>> _smooth([1.0, 3.0, 5.0], window=2)
    [1.0, 2.0, 4.0]
    """
    out = []
    for i in range(len(values)):
        chunk = values[max(0, i - window + 1):i + 1]
        out.append(sum(chunk) / len(chunk))
    return out


# ---------------------------------------------------------------- the command
def build_plan(quick: bool, rates: Optional[str], params: Optional[float], iters: Optional[int],
               warmup: Optional[int], steps: Optional[int], seed: int, skip_speed: bool,
               skip_convergence: bool, docs_dir: Optional[str], job_timeout: float, compile_mode: str,
               two_hosts: bool = False) -> Plan:
    """Options -> :class:`Plan` (``--quick`` picks small defaults, explicit options win).

    >>> p = build_plan(True, None, None, None, None, None, 0, False, False, None, 300, "auto")
    >>> p.rates, [s.key for s in p.speed], p.steps
    (['1gbit'], ['horovod', 'fp16', 'topkqsgd', 'auto'], 40)
    """
    speed = [] if skip_speed else [s for s in SPEED_SETTINGS if not quick or s.key in QUICK_SPEED]
    conv = [] if skip_convergence else [s for s in CONVERGENCE_SETTINGS if not quick or s.key in QUICK_CONVERGENCE]
    docs = Path(docs_dir) if docs_dir else (ROOT / "runs" / "bench-quick" if quick else ROOT / "docs")
    return Plan(rates=parse_rates(rates or ("1gbit" if quick else "100mbit,1gbit,10gbit")), speed=speed, convergence=conv,
                params=params or (5e6 if quick else 25e6), warmup=warmup if warmup is not None else (1 if quick else 3),
                iters=iters or (3 if quick else 10), batch_size=4, steps=steps or (40 if quick else 400), seed=seed,
                docs_dir=docs, runs_dir=ROOT / "runs" / ("bench-quick" if quick else "bench"),
                job_timeout=job_timeout, compile_mode=compile_mode, two_hosts=two_hosts)


def planned_commands(plan: Plan) -> List[str]:
    """Every command the plan runs, as shell-quoted lines (``--dry-run``)."""
    lines = []
    for rate in plan.rates:
        if plan.two_hosts:
            lines.append(shlex.join(up_command(rate)))
        else:
            lines += [shlex.join(c) for c in netns_setup_commands("NS", rate)]
        for s in plan.speed:
            path = plan.runs_dir / "speed" / f"{rate}-{s.key}.json"
            program = speed_program(plan, s, path)
            cmd = horovodrun_across(program) if plan.two_hosts else in_netns("NS", horovodrun(program))
            lines.append(shlex.join(cmd))
        lines.append(shlex.join(["bash", "scripts/two_hosts.sh", "down"] if plan.two_hosts
                                else netns_teardown_command("NS")))
    for s in plan.convergence:
        lines.append(shlex.join(in_netns("NS", horovodrun(train_program(plan, s, plan.runs_dir / "convergence")))))
    return lines


def _positive(ctx: Any, param: Any, value: Any) -> Any:
    if value is not None and value <= 0:
        raise click.BadParameter("must be > 0")
    return value


@click.command(context_settings={"help_option_names": ["-h", "--help"]}, help=__doc__.split("\n\n")[0])
@click.option("--quick", is_flag=True, help="small smoke run (< 3 min), written under runs/bench-quick/")
@click.option("--rates", default=None, help="link rates, comma-separated tc units  [default: 100mbit,1gbit,10gbit]")
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
    """Entry point of ``hvdgc-bench``."""
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
    execute(plan, "hvdgc-bench " + shlex.join(sys.argv[1:]) if sys.argv[1:] else "hvdgc-bench")


def execute(plan: Plan, command: str) -> Dict[str, Any]:
    """Run the plan, write the report; returns the raw figures."""
    from tqdm import tqdm

    start = time.perf_counter()
    total = len(plan.rates) * len(plan.speed) + len(plan.convergence)
    with tqdm(total=total, unit="run", dynamic_ncols=True, file=sys.stdout) as bar:
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
        raise click.UsageError(f"{path} not found: run hvdgc-bench first (or pass --docs-dir)")
    data = json.loads(path.read_text())
    saved = data["plan"]
    for key in ("params", "warmup", "iters", "batch_size", "steps", "seed", "compile_mode", "rates"):
        setattr(plan, key, saved[key])
    write_report(plan, data, data["command"], data["elapsed_s"])


def write_report(plan: Plan, data: Dict[str, Any], command: str, elapsed: float) -> None:
    """BENCHMARKS.md, img/*.png and data/bench.json under ``plan.docs_dir``."""
    (plan.docs_dir / "data").mkdir(parents=True, exist_ok=True)
    (plan.docs_dir / "data" / "bench.json").write_text(json.dumps(data, indent=1, default=str) + "\n")
    images = plot_all(data["speed"], data["convergence"], plan.docs_dir / "img", plan.params)
    rel = {k: os.path.relpath(v, plan.docs_dir) for k, v in images.items()}
    md = render_markdown(plan, data["machine"], data["speed"], data["convergence"], command, elapsed, rel)
    path = plan.docs_dir / "BENCHMARKS.md"
    path.write_text(md)
    click.echo(md)
    click.echo(f"wrote {path}, {len(images)} plots in {plan.docs_dir / 'img'}, raw figures in "
               f"{plan.docs_dir / 'data' / 'bench.json'} ({elapsed / 60:.1f} min)")


if __name__ == "__main__":
    main()
