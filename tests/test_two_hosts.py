"""Two hosts for real: hvdgc-launch across the network namespaces of scripts/two_hosts.sh.

Host ``hvdgc-a`` and host ``hvdgc-b`` are network namespaces joined by a veth pair limited to
1 Gbit/s per direction, each with its own sshd and host name. Every test launches from
inside ``hvdgc-a`` and checks, from the ranks' own output, that one rank ran on each host:
over ssh with horovodrun (Gloo and MPI) and mpirun, from a hostfile, under a two-node Slurm
(horovodrun and ``srun --mpi=pmix`` inside ``sbatch -N 2``), and when host B's rank is
killed or the link is cut mid-training (the job ends non-zero, in bounded time, naming B).

The session fixture brings the hosts up (``two_hosts.sh up``, idempotent) and always tears
them down (``two_hosts.sh down``), failures included. Needs root and ``ip netns``; without
them the tests skip, except on CI (``CI`` set), where they fail.
"""
import os
import re
import signal
import subprocess
import threading
import time
from typing import Dict, List, Tuple

import pytest

from tests.harness import ROOT, launch, rank_env
from tests.test_launch_e2e import NASTY_ARGS, TARGET, _alive, _assert_compressed_run, _launcher, \
    _require_horovodrun

pytestmark = [pytest.mark.multirank, pytest.mark.two_hosts]
A, B = "hvdgc-a", "hvdgc-b"
TWO_HOSTS = ROOT / "scripts" / "two_hosts.sh"
WHERE_RE = re.compile(r"rank=(\d+) host=(\S+) netns=(\S+) pid=(\d+)")
JOB_TIMEOUT_S = 180


def _skip_or_fail(why: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"two hosts unavailable on CI: {why}")
    pytest.skip(f"two hosts unavailable: {why}")


@pytest.fixture(scope="session")
def two_hosts():
    """Hosts hvdgc-a and hvdgc-b (and their two-node Slurm) up for the session; always torn down."""
    if os.geteuid() != 0:
        _skip_or_fail("needs root (network namespaces, sshd)")
    _require_horovodrun()
    up = subprocess.run(["bash", str(TWO_HOSTS), "up"], capture_output=True, text=True, timeout=600)
    try:
        if up.returncode != 0:
            _skip_or_fail(f"two_hosts.sh up failed:\n{up.stdout}\n{up.stderr}")
        yield
    finally:
        down = subprocess.run(["bash", str(TWO_HOSTS), "down"], capture_output=True, text=True, timeout=120)
        assert down.returncode == 0, f"two_hosts.sh down failed:\n{down.stdout}\n{down.stderr}"


def on(host: str, argv: List[str]) -> List[str]:
    """argv run as ``host``: in its namespaces, with its host name."""
    return ["bash", str(TWO_HOSTS), "exec", host, *argv]


def _where(output: str) -> Dict[int, Tuple[str, str]]:
    return {int(m.group(1)): (m.group(2), m.group(3)) for m in WHERE_RE.finditer(output)}


def _assert_one_rank_per_host(output: str) -> None:
    assert _where(output) == {0: (A, A), 1: (B, B)}, f"ranks did not run one per host\n{output}"


# ---------------------------------------------------------------- ssh launchers
@pytest.mark.timeout(JOB_TIMEOUT_S + 30)
@pytest.mark.parametrize("flags", [["--gloo"], ["--launcher", "mpirun", "--tcp"]], ids=["horovodrun-gloo", "mpirun"])
def test_two_hosts_one_rank_per_host_over_ssh(two_hosts, flags):
    argv = on(A, [*_launcher(), "-np", "2", "-H", f"{A}:1,{B}:1", "--network-interface", "hvdgc0", *flags,
                  "--compression", "topk-qsgd", "--ratio", "0.05", "--accumulate", "2", TARGET, *NASTY_ARGS])
    res = launch(argv, timeout=JOB_TIMEOUT_S, env=rank_env())
    assert res.returncode == 0, f"exit {res.returncode}\n--- output of all ranks ---\n{res.stdout}"
    _assert_one_rank_per_host(res.stdout)
    _assert_compressed_run(res.stdout, "topk-qsgd", 0.05, 2)


@pytest.mark.timeout(JOB_TIMEOUT_S + 30)
@pytest.mark.parametrize("flags", [["--mpi"]], ids=["horovodrun-mpi"])  # Horovod's own mpirun, from the file
def test_two_hosts_hostfile(two_hosts, tmp_path, flags):
    hostfile = tmp_path / "hosts"
    hostfile.write_text(f"# the two test hosts\n{A}:1\n{B}   # a bare host has one slot\n")
    argv = on(A, [*_launcher(), "--hostfile", str(hostfile), *flags, TARGET, "--steps", "2"])
    res = launch(argv, timeout=JOB_TIMEOUT_S, env=rank_env())
    assert res.returncode == 0, f"exit {res.returncode}\n--- output of all ranks ---\n{res.stdout}"
    _assert_one_rank_per_host(res.stdout)


