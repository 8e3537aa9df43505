"""The examples, run for real: train.py and synthetic_benchmark.py on 2 Gloo ranks.

Each multi-rank test starts ``horovodrun -np 2 --gloo`` through :func:`tests.harness.launch`
(own process group, timeout, all output on failure) and asserts on the files the example
wrote: the per-step CSV, the JSON summary, the benchmark's JSON.
"""
from __future__ import annotations

import csv
import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

from tests.harness import HOROVODRUN, ROOT, horovodrun_argv, launch, rank_env

TRAIN = str(ROOT / "examples" / "train.py")
BENCH = str(ROOT / "examples" / "synthetic_benchmark.py")
SMALL_TEXT = ["--text-bytes", "200000"]


def _require_horovodrun() -> None:
    if not Path(HOROVODRUN).exists():
        pytest.skip(f"{HOROVODRUN} not built yet (bash scripts/setup.sh)")


def _run_2_ranks(program: List[str], timeout: float = 80, env: Dict[str, str] = None) -> str:
    _require_horovodrun()
    res = launch(horovodrun_argv(2, "gloo", [sys.executable, *program]), timeout, rank_env(env))
    if res.returncode != 0:
        pytest.fail(f"exited {res.returncode}\n--- output of all ranks ---\n{res.stdout}")
    return res.stdout


def _rows(path: Path) -> List[Dict[str, float]]:
    with open(path) as fh:
        return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(fh)]


def _load_train_module():
    spec = importlib.util.spec_from_file_location("examples_train", TRAIN)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    if str(ROOT / "examples") not in sys.path:
        sys.path.insert(0, str(ROOT / "examples"))
    spec.loader.exec_module(module)
    return module


@pytest.mark.multirank
@pytest.mark.timeout(90)
def test_train_topkqsgd_with_accumulation_from_env(tmp_path: Path) -> None:
    """Settings come from HVDGC_* (as hvdgc-launch sets them); the log has one row per step."""
    env = {"HVDGC_COMPRESSION": "topk-qsgd", "HVDGC_RATIO": "0.01", "HVDGC_BITS": "8", "HVDGC_ACCUMULATE": "2"}
    _run_2_ranks([TRAIN, "--steps", "12", "--micro-batch", "16", "--lr", "0.1", "--out-dir", str(tmp_path),
                  "--run-name", "t", "--no-progress", *SMALL_TEXT], env=env)
    rows = _rows(tmp_path / "t.csv")
    summary = json.loads((tmp_path / "t.json").read_text())
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert all(math.isfinite(r["loss"]) for r in rows)
    assert sum(r["loss"] for r in rows[-3:]) / 3 < rows[0]["loss"] - 0.3  # starts at ln(128) = 4.85
    assert all(r["bytes_sent"] > 0 and r["ratio"] > 10 for r in rows)
    assert summary["config"]["compression"] == "topk-qsgd" and summary["accumulate"] == 2
    assert summary["effective_batch"] == 16 * 2 * 2
    assert summary["compressor"].startswith("TopKQSGD(ratio=0.01, bits=8")
    assert summary["ratio"] > 10 and summary["steps"] == 12
    assert 0.0 <= summary["val_accuracy"] <= 1.0 and math.isfinite(summary["val_loss"])


@pytest.mark.multirank
@pytest.mark.timeout(90)
def test_train_digits_epoch_flushes_partial_window(tmp_path: Path) -> None:
    """One epoch of digits: 1,437 images / 2 ranks / 32 = 22 micro-batches = 5 windows of 4 + a flush of 2.

    4-bit QSGD without error feedback: unbiased, so six steps already learn. (With error
    feedback, 4-bit payloads are scaled by 1/(1+w) = 0.24 to keep the residual bounded, which
    slows the first steps; see hvd_gradcomp.codecs.compressor.qsgd_ef_scale.)
    """
    _run_2_ranks([TRAIN, "--data", "digits", "--steps", "0", "--epochs", "1", "--micro-batch", "32",
                  "--compression", "qsgd", "--bits", "4", "--no-error-feedback", "--accumulate", "4",
                  "--out-dir", str(tmp_path),
                  "--run-name", "d", "--no-progress"])
    rows = _rows(tmp_path / "d.csv")
    summary = json.loads((tmp_path / "d.json").read_text())
    assert len(rows) == 6 and summary["steps"] == 6
    assert all(r["epoch"] == 0 and r["bytes_sent"] > 0 for r in rows)
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert summary["compressor"].startswith("QSGD(bits=4")
    assert summary["val_accuracy"] > 0.3  # 10 classes: chance is 0.1


def _bench(tmp_path: Path, *flags: str) -> Tuple[dict, str]:
    """The synthetic benchmark on 2 ranks with a tiny model: (its JSON, its output)."""
    out = tmp_path / "bench.json"
    text = _run_2_ranks([BENCH, "--params", "1e5", "--width", "128", *flags, "--json", str(out)])
    return json.loads(out.read_text()), text


