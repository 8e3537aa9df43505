"""Rank-side code of tests/test_integration.py (runs under horovodrun; see tests/harness.py).

Each function returns JSON-able values; the assertions live in the test, in the pytest
process, except where a value can only be checked on the rank (then it is returned too).
"""
from __future__ import annotations

import math
import os
import signal
import time
from typing import Any, Dict, List, Optional

import horovod.torch as hvd
import torch
import torch.nn.functional as F

import hvd_gradcomp as gc
from hvd_gradcomp.codecs.compressor import qsgd_ef_scale
from hvd_gradcomp.feedback.kernels import half_bound
from hvd_gradcomp.stats import ByteStats  # noqa: F401  (documented attribute types)

IN, HIDDEN, OUT = 64, 128, 10   # fc1.weight 8192 and fc2.weight 1280 elements: compressed


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential()
    model.add_module("fc1", torch.nn.Linear(IN, HIDDEN))
    model.add_module("act", torch.nn.Tanh())
    model.add_module("fc2", torch.nn.Linear(HIDDEN, OUT))
    return model.double() if os.environ.get("HVDGC_TEST_DOUBLE") else model


def batch(rank: int, step: int, n: int = 16, offset: int = 0):
    """Deterministic data of (rank, step): the same on every run."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(n + offset, IN, generator=g)[offset:]
    y = torch.randint(0, OUT, (n + offset,), generator=g)[offset:]
    return x, y


def make_compressor(kind: str, **kw: Any):
    if kind == "none":
        return None
    if kind == "fp16":
        return hvd.Compression.fp16
    return {"qsgd": gc.QSGD, "topk": gc.TopK, "topkqsgd": gc.TopKQSGD, "auto": gc.Auto}[kind](**kw)


def grads_of(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def all_ranks_equal(t: torch.Tensor) -> bool:
    every = hvd.allgather(t.detach().reshape(1, -1).contiguous())
    return all(torch.equal(every[0], every[r]) for r in range(every.shape[0]))


def mean_over_ranks(t: torch.Tensor) -> torch.Tensor:
    return hvd.allreduce(t.detach().clone(), op=hvd.Average)


# ---------------------------------------------------------------- (a) and (f)
def compressed_gradient(kind: str, stock: bool = False, op: str = "average", **kw: Any) -> Dict[str, Any]:
    """One step's exchanged gradient against an uncompressed reference computed here."""
    model = make_model()
    comp = make_compressor(kind, **kw)
    hvd_op = hvd.Average if op == "average" else hvd.Sum
    base = torch.optim.SGD(model.parameters(), lr=0.1)
    wrap = hvd.DistributedOptimizer if stock else gc.DistributedOptimizer
    opt = wrap(base, named_parameters=model.named_parameters(), compression=comp, op=hvd_op)
    x, y = batch(hvd.rank(), 0)
    # The local gradient from a twin model: stock Horovod allreduces uncompressed tensors (small
    # ones here) in place on p.grad in its background thread, so p.grad cannot be read back.
    twin = make_model()
    F.cross_entropy(twin(x), y).backward()
    local = grads_of(twin)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.synchronize()
    out: Dict[str, Any] = {"names": [], "identical": [], "max_err": [], "bound": [], "rel_err": []}
    for name, p in model.named_parameters():
        ref = expected(kind, local[name], hvd_op, kw, stock)
        out["names"].append(name)
        out["identical"].append(all_ranks_equal(p.grad))
        out["max_err"].append((p.grad - ref).abs().max().item())
        out["rel_err"].append(((p.grad - ref).norm() / ref.norm()).item())
        out["bound"].append(error_bound(kind, local[name], hvd_op, kw, stock))
    return out


