"""Launcher hygiene, one test (or more) named after each behaviour:

``kill -9`` of hvdgc-launch ends the job; hostfiles in every documented form reach the
launcher as hosts it reads; horovodrun/mpirun options are mapped or passed through between
two ``--``; Slurm node lists are counted before they are expanded; stale ``HVDGC_*``
variables never reach the ranks unseen, and ``--sbatch`` validates like a launch.
"""
import os
import re
import resource
import shlex
import signal
import subprocess
import sys
import threading
import time
from typing import List

import pytest
from click.testing import CliRunner

from hvd_gradcomp.launchers import cli
from hvd_gradcomp.launchers.slurm import SlurmError, allocation_from_env, expand_nodelist
from tests.harness import ROOT, launch, rank_env
from tests.test_launch_e2e import TARGET, _alive, _launcher, _require_horovodrun

SLURM_VARS = ("SLURM_JOB_ID", "SLURM_JOB_NODELIST", "SLURM_NTASKS", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE",
              "SLURM_JOB_NUM_NODES", "SLURM_NNODES")


@pytest.fixture
def invoke(monkeypatch):
    """hvdgc-launch in-process, outside Slurm, no HVDGC_* in the environment, fixed tool paths."""
    for name in [*SLURM_VARS, *(k for k in os.environ if k.startswith("HVDGC_"))]:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(cli, "_find_tool", lambda name: f"/opt/bin/{name}")
    monkeypatch.setattr(cli.os, "geteuid", lambda: 0)
    monkeypatch.setenv("PATH", "/usr/bin")
    monkeypatch.delenv("LD_LIBRARY_PATH", raising=False)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    monkeypatch.chdir(ROOT)

    def run(*args: str, env=None):
        return CliRunner().invoke(cli.main, list(args), env=env)
    return run


def _command(res) -> List[str]:
    assert res.exit_code == 0, res.output
    return shlex.split(res.output.splitlines()[-1])


def _error(res) -> str:
    assert res.exit_code == 2, res.output
    return [line for line in res.output.splitlines() if line.startswith("Error:")][0]


