"""Synthetic benchmark, in the manner of Horovod's ``pytorch_synthetic_benchmark.py``.

A stack of square Linear layers sized by ``--params`` (25M by default) trains on one fixed
random batch: warm-up iterations, then timed iterations of ``--batches-per-iter`` steps.
Prints samples/s as mean +- 1.96 sigma per rank and in total, the time each step spends
inside ``synchronize()`` (exposed communication and decoding) and the bytes each rank hands
to Horovod per step. ``--json OUT`` writes the figures (rank 0) for the benchmark (``python -m benchmarks``).

Example::

    horovodrun -np 2 -H localhost:2 --gloo python examples/synthetic_benchmark.py \\
        --params 25e6 --compression topk-qsgd --ratio 0.01 --bits 8

``--optimizer stock`` times Horovod's own ``hvd.DistributedOptimizer`` instead (its
communication time is measured around an explicit ``synchronize()``).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train import add_compression_args, make_compression, resolve_config  # noqa: E402  (examples/train.py)
from models import build_model, iterations_for, layer_plan  # noqa: E402,F401  (shared with benchmarks/bench_ddp.py)

import horovod.torch as hvd  # noqa: E402
import hvd_gradcomp as gc  # noqa: E402
from hvd_gradcomp.config import CompressionConfig  # noqa: E402


def parse_args(argv: Optional[Sequence[str]] = None) -> Tuple[argparse.Namespace, CompressionConfig]:
    parser = argparse.ArgumentParser(description="Synthetic Horovod benchmark with gradient compression",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--params", type=float, default=25e6, help="approximate model size in parameters")
    parser.add_argument("--width", type=int, default=2048, help="width of the square Linear layers")
    parser.add_argument("--batch-size", type=int, default=4, help="samples per step per rank (small: cheap compute)")
    parser.add_argument("--warmup", type=int, default=3, help="warm-up iterations (not timed)")
    parser.add_argument("--iters", type=int, default=10, help="timed iterations (at least)")
    parser.add_argument("--min-seconds", type=float, default=0.0,
                        help="time more iterations, up to --max-iters, until about this many seconds are timed "
                             "(from the last warm-up step's time; fast settings otherwise get few samples)")
    parser.add_argument("--max-iters", type=int, default=60, help="most timed iterations --min-seconds may ask for")
    parser.add_argument("--batches-per-iter", type=int, default=1, help="optimizer steps per iteration")
    parser.add_argument("--optimizer", choices=("gc", "stock", "none"), default="gc",
                        help="gc: hvd_gradcomp.DistributedOptimizer; stock: hvd.DistributedOptimizer; none: no "
                             "exchange, each rank's own SGD step after a 1-float allreduce (the time a synchronous "
                             "step waits here for the slower rank with nothing to send: a reference, not training)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--json", default=None, help="write the results (rank 0) to this JSON file")
    parser.add_argument("--label", default=None, help="name of this setting in the JSON")
    parser.add_argument("--print-steps", action="store_true",
                        help="print every step's time (warm-up included) on rank 0: wall, in synchronize(), codec")
    add_compression_args(parser)
    args = parser.parse_args(argv)
    if args.params < 1000:
        parser.error(f"--params must be >= 1000, got {args.params:g}")
    for flag in ("width", "batch_size", "iters", "batches_per_iter", "threads"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")
    if args.min_seconds < 0 or args.max_iters < args.iters:
        parser.error(f"--min-seconds must be >= 0 and --max-iters >= --iters, got {args.min_seconds}, {args.max_iters}")
    cfg = resolve_config(args, parser)
    if args.optimizer != "gc" and cfg.accumulate != 1:
        parser.error(f"--optimizer {args.optimizer} is timed with --accumulate 1")
    if args.optimizer == "none" and cfg.compression != "none":
        parser.error(f"--optimizer none sends nothing to compress: use --compression none, got {cfg.compression!r}")
    return args, cfg


def make_optimizer(model: nn.Module, cfg: CompressionConfig, kind: str, min_numel: int,
                   args: Optional[argparse.Namespace] = None) -> Any:
    """The distributed optimizer under test (public API only); ``args``: the feedback and
    sparsity warm-up flags shared with train.py (``--feedback``, ``--warmup-steps``, ...)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    compression = cfg.make_compressor() if args is None else make_compression(
        cfg, "momentum" if args.momentum_correction else args.feedback, args.momentum_masking,
        args.warmup_steps, args.warmup_ratio)
    if kind == "none":
        pass  # no exchange: the ranks' models part ways (a timing reference, see StepTimer._plain_step)
    elif kind == "stock":
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                       compression=compression or hvd.Compression.none)
    else:
        opt = gc.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=compression,
                                      backward_passes_per_step=cfg.accumulate, min_compress_numel=min_numel)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    return opt


