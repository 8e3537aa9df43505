"""Unit tests of hvdgc-launch: command building (exact argv/env) and the CLI's input checks."""
import os
import shlex
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from hvd_gradcomp.launchers import cli
from hvd_gradcomp.launchers.command import (LaunchError, LaunchSpec, build_command, format_hosts, parse_hostfile_text,
                                            parse_hosts, program_argv, resolve_np)

SCRIPT = "tests/scripts/launch_target.py"
NO_SETTINGS: dict = {}   # no compression option given: hvdgc-launch exports no HVDGC_* setting


# ---------------------------------------------------------------- host parsing
def test_parse_hosts_with_and_without_slots():
    assert parse_hosts("node1:4,node2:2,10.0.0.3") == [("node1", 4), ("node2", 2), ("10.0.0.3", 1)]


@pytest.mark.parametrize("spec, fragment", [
    ("", "-H is empty"),
    ("node1:", "malformed slots in 'node1:'"),
    ("node1:0", "malformed slots in 'node1:0'"),
    ("node1:x", "malformed slots in 'node1:x'"),
    ("node1:4,,node2:4", "malformed host ''"),
    ("no de:2", "malformed host 'no de:2'"),
    ("a:1;rm -rf /", "malformed"),
    ("a:2,a:2", "host 'a' appears twice"),
])
def test_parse_hosts_rejects_malformed(spec, fragment):
    with pytest.raises(LaunchError) as err:
        parse_hosts(spec)
    assert fragment in str(err.value)


def test_parse_hostfile_text():
    text = "# cluster\nnode1 slots=4\n\nnode2 slots = 2  # spare\nnode3:3\nnode4\n"
    assert parse_hostfile_text(text) == [("node1", 4), ("node2", 2), ("node3", 3), ("node4", 1)]


def test_parse_hostfile_errors_name_the_line():
    with pytest.raises(LaunchError, match=r"hosts.txt line 2 \('node2 slots=zero'\)"):
        parse_hostfile_text("node1 slots=1\nnode2 slots=zero\n", "hosts.txt")
    with pytest.raises(LaunchError, match="lists no hosts"):
        parse_hostfile_text("# nothing\n\n")


def test_format_hosts_round_trips():
    assert format_hosts(parse_hosts("a:4,b:2")) == "a:4,b:2"


# ---------------------------------------------------------------- np
def test_resolve_np():
    assert resolve_np(None, None) == 1
    assert resolve_np(4, None) == 4
    assert resolve_np(None, [("a", 4), ("b", 2)]) == 6
    assert resolve_np(5, [("a", 4), ("b", 2)]) == 5


def test_resolve_np_errors():
    with pytest.raises(LaunchError, match="-np must be at least 1, got 0"):
        resolve_np(0, None)
    with pytest.raises(LaunchError, match=r"-np 7 is more than the 6 slots in -H a:4,b:2; lower -np"):
        resolve_np(7, [("a", 4), ("b", 2)], "-H a:4,b:2")


def test_program_argv_python_and_executable():
    assert program_argv(["t.py", "--x", "a b"], "/py") == ["/py", "t.py", "--x", "a b"]
    assert program_argv(["./job.sh", "1"], "/py") == ["./job.sh", "1"]
    with pytest.raises(LaunchError, match="missing training script"):
        program_argv([], "/py")


# ---------------------------------------------------------------- horovodrun
def test_horovodrun_default_is_localhost():
    argv, env = build_command(LaunchSpec(command=("train.py", "--epochs", "3"), np=8, python="/py"))
    assert argv == ["horovodrun", "-np", "8", "-H", "localhost:8", "/py", "train.py", "--epochs", "3"]
    assert env == {}


def test_horovodrun_all_flags():
    spec = LaunchSpec(command=("train.py",), np=6, hosts=(("a", 4), ("b", 4)), backend="gloo", ssh_port=2222,
                      start_timeout=60, verbose=True, python="/py", env={"HVDGC_COMPRESSION": "topk"})
    argv, env = build_command(spec)
    assert argv == ["horovodrun", "-np", "6", "-H", "a:4,b:4", "--gloo", "-p", "2222", "--start-timeout", "60",
                    "--verbose", "/py", "train.py"]
    assert env == {"HVDGC_COMPRESSION": "topk"}