# ---------------------------------------------------------------- 10: kill -9 of the launcher
@pytest.mark.multirank
@pytest.mark.timeout(150)
@pytest.mark.parametrize("flags", [["--gloo"], ["--launcher", "mpirun"]], ids=["horovodrun-gloo", "mpirun"])
def test_kill_9_of_launcher_ends_every_rank(flags):
    _require_horovodrun()
    argv = [*_launcher(), "-np", "2", *flags, TARGET, "--sleep", "300"]
    proc = subprocess.Popen(argv, cwd=ROOT, env=rank_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    lines: List[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    pids: List[int] = []
    try:
        deadline = time.monotonic() + 100
        while len(pids) < 2 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
            pids = [int(m.group(1)) for ln in list(lines) if (m := re.search(r"rank=\d+ pid=(\d+)", ln))]
        assert len(pids) == 2, "ranks did not start\n" + "".join(lines)
        os.kill(proc.pid, signal.SIGKILL)  # only hvdgc-launch itself: no handler runs
        proc.wait(timeout=10)
        deadline = time.monotonic() + 20
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in pids if _alive(p)], "ranks outlived kill -9 of hvdgc-launch\n" + "".join(lines)
    finally:
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        reader.join(timeout=5)


def test_child_gets_sigterm_when_launcher_dies(tmp_path):
    """The mechanism alone, without Horovod: a grandchild of a killed launcher process ends."""
    marker = tmp_path / "child.pid"
    child_code = f"import os, time; open({str(marker)!r}, 'w').write(str(os.getpid())); time.sleep(300)"
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); from hvd_gradcomp.launchers import cli; "
            f"cli.run([sys.executable, '-c', {child_code!r}], {{}})")
    parent = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not (marker.exists() and marker.read_text()) and time.monotonic() < deadline:
            time.sleep(0.1)
        child = int(marker.read_text())
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=10)
        deadline = time.monotonic() + 10
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(child), "the job survived its launcher's SIGKILL"
    finally:
        try:
            os.killpg(parent.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# A launcher at its worst: it ignores SIGTERM and SIGINT, and its rank runs in a session of its
# own (as Horovod's middlemen start them) and ignores SIGTERM too.
_RANK = "import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); open({m!r}, 'w').write(str(os.getpid())); time.sleep(300)"
_STUBBORN = ("import os, signal, subprocess, sys, time; "
             "[signal.signal(s, signal.SIG_IGN) for s in (signal.SIGTERM, signal.SIGINT)]; "
             "subprocess.Popen([sys.executable, '-c', {rank!r}], start_new_session=True); "
             "open({m!r}, 'w').write(str(os.getpid())); time.sleep({life})")


def _stubborn_job(tmp_path, life: int = 300):
    """(argv of the launcher, path of its pid, path of its rank's pid)."""
    launcher, rank = tmp_path / "launcher.pid", tmp_path / "rank.pid"
    code = _STUBBORN.format(rank=_RANK.format(m=str(rank)), m=str(launcher), life=life)
    return [sys.executable, "-c", code], launcher, rank


def _read_pid(path, timeout: float = 30) -> int:
    deadline = time.monotonic() + timeout
    while not (path.exists() and path.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return int(path.read_text())


def _ended(pids, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not any(_alive(p) for p in pids)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["kill -9", "third Ctrl-C"])
def test_guard_ends_a_launcher_that_ignores_signals_and_its_rank_in_another_session(tmp_path, how):
    """hvdgc-launch killed (or interrupted three times): the guard ends the launcher and, as a
    subreaper, its rank in another session, both ignoring SIGTERM (SIGKILL after the grace)."""
    argv, launcher_pid, rank_pid = _stubborn_job(tmp_path)
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); from hvd_gradcomp.launchers import cli; "
            f"sys.exit(cli.run({argv!r}, {{}}, kill_after=1.0))")
    parent = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    pids = []
    try:
        pids = [_read_pid(launcher_pid), _read_pid(rank_pid)]
        if how == "kill -9":
            os.kill(parent.pid, signal.SIGKILL)
            parent.wait(timeout=10)
        else:
            for _ in range(3):
                os.kill(parent.pid, signal.SIGINT)
                time.sleep(0.3)
            assert parent.wait(timeout=30) == 128 + signal.SIGKILL
        assert _ended(pids, 20), f"still running: {[p for p in pids if _alive(p)]}"
    finally:
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        if parent.poll() is None:
            os.killpg(parent.pid, signal.SIGKILL)


@pytest.mark.timeout(60)
def test_what_a_launcher_leaves_behind_ends_with_it(tmp_path):
    """The launcher exits (code 3) and leaves a rank running in another session: run() returns 3
    and the rank has ended."""
    argv, launcher_pid, rank_pid = _stubborn_job(tmp_path, life=3)
    argv[-1] = argv[-1] + "; sys.exit(3)"
    t0 = time.monotonic()
    assert cli.run(argv, {}, kill_after=1.0) == 3
    rank = _read_pid(rank_pid, timeout=0)
    assert not _alive(rank)
    assert time.monotonic() - t0 < 30


# ---------------------------------------------------------------- 11: hostfiles
HOSTFILE = "# two nodes\nnodeA slots=2   # comment after a host\n\nnodeB:2\nnodeC\n"


@pytest.mark.parametrize("launcher, expected", [
    ("horovodrun", ["/opt/bin/horovodrun", "-np", "5", "-H", "nodeA:2,nodeB:2,nodeC:1"]),
    ("mpirun", ["/opt/bin/mpirun", "--allow-run-as-root", "-np", "5", "-H", "nodeA:2,nodeB:2,nodeC:1"]),
])
def test_hostfile_forms_reach_the_launcher_normalised(invoke, tmp_path, launcher, expected):
    hostfile = tmp_path / "hosts"
    hostfile.write_text(HOSTFILE)
    argv = _command(invoke("--dry-run", "--launcher", launcher, "--hostfile", str(hostfile), TARGET))
    assert argv[:len(expected)] == expected
    assert "--hostfile" not in argv  # neither tool reads all three forms from a file


