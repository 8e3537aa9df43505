"""Rank side of tests/test_ddp.py: ``python -m torch.distributed.run ... tests/ddp_workers.py JOB OUTDIR``.

Every rank runs every scenario of JOB in order and writes ``OUTDIR/rank<r>.json`` (JSON
values the test asserts on). A failing rank prints its traceback and exits at once, so
torchrun stops the other rank instead of letting it wait in a collective.
"""
from __future__ import annotations

import copy
import datetime
import json
import os
import sys
import traceback
import warnings
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hvd_gradcomp as gc  # noqa: E402
from hvd_gradcomp import ddp as gc_ddp  # noqa: E402

BUCKET_MB = 0.01  # ~2,600 float32 per bucket: several buckets, so ordering across buckets is exercised


class Net(nn.Module):
    """Weights above min_compress_numel (compressed), biases and a small head below it (dense)."""

    def __init__(self, unused_branch: bool = False, spare_on: int = -1) -> None:
        super().__init__()
        self.spare_on = spare_on  # the rank whose forward uses the spare layer (-1: none)
        self.fc1 = nn.Linear(32, 64)
        self.fc2 = nn.Linear(64, 64)
        self.fc3 = nn.Linear(64, 48)
        self.head = nn.Linear(48, 10)
        self.spare = nn.Linear(64, 64) if unused_branch else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        h = torch.relu(self.fc2(h))
        if self.spare is not None and self.spare_on == _rank():
            h = h + self.spare(h)
        return self.head(torch.relu(self.fc3(h)))


_as_rank = [None]  # the reference computes other ranks' gradients locally


def register_wrapped(model: nn.Module, comp: Any, opt: torch.optim.Optimizer) -> Any:
    """``model`` in DDP with the test's buckets and ``comp`` registered as its hook, as docs/DDP.md shows:
    (state, optimizer, DDP model), the shape the shared training workers take."""
    ddp_model = DDP(model, bucket_cap_mb=BUCKET_MB)
    return gc_ddp.register(ddp_model, compression=comp, optimizer=opt), opt, ddp_model


def mean_over_ranks(t: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(t)
    return t / dist.get_world_size()


def save_state(state: Any, comp: Any) -> Any:
    return copy.deepcopy(state.state_dict())


def load_state(state: Any, comp: Any, saved: Any) -> None:
    state.load_state_dict(saved)


def _rank() -> int:
    return _as_rank[0] if _as_rank[0] is not None else dist.get_rank()


def make_compression(kind: str, **kw: Any) -> Any:
    seed = kw.pop("seed", 7)
    return {"none": lambda: None, "fp16": lambda: torch.float16,
            "topk": lambda: gc.TopK(seed=seed, **kw), "topkqsgd": lambda: gc.TopKQSGD(seed=seed, **kw),
            "qsgd": lambda: gc.QSGD(seed=seed, **kw)}[kind]()


UPDATE_OPTIMIZERS: Dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "adafactor": lambda ps: torch.optim.Adafactor(ps, lr=1e-2),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=1e-3)}
"""Adaptive optimizers other than Adam/AdamW: feedback='auto' gives them 'update' (issue 61)."""


def batch(rank: int, step: int, n: int = 16) -> Any:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, 32, generator=g), torch.randint(0, 10, (n,), generator=g)


def net(seed: int = 0, **kw: Any) -> Net:
    torch.manual_seed(seed)
    return Net(**kw)


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x), y)