# ---------------------------------------------------------------- Slurm, two nodes
def _job_state(job_id: str) -> Tuple[str, str]:
    proc = subprocess.run(on(A, ["scontrol", "show", "job", job_id]), capture_output=True, text=True, timeout=30)
    fields = dict(re.findall(r"(\w+)=(\S+)", proc.stdout))
    return fields.get("JobState", "UNKNOWN"), fields.get("ExitCode", "")


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("flags", [["--gloo"], ["--launcher", "srun"]], ids=["horovodrun-gloo", "srun-pmix"])
def test_two_hosts_slurm_sbatch_two_nodes(two_hosts, tmp_path, flags):
    script = tmp_path / "job.sbatch"
    gen = launch([*_launcher(), "--sbatch", "--nodes", "2", "--ntasks-per-node", "1", "--time", "5",
                  "--job-name", "hvdgc-two", "--output", str(tmp_path / "%x-%j.out"), *flags,
                  "--compression", "topk-qsgd", "--ratio", "0.05", "--accumulate", "2", "--sbatch-file", str(script),
                  TARGET, *NASTY_ARGS], timeout=60, env=rank_env())
    assert gen.returncode == 0, gen.stdout
    sub = subprocess.run(on(A, ["sbatch", "--parsable", str(script)]), cwd=tmp_path, env=rank_env(),
                         capture_output=True, text=True, timeout=30)
    assert sub.returncode == 0, f"sbatch failed: {sub.stderr}\n--- script ---\n{script.read_text()}"
    job_id = sub.stdout.strip().split(";")[0]
    log = tmp_path / f"hvdgc-two-{job_id}.out"
    deadline, state, code = time.monotonic() + JOB_TIMEOUT_S, "UNKNOWN", ""
    while time.monotonic() < deadline:
        state, code = _job_state(job_id)
        if state not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "UNKNOWN"):
            break
        time.sleep(1)
    text = log.read_text() if log.exists() else "(no output file)"
    if state in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
        subprocess.run(on(A, ["scancel", job_id]), timeout=30)
        pytest.fail(f"job {job_id} still {state} after {JOB_TIMEOUT_S}s\n{text}")
    assert (state, code) == ("COMPLETED", "0:0"), f"job {job_id}: {state} {code}\n{text}"
    assert f"hvdgc: job {job_id} on {A},{B}, 2 tasks" in text, text
    _assert_one_rank_per_host(text)
    _assert_compressed_run(text, "topk-qsgd", 0.05, 2)


# ---------------------------------------------------------------- faults across hosts
class _Job:
    """A launch from host A running in the background, its output collected as it comes."""

    def __init__(self, argv: List[str]) -> None:
        self.proc = subprocess.Popen(on(A, argv), cwd=ROOT, env=rank_env(), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines: List[str] = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(iter(self.proc.stdout.readline, "")),
                                       daemon=True)
        self.reader.start()

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for_training(self, timeout: float = 120) -> Dict[int, int]:
        """Both ranks took a step; returns each rank's pid."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            out = self.output
            if all(f"rank={r} trained step 1" in out for r in (0, 1)):
                return {int(m.group(1)): int(m.group(4)) for m in WHERE_RE.finditer(out)}
            time.sleep(0.2)
        pytest.fail(f"training did not start on both hosts\n{self.output}")

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the job still runs {timeout:.0f}s after the fault\n{self.output}")

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.reader.join(timeout=5)


FAULT_FLAGS = pytest.mark.parametrize("flags", [["--gloo"], ["--launcher", "mpirun", "--tcp"]],
                                      ids=["horovodrun-gloo", "mpirun"])
TRAIN = [TARGET, "--steps", "100000", "--step-sleep", "0.05"]


def _summary(output: str) -> str:
    lines = [ln for ln in output.splitlines() if ln.startswith("hvdgc-launch: the job failed")]
    assert lines, f"no closing message from hvdgc-launch\n{output}"
    return lines[-1]


@pytest.mark.timeout(300)
@FAULT_FLAGS
def test_two_hosts_sigkill_of_rank_on_host_b_ends_the_job_naming_b(two_hosts, flags):
    job = _Job([*_launcher(), "-np", "2", "-H", f"{A}:1,{B}:1", "--network-interface", "hvdgc0", *flags, *TRAIN])
    try:
        pids = job.wait_for_training()
        os.kill(pids[1], signal.SIGKILL)  # same PID namespace: only the network differs
        start = time.monotonic()
        code = job.wait(timeout=90)
        assert code != 0, job.output
        assert time.monotonic() - start < 90
        job.reader.join(timeout=5)
        assert f"host {B}" in _summary(job.output), job.output
        deadline = time.monotonic() + 30
        while _alive(pids[0]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(pids[0]), f"rank 0 on {A} outlived the job\n{job.output}"
    finally:
        job.close()


@pytest.mark.timeout(300)
@FAULT_FLAGS
def test_two_hosts_link_down_ends_the_job_naming_b(two_hosts, flags):
    job = _Job([*_launcher(), "-np", "2", "-H", f"{A}:1,{B}:1", "--network-interface", "hvdgc0",
                "--lost-host-timeout", "10", *flags, *TRAIN])
    pids: Dict[int, int] = {}
    try:
        pids = job.wait_for_training()
        subprocess.run(["ip", "netns", "exec", B, "ip", "link", "set", "hvdgc0", "down"], check=True, timeout=10)
        start = time.monotonic()
        code = job.wait(timeout=90)
        assert code != 0, job.output
        assert time.monotonic() - start < 60, job.output
        job.reader.join(timeout=5)
        assert f"hvdgc-launch: lost host {B}: no answer on port 22 for 10 s; ending the job" in job.output, job.output
        assert f"after losing host {B}" in _summary(job.output), job.output
    finally:
        subprocess.run(["ip", "netns", "exec", B, "ip", "link", "set", "hvdgc0", "up"], timeout=10)
        job.close()
    # With the link back, host B's rank finds its peer gone and ends too (Gloo/MPI errors or timeouts).
    deadline = time.monotonic() + 90
    while pids and _alive(pids[1]) and time.monotonic() < deadline:
        time.sleep(0.5)
    if pids and _alive(pids[1]):
        os.kill(pids[1], signal.SIGKILL)
        pytest.fail(f"rank 1 on {B} still ran 90 s after the link came back\n{job.output}")


# The benchmark's --two-hosts plan and report (no namespaces needed): tests/test_bench.py.