def test_horovodrun_hostfile_and_mpi():
    spec = LaunchSpec(command=("train.py",), hosts=(("a", 2), ("b", 2)), hostfile="hosts.txt", backend="mpi",
                      python="/py")
    argv, _ = build_command(spec)
    assert argv == ["horovodrun", "-np", "4", "-H", "a:2,b:2", "--mpi", "/py", "train.py"]


def test_arguments_are_forwarded_untouched():
    nasty = ("train.py", "--name", "a b", "it's", 'say "hi"', "x; rm -rf /", "$HOME", "--", "-np", "9")
    argv, _ = build_command(LaunchSpec(command=nasty, np=1, python="/py"))
    assert argv[-len(nasty):] == list(nasty)
    assert argv[:-len(nasty)] == ["horovodrun", "-np", "1", "-H", "localhost:1", "/py"]


def test_np_larger_than_slots_fails():
    with pytest.raises(LaunchError, match=r"-np 9 is more than the 8 slots in -H a:4,b:4"):
        build_command(LaunchSpec(command=("t.py",), np=9, hosts=(("a", 4), ("b", 4)), hosts_origin="-H a:4,b:4"))


# ---------------------------------------------------------------- mpirun
def test_mpirun_as_root_with_env_and_forwarded_vars():
    spec = LaunchSpec(command=("train.py", "--lr", "0.1"), np=2, launcher="mpirun", python="/py", as_root=True,
                      env={"HVDGC_RATIO": "0.01", "HVDGC_COMPRESSION": "topk"},
                      forward_env=("PATH", "PYTHONPATH"))
    argv, env = build_command(spec)
    assert argv == ["mpirun", "--allow-run-as-root", "-np", "2", "-H", "localhost:2", "-bind-to", "none",
                    "-map-by", "slot", "-x", "HVDGC_COMPRESSION", "-x", "HVDGC_RATIO", "-x", "PATH",
                    "-x", "PYTHONPATH", "/py", "train.py", "--lr", "0.1"]
    assert env == {"HVDGC_RATIO": "0.01", "HVDGC_COMPRESSION": "topk"}


def test_mpirun_ssh_port_verbose_hostfile_not_root():
    spec = LaunchSpec(command=("./run.sh",), hosts=(("a", 2),), hostfile="h", launcher="mpirun", ssh_port=2222,
                      verbose=True, backend="mpi")
    argv, _ = build_command(spec)
    assert argv == ["mpirun", "-np", "2", "-H", "a:2", "-bind-to", "none", "-map-by", "slot",
                    "-mca", "plm_rsh_args", "-p 2222", "--display-map", "./run.sh"]


@pytest.mark.parametrize("kwargs, fragment", [
    ({"backend": "gloo"}, "--gloo needs horovodrun"),
    ({"start_timeout": 30}, "--start-timeout is a horovodrun option"),
])
def test_mpirun_rejects_horovodrun_only_options(kwargs, fragment):
    with pytest.raises(LaunchError, match=fragment):
        build_command(LaunchSpec(command=("t.py",), launcher="mpirun", **kwargs))


# ---------------------------------------------------------------- srun
def test_srun_inside_allocation():
    spec = LaunchSpec(command=("train.py",), hosts=(("n1", 4), ("n2", 4)), launcher="srun", python="/py",
                      env={"HVDGC_COMPRESSION": "qsgd"})
    argv, env = build_command(spec)
    assert argv == ["srun", "--mpi=pmix", "--ntasks", "8", "/py", "train.py"]
    assert env == {"HVDGC_COMPRESSION": "qsgd"}


@pytest.mark.parametrize("kwargs, fragment", [
    ({"backend": "gloo"}, "--gloo needs horovodrun"),
    ({"ssh_port": 22}, "-p/--ssh-port does not apply"),
    ({"hostfile": "h"}, "--hostfile does not apply"),
])
def test_srun_rejects_what_slurm_decides(kwargs, fragment):
    with pytest.raises(LaunchError, match=fragment):
        build_command(LaunchSpec(command=("t.py",), launcher="srun", **kwargs))


