"""Rank-side code of tests/test_clipping.py: the compressor's ``clip=`` on every road.

Horovod roads run through tests/rank_main.py (``clipping:step``); the DDP hook runs this file
under torchrun: ``python tests/workers/clipping.py OUTDIR KWARGS_JSON``.

The model has one tensor the compressor compresses (``big.weight``, 4096 values) and small ones
it sends dense (``big.bias``, ``head``): a step of plain SGD through ``TopK(ratio=1.0)`` (exact,
so the update is the average of what each rank sent) shows what was clipped, tensor by tensor.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Dict, List

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import hvd_gradcomp as gc  # noqa: E402


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))


def _loss(model: nn.Module, rank: int, module: nn.Module) -> torch.Tensor:
    """A loss whose gradients are large (norm ~1e3), different on every rank, largest in the biases
    (``model``: what runs the forward, ``module`` the layers themselves, DDP's ``.module``)."""
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(10 + rank))
    return 1000.0 * (model(x) ** 2).mean() + 5000.0 * (module[0].bias * (1 + rank)).sum()


def _local_norm(model: nn.Module, rank: int) -> float:
    """This rank's gradient norm over every tensor, computed apart (no road)."""
    twin = _model()
    twin.load_state_dict(model.state_dict())
    _loss(twin, rank, twin).backward()
    return float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in twin.parameters()])))


def step(road: str, clip: float, rank: int = -1, world: int = 2) -> Dict[str, Any]:
    """One SGD step (lr 1) with ``TopK(ratio=1.0, clip=clip)`` on ``road`` ("gc", "stock" or "ddp"):
    the change of each parameter, this rank's gradient norm, what the road reported."""
    model = _model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    comp = gc.TopK(ratio=1.0, clip=clip)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    out: Dict[str, Any] = {}
    if road == "ddp":
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP
        from hvd_gradcomp import ddp as gc_ddp
        rank, world = dist.get_rank(), dist.get_world_size()
        net = DDP(model, bucket_cap_mb=0.005)     # several buckets: the clip waits for the last
        state = gc_ddp.register(net, compression=comp, optimizer=opt)
        local = _local_norm(model, rank)
        _loss(net, rank, model).backward()
        opt.step()
        reported = getattr(state, "last_local_norm", None)
    else:
        import horovod.torch as hvd
        rank, world = hvd.rank(), hvd.size()
        wrap = gc.DistributedOptimizer if road == "gc" else hvd.DistributedOptimizer
        opt = wrap(opt, named_parameters=model.named_parameters(), compression=comp)
        local = _local_norm(model, rank)
        _loss(model, rank, model).backward()
        opt.step()
        reported = getattr(opt, "last_local_norm", None)
    out["change"] = {n: float((p.detach() - before[n]).norm()) for n, p in model.named_parameters()}
    out["total_change"] = float(torch.linalg.vector_norm(
        torch.stack([(p.detach() - before[n]).norm() for n, p in model.named_parameters()])))
    out["local_norm"] = local
    out["reported"] = None if reported is None else float(reported)
    out["world"] = world
    return out


def _ddp_main(outdir: str, kwargs: Dict[str, Any]) -> None:
    import torch.distributed as dist
    dist.init_process_group("gloo")
    results: List[Dict[str, Any]] = [step("ddp", **kwargs)]
    Path(outdir, f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    os.environ.setdefault("HVDGC_COMPILE", "0")
    _ddp_main(sys.argv[1], json.loads(sys.argv[2]))
