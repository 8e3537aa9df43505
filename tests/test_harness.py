"""The stack and the multi-rank harness: Horovod's collectives on 2 ranks, Gloo and MPI."""
import pytest

from tests.harness import run_ranks

pytestmark = pytest.mark.multirank


def test_collectives_on_two_ranks(backend):
    results = run_ranks("basic:collectives", backend=backend, timeout=120)
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:
        assert r["size"] == 2
        assert r["sum"] == 1 + 2                       # sum of rank + 1
        assert r["gathered"] == [0, 1, 1]              # rank r contributes r+1 copies of r (uint8)
        assert r["alltoall"] == [r["rank"], 10 + r["rank"]]  # element rank from each sender
        assert r[backend] is True


def test_a_failing_rank_fails_the_test_with_its_output(backend):
    [res] = run_ranks("basic:fail_on_rank_1", backend=backend, timeout=120, expect_fail=True)
    assert res["returncode"] != 0
    assert "rank 1 says no" in res["output"]