@pytest.mark.multirank
@pytest.mark.timeout(90)
def test_synthetic_benchmark_tiny_json(tmp_path: Path) -> None:
    r, text = _bench(tmp_path, "--warmup", "1", "--iters", "3", "--compression", "topk-qsgd", "--ratio", "0.01")
    assert r["ranks"] == 2 and r["iters"] == 3 and len(r["step_times_s"]) == 3
    assert r["params"] == 6 * (128 * 128 + 128) + 128 * 1000 + 1000
    assert r["raw_bytes_per_step"] == 4 * r["params"]
    assert 0 < r["bytes_per_step"] < r["raw_bytes_per_step"] / 10 and r["ratio"] > 10
    assert r["samples_per_s_total_mean"] == pytest.approx(2 * r["samples_per_s_rank_mean"])
    assert 0 <= r["comm_s"] <= r["step_s"] and r["comm_share"] == pytest.approx(r["comm_s"] / r["step_s"])
    assert 0 < r["codec_s"] < r["step_s"] and 0 <= r["exposed_comm_s"] <= r["comm_s"] and r["auto"] is None
    assert "Total samples/sec on 2 rank(s)" in text


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_synthetic_benchmark_auto_decides_during_warmup(tmp_path: Path) -> None:
    r, text = _bench(tmp_path, "--warmup", "9", "--iters", "2", "--compression", "auto")
    auto = r["auto"]
    assert auto["step"] >= 11 and auto["link"]["bandwidth_Bps"] > 0   # 8 exploring steps, then decided
    assert len(auto["decisions"]) == 7 and set(auto["decisions"].values()) <= {"sparse", "qsgd", "fp16", "dense"}
    assert all(len(t["codec_ms"]) == 4 for t in auto["tensors"].values())
    assert f"Auto: step {auto['step']}:" in text


@pytest.mark.multirank
@pytest.mark.timeout(90)
def test_synthetic_benchmark_stock_fp16_bytes(tmp_path: Path) -> None:
    r, _ = _bench(tmp_path, "--warmup", "0", "--iters", "2", "--optimizer", "stock", "--compression", "fp16")
    assert r["optimizer"] == "stock" and r["bytes_per_step"] == r["raw_bytes_per_step"] // 2


@pytest.mark.multirank
@pytest.mark.timeout(90)
def test_synthetic_benchmark_no_exchange_reference(tmp_path: Path) -> None:
    """``--optimizer none``: the benchmark's floor row sends one float per step and times the wait for it."""
    r, _ = _bench(tmp_path, "--warmup", "1", "--iters", "3", "--optimizer", "none", "--compression", "none")
    assert r["optimizer"] == "none" and r["bytes_per_step"] == 4 and r["codec_s"] == 0.0
    assert 0 < r["comm_s"] < r["step_s"] and len(r["sync_s_per_rank"]) == 2 and len(r["sync_s_per_rank"][0]) == 3


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize("argv, message", [
    (["--ratio", "2"], "ratio must be in (0, 1]"),
    (["--bits", "9"], "bits must be in 2..8"),
    (["--compression", "zip"], "invalid choice: 'zip'"),
    (["--steps", "0"], "give --steps N"),
    (["--micro-batch", "0"], "--micro-batch must be >= 1"),
])
def test_train_bad_flags_are_usage_errors(argv: List[str], message: str) -> None:
    res = subprocess.run([sys.executable, TRAIN, *argv], capture_output=True, text=True, timeout=50,
                         env=rank_env())
    assert res.returncode == 2
    assert message in res.stderr and "Traceback" not in res.stderr


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize("argv, message", [
    (["--optimizer", "none", "--compression", "topk"], "--optimizer none sends nothing to compress"),
    (["--optimizer", "none", "--accumulate", "2"], "--optimizer none is timed with --accumulate 1"),
])
def test_synthetic_benchmark_bad_flags_are_usage_errors(argv: List[str], message: str) -> None:
    res = subprocess.run([sys.executable, BENCH, *argv], capture_output=True, text=True, timeout=50, env=rank_env())
    assert res.returncode == 2
    assert message in res.stderr and "Traceback" not in res.stderr


@pytest.mark.timeout(60)
def test_flags_override_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    train = _load_train_module()
    monkeypatch.setenv("HVDGC_COMPRESSION", "qsgd")
    monkeypatch.setenv("HVDGC_BITS", "8")
    monkeypatch.setenv("HVDGC_ERROR_FEEDBACK", "1")
    _, cfg = train.parse_args(["--bits", "4", "--no-error-feedback"])
    assert (cfg.compression, cfg.bits, cfg.error_feedback, cfg.seed) == ("qsgd", 4, False, 0)
    assert train.default_run_name("text", cfg) == "text-qsgd-b4-noef-acc1"
