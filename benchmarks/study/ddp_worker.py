"""One torchrun job of the study under PyTorch DDP: a task and seed, several settings in turn.
Rank 0 writes one JSON per setting into ``--out`` (the same fields as ``worker.py``'s), under the
task name ``<task>-ddp``.

    torchrun --standalone --nproc-per-node 2 benchmarks/study/ddp_worker.py --task transformer --seed 0

Each compressed setting is ``hvd_gradcomp.ddp.register(model, compression=..., optimizer=opt)``
as docs/DDP.md shows it; the feedback policy is the library's choice (``feedback="auto"``)
except in the *classic EF* row. Two settings outside the study's default rows compare PowerSGD
rank 4 (``study.py --config powersgd``): ``psgd4``, ``gc.PowerSGD(rank=4)`` through
the same hook, and ``psgd4-torch``, torch's own ``powerSGD_hook``.
"""
from __future__ import annotations

import datetime
import sys
from pathlib import Path
from typing import Any, Dict

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.study import loop, settings as shared  # noqa: E402
from benchmarks.study.tasks import make_task  # noqa: E402
import hvd_gradcomp as gc  # noqa: E402
from hvd_gradcomp import ddp as gc_ddp  # noqa: E402

DEFAULT_SETTINGS = ("none", "tq1", "tq01", "tq1-classic", "tq1-fixedlr", "tq01-spw100", "tq1-prev", "tq01-prev",
                    "tq01-nowarm")
# PowerSGD rank 4, ours and torch's hook, both compressing from DDP's third iteration: the earliest
# torch's hook allows with error feedback (DDP rebuilds its buckets after the first), so the two
# differ by their implementation only. torch's hook gets one bucket under Gloo (it hangs with
# several, docs/DDP.md "PowerSGD with several buckets under Gloo").
POWERSGD_RANK, POWERSGD_START, TORCH_POWERSGD, ONE_BUCKET_MB = 4, 2, "psgd4-torch", 1e5
SETTINGS = {**{key: shared.SETTINGS[key] for key in DEFAULT_SETTINGS},   # the rows the DDP task has
            "psgd4": (f"hvd-gradcomp PowerSGD rank {POWERSGD_RANK}", lambda opt: gc.PowerSGD(rank=POWERSGD_RANK)),
            TORCH_POWERSGD: (f"torch's PowerSGD hook, rank {POWERSGD_RANK}", lambda opt: None)}


class _TorchPowerSGDBytes:
    """Bytes this rank hands to the allreduces per step under torch's hook: the raw gradient before
    ``start_powerSGD_iter``, then the elements its ``compression_stats()`` counted, as float32."""

    def __init__(self, state: powerSGD_hook.PowerSGDState, raw: int) -> None:
        self.state, self.raw, self._seen = state, raw, 0

    def step(self) -> int:
        now = self.state.compression_stats()[2] * 4
        sent, self._seen = now - self._seen, now
        return sent or self.raw


def run(task_name: str, setting: str, seed: int, steps: int = 0, clip: float = 0.0) -> Dict[str, Any]:
    task = make_task(task_name, seed, dist.get_rank())
    if task.accumulate != 1:
        raise ValueError(f"{task_name}: the DDP worker runs tasks without accumulation")
    if steps:
        task.steps = steps
    task.wrapper = "ddp"
    label, factory = SETTINGS[setting]
    compression = factory(task.optimizer)  # some settings follow the task's optimizer
    raw = sum(p.numel() * p.element_size() for p in task.model.parameters() if p.requires_grad)
    model = DDP(task.model, bucket_cap_mb=ONE_BUCKET_MB if setting == TORCH_POWERSGD else 25)
    state = None
    step_bytes = lambda: state.last_step_bytes if state else raw  # noqa: E731
    if setting == TORCH_POWERSGD:
        psgd = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=POWERSGD_RANK,
                                           start_powerSGD_iter=POWERSGD_START, random_seed=seed)
        model.register_comm_hook(psgd, powerSGD_hook.powerSGD_hook)
        step_bytes = _TorchPowerSGDBytes(psgd, raw).step
    elif compression is not None:
        compression.seed = seed
        start = POWERSGD_START if setting == "psgd4" else 0
        state = gc_ddp.register(model, compression=compression, optimizer=task.optimizer, start_compress_iter=start)

    def one_step() -> None:
        task.optimizer.zero_grad()
        x, y = task.batch()
        task.loss(model, x, y).backward()
        if clip:   # as users do under DDP: clip the averaged gradients before the step
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        task.optimizer.step()

    trained = loop.train(task, task.optimizer, one_step, step_bytes,
                         f"{task_name}-ddp/{setting}/seed {seed}")
    return loop.record(task, f"{task_name}-ddp", setting, label, seed, dist.get_world_size(), compression,
                       trained, raw)


def _init() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=10))


if __name__ == "__main__":
    sys.exit(loop.main(__doc__, SETTINGS, DEFAULT_SETTINGS, _init, dist.get_rank, run))