def test_unknown_launcher_and_backend():
    with pytest.raises(LaunchError, match="unknown launcher 'ssh'"):
        build_command(LaunchSpec(command=("t.py",), launcher="ssh"))
    with pytest.raises(LaunchError, match="unknown backend 'nccl'"):
        build_command(LaunchSpec(command=("t.py",), backend="nccl"))


# ---------------------------------------------------------------- the CLI (no process is started)
@pytest.fixture
def invoke(monkeypatch):
    """Run hvdgc-launch in-process outside Slurm, with launcher tools at fixed fake paths."""
    for name in ("SLURM_JOB_ID", "SLURM_JOB_NODELIST", "SLURM_NTASKS", "SLURM_NTASKS_PER_NODE",
                 "SLURM_TASKS_PER_NODE", "SLURM_JOB_NUM_NODES", "SLURM_NNODES",
                 *(k for k in os.environ if k.startswith("HVDGC_"))):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(cli, "_find_tool", lambda name: f"/opt/bin/{name}")
    monkeypatch.chdir(Path(__file__).resolve().parents[1])

    def run(*args: str, env=None):
        return CliRunner().invoke(cli.main, list(args), env=env)
    return run


def _dry_run_lines(env, argv):
    return ["# environment added:", *(f"export {k}={shlex.quote(v)}" for k, v in sorted(env.items())),
            "# command:", shlex.join(argv)]


def test_cli_dry_run_prints_exact_command_and_env(invoke):
    res = invoke("--dry-run", "-np", "2", "--gloo", "--compression", "topk-qsgd", "--ratio", "0.05", "--bits", "4",
                 "--accumulate", "8", "--seed", "3", SCRIPT, "--epochs", "3", "a b;c")
    assert res.exit_code == 0, res.output
    env = {"HVDGC_COMPRESSION": "topk-qsgd", "HVDGC_RATIO": "0.05", "HVDGC_BITS": "4", "HVDGC_ACCUMULATE": "8",
           "HVDGC_SEED": "3"}   # no --error-feedback given: not exported
    argv = ["/opt/bin/horovodrun", "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, SCRIPT,
            "--epochs", "3", "a b;c"]
    assert res.output.splitlines() == _dry_run_lines(env, argv)


def test_cli_forwards_options_after_the_script(invoke):
    res = invoke("--dry-run", SCRIPT, "-np", "5", "--compression", "bogus", "--help")
    assert res.exit_code == 0, res.output
    argv = ["/opt/bin/horovodrun", "-np", "1", "-H", "localhost:1", sys.executable, SCRIPT,
            "-np", "5", "--compression", "bogus", "--help"]
    assert res.output.splitlines() == _dry_run_lines(NO_SETTINGS, argv)


def test_cli_mpirun_no_error_feedback(invoke, monkeypatch):
    monkeypatch.setattr(cli.os, "geteuid", lambda: 1000)
    monkeypatch.setenv("PATH", "/usr/bin")
    monkeypatch.delenv("LD_LIBRARY_PATH", raising=False)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    res = invoke("--dry-run", "--launcher", "mpirun", "-H", "a:1,b:1", "--no-error-feedback", SCRIPT)
    assert res.exit_code == 0, res.output
    env = {"HVDGC_ERROR_FEEDBACK": "0"}
    argv = ["/opt/bin/mpirun", "-np", "2", "-H", "a:1,b:1", "-bind-to", "none", "-map-by", "slot",
            "-x", "HVDGC_ERROR_FEEDBACK", "-x", "PATH", sys.executable, SCRIPT]
    assert res.output.splitlines() == _dry_run_lines(env, argv)


def _exported(res) -> dict:
    """The variables a dry run adds, as a dict."""
    lines = res.output.splitlines()
    added = lines[lines.index("# environment added:") + 1:]
    return dict(line[len("export "):].split("=", 1) for line in added[:next(
        i for i, line in enumerate(added) if line.startswith("#"))])


