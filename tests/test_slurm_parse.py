"""Unit tests of Slurm support: node lists, tasks per node, allocations and batch scripts."""
import shlex
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from hvd_gradcomp.launchers import cli
from hvd_gradcomp.launchers.slurm import (Allocation, BatchJob, SlurmError, allocation_from_env, expand_nodelist,
                                          launcher_args, parse_tasks_per_node, render_sbatch)

ROOT = Path(__file__).resolve().parents[1]
TEMPLATES = sorted((ROOT / "hvd_gradcomp" / "launchers" / "slurm").glob("*.sbatch"))


@pytest.mark.parametrize("spec, hosts", [
    ("vm", ["vm"]),
    ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
    ("n[8-11]", ["n8", "n9", "n10", "n11"]),
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
    ("a[1-2]b[3,5]", ["a1b3", "a1b5", "a2b3", "a2b5"]),
    ("rack1-[2-3].cluster", ["rack1-2.cluster", "rack1-3.cluster"]),
    ("x,y[1],z", ["x", "y1", "z"]),
])
def test_expand_nodelist(spec, hosts):
    assert expand_nodelist(spec) == hosts


@pytest.mark.parametrize("spec, fragment", [
    ("", "empty host name"),
    ("a,,b", "empty host name"),
    ("node[1-3", "unclosed '['"),
    ("node1-3]", "unbalanced brackets"),
    ("node[[1]]", "unbalanced brackets"),
    ("node[]", "bad range ''"),
    ("node[a-c]", "bad range 'a-c'"),
    ("node[5-2]", "range '5-2' runs backwards"),
    ("no de", "bad host name 'no de'"),
])
def test_expand_nodelist_rejects_malformed(spec, fragment):
    with pytest.raises(SlurmError) as err:
        expand_nodelist(spec)
    assert str(err.value).startswith(f"SLURM_JOB_NODELIST={spec!r} is malformed: ")
    assert fragment in str(err.value)


@pytest.mark.parametrize("spec, counts", [
    ("4", [4]),
    ("4(x2),2", [4, 4, 2]),
    ("1,2(x3)", [1, 2, 2, 2]),
])
def test_parse_tasks_per_node(spec, counts):
    assert parse_tasks_per_node(spec) == counts


@pytest.mark.parametrize("spec", ["", "0", "4(x0)", "4(2)", "x", "4(x2", "-1", "2,,2"])
def test_parse_tasks_per_node_rejects_malformed(spec):
    with pytest.raises(SlurmError, match=r"SLURM_TASKS_PER_NODE=.* is malformed: expected forms like 4 or 4\(x2\),2"):
        parse_tasks_per_node(spec)


def test_allocation_outside_slurm_is_none():
    assert allocation_from_env({"SLURM_JOB_NODELIST": "n1"}) is None


def test_allocation_from_tasks_per_node():
    env = {"SLURM_JOB_ID": "9", "SLURM_JOB_NODELIST": "node[01-03,07]", "SLURM_TASKS_PER_NODE": "4(x2),2,1",
           "SLURM_NTASKS": "11"}
    assert allocation_from_env(env) == Allocation(
        job_id="9", hosts=(("node01", 4), ("node02", 4), ("node03", 2), ("node07", 1)), ntasks=11,
        nodelist="node[01-03,07]")


def test_ntasks_per_node_wins_and_applies_to_every_node():
    env = {"SLURM_JOB_ID": "9", "SLURM_JOB_NODELIST": "gpu[1-2]", "SLURM_NTASKS_PER_NODE": "8",
           "SLURM_TASKS_PER_NODE": "4(x2)"}
    alloc = allocation_from_env(env)
    assert alloc.hosts == (("gpu1", 8), ("gpu2", 8))
    assert alloc.ntasks is None