def error_bound(kind: str, g: torch.Tensor, op: Any, kw: Dict[str, Any], stock: bool = False) -> float:
    """A hard elementwise bound on |exchanged - expected|, from every rank's gradient.

    Expected is the exact mean for dense kinds, and the mean of every rank's top-k-masked
    gradient for TopK kinds. QSGD moves each value by less than one level, norm/s, per
    quantisation; the compressed allreduce quantises twice (each rank's chunk, then the
    reduced chunk), and a bucket's norm is at most the tensor's norm. fp16: relative 2**-11.
    Our compressors send tensors below min_compress_numel as float16 (exempt="fp16"): divided
    by the ranks and cast (one rounding), summed in float16 (one more), divided by the ranks in
    float16 by Horovod's Average on the stock road (one more); below float16's normal range a
    rounding moves a value by up to 2**-25 of the ranks' scale.
    """
    scale = hvd.size() if op == hvd.Sum else 1
    if g.numel() < 1024:  # below min_compress_numel: uncompressed on both wrappers (fp16 still casts)
        kind = "fp16" if kind == "fp16" else "exempt" if kind != "none" else "none"
    gmax = hvd.allreduce(g.abs().max().reshape(1), op=hvd.Max).item()
    if kind == "exempt":
        return scale * (3 * gmax * 2 ** -11 + 3 * hvd.size() * 2 ** -24) + 1e-7
    gmax_norm = hvd.allreduce(g.norm().reshape(1), op=hvd.Max).item()
    if kind in ("qsgd", "topkqsgd"):
        s = 2 ** (kw.get("bits", 8) - 1) - 1
        stages = 2 if kind == "qsgd" else 1
        return scale * stages * gmax_norm / s * 1.0001 + 1e-7
    if kind == "fp16":
        return scale * 2 * gmax * 2 ** -10 + 1e-7
    return 1e-6 * scale


def ef_shrink(kind: str, n: int, kw: Dict[str, Any], stock: bool) -> float:
    """Classic error feedback scales low-bit QSGD payloads by 1/(1+w) (see qsgd_ef_scale): the factor
    for a tensor of n elements, applied once per quantisation (twice on the compressed-allreduce
    road). With feedback="auto" (the default) low-bit QSGD runs without error feedback: no scale."""
    if kind != "qsgd" or kw.get("feedback") != "classic" or n < 1024:
        return 1.0
    piece = n if stock else n // hvd.size()
    scale = qsgd_ef_scale(kw.get("bits", 8), min(piece, kw.get("bucket_size", 512)))
    return scale if stock else scale ** 2


def expected(kind: str, g: torch.Tensor, op: Any, kw: Dict[str, Any], stock: bool = False) -> torch.Tensor:
    """What the exchange should produce, computed independently of the library (torch.topk)."""
    flat = g.reshape(-1) * ef_shrink(kind, g.numel(), kw, stock)
    if kind in ("topk", "topkqsgd") and flat.numel() >= 1024:
        k = max(1, math.ceil(kw.get("ratio", 0.01) * flat.numel() - 1e-9))
        keep = torch.zeros_like(flat, dtype=torch.bool)
        keep[torch.topk(flat.abs(), k).indices] = True
        flat = torch.where(keep, flat, torch.zeros_like(flat))
    out = mean_over_ranks(flat)
    return (out * hvd.size() if op == hvd.Sum else out).view_as(g)


