"""Tables and targets from a run's raw figures (pure functions, tested with exact values)."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

from .plan import (REFERENCE_KEYS, SPEED_LABELS, SPEED_SETTINGS, TARGET_AUTO, TARGET_COMM_SHARE, TARGET_LOSS_GAP,
                   TARGET_SPEEDUP_VS_FP16, TARGET_SPEEDUP_VS_HOROVOD, CONVERGENCE_SETTINGS, Setting)  # noqa: F401 (doctest)


def speed_rows(results: Dict[str, Dict[str, Any]], settings: Sequence[Setting]) -> List[Dict[str, Any]]:
    """Table rows with speedups over uncompressed Horovod and over fp16 (None when a baseline is missing).

    The step splits into compute, codec (encode + decode) and exposed communication; a run
    without ``codec_s``/``exposed_comm_s`` (uncompressed Horovod) counts all of ``comm_s`` as
    exposed. ``auto`` is Auto's summary of its decisions, when the row is Auto. A reference row
    (no exchange at all) has no speedup: it does not train the same model on every rank.

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
        rows.append({"key": s.key, "label": s.label, "reference": s.reference, "step_s": r["step_s"], "comm_s": r["comm_s"],
                     "imbalance_s": r.get("imbalance_s"),
                     "codec_s": codec, "exposed_s": exposed, "compute_s": max(r["step_s"] - codec - exposed, 0.0),
                     "auto": (r.get("auto") or {}).get("summary"),
                     "comm_share": r["comm_s"] / r["step_s"], "bytes_per_step": r["bytes_per_step"],
                     "ratio": r["ratio"], "samples_s": r["samples_per_s_total_mean"],
                     "samples_s_conf": r["samples_per_s_total_conf"],
                     "speedup": base / r["step_s"] if base and not s.reference else None,
                     "speedup_fp16": fp16 / r["step_s"] if fp16 and not s.reference else None})
    return rows


def _x(v: Optional[float]) -> str:
    return "n/a" if v is None else f"{v:.2f}x"


