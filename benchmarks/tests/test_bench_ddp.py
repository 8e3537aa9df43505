"""The DDP half of the benchmark (benchmarks/ddp.py): plan, command lines, tables, targets and page.

Its jobs are 2-rank torchrun runs (minutes); the scripts they run are tested for real: bench_ddp.py
--quick at the end of this file, train_ddp.py through hvdgc-launch in tests/test_ddp.py. Here the
pure pieces, with exact values.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from benchmarks import cli
from benchmarks import ddp as bddp
from benchmarks import plan as bplan
from tests.harness import ROOT, launch, rank_env

pytestmark = pytest.mark.timeout(60)


def _plan(tmp_path: Path, quick: bool = False) -> bddp.DdpPlan:
    base = bplan.build_plan(quick, "1gbit,10gbit", None, None, None, None, 7, False, False, str(tmp_path), 300, "auto")
    return bddp.build_ddp_plan(base, quick, False, False)


def _speed(step_s: float, share: float, nbytes: float, ratio: float) -> dict:
    return {"step_s": step_s, "comm_share": share, "bytes_per_step": nbytes, "ratio": ratio}


SPEED = {"conditions": {"params": 25e6, "batch_size": 4, "warmup": 3, "iters": 10}, "elapsed_s": 120.0,
         "rates": {"1gbit": {"mode": "loopback", "throttled": True, "failures": {"qsgd8": "timed out after 420s\nx"},
                             "results": {"ddp": _speed(2.0, 0.9, 100e6, 1.0), "fp16": _speed(1.0, 0.8, 50e6, 2.0),
                                         "powersgd-1": _speed(0.8, 0.5, 0.1e6, 500.0),
                                         "powersgd-4": _speed(1.6, 0.7, 0.4e6, 125.0),
                                         "topkqsgd": _speed(0.5, 0.3, 0.6e6, 170.0)}}}}


def _run(seed: int, loss: float, curve_end: float = 1.0) -> dict:
    return {"seed": seed, "feedback": "momentum", "val_loss": loss, "bytes_per_step": 25e3, "ratio": 137.0, "wall_s": 60.0,
            "params": 857_216, "micro_batch": 32, "momentum": 0.9, "val_size": 4096,
            "val_curve": [[600, loss * curve_end], [800, loss]]}


CONV = {"conditions": {"steps": 800, "lr": 0.1, "seeds": [0, 1, 2], "eval_every": 100}, "elapsed_s": 600.0,
        "failures": {}, "results": {"none": [_run(0, 2.0, 1.005), _run(1, 2.1, 1.005), _run(2, 2.2, 1.005)],
                                    "topkqsgd": [_run(0, 2.04), _run(1, 2.1), _run(2, 2.2)]}}


def test_plan_defaults_full_and_quick(tmp_path: Path) -> None:
    full = _plan(tmp_path)
    assert [s.key for s in full.speed] == ["ddp", "fp16", "powersgd-1", "powersgd-4", "gc-powersgd-4", "topkqsgd",
                                           "qsgd8", "auto"]
    assert [s.key for s in full.convergence] == ["none", "powersgd-1", "powersgd-4", "topkqsgd", "topkqsgd-classic",
                                                 "qsgd8"]
    assert (full.seeds, full.steps, full.lr, full.eval_every, full.jobs) == ([7, 8, 9], 800, 0.1, 100, 2 * 8 + 3 * 6)
    assert full.docs_dir == tmp_path / "ddp"
    quick = _plan(tmp_path, quick=True)
    assert (quick.seeds, quick.steps, [s.key for s in quick.speed]) == ([7], 40, ["ddp", "powersgd-1", "topkqsgd"])


def test_command_lines_are_exact(tmp_path: Path) -> None:
    plan = _plan(tmp_path)
    out = tmp_path / "x.json"
    prog = bddp.speed_program(plan, bddp.SPEED_SETTINGS[2], out)
    assert prog[1:] == [str(bddp.BENCH_DDP), "--settings", "powersgd-1", "--params", "2.5e+07", "--batch-size", "4",
                        "--warmup", "3", "--iters", "10", "--min-seconds", "12", "--json", str(out)]
    prog = bddp.convergence_program(plan, bddp.CONVERGENCE_SETTINGS[3], 8, out)
    assert prog[1:] == [str(bddp.TRAIN_DDP), "--steps", "800", "--lr", "0.1", "--cosine", "--seed", "8",
                        "--eval-every", "100", "--log-every", "800", "--out", str(out),
                        "--compression", "topk-qsgd", "--ratio", "0.01", "--bits", "8"]
    assert bddp.torchrun(["p"], bin_dir=Path("/b")) == ["/b/torchrun", "--standalone", "--nproc-per-node", "2",
                                                        "--no-python", "p"]


def test_cli_flags_and_dry_run() -> None:
    runner = CliRunner()
    res = runner.invoke(cli.main, ["--skip-ddp", "--only-ddp"])
    assert res.exit_code == 2 and "nothing to run" in res.output
    res = runner.invoke(cli.main, ["--only-ddp", "--rates", "1gbit", "--dry-run"])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert not any("horovodrun" in ln for ln in lines)          # only the DDP half
    assert lines[:3] == [" ".join(c) for c in bddp.netns_setup_commands("NS", "1gbit")]
    speed = [ln for ln in lines if "bench_ddp.py" in ln]
    assert len(speed) == 8 and all(ln.startswith("ip netns exec NS ") and "torchrun --standalone" in ln for ln in speed)
    assert sum("train_ddp.py" in ln for ln in lines) == 18 and lines[-1].endswith("--compression qsgd --bits 8")
    res = runner.invoke(cli.main, ["--only-ddp", "--skip-convergence", "--rates", "1gbit", "--ddp-settings",
                                   "powersgd-4,gc-powersgd-4", "--dry-run"])
    assert res.exit_code == 0, res.output
    speed = [ln for ln in res.output.splitlines() if "bench_ddp.py" in ln]
    assert [ln.split("--settings ")[1].split()[0] for ln in speed] == ["powersgd-4", "gc-powersgd-4"]
    res = runner.invoke(cli.main, ["--only-ddp", "--ddp-settings", "nope", "--dry-run"])
    assert res.exit_code == 2 and "unknown DDP speed settings ['nope']" in res.output
    res = runner.invoke(cli.main, ["--skip-speed", "--ddp-settings", "ddp", "--dry-run"])
    assert res.exit_code == 2 and "not with --skip-ddp or --skip-speed" in res.output
    res = runner.invoke(cli.main, ["--quick", "--dry-run", "--skip-ddp"])
    assert not any("torchrun" in ln for ln in res.output.splitlines())
    res = runner.invoke(cli.main, ["--quick", "--dry-run"])   # make bench includes the DDP half
    assert any("bench_ddp.py" in ln for ln in res.output.splitlines())


def test_speed_rows_table_and_targets() -> None:
    rows = {r["key"]: r for r in bddp.speed_rows(SPEED["rates"]["1gbit"]["results"])}
    t = rows["topkqsgd"]
    assert (t["speedup"], t["vs_powersgd-1"], t["vs_powersgd-4"]) == pytest.approx((4.0, 1.6, 3.2))
    table = bddp.render_speed_table(list(rows.values())).splitlines()
    assert table[-1] == "| DDP + TopKQSGD(1%, 8) | 500.0 | 30.0% | 0.600 | 170.0x | 4.00x | 1.60x | 3.20x |"
    lines = bddp.target_lines({"speed": SPEED, "convergence": CONV})
    assert lines[0].endswith("at 1gbit: 4.00x (target >= 3x): **MET**")
    assert lines[1].endswith("(its default) at 1gbit: 1.60x (target > 1x, faster): **MET**")
    assert lines[2].endswith("+0.67% (uncompressed seed spread +-4.76%; target within 2%): **MET**")
    slow = {"rates": {"1gbit": {"results": {**SPEED["rates"]["1gbit"]["results"], "topkqsgd": _speed(0.8, 0.3, 1, 1)}}}}
    assert [ln.split(": ")[-1] for ln in bddp.target_lines({"speed": slow})] == ["**MISSED**", "**MISSED**"]


def test_convergence_rows_pair_seeds_and_state_the_spread() -> None:
    rows = {r["key"]: r for r in bddp.convergence_rows(CONV["results"])}
    t = rows["topkqsgd"]
    assert (t["gap"], t["gap_lo"], t["gap_hi"]) == pytest.approx((0.02 / 3, 0.0, 0.02))
    assert t["spread"] == pytest.approx(0.1 / 2.1)
    assert bddp.settled(CONV["results"]["none"]) == pytest.approx(-0.005 / 1.005)
    table = bddp.render_convergence_table(list(rows.values()))
    assert "| DDP + TopKQSGD(1%, 8) | momentum | 0,1,2 | 2.1133 +- 0.0808 | +0.67% [+0.00%, +2.00%] | +-4.76% | 25.0 | 137.0x | 60.0 |" \
        in table


def test_page_merges_parts_and_every_figure_comes_from_the_data(tmp_path: Path) -> None:
    plan = _plan(tmp_path)
    machine = {"date": "2031-01-02", "cpu": "Test CPU", "cores": "2", "torch": "9.9"}
    page = bddp.write_page(plan, {"speed": SPEED, "convergence": None}, "python -m benchmarks --only-ddp", machine)
    md = page.read_text()
    assert "## Step time" in md and "## Convergence" not in md and "failed: `timed out after 420s`" in md
    # A later convergence-only run keeps the speed part (and says which command made which part).
    page = bddp.write_page(plan, {"speed": None, "convergence": CONV}, "python -m benchmarks --only-ddp --skip-speed",
                           machine)
    md = page.read_text()
    data = json.loads((tmp_path / "ddp" / "data.json").read_text())
    assert data["speed"]["command"] == "python -m benchmarks --only-ddp"
    assert data["convergence"]["command"] == "python -m benchmarks --only-ddp --skip-speed"
    assert "## Step time" in md and "## Convergence on real data" in md and md.count("**MET**") == 3
    assert "moved by -0.50% over the last quarter of the steps: it has settled" in md
    assert "857,216 parameters" in md and "2031-01-02 (Test CPU, 2 cores, PyTorch 9.9), 10.0 minutes" in md
    unsettled = {**CONV, "command": "python -m benchmarks --only-ddp", "date": "2031-01-03", "results": {"none": [_run(0, 2.0, 1.05)], "topkqsgd": [_run(0, 2.1)]}}
    md = bddp.render_page({"convergence": unsettled})
    assert "it has NOT settled" in md and "n/a (1 seed)" in md and "**MISSED**" in md
    assert bddp.render_saved(tmp_path) == page and bddp.render_saved(tmp_path / "nowhere") is None


def test_chosen_rows_merge_into_the_saved_ones_and_say_where_they_come_from(tmp_path: Path) -> None:
    """--ddp-settings: the rows run replace theirs in data.json, the others stay with their command;
    the page names the later command, its date and the load average before each merged row."""
    machine = {"date": "2031-01-02", "cpu": "Test CPU", "cores": "2", "torch": "9.9"}
    bddp.write_page(_plan(tmp_path), {"speed": SPEED, "convergence": None}, "python -m benchmarks --only-ddp", machine)
    base = bplan.build_plan(False, "1gbit", None, None, None, None, 7, False, True, str(tmp_path), 300, "auto")
    plan = bddp.build_ddp_plan(base, False, False, True, only=["powersgd-4", "gc-powersgd-4"])
    new = {"conditions": SPEED["conditions"], "elapsed_s": 60.0,
           "rates": {"1gbit": {"mode": "loopback", "throttled": True, "failures": {},
                               "results": {"powersgd-4": dict(_speed(0.5, 0.7, 0.4e6, 125.0), load_avg=[0.5, 1.0, 2.0]),
                                           "gc-powersgd-4": dict(_speed(0.6, 0.7, 0.4e6, 125.0), load_avg=[0.4, 1, 2])}}}}
    md = bddp.write_page(plan, {"speed": new, "convergence": None}, "python -m benchmarks --ddp-settings x",
                         dict(machine, date="2031-01-05")).read_text()
    data = json.loads((tmp_path / "ddp" / "data.json").read_text())
    res = data["speed"]["rates"]["1gbit"]["results"]
    assert data["speed"]["command"] == "python -m benchmarks --only-ddp" and res["ddp"]["step_s"] == 2.0
    assert res["powersgd-4"]["step_s"] == 0.5 and res["powersgd-4"]["date"] == "2031-01-05"
    assert "| DDP + hvd-gradcomp PowerSGD rank 4 | 600.0 | 70.0% | 0.400 | 125.0x | 3.33x | 1.33x | 0.83x |" in md
    assert ("- Rerun later by `python -m benchmarks --ddp-settings x` on 2031-01-05: DDP + PowerSGD rank 4 (load "
            "average before it: 0.50, 1.00, 2.00), DDP + hvd-gradcomp PowerSGD rank 4 (load average before it: "
            "0.40, 1.00, 2.00)") in md
    other = dict(new, conditions={**SPEED["conditions"], "params": 1e6})
    with pytest.raises(ValueError, match="ran under"):
        bddp.merge_speed(data["speed"], other, "c", "d")


LAUNCHER_LIKE_TORCHRUN = """
import signal, subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
open(sys.argv[1], "w").write(str(worker.pid))
def stop(*_):
    worker.kill(); worker.wait(); sys.exit(143)
