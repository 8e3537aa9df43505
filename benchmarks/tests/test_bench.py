"""The benchmark's (benchmarks/) pure pieces: command builders, option handling, tables and the report.

A real ``python -m benchmarks --quick`` takes about 2-3 minutes (each 2-rank job starts Horovod), too
long for a unit test; its pieces are tested here with exact expected values, and the
examples it runs are tested for real in test_examples.py.
"""
from __future__ import annotations

import json
from contextlib import nullcontext
from pathlib import Path

import pytest
from click.testing import CliRunner

from benchmarks import cli, markdown, netns, runner, tables
from benchmarks import plan as bplan
from hvd_gradcomp.launchers import jobs

pytestmark = pytest.mark.timeout(60)


def _speed_result(step_s: float, comm_s: float, bytes_step: float, ratio: float) -> dict:
    return {"step_s": step_s, "comm_s": comm_s, "bytes_per_step": bytes_step, "ratio": ratio,
            "samples_per_s_total_mean": 8 / step_s, "samples_per_s_total_conf": 0.5}


SPEED = {"1gbit": {"throttled": True, "failures": {}, "results": {
    "horovod": _speed_result(2.0, 1.6, 108e6, 1.0),
    "fp16": _speed_result(1.2, 0.8, 54e6, 2.0),
    "topkqsgd": _speed_result(0.5, 0.04, 0.6e6, 180.0),
}}}


def _conv(val_loss: float, key: str) -> dict:
    return {"params": 900_000, "micro_batch": 32, "lr": 0.05, "momentum": 0.9, "ranks": 2, "val_size": 4096,
            "min_compress_numel": 1024, "val_loss": val_loss, "final_train_loss": val_loss - 0.05, "val_accuracy": 0.36,
            "bytes_per_step": 3.4e6 if key == "none" else 25e3, "ratio": 1.0 if key == "none" else 138.0,
            "wall_s": 30.0, "samples_per_s": 1000.0, "steps": 300,
            "curve": {"step": [1.0, 2.0], "loss": [4.8, 4.0], "wall_s": [0.1, 0.2]}}


CONV = {"rate": "1gbit", "throttled": True, "failures": {},
        "results": {"none": _conv(2.50, "none"), "topkqsgd": _conv(2.54, "topkqsgd"),
                    "topkqsgd-noef": _conv(2.90, "topkqsgd-noef")}}


def _plan(tmp_path: Path, **kw) -> bplan.Plan:
    plan = bplan.build_plan(False, None, None, None, None, None, 0, False, False, str(tmp_path), 300, "auto")
    for k, v in kw.items():
        setattr(plan, k, v)
    return plan


def test_netns_commands_are_exact() -> None:
    assert netns.netns_setup_commands("hvdgc-x", "10gbit") == [
        ["ip", "netns", "add", "hvdgc-x"],
        ["ip", "netns", "exec", "hvdgc-x", "ip", "link", "set", "lo", "up"],
        ["ip", "netns", "exec", "hvdgc-x", "tc", "qdisc", "add", "dev", "lo", "root", "tbf",
         "rate", "10gbit", "burst", "256kb", "latency", "50ms"],
    ]
    assert netns.netns_teardown_command("hvdgc-x") == ["ip", "netns", "del", "hvdgc-x"]
    assert netns.in_netns(None, ["a", "b"]) == ["a", "b"]
    assert netns.in_netns("n", ["a"]) == ["ip", "netns", "exec", "n", "a"]