def flat_grads(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


def reference_grad(step: int, world: int, n: int = 16) -> torch.Tensor:
    """The uncompressed average gradient, computed locally from every rank's batch."""
    total = None
    for r in range(world):
        m = net()
        loss_of(m, *batch(r, step, n)).backward()
        g = flat_grads(m)
        total = g if total is None else total + g
    return total / world


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


# ---------------------------------------------------------------- scenarios
def one_step(kind: str, **kw: Any) -> Dict[str, Any]:
    """One exchange of a fresh model: gradient vs the uncompressed reference, and the bytes."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = DDP(net(), bucket_cap_mb=BUCKET_MB)
    state = gc_ddp.register(model, compression=make_compression(kind, **kw))
    loss_of(model, *batch(rank, 0)).backward()
    g = flat_grads(model.module)
    ref = reference_grad(0, world)
    return {"rel": rel(g, ref), "grad": g.tolist(), "bytes": state.last_step_bytes,
            "ratio": state.comm_stats.ratio, "raw": sum(p.numel() * 4 for p in model.parameters())}


def ef_average(kind: str, steps: int, **kw: Any) -> Dict[str, Any]:
    """The same batch every step: with error feedback the mean of what arrives tends to the truth."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = DDP(net(), bucket_cap_mb=BUCKET_MB)
    gc_ddp.register(model, compression=make_compression(kind, **kw))
    first, total = None, None
    for _ in range(steps):
        model.zero_grad()
        loss_of(model, *batch(rank, 0)).backward()
        g = flat_grads(model.module)
        first = g.clone() if first is None else first
        total = g.clone() if total is None else total + g
    ref = reference_grad(0, world)
    return {"rel_first": rel(first, ref), "rel_mean": rel(total / steps, ref)}


def accumulation(kind: str, micro: int = 4, tail: int = 0, **kw: Any) -> Dict[str, Any]:
    """N micro-batches under no_sync (through GradientAccumulator) vs one big batch."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = batch(rank, 5, n=8 * micro)
    big = DDP(net(), bucket_cap_mb=BUCKET_MB)
    gc_ddp.register(big, compression=make_compression(kind, **kw))
    loss_of(big, x, y).backward()
    want = flat_grads(big.module)

    model = DDP(net(), bucket_cap_mb=BUCKET_MB)
    gc_ddp.register(model, compression=make_compression(kind, **kw))
    grads: List[torch.Tensor] = []
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    opt.step = lambda: grads.append(flat_grads(model.module))  # record what the step would apply
    n = micro if not tail else tail
    acc = gc_ddp.GradientAccumulator(model, opt, steps=micro, micro_batch=8)
    for xs, ys in list(zip(x.chunk(micro), y.chunk(micro)))[:n]:
        with acc.accumulate():
            acc.backward(loss_of(model, xs, ys))
    flushed = acc.flush()
    if tail:
        want = reference_of_first(x, y, micro, tail, world, rank)
    return {"rel": rel(grads[0], want), "steps": acc.optimizer_steps, "flushed": flushed}


def accumulation_clipped(micro: int = 2, steps: int = 3, max_norm: float = 0.05, optimizer: str = "adamw"
                         ) -> Dict[str, Any]:
    """gc_ddp.GradientAccumulator(max_grad_norm=...) against the loop written out (no_sync, clip,
    step), TopKQSGD with AdamW (frozen, in its dense warm-up): the same parameters bit for bit and
    the same norms. With SGD with momentum (momentum correction) the accumulator refuses when built:
    the message is returned."""
    rank = dist.get_rank()

    def build():
        model = DDP(net(), bucket_cap_mb=BUCKET_MB)
        opt = (torch.optim.AdamW(model.parameters(), lr=1e-2) if optimizer == "adamw"
               else torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9))
        gc_ddp.register(model, compression=make_compression("topkqsgd", ratio=0.25, seed=5), optimizer=opt)
        return model, opt

    model, opt = build()
    if optimizer == "sgd":
        at = "construction"   # register() came first: the policy is known when the accumulator is built
        try:
            acc = gc_ddp.GradientAccumulator(model, opt, steps=micro, max_grad_norm=max_norm)
            at = "step"
            for i in range(micro):
                with acc.accumulate():
                    acc.backward(loss_of(model, *batch(rank, i)))
        except ValueError as err:
            return {"refused": str(err), "at": at}
        return {"refused": None}
    acc = gc_ddp.GradientAccumulator(model, opt, steps=micro, max_grad_norm=max_norm)
    norms = []
    for step in range(steps):
        for i in range(micro):
            with acc.accumulate():
                acc.backward(loss_of(model, *batch(rank, 10 * step + i)))
        norms.append(float(acc.last_grad_norm))
    ref, ref_opt = build()
    ref_norms = []
    for step in range(steps):
        for i in range(micro):
            with ref.no_sync() if i + 1 < micro else nullcontext():
                (loss_of(ref, *batch(rank, 10 * step + i)) / micro).backward()
        ref_norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)))
        ref_opt.step()
        ref_opt.zero_grad()
    return {"identical": all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters())),
            "norms": norms, "ref_norms": ref_norms}


def reference_of_first(x, y, micro, tail, world, rank) -> torch.Tensor:
    """Average over ranks of the mean gradient of the first ``tail`` micro-batches (uncompressed)."""
    m = net()
    xs, ys = x.chunk(micro), y.chunk(micro)
    for i in range(tail):
        loss_of(m, xs[i], ys[i]).backward()
    g = flat_grads(m) / tail
    dist.all_reduce(g)
    return g / world


def raw_no_sync(micro: int = 4) -> Dict[str, Any]:
    """model.no_sync() written by hand, as in torch's docs, with our hook registered (uncompressed)."""
    rank = dist.get_rank()
    x, y = batch(rank, 6, n=8 * micro)
    big = DDP(net(), bucket_cap_mb=BUCKET_MB)
    gc_ddp.register(big, compression=None)
    loss_of(big, x, y).backward()
    model = DDP(net(), bucket_cap_mb=BUCKET_MB)
    state = gc_ddp.register(model, compression=None)
    pairs = list(zip(x.chunk(micro), y.chunk(micro)))
    with model.no_sync():
        for xs, ys in pairs[:-1]:
            (loss_of(model, xs, ys) / micro).backward()
    (loss_of(model, *pairs[-1]) / micro).backward()
    return {"rel": rel(flat_grads(model.module), flat_grads(big.module)), "exchanges": state.iter}


def train(model: DDP, state: Any, opt: torch.optim.Optimizer, steps: range, extra=None, sched=None) -> None:
    rank = dist.get_rank()
    for step in steps:
        opt.zero_grad()
        loss_of(model, *batch(rank, step)).backward()
        opt.step()
        if sched is not None:
            sched.step()


def checkpoint(kind: str, ckpt: str, bind: bool = False, adamw: bool = False, schedule: bool = False,
               optimizer: str = "", all_ranks: bool = False, **kw: Any) -> Dict[str, Any]:
    """6 steps straight vs 3 steps, save, fresh DDP + state + optimizer, load, 3 steps: bit-identical.
    ``bind``: the optimizer goes to register() (momentum correction: velocities are checkpointed too).
    ``adamw``: AdamW with FrozenVariance(warmup=2), so the checkpoint falls in the frozen phase.
    ``optimizer``: one of :data:`UPDATE_OPTIMIZERS` instead (feedback 'update': each rank's private
    optimizers are checkpointed too). ``all_ranks``: one file, written by rank 0, of
    ``state.state_dict(all_ranks=True)``, which every rank loads.
    ``schedule``: a rate that changes every step (the policy must read the param groups that the
    optimizer's load_state_dict put in place, not those register() saw)."""
    rank = dist.get_rank()

    def fresh():
        model = DDP(net(), bucket_cap_mb=BUCKET_MB)
        opt = (torch.optim.AdamW(model.parameters(), lr=1e-2) if adamw
               else UPDATE_OPTIMIZERS[optimizer](model.parameters()) if optimizer
               else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        extra = {"feedback": gc.FrozenVariance(warmup=2)} if adamw else {}
        state = gc_ddp.register(model, compression=make_compression(kind, seed=11, **kw, **extra),
                                optimizer=opt if bind or optimizer else None)
        sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.7) if schedule else None
        return model, state, opt, sched

    model, state, opt, sched = fresh()
    train(model, state, opt, range(6), sched=sched)
    straight = torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    model, state, opt, sched = fresh()
    train(model, state, opt, range(3), sched=sched)
    path = Path(ckpt) / (f"rank{rank}.pt" if not all_ranks else "rank0-only.pt")
    hook = state.state_dict(all_ranks=True) if all_ranks else state.state_dict()   # all_ranks: on every rank
    if not all_ranks or rank == 0:
        torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "hook": hook,
                    "sched": sched.state_dict() if sched is not None else None}, path)
    if all_ranks:
        dist.barrier()
    feedback = state.compression.feedback.key if isinstance(state.compression, gc.GradientCompressor) else None
    model, state, opt, sched = fresh()
    saved = torch.load(path, weights_only=False)
    model.module.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    state.load_state_dict(saved["hook"])
    if sched is not None:
        sched.load_state_dict(saved["sched"])
    train(model, state, opt, range(3, 6), sched=sched)
    resumed = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {"identical": bool(torch.equal(straight, resumed)), "max_diff": float((straight - resumed).abs().max()),
            "params": resumed.tolist(), "feedback": feedback}


