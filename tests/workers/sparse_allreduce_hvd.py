"""Rank-side code of tests/test_sparse_allreduce_horovod.py: the sparse allreduce
(``exchange="allreduce"``, issue 62) under ``hvd_gradcomp.DistributedOptimizer``, against the
allgather exchange, and stock ``hvd.DistributedOptimizer``'s refusal."""
from __future__ import annotations

from typing import Any, Dict, List

import horovod.torch as hvd
import torch
import torch.nn.functional as F

import hvd_gradcomp as gc
from tests.workers import horovod_features as hf
from tests.workers.integration import batch, make_model

KINDS = {"topk": lambda exchange: gc.TopK(ratio=0.05, seed=5, exchange=exchange),
         "topkqsgd": lambda exchange: gc.TopKQSGD(ratio=0.05, bits=8, seed=5, exchange=exchange)}
DATA = 2   # batches per rank, cycled: random labels are learnable only when seen again
_calls = iter(range(1 << 30))


def _sum(t: torch.Tensor) -> torch.Tensor:
    return hvd.allreduce(t.detach().contiguous(), op=hvd.Sum, name=f"sa.check.{next(_calls)}")


def _residuals(comp: Any, model: torch.nn.Module, tag: str) -> Dict[str, torch.Tensor]:
    """Every parameter's residual as stored (zeros where none yet), flat."""
    stored = comp.state_dict()["residuals"]
    return {f"{tag}.{n}": stored.get(f"{tag}.{n}", torch.zeros(p.numel())).detach().reshape(-1).clone().float()
            for n, p in model.named_parameters()}


def train(kind: str, exchange: str, steps: int = 30, tag: str = "sa", conserve: bool = True) -> Dict[str, Any]:
    """``steps`` of SGD; per step, the sum over ranks of (gradient + residual before) against the sum
    of (residual after) plus the ranks times the applied average (nothing lost)."""
    model = make_model()
    comp = KINDS[kind](exchange)
    opt = gc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=hf.named(model, tag),
                                  compression=comp, min_compress_numel=1)
    world, worst, losses, step_bytes = hvd.size(), 0.0, [], []
    every = [batch(r, s) for r in range(world) for s in range(DATA)]   # the training set, on every rank
    data = torch.cat([x for x, _ in every]), torch.cat([y for _, y in every])
    with torch.no_grad():
        losses.append(float(F.cross_entropy(model(data[0]), data[1])))   # before the first step
    for step in range(steps):
        x, y = batch(hvd.rank(), step % DATA)
        opt.zero_grad()
        before = _residuals(comp, model, tag) if conserve else {}
        F.cross_entropy(model(x), y).backward()
        grads = {f"{tag}.{n}": p.grad.detach().reshape(-1).clone() for n, p in model.named_parameters()}
        opt.synchronize()
        if conserve:
            after = _residuals(comp, model, tag)
            for n, p in model.named_parameters():
                name = f"{tag}.{n}"
                lhs = _sum(grads[name] + before[name])
                rhs = _sum(after[name]) + world * p.grad.detach().reshape(-1)
                worst = max(worst, float((lhs - rhs).abs().max()))
        with opt.skip_synchronize():
            opt.step()
        step_bytes.append(opt.last_step_bytes)
        with torch.no_grad():
            losses.append(float(F.cross_entropy(model(data[0]), data[1])))
    inner = opt._exchanges.compressed.inner
    fresh = KINDS[kind](exchange)   # how many pairs each tensor sends: k of its size
    ks = [int(fresh.compress_carried(f"k{i}", torch.randn(p.numel()))[1][0].numel())
          for i, p in enumerate(model.parameters())]
    return {"losses": losses, "worst_conservation": worst, "step_bytes": step_bytes,
            "ring_bytes": sum(getattr(inner, "ring_bytes", {}).values()),
            "exchange": type(inner).__name__, "ks": ks,
            "params_equal_across_ranks": hf.all_ranks_equal(hf.flat_params(model)),
            "params": hf.flat_params(model).tolist()[:64]}


def gradscaler(kind: str) -> Dict[str, Any]:
    """horovod_features' GradScaler scenario (rank 1's loss times inf at step 2) with the sparse allreduce."""
    hf.KINDS[f"{kind}-ar"] = lambda: KINDS[kind]("allreduce")
    return hf.gradscaler("ours", f"{kind}-ar", tag=f"sa.gs.{kind}")


def join_uneven(kind: str) -> Dict[str, Any]:
    """horovod_features' hvd.join() scenario (rank 0 trains one batch more than the others, whose
    step it carries alone, its pairs dense) with the sparse allreduce."""
    hf.KINDS[f"{kind}-ar"] = lambda: KINDS[kind]("allreduce")
    return hf.join_uneven("ours", f"{kind}-ar", tag=f"sa.join.{kind}")


def stock(kind: str) -> Dict[str, Any]:
    """Stock hvd.DistributedOptimizer: the first backward raises, naming the wrappers."""
    model = make_model()
    hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=hf.named(model, "sa.st"),
                             compression=KINDS[kind]("allreduce"))
    x, y = batch(hvd.rank(), 0)
    try:
        F.cross_entropy(model(x), y).backward()
    except gc.HorovodIntegrationError as err:
        return {"error": str(err)}
    return {"error": None}


def battery(cases: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Every case in one job (starting ranks costs seconds), in the order given."""
    fns = {"train": train, "gradscaler": gradscaler, "stock": stock, "join": join_uneven}
    return {case["key"]: fns[case["fn"]](**{k: v for k, v in case.items() if k not in ("key", "fn")})
            for case in cases}