def test_cli_without_compression_options_sets_no_settings(invoke):
    res = invoke("--dry-run", "-np", "4", SCRIPT)
    assert res.exit_code == 0, res.output
    assert _exported(res) == {}
    assert "HVDGC_" not in res.output


@pytest.mark.parametrize("args, env", [
    (("--ratio", "0.05"), {"HVDGC_RATIO": "0.05"}),
    (("--bits", "4"), {"HVDGC_BITS": "4"}),
    (("--accumulate", "8"), {"HVDGC_ACCUMULATE": "8"}),
    (("--seed", "7"), {"HVDGC_SEED": "7"}),
    (("--error-feedback",), {"HVDGC_ERROR_FEEDBACK": "1"}),
    (("--compression", "none"), {"HVDGC_COMPRESSION": "none"}),     # given, even if it is the default
    (("--compression", "topk", "--ratio", "0.1"), {"HVDGC_COMPRESSION": "topk", "HVDGC_RATIO": "0.1"}),
])
def test_cli_exports_only_the_options_given(invoke, args, env):
    res = invoke("--dry-run", "-np", "2", *args, SCRIPT)
    assert res.exit_code == 0, res.output
    assert _exported(res) == env


def test_what_is_not_given_reads_as_the_same_defaults():
    """A script reading the settings (config.from_env, ddp.compression_from_env) gets the defaults of
    the options left out, as when the launcher exported them all."""
    from hvd_gradcomp.config import CompressionConfig, from_env
    for given in ((), ("ratio",), ("compression", "bits")):
        env, _ = cli._compression_env("topk-qsgd", 0.05, 4, 1, True, None, given=given)
        assert set(env) == {f"HVDGC_{name.upper()}" for name in given}
        full = dict(compression="topk-qsgd", ratio=0.05, bits=4)
        assert from_env(env) == CompressionConfig(**{k: v for k, v in full.items() if k in given})
    all_env, owned = cli._compression_env("topk-qsgd", 0.05, 4, 2, False, 3)   # given=None: every setting
    assert from_env(all_env) == CompressionConfig("topk-qsgd", 0.05, 4, 2, False, 3)
    assert set(owned) == set(all_env) | {"HVDGC_CODEC_MODULE"}


def test_a_script_building_its_own_compressor_is_not_warned_under_a_bare_launch(invoke):
    """hvdgc-launch -np 4 train.py, whose script builds TopKQSGD(...) itself: nothing to warn about;
    with --ratio 0.05 the warning names that one setting only."""
    from hvd_gradcomp import settings
    built = {"compression": "topk-qsgd", "ratio": 0.01, "bits": 8, "error_feedback": True, "seed": 1234}
    bare = _exported(invoke("--dry-run", "-np", "4", SCRIPT))
    assert settings.unread_settings_message(built, bare, "TopKQSGD()") is None
    assert settings.unread_settings_message(dict(built, ratio=0.05),
                                            _exported(invoke("--dry-run", "--ratio", "0.05", SCRIPT))) is None
    message = settings.unread_settings_message(built, _exported(invoke("--dry-run", "--ratio", "0.05", SCRIPT)),
                                               "TopKQSGD()")
    assert message.startswith("HVDGC_RATIO=0.05 is set") and "built TopKQSGD()" in message, message
    assert "HVDGC_COMPRESSION" not in message and "HVDGC_BITS" not in message