def clipped_warmup(steps: int = 9, scale: float = 0.5) -> Dict[str, Any]:
    """AdamW under TopKQSGD with FrozenVariance(warmup=6, window=4) twice: as is, and with every
    gradient scaled by ``scale`` before opt.step() (what clip_grad_norm_ does). Returns the largest
    relative difference of the frozen denominators (v is frozen from the gradients as exchanged),
    the RuntimeWarnings of each run, and, at the last (compressed) step, the largest |p.grad| of
    the compressed weights (zeros: the update direction is kept apart, not left for a clip to see)
    and whether they still moved."""
    rank = dist.get_rank()

    def run(s: float):
        model = DDP(net(), bucket_cap_mb=BUCKET_MB)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        comp = gc.TopKQSGD(ratio=0.25, bits=8, seed=1, feedback=gc.FrozenVariance(warmup=6, window=4))
        gc_ddp.register(model, compression=comp, optimizer=opt)
        weights = [model.module.fc1.weight, model.module.fc2.weight]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(steps):
                opt.zero_grad()
                loss_of(model, *batch(rank, step)).backward()
                for p in model.parameters():
                    p.grad.mul_(s)
                before = [w.detach().clone() for w in weights]
                seen = max(float(w.grad.abs().max()) for w in weights)
                opt.step()
        moved = min(float((w.detach() - b).abs().max()) for w, b in zip(weights, before))
        return (dict(comp.feedback.denom), [str(w.message) for w in caught if w.category is RuntimeWarning],
                seen, moved)

    plain, plain_warned, seen, moved = run(1.0)
    scaled, scaled_warned, _, _ = run(scale)
    return {"names": sorted(plain), "rel": max(float(((scaled[n] - plain[n]) / plain[n]).abs().max()) for n in plain),
            "plain_warned": plain_warned, "scaled_warned": scaled_warned, "grad_seen": seen, "moved": moved}


def scaled_averages(steps: int = 6) -> Dict[str, Any]:
    """Momentum SGD under TopKQSGD(25%, 8) (momentum correction) in the DDP hook, the gradients
    before opt.step(): left alone, clipped (clip_grad_norm_), or scaled by a power of two (a loss
    scaler's unscale_). Per variant: the RuntimeWarnings about scaled averages and the count."""
    rank = dist.get_rank()
    out: Dict[str, Any] = {}
    for label in ("none", "clip", "unscale"):
        model = DDP(net(), bucket_cap_mb=BUCKET_MB)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        comp = gc.TopKQSGD(ratio=0.25, bits=8, seed=1)
        gc_ddp.register(model, compression=comp, optimizer=opt)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(steps):
                opt.zero_grad()
                loss_of(model, *batch(rank, step)).backward()
                if label == "clip":
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
                elif label == "unscale":
                    for p in model.parameters():
                        p.grad.mul_(0.5)
                opt.step()
        out[label] = {"warned": [str(w.message) for w in caught if "scaled by" in str(w.message)],
                      "count": comp.scaled_after_exchange, "feedback": comp.feedback.key}
    return out


def ddp_options(kind: str, **kw: Any) -> Dict[str, Any]:
    """find_unused_parameters, frozen parameters and static_graph, 3 steps each, vs uncompressed."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out: Dict[str, Any] = {}
    for label, build in {
        "unused": lambda: DDP(net(unused_branch=True), bucket_cap_mb=BUCKET_MB, find_unused_parameters=True),
        "frozen": lambda: DDP(_frozen(net()), bucket_cap_mb=BUCKET_MB),
        "static": lambda: DDP(net(), bucket_cap_mb=BUCKET_MB, static_graph=True),
        "unused_on_one_rank": lambda: DDP(net(unused_branch=True, spare_on=0), bucket_cap_mb=BUCKET_MB,
                                          find_unused_parameters=True),
    }.items():
        model = build()
        state = gc_ddp.register(model, compression=make_compression(kind, **kw))
        rels = []
        for step in range(3):
            model.zero_grad()
            loss_of(model, *batch(rank, step)).backward()
            g = flat_grads(model.module)
            ref_model = net(unused_branch=label.startswith("unused"), spare_on=0 if label == "unused_on_one_rank" else -1)
            if label == "frozen":
                _frozen(ref_model)
            total = None
            for r in range(world):
                ref_model.zero_grad()
                _as_rank[0] = r
                loss_of(ref_model, *batch(r, step)).backward()
                _as_rank[0] = None
                rg = _grads_like(ref_model, model.module)
                total = rg if total is None else total + rg
            rels.append(rel(g, total / world))
        out[label] = {"rels": rels, "grad": g.tolist(), "exchanges": state.iter,
                      "frozen_grad_none": model.module.fc1.weight.grad is None if label == "frozen" else None,
                      "spare_grad": (None if model.module.spare is None or model.module.spare.weight.grad is None
                                     else float(model.module.spare.weight.grad.abs().sum()))}
    return out


def _grads_like(ref: nn.Module, model: nn.Module) -> torch.Tensor:
    """ref's gradients for the parameters that have one in ``model`` (zeros where ref has none)."""
    return torch.cat([(q.grad if q.grad is not None else torch.zeros_like(q)).reshape(-1)
                      for p, q in zip(model.parameters(), ref.parameters()) if p.grad is not None])


