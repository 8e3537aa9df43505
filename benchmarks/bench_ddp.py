"""DDP speed: uncompressed, torch's fp16 and PowerSGD hooks, and hvd-gradcomp's hook, on one model.

The synthetic model of ``examples/synthetic_benchmark.py`` (square Linear layers, 25M
parameters by default) trains on a fixed random batch under each setting in turn, in one
``torchrun`` job. Per setting it prints the step time (mean over ranks), the CPU time of each
rank's process per step (all its threads, mean over ranks: on a shared machine, the figure load
disturbs least), the share of the step that communication adds (step time minus the step time
with a no-op hook that sends nothing, over the step time) and the bytes each rank hands to the
collectives per step.

    torchrun --standalone --nproc-per-node 2 benchmarks/bench_ddp.py --json runs/ddp.json
    torchrun --standalone --nproc-per-node 2 benchmarks/bench_ddp.py --quick     # a smoke test

PowerSGD runs with ``start_powerSGD_iter = max(2, --warmup)``: torch's docs ask for at least 2
with error feedback (DDP rebuilds its buckets after the first iteration) and the warm-up
iterations are not timed, so every timed step is compressed, as in training after its
warm-up; ``min_compression_rate`` keeps torch's default. Under Gloo, PowerSGD gets one bucket
(see ``ONE_BUCKET_MB``); with NCCL every setting uses ``--bucket-cap-mb``. Run it on a rate-limited link as
``python -m benchmarks`` does (benchmarks/results/BENCHMARKS.md) for the 1 Gbit/s rows.
"""
# No `from __future__ import annotations`: DDP checks a hook's annotations as real objects.

import argparse
import datetime
import json
import os
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
from models import build_model, iterations_for  # noqa: E402  (examples/models.py)

import hvd_gradcomp as gc  # noqa: E402
from hvd_gradcomp import ddp as gc_ddp  # noqa: E402

# torch's PowerSGD hook issues its second allreduce from a future callback and waits on it
# there; under Gloo those callbacks run on the group's worker threads, and with several
# buckets the job hung or aborted here. One bucket keeps it working on CPU (no overlap).
ONE_BUCKET_MB = 1e5
# gc-powersgd-4: hvd-gradcomp's gc.PowerSGD(rank=4) in its hook, beside torch's powersgd-4; the hook
# issues its second rounds on a second process group, so it keeps --bucket-cap-mb under Gloo too.
SETTINGS = ("ddp", "fp16", "powersgd-1", "powersgd-4", "gc-powersgd-4", "topkqsgd", "qsgd8")
# gc.Auto() in the hook: on request (--settings ...,auto). Its start runs in the warm-up: DDP's
# first iteration, its bucket rebuild (exploration restarts), then Auto's start (exploring, the
# decision, 1 untimed and 2 verified steps: gc.Auto().start_steps, see docs/AUTO.md) and one step to spare.
CHOICES = SETTINGS + ("auto",)
AUTO_WARMUP = 1 + gc.Auto().start_steps + 1


def _noop_hook(_: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def register(setting: str, model: DDP, warmup: int) -> Callable[[int], int]:
    """Register ``setting``'s hook; returns steps -> bytes this rank handed over in them."""
    raw = sum(p.numel() * p.element_size() for p in model.parameters())
    if setting == "noop":
        model.register_comm_hook(None, _noop_hook)
        return lambda steps: 0
    if setting == "ddp":
        return lambda steps: raw * steps
    if setting == "fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return lambda steps: raw // 2 * steps
    if setting.startswith("powersgd-"):
        state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=int(setting.split("-")[1]),
                                            start_powerSGD_iter=max(2, warmup))
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        before = [0]

        def powersgd_bytes(steps: int) -> int:  # elements after compression (P, Q, uncompressed), float32
            total = state.compression_stats()[2] * 4
            sent, before[0] = total - before[0], total
            return sent
        return powersgd_bytes
    compression = {"topkqsgd": lambda: gc.TopKQSGD(ratio=0.01, bits=8), "auto": gc.Auto,
                   "gc-powersgd-4": lambda: gc.PowerSGD(rank=4), "qsgd8": lambda: gc.QSGD(bits=8)}[setting]()
    hook_state = gc_ddp.register(model, compression=compression)
    totals = [0]

    def ours(steps: int) -> int:
        sent, totals[0] = hook_state.comm_stats.bytes_out - totals[0], hook_state.comm_stats.bytes_out
        return sent
    return ours


