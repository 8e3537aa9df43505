"""A real Slurm run: sbatch a script written by ``hvdgc-launch --sbatch`` and check its output.

Needs the one-node cluster of scripts/slurm_up.sh (``make test`` starts it). Without it the
tests skip, except on CI (``CI`` set), where a Slurm that is down is a failure.
"""
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Tuple

import pytest

from hvd_gradcomp.launchers.slurm import job_state
from tests.harness import launch, rank_env
from tests.test_launch_e2e import NASTY_ARGS, TARGET, _assert_compressed_run, _launcher, _require_horovodrun

pytestmark = pytest.mark.slurm
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
                "BOOT_FAIL", "DEADLINE"}
JOB_TIMEOUT_S = 150


@pytest.fixture(scope="module")
def slurm() -> None:
    """The local cluster is up: sinfo answers and the node takes jobs."""
    why = _slurm_down_reason()
    if why:
        if os.environ.get("CI"):
            pytest.fail(f"Slurm is not usable on CI: {why}; scripts/slurm_up.sh should have started it")
        pytest.skip(f"no local Slurm ({why}); start one with: sudo bash scripts/slurm_up.sh")
    _require_horovodrun()


def _slurm_down_reason() -> str:
    if shutil.which("sbatch") is None or shutil.which("sinfo") is None:
        return "sbatch/sinfo not installed"
    proc = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, timeout=20)
    states = proc.stdout.split()
    if proc.returncode != 0:
        return f"sinfo failed: {proc.stderr.strip()}"
    if not any(s.rstrip("*") in ("idle", "mix", "alloc", "comp") for s in states):
        return f"no node takes jobs (sinfo states: {states or 'none'})"
    return ""


def _wait(job_id: str, log: Path) -> Tuple[str, str, str]:
    """Poll ``scontrol show job`` until the job ends; on timeout cancel it and fail with its log."""
    deadline = time.monotonic() + JOB_TIMEOUT_S
    state, code = "UNKNOWN", ""
    while time.monotonic() < deadline:
        state, code = job_state(job_id)
        if state in FINAL_STATES:
            break
        time.sleep(1)
    text = log.read_text() if log.exists() else "(no output file)"
    if state not in FINAL_STATES:
        subprocess.run(["scancel", job_id], timeout=20)
        pytest.fail(f"job {job_id} still {state} after {JOB_TIMEOUT_S}s\n--- {log} ---\n{text}")
    return state, code, text


def _sbatch_options(tmp_path: Path, name: str) -> list:
    return ["--sbatch", "--nodes", "1", "--ntasks-per-node", "2", "--time", "5", "--job-name", name,
            "--output", str(tmp_path / f"{name}-%j.out"), "--compression", "topk-qsgd", "--ratio", "0.05",
            "--accumulate", "2"]


def test_sbatch_generated_script_runs_two_compressed_ranks(slurm, tmp_path):
    script = tmp_path / "job.sbatch"
    gen = launch([*_launcher(), *_sbatch_options(tmp_path, "hvdgc-gloo"), "--gloo", "--sbatch-file", str(script),
                  TARGET, *NASTY_ARGS], timeout=60, env=rank_env())
    assert gen.returncode == 0, gen.stdout
    sub = subprocess.run(["sbatch", "--parsable", str(script)], cwd=tmp_path, env=rank_env(),
                         capture_output=True, text=True, timeout=30)
    assert sub.returncode == 0, f"sbatch failed: {sub.stderr}\n--- script ---\n{script.read_text()}"
    job_id = sub.stdout.strip().split(";")[0]
    state, code, text = _wait(job_id, tmp_path / f"hvdgc-gloo-{job_id}.out")
    assert (state, code) == ("COMPLETED", "0:0"), f"job {job_id}: {state} {code}\n{text}"
    assert f"hvdgc: job {job_id} on " in text and ", 2 tasks" in text, text
    assert "hvdgc: finished with exit code 0" in text, text
    _assert_compressed_run(text, "topk-qsgd", 0.05, 2)


def test_submit_with_srun_pmix(slurm, tmp_path):
    res = launch([*_launcher(), *_sbatch_options(tmp_path, "hvdgc-srun"), "--launcher", "srun", "--submit",
                  TARGET, *NASTY_ARGS], timeout=60, env=rank_env())
    assert res.returncode == 0, res.stdout
    assert res.stdout.startswith("Submitted batch job "), res.stdout
    job_id = res.stdout.split()[3]
    state, code, text = _wait(job_id, tmp_path / f"hvdgc-srun-{job_id}.out")
    assert (state, code) == ("COMPLETED", "0:0"), f"job {job_id}: {state} {code}\n{text}"
    assert "hvdgc: finished with exit code 0" in text, text
    _assert_compressed_run(text, "topk-qsgd", 0.05, 2)
