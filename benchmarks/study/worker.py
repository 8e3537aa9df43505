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
from benchmarks.study import loop  # noqa: E402
from benchmarks.study.tasks import make_task  # noqa: E402

# setting -> (label, compressor factory). Every compressor uses the library's defaults
# (feedback="auto") except "tq1-classic" (error feedback on gradients, the pre-issue-9 recipe) and
# "tq1-update" (compress the update: the previous default for Adam and AdamW).
SETTINGS = {
    "none": ("uncompressed", lambda opt: None),
    "fp16": ("fp16", lambda opt: hvd.Compression.fp16),
    "qsgd8": ("QSGD 8-bit", lambda opt: gc.QSGD(bits=8)),
    "qsgd4": ("QSGD 4-bit", lambda opt: gc.QSGD(bits=4)),
    "topk": ("TopK 1%", lambda opt: gc.TopK(ratio=0.01)),
    "tq1": ("TopKQSGD(1%, 8)", lambda opt: gc.TopKQSGD(ratio=0.01, bits=8)),
    "tq01": ("TopKQSGD(0.1%, 8)", lambda opt: gc.TopKQSGD(ratio=0.001, bits=8)),
    # The sparsity warm-up of 100 steps whatever the ratio (before it kept its pace below 1%): as a
    # schedule of the user's own, which counts the same compressed steps as the policy's
    "tq01-spw100": ("TopKQSGD(0.1%, 8), 100-step sparsity warm-up",
                    lambda opt: gc.TopKQSGD(ratio=gc.SparsityWarmup(0.001, steps=100), bits=8)),
    # momentum correction's sparsity warm-up at 0.1% before it lasted sqrt(1%/ratio) times its 100 steps
    # (317): 172 steps, the pace it has at 1%, as a schedule of the user's own
    "tq01-spw172": ("TopKQSGD(0.1%, 8), 172-step sparsity warm-up",
                    lambda opt: gc.TopKQSGD(ratio=gc.SparsityWarmup(0.001, steps=172), bits=8)),
    # char-MLP's output layer (out.weight, 65,536 values: 66 a step at 0.1%) kept at 1% (min_ratio=)
    "tq01-out1": ("TopKQSGD(0.1%, 8), output layer at 1% (min_ratio)",
                  lambda opt: gc.TopKQSGD(ratio=0.001, bits=8, min_ratio={r"^out\.": 0.01})),
    "tq1-classic": ("TopKQSGD(1%, 8), classic EF", lambda opt: gc.TopKQSGD(ratio=0.01, bits=8, feedback="classic")),
    "tq1-momentum": ("TopKQSGD(1%, 8), momentum correction",
                     lambda opt: gc.TopKQSGD(ratio=0.01, bits=8, feedback="momentum")),
    "tq1-update": ("TopKQSGD(1%, 8), compress the update", lambda opt: gc.TopKQSGD(ratio=0.01, bits=8, feedback="update")),
    # Momentum correction's default sparsity warm-up switched off: the default before it was one.
    "tq1-nospw": ("TopKQSGD(1%, 8), no sparsity warm-up",
                  lambda opt: gc.TopKQSGD(ratio=0.01, bits=8, feedback=gc.MomentumCorrection(sparsity_warmup=0))),
    # The residual kept at the rate it was computed (before it followed the learning rate)
    "tq1-fixedlr": ("TopKQSGD(1%, 8), residual not following the rate", loop.fixed_rate_topkqsgd),
    # Adam and AdamW: FrozenVariance's default before it dropped Adam's momentum and its sparsity
    # warm-up (docs/FREEZE_CHECK.md); Adam's first moment kept by every tensor; the default with the
    # sparsity warm-up back. All with the 100-step sparsity warm-up they ran with.
    "tq1-prev": ("TopKQSGD(1%, 8), previous default", lambda opt: loop.previous_default(0.01)),
    "tq01-prev": ("TopKQSGD(0.1%, 8), previous default", lambda opt: loop.previous_default(0.001)),
    "tq1-mom": ("TopKQSGD(1%, 8), Adam's momentum kept",
                lambda opt: gc.TopKQSGD(ratio=0.01, bits=8, feedback=gc.FrozenVariance(momentum=True, sparsity_warmup=100))),
    "tq01-mom": ("TopKQSGD(0.1%, 8), Adam's momentum kept",
                 lambda opt: gc.TopKQSGD(ratio=0.001, bits=8, feedback=gc.FrozenVariance(momentum=True, sparsity_warmup=100))),
    "tq1-nomom": ("TopKQSGD(1%, 8), sparsity warm-up after the freeze",
                  lambda opt: gc.TopKQSGD(ratio=0.01, bits=8, feedback=gc.FrozenVariance(sparsity_warmup=100))),
    "tq01-nomom": ("TopKQSGD(0.1%, 8), sparsity warm-up after the freeze",
                   lambda opt: gc.TopKQSGD(ratio=0.001, bits=8, feedback=gc.FrozenVariance(sparsity_warmup=100))),
    # Below 1% with Adam, "auto" gives FrozenVariance a sparsity warm-up after the freeze, sending
    # Adam's momentum while it is dense (compressors.LOW_RATIO_FROZEN); before, it had neither:
    "tq01-nowarm": ("TopKQSGD(0.1%, 8), no sparsity warm-up after the freeze",
                    lambda opt: gc.TopKQSGD(ratio=0.001, bits=8, feedback=gc.FrozenVariance())),
    # The frozen v never following the gradients' scale (the default follows it where it shrinks):
    # under a schedule, the default before it did
    "tq1-vfrozen": ("TopKQSGD(1%, 8), v frozen for good",
                    lambda opt: gc.TopKQSGD(ratio=0.01, bits=8, feedback=gc.FrozenVariance(follow_scale=None))),
    # Adam's second moment frozen after a third of the CNN's 600 steps (the default: 100)
    "tq1-warm200": ("TopKQSGD(1%, 8), second moment frozen after 200 steps",
                    lambda opt: gc.TopKQSGD(ratio=0.01, bits=8, feedback=gc.FrozenVariance(warmup=200))),
    # Adam's second moment frozen 3x later than the default (100 steps): run_length.py's longer runs
    "tq1-warm300": ("TopKQSGD(1%, 8), second moment frozen after 300 steps",
                    lambda opt: gc.TopKQSGD(ratio=0.01, bits=8, feedback=gc.FrozenVariance(warmup=300))),
}
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