@pytest.mark.parametrize("text, message", [
    ("nodeA slots=2\nnodeA:1\n", "host 'nodeA' appears twice"),
    ("nodeA slots=two\n", "hosts line 1 ('nodeA slots=two'); slots must be a whole number"),
    ("nodeA max_slots=4\n", "malformed host 'nodeA max_slots=4'"),
    ("# nothing\n", "lists no hosts"),
])
def test_bad_hostfiles_are_rejected_clearly(invoke, tmp_path, text, message):
    hostfile = tmp_path / "hosts"
    hostfile.write_text(text)
    assert message in _error(invoke("--dry-run", "--hostfile", str(hostfile), TARGET))


# ---------------------------------------------------------------- 12: launcher options
OPTIONS = ["--network-interface", "eth0", "--log-level", "debug", "--tcp", "-x", "NCCL_DEBUG=INFO", "-x", "HOME",
           "--timeline-filename", "/tmp/tl.json"]


def test_horovodrun_options_are_mapped(invoke):
    argv = _command(invoke("--dry-run", "-np", "2", *OPTIONS, TARGET, "--epochs", "1"))
    assert argv == ["/opt/bin/horovodrun", "-np", "2", "-H", "localhost:2", "--network-interface", "eth0",
                    "--log-level", "DEBUG", "--tcp", "--timeline-filename", "/tmp/tl.json", sys.executable, TARGET,
                    "--epochs", "1"]
    res = invoke("--dry-run", "-np", "2", *OPTIONS, TARGET)
    assert "export NCCL_DEBUG=INFO" in res.output.splitlines()


def test_mpirun_options_are_mapped(invoke):
    argv = _command(invoke("--dry-run", "-np", "2", "--launcher", "mpirun", *OPTIONS, TARGET))
    assert argv == ["/opt/bin/mpirun", "--allow-run-as-root", "-np", "2", "-H", "localhost:2", "-bind-to", "none",
                    "-map-by", "slot", "-mca", "btl", "tcp,self", "-mca", "btl_tcp_if_include", "eth0",
                    "-mca", "oob_tcp_if_include", "eth0",
                    "-x", "HOROVOD_LOG_LEVEL", "-x", "HOROVOD_TIMELINE", "-x", "NCCL_DEBUG",
                    "-x", "PATH", "-x", "HOME", sys.executable, TARGET]
    lines = invoke("--dry-run", "-np", "2", "--launcher", "mpirun", *OPTIONS, TARGET).output.splitlines()
    assert {"export HOROVOD_LOG_LEVEL=DEBUG", "export HOROVOD_TIMELINE=/tmp/tl.json"} <= set(lines)


def test_srun_gets_the_same_settings_through_the_environment(invoke):
    slurm = {"SLURM_JOB_ID": "3", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NTASKS_PER_NODE": "1",
             "SLURM_JOB_NUM_NODES": "2"}
    res = invoke("--dry-run", "--launcher", "srun", "--network-interface", "ib0", "--tcp", "--log-level", "info",
                 TARGET, env=slurm)
    assert _command(res) == ["/opt/bin/srun", "--mpi=pmix", "--ntasks", "2", sys.executable, TARGET]
    assert {"export OMPI_MCA_btl=tcp,self", "export OMPI_MCA_btl_tcp_if_include=ib0",
            "export OMPI_MCA_oob_tcp_if_include=ib0", "export HOROVOD_LOG_LEVEL=INFO"} <= set(res.output.splitlines())


@pytest.mark.parametrize("launcher, head", [
    ("horovodrun", ["/opt/bin/horovodrun", "-np", "2", "-H", "localhost:2"]),
    ("mpirun", ["/opt/bin/mpirun", "--allow-run-as-root", "-np", "2", "-H", "localhost:2"]),
])
def test_other_options_pass_through_between_double_dashes(invoke, launcher, head):
    # leading '--' or not, the launcher's own options sit between the two '--'
    for args in (["--", "--mca", "btl_tcp_links", "2", "--"], ["--mca", "btl_tcp_links", "2", "--"]):
        argv = _command(invoke("--dry-run", "-np", "2", "--launcher", launcher, *args, TARGET, "--", "-x"))
        assert argv[:len(head)] == head
        assert argv[-7:] == ["--mca", "btl_tcp_links", "2", sys.executable, TARGET, "--", "-x"]


