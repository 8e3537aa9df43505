"""Rank side of tests/test_ddp_auto.py: ``gc.Auto()`` in the DDP hook, under torchrun.

``python -m torch.distributed.run ... tests/ddp_auto_workers.py JOBS OUTDIR``: every rank runs
every scenario of JOBS in order and writes ``OUTDIR/rank<r>.json``; a failing rank prints its
traceback and exits at once, so torchrun stops the other one (see tests/ddp_workers.py).
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable, Dict

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hvd_gradcomp as gc  # noqa: E402
from hvd_gradcomp import ddp as gc_ddp  # noqa: E402
from hvd_gradcomp.collectives.reduce import chunk_bounds  # noqa: E402
from tests.ddp_workers import BUCKET_MB, batch, flat_grads, loss_of, net, reference_grad  # noqa: E402
from tests.ddp_workers import main as run_jobs  # noqa: E402

ROADS = ("sparse", "qsgd", "dense")   # the exact roads: fp16 would round the average


def forced_plans(auto: gc.Auto) -> Callable[[], Dict[str, str]]:
    """A replacement for ``auto.decide``: the k-th decision gives the i-th bucket (in name order)
    road (i + k) mod 3, so every bucket changes road at every decision, the same on every rank."""
    calls = [0]

    def decide() -> Dict[str, str]:
        for i, key in enumerate(sorted(auto.costs)):
            road = ROADS[(i + calls[0]) % len(ROADS)]
            if auto.decisions.get(key) != road:
                auto.history.append((auto.step, key, auto.decisions.get(key), road))
            auto.decisions[key] = road
        calls[0] += 1
        return dict(auto.decisions)

    return decide


def owed(model: DDP, auto: gc.Auto) -> torch.Tensor:
    """What the ranks still owe the average, in flat_grads order: the mean over ranks of their
    residuals (both compressors), plus each rank's residual of its reduced QSGD chunk (a residual
    of the average, counted once: x P here, before the mean)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    parts = []
    for name, p in model.module.named_parameters():
        local = torch.zeros(p.numel())
        for store in (auto.sparse.residuals, auto.qsgd.residuals):
            r = store.residual(name)
            if r is not None:
                local += r
        chunk = auto.qsgd.relay_residuals.residual(f"{name}#reduced{rank}")
        if chunk is not None:
            start = chunk_bounds(p.numel(), world)[rank]
            local[start:start + chunk.numel()] += world * chunk
        parts.append(local)
    flat = torch.cat(parts)
    dist.all_reduce(flat)
    return flat / world


def same_on_every_rank(t: torch.Tensor) -> bool:
    gathered = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, t)
    return all(torch.equal(g, gathered[0]) for g in gathered)