@pytest.mark.parametrize("env, message", [
    ({"SLURM_JOB_ID": "1"}, "SLURM_JOB_ID is set but SLURM_JOB_NODELIST is not"),
    ({"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "n1"}, "neither SLURM_NTASKS_PER_NODE nor SLURM_TASKS_PER_NODE"),
    ({"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "n[1-3]", "SLURM_TASKS_PER_NODE": "2,2"},
     "SLURM_TASKS_PER_NODE='2,2' gives 2 nodes but SLURM_JOB_NODELIST has 3; they must match"),
    ({"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "n1", "SLURM_NTASKS_PER_NODE": "two"},
     "SLURM_NTASKS_PER_NODE='two' is malformed"),
    ({"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "n1", "SLURM_TASKS_PER_NODE": "2", "SLURM_NTASKS": "0"},
     "SLURM_NTASKS='0' is malformed: expected a whole number >= 1"),
])
def test_allocation_errors(env, message):
    with pytest.raises(SlurmError) as err:
        allocation_from_env(env)
    assert str(err.value).startswith(message)


# ---------------------------------------------------------------- batch scripts
def test_render_sbatch_exact():
    job = BatchJob(command=("hvdgc-launch", "--compression", "topk", "train.py", "--name", "a b; echo pwned"),
                   nodes=2, ntasks_per_node=4, time="1:00:00", partition="gpu", job_name="run1",
                   output="logs/%j.out", workdir="/data/my runs")
    assert render_sbatch(job).splitlines() == [
        "#!/bin/bash",
        "# Written by hvdgc-launch --sbatch. Edit freely; submit with: sbatch THIS_FILE",
        "#SBATCH --job-name=run1",
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=4",
        "#SBATCH --time=1:00:00",
        "#SBATCH --partition=gpu",
        "#SBATCH --output=logs/%j.out",
        "",
        "cd '/data/my runs' || exit 1",
        'echo "hvdgc: job $SLURM_JOB_ID on $SLURM_JOB_NODELIST, $SLURM_NTASKS tasks"',
        "# hvdgc-launch reads the hosts and slots from Slurm's environment.",
        "hvdgc-launch --compression topk train.py --name 'a b; echo pwned'",
        "rc=$?",
        'echo "hvdgc: finished with exit code $rc"',
        "exit $rc",
    ]


def test_rendered_script_runs_arguments_without_shell_interpretation(tmp_path):
    marker = tmp_path / "pwned"
    args = ("a b", "it's", f"x; touch {marker}", "$(touch {marker})", "`id`")
    script = render_sbatch(BatchJob(command=("printf", "<%s>\\n", *args)))
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=10)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[1:-1] == [f"<{a}>" for a in args]
    assert not marker.exists()


@pytest.mark.parametrize("kwargs, message", [
    ({"command": ()}, "missing training script"),
    ({"nodes": 0}, "--nodes and --ntasks-per-node must be at least 1"),
    ({"time": "1 hour"}, "--time '1 hour' is not a Slurm time"),
    ({"partition": "gpu\n#SBATCH --x"}, "--partition 'gpu\\n#SBATCH --x' may only contain"),
    ({"job_name": "my job"}, "--job-name 'my job' may only contain"),
    ({"output": "my log.out"}, "--output 'my log.out' must be a path without spaces"),
])
def test_render_sbatch_rejects_bad_options(kwargs, message):
    job = dict(command=("t.py",))
    job.update(kwargs)
    with pytest.raises(SlurmError) as err:
        render_sbatch(BatchJob(**job))
    assert str(err.value).startswith(message)


@pytest.mark.parametrize("time", ["30", "10:00", "1:00:00", "2-0", "2-12:00", "1-00:00:00"])
def test_render_sbatch_accepts_slurm_times(time):
    assert f"#SBATCH --time={time}" in render_sbatch(BatchJob(command=("t.py",), time=time))


def test_launcher_args():
    assert launcher_args([("-np", 4), ("--gloo", True), ("--mpi", False), ("-p", None), ("--ratio", 0.5)]) == [
        "-np", "4", "--gloo", "--ratio", "0.5"]


def test_cli_sbatch_prints_script_that_relaunches_with_same_options(monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(cli, "_self_command", lambda: ["hvdgc-launch"])
    res = CliRunner().invoke(cli.main, [
        "--sbatch", "--nodes", "2", "--ntasks-per-node", "4", "--time", "10", "--partition", "debug",
        "-np", "6", "--mpi", "--compression", "topk-qsgd", "--ratio", "0.05", "--bits", "4", "--accumulate", "2",
        "--no-error-feedback", "tests/scripts/launch_target.py", "--note", "a b"])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert lines[2:8] == ["#SBATCH --job-name=hvdgc", "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=4",
                          "#SBATCH --time=10", "#SBATCH --partition=debug", "#SBATCH --output=%x-%j.out"]
    assert lines[9] == f"cd {shlex.quote(str(ROOT))} || exit 1"
    assert shlex.split(lines[12]) == [
        "hvdgc-launch", "-np", "6", "--mpi", "--compression", "topk-qsgd",
        "--ratio", "0.05", "--bits", "4", "--accumulate", "2", "--no-error-feedback",
        "tests/scripts/launch_target.py", "--note", "a b"]


def test_cli_sbatch_writes_file(monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "job.sbatch"
    res = CliRunner().invoke(cli.main, ["--sbatch", "--sbatch-file", str(out), "tests/scripts/launch_target.py"])
    assert res.exit_code == 0, res.output
    assert out.read_text().startswith("#!/bin/bash\n")
    assert "tests/scripts/launch_target.py" in out.read_text().splitlines()[-4]


@pytest.mark.parametrize("args, message", [
    (["--sbatch", "-np", "5", "--nodes", "2", "--ntasks-per-node", "2"],
     "Error: -np 5 is more than the 4 slots in --nodes 2 x --ntasks-per-node 2"),
    (["--sbatch", "-H", "a:2"], "Error: -H/--hostfile do not combine with --sbatch"),
    (["--sbatch", "--time", "soon"], "Error: --time 'soon' is not a Slurm time"),
])
def test_cli_sbatch_bad_input(monkeypatch, args, message):
    monkeypatch.chdir(ROOT)
    res = CliRunner().invoke(cli.main, [*args, "tests/scripts/launch_target.py"])
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output
    assert res.output.splitlines()[-1].startswith(message)


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda p: p.name)
def test_templates_are_valid_bash_and_their_launch_line_parses(template, monkeypatch):
    """Each template's hvdgc-launch line must be accepted by the CLI inside a 2x4 allocation."""
    assert subprocess.run(["bash", "-n", str(template)]).returncode == 0
    lines = [ln for ln in template.read_text().splitlines() if ln.lstrip().startswith("hvdgc-launch")]
    assert len(lines) == 1, f"{template.name} should run hvdgc-launch exactly once"
    argv = shlex.split(lines[0])[1:]
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(cli, "_find_tool", lambda name: f"/opt/bin/{name}")
    script = Path(argv[argv.index("examples/train.py")])
    monkeypatch.setattr(cli, "_check_script", lambda command: None)  # examples/train.py is another issue
    slurm = {"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "gpu[1-2]", "SLURM_NTASKS_PER_NODE": "4",
             "SLURM_NTASKS": "8"}
    res = CliRunner().invoke(cli.main, ["--dry-run", *argv], env=slurm)
    assert res.exit_code == 0, res.output
    assert str(script) in res.output.splitlines()[-1]
