"""Bytes per rank per step: measured at 2, 4 and 8 ranks for every road, modelled up to 1024.

    .venv/bin/python benchmarks/bench_bytes_per_rank.py [--ranks 2,4,8] [--backend gloo]
    .venv/bin/python benchmarks/bench_bytes_per_rank.py --model-only     # no ranks started

Roads (see :mod:`hvd_gradcomp.policy`): ``dense`` and ``fp16`` (Horovod's allreduce), ``qsgd``
(QSGD 8-bit compressed allreduce of hvd_gradcomp.DistributedOptimizer), ``qsgd-ag`` (QSGD 8-bit
allgathered, as inside stock hvd.DistributedOptimizer), ``sparse`` (TopK 1% and TopKQSGD(1%, 8)
allgathered), and ``auto`` (gc.Auto's exploration steps and choices). The model: 3 Linear
layers, 1.05M parameters (8 ranks share 2 cores, so the tensors stay small).

Measured: *handed* is what each rank hands to Horovod's collectives per step (its own
payloads; for the alltoall, the chunks addressed to other ranks): flat in the rank count.
*wire*, when run as root, is what each rank really sends: the job runs in a fresh network
namespace and rank 0 reads the namespace's loopback counter (``/proc/net/dev``) around the
steps, divided by ranks and steps; it includes Horovod's negotiation and TCP headers.
Modelled: :func:`hvd_gradcomp.policy.wire_bytes` summed over the tensors, from the payload
sizes of the same model (tensors under 1,024 values go dense, fused), with the rank count
past which the sparse road sends more than each flat road.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Callable, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# (setting, path, road, label)
SETTINGS = [("none", "ours", "dense", "uncompressed"), ("fp16", "ours", "fp16", "fp16"),
            ("qsgd8", "ours", "qsgd", "QSGD 8-bit"), ("qsgd8", "stock", "qsgd-ag", "QSGD 8-bit, stock"),
            ("topk", "ours", "sparse", "TopK 1%"), ("topkqsgd", "ours", "sparse", "TopKQSGD(1%, 8)"),
            ("auto", "ours", "auto", "Auto")]
MODEL_RANKS = [2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
MIN_COMPRESS_NUMEL = 1024
STEPS = 3
WARMUP_AUTO = 5  # explore_steps=1 x 4 roads, then the decision


def build_model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 512),
                               torch.nn.ReLU(), torch.nn.Linear(512, 10))


def make_compression(setting: str):
    import horovod.torch as hvd

    import hvd_gradcomp as gc

    return {"none": lambda: None, "fp16": lambda: hvd.Compression.fp16, "qsgd8": lambda: gc.QSGD(bits=8),
            "topk": lambda: gc.TopK(ratio=0.01), "topkqsgd": lambda: gc.TopKQSGD(ratio=0.01, bits=8),
            "auto": lambda: gc.Auto(explore_steps=1)}[setting]()


def _lo_tx() -> Optional[int]:
    """Bytes sent on this network namespace's loopback so far (None when unreadable)."""
    try:
        for line in Path("/proc/net/dev").read_text().splitlines():
            name, _, rest = line.partition(":")
            if name.strip() == "lo":
                return int(rest.split()[8])
    except (OSError, IndexError, ValueError):
        pass
    return None


