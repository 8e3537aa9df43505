"""Rank-side code of tests/test_auto.py: gc.Auto on 2 ranks (see tests/harness.py)."""
from __future__ import annotations

import copy
import gc as pygc
from typing import Any, Dict, List

import horovod.torch as hvd
import torch
import torch.nn.functional as F

import hvd_gradcomp as gc
from hvd_gradcomp.collectives.reduce import chunk_bounds
from tests.workers.integration import all_ranks_equal, batch, make_model


def _residual_of_mean(auto: gc.Auto, name: str, numel: int) -> torch.Tensor:
    """What the average over ranks still owes for ``name``: every rank's local residuals,
    averaged, plus the reduced-chunk residuals (already residuals of the average)."""
    local = torch.zeros(numel, dtype=torch.float64)
    for comp in (auto.sparse, auto.qsgd):
        r = comp.residuals.residual(name)
        if r is not None:
            local += r.double().reshape(-1)
    owed = hvd.allreduce(local, op=hvd.Average, name=f"owed.{name}")
    chunk = torch.zeros(numel, dtype=torch.float64)
    r = auto.qsgd.relay_residuals.residual(f"{name}#reduced{hvd.rank()}")
    if r is not None:
        start = chunk_bounds(numel, hvd.size())[hvd.rank()]
        chunk[start:start + r.numel()] = r.double()
    return owed + hvd.allreduce(chunk, op=hvd.Sum, name=f"owedchunk.{name}")


def switching(stock: bool = False, steps: int = 8) -> Dict[str, Any]:
    """Train with lr 0 (fixed gradients per rank and step) while Auto switches roads: every
    step's applied gradient is identical on all ranks, and what was applied plus what is still
    owed (residuals) equals the sum of the true averaged gradients. No warm-up step: one
    exploring step per road, so that re-decisions (switches) come within the 8 steps."""
    model = make_model()
    ref = copy.deepcopy(model)  # local gradients from here: stock Horovod allreduces p.grad in place
    auto = gc.Auto(ratio=0.05, explore_steps=1, warmup_steps=0, interval=3, roads=("sparse", "qsgd", "dense"),
                   probe_numel=4096, seed=7)
    base = torch.optim.SGD(model.parameters(), lr=0.0)
    if stock:
        opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(), compression=auto)
    else:
        opt = gc.DistributedOptimizer(base, named_parameters=model.named_parameters(), compression=auto)
    names = [n for n, p in model.named_parameters() if stock or p.numel() >= 1024]
    params = dict(model.named_parameters())
    applied = {n: torch.zeros(params[n].numel(), dtype=torch.float64) for n in names}
    truth = {n: torch.zeros_like(applied[n]) for n in names}
    equal: List[bool] = []
    gaps: List[float] = []
    roads: List[str] = []
    for step in range(steps):
        opt.zero_grad()
        x, y = batch(hvd.rank(), step)
        F.cross_entropy(model(x), y).backward()
        ref_grads = dict(zip([n for n, _ in ref.named_parameters()],
                             torch.autograd.grad(F.cross_entropy(ref(x), y), list(ref.parameters()))))
        local = {n: ref_grads[n].double().reshape(-1) for n in names}
        opt.step()
        roads.append("explore" if auto.exploring else auto.decisions["fc1.weight"])
        for n in names:
            truth[n] += hvd.allreduce(local[n], op=hvd.Average, name=f"truth.{n}.{step}")
            applied[n] += params[n].grad.detach().double().reshape(-1)
            equal.append(all_ranks_equal(params[n].grad))
        gap = max(float((truth[n] - applied[n] - _residual_of_mean(auto, n, applied[n].numel())).abs().max()
                        / truth[n].abs().max()) for n in names)
        gaps.append(gap)
    rep = auto.report()
    return {"equal": equal, "gaps": gaps, "decisions": rep["decisions"], "switches": rep["switches"],
            "summary": rep["summary"], "step": auto.step, "roads": roads,
            "codec_roads": {n: sorted(t["codec_ms"]) for n, t in rep["tensors"].items()},
            "bandwidth": rep["link"]["bandwidth_Bps"] if rep["link"] else None}


