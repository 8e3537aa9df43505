"""benchmarks/results/RECIPES.md from the recipe study's JSON results (``study.py --recipes``; generated, never typed),
and benchmarks/results/LIGHTNING_CHECK.md (:func:`lightning_check`: the ``lightning`` road beside the saved rows).

Every recipe gets one row per road: held-out loss (mean over seeds, and each seed), the gap to
uncompressed training beside the uncompressed seed spread, the target (3% or that spread,
whichever is larger), divergence, bytes over the whole run and in its second half, and whether
the ranks ended with identical parameters.
"""
from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

from benchmarks.study.recipes import RECIPES, ROADS

TARGET = 0.03
"""The gap allowed: 3% of uncompressed held-out loss, or the uncompressed seed spread if larger."""

VARIANTS = {"+clip=0.25": "the same, clipping with the compressor's `clip=0.25` instead of by hand",
            "+feedback=classic": "with classic error feedback (`feedback=\"classic\"`: what the hook ran for Adafactor "
                                 "before it ran `\"update\"`, issue 61)"}
"""Rows beyond the default roads: a setting the library recommends, or one it ran before, passed as the
compressor's argument."""


def load(out: Path) -> Dict[Tuple[str, str], List[dict]]:
    """Results by (recipe, row), a row being the road plus any setting (``gc+clip=0.25``)."""
    runs: Dict[Tuple[str, str], List[dict]] = defaultdict(list)
    for path in sorted(out.glob("*-s*.json")):
        r = json.loads(path.read_text())
        tag = "".join(f"+{k}={v}" for k, v in sorted(r.get("extra", {}).items()))
        runs[(r["recipe"], r["road"] + tag)].append(r)
    return runs


def spread(losses: List[float]) -> float:
    """max - min over seeds (0 for one seed)."""
    return max(losses) - min(losses) if len(losses) > 1 else 0.0


def paired_gaps(rs: List[dict], base: Dict[int, float]) -> List[float]:
    """Each run's held-out loss against the reference run of its seed (``base``: seed -> loss), relative.

    >>> paired_gaps([{"seed": 0, "val_loss": 2.2}, {"seed": 5, "val_loss": 1.0}], {0: 2.0})
    [0.10000000000000009]
    """
    return [(r["val_loss"] - base[r["seed"]]) / base[r["seed"]] for r in rs if r["seed"] in base]


def allowed_gap(base: Dict[int, float]) -> float:
    """The target: :data:`TARGET`, or the reference's seed spread relative to its mean if larger."""
    return max(TARGET, spread(list(base.values())) / statistics.fmean(base.values()))


def verdict(gap: float, allowed: float, diverged: int) -> str:
    """How a row compares with uncompressed training.

    >>> verdict(0.01, 0.03, 0), verdict(0.05, 0.03, 0), verdict(-0.06, 0.03, 0), verdict(0.0, 0.03, 1)
    ('within', '**over**', 'better (see below)', '**diverged**')
    """
    if diverged:
        return "**diverged**"
    if gap > allowed:
        return "**over**"
    if gap < -allowed:
        return "better (see below)"
    return "within"


def compressed_rows(runs: Dict[Tuple[str, str], List[dict]]) -> List[dict]:
    """Every recipe's compressed roads at their defaults (no probe, no setting): gap, target, verdict,
    bytes; what the README's sentence counts."""
    out = []
    for recipe in RECIPES:
        base = {r["seed"]: r["val_loss"] for r in runs.get((recipe, "none"), [])}
        if not base:
            continue
        allowed = allowed_gap(base)
        for road in ("stock", "gc", "ddp"):
            rs = runs.get((recipe, road), [])
            gaps = paired_gaps(rs, base)
            if not gaps:
                continue
            gap = statistics.fmean(gaps)
            out.append({"recipe": recipe, "road": road, "gap": gap, "allowed": allowed, "seeds": len(rs),
                        "verdict": verdict(gap, allowed, sum(bool(r["diverged"]) for r in rs)),
                        "whole": statistics.fmean(r["ratio_whole_run"] for r in rs),
                        "steady": statistics.fmean(r["ratio_steady"] for r in rs)})
    return out