def render_speed_table(rows: List[Dict[str, Any]]) -> str:
    """Markdown table of :func:`speed_rows`.

    >>> print(render_speed_table([{"label": "A", "step_s": 1.0, "comm_s": 0.25, "comm_share": 0.25,
    ...     "imbalance_s": 0.05, "bytes_per_step": 2e6, "ratio": 50.0, "samples_s": 8.0, "samples_s_conf": 1.0,
    ...     "speedup": 3.0, "speedup_fp16": None}]).splitlines()[2])
    | A | 1000.0 | 250.0 | 50.0 | 25.0% | 2.000 | 50.0x | 8.0 +- 1.0 | 3.00x | n/a |
    """
    lines = ["| setting | step time (ms) | in synchronize() (ms) | of which waiting for the last rank (ms) | "
             "comm share | MB sent per step per rank | "
             "ratio | samples/s, total (+- 1.96 sigma) | speedup vs uncompressed | speedup vs fp16 |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        wait = "n/a" if r.get("imbalance_s") is None else f"{r['imbalance_s'] * 1e3:.1f}"
        ratio = "n/a" if r.get("reference") else f"{r['ratio']:.1f}x"   # 4 bytes sent: no compression ratio
        lines.append(f"| {r['label']} | {r['step_s'] * 1e3:.1f} | {r['comm_s'] * 1e3:.1f} | {wait} | "
                     f"{100 * r['comm_share']:.1f}% | {r['bytes_per_step'] / 1e6:.3f} | {ratio} | "
                     f"{r['samples_s']:.1f} +- {r['samples_s_conf']:.1f} | {_x(r['speedup'])} | "
                     f"{_x(r['speedup_fp16'])} |")
    return "\n".join(lines)


def speedup_line(rate: str, rows: List[Dict[str, Any]]) -> Optional[str]:
    """One line per rate: TopKQSGD's and Auto's speedups over uncompressed Horovod and over fp16.

    >>> speedup_line("100mbit", [{"key": "topkqsgd", "label": "TopKQSGD(1%, 8)", "speedup": 9.0,
    ...                           "speedup_fp16": 4.5}])
    '- Speedup at 100mbit: TopKQSGD(1%, 8) 9.00x over uncompressed Horovod, 4.50x over Horovod fp16'
    """
    parts = [f"{r['label']} {_x(r['speedup'])} over uncompressed Horovod, {_x(r['speedup_fp16'])} over Horovod fp16"
             for r in rows if r["key"] in ("topkqsgd", "auto")]
    return f"- Speedup at {rate}: " + "; ".join(parts) if parts else None


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
        lines.append(_target(f"TopKQSGD(1%, 8) step time vs uncompressed Horovod at {rate}", t["speedup"],
                             TARGET_SPEEDUP_VS_HOROVOD, "x"))
        lines.append(_target(f"TopKQSGD(1%, 8) step time vs Horovod fp16 at {rate}", t["speedup_fp16"],
                             TARGET_SPEEDUP_VS_FP16, "x"))
        share = t["comm_share"]
        lines.append(f"- TopKQSGD(1%, 8) communication share of the step at {rate}: {100 * share:.1f}% "
                     f"(target < {100 * TARGET_COMM_SHARE:g}%): **{'MET' if share < TARGET_COMM_SHARE else 'MISSED'}**")
        if t.get("imbalance_s") is not None:
            last = (t["comm_s"] - t["imbalance_s"]) / t["step_s"]
            lines.append(f"  - of it, {1e3 * t['imbalance_s']:.1f} ms per step is the ranks waiting for the last one to "
                         f"finish its backward (load imbalance); the last rank's own time in synchronize() is "
                         f"{100 * last:.1f}% of the step")
        floor = rows.get("barrier")
        if floor is not None:
            lines.append(f"  - with nothing to exchange (the *{floor['label']}* row: the same model's step with a "
                         f"1-float allreduce in place of the exchange) the ranks spent {100 * floor['comm_share']:.1f}% "
                         f"of the step ({1e3 * floor['comm_s']:.1f} ms) waiting there for the slower one: the floor "
                         f"any synchronous step has on this machine")
    lines += auto_target_lines(speed)
    c = {r["key"]: r for r in conv_rows}
    if "topkqsgd" in c and c["topkqsgd"]["val_rel"] is not None:
        rel = c["topkqsgd"]["val_rel"]
        lines.append(f"- TopKQSGD with error feedback, held-out loss relative to uncompressed: {100 * rel:+.2f}% "
                     f"(target within {100 * TARGET_LOSS_GAP:g}%): "
                     f"**{'MET' if abs(rel) <= TARGET_LOSS_GAP else 'MISSED'}**")
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
        fixed = {k: v["step_s"] for k, v in results.items() if k != "auto" and k not in REFERENCE_KEYS}
        key = min(fixed, key=fixed.get) if against == "best" and fixed else against
        if key not in fixed:
            continue
        what = f"best fixed setting ({SPEED_LABELS.get(key, key)})" if against == "best" else "uncompressed Horovod"
        lines.append(_target(f"Auto step time vs {what} at {rate}", fixed[key] / results["auto"]["step_s"],
                             TARGET_AUTO, "x"))
    return lines


def auto_start_line(rate: str, results: Dict[str, Dict[str, Any]]) -> Optional[str]:
    """Auto's step time with its start counted: its row's step time is its steady state (its
    exploration, probe and first verification run in its longer warm-up), so this line adds the
    mean over every step after the warm-up the other rows had, exploration included. Both from
    rank 0's own step times (the row's figure is the mean over ranks).

    >>> auto = {"warmup": 4, "iters": 2, "step_s": 1.0, "warmup_step_times_s": [9.0, 3.0, 2.0, 2.0],
    ...         "step_times_s": [1.0, 1.0]}
    >>> auto_start_line("1gbit", {"horovod": {"warmup": 1}, "auto": auto})
    "- Auto at 1gbit (rank 0's step times), steady state (after its 4 warm-up steps): 1000.0 ms/step; with its start counted (every step after the 1 warm-up step of the other rows, exploration and probes included): 1800.0 ms/step"
    """
    auto = results.get("auto")
    others = [r["warmup"] for k, r in results.items() if k != "auto" and "warmup" in r]
    if not auto or not others or "warmup_step_times_s" not in auto:
        return None
    skip = min(others)
    counted = auto["warmup_step_times_s"][skip:] + auto["step_times_s"]
    if not counted:
        return None
    with_start = sum(counted) / len(counted)
    steady = sum(auto["step_times_s"]) / len(auto["step_times_s"])
    plural = "s" if skip != 1 else ""
    return (f"- Auto at {rate} (rank 0's step times), steady state (after its {auto['warmup']} warm-up steps): "
            f"{1e3 * steady:.1f} ms/step; with its start counted (every step after the {skip} warm-up "
            f"step{plural} of the other rows, exploration and probes included): {1e3 * with_start:.1f} ms/step")


def _target(what: str, value: Optional[float], goal: float, unit: str) -> str:
    if value is None:
        return f"- {what}: not measured (baseline missing)"
    return f"- {what}: {value:.2f}{unit} (target >= {goal:g}{unit}): **{'MET' if value >= goal else 'MISSED'}**"


