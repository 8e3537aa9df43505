"""hvdgc-launch end to end: real 2-rank runs of tests/scripts/launch_target.py under Gloo and MPI.

Each test starts the installed console script (or ``python -m hvd_gradcomp.launchers.cli`` before the
editable install) in its own process group with a timeout; a failure shows every rank's
output.
"""
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List

import pytest

from tests.harness import BIN, HOROVODRUN, ROOT, launch, rank_env

TARGET = "tests/scripts/launch_target.py"
NASTY_ARGS = ["--steps", "2", "--note", "two words", "it's \"quoted\"", "a;b && echo pwned", "$HOME", "--", "-np"]
# Open MPI may split a line and glue another rank's prefix into it, so records are found
# anywhere in the output, not per line, and every field is matched exactly.
RANK_RE = re.compile(r"rank=(\d+) size=(\d+) compression=(\S+) ratio=([\d.e-]+) bits=(\d+) accumulate=(\d+) "
                     r"error_feedback=(\d) args=")
DONE_RE = re.compile(r"done rank=(\d+) steps=(\d+) loss=([-\d.e]+) params=([-\d.e]+)")
COMPRESSOR_RE = re.compile(r"rank=(\d+) compressor=([^\n]*?\))")

pytestmark = pytest.mark.multirank


def _launcher() -> List[str]:
    script = BIN / "hvdgc-launch"
    return [str(script)] if script.exists() else [sys.executable, "-m", "hvd_gradcomp.launchers.cli"]


def _require_horovodrun() -> None:
    if not Path(HOROVODRUN).exists():
        if os.environ.get("CI"):
            pytest.fail(f"{HOROVODRUN} missing on CI; run bash scripts/setup.sh")
        pytest.skip(f"{HOROVODRUN} not built yet (bash scripts/setup.sh)")


def _compressors_importable() -> bool:
    try:
        from hvd_gradcomp import TopKQSGD  # noqa: F401
    except Exception:
        return False
    return True


def _parse_ranks(output: str, np: int) -> Dict[int, Dict[str, object]]:
    """Per rank: what it received and how its training ended; fails with the output if any is missing."""
    ranks: Dict[int, Dict[str, object]] = {}
    for match in RANK_RE.finditer(output):
        r, size, comp, ratio, bits, acc, ef = match.groups()
        ranks.setdefault(int(r), {}).update(size=int(size), compression=comp, ratio=float(ratio), bits=int(bits),
                                            accumulate=int(acc), error_feedback=int(ef),
                                            args=json.JSONDecoder().raw_decode(output, match.end())[0])
    for match in DONE_RE.finditer(output):
        ranks.setdefault(int(match.group(1)), {}).update(steps=int(match.group(2)), params=match.group(4))
    for match in COMPRESSOR_RE.finditer(output):
        ranks.setdefault(int(match.group(1)), {}).update(compressor=match.group(2))
    complete = [r for r in range(np) if {"size", "params", "compressor"} <= set(ranks.get(r, {}))]
    if complete != list(range(np)):
        pytest.fail(f"expected complete output from ranks 0..{np - 1}, got {sorted(ranks)}\n"
                    f"--- output of all ranks ---\n{output}")
    return ranks


def _assert_compressed_run(output: str, compression: str, ratio: float, accumulate: int) -> None:
    ranks = _parse_ranks(output, 2)
    for r in (0, 1):
        got = ranks[r]
        assert (got["size"], got["compression"], got["ratio"], got["bits"], got["accumulate"],
                got["error_feedback"]) == (2, compression, ratio, 8, accumulate, 1), output
        assert got["args"] == NASTY_ARGS, output
        assert got["steps"] == 2, output
        if _compressors_importable():
            assert str(got["compressor"]).startswith("TopKQSGD(ratio=0.05, bits=8"), output
        else:
            assert str(got["compressor"]).startswith("unavailable ("), output
    # Averaged gradients leave identical parameters on every rank.
    assert ranks[0]["params"] == ranks[1]["params"], output


@pytest.mark.parametrize("flags", [["--gloo"], ["--mpi"], ["--launcher", "mpirun"]],
                         ids=["horovodrun-gloo", "horovodrun-mpi", "mpirun"])
def test_two_ranks_receive_settings_and_arguments(flags):
    _require_horovodrun()
    argv = [*_launcher(), "-np", "2", *flags, "--compression", "topk-qsgd", "--ratio", "0.05", "--accumulate", "2",
            TARGET, *NASTY_ARGS]
    res = launch(argv, timeout=150, env=rank_env())
    assert res.returncode == 0, f"exit {res.returncode}\n--- output of all ranks ---\n{res.stdout}"
    _assert_compressed_run(res.stdout, "topk-qsgd", 0.05, 2)