def test_horovodrun_and_programs(tmp_path: Path) -> None:
    plan = _plan(tmp_path)
    argv = bplan.horovodrun(["python", "x.py"], bin_dir=Path("/v/bin"))
    # every rank bound to its own core (hvd_gradcomp/launchers/bind.py), then the program unchanged
    assert argv == ["/v/bin/horovodrun", "-np", "2", "-H", "localhost:2", "--gloo", "python", "-m", "hvd_gradcomp.launchers.bind",
                    "python", "x.py"]
    topkqsgd = next(s for s in bplan.SPEED_SETTINGS if s.key == "topkqsgd")
    prog = bplan.speed_program(plan, topkqsgd, tmp_path / "o.json")
    assert prog[1].endswith("examples/synthetic_benchmark.py")
    assert prog[2:] == ["--params", "2.5e+07", "--batch-size", "4", "--warmup", "3", "--iters", "10", "--min-seconds", "12", "--seed", "0",
                        "--label", "TopKQSGD(1%, 8)", "--json", str(tmp_path / "o.json"),
                        "--compression", "topk-qsgd", "--ratio", "0.01", "--bits", "8"]
    noef = next(s for s in bplan.CONVERGENCE_SETTINGS if s.key == "topkqsgd-noef")
    tprog = bplan.train_program(plan, noef, tmp_path)
    assert tprog[2:10] == ["--steps", "400", "--seed", "0", "--out-dir", str(tmp_path), "--run-name", "topkqsgd-noef"]
    assert tprog[-1] == "--no-error-feedback"


def test_rank_env_drops_stray_settings() -> None:
    env = jobs.rank_env(bplan.ROOT, {"HVDGC_COMPILE": "0"}, base={"HVDGC_COMPRESSION": "topk", "PATH": "/bin"})
    assert "HVDGC_COMPRESSION" not in env
    assert env["HVDGC_COMPILE"] == "0" and env["OMP_NUM_THREADS"] == "1" and env["PATH"] == "/bin"
    assert env["OMPI_ALLOW_RUN_AS_ROOT"] == "1"


def test_plan_defaults_full_and_quick(tmp_path: Path) -> None:
    full = bplan.build_plan(False, None, None, None, None, None, 0, False, False, None, 300, "auto")
    assert full.rates == ["100mbit", "1gbit", "10gbit"] and len(full.speed) == 8 and len(full.convergence) == 7
    assert full.params == 25e6 and full.docs_dir == bplan.ROOT / "benchmarks" / "results"
    quick = bplan.build_plan(True, "500mbit", None, 2, None, None, 0, False, True, None, 300, "auto")
    assert quick.rates == ["500mbit"] and quick.iters == 2 and quick.convergence == []
    assert quick.docs_dir == bplan.ROOT / "runs" / "bench-quick"


@pytest.mark.parametrize("text", ["", "fast", "1gb", "1gbit,x"])
def test_bad_rates_rejected(text: str) -> None:
    with pytest.raises(bplan.click.BadParameter):
        bplan.parse_rates(text)


def test_cli_usage_errors_and_dry_run() -> None:
    runner = CliRunner()
    res = runner.invoke(cli.main, ["--rates", "fast"])
    assert res.exit_code == 2 and "expected rates like" in res.output
    res = runner.invoke(cli.main, ["--skip-speed", "--skip-convergence"])
    assert res.exit_code == 2 and "nothing to run" in res.output
    res = runner.invoke(cli.main, ["--iters", "0"])
    assert res.exit_code == 2 and "must be > 0" in res.output
    res = runner.invoke(cli.main, ["--quick", "--dry-run", "--skip-ddp"])  # DDP commands: test_bench_ddp.py
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert lines[0] == "ip netns add NS" and lines[-1].endswith("--bits 8 --error-feedback")
    assert sum("synthetic_benchmark.py" in ln for ln in lines) == 4
    assert sum("train.py" in ln for ln in lines) == 2


def test_speed_rows_and_table() -> None:
    rows = tables.speed_rows(SPEED["1gbit"]["results"], bplan.SPEED_SETTINGS)
    assert [r["key"] for r in rows] == ["horovod", "fp16", "topkqsgd"]
    top = rows[-1]
    assert top["speedup"] == pytest.approx(4.0) and top["speedup_fp16"] == pytest.approx(2.4)
    assert top["comm_share"] == pytest.approx(0.08)
    table = tables.render_speed_table(rows).splitlines()
    assert table[-1] == "| TopKQSGD(1%, 8) | 500.0 | 40.0 | n/a | 8.0% | 0.600 | 180.0x | 16.0 +- 0.5 | 4.00x | 2.40x |"


