"""Bytes each rank hands to Horovod per step, at 2, 4 and 8 ranks, per compressor and path.

    .venv/bin/python benchmarks/bench_bytes_per_rank.py [--ranks 2,4,8] [--backend gloo]

Paths: ``ours`` is hvd_gradcomp.DistributedOptimizer (allgather for sparse payloads, the
alltoall + allgather compressed allreduce for QSGD, small tensors fused uncompressed);
``stock`` is the unmodified hvd.DistributedOptimizer with the same compressor (every
payload allgathered). Bytes are what this rank contributes to the collectives (its own
payloads; for the alltoall, the chunks addressed to other ranks), so they should stay flat
as ranks are added. The model: 3 Linear layers, 1.05M parameters (8 ranks share 2 cores).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SETTINGS = ["none", "fp16", "qsgd8", "qsgd4", "topk", "topkqsgd"]


def worker(out: str) -> None:
    import horovod.torch as hvd
    import torch

    import hvd_gradcomp as gc

    hvd.init()
    torch.set_num_threads(1)
    makers = {"none": lambda: None, "fp16": lambda: hvd.Compression.fp16, "qsgd8": lambda: gc.QSGD(bits=8),
              "qsgd4": lambda: gc.QSGD(bits=4), "topk": lambda: gc.TopK(ratio=0.01),
              "topkqsgd": lambda: gc.TopKQSGD(ratio=0.01, bits=8)}
    rows = []
    for setting in SETTINGS:
        for path in ("ours", "stock"):
            if path == "stock" and setting in ("none", "fp16"):
                continue
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 512),
                                        torch.nn.ReLU(), torch.nn.Linear(512, 10))
            comp = makers[setting]()
            wrap = gc.DistributedOptimizer if path == "ours" else hvd.DistributedOptimizer
            opt = wrap(torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=model.named_parameters(),
                       compression=comp)
            model(torch.randn(4, 512)).sum().backward()
            opt.step()
            raw = sum(p.numel() * 4 for p in model.parameters())
            sent = opt.last_step_bytes if path == "ours" else comp.stats.bytes_out
            rows.append({"setting": setting, "path": path, "raw": raw,
                         "sent": hvd.allreduce(torch.tensor([float(sent)]), op=hvd.Max).item()})
            if path == "ours":
                opt.remove_hooks()
    if hvd.rank() == 0:
        Path(out).write_text(json.dumps({"size": hvd.size(), "rows": rows}))


def run(np_: int, backend: str) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "out.json")
        env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                   PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
        argv = [str(Path(sys.executable).parent / "horovodrun"), "-np", str(np_), "-H", f"localhost:{np_}",
                f"--{backend}", sys.executable, __file__, "--worker", out]
        subprocess.run(argv, env=env, check=True, timeout=600, stdout=subprocess.DEVNULL)
        return json.loads(Path(out).read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", default="2,4,8")
    ap.add_argument("--backend", default="gloo", choices=["gloo", "mpi"])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker)
        return
    sizes = [int(s) for s in args.ranks.split(",")]
    results = {}
    for n in sizes:
        print(f"running {n} ranks ({args.backend})...", file=sys.stderr, flush=True)
        results[n] = run(n, args.backend)
    rows0 = results[sizes[0]]["rows"]
    print(f"bytes per rank per step (max over ranks); raw float32 gradient: {rows0[0]['raw']:,} B")
    print()
    print("| compressor | path | " + " | ".join(f"{n} ranks" for n in sizes) + " | ratio at " + str(sizes[-1]) + " |")
    print("| --- | --- | " + " | ".join("---" for _ in sizes) + " | --- |")
    for i, r in enumerate(rows0):
        sents = [results[n]["rows"][i]["sent"] for n in sizes]
        print(f"| {r['setting']} | {r['path']} | " + " | ".join(f"{int(s):,}" for s in sents)
              + f" | {r['raw'] / sents[-1]:.1f}x |")


if __name__ == "__main__":
    main()