def rows(recipe: str, runs: Dict[Tuple[str, str], List[dict]]) -> Tuple[List[str], List[str]]:
    """The recipe's table (markdown lines), and the rows far better than uncompressed."""
    base = runs.get((recipe, "none"), [])
    if not base:
        return [f"No uncompressed run of `{recipe}` yet."], []
    by_seed = {r["seed"]: r["val_loss"] for r in base}
    ref = statistics.fmean(by_seed.values())
    allowed = allowed_gap(by_seed)
    lines = ["| road | held-out loss (mean; per seed) | gap (mean; per seed) | uncompressed spread | "
             "verdict | bytes saved, whole run | second half | replicas identical | distance moved |",
             "| --- | --- | --- | ---: | --- | ---: | ---: | --- | ---: |"]
    better = []
    keys = sorted(((rec, row) for (rec, row) in runs if rec == recipe or rec.startswith(recipe + "@")),
                  key=lambda k: (k[0] != recipe, list(ROADS).index(k[1].split("+")[0]), k[1]))
    for rec, row in keys:
        rs = sorted(runs[(rec, row)], key=lambda r: r["seed"])
        losses = [r["val_loss"] for r in rs]
        # a compressed road of a probe against uncompressed training of the same probe
        ref_seed = by_seed if rec == recipe or row == "none" else \
            {r["seed"]: r["val_loss"] for r in runs.get((rec, "none"), [])}
        gaps = paired_gaps(rs, ref_seed)
        gap = statistics.fmean(gaps) if gaps else float("nan")
        div = sum(bool(r["diverged"]) for r in rs)
        road, _, setting = row.partition("+")
        label = ROADS[road] + (f" {VARIANTS.get('+' + setting, '`' + setting + '`')}" if setting else "")
        if rec != recipe:   # a probe of the recipe with one setting changed: "lstm@clip0.1", "nanogpt@0.004"
            probe = rec.split("@", 1)[1]
            label += ", the recipe " + (f"clipped at {probe[4:]}" if probe.startswith("clip") else f"at peak rate {probe}")
        per_seed = ", ".join(f"{x:.3f}" for x in losses)
        per_gap = ", ".join(f"{g:+.1%}" for g in gaps)
        is_ref = row == "none" and rec == recipe
        v = "reference" if is_ref else "(another step)" if row == "none" else verdict(gap, allowed, div)
        if rec != recipe and row != "none":
            label += " (gap against uncompressed training at the same rate)"
            v = v.replace(" (see below)", "")   # a probe: the list below is of the recipes' own rows
        if v.startswith("better") and rec == recipe and row != "none":
            better.append(f"{recipe}: {label} {gap:+.1%}")
        lines.append(
            f"| {label} | {statistics.fmean(losses):.3f} ({per_seed}) | "
            f"{'' if is_ref else f'{gap:+.1%} ({per_gap})'} | {spread(list(by_seed.values())) / ref:.1%} | {v} | "
            f"{statistics.fmean(r['ratio_whole_run'] for r in rs):.1f}x | "
            f"{statistics.fmean(r['ratio_steady'] for r in rs):.0f}x | "
            f"{'yes' if all(r['identical'] for r in rs) else '**no**'} ({len(rs)} seeds) | {_distance(rs)} |")
    return lines, better