def _frozen(m: Net) -> Net:
    for p in m.fc1.parameters():
        p.requires_grad_(False)
    return m


def nonfinite(kind: str, bind: bool = False, optimizer: str = "", **kw: Any) -> Dict[str, Any]:
    """Rank 1 has an Inf in its loss: every rank gets a non-finite gradient and nobody hangs.
    ``bind``: SGD(momentum) given to register(), so momentum correction runs (its velocity is kept
    only for what was sent: rank 1 keeps none from the bad step). ``optimizer``: one of
    :data:`UPDATE_OPTIMIZERS` given to register() instead (feedback 'update': rank 1 steps none of
    its private optimizers on the bad step)."""
    rank = dist.get_rank()
    model = DDP(net(), bucket_cap_mb=BUCKET_MB)
    opt = UPDATE_OPTIMIZERS[optimizer](model.parameters()) if optimizer else \
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = gc_ddp.register(model, compression=make_compression(kind, **kw),
                            optimizer=opt if bind or optimizer else None)
    loss = loss_of(model, *batch(rank, 0))
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        (loss * (float("inf") if rank == 1 else 1.0)).backward()
    bad = not bool(torch.isfinite(flat_grads(model.module)).all())
    feedback = state.compression.feedback
    kept = {"velocities": len(getattr(feedback, "velocity", {})), "residuals": len(feedback.residuals._residuals)}
    stepped = _private_steps(feedback)
    model.zero_grad()
    loss_of(model, *batch(rank, 1)).backward()  # the next step is fine again
    return {"nonfinite": bad, "count": state.nonfinite_exchanges, "kept_after_bad": kept,
            "next_finite": bool(torch.isfinite(flat_grads(model.module)).all()), "feedback": feedback.key,
            "private_after_bad": stepped, "private_after_next": _private_steps(feedback)}


def _private_steps(feedback: Any) -> Dict[str, int]:
    """feedback 'update': the steps each private optimizer took, by parameter name (none: {})."""
    return {name: int(o.state[o.param_groups[0]["params"][0]]["step"])
            for name, o in sorted(getattr(feedback, "_local", {}).items())}


def transport() -> Dict[str, Any]:
    """hvd_gradcomp.collectives.transport.TorchTransport on the default group: the exchanges' asynchronous
    allreduce (average and sum) and Auto's blocking collectives."""
    from hvd_gradcomp.collectives.transport import TorchTransport
    rank, world = dist.get_rank(), dist.get_world_size()
    t = TorchTransport(None, world)
    avg, total = t.allreduce(torch.tensor([1.0 + rank, 10.0]), "x", average=True), \
        t.allreduce(torch.tensor([1.0 + rank]), "y", average=False)
    probe = torch.full((4,), float(rank))
    t.probe_allreduce(probe, "p")
    t.probe_allgather(torch.ones(3, dtype=torch.uint8), "g")   # returns once done; nothing to read
    return {"rank": t.rank, "size": t.size, "average": avg.wait().tolist(), "average_again": avg.wait().tolist(),
            "sum": total.wait().tolist(), "mean": t.mean(torch.tensor([2.0 * rank], dtype=torch.float64), "m").tolist(),
            "broadcast": t.broadcast(torch.tensor([rank + 5]), "b").tolist(), "probe": probe.tolist()}


def errors() -> Dict[str, Any]:
    """Bad arguments: each gives a clear error."""
    out: Dict[str, Any] = {}

    def catch(label: str, fn: Callable[[], Any]) -> None:
        try:
            fn()
            out[label] = "no error"
        except (ValueError, TypeError, RuntimeError) as err:
            out[label] = f"{type(err).__name__}: {err}"

    model = DDP(net(), bucket_cap_mb=BUCKET_MB)
    catch("not_ddp", lambda: gc_ddp.register(net()))
    catch("bad_compression", lambda: gc_ddp.register(model, compression="topk"))
    catch("class_compression", lambda: gc_ddp.register(model, compression=gc.TopKQSGD))
    catch("bad_start", lambda: gc_ddp.GradCompState(None, None, start_compress_iter=-1))
    catch("no_names", lambda: gc_ddp.GradCompState(None, gc.TopK()))
    shared = gc.TopK()
    gc_ddp.GradCompState(None, shared, named_parameters=model.module.named_parameters())
    catch("shared", lambda: gc_ddp.GradCompState(None, shared, named_parameters=model.module.named_parameters()))
    state = gc_ddp.GradCompState(None, gc.QSGD(), named_parameters=model.module.named_parameters())
    sd = state.state_dict()
    catch("wrong_rank", lambda: state.load_state_dict({**sd, "rank": 1 - sd["rank"]}))
    catch("wrong_kind", lambda: state.load_state_dict({**sd, "compressor": "TopK"}))
    catch("acc_steps", lambda: gc_ddp.GradientAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), 0))
    acc = gc_ddp.GradientAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), 2)
    catch("acc_outside", lambda: acc.backward(loss_of(model, *batch(0, 0))))
    catch("update_without_optimizer", lambda: gc_ddp.register(model, compression=gc.TopK(feedback="update")))
    catch("momentum_without_optimizer", lambda: gc_ddp.register(model, compression=gc.TopK(feedback="momentum")))
    catch("frozen_without_optimizer", lambda: gc_ddp.register(model, compression=gc.TopK(feedback="frozen")))
    other = torch.optim.SGD(net().parameters(), lr=0.1)
    catch("foreign_optimizer", lambda: gc_ddp.register(model, compression=gc.TopK(), optimizer=other))
    return out


