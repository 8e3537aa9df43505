"""Rank side of tests/test_closure_horovod.py: ``optimizer.step(closure)`` on the Horovod roads.

``hvd_gradcomp.DistributedOptimizer`` finishes the exchange each time the closure returns, so stepping with
a closure gives the weights of ``backward()`` then ``step()``; stock ``hvd.DistributedOptimizer``, which
synchronizes before it runs the closure, is refused with a message naming the road that works.
"""
from __future__ import annotations

from typing import Any, Dict, Tuple

import horovod.torch as hvd
import torch
import torch.nn.functional as F

import hvd_gradcomp as gc
from tests.workers.integration import all_ranks_equal

# policy -> (optimizer, feedback=); each run builds its own Feedback object (it holds the run's state)
POLICIES: Dict[str, Tuple[str, Any]] = {
    "classic": ("sgd", lambda: "classic"),
    "none": ("sgd", lambda: "none"),
    "momentum": ("momentum", lambda: "auto"),
    "frozen": ("adamw", lambda: gc.FrozenVariance(warmup=2)),
    "update": ("rmsprop", lambda: "auto"),
}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 96), torch.nn.Tanh(), torch.nn.Linear(96, 4))


def _optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    return {"sgd": lambda: torch.optim.SGD(params, lr=0.1),
            "momentum": lambda: torch.optim.SGD(params, lr=0.1, momentum=0.9),
            "rmsprop": lambda: torch.optim.RMSprop(params, lr=1e-2),
            "lbfgs": lambda: torch.optim.LBFGS(params, lr=0.5, max_iter=3, history_size=4),
            "adamw": lambda: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)}[kind]()


def _batch(step: int) -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + hvd.rank())
    return torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g)


def _wrapped(optimizer: str, feedback: Any, stock: bool = False, ratio: float = 0.05) -> Any:
    model = _model()
    comp = gc.TopKQSGD(ratio=ratio, bits=8, seed=3, feedback=feedback)
    wrap = hvd.DistributedOptimizer if stock else gc.DistributedOptimizer
    opt = wrap(_optimizer(optimizer, model.parameters()), named_parameters=model.named_parameters(),
               compression=comp)
    return model, opt, comp


def _params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _run(policy: str, closure: bool, steps: int = 6) -> Tuple[torch.Tensor, Any]:
    optimizer, feedback = POLICIES[policy]
    model, opt, comp = _wrapped(optimizer, feedback())
    for step in range(steps):
        x, y = _batch(step)

        def loss_closure() -> torch.Tensor:
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            return loss

        if closure:
            opt.step(loss_closure)
        else:
            loss_closure()
            opt.step()
    return _params(model), comp


def closure_matches(policy: str) -> Dict[str, Any]:
    plain, comp = _run(policy, closure=False)
    got, _ = _run(policy, closure=True)
    return {"identical": bool(torch.equal(plain, got)), "max_diff": float((plain - got).abs().max()),
            "feedback": comp.feedback.key, "replicas": all_ranks_equal(got)}


def lbfgs() -> Dict[str, Any]:
    model, opt, comp = _wrapped("lbfgs", "classic", ratio=0.5)
    x, y = _batch(0)
    calls = [0]

    def closure() -> torch.Tensor:
        calls[0] += 1
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss

    with torch.no_grad():
        first = float(F.cross_entropy(model(x), y))
    for _ in range(3):
        opt.step(closure)
    last = float(F.cross_entropy(model(x), y).detach())
    return {"first": first, "last": last, "calls": calls[0], "replicas": all_ranks_equal(_params(model))}


def stock_refuses() -> Dict[str, Any]:
    model, opt, _ = _wrapped("sgd", "classic", stock=True)
    x, y = _batch(0)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss

    try:
        opt.step(closure)
        error = ""
    except Exception as exc:   # noqa: BLE001 - the test asserts on the message
        error = f"{type(exc).__name__}: {exc}"
    return {"error": error}


def rank0_checkpoint(policy: str, ckpt: str, stock: bool = False, steps: int = 6, half: int = 3) -> Dict[str, Any]:
    """``steps`` straight against ``half`` steps, a checkpoint of ``GradientAccumulator.state_dict(all_ranks=True)``
    written by rank 0 alone, a fresh model and optimizer on every rank loading it, then the rest."""
    optimizer, feedback = POLICIES[policy]

    def run(start: int, stop: int, model: Any, acc: Any) -> None:
        for step in range(start, stop):
            x, y = _batch(step)
            acc.backward(F.cross_entropy(model(x), y))

    def fresh() -> Any:
        model, opt, _ = _wrapped(optimizer, feedback(), stock=stock)
        return model, gc.GradientAccumulator(opt, steps=1)

    model, acc = fresh()
    run(0, steps, model, acc)
    straight = _params(model)
    model, acc = fresh()
    run(0, half, model, acc)
    state = acc.state_dict(all_ranks=True)
    path = f"{ckpt}/acc-{policy}-{int(stock)}.pt"
    if hvd.rank() == 0:
        torch.save({"model": model.state_dict(), "acc": state}, path)
    hvd.allreduce(torch.zeros(1), name="saved")   # a barrier: rank 0 has written the file
    model, acc = fresh()
    saved = torch.load(path, weights_only=True)
    model.load_state_dict(saved["model"])
    acc.load_state_dict(saved["acc"])
    run(half, steps, model, acc)
    stats = acc.optimizer.compression.stats if not stock else acc.optimizer._compression.stats
    return {"identical": bool(torch.equal(straight, _params(model))), "held": state["compression"]["ranks"] is not None,
            "summary": stats.summary()}


def seeded(seed: int, stock: bool = False, steps: int = 4) -> Dict[str, Any]:
    """A run whose compressor has no ``seed=``, after ``torch.manual_seed(seed)``: its seed and weights."""
    model = _model()
    torch.manual_seed(seed)
    comp = gc.TopKQSGD(ratio=0.05, bits=8)
    wrap = hvd.DistributedOptimizer if stock else gc.DistributedOptimizer
    opt = wrap(_optimizer("momentum", model.parameters()), named_parameters=model.named_parameters(),
               compression=comp)
    for step in range(steps):
        x, y = _batch(step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return {"seed": comp.seed, "params": _params(model).tolist()}


def battery(jobs: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    fns = {"closure_matches": closure_matches, "lbfgs": lbfgs, "stock_refuses": stock_refuses,
           "rank0_checkpoint": rank0_checkpoint, "seeded": seeded}
    return {key: fns[job.pop("fn")](**job) for key, job in ((k, dict(v)) for k, v in jobs.items())}