MECHANISM = {
    "adamw": "After its dense warm-up `feedback=\"frozen\"` divides by the second moment of the warm-up's "
             "last 50 steps and follows gradients that shrink (`follow_scale=\"down\"`), while Adam's own "
             "`v` still remembers the larger gradients of the first steps (about `1/(1 - b2)` of them) and "
             "shortens every step as the gradients fall: over a few hundred steps the compressed roads can "
             "take longer steps than the recipe's Adam, which the runs below measure.",
    "adafactor": "Under `feedback=\"update\"` each rank steps its own Adafactor on its local gradient and the "
                 "parameter change goes through error feedback: each rank's factored second moment sees only "
                 "its share of the batch, and clipping by hand no longer reaches the compressed tensors' "
                 "updates, so the compressed step is not the recipe's step.",
    "sgd": "The recipe's plain SGD takes the step its learning rate and clipping give; error feedback "
           "delivers each coordinate's held-back gradients in one piece and, under momentum SGD, DGC's "
           "momentum correction accumulates the momentum itself, so the compressed step is not the "
           "recipe's step.",
}
"""Why a compressed road can end below uncompressed training, per optimizer; each recipe's probe rows
(uncompressed training at another step) say how much of the gap the step explains."""


def explain(recipe: str, runs: Dict[Tuple[str, str], List[dict]]) -> List[str]:
    """The paragraph on ``recipe``'s compressed roads ending below uncompressed training: the mechanism,
    then its probes (uncompressed at another step) and the distance the weights moved, measured."""
    base = {r["seed"]: r["val_loss"] for r in runs.get((recipe, "none"), [])}
    said = [f"**`{recipe}`.** {MECHANISM[RECIPES[recipe].optimizer]}"]
    probes = []   # (probe, mean gap): uncompressed training at another step
    for (rec, row), rs in sorted(runs.items()):
        gaps = paired_gaps(rs, base) if rec.startswith(recipe + "@") and row == "none" else []
        if gaps:
            probe = rec.split("@", 1)[1]
            probes.append((probe, statistics.fmean(gaps)))
            what = f"clipped at {probe[4:]}" if probe.startswith("clip") else f"at peak rate {probe}"
            said.append(f"Uncompressed training {what} ends at {statistics.fmean(r['val_loss'] for r in rs):.3f} "
                        f"({probes[-1][1]:+.1%} against the recipe's, {len(rs)} seeds).")
    comp_gaps = [g for road in ("stock", "gc", "ddp") for g in paired_gaps(runs.get((recipe, road), []), base)]
    best = min(probes, key=lambda x: x[1], default=None)
    if comp_gaps and best is not None:
        cg = statistics.fmean(comp_gaps)
        if best[1] <= cg / 2:
            said.append(f"Uncompressed training at another step reaches {best[1]:+.1%} (the compressed roads: "
                        f"{cg:+.1%}): the recipe's step is not the best one for this run, and the compressed "
                        "roads' effective step is not the recipe's.")
        else:
            said.append(f"No probe of another step gets there ({best[1]:+.1%} at best, against {cg:+.1%}): the "
                        "step's length does not explain the gap alone; the rest is left open here.")
    moved = {row: [r["distance"] for r in rs if "distance" in r] for (rec, row), rs in runs.items()
             if rec == recipe and "+" not in row}
    if moved.get("none") and any(v for k, v in moved.items() if k != "none"):
        comp = [d for k, v in moved.items() if k != "none" for d in v]
        c, u = statistics.fmean(comp), statistics.fmean(moved["none"])
        said.append(f"The weights moved {c:.1f} from their start on the compressed roads, {u:.1f} uncompressed "
                    f"({'further' if c > u else 'not further'}).")
    return [" ".join(said), ""]