def momentum(steps: int = 5) -> Dict[str, Any]:
    """register(..., optimizer=): the feedback policy chosen per optimizer; and SGD(momentum) with momentum
    correction at ratio 1 (nothing dropped) trains exactly as uncompressed DDP: what the hook hands SGD
    makes SGD's momentum buffer the averaged velocity, not momentum applied twice."""
    rank = dist.get_rank()

    def run(compression: Any, make_opt: Callable[[Any], torch.optim.Optimizer], bind: bool) -> Any:
        model = DDP(net(), bucket_cap_mb=BUCKET_MB)
        opt = make_opt(model.parameters())
        state = gc_ddp.register(model, compression=compression, optimizer=opt if bind else None)
        for step in range(steps):
            opt.zero_grad()
            loss_of(model, *batch(rank, step)).backward()
            opt.step()
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), state

    sgd_m = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True)  # noqa: E731
    ref, _ = run(None, sgd_m, False)
    exact, st = run(gc.TopK(ratio=1.0, exempt="fp32"), sgd_m, True)
    sparse_mc, st_mc = run(gc.TopKQSGD(ratio=0.05, seed=3), sgd_m, True)
    sparse_classic, _ = run(gc.TopKQSGD(ratio=0.05, seed=3), sgd_m, False)
    policies = {"sgd-momentum": st.compression.feedback.key}
    for label, make_opt, bind in (("sgd", lambda ps: torch.optim.SGD(ps, lr=0.1), True),
                                  ("adamw", lambda ps: torch.optim.AdamW(ps, lr=1e-3), True),
                                  ("no-optimizer", sgd_m, False)):
        policies[label] = run(gc.TopK(ratio=0.5), make_opt, bind)[1].compression.feedback.key
    for bits in (8, 4, 2):   # a dense codec's choice, with and without optimizer=
        for label, bind in (("", True), ("-no-optimizer", False)):
            policies[f"qsgd{bits}{label}"] = run(gc.QSGD(bits=bits), sgd_m, bind)[1].compression.feedback.key
    return {"policies": policies, "rel_exact": rel(exact, ref), "rel_mc": rel(sparse_mc, ref),
            "rel_classic": rel(sparse_classic, ref), "velocities": len(st_mc.compression.feedback.velocity)}


class _Branchy(nn.Module):
    """A layer (``spare``, compressed) used on some steps only; ``zeroed``: used every step but times 0
    where it would be skipped (every gradient of it exactly zero there, the rest of the model unchanged)."""

    def __init__(self, zeroed: bool) -> None:
        super().__init__()
        self.zeroed = zeroed
        # no bias: a skipped dense parameter is plain DDP (no gradient, not stepped) in both runs alike
        self.fc1, self.spare, self.head = nn.Linear(32, 64), nn.Linear(64, 64, bias=False), nn.Linear(64, 10)

    def forward(self, x: torch.Tensor, use: bool) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        if use:
            h = h + self.spare(h)
        elif self.zeroed:
            h = h + 0.0 * self.spare(h)
        return self.head(h)


