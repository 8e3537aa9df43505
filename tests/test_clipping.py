"""The compressor's ``clip=`` bounds what ``clip_grad_norm_`` bounds: the global norm of each rank's
whole gradient, every tensor (compressed and small ones), on ``hvd_gradcomp.DistributedOptimizer``
and the DDP hook; stock ``hvd.DistributedOptimizer``, which compresses each tensor as its gradient
arrives, refuses it with the fix (tests/workers/clipping.py is the rank side).

Before (40933ca) ``clip=`` bounded each tensor alone and skipped the tensors too small to compress:
a 2-layer LSTM with SGD lr 20 and ``clip=0.25`` diverged through its biases (benchmarks/results/RECIPES.md).
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List

import pytest

from tests.harness import ROOT, launch, rank_env, run_ranks

pytestmark = pytest.mark.multirank

CLIP = 0.5


def _ddp(**kwargs: Any) -> List[Dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="hvdgc-clip-") as outdir:
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                str(ROOT / "tests" / "workers" / "clipping.py"), outdir, json.dumps(kwargs)]
        res = launch(argv, 180, rank_env())
        if res.returncode != 0:
            pytest.fail(f"DDP job exited {res.returncode}\n--- output of all ranks ---\n{res.stdout}")
        return [json.loads((Path(outdir) / f"rank{r}.json").read_text())[0] for r in range(2)]


@pytest.mark.parametrize("road", ["gc", "ddp"])
def test_clip_bounds_the_global_norm_of_every_tensor(road):
    ranks = _ddp(clip=CLIP) if road == "ddp" else run_ranks("clipping:step", road=road, clip=CLIP)
    for r in ranks:
        # SGD lr 1 through TopK(ratio=1.0): the update is the average of the ranks' clipped gradients,
        # each of global norm CLIP (their norms are ~1e3): at most CLIP, and not far below it
        assert r["local_norm"] > 100 * CLIP, r
        assert CLIP * 0.5 < r["total_change"] <= CLIP * (1 + 1e-4), r
        # the small tensors were clipped with the rest (before, the biases moved by ~1e3)
        assert all(v <= CLIP * (1 + 1e-4) for v in r["change"].values()), r["change"]
        assert r["reported"] == pytest.approx(r["local_norm"], rel=1e-4), r
    assert ranks[0]["change"] == ranks[1]["change"]


def test_stock_horovod_refuses_clip_with_the_fix():
    """At the first gradient, in backward: the job stops (every rank), saying why and what to use."""
    out = run_ranks("clipping:step", road="stock", clip=CLIP, expect_fail=True)[0]["output"]
    assert "ValueError" in out and "global norm" in out and "hvd_gradcomp.DistributedOptimizer" in out, out
