"""Rank side of the DDP half of tests/test_powersgd_ranks.py, under torchrun (the runner of
tests/ddp_workers.py): PowerSGD through ``hvd_gradcomp.ddp.register``."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Dict

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests import ddp_workers  # noqa: E402
from tests.workers import powersgd  # noqa: E402


def powersgd_ddp(pgrank: int = 8) -> Dict[str, Any]:
    return powersgd.train(ddp_workers.register_wrapped, ddp_workers.mean_over_ranks, dist.get_rank(),
                          comm=lambda state, n: state.comm_stats.per_tensor[n][1],
                          save=ddp_workers.save_state, load=ddp_workers.load_state, pgrank=pgrank)


if __name__ == "__main__":
    ddp_workers.main({"powersgd_ddp": powersgd_ddp})