def intermittent(steps: int = 8, bind: bool = True) -> Dict[str, Any]:
    """Momentum SGD through TopKQSGD(5%) (momentum correction) with a layer that every rank skips on odd
    steps (find_unused_parameters=True: DDP leaves its gradient None there), against the same layer used
    but multiplied by 0 on those steps (its gradient zero, delivered). The hook's exchange ran on both;
    with the optimizer bound, the skipped layer gets the exchange's average as its gradient (as on the
    Horovod road), so both runs must end bit-identical."""
    rank = dist.get_rank()

    def run(zeroed: bool) -> Tuple[torch.Tensor, Any, List[str]]:
        torch.manual_seed(0)
        model = DDP(_Branchy(zeroed), bucket_cap_mb=BUCKET_MB, find_unused_parameters=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        state = gc_ddp.register(model, compression=gc.TopKQSGD(ratio=0.05, seed=3), optimizer=opt if bind else None)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(steps):
                opt.zero_grad()
                x, y = batch(rank, step)
                loss_of_use = nn.functional.cross_entropy(model(x, step % 2 == 0), y)
                loss_of_use.backward()
                opt.step()
        said = [str(w.message) for w in caught if "got no gradient from DDP" in str(w.message)]
        return torch.cat([q.detach().reshape(-1) for q in model.parameters()]), state, said

    skipped, st, said = run(False)
    zeroed, _, _ = run(True)
    return {"policy": st.compression.feedback.key, "max_diff": float((skipped - zeroed).abs().max()),
            "finite": bool(torch.isfinite(skipped).all()), "said": said, "params": skipped.tolist()}


def optimizer_over_part(steps: int = 3, optimizer: str = "adamw") -> Dict[str, Any]:
    """AdamW over fc3 and the head only, TopKQSGD(5%) ("frozen"): DDP still averages fc1 and fc2, which
    the policy cannot compress without their Adam state; they go uncompressed (before: a RuntimeError at
    the first exchange). Then they join the optimizer (add_param_group): bound before their next exchange.
    ``optimizer``: one of :data:`UPDATE_OPTIMIZERS` instead ("update": no private optimizer for them)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = DDP(net(), bucket_cap_mb=BUCKET_MB)
    make = UPDATE_OPTIMIZERS.get(optimizer, lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    opt = make(list(model.module.fc3.parameters()) + list(model.module.head.parameters()))
    state = gc_ddp.register(model, compression=gc.TopKQSGD(ratio=0.05, seed=3), optimizer=opt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rels = []
        for step in range(steps):
            opt.zero_grad()
            model.zero_grad()
            loss_of(model, *batch(rank, step)).backward()
            if step == 0:   # the parameters are still the initial ones: the reference applies
                rels.append(rel(model.module.fc1.weight.grad.reshape(-1), reference_grad(0, world)[:32 * 64]))
            opt.step()
        said = [str(w.message) for w in caught if "not in the optimizer passed to register()" in str(w.message)]
        # progressive unfreezing: fc1 and fc2 join the optimizer; the policy binds them before their next
        # exchange, which then no longer sends them uncompressed for want of their Adam state
        feedback = state.compression.feedback
        outside = [feedback.needs_optimizer_state("fc1.weight")]
        opt.add_param_group({"params": list(model.module.fc1.parameters()) + list(model.module.fc2.parameters())})
        for step in range(steps, steps + 2):
            opt.zero_grad()
            loss_of(model, *batch(rank, step)).backward()
            outside.append(feedback.needs_optimizer_state("fc1.weight"))
            opt.step()
    return {"policy": feedback.key, "fc1_rel": rels[0], "said": said, "outside": outside,
            "fc1_steps": int(opt.state[model.module.fc1.weight]["step"]),
            "params": torch.cat([q.detach().reshape(-1) for q in model.parameters()]).tolist()}


def frozen(steps: int = 6, warmup: int = 2) -> Dict[str, Any]:
    """AdamW through the hook with feedback='frozen' at ratio 1 (nothing dropped): exact AdamW for the
    dense warm-up, then AdamW with v frozen, written out here from each rank's gradients (its
    momentum, its step lengthened by sqrt(s_freeze / s_t) where that is above 1, s its own gradients'
    mean square averaged over the policy's window, each coordinate's step at most 1/sqrt(1 - b2); the
    compressed weights) and plain AdamW (the small tensors, always dense)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    opts = dict(lr=1e-2, weight_decay=0.1)
    model = DDP(net(), bucket_cap_mb=BUCKET_MB)
    opt = torch.optim.AdamW(model.parameters(), **opts)
    policy = gc.FrozenVariance(warmup=warmup, momentum=True)   # the reference below keeps Adam's momentum
    state = gc_ddp.register(model, compression=gc.TopK(ratio=1.0, feedback=policy, exempt="fp32"), optimizer=opt)
    zero_grads, sent_bytes = [], []
    for step in range(steps):
        opt.zero_grad()
        loss_of(model, *batch(rank, step)).backward()
        sent_bytes.append(state.last_step_bytes)
        opt.step()
        zero_grads.append(all(int(torch.count_nonzero(model.module.get_parameter(n).grad)) == 0
                              for n in ("fc1.weight", "fc2.weight", "fc3.weight")))
    got = torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    ref = net()
    adamw = torch.optim.AdamW(ref.parameters(), **opts)
    b1, b2 = adamw.param_groups[0]["betas"]
    eps, lr, wd = adamw.param_groups[0]["eps"], opts["lr"], opts["weight_decay"]
    big = [p for p in ref.parameters() if p.numel() >= gc_ddp.DEFAULT_MIN_COMPRESS_NUMEL]
    frozen_state: Dict[torch.Tensor, Any] = {}
    scale: Dict[Tuple[torch.Tensor, int], torch.Tensor] = {}   # (parameter, rank): mean-square average
    for t in range(1, steps + 1):
        local = []
        for r in range(world):
            ref.zero_grad()
            loss_of(ref, *batch(r, t - 1)).backward()
            local.append({p: p.grad.clone() for p in ref.parameters()})
        for p in ref.parameters():
            p.grad = sum(g[p] for g in local) / world
            if t > warmup and any(p is b for b in big) and p not in frozen_state:   # frozen before this step
                st = adamw.state[p]
                root = (st["exp_avg_sq"] / (1 - b2 ** warmup)).sqrt()
                frozen_state[p] = [root.clamp(min=0.1 * root.mean().item()) + eps,
                                   [st["exp_avg"].clone() for _ in range(world)],
                                   [scale[p, r] for r in range(world)]]
            for r in range(world):
                ms = local[r][p].pow(2).mean()
                scale[p, r] = ms if (p, r) not in scale else torch.lerp(scale[p, r], ms, 1 / policy.window)
        if t > warmup:
            for p in big:
                denom, us, at_freeze = frozen_state[p]
                sent = 0
                for r in range(world):
                    us[r].mul_(b1).add_(local[r][p], alpha=1 - b1)
                    step = us[r] / denom * (at_freeze[r] / scale[p, r]).clamp(min=1.0).sqrt()
                    sent = sent + step.clamp(-(1 - b2) ** -0.5, (1 - b2) ** -0.5)   # Adam's bound per gradient
                with torch.no_grad():
                    p.mul_(1 - lr * wd).sub_(lr / (1 - b1 ** t) * sent / world)
                p.grad = None   # AdamW steps only the small tensors from here on
        adamw.step()
    want = torch.cat([p.detach().reshape(-1) for p in ref.parameters()])
    return {"policy": state.compression.feedback.key, "rel": rel(got, want), "zero_grads": zero_grads,
            "sent_bytes": sent_bytes, "raw_bytes": sum(p.numel() * 4 for p in model.parameters())}


