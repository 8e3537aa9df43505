"""benchmarks/study: its one runner (``study.py --config NAME``) over the configurations of
``configs.py``. The study's workers on 2 ranks, a few steps, each writing the record report.py
reads (Horovod and DDP); every page with saved results is the rendering of them by the command it
names; the checks' short real runs on 2 ranks write their tables; what a configuration does not
have is refused, naming what it has."""
from __future__ import annotations

import json
import re
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.study import configs, pages, report, study
from tests.harness import ROOT, horovodrun_argv, launch, rank_env

pytestmark = pytest.mark.multirank

RUNNER = [sys.executable, str(ROOT / "benchmarks/study/study.py")]


def _check(res, out: Path, names) -> list:
    assert res.returncode == 0, res.output
    records = [json.loads((out / f"{n}.json").read_text()) for n in names]
    for r in records:
        assert r["steps"] == 4 and len(r["evals"]) == 5 and r["ranks"] == 2, r
        assert 0 < r["val_loss"] < 10 and r["raw_bytes_per_step"] > 0 and r["ratio_second_half"] >= 1
    return records


def test_horovod_and_ddp_workers_write_the_records_the_report_reads(tmp_path: Path) -> None:
    out = tmp_path / "study"
    args = ["--seed", "0", "--steps", "4", "--out", str(out)]
    res = launch(horovodrun_argv(2, "gloo", [sys.executable, str(ROOT / "benchmarks/study/worker.py"),
                                             "--task", "char-mlp", "--settings", "none,tq1", *args]), 300, rank_env())
    none, tq1 = _check(res, out, ["char-mlp-none-s0", "char-mlp-tq1-s0"])
    assert (none["feedback"], tq1["feedback"]) == (None, "momentum")   # the library's choice for momentum SGD
    assert tq1["ratio_second_half"] > 10 * none["ratio_second_half"]
    res = launch(configs.command("transformer-ddp", 0, ["none", "tq1"], out, steps=4), 300, rank_env())
    none, tq1 = _check(res, out, ["transformer-ddp-none-s0", "transformer-ddp-tq1-s0"])
    assert tq1["feedback"] == "frozen" and tq1["wrapper"] == "ddp"
    # 4 steps: all inside frozen's dense warm-up; the small tensors (biases, norms) still go as float16
    # (exempt="fp16"): the loss matched exactly on session 10's CI machine, within 1 ulp on session 11's
    assert tq1["val_loss"] == pytest.approx(none["val_loss"], rel=1e-5)
    page = report.render(out, tmp_path / "docs", command="test", minutes=0.1)
    assert "## char-mlp" in page and "## transformer-ddp" in page and "| transformer-ddp |" in page