class StepTimer:
    """Runs one optimizer step and records its wall time, time in synchronize() and bytes sent."""

    def __init__(self, model: nn.Module, opt: Any, kind: str, cfg: CompressionConfig, batch: int,
                 width: int, seed: int) -> None:
        self.model, self.opt, self.kind, self.cfg = model, opt, kind, cfg
        g = torch.Generator().manual_seed(seed + hvd.rank())
        self.x = torch.randn(batch, width, generator=g)
        self.y = torch.randint(0, 1000, (batch,), generator=g)
        self.raw_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        self.acc = gc.GradientAccumulator(opt, steps=cfg.accumulate, micro_batch=batch) if kind == "gc" else None

    def step(self) -> Tuple[float, float, int, float, float]:
        """(seconds, seconds in synchronize, bytes this rank handed to Horovod, codec seconds, codec
        seconds inside synchronize); Horovod's own optimizer: no codec time is measured."""
        t0 = time.perf_counter()
        if self.kind != "gc":
            return (*self._plain_step(t0), 0.0, 0.0)
        before, timing = self.opt.comm_wait_s, self.opt.exchange_timing
        codec0, sync0 = timing.codec_s, timing.codec_sync_s
        for _ in range(self.cfg.accumulate):
            self.acc.backward(F.cross_entropy(self.model(self.x), self.y))
        return (time.perf_counter() - t0, self.opt.comm_wait_s - before, self.opt.last_step_bytes,
                timing.codec_s - codec0, timing.codec_sync_s - sync0)

    def _plain_step(self, t0: float) -> Tuple[float, float, int]:
        """A step of a plain optimizer: backward, its exchange (timed as "in synchronize()"), the step.
        ``stock``: Horovod's optimizer; ``none``: a 1-float allreduce in place of the exchange and
        each rank's own step, what every synchronous step waits for the slower rank on this machine
        with (almost) nothing to send."""
        stock = self.kind == "stock"
        self.opt.zero_grad()
        F.cross_entropy(self.model(self.x), self.y).backward()
        t1 = time.perf_counter()
        if stock:
            self.opt.synchronize()
        else:
            hvd.allreduce(torch.zeros(1), name="bench.barrier")
        comm = time.perf_counter() - t1
        with self.opt.skip_synchronize() if stock else contextlib.nullcontext():
            self.opt.step()
        sent = 4 if not stock else self.raw_bytes // 2 if self.cfg.compression == "fp16" else self.raw_bytes
        return time.perf_counter() - t0, comm, sent


def timed_iterations(args: argparse.Namespace, warm: Sequence[float]) -> int:
    """:func:`iterations_for` from rank 0's last warm-up step, the same count on every rank."""
    last = warm[-1] if warm else 0.0
    n = iterations_for(args.min_seconds, last, args.iters, args.max_iters, args.batches_per_iter)
    return int(hvd.broadcast(torch.tensor([n]), 0, name="bench.iters").item())


def confidence(values: List[float]) -> Tuple[float, float]:
    """(mean, 1.96 x population standard deviation), as Horovod's benchmark prints them.

    >>> confidence([1.0, 3.0])
    (2.0, 1.96)
    """
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / len(values)
    return mean, 1.96 * math.sqrt(var)


def run(args: argparse.Namespace, cfg: CompressionConfig) -> Dict[str, Any]:
    torch.manual_seed(cfg.seed)
    model = build_model(args.params, args.width)
    opt = make_optimizer(model, cfg, args.optimizer, args.min_compress_numel, args)
    timer = StepTimer(model, opt, args.optimizer, cfg, args.batch_size, args.width, cfg.seed)
    say = print if hvd.rank() == 0 else (lambda *a, **k: None)
    n_params = sum(p.numel() for p in model.parameters())
    say(f"Model: {len(model) // 2} x Linear({args.width}, {args.width}) + head, {n_params:,} parameters "
        f"({timer.raw_bytes / 1e6:.1f} MB of float32 gradients)")
    say(f"Batch size: {args.batch_size} per rank x {cfg.accumulate} accumulated, ranks: {hvd.size()}, "
        f"optimizer: {args.optimizer}, compression: {cfg.compression} ({cfg.make_compressor()!r})", flush=True)
    comp = getattr(opt, "compression", None) or getattr(opt, "_compression", None)
    counter = iter(range(1, 1 << 62))

    def step() -> Tuple[float, float, int, float, float]:
        st = timer.step()
        if args.print_steps:
            roads = comp.report()["summary"].split(";")[0] if isinstance(comp, gc.Auto) else ""
            say(f"step {next(counter)}: {1e3 * st[0]:.0f} ms, in synchronize() {1e3 * st[1]:.0f} ms, "
                f"codec {1e3 * st[3]:.0f} ms {roads}", flush=True)
        return st

    t_warm = time.perf_counter()
    warm = [step()[0] for _ in range(args.warmup * args.batches_per_iter)]
    say(f"Warm-up: {args.warmup} iterations, {time.perf_counter() - t_warm:.1f}s", flush=True)
    steps: List[Tuple[float, float, int, float, float]] = []
    rates: List[float] = []
    samples = args.batch_size * cfg.accumulate * args.batches_per_iter
    args.iters = timed_iterations(args, warm)
    for i in range(args.iters):
        t0 = time.perf_counter()
        for _ in range(args.batches_per_iter):
            steps.append(step())
        rate = samples / (time.perf_counter() - t0)
        rates.append(rate)
        say(f"Iter #{i}: {rate:.1f} samples/sec per rank", flush=True)
    return _report(args, cfg, model, timer, steps, rates, say, warm)