def update(optimizer: str, steps: int = 5, ratio: float = 0.1) -> Dict[str, Any]:
    """feedback='auto' with an adaptive optimizer other than Adam/AdamW: 'update' in the hook, as on the
    Horovod roads (issue 61). ``TopK(ratio, exempt="fp32")`` through it against the arithmetic written
    out here from every rank's gradients: each rank steps its own copy of the optimizer on its local
    gradient, the top-k of that change plus its residual goes out, the average of what went out is
    added to the parameter; the wrapped optimizer steps the small tensors (dense, float32) on their
    average and leaves the compressed ones alone (their gradient is zero at its step)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    make = UPDATE_OPTIMIZERS[optimizer]
    policies = {}
    for name, other in UPDATE_OPTIMIZERS.items():   # the README's compressor, the library's choice
        m = DDP(net(), bucket_cap_mb=BUCKET_MB)
        policies[name] = gc_ddp.register(m, compression=gc.TopKQSGD(ratio=0.01, bits=8, seed=3),
                                         optimizer=other(m.parameters())).compression.feedback.key
    model = DDP(net(), bucket_cap_mb=BUCKET_MB)
    opt = make(model.parameters())
    comp = gc.TopK(ratio=ratio, exempt="fp32", seed=5)
    state = gc_ddp.register(model, compression=comp, optimizer=opt)
    big = [n for n, p in model.module.named_parameters() if p.numel() >= gc_ddp.DEFAULT_MIN_COMPRESS_NUMEL]
    zero_grads, moved_before_step = [], []
    for step in range(steps):
        opt.zero_grad()
        before = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()
        loss_of(model, *batch(rank, step)).backward()
        moved_before_step.append(not torch.equal(before, torch.cat([p.detach().reshape(-1) for p in model.parameters()])))
        zero_grads.append(all(int(torch.count_nonzero(model.module.get_parameter(n).grad)) == 0 for n in big))
        opt.step()
    got = torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    ref = net()
    ref_opt = make(ref.parameters())
    private: Dict[Tuple[str, int], torch.optim.Optimizer] = {}
    residual: Dict[Tuple[str, int], torch.Tensor] = {}
    for t in range(steps):
        local = []
        for r in range(world):
            ref.zero_grad()
            loss_of(ref, *batch(r, t)).backward()
            local.append({n: p.grad.clone() for n, p in ref.named_parameters()})
        for n, p in ref.named_parameters():
            if n not in big:
                p.grad = sum(g[n] for g in local) / world
                continue
            total = torch.zeros(p.numel())
            for r in range(world):
                if (n, r) not in private:
                    private[n, r] = make([torch.zeros_like(p)])
                shadow = private[n, r].param_groups[0]["params"][0]
                with torch.no_grad():
                    shadow.copy_(p)
                shadow.grad = local[r][n]
                private[n, r].step()
                acc = (shadow.detach() - p.detach()).reshape(-1) + residual.get((n, r), torch.zeros(p.numel()))
                top = acc.abs().topk(comp.selected(acc.numel())).indices
                sent = torch.zeros_like(acc)
                sent[top] = acc[top]
                residual[n, r] = acc - sent
                total += sent
            with torch.no_grad():
                p.add_((total / world).view_as(p))
            p.grad = None   # the wrapped optimizer does not step it
        ref_opt.step()
    want = torch.cat([p.detach().reshape(-1) for p in ref.parameters()])
    start = torch.cat([p.detach().reshape(-1) for p in net().parameters()])
    return {"policies": policies, "feedback": state.compression.feedback.key, "rel": rel(got, want),
            "moved": rel(got, start), "zero_grads": zero_grads, "moved_before_step": moved_before_step,
            "params": got.tolist(), "private": _private_steps(state.compression.feedback)}


SMALL_VALUES = [1e6, -3e5, 70000.0, 1.0, -0.25, 1e-3, 3e-5, 1e-7, -2e-9, 0.0]


class Chosen(nn.Module):
    """Parameters whose gradients are chosen: d(loss)/d(small) = c, d(loss)/d(big) = d."""

    def __init__(self, big: bool) -> None:
        super().__init__()
        self.small = nn.Parameter(torch.zeros(len(SMALL_VALUES)))
        self.big = nn.Parameter(torch.zeros(2048)) if big else None

    def forward(self, c: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        loss = (self.small * c).sum()
        return loss if self.big is None else loss + (self.big * d).sum()


def exempt(steps: int = 4) -> Dict[str, Any]:
    """Issue 9: a 10-value parameter (under min_compress_numel: exempt="fp16") with chosen gradients,
    from beyond float16's range to below its resolution, in a bucket beside a compressed one
    (``mixed``) and in a bucket of its own (``alone``, nothing compressed), ``steps`` steps and then
    one where rank 1's gradient holds NaN and Inf. Returns: the first average against float16
    arithmetic done here, identical on every rank, what arrived plus what the ranks still owe
    against the sum of the true averages, the bytes counted; and on the NaN step, where the
    average is non-finite and whether this rank's residual stayed as it was. Then the Net of the
    other scenarios, one exchange: its biases and head, bit-exact float16 arithmetic."""
    rank, world = dist.get_rank(), dist.get_world_size()
    bound = gc.feedback.kernels.half_bound(world)
    out: Dict[str, Any] = {}
    for label in ("mixed", "alone"):
        model = DDP(Chosen(big=label == "mixed"))   # one bucket
        comp = gc.TopKQSGD(ratio=0.05, seed=3)
        state = gc_ddp.register(model, compression=comp)
        d = torch.randn(2048, generator=torch.Generator().manual_seed(rank))
        got = torch.zeros(len(SMALL_VALUES), dtype=torch.float64)
        true, tol, identical, first_exact, owed = None, None, True, None, None
        for step in range(steps + 1):
            c = torch.tensor(SMALL_VALUES) * (1 + rank) * (1 + 0.1 * step)
            if step == steps and rank == 1:
                c[3], c[4] = float("nan"), float("inf")
            before = comp.half_residuals.residual("small")
            before = None if before is None else before.clone()
            model.zero_grad()
            with warnings.catch_warnings(record=True):
                warnings.simplefilter("always")
                model(c, d).backward()
            avg = model.module.small.grad.detach().double().clone()
            every = [torch.empty_like(avg) for _ in range(world)]
            dist.all_gather(every, torch.nan_to_num(avg, nan=7.0, posinf=8.0, neginf=9.0))
            identical = identical and all(torch.equal(every[0], e) for e in every)
            if step == steps:
                out[label] = {"identical": identical, "first_exact": first_exact,
                              "err_over_tol": float(((got + owed - true).abs() / tol).max()),
                              "owed_max": float(owed.abs().max()), "received_finite": bool(torch.isfinite(got).all()),
                              "nonfinite_where": [i for i in range(len(SMALL_VALUES)) if not torch.isfinite(avg[i])],
                              "residual_kept": bool(torch.equal(before, comp.half_residuals.residual("small"))),
                              "bytes": state.comm_stats.per_tensor["exempt.fp16"][:2],
                              "dense_bytes": state.comm_stats.per_tensor.get("dense", [0, 0])[1],
                              "compressed": sorted(n for n in state.comm_stats.per_tensor if n in ("big", "small"))}
                break
            if step == 0:   # float16 arithmetic here: each rank's cast, then the float16 sum
                halves = [torch.empty(len(SMALL_VALUES)) for _ in range(world)]
                dist.all_gather(halves, (c / world).clamp(-bound, bound).half().float())
                s16 = halves[0].half()
                for h in halves[1:]:
                    s16 = s16 + h.half()
                first_exact = bool(torch.equal(avg.float(), s16.float()))
            true_avg = c.double()
            dist.all_reduce(true_avg)
            true_avg /= world
            got += avg
            true = true_avg if true is None else true + true_avg
            # the float16 sum rounds once (2**-11 of the value, 2**-25 below the normal range) and the
            # float32 residuals once a step (2**-24 of their size)
            step_tol = avg.abs() * 2 ** -10 + world * 2 ** -23 + true_avg.abs() * (step + 1) * 2 ** -22
            tol = step_tol if tol is None else tol + step_tol
            owed = comp.half_residuals.residual("small").double().reshape(-1).clone()
            dist.all_reduce(owed)
            owed /= world
    model = DDP(net(), bucket_cap_mb=BUCKET_MB)
    state = gc_ddp.register(model, compression=gc.TopKQSGD(ratio=0.05, seed=3))
    loss_of(model, *batch(rank, 0)).backward()
    small = [n for n, p in model.module.named_parameters() if p.numel() < gc_ddp.DEFAULT_MIN_COMPRESS_NUMEL]
    want = {}
    for r in range(world):   # each rank's gradient, computed here: cast, summed in float16
        m = net()
        loss_of(m, *batch(r, 0)).backward()
        for n in small:
            h = (m.get_parameter(n).grad / world).clamp(-bound, bound).half()
            want[n] = h if n not in want else want[n] + h
    out["net"] = {"exact": all(torch.equal(model.module.get_parameter(n).grad, want[n].float()) for n in small),
                  "bytes": state.comm_stats.per_tensor["exempt.fp16"][:2],
                  "small_numel": sum(model.module.get_parameter(n).numel() for n in small)}
    return out


def min_ratio(steps: int = 3) -> Dict[str, Any]:
    """TopKQSGD(0.1%) with ``min_ratio`` naming fc2's weight, under momentum correction: the bytes
    each weight sent per step (fc2 at 25%, the others at min_k), and the parameters after training."""
    rank = dist.get_rank()
    model = DDP(net(), bucket_cap_mb=BUCKET_MB)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    comp = gc.TopKQSGD(ratio=0.001, bits=8, min_ratio={r"^fc2\.weight$": 0.25},
                       feedback=gc.MomentumCorrection(sparsity_warmup=0))
    gc_ddp.register(model, compression=comp, optimizer=opt)
    for step in range(steps):
        opt.zero_grad()
        loss_of(model, *batch(rank, step)).backward()
        opt.step()
    return {"bytes": {n: b[1] // steps for n, b in comp.stats.per_tensor.items() if n.endswith(".weight")},
            "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()}


def die(after: int) -> Dict[str, Any]:
    """Rank 1 exits abruptly in the middle of training; the job must end non-zero, soon."""
    rank = dist.get_rank()
    model = DDP(net(), bucket_cap_mb=BUCKET_MB)
    gc_ddp.register(model, compression=gc.TopKQSGD(ratio=0.05))
    for step in range(1000):
        if rank == 1 and step == after:
            os._exit(3)
        model.zero_grad()
        loss_of(model, *batch(rank, step)).backward()
    return {}


SCENARIOS = {"one_step": one_step, "ef_average": ef_average, "accumulation": accumulation, "raw_no_sync": raw_no_sync,
             "checkpoint": checkpoint, "ddp_options": ddp_options, "nonfinite": nonfinite, "errors": errors,
             "die": die, "momentum": momentum, "frozen": frozen, "exempt": exempt, "clipped_warmup": clipped_warmup,
             "accumulation_clipped": accumulation_clipped, "scaled_averages": scaled_averages,
             "min_ratio": min_ratio, "intermittent": intermittent, "optimizer_over_part": optimizer_over_part,
             "transport": transport, "update": update}


def main(scenarios: Dict[str, Callable[..., Dict[str, Any]]] = SCENARIOS) -> None:
    """Run JOB (argv[1]) with ``scenarios`` (tests/ddp_auto_workers.py passes its own) on this rank."""
    jobs, outdir = json.loads(sys.argv[1]), Path(sys.argv[2])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    results = []
    try:
        for job in jobs:
            job = dict(job)
            results.append(scenarios[job.pop("fn")](**job))
    except BaseException:
        print(f"[rank {rank}] FAILED in {job}", file=sys.stderr, flush=True)
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    (outdir / f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