def worker(out: str, wire: bool) -> None:
    import horovod.torch as hvd
    import torch

    import hvd_gradcomp as gc

    hvd.init()
    torch.set_num_threads(1)
    rows = []
    for setting, path, road, label in SETTINGS:
        model = build_model()
        comp = make_compression(setting)
        wrap = gc.DistributedOptimizer if path == "ours" else hvd.DistributedOptimizer
        extra = {"min_compress_numel": MIN_COMPRESS_NUMEL} if path == "ours" else {}
        # lr 0: the bytes do not depend on learning, and the unbounded sum() loss cannot diverge
        opt = wrap(torch.optim.SGD(model.parameters(), lr=0.0), named_parameters=model.named_parameters(),
                   compression=comp, **extra)
        step = _stepper(model, opt)
        for _ in range(WARMUP_AUTO if setting == "auto" else 1):
            step()  # warm-up: first-call costs, Horovod's response cache; Auto: exploration
        hvd.allreduce(torch.zeros(1), name=f"barrier.a.{label}")
        tx0, handed0 = _lo_tx(), _handed(opt, comp, path)
        for _ in range(STEPS):
            step()
        hvd.allreduce(torch.zeros(1), name=f"barrier.b.{label}")
        tx1, handed = _lo_tx(), (_handed(opt, comp, path) - handed0) / STEPS
        raw = sum(p.numel() * 4 for p in model.parameters())
        row = {"label": label, "road": road, "raw": raw,
               "handed": hvd.allreduce(torch.tensor([float(handed)]), op=hvd.Max, name=f"max.{label}").item()}
        if wire and tx0 is not None and tx1 is not None:
            row["wire"] = (tx1 - tx0) / (hvd.size() * STEPS)
        if setting == "auto":
            row["report"] = comp.report()
        rows.append(row)
        if path == "ours":
            opt.remove_hooks()
    if hvd.rank() == 0:
        Path(out).write_text(json.dumps({"size": hvd.size(), "rows": rows}))


def _stepper(model, opt) -> Callable[[], None]:
    import torch

    x = torch.randn(4, 512)

    def step() -> None:
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
    return step


def _handed(opt, comp, path: str) -> float:
    """Bytes handed to Horovod so far: our optimizer counts them; stock: the compressor's payloads."""
    return opt.comm_stats.bytes_out if path == "ours" else comp.stats.bytes_out


def run(np_: int, backend: str, netns: Optional[str]) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "out.json")
        env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                   PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", HVDGC_COMPILE="0")
        argv = [str(Path(sys.executable).parent / "horovodrun"), "-np", str(np_), "-H", f"localhost:{np_}",
                f"--{backend}", sys.executable, __file__, "--worker", out] + (["--wire"] if netns else [])
        if netns:
            argv = ["ip", "netns", "exec", netns, *argv]
        subprocess.run(argv, env=env, check=True, timeout=900, stdout=subprocess.DEVNULL)
        return json.loads(Path(out).read_text())