def _deep_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Tanh(), torch.nn.Linear(96, 80), torch.nn.Tanh(),
                               torch.nn.Linear(80, 48), torch.nn.Tanh(), torch.nn.Linear(48, 10))


def fused(steps: int = 3) -> Dict[str, Any]:
    """Fused sparse allgathers give bit-for-bit the gradients of one allgather per tensor, on
    every rank; the last group launches from the last hook; no payload header is read twice."""
    from hvd_gradcomp import wire
    from hvd_gradcomp.collectives.exchange import AllgatherExchange, TimedExchange, wait_done

    out: Dict[str, Any] = {}
    for fusion_bytes in (1 << 30, 96 * 80 * 4):   # one group per step; a group per ~1-2 tensors
        models = [_deep_model(), _deep_model()]
        opts = [gc.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters(),
                                        compression=gc.TopKQSGD(ratio=0.05, seed=3), min_compress_numel=400)
                for m in models]
        opts[0]._compressed.inner.fusion_bytes = fusion_bytes
        opts[1]._compressed = TimedExchange(AllgatherExchange(opts[1].compression, opts[1].op, opts[1].process_set))
        res = {"equal_to_unfused": [], "ranks_equal": [], "groups": [], "launched_before_sync": [],
               "read_header_calls": [], "parse_header_calls": []}
        for step in range(steps):
            x, y = batch(hvd.rank(), step, offset=0)[0], batch(hvd.rank(), step)[1]
            calls = {"read": 0, "parse": 0}
            real_read, real_parse = wire.read_header, wire.parse_header

            def read(*a, **k):
                calls["read"] += 1
                return real_read(*a, **k)

            def parse(*a, **k):
                calls["parse"] += 1
                return real_parse(*a, **k)
            wire.read_header, wire.parse_header = read, parse
            try:
                opts[0].zero_grad()
                F.cross_entropy(models[0](x), y).backward()
                groups = {id(p.group): p.group for p in opts[0]._pending.values()}
                res["groups"].append(len(groups))
                res["launched_before_sync"].append(all(g.handle is not None for g in groups.values()))
                res.setdefault("small_before_sync", []).append(opts[0]._early_fused is not None)
                if fusion_bytes < 1 << 30:   # groups done before synchronize(): their averages go into p.grad at once
                    for g in groups.values():
                        if g.handle is not None and not g.decoded:   # a decoded group's handle is consumed
                            wait_done(g.handle)
                    opts[0]._progress()
                    res.setdefault("summed_before_sync", []).append(
                        sum(bool(p.summed) for p in opts[0]._pending.values()))
                opts[0].step()
            finally:
                wire.read_header, wire.parse_header = real_read, real_parse
            res["read_header_calls"].append(calls["read"])
            res["parse_header_calls"].append(calls["parse"])
            opts[1].zero_grad()
            F.cross_entropy(models[1](x), y).backward()
            opts[1].step()
            for (n, a), b in zip(models[0].named_parameters(), models[1].parameters()):
                res["equal_to_unfused"].append(torch.equal(a.grad, b.grad))
                res["ranks_equal"].append(all_ranks_equal(a.grad))
        t = opts[0].exchange_timing
        res["timing"] = [t.codec_s, t.codec_sync_s, t.wait_s, opts[0].comm_wait_s]
        # what only the cyclic collector would free: no pending tensor or fusion group (such a cycle
        # held p.grad, p.out, for several steps: the slow steps of issue 13)
        pygc.set_debug(pygc.DEBUG_SAVEALL)
        pygc.collect()
        pygc.set_debug(0)
        res["cyclic"] = sorted({type(o).__name__ for o in pygc.garbage} & {"Pending", "_Group"})
        pygc.garbage.clear()
        for o in opts:
            o.remove_hooks()
        out[str(fusion_bytes)] = res
    return out


def battery(scenarios: List[Dict[str, Any]]) -> List[Any]:
    return [globals()[sc.pop("fn")](**sc) for sc in scenarios]