def test_cli_hostfile(invoke, tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("a slots=2\nb slots=2\n")
    res = invoke("--dry-run", "--hostfile", str(hostfile), SCRIPT)
    assert res.exit_code == 0, res.output
    assert res.output.splitlines()[-1] == shlex.join(
        ["/opt/bin/horovodrun", "-np", "4", "-H", "a:2,b:2", sys.executable, SCRIPT])


def test_cli_inside_slurm_takes_hosts_and_np(invoke):
    slurm = {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "node[01-02]", "SLURM_TASKS_PER_NODE": "2(x2)",
             "SLURM_NTASKS": "3"}
    res = invoke("--dry-run", SCRIPT, env=slurm)
    assert res.exit_code == 0, res.output
    assert res.output.splitlines()[-1] == shlex.join(
        ["/opt/bin/horovodrun", "-np", "3", "-H", "node01:2,node02:2", sys.executable, SCRIPT])
    res = invoke("--dry-run", "--launcher", "srun", SCRIPT, env=slurm)
    assert res.exit_code == 0, res.output
    assert res.output.splitlines()[-1] == shlex.join(
        ["/opt/bin/srun", "--mpi=pmix", "--ntasks", "3", sys.executable, SCRIPT])


@pytest.mark.parametrize("args, env, message", [
    ((), None, "Error: missing training script"),
    (("nothere.py",), None, "Error: script not found: nothere.py"),
    (("--bogus", SCRIPT), None, "Error: unknown option --bogus"),
    (("-np", "0", SCRIPT), None, "Error: -np must be at least 1, got 0"),
    (("-np", "3", "-H", "a:1,b:1", SCRIPT), None, "Error: -np 3 is more than the 2 slots in -H a:1,b:1"),
    (("-H", "a:1:2", SCRIPT), None, "Error: malformed slots in 'a:1:2'"),
    (("-H", "a:1", "--hostfile", SCRIPT, SCRIPT), None, "Error: give either -H or --hostfile, not both"),
    (("--compression", "zip", SCRIPT), None, "Error: unknown compression 'zip'; choose one of none, fp16"),
    (("--ratio", "2", SCRIPT), None, "Error: ratio must be in (0, 1], got 2.0"),
    (("--accumulate", "0", SCRIPT), None, "Error: accumulate must be >= 1, got 0"),
    (("--launcher", "mpirun", "--gloo", SCRIPT), None, "Error: --gloo needs horovodrun"),
    (("--launcher", "srun", SCRIPT), None, "Error: --launcher srun runs inside a Slurm allocation"),
    (("--nodes", "2", SCRIPT), None, "Error: --nodes only applies with --sbatch; add --sbatch or drop it"),
    (("--submit", SCRIPT), None, "Error: --submit only applies with --sbatch"),
    ((SCRIPT,), {"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "n[1-2", "SLURM_TASKS_PER_NODE": "1"},
     "Error: SLURM_JOB_NODELIST='n[1-2' is malformed: unclosed '['"),
    ((SCRIPT,), {"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_TASKS_PER_NODE": "2(x3)"},
     "Error: SLURM_TASKS_PER_NODE='2(x3)' gives 3 nodes, more than the 2 in SLURM_JOB_NODELIST"),
    ((SCRIPT,), {"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "n1", "SLURM_TASKS_PER_NODE": "2", "SLURM_NTASKS": "x"},
     "Error: SLURM_NTASKS='x' is malformed"),
    (("-np", "4", SCRIPT), {"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "n1", "SLURM_NTASKS_PER_NODE": "2"},
     "Error: -np 4 is more than the 2 slots in the Slurm allocation (n1)"),
])
def test_cli_bad_input_is_one_clear_line(invoke, args, env, message):
    res = invoke(*args, env=env)
    assert res.exit_code == 2, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit)
    assert "Traceback" not in res.output
    assert [line for line in res.output.splitlines() if line.startswith("Error:")][0].startswith(message)


def test_cli_missing_launcher_tool(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.setattr(cli.sys, "executable", "/nonexistent/python")
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    res = CliRunner().invoke(cli.main, ["--dry-run", "--launcher", "mpirun", SCRIPT])
    assert res.exit_code == 1
    assert res.output.strip() == ("Error: mpirun not found on the PATH; install Open MPI (apt-get install "
                                  "openmpi-bin) or use --launcher horovodrun")


# ---------------------------------------------------------------- running (a tiny real child, no Horovod)
def test_run_adds_env_and_returns_exit_code():
    code = cli.run([sys.executable, "-c", "import os, sys; sys.exit(int(os.environ['HVDGC_TEST_CODE']))"],
                   {"HVDGC_TEST_CODE": "7"})
    assert code == 7


def test_run_reports_death_by_signal_as_128_plus_n():
    assert cli.run([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"], {}) == 143
