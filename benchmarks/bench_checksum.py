"""What the payload CRC32 and the overflow-safe QSGD norms cost: encode time, in-process.

    .venv/bin/python benchmarks/bench_checksum.py                  # 25M float32
    .venv/bin/python benchmarks/bench_checksum.py --numel 1000000 --threads 1

For each compressor, the best encode time (``checksum=False``), the best time of the CRC32
of the payload it produced (what ``checksum=True`` adds to each encode, and again to each
decode), and the CRC's share of the encode. Timing the CRC alone, rather than the difference
of two encode timings, keeps the figure meaningful on a busy machine. The compressors' default
(``checksum=None``) turns the CRC on where the share is under 5%. ``--norms`` also times the QSGD norm arithmetic on its own, as now (float64
square root, capped) against the old float32 square root, on one bucket norm per 512 values.
Kernels for large tensors are compiled on first use; warm-up runs absorb that cost.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable, List

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hvd_gradcomp import QSGD, TopK, TopKQSGD, wire  # noqa: E402
from hvd_gradcomp.codecs import kernels  # noqa: E402

def best_time(fn: Callable[[], object], repeat: int, warmup: int) -> float:
    """Best of ``repeat`` runs: on a shared machine the fastest run is the least disturbed."""
    for _ in range(warmup):
        fn()
    times: List[float] = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--numel", type=int, default=25_000_000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    ap.add_argument("--norms", action="store_true", help="also time the QSGD norm arithmetic alone")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    x = torch.randn(args.numel)
    print(f"tensor: {args.numel:,} float32, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| compressor | encode (ms) | payload (MB) | CRC32 of the payload (ms) | CRC share of encode | default |")
    print("| --- | --- | --- | --- | --- | --- |")
    for label, make in [("QSGD(bits=8)", lambda c: QSGD(bits=8, seed=0, error_feedback=False, checksum=c)),
                        ("TopK(ratio=0.01)", lambda c: TopK(ratio=0.01, error_feedback=False, checksum=c)),
                        ("TopKQSGD(ratio=0.01, bits=8)",
                         lambda c: TopKQSGD(ratio=0.01, bits=8, seed=0, error_feedback=False, checksum=c))]:
        plain = make(False)
        t_plain = best_time(lambda: plain.encode(x), args.repeat, args.warmup)
        payload = plain.encode(x)
        t_crc = best_time(lambda: wire.payload_crc32(payload), args.repeat, args.warmup)
        default = "on" if make(None)._checksummed else "off"
        print(f"| {label} | {t_plain * 1e3:.1f} | {payload.numel() / 1e6:.2f} | {t_crc * 1e3:.2f} | "
              f"{t_crc / t_plain:.2%} | {default} |")
    if args.norms:
        sq = torch.rand(args.numel // 512, dtype=torch.float64) * 512
        cap = kernels.norm_cap(torch.float32)
        t_old = best_time(lambda: sq.to(torch.float32).sqrt(), args.repeat * 20, args.warmup)
        t_new = best_time(lambda: kernels._norms(sq, cap), args.repeat * 20, args.warmup)
        t_enc = best_time(lambda: kernels.qsgd_encode(x, 8, 512, 0), args.repeat, args.warmup)
        print(f"QSGD norms of {sq.numel():,} buckets: float32 sqrt {t_old * 1e3:.3f} ms, float64 sqrt + cap "
              f"{t_new * 1e3:.3f} ms; difference {(t_new - t_old) / t_enc:+.2%} of a QSGD-8 encode "
              f"({t_enc * 1e3:.1f} ms)")


if __name__ == "__main__":
    main()