signal.signal(signal.SIGTERM, stop)
time.sleep(120)
"""


def test_timed_out_job_leaves_no_worker_of_its_own_session(tmp_path: Path) -> None:
    """torchrun puts each worker in a session of its own: a job killed at its timeout must still end them
    (run_job sends SIGTERM first, which torchrun forwards), or a hung DDP rank outlives the benchmark."""
    import os

    from hvd_gradcomp.launchers.jobs import CAPTURE, run_job

    pid_file = tmp_path / "worker.pid"
    script = tmp_path / "launcher.py"
    script.write_text(LAUNCHER_LIKE_TORCHRUN)
    import sys
    import time

    res = run_job([sys.executable, str(script), str(pid_file)], dict(os.environ), timeout=3, output=CAPTURE)
    assert res.timed_out and res.seconds < 3 + 10
    worker = int(pid_file.read_text())
    time.sleep(0.2)
    with pytest.raises(ProcessLookupError):
        os.kill(worker, 0)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ddp_speed_benchmark_quick(tmp_path):
    """A smoke test of benchmarks/bench_ddp.py (timings on this machine mean nothing; bytes do)."""
    out = tmp_path / "ddp.json"
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            str(ROOT / "benchmarks" / "bench_ddp.py"), "--quick", "--json", str(out)]
    res = launch(argv, 240, rank_env())
    assert res.returncode == 0, res.stdout
    rows = {r["setting"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["ddp", "fp16", "powersgd-1", "powersgd-4", "gc-powersgd-4", "topkqsgd", "qsgd8"]
    assert rows["ddp"]["ratio"] == 1.0 and rows["fp16"]["ratio"] == 2.0
    assert rows["powersgd-1"]["ratio"] > rows["powersgd-4"]["ratio"] > 2
    # ours at rank 4 sends the same factors as torch's hook, give or take the small tensors' split
    assert rows["gc-powersgd-4"]["ratio"] == pytest.approx(rows["powersgd-4"]["ratio"], rel=0.1)
    assert rows["topkqsgd"]["ratio"] > 50 and 3.5 < rows["qsgd8"]["ratio"] < 4.1
    assert all(r["step_s"] > 0 and 0 <= r["comm_share"] < 1 for r in rows.values())