def test_waiting_for_the_last_rank_is_reported_apart() -> None:
    """Issue 13: the time the ranks waited in synchronize() for the last one to arrive (load
    imbalance) is shown beside the share, in the table and under the target."""
    timed = {"1gbit": {**SPEED["1gbit"], "results": {**SPEED["1gbit"]["results"], "topkqsgd": {
        **_speed_result(0.5, 0.04, 0.6e6, 180.0), "imbalance_s": 0.03}}}}
    rows = tables.speed_rows(timed["1gbit"]["results"], bplan.SPEED_SETTINGS)
    assert "| TopKQSGD(1%, 8) | 500.0 | 40.0 | 30.0 | 8.0% |" in tables.render_speed_table(rows)
    lines = tables.target_lines(timed, [])
    assert lines[2].endswith("8.0% (target < 5%): **MISSED**")
    assert lines[3] == ("  - of it, 30.0 ms per step is the ranks waiting for the last one to finish its backward "
                        "(load imbalance); the last rank's own time in synchronize() is 2.0% of the step")


def test_the_no_exchange_row_is_a_floor_not_a_setting() -> None:
    """Issue 13: the reference row (a 1-float allreduce in place of the exchange) gives the time
    any synchronous step waits here for the slower rank; it gets no speedup, is never Auto's
    best fixed setting even when fastest, and its share is printed under the < 5% target."""
    auto = {**_speed_result(0.52, 0.05, 0.7e6, 150.0)}
    floor = {**_speed_result(0.4, 0.03, 4, 27e6)}
    timed = {"1gbit": {**SPEED["1gbit"], "results": {**SPEED["1gbit"]["results"], "auto": auto, "barrier": floor}}}
    rows = {r["key"]: r for r in tables.speed_rows(timed["1gbit"]["results"], bplan.SPEED_SETTINGS)}
    assert rows["barrier"]["speedup"] is None and rows["barrier"]["speedup_fp16"] is None
    assert rows["barrier"]["comm_share"] == pytest.approx(0.075)
    assert "| No exchange (reference) | 400.0 | 30.0 | n/a | 7.5% | 0.000 | n/a |" in tables.render_speed_table(list(rows.values()))
    lines = tables.target_lines(timed, [])
    assert lines[3] == ("  - with nothing to exchange (the *No exchange (reference)* row: the same model's step with "
                        "a 1-float allreduce in place of the exchange) the ranks spent 7.5% of the step (30.0 ms) "
                        "waiting there for the slower one: the floor any synchronous step has on this machine")
    # Auto against TopKQSGD (0.5 s), not against the faster reference row (0.4 s)
    assert lines[4] == "- Auto step time vs best fixed setting (TopKQSGD(1%, 8)) at 1gbit: 0.96x (target >= 0.95x): **MET**"
    assert bplan.REFERENCE_KEYS == {"barrier"}


def test_convergence_rows_and_targets() -> None:
    rows = tables.convergence_rows(CONV["results"], bplan.CONVERGENCE_SETTINGS)
    assert [r["key"] for r in rows] == ["none", "topkqsgd", "topkqsgd-noef"]
    assert rows[1]["val_rel"] == pytest.approx(0.016)
    table = tables.render_convergence_table(rows)
    assert "| TopKQSGD(1%, 8) | on | 300 | 2.4900 | 2.5400 | +1.60% | 0.360 | 25.0 | 138.0x | 1000 | 30.0 |" in table
    assert "| TopKQSGD(1%, 8), no error feedback | off |" in table
    targets = tables.target_lines(SPEED, rows)
    assert targets[0].endswith("4.00x (target >= 3x): **MET**")
    assert targets[1].endswith("2.40x (target >= 1.5x): **MET**")
    assert targets[2].endswith("8.0% (target < 5%): **MISSED**")
    assert targets[3].endswith("+1.60% (target within 2%): **MET**")
    slow = {"1gbit": {**SPEED["1gbit"], "results": {**SPEED["1gbit"]["results"],
                                                    "topkqsgd": _speed_result(1.0, 0.3, 0.6e6, 180.0)}}}
    assert tables.target_lines(slow, [])[0].endswith("2.00x (target >= 3x): **MISSED**")


