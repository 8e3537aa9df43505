"""Rank side of tests/test_ddp_loops.py: the training loops frameworks run, on the DDP hook.

``python -m torch.distributed.run ... tests/ddp_loop_workers.py JOB OUTDIR`` (see tests/ddp_workers.py's
``main``): ``optimizer.step(closure)`` as Lightning's automatic optimization and LBFGS call it,
checkpoints written by rank 0 only, and runs repeated under one ``torch.manual_seed``.
"""
from __future__ import annotations

import copy
import sys
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hvd_gradcomp as gc  # noqa: E402
from hvd_gradcomp import ddp as gc_ddp  # noqa: E402
from tests.ddp_workers import BUCKET_MB, batch, loss_of, main, net  # noqa: E402

# feedback policy -> (optimizer, the compressor's feedback=): every policy the hook runs (a Feedback object
# holds one run's state: each run gets its own, see _fresh)
POLICIES = {
    "classic": ("sgd", "classic"),
    "none": ("sgd", "none"),
    "momentum": ("momentum", "auto"),
    "frozen": ("adamw", gc.FrozenVariance(warmup=2)),
    "auto-adamw": ("adamw", "auto"),
    "update": ("rmsprop", "auto"),
}


def _optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1)
    if kind == "momentum":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    if kind == "rmsprop":
        return torch.optim.RMSprop(params, lr=1e-2)
    if kind == "lbfgs":
        return torch.optim.LBFGS(params, lr=0.5, max_iter=3, history_size=4)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def _fresh(optimizer: str, feedback: Any, seed: Optional[int] = 11, ratio: float = 0.05,
           group: Any = None) -> Any:
    model = DDP(net(), bucket_cap_mb=BUCKET_MB, process_group=group)
    opt = _optimizer(optimizer, model.parameters())
    comp = gc.TopKQSGD(ratio=ratio, bits=8, seed=seed, feedback=copy.deepcopy(feedback))
    state = gc_ddp.register(model, compression=comp, optimizer=opt)
    return model, opt, state


def _params(model: DDP) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _same_on_every_rank(t: torch.Tensor, group: Any = None) -> bool:
    mine = t.clone()
    other = t.clone()
    dist.broadcast(other, src=dist.get_global_rank(group or dist.group.WORLD, 0), group=group)
    return bool(torch.equal(mine, other))


def _step_plain(model: DDP, opt: torch.optim.Optimizer, step: int) -> None:
    opt.zero_grad()
    loss_of(model, *batch(dist.get_rank(), step)).backward()
    opt.step()


def _step_closure(model: DDP, opt: torch.optim.Optimizer, step: int, by_keyword: bool) -> float:
    def closure() -> torch.Tensor:
        opt.zero_grad()   # inside the closure, as Lightning and LBFGS users write it
        loss = loss_of(model, *batch(dist.get_rank(), step))
        loss.backward()
        return loss
    loss = opt.step(closure=closure) if by_keyword else opt.step(closure)
    return float(loss.detach())


def closure(policy: str, steps: int = 6) -> Dict[str, Any]:
    """``steps`` steps of backward-then-step against the same steps through ``step(closure)`` (positional
    and by keyword): the weights must be the same bits, with nothing pending after the last step."""
    optimizer, feedback = POLICIES[policy]
    model, opt, state = _fresh(optimizer, feedback)
    for step in range(steps):
        _step_plain(model, opt, step)
    plain = _params(model)
    out: Dict[str, Any] = {"feedback": state.compression.feedback.key}
    for by_keyword in (False, True):
        model, opt, state = _fresh(optimizer, feedback)
        for step in range(steps):
            _step_closure(model, opt, step, by_keyword)
        got = _params(model)
        key = "keyword" if by_keyword else "positional"
        out[key] = {"identical": bool(torch.equal(plain, got)), "max_diff": float((plain - got).abs().max()),
                    "pending": state.pending_updates, "replicas": _same_on_every_rank(got)}
    return out


def lbfgs(steps: int = 4) -> Dict[str, Any]:
    """LBFGS calls the closure several times per step: every call's exchange must finish before LBFGS reads
    the gradient, so every rank takes the same line-search decisions and the replicas stay identical."""
    model, opt, state = _fresh("lbfgs", "classic", ratio=0.5)
    x, y = batch(dist.get_rank(), 0, n=64)
    calls = [0]

    def closure() -> torch.Tensor:
        calls[0] += 1
        opt.zero_grad()
        loss = loss_of(model, x, y)
        loss.backward()
        return loss

    first = float(closure())
    for _ in range(steps):
        opt.step(closure)
    last = float(loss_of(model, x, y))
    return {"first": first, "last": last, "calls": calls[0], "exchanges": state.iter,
            "replicas": _same_on_every_rank(_params(model)), "pending": state.pending_updates}


