"""Code of tests/test_horovod_adapter.py that needs ``hvd.init()``: run in one plain process
(size 1, see :func:`tests.harness.run_single`), where Horovod's own optimizer code runs but
no rank is started. Each check returns what happened; the test asserts on it."""
from __future__ import annotations

from typing import Any, Callable, Dict

import horovod.torch as hvd
import torch

import hvd_gradcomp as gc
from hvd_gradcomp.horovod import StockContext


def _error(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except Exception as exc:  # the test asserts type and message
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))


def stock_optimizer_frames() -> Dict[str, Any]:
    """Horovod 0.28.1's real _allreduce_grad_async calls compress(): names, context, result."""
    out: Dict[str, Any] = {}
    for how in ("frame", "bound", "noname"):
        model = _model()
        comp = gc.TopK(ratio=1.0)
        if how == "bound":
            comp.bind(model.named_parameters())
        names = None if how == "noname" else model.named_parameters()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=names,
                                       compression=comp)
        model(torch.randn(8, 32)).pow(2).mean().backward()
        p = model[0].weight
        local = p.grad.clone()
        handle, ctx = opt._allreduce_grad_async(p)       # Horovod's own call, as its hook makes it
        out[f"{how}-ctx"] = type(ctx).__name__
        out[f"{how}-name"] = ctx.pending.name if isinstance(ctx, StockContext) else None
        hvd.synchronize(handle)
        out[f"{how}-equal"] = bool(torch.equal(comp.decompress(torch.empty(0), ctx), local))  # ratio 1, 1 rank
        out[f"{how}-stream"] = comp.stream
    model = _model()
    other = _model(1)
    comp = gc.TopK(ratio=1.0, named_parameters=other.named_parameters())     # names of another model
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), compression=comp)
    model(torch.randn(8, 32)).pow(2).mean().backward()
    out["wrong-model"] = _error(lambda: opt._allreduce_grad_async(model[0].weight))
    return out


def optimizer_misuse() -> Dict[str, Any]:
    """hvd_gradcomp.DistributedOptimizer and GradientAccumulator used wrongly, on one rank."""
    out: Dict[str, Any] = {}
    model = _model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 32)
    opt = gc.DistributedOptimizer(sgd, named_parameters=model.named_parameters(), compression=gc.TopKQSGD(),
                                  min_compress_numel=16)
    model(x).sum().backward()
    out["too_many_backward"] = _error(lambda: model(x).sum().backward())
    out["zero_grad_in_flight"] = _error(opt.zero_grad)
    opt.step()
    out["zero_grad_after_step"] = _error(opt.zero_grad)
    out["wrap_twice"] = _error(lambda: gc.DistributedOptimizer(opt, named_parameters=model.named_parameters()))
    opt.remove_hooks()
    model2 = _model()
    out["unnamed_parameter"] = _error(lambda: gc.DistributedOptimizer(
        torch.optim.SGD(model2.parameters(), lr=0.1), named_parameters=list(model2.named_parameters())[:2]))
    out["duplicate_names"] = _error(lambda: gc.DistributedOptimizer(
        torch.optim.SGD(model2.parameters(), lr=0.1),
        named_parameters=[("w", p) for p in model2.parameters()]))
    out["not_tuples"] = _error(lambda: gc.DistributedOptimizer(
        torch.optim.SGD(model2.parameters(), lr=0.1), named_parameters=list(model2.parameters())))
    acc_opt = gc.DistributedOptimizer(torch.optim.SGD(model2.parameters(), lr=0.1),
                                      named_parameters=model2.named_parameters(), backward_passes_per_step=2)
    acc = gc.GradientAccumulator(acc_opt, steps=2, micro_batch=8)
    out["flush_nothing"] = [acc.flush(), acc.optimizer_steps]
    out["non_scalar_loss"] = _error(lambda: acc.backward(model2(x)))
    out["stepped"] = [acc.backward(model2(x).sum()), acc.backward(model2(x).sum())]
    out["flush_after_step"] = [acc.flush(), acc.optimizer_steps]
    state = acc.state_dict()                   # between windows
    acc.backward(model2(x).sum())
    out["save_mid_window"] = _error(acc.state_dict)
    out["load_mid_window"] = _error(lambda: acc.load_state_dict({**state, "pending": 1}))  # a hand-made one
    out["load_other_steps"] = _error(lambda: gc.GradientAccumulator(acc_opt, steps=2).load_state_dict(
        {**state, "steps": 4, "pending": 0}))
    out.update(grads_changed_before_step())
    return out