@pytest.mark.parametrize("args, message", [
    (["--disable-cache", TARGET], "Error: unknown option --disable-cache; hvdgc-launch's own options go before "
                                  "the script (see hvdgc-launch --help), and options for the launcher itself go "
                                  "between two '--': hvdgc-launch [OPTIONS] -- --disable-cache ... -- SCRIPT"),
    (["--log-level", "LOUD", TARGET], "Error: Invalid value for '--log-level'"),
    (["--network-interface", "eth0;id", TARGET], "Error: malformed --network-interface 'eth0;id'"),
    (["-x", "1X=2", TARGET], "Error: malformed -x '1X=2'"),
    (["-x", "HVDGC_UNSET_HERE", TARGET], "Error: -x HVDGC_UNSET_HERE: HVDGC_UNSET_HERE is not set here"),
    (["-x", "HVDGC_SEED=3", TARGET], "Error: -x HVDGC_SEED: hvdgc-launch sets HVDGC_SEED from its own options"),
])
def test_bad_launcher_options_are_one_clear_line(invoke, args, message):
    assert _error(invoke("--dry-run", *args)).startswith(message)


# ---------------------------------------------------------------- 13: Slurm node lists
def test_huge_nodelist_is_refused_without_expanding():
    with pytest.raises(SlurmError, match=r"names 1000000000 nodes but SLURM_JOB_NUM_NODES=2; they must match"):
        allocation_from_env({"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "node[1-1000000000]",
                             "SLURM_JOB_NUM_NODES": "2", "SLURM_TASKS_PER_NODE": "1(x2)"})
    with pytest.raises(SlurmError, match=r"names 1000000000 nodes, more than 100000"):
        expand_nodelist("node[1-1000000000]")
    with pytest.raises(SlurmError, match=r"gives 1000000000 nodes, more than the 2 in SLURM_JOB_NODELIST"):
        allocation_from_env({"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "n[1-2]",
                             "SLURM_TASKS_PER_NODE": "1(x1000000000)"})


def test_huge_nodelist_in_a_real_launch_fails_fast_in_bounded_memory():
    """The launcher process, capped at 1 GiB of address space, answers in seconds."""
    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
    env = rank_env({"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "node[1-1000000000]", "SLURM_TASKS_PER_NODE": "1"})
    env.pop("SLURM_JOB_NUM_NODES", None)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "hvd_gradcomp.launchers.cli", "--dry-run", TARGET], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60, preexec_fn=cap)
    assert time.monotonic() - start < 30
    assert proc.returncode == 2, proc.stderr
    assert "Error: SLURM_JOB_NODELIST='node[1-1000000000]' names 1000000000 nodes, more than 100000" in proc.stderr


# ---------------------------------------------------------------- 14: stale HVDGC_* and --sbatch
def test_dry_run_shows_stale_and_inherited_hvdgc_variables(invoke):
    res = invoke("--dry-run", "-np", "1", TARGET, env={"HVDGC_SEED": "5", "HVDGC_COMPRESSION": "topk",
                                                       "HVDGC_COMPILE": "0"})
    lines = res.output.splitlines()
    assert not any(line.startswith("export HVDGC_COMPRESSION") for line in lines)  # no --compression: none set
    # the stale values are removed, so the ranks read the defaults, as from_env() does without them
    assert lines[lines.index("# environment removed (set by hvdgc-launch options only):") + 1] == \
        "unset HVDGC_COMPRESSION HVDGC_SEED"
    res = invoke("--dry-run", "-np", "1", "--compression", "qsgd", TARGET, env={"HVDGC_COMPRESSION": "topk"})
    assert "export HVDGC_COMPRESSION=qsgd" in res.output.splitlines()  # the option's value replaces the stale one
    assert lines[lines.index("# HVDGC_* variables passed on from this shell:") + 1] == "export HVDGC_COMPILE=0"


@pytest.mark.multirank
def test_stale_hvdgc_seed_does_not_reach_the_ranks():
    """A real rank (mpirun -np 1 running env) sees the launch's settings only."""
    res = launch([*_launcher(), "-np", "1", "--launcher", "mpirun", "--bits", "4", "/usr/bin/env"], timeout=60,
                 env=rank_env({"HVDGC_SEED": "5", "HVDGC_BITS": "2"}))
    assert res.returncode == 0, res.stdout
    seen = dict(line.split("=", 1) for line in res.stdout.splitlines() if line.startswith("HVDGC_"))
    assert "HVDGC_SEED" not in seen, res.stdout
    assert seen["HVDGC_BITS"] == "4", res.stdout


