"""Encode+decode time of each compressor as a ratio to ``x.clone()``, and payload sizes.

    .venv/bin/python benchmarks/bench_compressors.py            # 25M float32, as in the targets
    .venv/bin/python benchmarks/bench_compressors.py --numel 1000000 --repeat 3
    .venv/bin/python benchmarks/bench_compressors.py --threads 1   # steadier on a busy machine

All ratios come from one run on one tensor (this machine is noisy: compare within a run).
Kernels for large tensors are compiled (torch.compile) on first use; warm-up runs absorb
that cost. Targets (issue 3): QSGD-8 <= 3x, TopK 1% <= 3x, TopKQSGD(1%, 8) <= 3.5x clone;
size ratios TopKQSGD >= 150, QSGD 8/4/2-bit >= 3.9/7.8/15.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, List

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hvd_gradcomp import QSGD, TopK, TopKQSGD  # noqa: E402

TIME_TARGETS = {"QSGD(bits=8)": 3.0, "TopK(ratio=0.01)": 3.0, "TopKQSGD(ratio=0.01, bits=8)": 3.5}
SIZE_TARGETS = {"QSGD(bits=8)": 3.9, "QSGD(bits=4)": 7.8, "QSGD(bits=2)": 15.0,
                "TopKQSGD(ratio=0.01, bits=8)": 150.0}


def best_time(fn: Callable[[], object], repeat: int) -> float:
    times: List[float] = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--numel", type=int, default=25_000_000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads (default: torch's choice). With other jobs on the machine, "
                         "--threads 1 gives steadier ratios: a parallel loop waits for its slowest thread")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    x = torch.randn(args.numel)
    settings = [("QSGD(bits=8)", QSGD(bits=8, seed=0)), ("QSGD(bits=4)", QSGD(bits=4, seed=0)),
                ("QSGD(bits=2)", QSGD(bits=2, seed=0)), ("TopK(ratio=0.01)", TopK(ratio=0.01)),
                ("TopKQSGD(ratio=0.01, bits=8)", TopKQSGD(ratio=0.01, bits=8, seed=0))]
    for _ in range(args.warmup):
        x.clone()
    clone = best_time(x.clone, args.repeat)
    print(f"tensor: {args.numel:,} float32 ({4 * args.numel / 1e6:.0f} MB), torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; x.clone() = {clone * 1e3:.1f} ms")
    print()
    print("| compressor | encode ms | decode ms | enc+dec / clone | target | EF compress ms | EF compress / clone "
          "| size ratio | target |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    failures = []
    for label, c in settings:
        for _ in range(args.warmup):
            c.decode(c.encode(x))
        payload = c.encode(x)
        enc = best_time(lambda: c.encode(x), args.repeat)
        dec = best_time(lambda: c.decode(payload), args.repeat)
        for i in range(args.warmup):
            c.compress_named("bench", x)
        ef = best_time(lambda: c.compress_named("bench", x), args.repeat)
        ratio_t = (enc + dec) / clone
        size_ratio = 4 * args.numel / payload.numel()
        tt, st = TIME_TARGETS.get(label), SIZE_TARGETS.get(label)
        if tt and ratio_t > tt:
            failures.append(f"{label}: time {ratio_t:.2f}x > {tt}x")
        if st and size_ratio < st:
            failures.append(f"{label}: size ratio {size_ratio:.1f} < {st}")
        print(f"| {label} | {enc * 1e3:.1f} | {dec * 1e3:.1f} | {ratio_t:.2f}x | {f'<= {tt}x' if tt else '-'} | "
              f"{ef * 1e3:.1f} | {ef / clone:.2f}x | {size_ratio:.1f}x | {f'>= {st}x' if st else '-'} |")
    print()
    print("all targets met" if not failures else "MISSED: " + "; ".join(failures))


if __name__ == "__main__":
    main()