def _report(args: argparse.Namespace, cfg: CompressionConfig, model: nn.Module, timer: StepTimer,
            steps: List[Tuple[float, float, int, float, float]], rates: List[float], say: Any,
            warm: Sequence[float] = ()) -> Dict[str, Any]:
    mean, conf = confidence(rates)
    size = hvd.size()
    step_s, comm_s, codec_s, codec_sync_s = _across_ranks(
        [sum(st[i] for st in steps) / len(steps) for i in (0, 1, 3, 4)], "bench.times")
    every = _every_rank([st[1] for st in steps])
    last_in_s = float(every.min(dim=0).values.mean())
    bytes_step = sum(st[2] for st in steps) / len(steps)
    say(f"Samples/sec per rank: {mean:.1f} +-{conf:.1f}")
    say(f"Total samples/sec on {size} rank(s): {size * mean:.1f} +-{size * conf:.1f}")
    say(f"Step time: {step_s * 1e3:.1f} ms, of which in synchronize(): {comm_s * 1e3:.1f} ms "
        f"({100 * comm_s / step_s:.1f}%; {1e3 * (comm_s - last_in_s):.1f} ms of it waiting for the last rank to arrive)")
    say(f"Bytes handed to Horovod per step per rank: {bytes_step:,.0f} (raw gradients {timer.raw_bytes:,}, "
        f"ratio {timer.raw_bytes / bytes_step if bytes_step else 0:.1f}x)")
    comp = getattr(timer.opt, "compression", None) or getattr(timer.opt, "_compression", None)
    if isinstance(comp, gc.Auto):
        say(f"Auto: {comp.report()['summary']}")
    result = {
        "label": args.label or cfg.compression, "optimizer": args.optimizer, "config": vars_cfg(cfg),
        "compressor": repr(cfg.make_compressor()), "ranks": size, "params": sum(p.numel() for p in model.parameters()),
        "width": args.width, "batch_size": args.batch_size, "warmup": args.warmup, "iters": args.iters,
        "batches_per_iter": args.batches_per_iter, "samples_per_s_rank_mean": mean, "samples_per_s_rank_conf": conf,
        "samples_per_s_total_mean": size * mean, "samples_per_s_total_conf": size * conf,
        "step_s": step_s, "comm_s": comm_s, "comm_share": comm_s / step_s if step_s else 0.0,
        # codec: encode + decode wherever it ran; exposed: synchronize() minus the codec work done there
        "codec_s": codec_s, "exposed_comm_s": max(comm_s - codec_sync_s, 0.0),
        # the part of comm_s spent waiting for the last rank to enter synchronize() (load imbalance)
        "last_in_s": last_in_s, "imbalance_s": max(comm_s - last_in_s, 0.0),
        # per rank, per timed step: which rank arrives last, and how often (issue 13)
        "sync_s_per_rank": every.tolist(),
        "auto": comp.report() if isinstance(comp, gc.Auto) else None,
        "bytes_per_step": bytes_step, "raw_bytes_per_step": timer.raw_bytes,
        "ratio": timer.raw_bytes / bytes_step if bytes_step else 0.0,
        "step_times_s": [st[0] for st in steps], "warmup_step_times_s": list(warm), "torch": torch.__version__, "python": platform.python_version(),
    }
    if args.json and hvd.rank() == 0:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
    return result


def vars_cfg(cfg: CompressionConfig) -> Dict[str, Any]:
    return {"compression": cfg.compression, "ratio": cfg.ratio, "bits": cfg.bits, "accumulate": cfg.accumulate,
            "error_feedback": cfg.error_feedback, "seed": cfg.seed}


def _every_rank(sync_s: List[float]) -> torch.Tensor:
    """Every rank's time in ``synchronize()`` per timed step (ranks x steps), gathered once, after
    the timed steps. The mean over steps of each step's least is the time of the last rank to
    arrive (it waits for no one), so that ``comm_s`` minus it is the time the others spent waiting
    for that rank to finish its backward (load imbalance, not the network or the codec)."""
    return hvd.allgather(torch.tensor([sync_s], dtype=torch.float64), name="bench.sync_steps")


def _across_ranks(values: List[float], name: str) -> List[float]:
    """Means over ranks: the step and communication times the job saw."""
    return hvd.allreduce(torch.tensor(values, dtype=torch.float64), name=name).tolist()


def main(argv: Optional[Sequence[str]] = None) -> int:
    args, cfg = parse_args(argv)
    torch.set_num_threads(args.threads)
    hvd.init()
    run(args, cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
