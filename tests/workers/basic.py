"""Rank-side code of tests/test_harness.py: the stack itself (Horovod collectives, both backends)."""
from typing import Any, Dict

import horovod.torch as hvd
import torch


def collectives() -> Dict[str, Any]:
    r, n = hvd.rank(), hvd.size()
    summed = hvd.allreduce(torch.tensor([float(r + 1)]), op=hvd.Sum).item()
    gathered = hvd.allgather(torch.full((r + 1,), r, dtype=torch.uint8)).tolist()
    sent = torch.arange(n, dtype=torch.float32) + 10 * r          # element j goes to rank j
    received, _ = hvd.alltoall(sent, splits=torch.ones(n, dtype=torch.int32))
    return {"rank": r, "size": n, "sum": summed, "gathered": gathered, "alltoall": received.tolist(),
            "mpi": hvd.mpi_enabled(), "gloo": hvd.gloo_enabled()}


def fail_on_rank_1() -> Dict[str, Any]:
    if hvd.rank() == 1:
        raise ValueError("rank 1 says no")
    hvd.allreduce(torch.ones(1))  # rank 0 would wait here forever without the harness
    return {}
