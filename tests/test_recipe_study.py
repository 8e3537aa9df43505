"""The recipe study (``study.py --recipes``): its worker drives each road as a user does and writes the
records recipe_report.py reads; the page docs/RECIPES.md is the rendering of the saved runs."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from benchmarks.study import recipe_report
from tests.harness import ROOT, horovodrun_argv, launch, rank_env

pytestmark = pytest.mark.multirank

WORKER = str(ROOT / "benchmarks/study/recipe_worker.py")


def _records(out: Path, names) -> list:
    return [json.loads((out / f"{n}.json").read_text()) for n in names]


def test_worker_drives_every_road_and_writes_what_the_report_reads(tmp_path: Path) -> None:
    out = tmp_path / "recipes"
    args = ["--recipe", "lstm", "--seed", "0", "--steps", "6", "--out", str(out)]
    res = launch(horovodrun_argv(2, "gloo", [sys.executable, WORKER, "--roads", "none,stock,gc", *args]),
                 300, rank_env())
    assert res.returncode == 0, res.output
    res = launch([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", WORKER,
                  "--roads", "ddp", "--setting", "clip=0.25", *args], 300, rank_env())
    assert res.returncode == 0, res.output
    none, stock, gcr, ddp = _records(out, ["lstm-none-s0", "lstm-stock-s0", "lstm-gc-s0", "lstm-ddp+clip=0.25-s0"])
    for r in (none, stock, gcr, ddp):
        assert r["identical"] and r["steps"] == 6 and 0 < r["val_loss"] < 10 and r["distance"] > 0, r
    assert none["ratio_whole_run"] == none["ratio_steady"] == 1.0
    for r in (stock, gcr, ddp):   # plain SGD: TopKQSGD from the first step, ~100x
        assert r["feedback"] == "classic" and r["ratio_whole_run"] > 50 and r["ratio_steady"] > 50, r
    assert ddp["extra"] == {"clip": 0.25}
    runs = recipe_report.load(out)
    table, _ = recipe_report.rows("lstm", runs)
    assert any(" | reference | " in line for line in table) and len(table) == 2 + 4


def test_recipes_page_is_the_rendering_of_its_saved_runs(tmp_path: Path) -> None:
    """docs/RECIPES.md comes from docs/data/recipes (``study.py --recipes --report-only`` rewrites it)."""
    saved = ROOT / "docs/data/recipes"
    page = (ROOT / "docs/RECIPES.md").read_text()
    command = page.split("from the runs of `", 1)[1].split("`", 1)[0]
    recipe_report.write(saved, tmp_path, command)
    assert (tmp_path / "RECIPES.md").read_text() == page
    runs = recipe_report.load(saved)
    for recipe in ("nanogpt", "tied-1e-3", "tied-2e-3", "lstm", "bert-ft", "cnn-bn"):
        for road in ("none", "stock", "gc", "ddp"):
            rs = runs[(recipe, road)]
            assert len(rs) == 3 and all(r["identical"] for r in rs), (recipe, road)
            assert not any(r["diverged"] for r in rs), (recipe, road)
