"""Rank side of the DDP half of tests/test_powersgd_ranks.py, under torchrun (the runner of
tests/ddp_workers.py): PowerSGD through ``hvd_gradcomp.ddp.register``."""
from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any, Dict

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hvd_gradcomp import ddp as gc_ddp  # noqa: E402
from tests import ddp_workers  # noqa: E402
from tests.workers import powersgd  # noqa: E402


def powersgd_ddp(pgrank: int = 8) -> Dict[str, Any]:
    def wrap(model: torch.nn.Module, comp: Any, opt: torch.optim.Optimizer) -> Any:
        ddp_model = DDP(model, bucket_cap_mb=ddp_workers.BUCKET_MB)
        return gc_ddp.register(ddp_model, compression=comp, optimizer=opt), opt, ddp_model

    def mean(t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t)
        return t / dist.get_world_size()

    return powersgd.train(wrap, mean, dist.get_rank(), comm=lambda state, n: state.comm_stats.per_tensor[n][1],
                          save=lambda state, comp: copy.deepcopy(state.state_dict()),
                          load=lambda state, comp, saved: state.load_state_dict(saved), pgrank=pgrank)


if __name__ == "__main__":
    ddp_workers.main({"powersgd_ddp": powersgd_ddp})
