"""Rank side of tests/test_ddp_join.py: uneven inputs under ``model.join()``, with and without the hook.

``python -m torch.distributed.run --nproc-per-node N ... tests/ddp_join_workers.py JOB OUTDIR`` (see
tests/ddp_workers.py's ``main``). Rank r has ``base - r`` batches. Every step a rank trains it records its
local gradient (a copy of the module, the same batch), what it contributed to a step after a join (the
dense part its payload carried: :func:`hvd_gradcomp.ddp.join.own_dense`, recorded by name) and the
gradient DDP left in ``p.grad``; at the end the weights and whether its residuals stayed as it joined.
"""
from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any, Dict, List

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hvd_gradcomp as gc  # noqa: E402
from hvd_gradcomp import ddp as gc_ddp  # noqa: E402
from hvd_gradcomp.ddp import join as gc_join  # noqa: E402
from tests.ddp_workers import BUCKET_MB, batch, loss_of, main, net  # noqa: E402


def _compression(kind: str, feedback: str) -> Any:
    if kind == "none":
        return None
    if feedback == "frozen":
        return gc.TopKQSGD(ratio=0.05, bits=8, seed=3, feedback=gc.FrozenVariance(warmup=2))
    if kind == "qsgd":
        return gc.QSGD(bits=8, seed=3, feedback=feedback)
    if kind == "powersgd":
        return gc.PowerSGD(rank=2, seed=3)
    return {"topkqsgd": gc.TopKQSGD(ratio=0.05, bits=8, seed=3, feedback=feedback),
            "topk": gc.TopK(ratio=0.05, seed=3, feedback=feedback)}[kind]


def _residuals(state: Any) -> List[Any]:
    if state is None or not isinstance(state.compression, gc.GradientCompressor):
        return []
    res = state.compression.state_dict()["residuals"]
    return sorted((k, torch.as_tensor(v).reshape(-1).tolist()) for k, v in res.items())


def join_run(compression: str = "topkqsgd", feedback: str = "classic", divide: bool = True, base: int = 4,
             after: int = 2, momentum: float = 0.0, optimizer: str = "sgd", epochs: int = 1) -> Dict[str, Any]:
    rank = dist.get_rank()
    model = DDP(net(), bucket_cap_mb=BUCKET_MB)
    opt = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=momentum),
           "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01),
           "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-2)}[optimizer](model.parameters())
    state = None
    if compression != "ddp":   # "ddp": no hook, DDP's own allreduce
        state = gc_ddp.register(model, compression=_compression(compression, feedback), optimizer=opt)
    names = [n for n, _ in model.module.named_parameters()]
    parts: Dict[str, List[float]] = {}
    sending: List[str] = []
    own_dense = gc_join.own_dense
    if state is not None and isinstance(state.compression, gc.GradientCompressor):
        comp, send_prepared = state.compression, state.compression.send_prepared

        def recording_send(prepared: Any) -> Any:
            sending.append(prepared.name)
            return send_prepared(prepared)

        def recording_own(*args: Any, **kwargs: Any) -> torch.Tensor:
            out = own_dense(*args, **kwargs)
            parts[sending[-1]] = out.tolist()
            return out

        comp.send_prepared, gc_join.own_dense = recording_send, recording_own
    for epoch in range(epochs):   # the last epoch's steps are kept
        steps = []
        with model.join(divide_by_initial_world_size=divide):
            for t in range(base - rank):
                x, y = batch(rank, 10 * epoch + t)
                local = copy.deepcopy(model.module)
                loss_of(local, x, y).backward()
                parts.clear()
                opt.zero_grad()
                loss_of(model, x, y).backward()
                steps.append({"local": {n: p.grad.reshape(-1).tolist() for n, p in local.named_parameters()},
                              "part": dict(parts),
                              "avg": {n: p.grad.reshape(-1).tolist() for n, p in zip(names, model.parameters())}})
                opt.step()
            at_join = _residuals(state)
    kept = _residuals(state) == at_join
    gc_join.own_dense = own_dense   # the next job records its own
    weights_at_end = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()
    for t in range(after):   # even steps after the join: the hook goes on, replicas stay identical
        x, y = batch(rank, 100 + t)
        opt.zero_grad()
        loss_of(model, x, y).backward()
        opt.step()
    return {"steps": steps, "kept": kept, "weights_at_end": weights_at_end,
            "weights_after": torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist(),
            "join_steps": state._join.join_steps if state is not None else None,
            "iter": state.iter if state is not None else None}


def refused(mode: str) -> Dict[str, Any]:
    """``gc.Auto()`` in a step after a join, or ``throw_on_early_termination=True``: the error every rank gets."""
    rank = dist.get_rank()
    model = DDP(net(), bucket_cap_mb=BUCKET_MB)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gc_ddp.register(model, compression=gc.Auto() if mode == "auto" else gc.TopKQSGD(ratio=0.05, seed=3), optimizer=opt)
    try:
        with model.join(throw_on_early_termination=mode == "throw"):
            for t in range(4 - rank):
                x, y = batch(rank, t)
                opt.zero_grad()
                loss_of(model, x, y).backward()
                opt.step()
    except RuntimeError as err:
        return {"error": str(err)}
    return {"error": None}


SCENARIOS = {"join_run": join_run, "refused": refused}

if __name__ == "__main__":
    main(SCENARIOS)
