"""Encode+decode time of each compressor as a ratio to ``x.clone()``, and payload sizes.

    .venv/bin/python benchmarks/bench_compressors.py            # 25M float32, as in the targets
    .venv/bin/python benchmarks/bench_compressors.py --numel 1000000 --repeat 3
    .venv/bin/python benchmarks/bench_compressors.py --threads 1   # steadier on a busy machine
    .venv/bin/python benchmarks/bench_compressors.py --road        # CPU per step and per stage, below

All ratios come from one run on one tensor (this machine is noisy: compare within a run).

``--road`` profiles the CPU cost of one training step of the synthetic model (square Linear
layers, ``--params``/``--width``, batch 4, one thread) in one process, min and median over
``--repeat`` interleaved steps: forward+backward alone; a DDP step (1-rank Gloo group) with a
no-op hook, with torch's PowerSGD hook (rank 1 and 4) and with our TopKQSGD(1%, 8) hook (CPU
of all threads, ``time.process_time``); and each stage of our TopKQSGD road on that model's
gradients as a 2-rank step sees it (this rank's encode, decode of the other rank's payload and the sum of both parts;
``time.thread_time`` around each stage's function).
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


# ---------------------------------------------------------------- --road: CPU per step and stage
STAGES = [  # (module, attribute, label): the functions of the TopKQSGD road, timed where they are looked up;
    # rows for functions a version does not have (or call) are left out, so that older checkouts run too
    ("feedback", "ResidualStore.compensate", "error-feedback add"),
    ("feedback", "ResidualStore.compensate_marked", "error-feedback add + top-k compare (fused)"),
    ("feedback.kernels", "momentum_marked", "momentum correction: velocity + error-feedback add + top-k compare (fused)"),
    ("codecs.kernels", "topk_indices", "top-k selection"),
    ("codecs.kernels", "topk", "top-k: candidates, k-th value, kept values"),
    ("wire", "encode_indices", "index encode"),
    ("codecs.kernels", "qsgd_encode", "QSGD encode"),
    ("codecs.kernels", "qsgd_decode", "QSGD decode (sent values; received values)"),
    ("wire", "assemble", "payload assembly + CRC32"),
    ("feedback", "subtract_sent", "error-feedback subtract"),
    ("compressors", "GradientCompressor._compress_finite", "= encode, this rank, total"),
    ("wire", "decode_indices", "index decode"),
    ("qsgd", "_read_qsgd", "values decode"),
    ("compressors", "GradientCompressor.decode_parts", "= decode of the other rank's payload, total"),
    ("reduce", "sum_parts", "sum of both parts into the gradient"),
]


def _stats(values: List[float]) -> str:
    return f"{min(values) * 1e3:8.1f} | {statistics.median(values) * 1e3:8.1f}"


def _wrap_stages(times: dict) -> None:
    import importlib
    for mod, attr, label in STAGES:
        try:
            owner = importlib.import_module(f"hvd_gradcomp.{mod}")
        except ImportError:   # a module an older checkout does not have
            continue
        *path, name = attr.split(".")
        for part in path:
            owner = getattr(owner, part)
        fn = getattr(owner, name, None)
        if fn is None:
            continue

        def timed(*a, _fn=fn, _label=label, **k):
            t0 = time.thread_time()
            try:
                return _fn(*a, **k)
            finally:
                times[_label] = times.get(_label, 0.0) + time.thread_time() - t0
        setattr(owner, name, timed)


def _ddp_steps(model_fn: Callable, batch: int, width: int) -> dict:
    """One step function per DDP setting, each on its own model (1-rank Gloo group)."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel as DDP
    from benchmarks.bench_ddp import _noop_hook  # annotated for DDP's check (no __future__ there)
    from hvd_gradcomp import ddp as gc_ddp
    if not dist.is_initialized():
        import socket
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)

    x, y = torch.randn(batch, width), torch.randint(0, 1000, (batch,))
    steps = {}
    for setting in ("DDP, no-op hook", "DDP + PowerSGD rank 1", "DDP + PowerSGD rank 4", "DDP + TopKQSGD(1%, 8)"):
        psgd = "PowerSGD" in setting
        model = DDP(model_fn(), bucket_cap_mb=1e5 if psgd else 25)  # PowerSGD on Gloo: one bucket (bench_ddp.py)
        if psgd:
            state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=int(setting[-1]), start_powerSGD_iter=2)
            model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        elif "TopKQSGD" in setting:
            gc_ddp.register(model, compression=TopKQSGD(ratio=0.01, bits=8))
        else:
            model.register_comm_hook(None, _noop_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        def step(model=model, opt=opt) -> None:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        steps[setting] = step
    return steps


def road(args: argparse.Namespace) -> None:
    import warnings
    import torch.nn.functional as F
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from models import build_model  # examples/models.py, as the speed benchmarks
    from hvd_gradcomp.collectives import reduce
    torch.set_num_threads(args.threads or 1)
    torch.manual_seed(0)
    model = build_model(args.params, args.width)
    x, y = torch.randn(4, args.width), torch.randint(0, 1000, (4,))
    warnings.filterwarnings("ignore", message=".*no optimizer was given.*")
    steps = _ddp_steps(lambda: build_model(args.params, args.width), 4, args.width)

    def fwd_bwd() -> None:
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
    fwd_bwd()
    grads = [(n, p.grad.clone()) for n, p in model.named_parameters() if p.numel() >= 1024]
    mine, theirs = TopKQSGD(ratio=0.01, bits=8, seed=0), TopKQSGD(ratio=0.01, bits=8, seed=1)
    outs = [torch.empty(g.numel()) for _, g in grads]
    stage_times: dict = {}

    other = [theirs._compress_finite(n, g * 0.5)[0] for n, g in grads]  # the other rank's payloads

    def codec_step() -> None:
        for (n, g), b, out in zip(grads, other, outs):
            _, carried = mine._compress_finite(n, g)   # this rank's part: not decoded (compress_carried)
            parts = [carried, *reduce.decode_payloads(mine, [b], 1, g.numel())]
            reduce.sum_parts(parts, True, g.numel(), g.dtype, out=out)

    _wrap_stages(stage_times)
    timed = {"forward + backward (no DDP)": (fwd_bwd, time.thread_time), "TopKQSGD road (stages below)":
             (codec_step, time.thread_time), **{k: (v, time.process_time) for k, v in steps.items()}}
    results: dict = {k: [] for k in timed}
    per_stage: dict = {label: [] for _, _, label in STAGES}
    for i in range(args.warmup + args.repeat):
        for key, (fn, clock) in timed.items():
            stage_times.clear()
            t0 = clock()
            fn()
            if i >= args.warmup:
                results[key].append(clock() - t0)
                if fn is codec_step:
                    for label in per_stage:
                        per_stage[label].append(stage_times.get(label, 0.0))
    n = sum(p.numel() for p in model.parameters())
    print(f"{n:,} parameters ({len(grads)} compressed tensors), batch 4, {torch.get_num_threads()} thread(s), "
          f"torch {torch.__version__}; CPU ms per step over {args.repeat} interleaved steps")
    print()
    print("| step | min | median |")
    print("| --- | ---: | ---: |")
    for key, values in results.items():
        print(f"| {key} | {_stats(values).replace('|', ' | ')} |")
    for label, values in per_stage.items():
        if not any(values):
            continue
        print(f"| {'&nbsp;' * 4}{label} | {_stats(values).replace('|', ' | ')} |")


if __name__ == "__main__":
    if "--road" in sys.argv:
        ap = argparse.ArgumentParser(description="CPU per training step and per stage of the TopKQSGD road")
        ap.add_argument("--road", action="store_true")
        ap.add_argument("--params", type=float, default=25e6)
        ap.add_argument("--width", type=int, default=2048)
        ap.add_argument("--repeat", type=int, default=9)
        ap.add_argument("--warmup", type=int, default=3)
        ap.add_argument("--threads", type=int, default=1)
        road(ap.parse_args())
    else:
        main()
