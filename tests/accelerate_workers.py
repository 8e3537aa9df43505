"""Rank side of tests/test_integrations_accelerate.py: ``python -m torch.distributed.run --nproc-per-node 2
tests/accelerate_workers.py JOB OUTDIR``.

Every rank runs every scenario of JOB in order (accelerate's ``Accelerator`` under torchrun, Gloo, CPU)
and writes ``OUTDIR/rank<r>.json``. A failing rank prints its traceback and exits at once, so
torchrun stops the other rank instead of letting it wait in a collective.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from accelerate import Accelerator  # noqa: E402

import hvd_gradcomp as gc  # noqa: E402
from hvd_gradcomp import ddp as gc_ddp  # noqa: E402
from tests.ddp_workers import main as run_scenarios  # noqa: E402
from hvd_gradcomp.integrations import accelerate as gc_accelerate  # noqa: E402


def net() -> nn.Module:
    """Weights above min_compress_numel (compressed), a small head (dense)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def make_optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2)
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def make_compression(name: str) -> Any:
    extra = {"feedback": gc.FrozenVariance(warmup=2)} if name == "adamw" else {}
    return gc.TopKQSGD(ratio=0.05, bits=8, seed=7, clip=1.0, **extra)


def batch(rank: int, i: int, n: int = 8) -> Any:
    g = torch.Generator().manual_seed(1000 * i + rank)
    return torch.randn(n, 32, generator=g), torch.randint(0, 10, (n,), generator=g)


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def prepared(optimizer: str, accumulate: int) -> Any:
    """An Accelerator and what its prepare() returns, the hook registered on them as they come."""
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accumulate)
    model = net()
    model, opt = accelerator.prepare(model, make_optimizer(optimizer, model.parameters()))
    if optimizer == "sgd":   # hvd_gradcomp.ddp.register itself takes the AcceleratedOptimizer too
        state = gc_ddp.register(model, compression=make_compression(optimizer), optimizer=opt)
    else:
        state = gc_accelerate.register(model, opt, compression=make_compression(optimizer))
    return accelerator, model, opt, state


def run(accelerator: Accelerator, model: Any, opt: Any, micro: range) -> List[int]:
    """accelerate's loop as its docs write it; the hook's exchanges so far after each micro-batch."""
    rank, state = dist.get_rank(), gc_ddp._STATES[model]
    seen = []
    for i in micro:
        x, y = batch(rank, i)
        with accelerator.accumulate(model):
            accelerator.backward(nn.functional.cross_entropy(model(x), y))
            opt.step()
            opt.zero_grad()
        seen.append(state.iter)
    return seen


# ---------------------------------------------------------------- scenarios
def accumulate(optimizer: str, accumulate: int, micro: int) -> Dict[str, Any]:
    """accelerator.accumulate against hvd_gradcomp.ddp.GradientAccumulator on the same batches: one exchange
    per optimizer step and the same weights, bit for bit."""
    rank = dist.get_rank()
    accelerator, model, opt, state = prepared(optimizer, accumulate)
    iters = run(accelerator, model, opt, range(micro))
    with_accelerate = flat(model)

    ref = DDP(net())
    ref_opt = make_optimizer(optimizer, ref.parameters())
    ref_state = gc_ddp.register(ref, compression=make_compression(optimizer), optimizer=ref_opt)
    acc = gc_ddp.GradientAccumulator(ref, ref_opt, steps=accumulate)
    for i in range(micro):
        x, y = batch(rank, i)
        with acc.accumulate():
            acc.backward(nn.functional.cross_entropy(ref(x), y))
    by_hand = flat(ref)
    return {"identical": bool(torch.equal(with_accelerate, by_hand)),
            "max_diff": float((with_accelerate - by_hand).abs().max()),
            "iters": iters, "exchanges": state.iter, "ref_exchanges": ref_state.iter, "ref_steps": acc.optimizer_steps,
            "model_type": type(model).__name__, "opt_type": type(opt).__name__,
            "bound_to": type(state.compression._binding[0]).__name__, "feedback": state.compression.feedback.key,
            "pending": state.pending_updates, "payload": state.comm_stats.payload_bytes,
            "raw": state.comm_stats.bytes_in}


def checkpoint(optimizer: str, accumulate: int, micro: int, ckpt: str) -> Dict[str, Any]:
    """2*micro micro-batches straight against micro, accelerator.save_state (every process; the main one
    writes), a fresh Accelerator, model, optimizer and hook, accelerator.load_state, micro more: bit-identical."""
    rank = dist.get_rank()
    accelerator, model, opt, state = prepared(optimizer, accumulate)
    run(accelerator, model, opt, range(2 * micro))
    straight = flat(model)

    accelerator, model, opt, state = prepared(optimizer, accumulate)
    gc_accelerate.register_for_checkpointing(accelerator, state)
    run(accelerator, model, opt, range(micro))
    accelerator.save_state(ckpt)
    saved_iter = state.iter
    accelerator.wait_for_everyone()
    files = sorted(os.listdir(ckpt))
    pkl = [f for f in files if f.startswith("custom_checkpoint")]
    saved = torch.load(os.path.join(ckpt, pkl[0]), weights_only=False) if pkl else {}

    torch.manual_seed(99)   # a resumed process starts elsewhere: the checkpoint must carry what matters
    accelerator, model, opt, state = prepared(optimizer, accumulate)
    gc_accelerate.register_for_checkpointing(accelerator, state)
    accelerator.load_state(ckpt)
    resumed_iter = state.iter
    run(accelerator, model, opt, range(micro, 2 * micro))
    resumed = flat(model)
    return {"identical": bool(torch.equal(straight, resumed)), "max_diff": float((straight - resumed).abs().max()),
            "files": files, "saved_iter": saved_iter, "resumed_iter": resumed_iter, "iter": state.iter,
            "saved_all_ranks": bool(saved.get("all_ranks")), "saved_ranks": len(saved.get("ranks") or []),
            "rank": rank, "summary": state.comm_stats.summary()}


SCENARIOS: Dict[str, Callable[..., Dict[str, Any]]] = {"accumulate": accumulate, "checkpoint": checkpoint}


def main() -> None:
    run_scenarios(SCENARIOS)   # accelerate uses the process group as it is


if __name__ == "__main__":
    main()
