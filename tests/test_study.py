"""The convergence study's workers (benchmarks/study) on 2 ranks, a few steps: each writes the record
report.py reads, under Horovod and under DDP, and the page is generated from them."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.study import report
from tests.harness import ROOT, horovodrun_argv, launch, rank_env

pytestmark = pytest.mark.multirank


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
    res = launch([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                  str(ROOT / "benchmarks/study/ddp_worker.py"), "--task", "transformer", "--settings", "none,tq1",
                  *args], 300, rank_env())
    none, tq1 = _check(res, out, ["transformer-ddp-none-s0", "transformer-ddp-tq1-s0"])
    assert tq1["feedback"] == "frozen" and tq1["wrapper"] == "ddp"
    # 4 steps: all inside frozen's dense warm-up; the small tensors (biases, norms) still go as float16
    # (exempt="fp16"): the loss matched exactly on session 10's CI machine, within 1 ulp on session 11's
    assert tq1["val_loss"] == pytest.approx(none["val_loss"], rel=1e-5)
    report.write(out, tmp_path / "docs", command="test", minutes=0.1)
    page = (tmp_path / "docs" / "STUDY.md").read_text()
    assert "## char-mlp" in page and "## transformer-ddp" in page and "| transformer-ddp |" in page


def test_run_length_page_sets_each_gap_beside_the_longer_runs() -> None:
    """benchmarks/study/run_length.py: per task, the study's gap and the longer runs' gap, each
    against the uncompressed run of the same seed and length."""
    from benchmarks.study import run_length

    def run(seed: int, steps: int, loss: float) -> dict:
        # 2% above the final loss at three quarters of the run: the page's "change over the last quarter"
        evals = [{"step": 0, "val_loss": loss + 1.0}, {"step": 3 * steps // 4, "val_loss": loss * 1.02},
                 {"step": steps, "val_loss": loss}]
        return {"seed": seed, "steps": steps, "val_loss": loss, "evals": evals}

    def runs(steps: int, base: float, comp: float) -> dict:
        return {(t, s): [run(seed, steps, (base if s == "none" else comp) + 0.1 * seed) for seed in (0, 1)]
                for t in run_length.TASKS for s in run_length.SETTINGS}

    page = run_length.page(runs(400, 2.0, 2.1), runs(1200, 1.5, 1.8), [0, 1], "python benchmarks/study/run_length.py")
    rows = [ln for ln in page.splitlines() if ln.startswith("| transformer |")]
    # losses 2.0/2.1 (seeds 0, 1) against 2.1/2.2: +5% and +4.76%; spread stdev 0.0707 / mean 2.05
    assert rows[0] == "| transformer | 400 | 0.8 | 2.0500 | 2.00% | +-3.45% | " + " | ".join(["+4.88%"] * 7) + " |"
    assert rows[1] == "| transformer | 1200 | 2.4 | 1.5500 | 2.00% | +-4.56% | " + " | ".join(["+19.38%"] * 7) + " |"
    assert "- transformer, TopKQSGD(1%, 8): +4.88% (400 steps) -> +19.38% (1200 steps): above the 1% target" in page
    assert "| transformer-const | 1200 | 2.4 | 1.5500 | 2.00% |" in page
    partial = run_length.page(runs(400, 2.0, 2.0), {k: v for k, v in runs(1200, 1.5, 1.5).items() if k[1] != "tq1"},
                              [0, 1], "c")
    assert "| transformer | 1200 | 2.4 | 1.5500 | 2.00% | +-4.56% | +0.00% | +0.00% | +0.00% | +0.00% | - | +0.00% | +0.00% |" \
        in partial
    assert "`python benchmarks/study/run_length.py`" in page


def test_run_length_refuses_an_unknown_task(tmp_path: Path) -> None:
    """run_length.py --tasks names the task it does not know and the ones it does, and trains nothing."""
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks/study/run_length.py"), "--tasks", "transformer,nope",
                          "--out", str(tmp_path / "runs"), "--doc", str(tmp_path / "page.md")],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "--tasks: unknown nope (known: transformer, char-mlp, transformer-const)" in res.stderr
    assert not (tmp_path / "runs").exists() and not (tmp_path / "page.md").exists()


def test_study_refuses_an_unknown_setting(tmp_path: Path) -> None:
    """study.py --settings names the setting it does not know, and trains and writes nothing."""
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks/study/study.py"), "--tasks", "cnn-adam",
                          "--settings", "tq01,nope", "--out", str(tmp_path / "runs"), "--docs", str(tmp_path / "docs")],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "unknown settings ['nope']; choose from ['none', 'fp16'," in res.stderr
    assert not (tmp_path / "runs").exists() and not (tmp_path / "docs").exists()


def test_outside_check_trains_both_wrappers_and_tables_the_gaps(tmp_path: Path) -> None:
    """benchmarks/study/outside_check.py, 20 steps: uncompressed once, TopKQSGD through both wrappers,
    a table row each with a finite gap; a rerun trains nothing again."""
    out = tmp_path / "runs.jsonl"
    argv = [sys.executable, str(ROOT / "benchmarks/study/outside_check.py"), "--steps", "20", "--seeds", "0",
            "--optimizers", "adam", "--settings", "none,tq1", "--out", str(out), "--page", str(tmp_path / "page.md")]
    res = launch(argv, 300, rank_env())
    assert res.returncode == 0, res.output
    runs = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted((r["wrapper"], r["setting"]) for r in runs) == [("gc", "none"), ("gc", "tq1"), ("hvd", "tq1")]
    assert all(0 < r["mse"] < 100 for r in runs)
    rows = [ln for ln in res.output.splitlines() if ln.startswith("| adam |")]
    assert len(rows) == 2 and all("%" in ln for ln in rows), res.output
    page = (tmp_path / "page.md").read_text()
    assert all(ln in page for ln in rows) and "20 steps, 3 runs" in page
    again = launch(argv, 300, rank_env())
    assert again.returncode == 0 and "seed 0 ..." not in again.output and len(out.read_text().splitlines()) == 3


def test_outside_check_page_is_generated_from_the_saved_results() -> None:
    """docs/OUTSIDE_CHECK.md is what outside_check.py renders from docs/data/outside_check.jsonl."""
    sys.path.insert(0, str(ROOT / "benchmarks/study"))
    import outside_check
    results = [json.loads(line) for line in outside_check.DEFAULT_OUT.read_text().splitlines()]
    steps = max(r["steps"] for r in results)
    assert outside_check.DEFAULT_PAGE.read_text() == outside_check.render_page(results, steps)


def test_small_mlp_check_section_is_replaced_or_appended(tmp_path: Path) -> None:
    """``--section``: the table goes under its own heading, replacing that section when the page has
    it and leaving the rest of the page as it was; unknown ``--variants`` are refused by name."""
    from benchmarks.study import small_mlp_check as smc
    page = tmp_path / "p.md"
    page.write_text("# Small-MLP check\n\nintro\n\n| old table |\n")
    smc.write_page(str(page), "Where", ["--variants", "ratio10"], 100, 2, ["| t1 |"])
    smc.write_page(str(page), "Other", ["--section", "Other one"], 50, 3, ["| t2 |"])
    smc.write_page(str(page), "Where", ["--variants", "min-k128"], 200, 2, ["| t3 |"], cosine=True)
    text = page.read_text()
    assert text.startswith("# Small-MLP check\n\nintro\n\n| old table |\n\n## Where\n")
    assert "| t1 |" not in text and text.count("## Where") == 1
    assert "--variants min-k128` (200 steps, seeds 0..1, the learning rate decayed" in text
    assert text.index("## Where") < text.index("| t3 |") < text.index("## Other") < text.index("| t2 |")
    smc.write_page(str(page), None, ["--steps", "300"], 300, 3, ["| new head |"])   # the head anew, sections kept
    again = page.read_text()
    assert "| old table |" not in again and "| new head |" in again and "300 steps, constant learning rate" in again
    assert again[again.index("\n## Where"):] == text[text.index("\n## Where"):]
    assert "small_mlp_check.py --section 'Other one'` (50 steps" in text   # the command as one would paste it
    res = launch([sys.executable, str(ROOT / "benchmarks/study/small_mlp_check.py"), "--variants", "ratio10,nope"],
                 60, rank_env())
    assert res.returncode == 2 and "unknown --variants nope" in res.output, res.output
    res = launch([sys.executable, str(ROOT / "benchmarks/study/small_mlp_check.py"), "--optimizers", "sgd,lbfgs"],
                 60, rank_env())
    assert res.returncode == 2 and "unknown --optimizers lbfgs" in res.output, res.output
    res = launch([sys.executable, str(ROOT / "benchmarks/study/small_mlp_check.py"), "--section", "X",
                  "--page", str(tmp_path / "absent.md")], 60, rank_env())
    assert res.returncode == 2 and "write the page first" in res.output, res.output


def test_small_mlp_check_writes_its_page(tmp_path: Path) -> None:
    """benchmarks/study/small_mlp_check.py on 2 ranks, 60 steps, 2 seeds, one optimizer, two policies:
    it runs to the end (the ranks' parameters are checked identical inside) and its page has one
    row per policy, with the uncompressed loss, the per-seed gaps and the command that made it."""
    page = tmp_path / "SMALL_MLP_CHECK.md"
    res = launch(horovodrun_argv(2, "gloo", [sys.executable, str(ROOT / "benchmarks/study/small_mlp_check.py"),
                                             "--optimizers", "adam", "--steps", "60", "--seeds", "2",
                                             "--feedback", "auto,update", "--page", str(page)]), 300, rank_env())
    assert res.returncode == 0, res.output
    text = page.read_text()
    assert "Generated by `horovodrun -np 2" in text and "--feedback auto,update" in text and "60 steps" in text
    rows = [ln.split(" | ") for ln in text.splitlines() if ln.startswith("| adam |")]
    assert [r[1] for r in rows] == ["auto", "update"], text
    for r in rows:
        assert 0 < float(r[2].split()[0]) < 5 and 0 < float(r[3]) < 5   # held-out losses, last step
        assert r[4].count(",") == 1 and r[4].startswith("**")            # mean gap, then one per seed
    # the digits MLP, as a section of the same page: its task said there, Nesterov SGD's row
    res = launch(horovodrun_argv(2, "gloo", [sys.executable, str(ROOT / "benchmarks/study/small_mlp_check.py"),
                                             "--data", "digits", "--optimizers", "nesterov", "--steps", "30",
                                             "--seeds", "1", "--page", str(page), "--section", "Digits"]),
                 300, rank_env())
    assert res.returncode == 0, res.output
    digits = page.read_text().split("\n## Digits\n")[1]
    assert "--data digits" in digits and "scikit-learn's digits" in digits and "30 steps" in digits, digits
    assert "\n\n| optimizer | feedback, or setting |" in digits, digits   # the table's head on its own line
    (row,) = [ln.split(" | ") for ln in digits.splitlines() if ln.startswith("| nesterov |")]
    assert row[1] == "auto" and 0 < float(row[2].split()[0]) < 5 and 0 < float(row[3]) < 5, row


def test_freeze_check_writes_its_page(tmp_path: Path) -> None:
    """benchmarks/study/freeze_check.py on 2 ranks, past the freeze (110 steps), one seed, one
    configuration: it runs to the end (the ranks' parameters are checked identical inside) and its
    page has one row per setting, the held-out loss at the freeze, at the end and the highest after
    the freeze, and the command that made it; bad arguments are refused."""
    page = tmp_path / "FREEZE_CHECK.md"
    script = str(ROOT / "benchmarks/study/freeze_check.py")
    res = launch(horovodrun_argv(2, "gloo", [sys.executable, script, "--seeds", "1", "--steps", "110",
                                             "--configs", "adamw-one-cycle", "--page", str(page)]), 300, rank_env())
    assert res.returncode == 0, res.output
    text = page.read_text()
    assert "Generated by `horovodrun -np 2" in text and "--steps 110" in text, text
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
    for bad, said in ((["--steps", "50"], "--steps must be above 100"), (["--configs", "sgd"], "unknown ['sgd']"),
                      (["--ratio", "0"], "--ratio must be in (0, 1]")):
        res = launch([sys.executable, script] + bad, 60, rank_env())
        assert res.returncode == 2 and said in res.output, res.output


def test_wrapper_check_page_is_its_rendering_and_the_roads_agree():
    """docs/WRAPPER_CHECK.md is what benchmarks/study/wrapper_check.py renders from its committed runs;
    in them every compressed road (stock Horovod, hvd_gradcomp.DistributedOptimizer, DDP) ends within the
    uncompressed seed spread of the others, its replicas identical."""
    import json
    import statistics

    from benchmarks.study import wrapper_check

    assert wrapper_check.PAGE.read_text() == wrapper_check.render()
    runs = [json.loads(p.read_text()) for p in sorted(wrapper_check.OUT.glob("*.json"))]
    by_road = {road: [r["val_loss"] for r in runs if r["road"] == road] for road in wrapper_check.ROADS}
    assert all(len(losses) >= 3 for losses in by_road.values()), {k: len(v) for k, v in by_road.items()}
    assert all(r["identical"] for r in runs)
    spread = max(by_road["none"]) - min(by_road["none"])
    means = [statistics.mean(by_road[road]) for road in ("stock", "gc", "ddp")]
    assert max(means) - min(means) <= spread, (means, spread)


def test_powersgd_check_page_is_the_rendering_of_its_saved_runs() -> None:
    """docs/POWERSGD.md is what benchmarks/study/powersgd_check.py renders from docs/data/powersgd_check;
    every PowerSGD run has the DDP uncompressed run of its seed to be paired with."""
    from benchmarks.study import powersgd_check as pc

    runs = pc.load()
    assert pc.PAGE.read_text() == pc.render(runs)
    assert {s for _, s in runs} == set(pc.SETTINGS)
    for (task, setting), by_seed in runs.items():
        assert set(by_seed) <= set(runs[(task, "none")]), (task, setting)
        assert {r["label"] for r in by_seed.values()} == {
            {"none": "uncompressed", "psgd4": "hvd-gradcomp PowerSGD rank 4",
             "psgd4-torch": "torch's PowerSGD hook, rank 4"}[setting]}
