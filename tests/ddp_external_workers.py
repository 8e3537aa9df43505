"""Rank side of the DDP half of tests/test_external_codec.py, under torchrun (the runner of
tests/ddp_workers.py, with these scenarios): the compressor of tests/external_randomk.py through
``hvd_gradcomp.ddp.register``."""
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
from tests.workers import external  # noqa: E402


def randomk_ddp() -> Dict[str, Any]:
    def wrap(model: torch.nn.Module, comp: Any, opt: torch.optim.Optimizer) -> Any:
        ddp_model = DDP(model, bucket_cap_mb=ddp_workers.BUCKET_MB)
        return gc_ddp.register(ddp_model, compression=comp, optimizer=opt), opt, ddp_model

    def mean(t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t)
        return t / dist.get_world_size()

    return external.run(wrap, mean, dist.get_rank(),
                        comm_bytes=lambda state, name: state.comm_stats.per_tensor[name][1],
                        save=lambda state, comp: copy.deepcopy(state.state_dict()),
                        load=lambda state, comp, saved: state.load_state_dict(saved))


SCENARIOS = {"randomk_ddp": randomk_ddp}

if __name__ == "__main__":
    ddp_workers.main(SCENARIOS)
