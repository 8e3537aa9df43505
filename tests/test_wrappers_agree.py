"""The two Horovod wrappers train alike when driven as a user drives them (tests/workers/user_loop.py:
the README's broadcasts after wrapping, a schedule set through ``param_groups``, a plain loop).

The same compressor and seed through ``hvd_gradcomp.DistributedOptimizer`` and stock
``hvd.DistributedOptimizer`` must end within the uncompressed seed spread of each other, and
within 5% of uncompressed training; replicas identical on every rank.
"""
from __future__ import annotations

from typing import Any, Dict, List

import pytest

from tests.harness import run_ranks

pytestmark = pytest.mark.multirank

SEEDS = (0, 1, 2)
RUNS: Dict[str, Dict[str, Any]] = {
    **{f"none-s{s}": dict(wrapper="hvd", compression="none", seed=s) for s in SEEDS},
    "gc-topkqsgd": dict(wrapper="gc", compression="topkqsgd", seed=0),
    "hvd-topkqsgd": dict(wrapper="hvd", compression="topkqsgd", seed=0),
}
_cache: Dict[str, Dict[str, List[Any]]] = {}


def results(backend: str) -> Dict[str, List[Any]]:
    if backend not in _cache:
        ids = list(RUNS)
        per_rank = run_ranks("user_loop:battery", backend=backend, timeout=420, runs=[RUNS[i] for i in ids])
        _cache[backend] = {i: [r[j] for r in per_rank] for j, i in enumerate(ids)}
    return _cache[backend]


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_the_two_wrappers_end_within_the_uncompressed_seed_spread(backend):
    res = results(backend)
    base = [res[f"none-s{s}"][0]["val_loss"] for s in SEEDS]
    spread = max(base) - min(base)
    gc_loss, hvd_loss = res["gc-topkqsgd"][0]["val_loss"], res["hvd-topkqsgd"][0]["val_loss"]
    assert max(base) < 1.2, f"uncompressed training did not learn: {base}"
    assert res["gc-topkqsgd"][0]["feedback"] == res["hvd-topkqsgd"][0]["feedback"] == "frozen"
    assert abs(gc_loss - hvd_loss) <= spread, \
        f"hvd_gradcomp.DistributedOptimizer {gc_loss:.4f} vs stock {hvd_loss:.4f}: gap beyond the seed spread {spread:.4f}"
    # TopKQSGD(1%, 8) after a 100-step dense warm-up: a few percent above uncompressed on this short run
    # (measured +1.6%); a broken road (+45% in the report that started this test) misses by far
    for name, loss in (("gc", gc_loss), ("stock", hvd_loss)):
        assert loss <= 1.05 * base[0], f"{name} road {loss:.4f} vs uncompressed {base} (spread {spread:.4f})"


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_replicas_stay_identical(backend):
    for name, ranks in results(backend).items():
        assert all(r["identical"] for r in ranks), f"{name}: ranks hold different parameters"
