"""Bytes per step of the study's transformer with TopKQSGD(1%, 8), exempt tensors as float32 or
float16 (issue 9): what each rank hands to Horovod in a compressed step, split into the compressed
payloads and the exempt tensors (LayerNorms, biases: under ``min_compress_numel``). No timing.

    .venv/bin/horovodrun -np 2 -H localhost:2 --gloo .venv/bin/python benchmarks/bench_exempt_bytes.py

``feedback=FrozenVariance(warmup=1, sparsity_warmup=0)`` (the study's default policy for AdamW,
with its warm-ups cut short) reaches the steady state of the study's second half at step 2.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Dict

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import horovod.torch as hvd  # noqa: E402

import hvd_gradcomp as gc  # noqa: E402
from benchmarks.study.tasks import make_task  # noqa: E402
from hvd_gradcomp.codecs.compressor import DEFAULT_MIN_COMPRESS_NUMEL  # noqa: E402

STEPS = 5


def measure(exempt: str) -> Dict[str, float]:
    task = make_task("transformer", seed=0, rank=hvd.rank())
    comp = gc.TopKQSGD(ratio=0.01, bits=8, seed=0, exempt=exempt,
                       feedback=gc.FrozenVariance(warmup=1, sparsity_warmup=0))
    opt = gc.DistributedOptimizer(task.optimizer, named_parameters=task.model.named_parameters(), compression=comp)
    hvd.broadcast_parameters(task.model.state_dict(), root_rank=0)
    raw = sum(p.numel() * p.element_size() for p in task.model.parameters())
    small = sum(p.numel() for p in task.model.parameters() if p.numel() < DEFAULT_MIN_COMPRESS_NUMEL)
    per_step, fused = [], []
    for _ in range(STEPS):
        opt.zero_grad()
        task.loss(task.model, *task.batch()).backward()
        opt.step()
        per_step.append(opt.last_step_bytes)
        # the fused allreduces: the exempt tensors (and, at step 1, Adam's dense warm-up)
        fused.append(sum(entry[1] for name, entry in opt.comm_stats.per_tensor.items() if name.startswith("fused.")))
    opt.remove_hooks()
    late = STEPS - 2
    return {"raw": raw, "small_values": small, "step": sum(per_step[2:]) / late, "exempt": (fused[-1] - fused[1]) / late}


def main() -> None:
    hvd.init()
    rows = {mode: measure(mode) for mode in ("fp32", "fp16")}
    if hvd.rank() == 0:
        r = rows["fp32"]
        print(f"transformer: {r['raw']:,} raw bytes per step, {r['small_values']:,} values in exempt tensors, "
              f"{hvd.size()} ranks, TopKQSGD(ratio=0.01, bits=8), steps 3-{STEPS}")
        print("| exempt | bytes per step | of which exempt tensors | fewer than fp32 |")
        print("| --- | ---: | ---: | ---: |")
        for mode, r in rows.items():
            print(f"| {mode} | {r['step']:,.0f} | {r['exempt']:,.0f} | {r['raw'] / r['step']:.1f}x |")


if __name__ == "__main__":
    main()
