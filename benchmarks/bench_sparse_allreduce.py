"""Bytes per rank of the sparse allreduce (issue 62, hvd_gradcomp/collectives/sparse_allreduce.py) against
today's sparse allgather, at 16 to 1,024 ranks simulated in one process
(hvd_gradcomp/collectives/simulate.py). No transport, no timing: the payloads' own bytes.

    .venv/bin/python benchmarks/bench_sparse_allreduce.py [--numel 65536] [--ratio 0.25] [--ranks 16 64 256 1024]

Each rank's gradient is a view of one random tensor (shifted per rank: different top-k sets, and
memory for one tensor instead of 1,024); TopK without error feedback (one step).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402

from hvd_gradcomp.auto.policy import sparse_allreduce_bytes, wire_bytes  # noqa: E402
from hvd_gradcomp.codecs.topk import TopK  # noqa: E402
from hvd_gradcomp.collectives.simulate import simulate  # noqa: E402
from hvd_gradcomp.collectives.sparse_allreduce import sparse_allreduce  # noqa: E402

STRIDE = 97


def measure(world: int, numel: int, ratio: float) -> Dict[str, float]:
    """One step at ``world`` simulated ranks: k, kept, bytes per rank (most, mean), the model's,
    and the allgather's (P-1) x a TopK payload."""
    base = torch.randn(numel + world * STRIDE, generator=torch.Generator().manual_seed(world))
    grads = [base[r * STRIDE:r * STRIDE + numel] for r in range(world)]
    outs = [torch.empty(numel) for _ in range(world)]
    start = time.perf_counter()
    runs = [sparse_allreduce(TopK(ratio=ratio, feedback="none"), [("w", g)], [o], world, r)
            for r, (g, o) in enumerate(zip(grads, outs))]
    kept, traffic = simulate(runs)
    if not all(torch.equal(outs[0], o) for o in outs[1:]):
        raise AssertionError("simulated ranks disagree")
    k = TopK(ratio=ratio).selected(numel)
    payload = TopK(ratio=ratio, feedback="none").compress_named("w", grads[0]).numel()
    return {"ranks": world, "k": k, "kept": kept[0][0].numel(), "most": traffic.most(),
            "mean": sum(traffic.per_rank()) / world, "model": sparse_allreduce_bytes(world, k),
            "allgather": wire_bytes("sparse", world, numel, payload), "seconds": time.perf_counter() - start}


def table(rows: List[Dict[str, float]]) -> str:
    head = "| ranks | k | kept K | bytes/rank (most) | mean | model | allgather (P-1)xS | allgather / this |"
    lines = [head, "|" + "---|" * 8]
    for r in rows:
        lines.append(f"| {r['ranks']} | {r['k']} | {r['kept']} | {r['most']:,.0f} | {r['mean']:,.0f} | "
                     f"{r['model']:,.0f} | {r['allgather']:,.0f} | {r['allgather'] / r['most']:.1f} |")
    return "\n".join(lines)


def main(argv: List[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=1 << 16)
    parser.add_argument("--ratio", type=float, default=0.25)
    parser.add_argument("--ranks", type=int, nargs="+", default=[16, 64, 256, 1024])
    args = parser.parse_args(argv)
    rows = [measure(w, args.numel, args.ratio) for w in args.ranks]
    print(f"TopK(ratio={args.ratio}) of {args.numel} float32 values, one step, payload bytes only")
    print(table(rows))


if __name__ == "__main__":
    main(sys.argv[1:])