def rank0_checkpoint(policy: str, ckpt: str, steps: int = 6, half: int = 3) -> Dict[str, Any]:
    """``steps`` straight, against ``half`` steps, a checkpoint written by rank 0 alone (the hook's state taken
    with ``all_ranks=True`` on every rank), a fresh model, optimizer and hook on every rank loading that one
    file, then the rest: the same bits, and the ledger saying which steps it counted."""
    optimizer, feedback = POLICIES[policy]
    model, opt, state = _fresh(optimizer, feedback)
    for step in range(steps):
        _step_plain(model, opt, step)
    straight = _params(model)

    model, opt, state = _fresh(optimizer, feedback)
    for step in range(half):
        _step_plain(model, opt, step)
    hook = state.state_dict(all_ranks=True)   # every rank: a collective
    path = Path(ckpt) / "rank0-only.pt"
    if dist.get_rank() == 0:
        torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "hook": hook}, path)
    held = hook["ranks"] is not None
    dist.barrier()
    model, opt, state = _fresh(optimizer, feedback)
    saved = torch.load(path, weights_only=True)   # plain types only: torch's default loader reads it
    model.module.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    state.load_state_dict(saved["hook"])
    for step in range(half, steps):
        _step_plain(model, opt, step)
    resumed = _params(model)
    return {"identical": bool(torch.equal(straight, resumed)), "held": held, "iter": state.iter,
            "summary": state.comm_stats.summary(), "counted": state.comm_stats.counted_steps}


def rank_count_change(ckpt: str) -> Dict[str, Any]:
    """A hook state taken on 2 ranks, loaded by a job of 1 rank (each rank alone in a group of its own):
    error feedback restarts from zero, with a warning, and the exchange counter goes on."""
    model, opt, state = _fresh("sgd", "classic")
    for step in range(3):
        _step_plain(model, opt, step)
    hook = state.state_dict(all_ranks=True)
    path = Path(ckpt) / "two-ranks.pt"
    if dist.get_rank() == 0:
        torch.save(hook, path)
    dist.barrier()
    alone = [dist.new_group([r]) for r in range(dist.get_world_size())][dist.get_rank()]
    model, opt, state = _fresh("sgd", "classic", group=alone)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        state.load_state_dict(torch.load(path, weights_only=True))
    residuals = state.compression.state_dict()["residuals"]
    _step_plain(model, opt, 3)
    return {"warnings": [str(w.message) for w in seen], "iter": state.iter, "residuals": len(residuals)}


def stub_from_other_rank() -> Dict[str, Any]:
    """What rank 1's ``state_dict(all_ranks=True)`` holds (nothing to resume from), and the error it gives."""
    model, opt, state = _fresh("sgd", "classic")
    _step_plain(model, opt, 0)
    objs: List[Any] = [state.state_dict(all_ranks=True)]
    dist.broadcast_object_list(objs, src=1)
    try:
        state.load_state_dict(objs[0])
        error = ""
    except ValueError as exc:
        error = str(exc)
    return {"error": error}


def seeded(seed: int, steps: int = 4) -> Dict[str, Any]:
    """A run with no ``seed=`` given, after ``torch.manual_seed(seed)``: its compressor seed and weights.
    (The model is built first: tests.ddp_workers.net seeds torch itself.)"""
    model = DDP(net(), bucket_cap_mb=BUCKET_MB)
    torch.manual_seed(seed)
    opt = _optimizer("momentum", model.parameters())
    state = gc_ddp.register(model, compression=gc.TopKQSGD(ratio=0.05, bits=8), optimizer=opt)
    for step in range(steps):
        _step_plain(model, opt, step)
    return {"seed": state.compression.seed, "params": _params(model).tolist()}


def compiled(steps: int = 3) -> Dict[str, Any]:
    """The hook under ``static_graph=True`` (eager) and under ``torch.compile`` of the DDP model, against the
    same steps eager: replicas identical, weights as eager's (compiled kernels may round differently)."""
    out: Dict[str, Any] = {}
    runs = {}
    for mode in ("eager", "static", "compile"):
        # DDP's default buckets: the compiled graph's splitter (dynamo's DDPOptimizer) refuses the tests' tiny ones
        model = DDP(net(), static_graph=mode == "static")
        opt = _optimizer("momentum", model.parameters())
        state = gc_ddp.register(model, compression=gc.TopKQSGD(ratio=0.05, bits=8, seed=11), optimizer=opt)
        run = torch.compile(model) if mode == "compile" else model
        for step in range(steps):
            _step_plain(run, opt, step)
        runs[mode] = _params(model)
        out[mode] = {"exchanges": state.iter, "replicas": _same_on_every_rank(runs[mode])}
    for mode in ("static", "compile"):
        out[mode]["max_diff"] = float((runs[mode] - runs["eager"]).abs().max())
    return out


SCENARIOS = {"compiled": compiled, "closure": closure, "lbfgs": lbfgs, "rank0_checkpoint": rank0_checkpoint,
             "rank_count_change": rank_count_change, "stub_from_other_rank": stub_from_other_rank, "seeded": seeded}

if __name__ == "__main__":
    main(SCENARIOS)
