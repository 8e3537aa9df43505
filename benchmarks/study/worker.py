"""One horovodrun job of the study: one task and seed, several compression settings in turn
(one start-up for all). Rank 0 writes one JSON per setting into ``--out``.

    horovodrun -np 2 -H localhost:2 --gloo python benchmarks/study/worker.py --task cnn-sgd --seed 0
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Dict

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import horovod.torch as hvd  # noqa: E402
import torch  # noqa: E402

import hvd_gradcomp as gc  # noqa: E402
from benchmarks.study import loop, settings as shared  # noqa: E402
from benchmarks.study.tasks import make_task  # noqa: E402

# setting -> (label, compressor factory): the shared table, and Horovod's own fp16 compression
SETTINGS = {"none": shared.SETTINGS["none"], "fp16": ("fp16", lambda opt: hvd.Compression.fp16), **shared.SETTINGS}
DEFAULT_SETTINGS = ("none", "fp16", "qsgd8", "topk", "tq1", "tq01", "tq1-classic", "tq1-fixedlr", "tq01-spw100")


def wrap(task: Any, compression: Any, seed: int) -> Any:
    if isinstance(compression, gc.GradientCompressor):
        compression.seed = seed
    kw = dict(named_parameters=task.model.named_parameters(), compression=compression or hvd.Compression.none,
              backward_passes_per_step=task.accumulate)
    opt = (gc.DistributedOptimizer(task.optimizer, **kw) if task.wrapper == "gc"
           else hvd.DistributedOptimizer(task.optimizer, **kw))
    hvd.broadcast_parameters(task.model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    return opt


class Bytes:
    """Bytes this rank hands to Horovod per optimizer step, on either wrapper."""

    def __init__(self, opt: Any, compression: Any, raw: int) -> None:
        self.opt, self.compression, self.raw = opt, compression, raw
        self._out = 0

    def step(self) -> int:
        if hasattr(self.opt, "last_step_bytes"):
            return self.opt.last_step_bytes
        if isinstance(self.compression, gc.GradientCompressor):
            now = self.compression.stats.bytes_out
            sent, self._out = now - self._out, now
            return sent
        return self.raw // 2 if self.compression is hvd.Compression.fp16 else self.raw


def run(task_name: str, setting: str, seed: int, steps: int = 0, clip: float = 0.0) -> Dict[str, Any]:
    task = make_task(task_name, seed, hvd.rank())
    if steps:
        task.steps = steps
    label, factory = SETTINGS[setting]
    compression = factory(task.optimizer)  # some settings follow the task's optimizer
    opt = wrap(task, compression, seed)
    raw = sum(p.numel() * p.element_size() for p in task.model.parameters() if p.requires_grad)
    counter = Bytes(opt, compression, raw)
    acc = gc.GradientAccumulator(opt, steps=task.accumulate)

    def one_step() -> None:
        if clip:   # Horovod's documented pattern: synchronize, clip the averages, step
            for _ in range(task.accumulate):
                x, y = task.batch()
                (task.loss(task.model, x, y) / task.accumulate).backward()
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(task.model.parameters(), clip)
            with opt.skip_synchronize():
                opt.step()
            opt.zero_grad()
            return
        for _ in range(task.accumulate):
            x, y = task.batch()
            acc.backward(task.loss(task.model, x, y))

    trained = loop.train(task, opt, one_step, counter.step, f"{task_name}/{setting}/seed {seed}")
    return loop.record(task, task_name, setting, label, seed, hvd.size(), compression, trained, raw)


if __name__ == "__main__":
    sys.exit(loop.main(__doc__, SETTINGS, DEFAULT_SETTINGS, hvd.init, hvd.rank, run))