def test_every_configuration_has_its_page_and_a_renderer() -> None:
    """Every configuration renders a page that exists under benchmarks/results/ and keeps its results in the
    checkout; ``study.py --list`` names each with its page; ``--recipes`` is ``--config recipes``."""
    for name, c in configs.CONFIGS.items():
        assert c.name == name and (ROOT / "benchmarks" / "results" / c.page).is_file() and callable(c.render) and callable(c.jobs), c
        assert c.about and not Path(c.out).is_absolute() and set(c.default_tasks) <= set(c.tasks), c
        assert set(c.default_settings) <= set(c.settings), c
    res = subprocess.run(RUNNER + ["--list"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    listed = {line.split()[0]: line for line in res.stdout.splitlines()}
    assert list(listed) == list(configs.CONFIGS)
    assert all(f"(benchmarks/results/{c.page})" in listed[n] for n, c in configs.CONFIGS.items())
    assert study.make_run(["--recipes"]).config.name == "recipes" and study.make_run([]).config.name == "study"


@pytest.mark.parametrize("config", ["run-length", "powersgd", "wrapper", "outside", "recipes", "adafactor",
                                    "lightning"])
def test_a_page_is_the_rendering_of_its_saved_results(config: str, tmp_path: Path) -> None:
    """The page's own command, with ``--report-only`` into another folder, writes the page as committed
    (benchmarks/results/STUDY.md names its date and minutes: its tables are tested above)."""
    page = ROOT / "benchmarks" / "results" / configs.CONFIGS[config].page
    command = re.search(r"`(python benchmarks/study/study\.py[^`]*)`", page.read_text()).group(1)
    run = study.make_run(shlex.split(command)[2:] + ["--docs", str(tmp_path), "--report-only"])
    assert run.config.name == config and run.command == command
    assert run.config.render(run) == page.read_text()


def test_lightning_check_plans_one_torchrun_job_per_missing_run(tmp_path: Path) -> None:
    """``--config lightning``: an AdamW and a momentum-SGD recipe, seeds 0 and 1, each on the ``lightning``
    road and the ``ddp`` road rerun beside it, under torchrun; a run whose result is kept is not planned."""
    run = study.make_run(["--config", "lightning", "--out", str(tmp_path)])
    jobs = run.config.jobs(run)
    assert [j.what for j in jobs] == [f"{name} seed {seed}: {road}" for seed in (0, 1) for name in ("nanogpt", "cnn-bn")
                                      for road in ("ddp", "lightning")]
    assert all(j.argv[1:3] == ["-m", "torch.distributed.run"] and j.argv[j.argv.index("--out") + 1] == str(tmp_path)
               for j in jobs)
    assert jobs[1].argv[-8:] == ["--recipe", "nanogpt", "--roads", "lightning", "--seed", "0", "--out", str(tmp_path)]
    (tmp_path / "nanogpt-lightning-s0.json").write_text("{}")
    assert [j.what for j in run.config.jobs(run)] == [j.what for j in jobs if j.what != "nanogpt seed 0: lightning"]


def test_lightning_check_sets_every_gap_beside_the_uncompressed_seed_spread(tmp_path: Path) -> None:
    """Each seed's Lightning run against the saved uncompressed and DDP-hook runs of that seed and the DDP
    hook rerun, the uncompressed spread over its saved seeds beside every gap, the verdict in the summary."""
    def write(folder: Path, road: str, losses: list) -> None:
        folder.mkdir(exist_ok=True)
        for seed, loss in enumerate(losses):
            (folder / f"nanogpt-{road}-s{seed}.json").write_text(json.dumps({
                "recipe": "nanogpt", "road": road, "seed": seed, "extra": {}, "val_loss": loss, "val_accuracy": 0.5,
                "evals": [{"step": 0, "val_loss": 3.0}, {"step": 10, "val_loss": loss}],
                "code": "abc", "feedback": None if road == "none" else "frozen", "ratio_whole_run": 5.0,
                "ratio_steady": 90.0, "identical": True, "wall_s": 10.0, "diverged": False}))
    saved, out = tmp_path / "recipes", tmp_path / "lightning"
    write(saved, "none", [2.0, 2.1, 2.2])            # spread 0.2 / 2.1: 9.5%
    write(saved, "ddp", [1.9, 2.0])
    write(out, "ddp", [1.95])                         # seed 1 not rerun
    write(out, "lightning", [1.94, 2.1])
    page = configs.recipe_report.lightning_check(out, saved, "cmd", ["nanogpt"], [0, 1])
    rows = [ln for ln in page.splitlines() if ln.startswith("| 0 |") or ln.startswith("| 1 |")
            or ln.startswith("| mean |")]
    assert rows == ["| 0 | 2.0000 | 1.9000 | 1.9500 | 1.9400 | -3.0% | +2.1% | -0.5% | -5.0% | 9.5% |",
                    "| 1 | 2.1000 | 2.0000 | - | 2.1000 | +0.0% | +5.0% | - | -4.8% | 9.5% |",
                    "| mean | | | | | -1.5% | +3.6% | -0.5% | -4.9% | 9.5% |"]
    assert "- `nanogpt`: through Lightning -1.5% against uncompressed training (2 seeds; target 9.5%): within; " \
           "the DDP hook's saved rows of the same seeds -4.9%. Lightning against them +3.6%, within the " \
           "uncompressed seed spread (9.5%). The DDP hook rerun on the Lightning runs' code gives every held-out " \
           "evaluation of the saved run on 0 of 1 seeds." in page
    write(out, "ddp", [1.9])                          # the rerun gives the saved run's evaluations
    assert "on 1 of 1 seeds." in configs.recipe_report.lightning_check(out, saved, "cmd", ["nanogpt"], [0, 1])
    assert "`cmd`" in page and page.count("| `nanogpt` |") == 2 + 2 + 1 + 2   # seeds 0, 1 of the saved, the reruns


def test_run_length_page_sets_each_gap_beside_the_longer_runs() -> None:
    """Per task, the study's gap and the longer runs' gap, each against the uncompressed run of the
    same seed and length."""
    config = configs.CONFIGS["run-length"]

    def run(seed: int, steps: int, loss: float) -> dict:
        # 2% above the final loss at three quarters of the run: the page's "change over the last quarter"
        evals = [{"step": 0, "val_loss": loss + 1.0}, {"step": 3 * steps // 4, "val_loss": loss * 1.02},
                 {"step": steps, "val_loss": loss}]
        return {"seed": seed, "steps": steps, "val_loss": loss, "evals": evals}

    def runs(steps: int, base: float, comp: float) -> dict:
        return {(t, s): [run(seed, steps, (base if s == "none" else comp) + 0.1 * seed) for seed in (0, 1)]
                for t in config.tasks for s in config.settings}

    command = "python benchmarks/study/study.py --config run-length"
    page = pages.run_length_page(runs(400, 2.0, 2.1), runs(1200, 1.5, 1.8), [0, 1], command, config.tasks)
    rows = [ln for ln in page.splitlines() if ln.startswith("| transformer |")]
    # losses 2.0/2.1 (seeds 0, 1) against 2.1/2.2: +5% and +4.76%; spread stdev 0.0707 / mean 2.05
    assert rows[0] == "| transformer | 400 | 0.8 | 2.0500 | 2.00% | +-3.45% | " + " | ".join(["+4.88%"] * 7) + " |"
    assert rows[1] == "| transformer | 1200 | 2.4 | 1.5500 | 2.00% | +-4.56% | " + " | ".join(["+19.38%"] * 7) + " |"
    assert "- transformer, TopKQSGD(1%, 8): +4.88% (400 steps) -> +19.38% (1200 steps): above the 1% target" in page
    assert "| transformer-const | 1200 | 2.4 | 1.5500 | 2.00% |" in page
    partial = pages.run_length_page(runs(400, 2.0, 2.0), {k: v for k, v in runs(1200, 1.5, 1.5).items()
                                                          if k[1] != "tq1"}, [0, 1], "c", config.tasks)
    assert "| transformer | 1200 | 2.4 | 1.5500 | 2.00% | +-4.56% | +0.00% | +0.00% | +0.00% | +0.00% | - | +0.00% | +0.00% |" \
        in partial
    assert f"`{command}`" in page


@pytest.mark.parametrize("argv, said", [
    (["--config", "nope"], "unknown configuration 'nope'; choose from ['study', 'recipes', 'run-length',"),
    (["--tasks", "cnn-adam", "--settings", "tq01,nope"], "unknown settings ['nope'] of --config study; choose from "
     "['none', 'fp16',"),
    (["--config", "run-length", "--tasks", "transformer,nope"], "unknown tasks ['nope'] of --config run-length; "
     "choose from ['transformer', 'char-mlp', 'transformer-const']"),
    (["--recipes", "--tasks", "gpt2"], "unknown tasks ['gpt2'] of --config recipes; choose from ['nanogpt',"),
    (["--config", "wrapper", "--roads", "gc,mpi"], "unknown roads ['mpi'] of --config wrapper; choose from "
     "['none', 'stock', 'gc', 'ddp']"),
    (["--config", "wrapper", "--tasks", "x"], "--config wrapper takes no --tasks"),
    (["--config", "small-mlp", "--settings", "ratio10,nope"], "unknown settings ['nope'] of --config small-mlp"),
    (["--config", "small-mlp", "--tasks", "sgd,lbfgs"], "unknown tasks ['lbfgs'] of --config small-mlp"),
    (["--config", "small-mlp", "--section", "X"], "--section adds a table to an existing page: write the page first"),
    (["--config", "freeze", "--tasks", "sgd"], "unknown tasks ['sgd'] of --config freeze; choose from ['adam',"),
    (["--config", "freeze", "--steps", "50"], "--steps must be above 100"),
    (["--config", "powersgd", "--steps", "50"], "--config powersgd trains each task for its own steps"),
    (["--config", "outside", "--cosine"], "--cosine is an option of ['small-mlp'], not of --config outside"),
])
def test_what_a_configuration_lacks_is_refused_naming_what_it_has(argv, said, tmp_path: Path, capsys) -> None:
    """Refused before anything trains or is written (exit 2, the message on stderr)."""
    with pytest.raises(SystemExit) as exc:
        study.main(argv + ["--out", str(tmp_path / "runs"), "--docs", str(tmp_path / "docs")])
    assert exc.value.code == 2 and said in capsys.readouterr().err
    assert not (tmp_path / "runs").exists() and not (tmp_path / "docs").exists()


def test_outside_check_trains_both_wrappers_and_tables_the_gaps(tmp_path: Path) -> None:
    """``--config outside``, 20 steps: uncompressed once, TopKQSGD through both wrappers, a table row
    each with a finite gap; a rerun trains nothing again."""
    out = tmp_path / "runs.jsonl"
    argv = RUNNER + ["--config", "outside", "--steps", "20", "--seeds", "0", "--tasks", "adam", "--settings", "none,tq1",
                     "--out", str(out), "--docs", str(tmp_path)]
    res = launch(argv, 300, rank_env())
    assert res.returncode == 0, res.output
    runs = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted((r["wrapper"], r["setting"]) for r in runs) == [("gc", "none"), ("gc", "tq1"), ("hvd", "tq1")]
    assert all(0 < r["mse"] < 100 for r in runs)
    page = (tmp_path / "OUTSIDE_CHECK.md").read_text()
    rows = [ln for ln in page.splitlines() if ln.startswith("| adam |")]
    assert len(rows) == 2 and all("%" in ln for ln in rows) and "20 steps, 3 runs" in page, page
    again = launch(argv, 300, rank_env())
    assert again.returncode == 0 and "seed 0" not in again.output and len(out.read_text().splitlines()) == 3


def test_wrapper_check_roads_agree() -> None:
    """In benchmarks/results/WRAPPER_CHECK.md's runs every compressed road (stock Horovod, hvd_gradcomp.DistributedOptimizer,
    DDP) ends within the uncompressed seed spread of the others, its replicas identical."""
    config = configs.CONFIGS["wrapper"]
    runs = pages.records(ROOT / config.out)
    by_road = {road: [r["val_loss"] for r in runs if r["road"] == road] for road in config.roads}
    assert all(len(losses) >= 3 for losses in by_road.values()), {k: len(v) for k, v in by_road.items()}
    assert all(r["identical"] for r in runs)
    spread = max(by_road["none"]) - min(by_road["none"])
    means = [statistics.mean(by_road[road]) for road in ("stock", "gc", "ddp")]
    assert max(means) - min(means) <= spread, (means, spread)


def test_powersgd_runs_pair_with_uncompressed_ddp() -> None:
    """Every PowerSGD run of benchmarks/results/POWERSGD.md has the DDP uncompressed run of its seed to be paired with."""
    config = configs.CONFIGS["powersgd"]
    runs = report.load(ROOT / config.out)
    assert {s for _, s in runs} == set(config.settings)
    for (task, setting), rs in runs.items():
        assert {r["seed"] for r in rs} <= {r["seed"] for r in runs[(task, "none")]}, (task, setting)
        assert {r["label"] for r in rs} == {
            {"none": "uncompressed", "psgd4": "hvd-gradcomp PowerSGD rank 4",
             "psgd4-torch": "torch's PowerSGD hook, rank 4"}[setting]}


def test_small_mlp_section_is_replaced_or_appended() -> None:
    """A table goes under its own heading, replacing that section when the page has it and leaving
    the rest of the page as it was; a new head keeps the sections."""
    page = pages.small_mlp_page("# Small-MLP check\n\nintro\n\n| old table |\n", "Where", "c1", "(1 step).", ["| t1 |"])
    page = pages.small_mlp_page(page, "Other", "c2", "(2 steps).", ["| t2 |"])
    text = pages.small_mlp_page(page, "Where", "c3", "(3 steps).", ["| t3 |"])
    assert text.startswith("# Small-MLP check\n\nintro\n\n| old table |\n\n## Where\n")
    assert "| t1 |" not in text and text.count("## Where") == 1 and "Generated by `c3` (3 steps)." in text
    assert text.index("## Where") < text.index("| t3 |") < text.index("## Other") < text.index("| t2 |")
    again = pages.small_mlp_page(text, None, "c4", "about.", ["| new head |"])
    assert "| old table |" not in again and "| new head |" in again and "Generated by `c4`.\n\nabout." in again
    assert again[again.index("\n## Where"):] == text[text.index("\n## Where"):]


def test_small_mlp_check_writes_its_page(tmp_path: Path) -> None:
    """``--config small-mlp`` on 2 ranks, 60 steps, 2 seeds, one optimizer, two policies: it runs to the
    end (the ranks' parameters are checked identical inside) and its page has one row per policy, with
    the uncompressed loss, the per-seed gaps and the command that made it."""
    page = tmp_path / "SMALL_MLP_CHECK.md"
    common = ["--config", "small-mlp", "--out", str(tmp_path / "small-mlp.json"), "--docs", str(tmp_path)]
    res = launch(RUNNER + common + ["--tasks", "adam", "--steps", "60", "--seeds", "0,1", "--settings", "auto,update"],
                 300, rank_env())
    assert res.returncode == 0, res.output
    text = page.read_text()
    assert "Generated by `python benchmarks/study/study.py --config small-mlp" in text, text
    assert "--settings auto,update" in text and "60 steps" in text and "seeds 0..1" in text, text
    rows = [ln.split(" | ") for ln in text.splitlines() if ln.startswith("| adam |")]
    assert [r[1] for r in rows] == ["auto", "update"], text
    for r in rows:
        assert 0 < float(r[2].split()[0]) < 5 and 0 < float(r[3]) < 5   # held-out losses, last step
        assert r[4].count(",") == 1 and r[4].startswith("**")            # mean gap, then one per seed
    # the digits MLP, as a section of the same page: its task said there, Nesterov SGD's row
    res = launch(RUNNER + common + ["--data", "digits", "--tasks", "nesterov", "--steps", "30", "--seeds", "0",
                                    "--section", "Digits"], 300, rank_env())
    assert res.returncode == 0, res.output
    digits = page.read_text().split("\n## Digits\n")[1]
    assert "--data digits" in digits and "scikit-learn's digits" in digits and "30 steps" in digits, digits
    assert "\n\n| optimizer | feedback, or setting |" in digits, digits   # the table's head on its own line
    (row,) = [ln.split(" | ") for ln in digits.splitlines() if ln.startswith("| nesterov |")]
    assert row[1] == "auto" and 0 < float(row[2].split()[0]) < 5 and 0 < float(row[3]) < 5, row


def test_freeze_check_writes_its_page(tmp_path: Path) -> None:
    """``--config freeze`` on 2 ranks, past the freeze (110 steps), one seed, one training setup: it runs
    to the end (the ranks' parameters are checked identical inside) and its page has one row per
    setting, the held-out loss at the freeze, at the end and the highest after the freeze, and the
    command that made it."""
    res = launch(RUNNER + ["--config", "freeze", "--seeds", "0", "--steps", "110", "--tasks", "adamw-one-cycle",
                           "--out", str(tmp_path / "freeze.json"), "--docs", str(tmp_path)], 300, rank_env())
    assert res.returncode == 0, res.output
    text = (tmp_path / "FREEZE_CHECK.md").read_text()
    assert "Generated by `python benchmarks/study/study.py --config freeze" in text and "--steps 110" in text, text
    assert "| configuration | setting | held-out loss, step 100 | held-out loss, step 110 | highest after the freeze |" \
        in text, text
    rows = [ln.split(" | ") for ln in text.splitlines() if ln.startswith("| ") and "---" not in ln][1:]
    assert [r[1] for r in rows] == ["uncompressed", "TopKQSGD(1%, 8), default",
                                    "... previous default (momentum=None, sparsity_warmup=100, follow_scale=None)",
                                    "... FrozenVariance(momentum=True)", "... FrozenVariance(sparsity_warmup=100)",
                                    "... FrozenVariance(follow_scale='both')", "... FrozenVariance(follow_scale=None)"]
    for r in rows:
        assert r[0] == "| AdamW, one-cycle, lr 0.002, 3 micro-batches", r
        assert 0 < float(r[2]) < 5 and 0 < float(r[3]) <= float(r[4]) < 5, r   # one evaluation after the freeze
    assert rows[0][5].startswith("**+0.0%**"), rows[0]   # uncompressed against itself
