"""A compressor written outside the package (tests/external_randomk.py: RandomK) runs on every
road through the documented interface alone, on 2 ranks: ``hvd_gradcomp.DistributedOptimizer``,
stock ``hvd.DistributedOptimizer(compression=...)`` and the DDP hook. No file of the package
names it. Per road: every rank gets the mean of what the ranks' payloads carried, what a
payload carried is exactly the compensated gradient minus the new residual (error feedback:
the residual is what was not sent), the bytes are the payloads' (computed independently from
the seed rule and the wire format), and a run resumed from a checkpoint continues
bit-identically."""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest

from tests.harness import ROOT, launch, rank_env, run_ranks

pytestmark = pytest.mark.multirank


def _ddp_job(codec: str, env: Optional[Dict[str, str]]) -> List[Dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="hvdgc-ddp-ext-") as outdir:
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                str(ROOT / "tests" / "ddp_external_workers.py"),
                json.dumps([{"fn": "external_ddp", "codec": codec}]), outdir]
        res = launch(argv, 300, rank_env(env))
        if res.returncode != 0:
            pytest.fail(f"DDP job exited {res.returncode}\n--- output of all ranks ---\n{res.output}")
        return [json.loads((Path(outdir) / f"rank{r}.json").read_text())[0] for r in range(2)]


def run_road(road: str, codec: str, env: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
    """Both ranks' reports (tests/workers/external.py) of ``codec`` on ``road`` (ours, stock or ddp);
    ``env``: the ranks' extra environment (the folder a codec package was installed into)."""
    if road == "ddp":
        return {"road": "ddp", "ranks": _ddp_job(codec, env)}
    return {"road": road, "ranks": run_ranks("external:horovod_road", np=2, env=env, road=road, codec=codec)}


@pytest.fixture(scope="module", params=["ours", "stock", "ddp"])
def road(request) -> Dict[str, Any]:
    return run_road(request.param, "randomk")


def test_every_rank_ends_identical_and_gets_the_mean_of_what_was_sent(road):
    r0, r1 = road["ranks"]
    assert r0["final"] == r1["final"]
    for r in (r0, r1):
        assert r["feedback"] == "classic"
        assert max(r["avg_error"]) < 1e-5, r["avg_error"]


def test_error_feedback_keeps_exactly_what_was_not_sent(road):
    for r in road["ranks"]:
        ks = [r["k"][n] for n in ("0.weight", "2.weight")]
        # each payload carried its k coordinates (fewer only where the value was an exact zero) ...
        assert all(c <= k for c, k in zip(r["sent_counts"], ks * (len(r["sent_counts"]) // 2)))
        assert sum(r["sent_counts"]) > 0.9 * sum(ks) * len(r["sent_counts"]) / 2
        # ... and left nothing of them in the residual
        assert max(r["ef_error"]) == 0.0
        assert max(r["sent_error"]) == 0.0


def test_bytes_are_the_payloads(road):
    for r in road["ranks"]:
        assert r["codec"] == r["expected"]   # the codec's own count, and the independent calculation
        if road["road"] == "ddp":
            assert r["comm"] == r["expected"]
        elif road["road"] == "ours":   # plus the fused allgather's index, charged to a group's first tensor
            extra = {n: r["comm"][n] - r["expected"][n] for n in r["expected"]}
            assert all(0 <= e <= 4 * 400 for e in extra.values()) and sum(extra.values()) > 0, extra


def test_every_road_counts_into_the_one_ledger(road):
    """``opt.comm_stats`` / ``state.comm_stats`` are the compressor's ``stats``; its last step holds the
    step's payloads exactly (the compressed tensors' and the small tensors' float16 casts) and the
    road's framing apart (envelopes, a fused index, the DDP hook's sizes and padding)."""
    for r in road["ranks"]:
        last = r["ledger"]["last_step"]
        assert r["ledger_shared"]
        assert last["payload"] == r["ledger_last_payload"], (last, r["ledger_last_payload"])
        assert 0 < last["framing"] < 1024 and last["sent"] == last["payload"] + last["framing"]
        assert r["ledger"]["steps"] == 4


def test_a_resumed_run_continues_bit_identically(road):
    assert all(r["resumed_identical"] for r in road["ranks"])


def test_the_package_never_names_the_external_compressor():
    for path in (ROOT / "hvd_gradcomp").rglob("*.py"):
        assert "RandomK" not in path.read_text() and "randomk" not in path.read_text().lower(), path
