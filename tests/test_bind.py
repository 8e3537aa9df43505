"""``hvdgc-launch --bind-cores`` (hvd_gradcomp/launchers/bind.py): each local rank gets its own slice of the cores.

The slicing and the variable lookup are checked as functions; then real 2-rank launches under
horovodrun (Gloo) and mpirun report their affinity, which must be disjoint and cover the cores.
"""
import ast
import os
import re
import subprocess
import sys

import pytest
from hypothesis import given, strategies as st

from hvd_gradcomp.launchers.bind import BindError, core_share, local_rank
from hvd_gradcomp.launchers.command import LaunchSpec, build_command
from tests.harness import BIN, HOROVODRUN, ROOT, launch, rank_env


@given(cores=st.lists(st.integers(0, 255), min_size=1, max_size=64, unique=True), size=st.integers(1, 80))
def test_shares_are_disjoint_contiguous_and_cover_the_cores(cores, size):
    shares = [core_share(cores, r, size) for r in range(size)]
    assert all(shares), "every rank gets at least one core"
    if size <= len(cores):
        flat = [c for s in shares for c in s]
        assert flat == sorted(cores), "in order, each core exactly once"
        assert max(map(len, shares)) - min(map(len, shares)) <= 1
    else:   # more ranks than cores: one core each, every core used
        assert all(len(s) == 1 for s in shares)
        assert {s[0] for s in shares} == set(cores)


def test_local_rank_from_each_launcher_and_bad_values():
    assert local_rank({"OMPI_COMM_WORLD_LOCAL_RANK": "3", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}) == (3, 4)
    # horovodrun's names win over a torchrun pair left in the environment
    assert local_rank({"HOROVOD_LOCAL_RANK": "1", "HOROVOD_LOCAL_SIZE": "2", "LOCAL_RANK": "0",
                       "LOCAL_WORLD_SIZE": "8"}) == (1, 2)
    with pytest.raises(BindError, match="HOROVOD_LOCAL_RANK.*srun"):
        local_rank({"LOCAL_RANK": "0"})   # the size is missing too
    with pytest.raises(BindError, match="not integers"):
        local_rank({"LOCAL_RANK": "x", "LOCAL_WORLD_SIZE": "2"})
    with pytest.raises(BindError, match="outside 0..1"):
        local_rank({"LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"})


def test_commands_bind_through_the_module_or_srun():
    spec = dict(command=("train.py",), np=2, python="py", bind_cores=True)
    for launcher in ("horovodrun", "mpirun", "torchrun"):
        argv, _ = build_command(LaunchSpec(launcher=launcher, **spec))
        assert argv[-5:] == ["py", "-m", "hvd_gradcomp.launchers.bind", "py", "train.py"], argv
    argv, _ = build_command(LaunchSpec(launcher="srun", hosts=(("n1", 2),), **spec))
    assert "--cpu-bind=cores" in argv and "hvd_gradcomp.launchers.bind" not in argv
    argv, _ = build_command(LaunchSpec(command=("train.py",), np=2, python="py"))
    assert "hvd_gradcomp.launchers.bind" not in argv, "off unless asked for"


def test_without_a_launcher_it_exits_with_the_reason_and_runs_nothing(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in {n for pair in [
        ("HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE"), ("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
        ("LOCAL_RANK", "LOCAL_WORLD_SIZE")] for n in pair}}
    marker = tmp_path / "ran"
    res = subprocess.run([sys.executable, "-m", "hvd_gradcomp.launchers.bind", sys.executable, "-c", f"open({str(marker)!r}, 'w')"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode != 0 and "--bind-cores" in res.stderr and "HOROVOD_LOCAL_RANK" in res.stderr, res.stderr
    assert not marker.exists()


AFFINITY = "import os, horovod.torch as hvd; hvd.init(); print(f'rank={hvd.rank()} cores={sorted(os.sched_getaffinity(0))}')"


@pytest.mark.multirank
@pytest.mark.parametrize("flags", [["--gloo"], ["--launcher", "mpirun"]], ids=["horovodrun-gloo", "mpirun"])
def test_two_ranks_get_disjoint_slices_covering_the_cores(flags, tmp_path):
    if not os.path.exists(HOROVODRUN):
        pytest.skip("Horovod not built yet (bash scripts/setup.sh)")
    script = tmp_path / "affinity.py"
    script.write_text(AFFINITY + "\n")
    launcher = [str(BIN / "hvdgc-launch")] if (BIN / "hvdgc-launch").exists() else [sys.executable, "-m", "hvd_gradcomp.launchers.cli"]
    res = launch([*launcher, "-np", "2", *flags, "--bind-cores", str(script)], timeout=120, env=rank_env())
    assert res.returncode == 0, res.stdout
    found = {int(r): ast.literal_eval(c) for r, c in re.findall(r"rank=(\d) cores=(\[[\d, ]*\])", res.stdout)}
    assert sorted(found) == [0, 1], res.stdout
    cores = sorted(os.sched_getaffinity(0))
    assert found[0] == core_share(cores, 0, 2) and found[1] == core_share(cores, 1, 2), res.stdout