def before_section(before: Path, runs: Dict[Tuple[str, str], List[dict]]) -> List[str]:
    """The runs of the code before the fixes (``benchmarks/results/data/recipes_before``: the same worker on a
    checkout of that commit) beside the same runs now."""
    old = load(before) if before.is_dir() else {}
    if not old:
        return []
    lines = ["## Before the fixes", "",
             "The same worker (`recipes.py`, `recipe_worker.py` copied into a checkout of the commit named) "
             "on the code before `FrozenVariance` bounded each gradient's step by Adam's (`1/sqrt(1 - b2)` "
             "times the rate), e.g. `git worktree add /tmp/old 40933ca`, then from there "
             "`horovodrun -np 2 -H localhost:2 --gloo python benchmarks/study/recipe_worker.py --recipe "
             "tied-2e-3 --peak 0.008 --roads none,gc --seed 0 --out benchmarks/results/data/recipes_before`. Seed 0:", "",
             "| recipe | road | code | held-out loss then | diverged then | held-out loss now (seed 0) |",
             "| --- | --- | --- | ---: | --- | ---: |"]
    for (rec, row), rs in sorted(old.items()):
        r = rs[0]
        now = [x["val_loss"] for x in runs.get((rec, row), []) if x["seed"] == r["seed"]]
        lines.append(f"| `{rec}` | {ROADS[row.split('+')[0]]} | {r['code']} | {r['val_loss']:.3f} | "
                     f"{'**yes**' if r['diverged'] else 'no'} | {f'{now[0]:.3f}' if now else '-'} |")
    return lines + [""]


def _distance(rs: List[dict]) -> str:
    """Mean distance the weights moved from their start (L2), over the seeds that recorded it."""
    ds = [r["distance"] for r in rs if "distance" in r]
    return f"{statistics.fmean(ds):.1f}" if ds else "-"


def write(out: Path, docs: Path, command: str, page: str = "RECIPES.md",
          title: str = "Recipes as users write them") -> Path:
    """Write benchmarks/results/RECIPES.md (or ``page``, under the heading ``title``: a configuration of its own, e.g.
    benchmarks/results/ADAFACTOR.md) from the results under ``out``; returns its path."""
    runs = load(out)
    recipes = [r for r in RECIPES if any(rec == r for rec, _ in runs)]
    text = [f"# {title}",
            "",
            "Generated by `benchmarks/study/recipe_report.py` from the runs of "
            f"`{command}` (results under `{out.name}/`); never typed.",
            "",
            "Each recipe is written the way the training script it comes from writes it (model, parameter "
            "groups, optimizer, schedule set through `param_groups`, clipping), not the way this library's "
            "own tasks do: `benchmarks/study/recipes.py`. Every road runs it on 2 ranks (Gloo), "
            "`TopKQSGD(ratio=0.01, bits=8)` with every other setting at its default; uncompressed training "
            "is `hvd.DistributedOptimizer` without compression (the DDP hook's gap is taken against it too: "
            "the same average of the same gradients). The gap is the held-out loss at the last step "
            "against uncompressed training on the same seed; the target is "
            f"{TARGET:.0%} or the uncompressed seed spread (max - min over seeds, relative), whichever is "
            "larger. A run diverged when it ends above its own starting held-out loss. Bytes: what one "
            "rank handed to the collectives against float32 gradients, over the whole run and over its "
            "second half (after `feedback=\"frozen\"`'s dense warm-up, for AdamW).",
            ""]
    all_better: List[str] = []
    for recipe in recipes:
        table, better = rows(recipe, runs)
        all_better += better
        text += [f"## `{recipe}`", "", RECIPES[recipe].what + ".", "", *table, ""]
    text += ["## Results better than uncompressed", ""]
    if all_better:
        text += [f"- {b}" for b in all_better] + [""]
        text += [line for recipe in recipes if any(b.startswith(recipe + ":") for b in all_better)
                 for line in explain(recipe, runs)]
    else:
        text += ["None beyond the target.", ""]
    if page == "RECIPES.md":   # the runs before the fixes are of RECIPES.md's recipes
        text += before_section(out.parent / "recipes_before", runs)
    path = docs / page
    path.write_text("\n".join(text))
    return path


def _pct(x: float) -> str:
    return "-" if x != x else f"{x:+.1%}"


def _loss(x: float) -> str:
    return "-" if x != x else f"{x:.4f}"


LIGHTNING_ROWS = (("none", False, "uncompressed (saved)"), ("ddp", False, "DDP hook (saved)"),
                  ("ddp", True, "DDP hook (this code)"), ("lightning", True, "Lightning"))