def test_report_written_with_plots(tmp_path: Path) -> None:
    plan = _plan(tmp_path)
    data = {"speed": SPEED, "convergence": CONV, "machine": {
        "cpu": "Test CPU", "cores": "2", "memory": "24.0 GiB", "os": "Debian", "python": "3.11", "torch": "2.x",
        "horovod": "0.28.1", "gpu": "none"}}
    markdown.write_report(plan, data, "python -m benchmarks --test", 60.0)
    md = (tmp_path / "BENCHMARKS.md").read_text()
    assert md.startswith("# Benchmarks\n") and "Generated by `python -m benchmarks --test`" in md
    assert "CPU: Test CPU, 2 cores" in md and "tbf rate RATE burst 256kb latency 50ms" in md
    assert "![step time per setting](img/step_time.png)" in md
    assert "- Speedup at 1gbit: TopKQSGD(1%, 8) " in md and " over Horovod fp16" in md
    for name in ("step_time", "loss_vs_step", "loss_vs_time"):
        assert (tmp_path / "img" / f"{name}.png").stat().st_size > 5000
    assert (tmp_path / "data" / "bench.json").exists()


def test_report_says_unthrottled(tmp_path: Path) -> None:
    plan = _plan(tmp_path)
    speed = {"1gbit": {**SPEED["1gbit"], "throttled": False}}
    md = markdown.render_markdown(plan, runner.machine_description(), speed, None, "python -m benchmarks", 1.0, {})
    assert "**Unthrottled**" in md and "### 1gbit requested, ran unthrottled" in md


def test_no_figure_on_the_page_is_typed_by_hand(tmp_path: Path) -> None:
    """The prose around the tables carries no figure of an earlier run: only this run's data."""
    plan = _plan(tmp_path)
    md = markdown.render_markdown(plan, runner.machine_description(), SPEED, CONV, "python -m benchmarks", 1.0, {})
    for stale in ("2.4927", "2.5611", "2.5217", "2.4644", "2.5245", "+2.74%", "+-1.2%"):
        assert stale not in md
    conditions = md.split("## Conditions")[1].split("## ")[0]
    assert "micro-batch 32" in conditions and "SGD lr 0.05 momentum 0.9" in conditions   # from the runs' JSON


def test_stacked_step_time_parts_and_auto_targets() -> None:
    results = {"horovod": {**_speed_result(1.0, 0.5, 108e6, 1.0)},
               "topkqsgd": {**_speed_result(0.6, 0.2, 0.6e6, 171.0), "codec_s": 0.15, "exposed_comm_s": 0.1},
               "auto": {**_speed_result(0.62, 0.2, 0.6e6, 171.0), "codec_s": 0.15, "exposed_comm_s": 0.1,
                        "auto": {"summary": "step 9: sparse x6"}}}
    rows = {r["key"]: r for r in tables.speed_rows(results, bplan.SPEED_SETTINGS)}
    t = rows["topkqsgd"]
    assert (t["compute_s"], t["codec_s"], t["exposed_s"]) == pytest.approx((0.35, 0.15, 0.1))
    assert rows["horovod"]["exposed_s"] == 0.5 and rows["horovod"]["codec_s"] == 0.0
    assert rows["auto"]["auto"] == "step 9: sparse x6"
    lines = tables.auto_target_lines({"1gbit": {"results": results}, "10gbit": {"results": results}})
    assert lines == ["- Auto step time vs best fixed setting (TopKQSGD(1%, 8)) at 1gbit: 0.97x (target >= 0.95x): **MET**",
                     "- Auto step time vs uncompressed Horovod at 10gbit: 1.61x (target >= 0.95x): **MET**"]


