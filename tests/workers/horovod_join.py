"""Rank side of tests/test_horovod_join.py: uneven data with ``hvd.join()`` on
``hvd_gradcomp.DistributedOptimizer`` (issue 63).

Each rank trains ``batches[epoch][rank]`` steps per epoch, then calls ``hvd.join()`` and
``opt.sync_after_join(last)``. For every step after some rank joined (a *join step*) the rank
reports what it contributed, computed independently of the exchange (a copy of its compressor
taken before the step encodes the same gradient, from a twin model, and the payload is decoded
here; small tensors go as float32, ``exempt="fp32"``), and the gradient the exchange handed to the
optimizer; the test sums the contributions and checks every join step's average exactly. Also
reported: each rank's residuals before ``hvd.join()`` and after the sync, the exchange steps, and
the parameters after each epoch (replicas must be identical).
"""
from __future__ import annotations

import copy
from typing import Any, Dict, List

import horovod.torch as hvd
import torch
import torch.nn.functional as F

import hvd_gradcomp as gc
from hvd_gradcomp import codecs
from hvd_gradcomp.collectives.reduce import chunk_bounds
from hvd_gradcomp.collectives.rounds import low_rank_rounds
from tests.workers.integration import batch, make_model

SMALL = 1024   # min_compress_numel: the biases (128 and 10 values) go dense, fc1/fc2 weights compressed


def _codec(kind: str, feedback: Any) -> Any:
    kw = {"exempt": "fp32", "feedback": feedback}
    if kind == "topk":
        return gc.TopK(ratio=0.05, seed=5, **kw)
    if kind == "topkqsgd":
        return gc.TopKQSGD(ratio=0.05, bits=8, seed=5, **kw)
    if kind == "qsgd":
        return gc.QSGD(bits=8, seed=5, **kw)
    if kind == "powersgd":
        return gc.PowerSGD(rank=2, seed=0, **kw)
    if kind == "randomk":
        from tests.external_randomk import RandomK
        return RandomK(ratio=0.25, seed=5, **kw)
    if kind == "ef-sign":
        from hvdgc_sign_plugin import EFSign
        return EFSign(seed=5, **kw)
    raise ValueError(kind)


def _optimizer(policy: str, model: torch.nn.Module) -> Any:
    """(base optimizer, feedback=) for a feedback policy."""
    if policy == "momentum":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), "momentum"
    if policy == "frozen":
        return torch.optim.AdamW(model.parameters(), lr=1e-3), gc.FrozenVariance(warmup=2)
    if policy == "update":
        return torch.optim.RMSprop(model.parameters(), lr=1e-3), "update"
    return torch.optim.SGD(model.parameters(), lr=0.1), policy   # classic, none


def _contribution(ref: Any, name: str, grad: torch.Tensor, size: int, active: int) -> List[float]:
    """What this rank adds to the sum of a join step, from ``ref`` (its compressor as the step began):
    the decoded payload (QSGD: its chunks), or the gradient of a small tensor; PowerSGD (one rank
    training only) its own approximation, the average over one rank."""
    if grad.numel() < SMALL:
        return grad.float().reshape(-1).tolist()
    collective = codecs.collective_of(ref)
    if collective == codecs.ALLGATHER:
        payload, _ = ref.compress_carried(name, grad)
        return ref.decode(payload).float().reshape(-1).tolist()
    if collective == codecs.COMPRESSED_ALLREDUCE:
        payloads = ref.compress_chunks(name, grad, chunk_bounds(grad.numel(), size))
        return torch.cat([ref.decode(pl).float().reshape(-1) for pl in payloads]).tolist()
    if active != 1:
        return []   # PowerSGD over two ranks: not additive, not checked here
    out = torch.empty_like(grad)
    run = low_rank_rounds(ref, [(name, grad)], [out])
    request = next(run)
    try:
        while True:
            request = run.send(request.tensor)   # one rank: the average is its own
    except StopIteration:
        pass
    return out.reshape(-1).tolist()


def _residuals(comp: Any) -> Dict[str, List[float]]:
    return {n: r.reshape(-1).tolist() for n, r in comp.state_dict()["residuals"].items()}


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def uneven(kind: str, batches: List[List[int]], policy: str = "classic", tag: str = "j") -> Dict[str, Any]:
    """Train ``batches[e][rank]`` steps in epoch ``e``, join, sync; report per step and per epoch."""
    rank, size = hvd.rank(), hvd.size()
    model = make_model()
    base, feedback = _optimizer(policy, model)
    comp = _codec(kind, feedback)
    named = [(f"{tag}.{n}", p) for n, p in model.named_parameters()]
    opt = gc.DistributedOptimizer(base, named_parameters=named, compression=comp, min_compress_numel=SMALL)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    steps, epochs, step_no = [], [], 0
    for epoch, counts in enumerate(batches):
        for t in range(max(counts)):
            active = sum(1 for c in counts if c > t)
            if t >= counts[rank]:
                continue
            x, y = batch(rank, step_no + t)
            checked = active < size and policy in ("classic", "none")   # the average is handed on as it is
            row: Dict[str, Any] = {"epoch": epoch, "t": t, "active": active}
            opt.zero_grad()
            if checked:
                twin = copy.deepcopy(model)
                F.cross_entropy(twin(x), y).backward()
                ref = copy.deepcopy(comp)
                row["contribution"] = {n: _contribution(ref, n, q.grad, size, active)
                                       for (n, _), q in zip(named, twin.parameters())}
            F.cross_entropy(model(x), y).backward()
            opt.synchronize()
            if checked:
                row["received"] = {n: p.grad.float().reshape(-1).tolist() for n, p in named}
            with opt.skip_synchronize():
                opt.step()
            row["exchange_step"] = comp.exchange_step
            if t == min(counts) - 1:   # the epoch's last step on every rank: compressed, replicas alike
                every = hvd.allgather(_flat(model).reshape(1, -1), name=f"check.all.{epoch}")
                row["identical"] = all(torch.equal(every[0], every[r]) for r in range(size))
            steps.append(row)
        step_no += max(counts)
        before = _residuals(comp)
        last = hvd.join()
        opt.sync_after_join(last)
        after = _residuals(comp)
        every = hvd.allgather(_flat(model).reshape(1, -1), name=f"check.params.{epoch}")
        rounds = hvd.allgather(torch.tensor([[comp.exchange_step]]), name=f"check.rounds.{epoch}")
        epochs.append({"last": last, "residuals_before_join": before, "residuals_after_sync": after,
                       "replicas_identical": all(torch.equal(every[0], every[r]) for r in range(size)),
                       "exchange_steps": rounds.reshape(-1).tolist(),
                       "finite": bool(torch.isfinite(_flat(model)).all())})
    return {"steps": steps, "epochs": epochs, "feedback": comp.feedback.key}
