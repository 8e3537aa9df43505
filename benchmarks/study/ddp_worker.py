"""One torchrun job of the study under PyTorch DDP: a task and seed, several settings in turn.
Rank 0 writes one JSON per setting into ``--out`` (the same fields as ``worker.py``'s), under the
task name ``<task>-ddp``.

    torchrun --standalone --nproc-per-node 2 benchmarks/study/ddp_worker.py --task transformer --seed 0

Each compressed setting is ``hvd_gradcomp.ddp.register(model, compression=..., optimizer=opt)``
as docs/DDP.md shows it; the feedback policy is the library's choice (``feedback="auto"``)
except in the *classic EF* row.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import hvd_gradcomp as gc  # noqa: E402
from benchmarks.study.tasks import TASKS, evaluate, lr_factor, make_task  # noqa: E402
from hvd_gradcomp import ddp as gc_ddp  # noqa: E402

SETTINGS = {
    "none": ("uncompressed", lambda: None),
    "tq1": ("TopKQSGD(1%, 8)", lambda: gc.TopKQSGD(ratio=0.01, bits=8)),
    "tq01": ("TopKQSGD(0.1%, 8)", lambda: gc.TopKQSGD(ratio=0.001, bits=8)),
    "tq1-classic": ("TopKQSGD(1%, 8), classic EF", lambda: gc.TopKQSGD(ratio=0.01, bits=8, feedback="classic")),
}
DEFAULT_SETTINGS = ("none", "tq1", "tq01", "tq1-classic")


def run(task_name: str, setting: str, seed: int, steps: int = 0) -> Dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    task = make_task(task_name, seed, rank)
    if task.accumulate != 1:
        raise ValueError(f"{task_name}: the DDP worker runs tasks without accumulation")
    if steps:
        task.steps = steps
    label, factory = SETTINGS[setting]
    compression = factory()
    model = DDP(task.model)
    state = None
    if compression is not None:
        compression.seed = seed
        state = gc_ddp.register(model, compression=compression, optimizer=task.optimizer)
    sched = torch.optim.lr_scheduler.LambdaLR(task.optimizer, lambda s: lr_factor(s, task.steps, task.warmup))
    raw = sum(p.numel() * p.element_size() for p in task.model.parameters() if p.requires_grad)
    every = max(1, task.steps // 20)
    evals: List[Dict[str, float]] = [dict(zip(("step", "val_loss", "val_accuracy"), (0, *evaluate(task))))]
    step_bytes: List[int] = []
    t0 = time.perf_counter()
    for step in range(1, task.steps + 1):
        task.optimizer.zero_grad()
        x, y = task.batch()
        task.loss(model, x, y).backward()
        task.optimizer.step()
        sched.step()
        step_bytes.append(state.last_step_bytes if state is not None else raw)
        if step % every == 0 or step == task.steps:
            vl, va = evaluate(task)
            if vl != vl:
                raise FloatingPointError(f"{task_name}/{setting}/seed {seed}: held-out loss is NaN at step {step}")
            evals.append({"step": step, "val_loss": vl, "val_accuracy": va})
    half = step_bytes[len(step_bytes) // 2:]
    feedback = getattr(getattr(compression, "feedback", None), "key", None)
    return {"task": f"{task_name}-ddp", "setting": setting, "label": label, "seed": seed, "ranks": world,
            "wrapper": "ddp", "optimizer": type(task.optimizer).__name__, "steps": task.steps,
            "accumulate": 1, "compressor": repr(compression), "feedback": feedback,
            "val_loss": evals[-1]["val_loss"], "val_accuracy": evals[-1]["val_accuracy"], "evals": evals,
            "raw_bytes_per_step": raw, "bytes_second_half": sum(half) / len(half),
            "ratio_second_half": raw * len(half) / max(1, sum(half)), "wall_s": time.perf_counter() - t0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", choices=TASKS, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--settings", default=",".join(DEFAULT_SETTINGS), help=f"comma-separated, of {list(SETTINGS)}")
    ap.add_argument("--out", default="runs/study")
    ap.add_argument("--steps", type=int, default=0, help="override the task's steps (smoke tests)")
    args = ap.parse_args()
    settings = args.settings.split(",")
    bad = [s for s in settings if s not in SETTINGS]
    if bad:
        ap.error(f"unknown settings {bad}; choose from {list(SETTINGS)}")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=10))
    out = Path(args.out)
    for setting in settings:
        result = run(args.task, setting, args.seed, args.steps)
        if dist.get_rank() == 0:
            out.mkdir(parents=True, exist_ok=True)
            (out / f"{result['task']}-{setting}-s{args.seed}.json").write_text(json.dumps(result, indent=1) + "\n")
            print(f"{result['task']} {setting} seed {args.seed}: held-out loss {result['val_loss']:.4f} "
                  f"acc {result['val_accuracy']:.3f} ratio(2nd half) {result['ratio_second_half']:.0f}x "
                  f"feedback {result['feedback']} {result['wall_s']:.0f}s", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