# ---------------------------------------------------------------- (b) accumulation
def accumulation(n: int = 4, micro: int = 4, stock: bool = False, partial: int = 0) -> Dict[str, Any]:
    """N micro-batches through GradientAccumulator vs one batch N times larger (float32).

    With ``partial`` = k < N, only k micro-batches are fed and ``flush()`` steps: the
    reference is then one batch of k micro-batches.
    """
    fed = partial or n
    wrap = hvd.DistributedOptimizer if stock else gc.DistributedOptimizer
    xs, ys = zip(*[batch(hvd.rank(), 0, micro, offset=i * micro) for i in range(fed)])
    # Accumulated.
    m_acc = make_model()
    opt = wrap(torch.optim.SGD(m_acc.parameters(), lr=0.5), named_parameters=m_acc.named_parameters(),
               backward_passes_per_step=n)
    acc = gc.GradientAccumulator(opt, steps=n, micro_batch=micro)
    grads_seen: Dict[str, torch.Tensor] = {}
    orig_step = opt.step

    def capture_then_step(*a, **k):  # record the exchanged gradient the step applies
        opt.synchronize()
        grads_seen.update(grads_of(m_acc))
        with opt.skip_synchronize():
            return orig_step(*a, **k)

    opt.step = capture_then_step
    stepped = [acc.backward(F.cross_entropy(m_acc(x), y)) for x, y in zip(xs, ys)]
    if partial:
        stepped.append(acc.flush())
    # Reference: one large batch, one step.
    m_ref = make_model()
    ref_opt = wrap(torch.optim.SGD(m_ref.parameters(), lr=0.5), named_parameters=m_ref.named_parameters())
    F.cross_entropy(m_ref(torch.cat(xs)), torch.cat(ys)).backward()
    ref_opt.synchronize()
    ref_grads = grads_of(m_ref)
    with ref_opt.skip_synchronize():
        ref_opt.step()
    grad_rel = max(((grads_seen[k] - ref_grads[k]).abs().max() / ref_grads[k].abs().max()).item()
                   for k in ref_grads)
    param_rel = max(((a - b).abs().max() / b.abs().max()).item()
                    for a, b in zip(m_acc.parameters(), m_ref.parameters()))
    return {"stepped": stepped, "grad_rel": grad_rel, "param_rel": param_rel,
            "describe": acc.describe(), "optimizer_steps": acc.optimizer_steps,
            "grads_zeroed": all(p.grad is None or not p.grad.any() for p in m_acc.parameters())}