"""The rows of benchmarks/results/LIGHTNING_CHECK.md's run table: (road, whether run with the Lightning runs, label)."""


def lightning_check(out: Path, saved: Path, command: str, names: Sequence[str], seeds: Sequence[int]) -> str:
    """benchmarks/results/LIGHTNING_CHECK.md: each recipe and seed through Lightning's ``Trainer`` with ``GradCompStrategy``
    (runs under ``out``) beside the recipe study's saved uncompressed and DDP-hook rows of the same seed
    (``saved``) and the DDP hook rerun on the code of the Lightning runs (``out``), every gap beside the
    uncompressed seed spread of benchmarks/results/RECIPES.md."""
    now, before = load(out), load(saved)

    def loss(runs: Dict[Tuple[str, str], List[dict]], recipe: str, road: str, seed: int) -> float:
        return next((r["val_loss"] for r in runs.get((recipe, road), []) if r["seed"] == seed), float("nan"))

    text = ["# Lightning check: the recipes through `GradCompStrategy`", "",
            "Generated by `benchmarks/study/recipe_report.py` from the runs of "
            f"`{command}` (results under `{out.name}/`, beside the recipe study's `{saved.name}/`); never typed.",
            "",
            "Each recipe of [RECIPES.md](RECIPES.md) trained through Lightning as its integration page shows it "
            "([INTEGRATIONS.md](../../docs/INTEGRATIONS.md)): `Trainer(accelerator=\"cpu\", devices=2, "
            "strategy=GradCompStrategy(compression=gc.TopKQSGD(ratio=0.01, bits=8, seed=1000 * seed + rank)), "
            "max_steps=...)` under torchrun, 2 ranks (Gloo). The `LightningModule` holds the recipe's model "
            "(`self.net`) and returns the recipe's optimizer with its parameter groups from "
            "`configure_optimizers`; `on_train_batch_start` sets the rate of each optimizer step as the "
            "recipe's schedule says; the recipe's clipping, where it clips, is `gradient_clip_val` (the "
            "strategy makes it the compressor's `clip=`). What is the same as on the DDP hook's road "
            "(`benchmarks/study/recipe_worker.py --roads ddp`): the weights at the start, each rank's batches "
            "(its own draws, in order, one per step), the rate per step, the compressor and its seed, the "
            "held-out set and loss. What differs: Lightning steps with a closure (the hook applies each update in "
            "that same step, as `backward()` then `step()` would), and the parameters' names begin with `net.`: "
            "the compressor's rounding noise is drawn per parameter name, so it is not the DDP road's noise. "
            "With the names matched the two roads give bit-identical weights, evaluations and bytes "
            "(tests/test_recipe_study.py), so a gap between them here is that noise's.", "",
            "*Uncompressed* and *DDP hook (saved)*: the recipe study's rows of the same seed "
            "(`hvd.DistributedOptimizer` without compression, and `hvd_gradcomp.ddp.register`), run on the "
            "code versions named below; *DDP hook (this code)*: that road rerun with the Lightning runs. Each "
            "gap is relative to the second loss named (the same seed); the *uncompressed seed spread* is "
            "RECIPES.md's (max - min over its seeds, relative to their mean); the target is RECIPES.md's: "
            f"{TARGET:.0%} or that spread, whichever is larger.", ""]
    summary = []
    for recipe in names:
        base = {r["seed"]: r["val_loss"] for r in before.get((recipe, "none"), [])}
        if not base:
            text += [f"## `{recipe}`", "", f"No saved uncompressed run of `{recipe}` under `{saved.name}/`.", ""]
            continue
        rel_spread, allowed = spread(list(base.values())) / statistics.fmean(base.values()), allowed_gap(base)
        text += [f"## `{recipe}`", "", RECIPES[recipe].what + ".", "",
                 "| seed | uncompressed | DDP hook (saved) | DDP hook (this code) | Lightning | Lightning against "
                 "uncompressed | Lightning against DDP hook (saved) | Lightning against DDP hook (this code) | "
                 "DDP hook (saved) against uncompressed | uncompressed seed spread |",
                 "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        gaps: Dict[str, List[float]] = defaultdict(list)
        for seed in seeds:
            none, ddp, ddp_now, lit = (loss(before, recipe, "none", seed), loss(before, recipe, "ddp", seed),
                                       loss(now, recipe, "ddp", seed), loss(now, recipe, "lightning", seed))
            row = {"none": lit / none - 1, "ddp": lit / ddp - 1, "ddp_now": lit / ddp_now - 1, "saved": ddp / none - 1}
            for k, v in row.items():
                if v == v:
                    gaps[k].append(v)
            text.append(f"| {seed} | {_loss(none)} | {_loss(ddp)} | {_loss(ddp_now)} | {_loss(lit)} | {_pct(row['none'])} | "
                        f"{_pct(row['ddp'])} | {_pct(row['ddp_now'])} | {_pct(row['saved'])} | {rel_spread:.1%} |")
        mean = {k: statistics.fmean(v) if v else float("nan") for k, v in gaps.items()}
        text += [f"| mean | | | | | {_pct(mean.get('none', float('nan')))} | {_pct(mean.get('ddp', float('nan')))} | "
                 f"{_pct(mean.get('ddp_now', float('nan')))} | {_pct(mean.get('saved', float('nan')))} | "
                 f"{rel_spread:.1%} |", ""]
        lit_runs = [r for r in now.get((recipe, "lightning"), []) if r["seed"] in seeds]
        if lit_runs and "none" in mean:
            v = verdict(mean["none"], allowed, sum(bool(r["diverged"]) for r in lit_runs)).replace(
                " (see below)", " (as the recipe's compressed roads: [RECIPES.md](RECIPES.md#results-better-than-"
                "uncompressed) says why)")
            near = abs(mean.get("ddp", float("nan"))) <= rel_spread
            saved_ddp = {r["seed"]: r.get("evals") for r in before.get((recipe, "ddp"), [])}
            reruns = [r for r in now.get((recipe, "ddp"), []) if r["seed"] in seeds]
            same = sum(r.get("evals") is not None and r["evals"] == saved_ddp.get(r["seed"]) for r in reruns)
            summary.append(f"- `{recipe}`: through Lightning {_pct(mean['none'])} against uncompressed training "
                           f"({len(lit_runs)} seeds; target {allowed:.1%}): {v}; the DDP hook's saved rows of the "
                           f"same seeds {_pct(mean.get('saved', float('nan')))}. Lightning against them "
                           f"{_pct(mean.get('ddp', float('nan')))}, "
                           f"{'within' if near else '**outside**'} the uncompressed seed spread ({rel_spread:.1%}). "
                           f"The DDP hook rerun on the Lightning runs' code gives every held-out evaluation of the "
                           f"saved run on {same} of {len(reruns)} seeds.")
    text += ["## Summary", "", *(summary or ["No Lightning run yet."]), "", "## Runs", "",
             "| recipe | seed | road | code | feedback | held-out loss | accuracy | bytes saved, whole run | "
             "second half | replicas identical | seconds |",
             "| --- | ---: | --- | --- | --- | ---: | ---: | ---: | ---: | --- | ---: |"]
    for recipe in names:
        for road, fresh, label in LIGHTNING_ROWS:
            runs = now if fresh else before
            for r in sorted((r for r in runs.get((recipe, road), []) if r["seed"] in seeds), key=lambda r: r["seed"]):
                text.append(f"| `{recipe}` | {r['seed']} | {label} | {r['code']} | {r['feedback'] or '-'} | "
                            f"{r['val_loss']:.4f} | {r['val_accuracy']:.3f} | {r['ratio_whole_run']:.1f}x | "
                            f"{r['ratio_steady']:.0f}x | {'yes' if r['identical'] else '**no**'} | {r['wall_s']:.0f} |")
    return "\n".join(text) + "\n"
