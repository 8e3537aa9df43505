"""Rank side of tests/test_powersgd_ranks.py: PowerSGD on ``hvd_gradcomp.DistributedOptimizer``
(and refused by stock ``hvd.DistributedOptimizer``); tests/ddp_powersgd_workers.py runs
:func:`train` through the DDP hook.

The model's weight gradients have rank <= the batch (4 rows per rank), so their average over 2
ranks has rank <= 8: with ``rank=8`` PowerSGD's first step is exact. Later steps add each rank's
residual (its own gradient minus the average, plus what the approximation missed); the ranks'
residuals cancel in the average only up to float32 rounding, and that rounding is amplified
step by step where the warm-started ``Q`` is ill-conditioned for the new gradient: so what is
checked on every step is error feedback's conservation (what was handed over, summed over the
steps, plus the ranks' average residual is the sum of the true averages).
"""
from __future__ import annotations

import copy
from typing import Any, Callable, Dict

import torch
import torch.nn as nn

import hvd_gradcomp as gc

MATRICES = ("0.weight", "2.weight")   # 64 x 16 and 64 x 64; the rest goes uncompressed
BATCH = 4


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))


def batch(rank: int, step: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(BATCH, 16, generator=g), torch.randint(0, 4, (BATCH,), generator=g)


def local_grads(model: nn.Module, rank: int, step: int) -> Dict[str, torch.Tensor]:
    ref = copy.deepcopy(model)
    x, y = batch(rank, step)
    names, params = zip(*ref.named_parameters())
    return dict(zip(names, torch.autograd.grad(nn.functional.cross_entropy(ref(x), y), params)))


def train(wrap: Callable[..., Any], mean: Callable[[torch.Tensor], torch.Tensor], rank: int, comm: Callable,
          save: Callable, load: Callable, pgrank: int = 8, steps: int = 5, resume_at: int = 3) -> Dict[str, Any]:
    """``wrap(model, comp, opt) -> (handle, opt, forward module)``; ``comm(handle, name)``: bytes sent."""
    model, comp = net(), gc.PowerSGD(rank=pgrank, min_compression_rate=1)
    handle, opt, fwd = wrap(model, comp, torch.optim.SGD(model.parameters(), lr=0.05))
    out: Dict[str, Any] = {"rel": [], "bytes": {}, "factors": {}, "conservation": {}}
    handed: Dict[str, torch.Tensor] = {n: torch.zeros(()) for n in MATRICES}
    truth: Dict[str, torch.Tensor] = {n: torch.zeros(()) for n in MATRICES}
    saved = None
    for step in range(steps):
        if step == resume_at:
            saved = (copy.deepcopy(model.state_dict()), save(handle, comp))
        local = local_grads(model, rank, step)
        opt.zero_grad()
        nn.functional.cross_entropy(fwd(batch(rank, step)[0]), batch(rank, step)[1]).backward()
        opt.step()
        params = dict(model.named_parameters())
        for n in MATRICES:
            true = mean(local[n].clone())
            out["rel"].append(float((params[n].grad - true).norm() / true.norm()))
            handed[n] = handed[n] + params[n].grad.double()
            truth[n] = truth[n] + true.double()
    params = dict(model.named_parameters())
    for n in MATRICES:
        owed = mean(comp.residuals.residual(n).clone()).view(params[n].shape).double()
        out["conservation"][n] = float((handed[n] + owed - truth[n]).norm() / truth[n].norm())
    for n in MATRICES:
        out["bytes"][n] = comm(handle, n)
        out["factors"][n] = comp.factors(tuple(params[n].shape))
    final = [p.detach().clone() for p in model.parameters()]
    model2, comp2 = net(), gc.PowerSGD(rank=pgrank, min_compression_rate=1, seed=77)
    model2.load_state_dict(saved[0])
    handle2, opt2, fwd2 = wrap(model2, comp2, torch.optim.SGD(model2.parameters(), lr=0.05))
    load(handle2, comp2, saved[1])
    for step in range(resume_at, steps):
        opt2.zero_grad()
        nn.functional.cross_entropy(fwd2(batch(rank, step)[0]), batch(rank, step)[1]).backward()
        opt2.step()
    out["resumed_identical"] = all(torch.equal(a, b) for a, b in zip(final, model2.parameters()))
    out["final"] = torch.cat([p.reshape(-1) for p in final]).tolist()
    return out


def ours(pgrank: int = 8) -> Dict[str, Any]:
    import horovod.torch as hvd

    def wrap(model: nn.Module, comp: Any, opt: Any) -> Any:
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = gc.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=comp)
        return opt, opt, model

    calls = iter(range(1 << 30))
    return train(wrap, lambda t: hvd.allreduce(t, op=hvd.Average, name=f"true.{next(calls)}"), hvd.rank(),
                 comm=lambda opt, n: opt.comm_stats.per_tensor[n][1],
                 save=lambda opt, comp: copy.deepcopy(comp.state_dict()),
                 load=lambda opt, comp, state: comp.load_state_dict(state), pgrank=pgrank)


def stock() -> Dict[str, Any]:
    """Stock hvd.DistributedOptimizer with PowerSGD: the first backward raises, naming the wrappers."""
    import horovod.torch as hvd

    model = net()
    _opt = hvd.DistributedOptimizer(  # its hooks call compress() in the first backward
        torch.optim.SGD(model.parameters(), lr=0.05), named_parameters=model.named_parameters(),
        compression=gc.PowerSGD(rank=2))
    x, y = batch(hvd.rank(), 0)
    try:
        nn.functional.cross_entropy(model(x), y).backward()
    except gc.HorovodIntegrationError as err:
        return {"error": str(err)}
    return {"error": None}
