"""One torchrun job of the study under PyTorch DDP: a task and seed, several settings in turn.
Rank 0 writes one JSON per setting into ``--out`` (the same fields as ``worker.py``'s), under the
task name ``<task>-ddp``.

    torchrun --standalone --nproc-per-node 2 benchmarks/study/ddp_worker.py --task transformer --seed 0

Each compressed setting is ``hvd_gradcomp.ddp.register(model, compression=..., optimizer=opt)``
as docs/DDP.md shows it; the feedback policy is the library's choice (``feedback="auto"``)
except in the *classic EF* row.
"""
from __future__ import annotations

import datetime
import sys
from pathlib import Path
from typing import Any, Dict

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.study import loop, settings as shared  # noqa: E402
from benchmarks.study.tasks import make_task  # noqa: E402
from hvd_gradcomp import ddp as gc_ddp  # noqa: E402

DEFAULT_SETTINGS = ("none", "tq1", "tq01", "tq1-classic", "tq1-fixedlr", "tq01-spw100", "tq1-prev", "tq01-prev",
                    "tq01-nowarm")
SETTINGS = {key: shared.SETTINGS[key] for key in DEFAULT_SETTINGS}   # the rows the DDP task has


def run(task_name: str, setting: str, seed: int, steps: int = 0, clip: float = 0.0) -> Dict[str, Any]:
    task = make_task(task_name, seed, dist.get_rank())
    if task.accumulate != 1:
        raise ValueError(f"{task_name}: the DDP worker runs tasks without accumulation")
    if steps:
        task.steps = steps
    task.wrapper = "ddp"
    label, factory = SETTINGS[setting]
    compression = factory(task.optimizer)  # some settings follow the task's optimizer
    model = DDP(task.model)
    state = None
    if compression is not None:
        compression.seed = seed
        state = gc_ddp.register(model, compression=compression, optimizer=task.optimizer)
    raw = sum(p.numel() * p.element_size() for p in task.model.parameters() if p.requires_grad)

    def one_step() -> None:
        task.optimizer.zero_grad()
        x, y = task.batch()
        task.loss(model, x, y).backward()
        if clip:   # as users do under DDP: clip the averaged gradients before the step
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        task.optimizer.step()

    trained = loop.train(task, task.optimizer, one_step, lambda: state.last_step_bytes if state else raw,
                         f"{task_name}-ddp/{setting}/seed {seed}")
    return loop.record(task, f"{task_name}-ddp", setting, label, seed, dist.get_world_size(), compression,
                       trained, raw)


def _init() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=10))


if __name__ == "__main__":
    sys.exit(loop.main(__doc__, SETTINGS, DEFAULT_SETTINGS, _init, dist.get_rank, run))
