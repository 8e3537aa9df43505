"""A real ``hvd.elastic`` job with compression (issue 63, elastic part), on this machine: two "hosts"
(localhost and 127.0.0.1, one slot each) under ``horovodrun --host-discovery-script`` with a discovery
file the job rewrites. ``tests/elastic_worker.py`` trains an MLP of Linear(256, 256) layers (compressed by
the defaults) with ``hvd_gradcomp.DistributedOptimizer`` (TopKQSGD + AdamW) under ``@hvd.elastic.run``
and ``hvd.elastic.TorchState(model=, optimizer=)``: at step 20 the rank on 127.0.0.1 dies mid-step, the
other restores its last commit and goes on alone, at step 40 the host comes back and a new rank joins.
The same faults uncompressed give the reference loss."""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List

import pytest

from tests.harness import HOROVODRUN, ROOT, launch, rank_env

pytestmark = [pytest.mark.multirank, pytest.mark.slow, pytest.mark.timeout(600)]


STEPS, KILL, GROW = 80, 20, 40


def elastic_job(compression: str, mode: str = "kill", timeout: float = 240) -> Dict[str, Any]:
    """Run the job; every rank's output in the failure message."""
    with tempfile.TemporaryDirectory(prefix="hvdgc-elastic-") as tmp:
        out = Path(tmp)
        hosts = out / "hosts"
        hosts.write_text("localhost:1\n127.0.0.1:1\n")
        discover = out / "discover.sh"
        discover.write_text(f"#!/bin/sh\ncat {hosts}\n")
        discover.chmod(0o755)
        argv = [HOROVODRUN, "-np", "2", "--min-np", "1", "--max-np", "2", "--host-discovery-script", str(discover),
                "--blacklist-cooldown-range", "1", "2", "--gloo",
                sys.executable, str(ROOT / "tests" / "elastic_worker.py"), str(out), str(hosts), compression,
                str(STEPS), str(KILL), str(GROW), mode]
        res = launch(argv, timeout, rank_env())
        ranks: List[Dict[str, Any]] = []
        for r in range(2):
            path = out / f"rank{r}.json"
            if res.returncode != 0 or not path.exists():
                pytest.fail(f"elastic job ({compression}) exited {res.returncode}, rank{r}.json "
                            f"{'written' if path.exists() else 'missing'}\n--- output of all ranks ---\n{res.output}")
            ranks.append(json.loads(path.read_text()))
        dead = json.loads((out / "dead.json").read_text()) if (out / "dead.json").exists() else None
        return {"ranks": ranks, "dead": dead, "output": res.output}


def test_elastic_topkqsgd_adamw_loses_and_regains_a_host() -> None:
    job = elastic_job("topkqsgd")
    ranks, why = job["ranks"], job["output"][-4000:]
    assert job["dead"] is not None and job["dead"]["step"] == KILL, why
    for r in ranks:
        assert r["size"] == 2 and r["step"] == STEPS, r
        assert r["replicas_identical"] and r["steps_agree"], r
        assert r["exchange_step"] == STEPS and r["elastic_synced"], r   # out-of-step check on after every sync
        assert all(e["identical"] for e in r["events"]), r["events"]  # parameters and optimizer state after each sync
    survivor = next(r for r in ranks if len(r["events"]) == 3)
    alone, regrown = survivor["events"][1], survivor["events"][2]
    assert (alone["world"], alone["at_step"], alone["exchange_step"]) == (1, KILL, KILL), alone
    # The survivor's residual after the failure is the one it committed (the interrupted step undone) ...
    assert alone["residual_norm"] == pytest.approx(survivor["commits"][str(KILL)], rel=1e-6) and alone["residual_norm"] > 0
    assert (regrown["world"], regrown["at_step"], regrown["exchange_step"]) == (2, GROW, GROW), regrown
    assert regrown["residual_norm"] == pytest.approx(survivor["commits"][str(GROW)], rel=1e-6)
    # ... and the rank that joins starts at zero.
    newcomer = next(r for r in ranks if r is not survivor)
    assert [(e["at_step"], e["residual_norm"], e["exchange_step"]) for e in newcomer["events"]] == [(GROW, 0.0, GROW)]
    assert job["dead"]["residual_norm_lost"] > 0   # gone with the rank that died

    reference = elastic_job("none")
    for r in reference["ranks"]:
        assert r["replicas_identical"] and r["step"] == STEPS and all(e["identical"] for e in r["events"]), r
    # Held-out MSE, measured: 0.0090 or 0.0117 (which process had rank 0 first: a different residual
    # survives), uncompressed 0.0058 (docs/HOROVOD.md).
    loss, ref = ranks[0]["held_out"], reference["ranks"][0]["held_out"]
    assert loss < 3.0 * ref, (loss, ref)


def test_elastic_host_removed_then_back() -> None:
    """The discovery file shrinks (no rank fails): Horovod interrupts both ranks at a commit, stops the
    rank on the removed host and skips ``sync()`` (hosts only removed); the rank left goes on with its
    state (exchange step, residual) as it was. The host comes back: a new rank joins through ``sync()``."""
    job = elastic_job("topkqsgd", mode="remove")
    ranks = job["ranks"]
    for r in ranks:
        assert r["size"] == 2 and r["step"] == STEPS and r["exchange_step"] == STEPS, r
        assert r["replicas_identical"] and r["steps_agree"] and r["elastic_synced"], r
        assert all(e["identical"] for e in r["events"]), r["events"]
    survivor = next(r for r in ranks if len(r["events"]) == 3)
    alone, regrown = survivor["events"][1], survivor["events"][2]
    assert (alone["world"], alone["at_step"], alone["exchange_step"]) == (1, KILL, KILL), alone
    assert alone["last_reset"]["exchange_step"] == 0   # no sync after a removal: the first sync's record
    assert alone["residual_norm"] == pytest.approx(survivor["commits"][str(KILL)], rel=1e-6)
    assert (regrown["world"], regrown["at_step"], regrown["exchange_step"]) == (2, GROW, GROW), regrown
    newcomer = next(r for r in ranks if r is not survivor)
    assert [(e["at_step"], e["residual_norm"], e["exchange_step"]) for e in newcomer["events"]] == [(GROW, 0.0, GROW)]
