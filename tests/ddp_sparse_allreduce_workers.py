"""Rank side of tests/test_ddp_sparse_allreduce.py: the DDP hook with ``exchange="allreduce"`` (the sparse
allreduce, :mod:`hvd_gradcomp.ddp.sparse_exchange`) or the allgather, on Gloo.

``python -m torch.distributed.run --nproc-per-node N ... tests/ddp_sparse_allreduce_workers.py JOBS OUTDIR``
(see tests/ddp_workers.py's ``main``). Each step records, summed over the ranks, what error feedback owes
(``residual_after`` plus ``world * average`` against ``gradient + residual_before``, per compressed parameter), the
bytes each rank put on the wire (counted at the collectives: an alltoall's bytes to the other ranks, an
allgather's input times the ranks it reaches), the ledger's bytes, and at the end the loss on a fixed batch and
a digest of the weights.
"""
from __future__ import annotations

import hashlib
import sys
from pathlib import Path
from typing import Any, Dict, List

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hvd_gradcomp as gc  # noqa: E402
from hvd_gradcomp import ddp as gc_ddp  # noqa: E402
from hvd_gradcomp.ddp import exchanges as gc_exchanges  # noqa: E402
from tests.ddp_workers import BUCKET_MB, batch, loss_of, main, net  # noqa: E402


class WireBytes:
    """Bytes this rank puts on the wire in the compressed exchanges: an ``all_to_all_single``'s bytes to the
    other ranks, an ``all_gather``'s input times the other ranks (a ring forwards it to each)."""

    def __init__(self) -> None:
        self.total = 0
        a2a, gather = dist.all_to_all_single, gc_exchanges._all_gather_single

        def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, **kw):  # noqa: A002
            world, rank = dist.get_world_size(), dist.get_rank()
            mine = input_split_sizes[rank] if input_split_sizes else input.numel() // world
            self.total += (input.numel() - mine) * input.element_size()
            return a2a(output, input, output_split_sizes, input_split_sizes, **kw)

        def all_gather_single(output, input, **kw):  # noqa: A002
            self.total += (dist.get_world_size() - 1) * input.numel() * input.element_size()
            return gather(output, input, **kw)

        dist.all_to_all_single = all_to_all_single
        gc_exchanges._all_gather_single = all_gather_single


_WIRE: List[WireBytes] = []


def wire_bytes() -> WireBytes:
    """The one counter of this process (installed at the first job: the collectives are wrapped once)."""
    if not _WIRE:
        _WIRE.append(WireBytes())
    return _WIRE[0]


def _residuals(comp: Any) -> Dict[str, torch.Tensor]:
    res = comp.state_dict()["residuals"]
    return {k: torch.as_tensor(v).reshape(-1).clone().float() for k, v in res.items()}


def _eval_loss(module: torch.nn.Module) -> float:
    """The loss on every rank's training batches (a run cycles through two per rank), averaged over the ranks."""
    rank = dist.get_rank()
    with torch.no_grad():
        loss = torch.stack([loss_of(module, *batch(rank, step)) for step in range(2)]).mean().reshape(1)
    dist.all_reduce(loss)
    return float(loss) / dist.get_world_size()


def _digest(model: torch.nn.Module) -> str:
    return hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()


def train(kind: str = "topk", exchange: str = "allreduce", steps: int = 6, bad_step: int = -1,
          ratio: float = 0.05) -> Dict[str, Any]:
    rank = dist.get_rank()
    wire = wire_bytes()
    model = DDP(net(), bucket_cap_mb=BUCKET_MB)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    comp = {"topk": gc.TopK(ratio=ratio, seed=3, feedback="classic", exchange=exchange),
            "topkqsgd": gc.TopKQSGD(ratio=ratio, bits=8, seed=3, feedback="classic", exchange=exchange)}[kind]
    state = gc_ddp.register(model, compression=comp, optimizer=opt)
    params = dict(model.module.named_parameters())
    initial = _eval_loss(model.module)
    owed: List[float] = []        # per step: max |sum_r residual_after + world * avg - sum_r (grad + residual_before)|
    scale: List[float] = []
    skipped, nonfinite_grads, bad_rank_residuals_kept, returned_all = [], [], None, None
    wire_per_step: List[int] = []
    for step in range(steps):
        x, y = batch(rank, step % 2)
        if step == bad_step and rank == 1:
            x[0, 0] = float("inf")
        before = _residuals(comp)
        local = dict(zip(params, torch.autograd.grad(loss_of(model.module, x, y), list(params.values()))))
        opt.zero_grad()
        start = wire.total
        loss_of(model, x, y).backward()
        wire_per_step.append(wire.total - start)
        after = _residuals(comp)
        finite = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())
        nonfinite_grads.append(not finite)
        if step == bad_step:
            if rank == 1:
                bad_rank_residuals_kept = all(torch.equal(before.get(k, after[k] * 0), after[k]) for k in after)
            else:   # everything it sent came back: residual_after == gradient + residual_before
                returned_all = max(float((after[k] - local[k].reshape(-1) - before.get(k, 0 * after[k])).abs().max())
                                   for k in after)
        if finite:
            worst, big = 0.0, 0.0
            for name in sorted(after):
                lhs = after[name] + params[name].grad.reshape(-1)   # summed over the ranks: + world * avg
                rhs = local[name].reshape(-1) + before.get(name, torch.zeros_like(after[name]))
                both = torch.stack([lhs, rhs]).double()
                dist.all_reduce(both)
                worst = max(worst, float((both[0] - both[1]).abs().max()))
                big = max(big, float(both[1].abs().max()))
            owed.append(worst)
            scale.append(big)
            opt.step()
        skipped.append(not finite)
    return {"digest": _digest(model.module), "loss": _eval_loss(model.module), "initial_loss": initial, "owed": owed, "scale": scale, "skipped": skipped,
            "nonfinite_grads": nonfinite_grads, "nonfinite_exchanges": state.nonfinite_exchanges,
            "bad_rank_residuals_kept": bad_rank_residuals_kept, "returned_all": returned_all,
            "wire": wire_per_step, "ledger": state.comm_stats.bytes_out, "steps": state.comm_stats.steps}


def joined(kind: str = "topk", base: int = 4) -> Dict[str, Any]:
    """Uneven inputs under ``model.join()`` (rank r has ``base - r`` batches: steps after a join travel dense
    among the ranks still training, :mod:`hvd_gradcomp.ddp.join`), then two more steps with every rank."""
    rank = dist.get_rank()
    model = DDP(net(), bucket_cap_mb=BUCKET_MB)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    comp = {"topk": gc.TopK(ratio=0.05, seed=3, feedback="classic", exchange="allreduce"),
            "topkqsgd": gc.TopKQSGD(ratio=0.05, bits=8, seed=3, feedback="classic", exchange="allreduce")}[kind]
    state = gc_ddp.register(model, compression=comp, optimizer=opt)
    with model.join():
        for step in range(base - rank):
            opt.zero_grad()
            loss_of(model, *batch(rank, step)).backward()
            opt.step()
    at_join = _digest(model.module)
    for step in range(base, base + 2):
        opt.zero_grad()
        loss_of(model, *batch(rank, step)).backward()
        opt.step()
    return {"at_join": at_join, "digest": _digest(model.module), "iter": state.iter,
            "join_steps": state._join.join_steps}


SCENARIOS = {"train": train, "joined": joined}

if __name__ == "__main__":
    main(SCENARIOS)