@pytest.mark.parametrize("flags", [["--gloo"], ["--launcher", "mpirun"]], ids=["horovodrun-gloo", "mpirun"])
def test_failing_rank_exit_code_comes_back(flags):
    _require_horovodrun()
    argv = [*_launcher(), "-np", "2", *flags, TARGET, "--fail-rank", "1", "--exit-code", "3"]
    res = launch(argv, timeout=150, env=rank_env())
    assert "rank=1 exiting with 3" in res.stdout, res.stdout
    assert res.returncode != 0, f"the job failed on rank 1 but the launcher exited 0\n{res.stdout}"
    if "--launcher" in flags:  # mpirun reports the failed rank's own status
        assert res.returncode == 3, res.stdout


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status  # a zombie has ended; only its parent has not reaped it


@pytest.mark.parametrize("flags", [["--gloo"], ["--launcher", "mpirun"]], ids=["horovodrun-gloo", "mpirun"])
def test_ctrl_c_ends_every_rank(flags):
    _require_horovodrun()
    argv = [*_launcher(), "-np", "2", *flags, TARGET, "--sleep", "300"]
    # Own session, like a terminal's job; SIGINT goes to the launcher only, as with Ctrl-C
    # in a shell where the ranks live in the launcher's separate process group.
    proc = subprocess.Popen(argv, cwd=ROOT, env=rank_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    lines: List[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    pids: List[int] = []
    try:
        deadline = time.monotonic() + 120
        while len(pids) < 2 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
            pids = [int(m.group(1)) for ln in list(lines) if (m := re.search(r"rank=\d+ pid=(\d+)", ln))]
        assert len(pids) == 2, "ranks did not start\n" + "".join(lines)
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail("launcher still running 30 s after SIGINT\n" + "".join(lines))
        deadline = time.monotonic() + 15
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in pids if _alive(p)], "ranks survived SIGINT\n" + "".join(lines)
        assert code != 0, "".join(lines)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        reader.join(timeout=5)


def test_dry_run_prints_and_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    argv = [*_launcher(), "--dry-run", "-np", "2", "--launcher", "mpirun", "--compression", "qsgd", "--bits", "4",
            "/usr/bin/touch", str(marker)]
    res = launch(argv, timeout=60, env=rank_env())
    assert res.returncode == 0, res.stdout
    assert not marker.exists()
    lines = res.stdout.splitlines()
    assert lines[:6] == ["# environment added:", "export HVDGC_BITS=4", "export HVDGC_COMPRESSION=qsgd",
                         # rank_env() sets HVDGC_COMPILE=0: shown, since every rank reads it
                         "# HVDGC_* variables passed on from this shell:", "export HVDGC_COMPILE=0",
                         "# command:"]
    assert lines[6].endswith(" -np 2 -H localhost:2 -bind-to none -map-by slot -x HVDGC_BITS "
                             "-x HVDGC_COMPRESSION -x PATH -x PYTHONPATH "
                             f"/usr/bin/touch {marker}"), lines[6]


@pytest.mark.parametrize("args, env, message", [
    (["-np", "2", "missing.py"], {}, "Error: script not found: missing.py"),
    (["-np", "0", TARGET], {}, "Error: -np must be at least 1, got 0"),
    (["-np", "4", "-H", "localhost:2", TARGET], {}, "Error: -np 4 is more than the 2 slots in -H localhost:2"),
    (["-H", "localhost:two", TARGET], {}, "Error: malformed slots in 'localhost:two'"),
    (["--compression", "gzip", TARGET], {}, "Error: unknown compression 'gzip'"),
    (["--launcher", "mpirun", TARGET], {"PATH": "/nonexistent"}, "Error: mpirun not found on the PATH"),
    ([TARGET], {"SLURM_JOB_ID": "5", "SLURM_JOB_NODELIST": "vm", "SLURM_TASKS_PER_NODE": "2(x)"},
     "Error: SLURM_TASKS_PER_NODE='2(x)' is malformed"),
])
def test_bad_input_exits_nonzero_with_one_line(args, env, message):
    res = launch([*_launcher(), *args], timeout=60, env=rank_env(env))
    assert res.returncode in (1, 2), res.stdout
    assert "Traceback" not in res.stdout, res.stdout
    errors = [line for line in res.stdout.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and errors[0].startswith(message), res.stdout