def test_two_hosts_plan_and_report_name_the_mode(tmp_path: Path) -> None:
    """No namespaces needed: the planned commands and the report's titles (``--two-hosts``)."""
    plan = bplan.build_plan(True, "1gbit", None, None, None, None, 0, False, True, str(tmp_path), 300, "0",
                            two_hosts=True)
    lines = bplan.planned_commands(plan)
    assert lines[0] == f"bash {bplan.ROOT}/scripts/two_hosts.sh up --rate 1gbit --no-slurm"
    assert lines[-1] == f"bash {bplan.ROOT}/scripts/two_hosts.sh down"
    assert len(lines) == 2 + len(plan.speed)
    assert all(" exec hvdgc-a " in ln and " -H hvdgc-a:1,hvdgc-b:1 --gloo --network-interface hvdgc0 " in ln
               for ln in lines[1:-1]), lines
    block = {"throttled": True, "results": {}, "failures": {}}
    md = markdown.render_markdown(plan, {"date": "d", "cpu": "c", "cores": "2", "memory": "m", "os": "o",
                                         "python": "p", "torch": "t", "horovod": "h", "gpu": "none"},
                                  {"1gbit": {**block, "mode": "two-hosts"}, "10gbit": {**block, "mode": "loopback"}},
                                  None, "python -m benchmarks --two-hosts", 1.0, {})
    assert "### 1gbit, two hosts: one rank in each of two network namespaces" in md
    assert "### 10gbit, one namespace: both ranks on one rate-limited loopback" in md
    assert "Tables titled *two hosts* ran as `bash scripts/two_hosts.sh exec hvdgc-a horovodrun" in md


def test_cli_two_hosts_dry_run() -> None:
    res = CliRunner().invoke(cli.main, ["--quick", "--two-hosts", "--skip-convergence", "--dry-run"])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert lines[0].endswith("scripts/two_hosts.sh up --rate 1gbit --no-slurm")
    assert sum("synthetic_benchmark.py" in ln and "hvdgc-a:1,hvdgc-b:1" in ln for ln in lines) == 4


def test_convergence_rows_show_the_feedback_policy_the_run_used() -> None:
    """A run that reports ``feedback`` (feedback="auto" turns error feedback off for low-bit QSGD)
    is shown with what it used, not with what its setting asked for."""
    results = {"none": _conv(2.5, "none"), "qsgd4": {**_conv(2.6, "qsgd4"), "feedback": "none"},
               "qsgd8": {**_conv(2.55, "qsgd8"), "feedback": "residual"}}
    rows = {r["key"]: r for r in tables.convergence_rows(results, bplan.CONVERGENCE_SETTINGS)}
    assert (rows["none"]["ef"], rows["qsgd4"]["ef"], rows["qsgd8"]["ef"]) == (None, False, True)


@pytest.mark.slow
def test_bytes_per_rank_tables_in_the_docs_are_generated_and_current() -> None:
    """benchmarks/results/FIGURES.md and docs/AUTO.md carry bench_bytes_per_rank.py's tables between its markers
    (``--write-docs``), and the modelled part is what the code models today."""
    from benchmarks import bench_bytes_per_rank as bpr

    tensors = bpr.model_payloads()
    blocks = {}
    for rel in bpr.DOC_FILES:
        text = (bplan.ROOT / rel).read_text()
        assert text.count(bpr.BEGIN) == 1 and text.count(bpr.END) == 1, rel
        blocks[rel] = text.split(bpr.BEGIN)[1].split(bpr.END)[0]
    assert bpr.model_tables(tensors) in blocks["docs/AUTO.md"]
    assert "Measured bytes per rank per step" in blocks["docs/AUTO.md"]
    cross = bpr.crossovers(tensors)["TopKQSGD(1%, 8)"]
    assert f"fp16 allreduce from {cross['fp16']} ranks on" in blocks["benchmarks/results/FIGURES.md"]
    assert "| sparse | TopKQSGD(1%, 8) |" in blocks["benchmarks/results/FIGURES.md"]


def test_accumulation_memory_table_is_generated_from_the_saved_run() -> None:
    """benchmarks/results/FIGURES.md's accumulation table is bench_accumulation_memory.py's rendering of
    benchmarks/results/data/accumulation_memory.json (``--write-docs``; ``--render`` rewrites it), not typed."""
    import json
    from benchmarks import bench_accumulation_memory as bam
    data = json.loads(bam.DATA.read_text())
    text = bam.PAGE.read_text()
    assert text.count(bam.BEGIN) == 1 and text.count(bam.END) == 1
    assert text.split(bam.BEGIN)[1].split(bam.END)[0].strip() == bam.page_block(data).strip(), \
        "run .venv/bin/python benchmarks/bench_accumulation_memory.py --render"
    assert [(r["micro"], r["steps"]) for r in data["rows"]] == [(32, 1), (4, 8)]