def auto_switches(steps: int = 12) -> Dict[str, Any]:
    """The same batch every step, parameters fixed, roads forced to change at every decision
    (explore 1 step per road, no warm-up step, decide every 3 steps; no verdicts, so that the switches are known): at every step
    what arrived plus what is still owed equals steps x the true average, and every rank
    applied bit-identical gradients."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = DDP(net(), bucket_cap_mb=BUCKET_MB)
    auto = gc.Auto(explore_steps=1, warmup_steps=0, interval=3, roads=ROADS, seed=5)
    auto.decide, auto.verify = forced_plans(auto), lambda: None
    state = gc_ddp.register(model, compression=auto)
    truth = reference_grad(0, world)
    applied = torch.zeros_like(truth)
    errors, identical, roads_seen = [], True, []
    for step in range(1, steps + 1):
        model.zero_grad()
        loss_of(model, *batch(rank, 0)).backward()
        g = flat_grads(model.module)
        identical &= same_on_every_rank(g)
        applied += g
        err = (applied + owed(model, auto) - step * truth).norm() / (step * truth).norm()
        errors.append(float(err))
        roads_seen.append(sorted(set(auto.decisions.values())) if not auto.exploring else [auto.road_of("?")])
    switched = [h for h in auto.history if h[2] is not None and h[2] != h[3]]
    return {"errors": errors, "identical": identical, "switches": [list(h) for h in switched],
            "roads_seen": roads_seen, "report": auto.report()["summary"], "decisions": auto.decisions,
            "bytes": state.comm_stats.bytes_out}


def auto_measured(steps: int = 14) -> Dict[str, Any]:
    """Auto as users run it (its own probes and decisions, default roads, 1 measured exploring
    step per road after the warm-up steps: sparse's 2, the first road's, qsgd's 1): decisions the same on every rank, in
    the report and the byte counts."""
    rank = dist.get_rank()
    model = DDP(net(), bucket_cap_mb=BUCKET_MB)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    auto = gc.Auto(explore_steps=1, interval=4, seed=3, probe_numel=1 << 12)
    state = gc_ddp.register(model, compression=auto)
    identical = True
    for step in range(steps):
        opt.zero_grad()
        loss_of(model, *batch(rank, step)).backward()
        identical &= same_on_every_rank(flat_grads(model.module))
        opt.step()
    rep = state.auto_report()
    codes = torch.tensor([gc.auto.policy.ROADS.index(rep["decisions"][k]) for k in sorted(rep["decisions"])])
    return {"identical": identical, "decisions": rep["decisions"], "same_decisions": same_on_every_rank(codes),
            "summary": rep["summary"], "link": rep["link"], "codec_roads": {k: sorted(t["codec_ms"]) for k, t in
                                                                            rep["tensors"].items()},
            "per_tensor": sorted(state.comm_stats.per_tensor), "verdicts": len(rep["verdicts"]),
            "step": rep["step"], "schedule": [[r, m] for r, m in zip(auto._setup.schedule, auto._setup.measured)]}


def auto_checkpoint(ckpt: str) -> Dict[str, Any]:
    """10 steps straight vs 7, save, fresh DDP + state + optimizer, load, 3: the Auto state (step,
    decisions, residuals) comes back and training resumes bit-identically, although the fresh DDP
    puts every parameter in one bucket for its first iteration (each then takes its own road).
    Exploration (no warm-up step) ends at step 5 (DDP's rebuild restarts it at step 3), decisions at step 6."""
    rank = dist.get_rank()

    def fresh():
        model = DDP(net(), bucket_cap_mb=BUCKET_MB)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        auto = gc.Auto(explore_steps=1, warmup_steps=0, interval=1000, roads=ROADS, seed=11)
        auto.decide, auto.verify = forced_plans(auto), lambda: None
        return model, gc_ddp.register(model, compression=auto), opt

    def train(model, opt, steps):
        for step in steps:
            opt.zero_grad()
            loss_of(model, *batch(rank, step)).backward()
            opt.step()

    model, state, opt = fresh()
    train(model, opt, range(10))
    straight = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    model, state, opt = fresh()
    train(model, opt, range(7))
    path = Path(ckpt) / f"rank{rank}.pt"
    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "hook": state.state_dict()}, path)
    before = state.compression
    model, state, opt = fresh()
    saved = torch.load(path, weights_only=False)
    model.module.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    state.load_state_dict(saved["hook"])
    after = state.compression
    residuals_back = all(torch.equal(before.sparse.residuals.residual(n), after.sparse.residuals.residual(n))
                         for n, _ in model.module.named_parameters() if before.sparse.residuals.residual(n) is not None)
    restored = {"step": after.step == before.step > 0, "decisions": after.decisions == before.decisions,
                "residuals": residuals_back, "some_residual": any(
                    before.sparse.residuals.residual(n) is not None for n, _ in model.module.named_parameters())}
    train(model, opt, range(7, 10))
    resumed = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {"restored": restored, "identical": bool(torch.equal(straight, resumed)),
            "max_diff": float((straight - resumed).abs().max()), "decisions": after.decisions}


def auto_nonfinite(bad_step: int = 8, steps: int = 10) -> Dict[str, Any]:
    """Rank 1's loss is Inf at one step after the decision (buckets on sparse, qsgd and dense):
    every rank gets a non-finite gradient there, nobody hangs, and the next steps are finite and
    identical on every rank again."""
    rank = dist.get_rank()
    model = DDP(net(), bucket_cap_mb=BUCKET_MB)
    auto = gc.Auto(explore_steps=1, warmup_steps=0, interval=1000, roads=ROADS, seed=5)
    auto.decide, auto.verify = forced_plans(auto), lambda: None
    state = gc_ddp.register(model, compression=auto)
    finite, identical = [], []
    for step in range(1, steps + 1):
        model.zero_grad()
        loss = loss_of(model, *batch(rank, step))
        if step == bad_step and rank == 1:
            loss = loss * float("inf")
        loss.backward()
        g = flat_grads(model.module)
        finite.append(bool(torch.isfinite(g).all()))
        identical.append(same_on_every_rank(g) if finite[-1] else None)
    return {"finite": finite, "identical": identical, "nonfinite_exchanges": state.nonfinite_exchanges,
            "roads": sorted(set(auto.decisions.values()))}


def auto_errors() -> Dict[str, Any]:
    """One Auto serves one hook state."""
    auto = gc.Auto()
    gc_ddp.register(DDP(net(), bucket_cap_mb=BUCKET_MB), compression=auto)
    try:
        gc_ddp.register(DDP(net(), bucket_cap_mb=BUCKET_MB), compression=auto)
    except ValueError as err:
        return {"error": str(err)}
    return {"error": None}


SCENARIOS = {"auto_switches": auto_switches, "auto_measured": auto_measured, "auto_checkpoint": auto_checkpoint,
             "auto_errors": auto_errors, "auto_nonfinite": auto_nonfinite}


if __name__ == "__main__":
    run_jobs(SCENARIOS)