def make_netns(rate: Optional[str]) -> Optional[str]:
    """A fresh namespace with only loopback (root only): its counter sees this job alone;
    ``rate`` (tc units, e.g. 1gbit) limits it."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return None
    name = f"hvdgc-bytes-{uuid.uuid4().hex[:6]}"
    ok = subprocess.run(["ip", "netns", "add", name], capture_output=True).returncode == 0
    ok = ok and subprocess.run(["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"],
                               capture_output=True).returncode == 0
    if ok and rate:
        ok = subprocess.run(["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate",
                             rate, "burst", "256kb", "latency", "50ms"], capture_output=True).returncode == 0
    if not ok:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
        return None
    return name


# ---------------------------------------------------------------- the model
def model_payloads() -> List[Dict[str, float]]:
    """Per tensor of the benchmark model: numel and the payload bytes of each road (one rank's)."""
    import torch

    import hvd_gradcomp as gc

    torch.manual_seed(1)
    out = []
    for name, p in build_model().named_parameters():
        g = torch.randn_like(p)
        pl = {"numel": p.numel()}
        if p.numel() >= MIN_COMPRESS_NUMEL:
            pl["qsgd"] = pl["qsgd-ag"] = gc.QSGD(bits=8, seed=0).encode(g).numel()
            pl["topk"] = gc.TopK(ratio=0.01, seed=0).encode(g).numel()
            pl["topkqsgd"] = gc.TopKQSGD(ratio=0.01, bits=8, seed=0).encode(g).numel()
        out.append(pl)
    return out


MODEL_ROWS = [("uncompressed", "dense", None), ("fp16", "fp16", None), ("QSGD 8-bit", "qsgd", "qsgd"),
              ("QSGD 8-bit, stock", "qsgd-ag", "qsgd-ag"), ("TopK 1%", "sparse", "topk"),
              ("TopKQSGD(1%, 8)", "sparse", "topkqsgd")]


def modelled(tensors: List[Dict[str, float]], road: str, key: Optional[str], ranks: int) -> float:
    """Modelled bytes each rank sends per step: small tensors dense (fused), the rest on ``road``."""
    from hvd_gradcomp.policy import wire_bytes

    total = 0.0
    for t in tensors:
        if key is None or key not in t:
            total += wire_bytes(road if key is None else "dense", ranks, int(t["numel"]))
        else:
            total += wire_bytes(road, ranks, int(t["numel"]), t[key])
    return total


def crossovers(tensors: List[Dict[str, float]]) -> Dict[str, Dict[str, Optional[int]]]:
    """For each sparse setting: the rank count past which it sends more than each flat road."""
    from hvd_gradcomp.policy import first_rank_where

    out = {}
    for label, _, key in MODEL_ROWS[4:]:
        out[label] = {other: first_rank_where(
            lambda p, r=road, k=okey: modelled(tensors, "sparse", key, p) > modelled(tensors, r, k, p))
            for other, road, okey in MODEL_ROWS[:3]}
    return out


def model_tables(tensors: List[Dict[str, float]]) -> str:
    lines = ["Modelled bytes each rank sends per step (ring algorithms; `hvd_gradcomp.policy.wire_bytes`):", "",
             "| road | setting | " + " | ".join(f"{p} ranks" for p in MODEL_RANKS) + " |",
             "| --- | --- | " + " | ".join("---:" for _ in MODEL_RANKS) + " |"]
    for label, road, key in MODEL_ROWS:
        lines.append(f"| {road} | {label} | " + " | ".join(_b(modelled(tensors, road, key, p)) for p in MODEL_RANKS)
                     + " |")
    lines += ["", "Crossover: the sparse allgather sends more than the flat road from this many ranks on:", "",
              "| sparse setting | vs " + " | vs ".join(lbl for lbl, _, _ in MODEL_ROWS[:3]) + " |",
              "| --- | " + " | ".join("---:" for _ in MODEL_ROWS[:3]) + " |"]
    for label, cross in crossovers(tensors).items():
        lines.append(f"| {label} | " + " | ".join("never" if c is None else str(c) for c in cross.values()) + " |")
    return "\n".join(lines)


def _b(v: float) -> str:
    return f"{v / 1e6:.2f} MB" if v >= 1e6 else f"{v / 1e3:.1f} kB"


def measured_table(results: Dict[int, dict], sizes: List[int]) -> str:
    rows0 = results[sizes[0]]["rows"]
    wire = all("wire" in r for n in sizes for r in results[n]["rows"])
    cols = [f"{n} ranks handed" for n in sizes] + ([f"{n} ranks wire" for n in sizes] if wire else [])
    lines = [f"Measured bytes per rank per step (max over ranks; raw float32 gradient {rows0[0]['raw']:,} B):", "",
             "| road | setting | " + " | ".join(cols) + " |", "| --- | --- | " + " | ".join("---:" for _ in cols) + " |"]
    for i, r in enumerate(rows0):
        vals = [_b(results[n]["rows"][i]["handed"]) for n in sizes]
        if wire:
            vals += [_b(results[n]["rows"][i]["wire"]) for n in sizes]
        lines.append(f"| {r['road']} | {r['label']} | " + " | ".join(vals) + " |")
    auto = [(n, results[n]["rows"][-1].get("report")) for n in sizes]
    lines += ["", "Auto's choices (Auto(explore_steps=1): one exploration step per road, then the decision):"]
    lines += [f"- {n} ranks: {rep['summary']}" for n, rep in auto if rep]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", default="2,4,8")
    ap.add_argument("--backend", default="gloo", choices=["gloo", "mpi"])
    ap.add_argument("--rate", default=None, help="limit the namespace's loopback (tc units, e.g. 1gbit)")
    ap.add_argument("--model-only", action="store_true", help="only the modelled table (starts no ranks)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--wire", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.wire)
        return
    if not args.model_only:
        sizes = [int(s) for s in args.ranks.split(",")]
        results = {}
        for n in sizes:
            netns = make_netns(args.rate)
            print(f"running {n} ranks ({args.backend}{', own network namespace' if netns else ''})...",
                  file=sys.stderr, flush=True)
            try:
                results[n] = run(n, args.backend, netns)
            finally:
                if netns:
                    subprocess.run(["ip", "netns", "del", netns], capture_output=True)
        print(measured_table(results, sizes))
        print()
    print(model_tables(model_payloads()))


if __name__ == "__main__":
    main()