def grads_changed_before_step() -> Dict[str, Any]:
    """clip_grad_norm_ between backward() and step() without synchronize(), on every compressor kind and
    uncompressed; then Horovod's pattern (synchronize, clip, skip_synchronize step), which must pass."""
    out: Dict[str, Any] = {}
    x = torch.randn(8, 32)
    for kind, comp in (("topkqsgd", gc.TopKQSGD()), ("qsgd", gc.QSGD(bits=8)), ("none", None)):
        model = _model()
        opt = gc.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3),
                                      named_parameters=model.named_parameters(), compression=comp,
                                      min_compress_numel=16)
        model(x).pow(2).mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
        out[f"clip-before-step-{kind}"] = _error(opt.step)
        opt.zero_grad()
        for _ in range(2):   # the next steps, in Horovod's pattern
            model(x).pow(2).mean().backward()
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
            with opt.skip_synchronize():
                opt.step()
            opt.zero_grad()
        model(x).pow(2).mean().backward()
        out[f"plain-step-{kind}"] = _error(opt.step)
        opt.remove_hooks()
    return out


def unread_settings() -> Dict[str, Any]:
    """HVDGC_COMPRESSION=topk is set (see the test's env) but the script builds an uncompressed
    optimizer without reading it: one warning, on rank 0, however many optimizers follow."""
    import warnings

    caught = []
    for _ in range(2):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            model = _model()
            gc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                    named_parameters=model.named_parameters()).remove_hooks()
        caught.append([f"{w.category.__name__}: {w.message}" for w in seen])
    return {"warnings": caught}


def one_class_every_road() -> Dict[str, Any]:
    """One codec class on the three roads (issue 60): stock ``hvd.DistributedOptimizer``,
    ``hvd_gradcomp.DistributedOptimizer`` and the DDP hook (a 1-rank gloo group), each a step
    that compresses; the class of each compressor and the payload bytes it counted."""
    import torch.distributed as dist

    out: Dict[str, Any] = {}
    roads = {"stock": lambda m, c: hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                                            named_parameters=m.named_parameters(), compression=c),
             "ours": lambda m, c: gc.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                                          named_parameters=m.named_parameters(), compression=c)}
    for road, wrap in roads.items():
        model = _model()
        comp = gc.TopKQSGD(ratio=0.5, bits=8, named_parameters=model.named_parameters())
        opt = wrap(model, comp)
        model(torch.randn(8, 32)).pow(2).mean().backward()
        if road == "stock":   # Horovod registers no hooks on 1 rank: its own call, as its hook makes it
            handle, ctx = opt._allreduce_grad_async(model[0].weight)
            hvd.synchronize(handle)
            comp.decompress(torch.empty(0), ctx)
        else:
            opt.step()
        out[road] = [f"{type(comp).__module__}:{type(comp).__qualname__}", comp.stats.bytes_out > 0]
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)   # in-process: no port
    try:
        model = torch.nn.parallel.DistributedDataParallel(_model())
        comp = gc.TopKQSGD(ratio=0.5, bits=8)
        gc.ddp.register(model, compression=comp, min_compress_numel=16)
        model(torch.randn(8, 32)).pow(2).mean().backward()
        out["ddp"] = [f"{type(comp).__module__}:{type(comp).__qualname__}", comp.stats.bytes_out > 0]
    finally:
        dist.destroy_process_group()
    return out
