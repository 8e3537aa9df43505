"""The recipe study (``study.py --recipes``): its worker drives each road as a user does and writes the
records recipe_report.py reads; the page benchmarks/results/RECIPES.md is the rendering of the saved runs. Its
``lightning`` road (``study.py --config lightning``) is its ``ddp`` road through Lightning's ``Trainer``."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.study import recipe_report, recipes
from tests.harness import ROOT, horovodrun_argv, launch, rank_env
from tests.torchrun_jobs import run_torchrun

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
    """benchmarks/results/RECIPES.md comes from benchmarks/results/data/recipes (``study.py --recipes --report-only`` rewrites it)."""
    saved = ROOT / "benchmarks/results/data/recipes"
    page = (ROOT / "benchmarks/results/RECIPES.md").read_text()
    command = page.split("from the runs of `", 1)[1].split("`", 1)[0]
    recipe_report.write(saved, tmp_path, command)
    assert (tmp_path / "RECIPES.md").read_text() == page
    runs = recipe_report.load(saved)
    for recipe in ("nanogpt", "tied-1e-3", "tied-2e-3", "lstm", "bert-ft", "cnn-bn"):
        for road in ("none", "stock", "gc", "ddp"):
            rs = runs[(recipe, road)]
            assert len(rs) == 3 and all(r["identical"] for r in rs), (recipe, road)
            assert not any(r["diverged"] for r in rs), (recipe, road)


@pytest.mark.timeout(400)
def test_lightning_road_is_the_ddp_road_through_the_trainer() -> None:
    """The worker's ``lightning`` road (``Trainer(strategy=GradCompStrategy(...))``) trains what its ``ddp``
    road trains, bit for bit, once the parameters carry the same names (the rounding noise is drawn per
    name): the same batches, rates per step, evaluations and bytes. AdamW past ``frozen``'s dense warm-up,
    momentum SGD, and the LSTM's clipping as ``gradient_clip_val`` against the compressor's ``clip=``."""
    jobs = [{"recipe": "nanogpt", "steps": 110, "seed": 1}, {"recipe": "cnn-bn", "steps": 12, "seed": 0},
            {"recipe": "lstm", "steps": 6, "seed": 0}]
    per_rank = run_torchrun(ROOT / "benchmarks" / "tests" / "recipe_lightning_worker.py", jobs, timeout=360)
    for rank in per_rank:
        for job, r in zip(jobs, rank):
            assert r["identical"] and r["evals_equal"] and r["sent_equal"], (job, r)
            assert r["evals"] == len([s for s in range(1, job["steps"] + 1) if recipes.evals_due(s, job["steps"])])
            assert r["last_sent"] < r["raw"] / 4, (job, r)   # the compressed phase was reached
    nanogpt, cnn, lstm = per_rank[0]
    assert (nanogpt["feedback"], cnn["feedback"], lstm["feedback"]) == ("frozen", "momentum", "classic")
    assert lstm["clip"] == 0.25 and cnn["clip"] is None   # gradient_clip_val became the compressor's clip=


def test_worker_writes_the_lightning_road_record(tmp_path: Path) -> None:
    """``--roads lightning`` under torchrun writes the record the pages read; it runs alone."""
    out = tmp_path / "recipes"
    res = launch([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", WORKER,
                  "--recipe", "cnn-bn", "--roads", "lightning", "--seed", "1", "--steps", "4", "--out", str(out)],
                 300, rank_env())
    assert res.returncode == 0, res.output
    (r,) = _records(out, ["cnn-bn-lightning-s1"])
    assert r["road"] == "lightning" and r["identical"] and r["steps"] == 4 and len(r["evals"]) == 5, r
    assert r["feedback"] == "momentum" and r["ratio_whole_run"] > 1 and 0 < r["val_loss"] < 10 and r["distance"] > 0
    refused = subprocess.run([sys.executable, WORKER, "--recipe", "cnn-bn", "--roads", "lightning,ddp"],
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "the lightning road runs alone, under torchrun" in refused.stderr
