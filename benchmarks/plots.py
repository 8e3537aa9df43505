"""PNG plots of a run: step time per setting, loss against step and against wall time."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional

from .plan import CONVERGENCE_LABELS, SPEED_LABELS, SPEED_SETTINGS
from .tables import speed_rows


def plot_all(speed: Dict[str, Any], conv: Optional[Dict[str, Any]], img_dir: Path, params: float) -> Dict[str, Path]:
    """PNG plots: step time per setting (stacked: compute, codec, exposed communication), loss against
    step and against wall time."""
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
        for part in ("compute_s", "codec_s", "exposed_s"):   # stacked: the three parts sum to the step time
            vals = [r[part] for r in rows]
            ax.bar(xs, vals, width, bottom=bottom, color=f"C{i}", hatch=hatches[part], edgecolor="black",
                   linewidth=0.3, alpha=1.0 if part == "compute_s" else 0.55, label=f"{rate}: {names[part]}")
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