def test_readme_figures_are_generated_from_the_saved_results() -> None:
    """The README's headline table and benchmarks/results/FIGURES.md's speed and convergence tables are
    benchmarks/readme_figures.py's rendering of the saved raw results (benchmarks/results/data/bench.json,
    benchmarks/results/ddp/data.json, benchmarks/results/data/study), not typed."""
    from benchmarks import readme_figures as rf
    root = Path(__file__).resolve().parents[2]
    assert rf.PAGES == {"README.md": "headline", "benchmarks/results/FIGURES.md": "full"}
    headline, full = rf.render(root, "headline"), rf.render(root, "full")
    assert headline in (root / "README.md").read_text(), "run python benchmarks/readme_figures.py --write"
    assert full in (root / "benchmarks/results/FIGURES.md").read_text(), "run python benchmarks/readme_figures.py --write"
    assert "| 1gbit | TopKQSGD(1%, 8) |" in full and "PowerSGD rank 1" in full and "| transformer |" in full
    assert "| TopKQSGD(1%, 8) |" in headline and "PowerSGD rank 1" in headline and "make study" in headline


def test_speed_rows_are_timed_in_rounds_and_the_fastest_kept(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Rounds in turn: round 1 times every row, later rounds only the short ones that did not fail;
    each row reports its fastest round and lists every round's time (on the page too)."""
    times = {"horovod": [2.0], "topk": [0.30, 0.22, 0.26], "auto": [0.25, 0.31, 0.24]}
    order = []

    def fake_run(argv, plan, log_path):
        key = next(k for k in ("horovod", "topk", "auto", "fp16") if f"-{k}" in log_path.name)
        order.append(key)
        if key == "fp16":
            raise runner.JobFailed("exited 1")
        step = times[key][sum(1 for k in order if k == key) - 1]
        result = {**_speed_result(step, step / 10, 1e6, 100.0), "comm_share": 0.1}
        log_path.with_suffix(".json").write_text(json.dumps(result))
        return 1.0

    monkeypatch.setattr(runner, "run_logged", fake_run)
    monkeypatch.setattr(runner, "speed_link", lambda plan, rate, say: nullcontext((lambda p: p, "loopback")))
    plan = _plan(tmp_path, rates=["1gbit"], runs_dir=tmp_path / "runs",
                 speed=[s for s in bplan.SPEED_SETTINGS if s.key in ("horovod", "fp16", "topk", "auto")])
    (tmp_path / "runs" / "speed").mkdir(parents=True)
    assert plan.rounds == bplan.FULL_ROUNDS == 3

    class Bar:
        updates = 0

        def update(self, n: int) -> None:
            Bar.updates += n

        def set_description(self, text: str) -> None:
            assert "round" in text

    out = runner.run_speed(plan, lambda line: None, Bar())["1gbit"]
    assert order == ["horovod", "fp16", "topk", "auto", "topk", "auto", "topk", "auto"]
    assert Bar.updates == 12   # every (round, row), timed or not: the bar's total
    res = out["results"]
    assert res["topk"]["step_s"] == 0.22 and res["topk"]["round_step_s"] == [0.30, 0.22, 0.26]
    assert res["auto"]["step_s"] == 0.24 and res["horovod"]["round_step_s"] == [2.0]
    assert set(out["failures"]) == {"fp16"} and "fp16" not in res
    assert (tmp_path / "runs" / "speed" / "1gbit-topk-round3.json").exists()
    rows = tables.speed_rows(res, plan.speed)
    assert markdown._rounds_line(rows, res) == \
        "- Step time in each round (ms): TopK 1% 300 / 220 / 260; Auto 250 / 310 / 240."
    assert "in 3 rounds" in markdown._rounds_clause(plan)
    assert bplan.build_plan(True, None, None, None, None, None, 0, False, False, None, 300, "auto").rounds == 1


def test_the_benchmarks_warm_up_covers_autos_start():
    """The benchmark times Auto's steady state: its warm-up covers exploring, deciding, verifying."""
    import hvd_gradcomp as gc

    flags = next(s for s in bplan.SPEED_SETTINGS if s.key == "auto").flags
    assert int(flags[flags.index("--warmup") + 1]) >= gc.Auto(ratio=0.01, bits=8).start_steps