@pytest.mark.parametrize("args, message", [
    (["--launcher", "srun", "--gloo"], "Error: --gloo needs horovodrun"),
    (["--launcher", "mpirun", "--start-timeout", "5"], "Error: --start-timeout is a horovodrun option"),
    (["--launcher", "srun", "-p", "22"], "Error: -p/--ssh-port does not apply to --launcher srun"),
    (["-x", "NOT_SET_ANYWHERE_X"], "Error: -x NOT_SET_ANYWHERE_X: NOT_SET_ANYWHERE_X is not set here"),
    (["--nodes", "0"], "Error: --nodes and --ntasks-per-node must be at least 1"),
])
def test_sbatch_validates_like_a_direct_launch(invoke, args, message):
    assert _error(invoke("--sbatch", *args, TARGET)).startswith(message)


def test_sbatch_carries_mapped_and_passed_through_options(invoke, monkeypatch):
    monkeypatch.setattr(cli, "_self_command", lambda: ["hvdgc-launch"])
    res = invoke("--sbatch", "--nodes", "2", "--launcher", "mpirun", "--network-interface", "eth0", "--tcp",
                 "-x", "A=1", "--", "--mca", "btl_tcp_links", "2", "--", TARGET, "--steps", "1")
    assert res.exit_code == 0, res.output
    line = [ln for ln in res.output.splitlines() if ln.startswith("hvdgc-launch ")][0]
    assert shlex.split(line) == [
        "hvdgc-launch", "--network-interface", "eth0", "--tcp", "-x", "A=1", "--launcher", "mpirun",
        "--", "--mca", "btl_tcp_links", "2", "--", TARGET, "--steps", "1"]


# ---------------------------------------------------------------- the job watch (no Horovod)
def test_watch_names_the_host_of_the_first_failed_rank():
    from hvd_gradcomp.launchers.watch import JobWatch, rank_hosts
    watch = JobWatch(rank_hosts([("a", 2), ("b", 2)], 4))
    watch.scan(b"Process 3 exit with status code 255.")
    watch.scan(b"Process name: 2")
    watch.scan(b"Process name: 0")  # only the first report counts
    assert watch.summary(1) == "hvdgc-launch: the job failed (exit code 1); first failure reported: rank 2 on host b"
    assert watch.summary(0) is None
    mpi = JobWatch(["a", "b"])
    mpi.scan(b"mpirun noticed that process rank 1 with PID 0 on node b exited on signal 9 (Killed).")
    assert mpi.summary(137).endswith("first failure reported: rank 1 on host b")


def test_watch_ends_the_job_when_a_host_that_answered_stops_answering():
    import socket
    from hvd_gradcomp.launchers.watch import JobWatch
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    port = server.getsockname()[1]
    lost: List[str] = []
    watch = JobWatch(["x"], remote=["127.0.0.1", "no-such-host.invalid"], port=port, timeout=1.0, interval=0.2)
    watch.start_watchdog(lost.append)
    time.sleep(0.7)
    assert lost == []  # answering; the unresolvable host never answered, so it is not watched
    server.close()
    deadline = time.monotonic() + 10
    while not lost and time.monotonic() < deadline:
        time.sleep(0.1)
    watch.stop()
    assert lost == ["127.0.0.1"]
    assert watch.summary(143) == "hvdgc-launch: the job failed (exit code 143) after losing host 127.0.0.1"


def test_keep_freed_memory_sets_glibcs_variables_on_every_rank(invoke):
    lines = invoke("--dry-run", "-np", "2", "--keep-freed-memory", TARGET).output.splitlines()
    assert {"export MALLOC_MMAP_MAX_=0", f"export MALLOC_TRIM_THRESHOLD_={1 << 40}"} <= set(lines)
    argv = _command(invoke("--dry-run", "-np", "2", "--launcher", "mpirun", "--keep-freed-memory", TARGET))
    assert argv[argv.index("MALLOC_MMAP_MAX_") - 1] == "-x" and "MALLOC_TRIM_THRESHOLD_" in argv
    assert "MALLOC_MMAP_MAX_" not in invoke("--dry-run", "-np", "2", TARGET).output
