"""Rank-side code of tests/test_fidelity_ranks.py: short trainings through either wrapper,
reporting the feedback policy chosen, what rank 0 said about it, and the held-out loss."""
from __future__ import annotations

import logging
from typing import Any, Dict, List

import horovod.torch as hvd
import torch
import torch.nn.functional as F

import hvd_gradcomp as gc
from tests.workers.integration import all_ranks_equal

IN, HIDDEN, OUT = 64, 128, 10


class _Said(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: List[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _data(seed: int, n: int):
    """A learnable task: labels from a fixed random teacher network."""
    g = torch.Generator().manual_seed(seed)
    teacher = torch.randn(IN, OUT, generator=torch.Generator().manual_seed(99))
    x = torch.randn(n, IN, generator=g)
    return x, (torch.tanh(x) @ teacher).argmax(1)


def train(wrapper: str, optimizer: str, compression: str, steps: int = 120, accumulate: int = 1,
          ratio: float = 0.25, feedback: str = "auto") -> Dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUT))
    if optimizer == "sgd-momentum":
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    policy = gc.FrozenVariance(warmup=int(feedback[6:])) if feedback.startswith("frozen") else feedback
    comp = gc.TopKQSGD(ratio=ratio, bits=8, feedback=policy) if compression == "topkqsgd" else None
    said = _Said()
    log = logging.getLogger("hvd_gradcomp")
    log.addHandler(said)
    log.setLevel(logging.INFO)
    kw = dict(named_parameters=model.named_parameters(), backward_passes_per_step=accumulate)
    if comp is not None:
        kw["compression"] = comp
    opt = (gc.DistributedOptimizer(opt, **kw) if wrapper == "gc" else hvd.DistributedOptimizer(opt, **kw))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    acc = gc.GradientAccumulator(opt, steps=accumulate)
    for step in range(steps):
        for i in range(accumulate):
            x, y = _data(10_000 * hvd.rank() + 10 * step + i, 32 // accumulate)
            acc.backward(F.cross_entropy(model(x), y))
        sched.step()
    log.removeHandler(said)
    vx, vy = _data(123_456, 2048)
    with torch.no_grad():
        val = F.cross_entropy(model(vx), vy).item()
    return {"feedback": getattr(getattr(comp, "feedback", None), "key", None), "said": said.messages,
            "identical": all(all_ranks_equal(p.detach()) for p in model.parameters()), "val_loss": val}


def battery(scenarios: List[Dict[str, Any]]) -> List[Any]:
    return [train(**sc) for sc in scenarios]


def _edited_run(wrapper: str, comp: Any, make_opt: Any, edit: Any, steps: int) -> Any:
    """Train the teacher task through ``wrapper`` with ``comp`` in Horovod's pattern, ``edit`` (the
    user's code) run on the parameters between synchronize() and step(); (model, warnings caught)."""
    import warnings

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUT))
    kw = dict(named_parameters=model.named_parameters(), compression=comp)
    opt = make_opt(model.parameters())
    opt = gc.DistributedOptimizer(opt, **kw) if wrapper == "gc" else hvd.DistributedOptimizer(opt, **kw)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(steps):
            x, y = _data(10_000 * hvd.rank() + step, 32)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.synchronize()
            edit(list(model.parameters()))
            with opt.skip_synchronize():
                opt.step()
    return model, caught


def clipped_warmup(wrapper: str, steps: int = 8, scale: float = 0.5) -> Dict[str, Any]:
    """AdamW under TopKQSGD with FrozenVariance(warmup=6, window=4) twice: as is, and with every
    gradient scaled by ``scale`` between synchronize() and step() (what clip_grad_norm_ does,
    in Horovod's pattern). Returns the largest relative difference between the two runs' frozen
    denominators (the second moment must be that of the gradients as exchanged) and the
    warnings each run raised."""
    def run(s: float):
        comp = gc.TopKQSGD(ratio=0.25, bits=8, seed=1, feedback=gc.FrozenVariance(warmup=6, window=4))
        _, caught = _edited_run(wrapper, comp, lambda ps: torch.optim.AdamW(ps, lr=3e-3),
                                lambda ps: [p.grad.mul_(s) for p in ps], steps)
        return dict(comp.feedback.denom), [str(w.message) for w in caught if w.category is RuntimeWarning]

    plain, plain_warned = run(1.0)
    scaled, scaled_warned = run(scale)
    return {"names": sorted(plain), "rel": max(float(((scaled[n] - plain[n]) / plain[n]).abs().max()) for n in plain),
            "plain_warned": plain_warned, "scaled_warned": scaled_warned}


def scaled_averages(wrapper: str, steps: int = 6) -> Dict[str, Any]:
    """Momentum SGD under TopKQSGD(25%, 8) (momentum correction) in Horovod's pattern, with the
    user's code between synchronize() and step() doing: nothing, clip_grad_norm_ (one factor on
    every gradient, changing from step to step), a loss scaler's unscale_ (a power of two), both,
    an addition (not a scaling), or a constant factor (a fixed rescale). Per variant: the RuntimeWarnings about scaled averages and the compressor's count."""
    edits = {
        "none": lambda ps: None,
        "clip": lambda ps: torch.nn.utils.clip_grad_norm_(ps, 0.01),
        "unscale": lambda ps: [p.grad.mul_(0.25) for p in ps],
        "unscale+clip": lambda ps: ([p.grad.mul_(0.25) for p in ps], torch.nn.utils.clip_grad_norm_(ps, 0.01)),
        "add": lambda ps: [p.grad.add_(p.detach(), alpha=1e-2) for p in ps],
        "constant": lambda ps: [p.grad.mul_(0.3) for p in ps]}
    out: Dict[str, Any] = {}
    for label, edit in edits.items():
        comp = gc.TopKQSGD(ratio=0.25, bits=8, seed=1)
        model, caught = _edited_run(wrapper, comp, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), edit, steps)
        out[label] = {"warned": [str(w.message) for w in caught if "scaled by" in str(w.message)],
                      "count": comp.scaled_after_exchange, "feedback": comp.feedback.key,
                      "identical": all(all_ranks_equal(p.detach()) for p in model.parameters())}
    return out
