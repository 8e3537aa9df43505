"""The same compressor through every road, each driven the way the README shows a user would:
a 2-layer character transformer (437,760 parameters) trained with AdamW for 300 steps, the rate
set each step through ``param_groups[i]["lr"]`` (linear warm-up over 30 steps, then cosine to a
tenth), a plain ``zero_grad()`` / ``backward()`` / ``step()`` loop, and on the Horovod roads the
optimizer wrapped, then ``hvd.broadcast_parameters`` and ``hvd.broadcast_optimizer_state``.

Roads: uncompressed ``hvd.DistributedOptimizer``; ``TopKQSGD(ratio=0.01, bits=8, seed=s)`` inside
stock ``hvd.DistributedOptimizer``; the same through ``hvd_gradcomp.DistributedOptimizer``; the
same as a DDP communication hook (``hvd_gradcomp.ddp.register(model, ..., optimizer=opt)``).
Feedback is left to its default everywhere ('frozen' for AdamW). Writes one JSON per run into
docs/data/wrapper_check and the page docs/WRAPPER_CHECK.md::

    python benchmarks/study/wrapper_check.py --seeds 0,1,2          # 12 runs of 2 ranks
    python benchmarks/study/wrapper_check.py --render-only          # the page from the JSON files
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "docs" / "data" / "wrapper_check"
PAGE = ROOT / "docs" / "WRAPPER_CHECK.md"
ROADS = {"none": "uncompressed `hvd.DistributedOptimizer`",
         "stock": "stock `hvd.DistributedOptimizer(compression=TopKQSGD)`",
         "gc": "`hvd_gradcomp.DistributedOptimizer(compression=TopKQSGD)`",
         "ddp": "DDP, `hvd_gradcomp.ddp.register(compression=TopKQSGD, optimizer=opt)`"}
STEPS, WARMUP, PEAK, CONTEXT, BATCH = 300, 30, 2e-3, 64, 16


def lr_at(step: int) -> float:
    """Linear warm-up to ``PEAK``, then cosine to a tenth of it.

    >>> round(lr_at(0) / PEAK, 4), round(lr_at(WARMUP - 1) / PEAK, 4), round(lr_at(STEPS) / PEAK, 4)
    (0.0333, 1.0, 0.1)
    """
    if step < WARMUP:
        return PEAK * (step + 1) / WARMUP
    done = min(1.0, (step - WARMUP) / (STEPS - WARMUP))
    return PEAK * (0.1 + 0.45 * (1.0 + math.cos(math.pi * done)))


def _model():
    import torch.nn as nn
    sys.path.insert(0, str(ROOT))
    from benchmarks.study.tasks import CharTransformer

    model = CharTransformer(d=128, layers=2, heads=4, context=CONTEXT)
    model.head = nn.Linear(128, model.head.out_features, bias=False)   # as the issue's user wrote it
    return model


def worker(road: str, seed: int) -> Dict[str, Any]:
    """One run on this rank (started by horovodrun or torchrun); the record, on every rank."""
    import torch
    import torch.nn.functional as F

    sys.path[:0] = [str(ROOT / "examples"), str(ROOT)]
    import data as datasets
    import hvd_gradcomp as gc
    from benchmarks.study.loop import wrap_as_user

    torch.set_num_threads(1)
    hvd = None
    if road == "ddp":
        import torch.distributed as dist
        dist.init_process_group("gloo")
        rank = dist.get_rank()
    else:
        import horovod.torch as hvd
        hvd.init()
        rank = hvd.rank()
    torch.manual_seed(seed)
    net = _model()
    train, val = datasets.load_text(400_000)
    g = torch.Generator().manual_seed(1000 * seed + rank)
    starts = torch.randint(0, len(val) - CONTEXT - 1, (512,), generator=torch.Generator().manual_seed(1))
    offs = torch.arange(CONTEXT)
    vx, vy = val[starts[:, None] + offs], val[starts[:, None] + offs + 1]
    opt = torch.optim.AdamW(net.parameters(), lr=PEAK, weight_decay=0.1)
    comp = None if road == "none" else gc.TopKQSGD(ratio=0.01, bits=8, seed=seed)
    model, opt, state = wrap_as_user(road, net, opt, comp, None if road == "ddp" else hvd)
    raw = sum(p.numel() * p.element_size() for p in net.parameters())
    counter = _Bytes(road, opt, comp, state, raw)
    sent: List[int] = []
    t0 = time.perf_counter()
    for step in range(STEPS):
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        s = torch.randint(0, len(train) - CONTEXT - 1, (BATCH,), generator=g)
        x, y = train[s[:, None] + offs], train[s[:, None] + offs + 1]
        opt.zero_grad()
        out = model(x)
        F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1)).backward()
        opt.step()
        sent.append(counter.step())
    wall = time.perf_counter() - t0
    with torch.no_grad():
        net.eval()
        out = net(vx)
        val_loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), vy.reshape(-1)).item()
    flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    if road == "ddp":
        every = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
        dist.all_gather(every, flat)
    else:
        every = list(hvd.allgather(flat[None]))
    half = sent[len(sent) // 2:]
    return {"road": road, "seed": seed, "steps": STEPS, "val_loss": val_loss, "parameters": int(flat.numel()),
            "identical": all(bool(torch.equal(every[0], e)) for e in every),
            "ratio_second_half": raw * len(half) / max(1, sum(half)), "wall_s": wall,
            "feedback": getattr(getattr(comp, "feedback", None), "key", None)}


class _Bytes:
    """Bytes this rank handed to the collectives in the last step, on each road."""

    def __init__(self, road: str, opt: Any, comp: Any, state: Any, raw: int) -> None:
        self.road, self.opt, self.comp, self.state, self.raw, self._seen = road, opt, comp, state, raw, 0

    def step(self) -> int:
        if self.road == "none":
            return self.raw
        if self.road == "gc":
            return self.opt.last_step_bytes
        if self.road == "ddp":
            return self.state.last_step_bytes
        now = self.comp.stats.bytes_out          # stock road: the compressor's own count, all steps
        sent, self._seen = now - self._seen, now
        return sent


def command(road: str, seed: int) -> List[str]:
    """The 2-rank job of one run: horovodrun for the Horovod roads, torchrun for DDP."""
    bin_dir = Path(sys.executable).parent
    me = [sys.executable, str(Path(__file__).resolve()), "--worker", road, "--seed", str(seed)]
    if road == "ddp":
        return [str(bin_dir / "torchrun"), "--standalone", "--nproc-per-node", "2", *me[1:]]
    return [str(bin_dir / "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo", *me]


def run(roads: List[str], seeds: List[int], timeout: int) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for seed in seeds:
        for road in roads:
            t0 = time.time()
            print(f"[wrapper_check] {road} seed {seed} ...", flush=True)
            res = subprocess.run(command(road, seed), cwd=ROOT, timeout=timeout, capture_output=True, text=True,
                                 env={**os.environ, "PYTHONPATH": str(ROOT)})
            if res.returncode != 0:
                sys.exit(f"{road} seed {seed} failed ({res.returncode}):\n{res.stdout[-4000:]}\n{res.stderr[-4000:]}")
            rec = json.loads((OUT / f"{road}-s{seed}.json").read_text())
            print(f"[wrapper_check] {road} seed {seed}: held-out loss {rec['val_loss']:.4f}, "
                  f"{rec['ratio_second_half']:.0f}x, identical {rec['identical']} ({time.time() - t0:.0f} s)", flush=True)


def render() -> str:
    """docs/WRAPPER_CHECK.md from the JSON files: per road, the mean held-out loss over seeds, its gap to
    uncompressed, the uncompressed seed spread beside it, the bytes ratio and whether ranks ended identical."""
    recs: Dict[str, Dict[int, Dict[str, Any]]] = {}
    for path in sorted(OUT.glob("*.json")):
        r = json.loads(path.read_text())
        recs.setdefault(r["road"], {})[r["seed"]] = r
    base = recs.get("none", {})
    spread = (max(r["val_loss"] for r in base.values()) - min(r["val_loss"] for r in base.values())) if base else 0.0
    base_mean = statistics.mean(r["val_loss"] for r in base.values()) if base else float("nan")
    rows = ["| road | seeds | held-out loss (mean) | vs uncompressed | per seed | second-half bytes ratio | "
            "replicas identical |", "| --- | ---: | ---: | ---: | --- | ---: | --- |"]
    for road, label in ROADS.items():
        runs = recs.get(road)
        if not runs:
            continue
        mean = statistics.mean(r["val_loss"] for r in runs.values())
        gap = "" if road == "none" else f"{100 * (mean / base_mean - 1):+.2f}%"
        per = ", ".join(f"{runs[s]['val_loss']:.3f}" for s in sorted(runs))
        ratio = statistics.mean(r["ratio_second_half"] for r in runs.values())
        same = "yes" if all(r["identical"] for r in runs.values()) else "**no**"
        rows.append(f"| {label} | {len(runs)} | {mean:.4f} | {gap} | {per} | {ratio:.0f}x | {same} |")
    params = next((r["parameters"] for runs in recs.values() for r in runs.values()), 0)
    return "\n".join([
        "# Wrapper check: every road driven as a user drives it", "",
        "Generated by `python benchmarks/study/wrapper_check.py` (`--render-only` redraws it from "
        "`docs/data/wrapper_check`); do not edit by hand.", "",
        f"A 2-layer character transformer ({params:,} parameters) on the standard library's sources, AdamW "
        f"(lr {PEAK:g}, weight decay 0.1), {STEPS} steps of {BATCH} sequences per rank on 2 ranks, the rate set "
        f"each step through `param_groups` ({WARMUP}-step linear warm-up, then cosine to a tenth), the "
        "broadcasts after wrapping, a plain `zero_grad()`/`backward()`/`step()` loop. Compressed roads: "
        "`TopKQSGD(ratio=0.01, bits=8, seed=s)` with the default feedback ('frozen').", "",
        *rows, "",
        f"Uncompressed seed spread (max - min held-out loss over its seeds): {spread:.4f} "
        f"({100 * spread / base_mean:.2f}% of its mean).", ""])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--roads", default=",".join(ROADS), help=f"comma-separated, of {list(ROADS)}")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per run")
    ap.add_argument("--render-only", action="store_true")
    ap.add_argument("--worker", choices=list(ROADS), help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        rec = worker(args.worker, args.seed)
        rank = int(os.environ.get("HOROVOD_RANK", os.environ.get("RANK", "0")))
        if rank == 0:
            OUT.mkdir(parents=True, exist_ok=True)
            (OUT / f"{args.worker}-s{args.seed}.json").write_text(json.dumps(rec, indent=1) + "\n")
        return 0
    if not args.render_only:
        roads = args.roads.split(",")
        bad = [r for r in roads if r not in ROADS]
        if bad:
            ap.error(f"unknown roads {bad}; choose from {list(ROADS)}")
        run(roads, [int(s) for s in args.seeds.split(",")], args.timeout)
    PAGE.write_text(render())
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