# ---------------------------------------------------------------- (c) bytes
def bytes_per_step(kind: str, **kw: Any) -> Dict[str, Any]:
    """Bytes this rank hands to Horovod in one step, against the raw gradient bytes."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 256))
    comp = make_compressor(kind, **kw)
    opt = gc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters(), compression=comp)
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(hvd.rank()))
    model(x).pow(2).mean().backward()
    opt.step()
    big = [n for n, p in model.named_parameters() if p.numel() >= 1024]
    # Our compressors send the small float32 tensors as float16 (exempt="fp16"): 2 bytes a value.
    small_bytes = sum(p.numel() * (2 if comp is not None else 4) for p in model.parameters() if p.numel() < 1024)
    raw_big = sum(p.numel() * 4 for n, p in model.named_parameters() if n in big)
    sent_big = sum(opt.comm_stats.per_tensor[n][1] for n in big)
    comp_ratio = None
    if comp is not None and hasattr(comp, "stats"):
        # The compressor's own count of payload bytes (chunks and re-quantised chunks included).
        comp_ratio = comp.stats.ratio
    return {"last_step_bytes": opt.last_step_bytes, "small_bytes": small_bytes, "raw_big": raw_big,
            "sent_big": sent_big, "compressor_ratio": comp_ratio, "size": hvd.size()}


def accumulation_clipped(stock: bool = False, kind: str = "topkqsgd", n: int = 2, steps: int = 3,
                         max_norm: float = 0.05, optimizer: str = "sgd") -> Dict[str, Any]:
    """GradientAccumulator(max_grad_norm=...) against the same loop written out (synchronize,
    clip_grad_norm_, step): parameters and norms must be identical, and equal on every rank. Where
    clipping the averages would be wrong (TopKQSGD with momentum correction) the first step
    refuses: the message is returned."""
    wrap = hvd.DistributedOptimizer if stock else gc.DistributedOptimizer

    def build():
        model = make_model()
        comp = make_compressor(kind, ratio=0.25, seed=5) if kind != "none" else None
        base = (torch.optim.AdamW(model.parameters(), lr=1e-2) if optimizer == "adamw"
                else torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9))
        opt = wrap(base, named_parameters=model.named_parameters(), compression=comp or hvd.Compression.none,
                   backward_passes_per_step=n)
        return model, opt

    model, opt = build()
    if kind != "none" and optimizer == "sgd":
        at = "construction"
        try:
            acc = gc.GradientAccumulator(opt, steps=n, max_grad_norm=max_norm)
            at = "step"
            for i in range(n):
                x, y = batch(hvd.rank(), i)
                acc.backward(F.cross_entropy(model(x), y))
        except ValueError as err:
            return {"refused": str(err), "at": at}
        return {"refused": None}
    acc = gc.GradientAccumulator(opt, steps=n, max_grad_norm=max_norm)
    norms = []
    for step in range(steps):
        for i in range(n):
            x, y = batch(hvd.rank(), 10 * step + i)
            acc.backward(F.cross_entropy(model(x), y))
        norms.append(float(acc.last_grad_norm))
    ref, ref_opt = build()
    ref_norms = []
    for step in range(steps):
        for i in range(n):
            x, y = batch(hvd.rank(), 10 * step + i)
            (F.cross_entropy(ref(x), y) / n).backward()
        ref_opt.synchronize()
        ref_norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)))
        with ref_opt.skip_synchronize():
            ref_opt.step()
        ref_opt.zero_grad()
    return {"identical": all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters())),
            "norms": norms, "ref_norms": ref_norms,
            "ranks_equal": all(all_ranks_equal(p.detach()) for p in model.parameters())}


def bfloat16_model(stock: bool = False, kind: str = "topkqsgd") -> Dict[str, Any]:
    """A bfloat16 model (Horovod 0.28.1's CPU allreduce refuses bfloat16): one step through either
    wrapper; the uncompressed (small) tensors' averages must be the float32 average of every rank's
    gradient cast to bfloat16, exactly, and every rank must hold the same parameters after 3 steps."""
    torch.manual_seed(0)   # the same start on every rank (Horovod cannot broadcast bfloat16 here)
    model = make_model().to(torch.bfloat16)
    comp = gc.Auto(named_parameters=model.named_parameters() if stock else None) if kind == "auto" \
        else gc.TopKQSGD(ratio=0.25, bits=8, seed=3)
    wrap = hvd.DistributedOptimizer if stock else gc.DistributedOptimizer
    opt = wrap(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
               compression=comp)
    exact = True
    for step in range(3):
        x, y = batch(hvd.rank(), step)
        opt.zero_grad()
        F.cross_entropy(model(x.to(torch.bfloat16)).float(), y).backward()
        local = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.numel() < 1024}
        opt.synchronize()
        for n, p in model.named_parameters():
            if n in local:
                want = hvd.allgather(local[n].unsqueeze(0), name=f"bf16.{n}.{step}.{stock}.{kind}").mean(0)
                exact = exact and torch.equal(p.grad, want.to(torch.bfloat16))
        with opt.skip_synchronize():
            opt.step()
    return {"exact": exact, "small": sorted(local), "dtype": str(next(model.parameters()).dtype),
            "ranks_equal": all(all_ranks_equal(p.detach().float()) for p in model.parameters())}


def float64_layer(stock: bool = False, kind: str = "topkqsgd") -> Dict[str, Any]:
    """A float32 model with one large float64 layer (fc1, 8192 elements: compressed were it float32),
    AdamW with its second moment frozen after 2 steps: fc1 travels as it is (the wire encodes
    float32, float16 and bfloat16), so its average must be every rank's float64 gradient averaged;
    fc2 is compressed; every rank must hold the same parameters after 5 steps."""
    model = make_model()
    model.fc1.double()
    feedback = {"feedback": gc.FrozenVariance(warmup=2)} if kind != "auto" else {}
    comp = gc.Auto(named_parameters=model.named_parameters() if stock else None) if kind == "auto" \
        else gc.TopKQSGD(ratio=0.05, bits=8, seed=3, **feedback)
    wrap = hvd.DistributedOptimizer if stock else gc.DistributedOptimizer
    opt = wrap(torch.optim.AdamW(model.parameters(), lr=0.01), named_parameters=model.named_parameters(),
               compression=comp)
    worst, losses = 0.0, []
    for step in range(5):
        x, y = batch(hvd.rank(), step)
        opt.zero_grad()
        loss = F.cross_entropy(model.fc2(model.act(model.fc1(x.double())).float()), y)
        # this rank's gradient, apart: on stock Horovod's road the allreduce writes p.grad in place
        # from its background thread, so p.grad after backward() may already be (partly) averaged
        local = torch.autograd.grad(loss, model.fc1.weight, retain_graph=True)[0]
        loss.backward()
        opt.synchronize()
        want = hvd.allgather(local.unsqueeze(0), name=f"f64.{step}.{stock}.{kind}").mean(0)
        worst = max(worst, float((model.fc1.weight.grad - want).abs().max() / want.abs().max()))
        with opt.skip_synchronize():
            opt.step()
        losses.append(float(loss))
    return {"worst_rel": worst, "losses": losses, "dtype": str(model.fc1.weight.dtype),
            "ranks_equal": all(all_ranks_equal(p.detach()) for p in model.parameters())}


# ---------------------------------------------------------------- (d) checkpoint / resume
def _train(model, acc, steps: int, start: int, n: int, sched=None) -> None:
    for step in range(start, start + steps):
        for i in range(n):
            x, y = batch(hvd.rank(), 100 * step + i, 8)
            acc.backward(F.cross_entropy(model(x), y))
        if sched is not None:
            sched.step()


def _fresh(kind: str, n: int, stock: bool = False, schedule: bool = False, warmup: int = 2,
           window: Optional[int] = 50):
    model = make_model()
    # Adam's default policy ("frozen") is dense for 100 steps: freeze after 2, so the checkpoint
    # (after 3) holds the frozen second moment, the velocities and the residuals (the biases':
    # those of their float16 road, exempt="fp16"). warmup=4, window=4: the checkpoint falls inside
    # the warm-up, with the window's running average under way.
    frozen = {"feedback": gc.FrozenVariance(warmup=warmup, window=window)} if kind in ("topk", "topkqsgd") else {}
    named = {"named_parameters": model.named_parameters()} if kind == "auto" and stock else {}
    comp = make_compressor(kind, seed=7, **frozen, **named) if kind != "none" else None
    wrap = hvd.DistributedOptimizer if stock else gc.DistributedOptimizer
    opt = wrap(torch.optim.Adam(model.parameters(), lr=0.01), named_parameters=model.named_parameters(),
               compression=comp or hvd.Compression.none, backward_passes_per_step=n)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    # A rate that changes every step: a policy reading the param groups of before the load
    # (torch's load_state_dict replaces them) would step the resumed run at a stale rate.
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.7) if schedule else None
    return model, opt, gc.GradientAccumulator(opt, steps=n, micro_batch=8), sched


def checkpoint_resume(kind: str, ckpt_dir: str, n: int = 2, steps: int = 6, stock: bool = False,
                      schedule: bool = False, warmup: int = 2, window: Optional[int] = 50) -> Dict[str, Any]:
    """Uninterrupted run vs a run stopped at steps/2, saved, rebuilt from scratch and resumed."""
    setup = dict(stock=stock, schedule=schedule, warmup=warmup, window=window)
    model, _, acc, sched = _fresh(kind, n, **setup)
    _train(model, acc, steps, 0, n, sched)
    straight = [p.detach().clone() for p in model.parameters()]

    model, _, acc, sched = _fresh(kind, n, **setup)
    _train(model, acc, steps // 2, 0, n, sched)
    path = os.path.join(ckpt_dir, f"ckpt-rank{hvd.rank()}.pt")
    torch.save({"model": model.state_dict(), "acc": acc.state_dict(),
                "sched": sched.state_dict() if sched is not None else None}, path)
    owed = {k: v.numel() for k, v in acc.state_dict()["compression"]["half"]["residuals"].items()} \
        if kind not in ("none", "auto") else {}   # Auto's small tensors go as float32 (exempt="fp32")
    del model, acc
    model, _, acc, sched = _fresh(kind, n, **setup)       # new objects, new (same-seeded) compressor
    state = torch.load(path)
    model.load_state_dict(state["model"])
    acc.load_state_dict(state["acc"])
    if sched is not None:
        sched.load_state_dict(state["sched"])
    _train(model, acc, steps - steps // 2, steps // 2, n, sched)
    resumed = [p.detach().clone() for p in model.parameters()]
    moved = max((a - b).abs().max().item() for a, b in zip(straight, make_model().parameters()))
    return {"identical": all(torch.equal(a, b) for a, b in zip(straight, resumed)),
            "max_diff": max((a - b).abs().max().item() for a, b in zip(straight, resumed)),
            "moved": moved, "optimizer_steps": acc.optimizer_steps, "half_residuals": owed}


# ---------------------------------------------------------------- exempt tensors as float16 (issue 9)
SMALL_VALUES = [1e6, -3e5, 70000.0, 1.0, -0.25, 1e-3, 3e-5, 1e-7, -2e-9, 0.0]


def exempt_half(stock: bool = False, op: str = "average", steps: int = 4) -> Dict[str, Any]:
    """A 10-value parameter (under min_compress_numel: exempt="fp16") given chosen gradients, from
    beyond float16's range to below its resolution, beside a compressed one, for ``steps`` steps,
    then a step where rank 1's gradient holds NaN and Inf. Returns what the test checks: the
    first average bit-exact against float16 arithmetic done here, identical on every rank, the
    sum of the averages plus what the ranks still owe against the sum of the true averages, the
    bytes counted, and the non-finite step (NaN/Inf everywhere, residuals put back)."""
    size, rank = hvd.size(), hvd.rank()
    small, big = torch.nn.Parameter(torch.zeros(len(SMALL_VALUES))), torch.nn.Parameter(torch.zeros(2048))
    comp = gc.TopKQSGD(ratio=0.05, bits=8, seed=3)
    hvd_op = hvd.Average if op == "average" else hvd.Sum
    scale = size if op == "sum" else 1
    wrap = hvd.DistributedOptimizer if stock else gc.DistributedOptimizer
    tag = f"{'stock' if stock else 'ours'}-{op}"
    opt = wrap(torch.optim.SGD([small, big], lr=0.0), named_parameters=[(f"{tag}.small", small), (f"{tag}.big", big)],
               compression=comp, op=hvd_op)
    d = torch.randn(2048, generator=torch.Generator().manual_seed(rank))
    got, true, identical, tol = torch.zeros(len(SMALL_VALUES), dtype=torch.float64), None, True, None
    first_exact = owed = None
    for step in range(steps + 1):
        c = torch.tensor(SMALL_VALUES) * (1 + rank) * (1 + 0.1 * step)
        if step == steps and rank == 1:
            c[3], c[4] = float("nan"), float("inf")
        owed_before = comp.half_residuals.residual(f"{tag}.small")
        owed_before = None if owed_before is None else owed_before.clone()
        opt.zero_grad()
        ((small * c).sum() + (big * d).sum()).backward()
        opt.synchronize()
        avg = small.grad.detach().double().clone()
        with opt.skip_synchronize():
            opt.step()
        identical = identical and all_ranks_equal(torch.nan_to_num(avg, nan=7.0, posinf=8.0, neginf=9.0))
        if step == steps:   # the non-finite step
            owed_after = comp.half_residuals.residual(f"{tag}.small")
            return {"identical": identical, "first_exact": first_exact,
                    "err_over_tol": ((got + owed - true).abs() / tol).max().item(),
                    "owed_max": owed.abs().max().item(), "received_finite": bool(torch.isfinite(got).all()),
                    "nonfinite_where": [i for i in range(len(SMALL_VALUES)) if not math.isfinite(avg[i])],
                    "rolled_back": bool(torch.equal(owed_before, owed_after)),
                    "bytes": comp.stats.per_tensor[f"{tag}.small"][:2] if stock else
                    opt.comm_stats.per_tensor["fused.fp16"][:2],
                    "fp32_fused": [k for k in getattr(opt, "comm_stats", ByteStats()).per_tensor if k.startswith("fused.f")
                                   and k != "fused.fp16"]}
        if step == 0:   # float16 arithmetic here: each rank's cast, the sum, Horovod's Average on the stock road
            h = (c / size).clamp(-half_bound(size), half_bound(size)).half()
            every = hvd.allgather(h.float().reshape(1, -1)).half()
            s16 = every[0]
            for r in range(1, size):
                s16 = s16 + every[r]
            expect = s16.float() * (size if stock or op == "sum" else 1)
            if stock and op == "average":
                expect = (s16.float() * (1.0 / size)).half().float() * size
            first_exact = bool(torch.equal(avg.float(), expect))
        true_avg = hvd.allreduce(c.double(), op=hvd_op)
        got += avg
        true = true_avg if true is None else true + true_avg
        # The float16 sum (and the stock road's Average) round once each after the ranks' values
        # met: at most 2**-11 of the value, or 2**-25 of the ranks' scale below float16's normal range.
        # The float32 residuals round too: 2**-24 of their size, below 2**-22 of the running total.
        step_tol = avg.abs() * 2 ** -10 + scale * size * 2 ** -23 + true_avg.abs() * (step + 1) * 2 ** -22
        tol = step_tol if tol is None else tol + step_tol
        owed = hvd.allreduce(comp.half_residuals.residual(f"{tag}.small").double(), op=hvd_op)
    raise AssertionError("unreachable")


# ---------------------------------------------------------------- (e) failures
def failing_rank(mode: str) -> Dict[str, Any]:
    """Rank 1 raises (or is killed) after one step; rank 0 goes on into the next exchange."""
    model = make_model()
    opt = gc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters(), compression=gc.TopKQSGD())
    for step in range(50):
        if step == 1 and hvd.rank() == 1:
            print(f"rank 1 going down ({mode})", flush=True)
            if mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError("deliberate failure on rank 1")
        x, y = batch(hvd.rank(), step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        time.sleep(0.05)
    return {"finished": True}


# ---------------------------------------------------------------- errors
def stock_errors() -> Dict[str, List[str]]:
    """Misuse through stock Horovod raises clear errors instead of wrong gradients."""
    messages = []
    model = make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   compression=gc.TopK(), sparse_as_dense=False)
    x, y = batch(hvd.rank(), 0)
    model(x).sum().backward()
    opt.synchronize()  # works: names come from Horovod's call
    c = gc.TopK()
    try:
        c.compress(torch.randn(100))  # outside Horovod, error feedback on, no name
    except ValueError as e:
        messages.append(str(e))
    try:
        gc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Adasum,
                                compression=gc.TopK())
    except ValueError as e:
        messages.append(str(e))
    return {"messages": messages}


# ---------------------------------------------------------------- prepared fused groups
def prepared_groups(steps: int = 3) -> Dict[str, Any]:
    """Issue 13's shortcuts in the fused allgather against its plainest path (every payload, this
    rank's too, decoded from the bytes once the allgather is done, ``p.grad`` zeroed after the
    wait): the same parameters and gradients, bit for bit, after a few steps with error feedback.
    The shortcuts: groups prepared while their allgather travels (fused._prepare), this rank's
    parts taken from its encoder (_CARRIED), the outputs zeroed before the wait (_PREZERO) and,
    with two ranks, this rank's part added to them before the wait too (_ADD_OWN).
    Runs as they come, and with every allgather seen as still in flight during backward (hvd.poll
    answers False there), so that every launched group is prepared and zeroed before its wait;
    then p.grad must still hold the local gradient after backward (never zeros)."""
    from hvd_gradcomp.collectives import exchange, fused

    def train(prepare: bool, in_flight: bool, shortcuts: bool = True) -> Dict[str, Any]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, HIDDEN),
                                    torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUT))
        comp = gc.TopKQSGD(ratio=0.05, bits=8, seed=3)
        opt = gc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      named_parameters=model.named_parameters(), compression=comp)
        road = exchange._inner_exchanges(opt._compressed)[0]
        road.fusion_bytes = 40_000   # 3 weights (5, 64 and 32 kB of float32) in 2 groups
        real_prepare, poll, prepared, nonzero = road._prepare, hvd.poll, [], True
        road._prepare = lambda g, p: (prepared.append(len(g.members)), real_prepare(g, p))
        real_before, zeroed, held = road.before_wait, [], []

        def before_wait(p: Any) -> None:
            real_before(p)
            zeroed.append(sum(m.zeroed for m in p.group.members))
            held.append(sum(m.held for m in p.group.members))
        road.before_wait = before_wait
        fused._PREPARE, fused._CARRIED, fused._PREZERO = prepare, shortcuts, shortcuts
        fused._ADD_OWN = shortcuts
        try:
            for step in range(steps):
                x, y = batch(hvd.rank(), step)
                opt.zero_grad()
                if in_flight:
                    hvd.poll = lambda handle: False
                try:
                    F.cross_entropy(model(x), y).backward()
                    nonzero &= all(bool(p.grad.abs().max() > 0) for p in model.parameters())
                finally:
                    hvd.poll = poll
                opt.step()
        finally:
            fused._PREPARE = fused._CARRIED = fused._PREZERO = fused._ADD_OWN = True
        grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        return {"grads": grads, "params": params, "prepared": prepared, "nonzero": nonzero, "zeroed": sum(zeroed),
                "held": sum(held)}

    runs = {f"prepare={prepare},in_flight={in_flight}": train(prepare, in_flight)
            for prepare in (True, False) for in_flight in (True, False)}
    runs["own payloads decoded, zeroed after the wait"] = train(True, True, shortcuts=False)
    ref = train(False, False, shortcuts=False)
    return {"same": {k: torch.equal(r["grads"], ref["grads"]) and torch.equal(r["params"], ref["params"])
                     for k, r in runs.items()},
            "ranks_equal": all(all_ranks_equal(runs["prepare=True,in_flight=True"][k]) for k in ("params", "grads")),
            "prepared": {k: r["prepared"] for k, r in runs.items()},
            "zeroed": {k: r["zeroed"] for k, r in runs.items()},
            "held": {k: r["held"] for k, r in runs.items()},
            "moved": (ref["params"] - runs["prepare=True,in_flight=True"]["params"]).abs().max().item(),
            "grads_after_backward_nonzero": runs["prepare=True,in_flight=True"]["nonzero"]}


def battery(scenarios: List[Dict[str, Any]]) -> List[Any]:
    """Run several scenarios in one job (starting ranks costs seconds): [{"fn": name, **kwargs}]."""
    return [globals()[sc.pop("fn")](**sc) for sc in scenarios]


# ---------------------------------------------------------------- independent rounding noise
def _digest(payload: torch.Tensor) -> str:
    import hashlib
    return hashlib.sha256(payload.cpu().numpy().tobytes()).hexdigest()


def independent_noise() -> Dict[str, Any]:
    """Every rank encodes the *same* gradient with a compressor of the *same* explicit seed (as
    one HVDGC_SEED sent to every rank does): the payloads must still differ between ranks, on
    every road, or QSGD's rounding noise would not average out over ranks."""
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    digests: Dict[str, str] = {}
    for road in ("stock-qsgd", "stock-topkqsgd", "ours-topkqsgd"):
        torch.manual_seed(0)                          # same weights on every rank; a fresh model per road
        model = torch.nn.Linear(64, 64, bias=False)   # (Horovod's hooks stay on the parameters it wrapped)
        comp = gc.QSGD(bits=4, seed=7) if road.endswith("-qsgd") else gc.TopKQSGD(ratio=0.5, bits=4, seed=7)
        real = comp.compress_carried   # compress_named's too

        def spy(name, grad, relay=False, _real=real, _road=road):  # what this rank puts on the wire
            payload, carried = _real(name, grad, relay)
            digests.setdefault(_road, _digest(payload))
            return payload, carried

        comp.compress_carried = spy
        wrap = hvd.DistributedOptimizer if road.startswith("stock") else gc.DistributedOptimizer
        opt = wrap(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                   compression=comp)
        model(x).pow(2).mean().backward()
        opt.synchronize()
    direct = gc.QSGD(bits=4, seed=7)
    payload, _ = direct.compress(torch.ones(4096) * 0.3, name="w")
    digests["direct"] = _digest(payload)
    return {"digests": digests}