def time_setting(setting: str, args: argparse.Namespace) -> Dict[str, Any]:
    torch.manual_seed(0)
    cap = args.bucket_cap_mb
    if setting.startswith("powersgd") and dist.get_backend() == "gloo":
        cap = ONE_BUCKET_MB
    model = DDP(build_model(args.params, args.width), bucket_cap_mb=cap)
    sent = register(setting, model, args.warmup)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(args.batch_size, args.width, generator=g), torch.randint(0, 1000, (args.batch_size,), generator=g)

    def step() -> float:
        t0 = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        return time.perf_counter() - t0

    for _ in range(max(2, args.warmup, AUTO_WARMUP if setting == "auto" else 0)):
        last = step()
    iters = torch.tensor([iterations_for(args.min_seconds, last, args.iters, args.max_iters)])
    dist.broadcast(iters, 0)  # rank 0's count on every rank: the steps are collectives
    iters = int(iters)
    sent(0)  # start counting bytes here
    cpu0 = time.process_time()
    times = [step() for _ in range(iters)]
    cpu_s = _mean_over_ranks((time.process_time() - cpu0) / iters)
    step_s = _mean_over_ranks(sum(times) / len(times))
    return {"setting": setting, "step_s": step_s, "cpu_s": cpu_s, "bytes_per_step": sent(iters) / iters,
            "raw_bytes_per_step": sum(p.numel() * 4 for p in model.parameters()), "iters": iters}


def _mean_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--params", type=float, default=25e6, help="approximate model size in parameters")
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=4, help="samples per step per rank (small: cheap compute)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per setting (>= 2)")
    p.add_argument("--iters", type=int, default=10, help="timed steps per setting (at least)")
    p.add_argument("--min-seconds", type=float, default=0.0,
                   help="time more steps, up to --max-iters, until about this many seconds are timed")
    p.add_argument("--max-iters", type=int, default=60)
    p.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated subset of {', '.join(CHOICES)}")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP bucket size (PowerSGD on Gloo: one bucket)")
    p.add_argument("--quick", action="store_true", help="a 0.3M-parameter model, 2 timed steps: a smoke test")
    p.add_argument("--json", default=None, help="write the rows (rank 0)")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    args.settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    unknown = sorted(set(args.settings) - set(CHOICES))
    if unknown:
        p.error(f"unknown settings {unknown}; choose from {', '.join(CHOICES)}")
    if args.quick:
        args.params, args.width, args.warmup, args.iters = 3e5, 256, 2, 2
    if args.iters < 1 or args.warmup < 0:
        p.error("--iters must be >= 1 and --warmup >= 0")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=10))
    rank0 = dist.get_rank() == 0
    noop = time_setting("noop", args)
    base = noop["step_s"]
    rows: List[Dict[str, Any]] = []
    if rank0:
        print(f"{dist.get_world_size()} ranks, no-op hook (no communication): {base * 1e3:.1f} ms/step, "
              f"{noop['cpu_s'] * 1e3:.1f} CPU ms/step")
        print(f"{'setting':<12} {'step ms':>9} {'CPU ms':>8} {'comm share':>11} {'bytes/step':>14} {'ratio':>8}",
              flush=True)
    for setting in args.settings:
        r = time_setting(setting, args)
        r["comm_share"] = max(0.0, (r["step_s"] - base) / r["step_s"])
        r["ratio"] = r["raw_bytes_per_step"] / r["bytes_per_step"] if r["bytes_per_step"] else 0.0
        rows.append(r)
        if rank0:
            print(f"{setting:<12} {r['step_s'] * 1e3:>9.1f} {r['cpu_s'] * 1e3:>8.1f} {100 * r['comm_share']:>10.1f}% "
                  f"{r['bytes_per_step']:>14,.0f} {r['ratio']:>7.1f}x", flush=True)
    if rank0 and args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump({"noop_step_s": base, "ranks": dist.get_world_size(), "params": args.params,
                       "rows": rows, "torch": torch.__version__}, fh, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    # Every result is written and flushed by now. The interpreter's teardown after this job
    # occasionally aborts ("terminate called without an active exception": 3 of 33 runs of --quick
    # on the 2-core machine): a Gloo worker thread frees a finished allreduce whose tensor holds the
    # last reference to a Python object, needs the GIL while Python finalizes, and is ended with
    # pthread_exit through a noexcept C++ frame (PyTorch's exit race, seen in a core dump). That
    # would turn a finished benchmark into a failed one: leave without the teardown. (The hook's
    # own callbacks are waited for at exit, see docs/DDP.md "Never blocking"; this exit also
    # covers the benchmark's own collectives.)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
