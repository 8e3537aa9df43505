"""benchmarks/gpu_check.py: the page is what its JSON says, and its checks run (on CPU here)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks import gpu_check

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
RUNS = [RESULTS / "data" / "gpu" / "full.json", RESULTS / "data" / "gpu" / "rerun-ddp-fix.json"]


def test_gpu_page_is_generated_from_its_json(tmp_path: Path) -> None:
    page = tmp_path / "GPU.md"
    rel = [p.relative_to(ROOT) for p in RUNS]
    args = ["--render", *map(str, rel), "--page", str(page)]
    import os
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        assert gpu_check.main(args) == 0
    finally:
        os.chdir(cwd)
    assert page.read_text() == (RESULTS / "GPU.md").read_text(), \
        "benchmarks/results/GPU.md differs from its JSON: regenerate it with the command at its top"


def test_a_failed_check_is_recorded_and_the_rest_still_run(tmp_path: Path) -> None:
    rec = gpu_check.Recorder(tmp_path / "r.json")
    rec.run("broken", lambda: 1 / 0)
    rec.run("fine", lambda: {"ok": True})
    checks = rec.results["checks"]
    assert checks["broken"]["ok"] is False and "ZeroDivisionError" in checks["broken"]["error"]
    assert checks["fine"]["ok"] is True
    assert "ZeroDivisionError" in (tmp_path / "r.json").read_text()


def test_deterministic_mode_check_runs_on_cpu() -> None:
    out = gpu_check.check_deterministic(torch.device("cpu"))
    assert out == {"ok": True, "payloads_repeat": True}
    assert not torch.are_deterministic_algorithms_enabled()


@pytest.mark.slow
def test_cpu_and_device_payloads_compared_on_cpu() -> None:
    out = gpu_check.check_codecs(torch.device("cpu"))
    assert out["ok"] and out["payloads_equal_cpu"]
    assert {r["codec"] for r in out["rows"]} == set(gpu_check.CODECS)
