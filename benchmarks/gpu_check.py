"""The codecs and the DDP hook on a GPU: one short script, results as JSON and a page.

The test suite runs on CPU (this project's CI machine has no GPU); this script checks what
only a GPU can show, in a few minutes, and writes ``gpu_check.json``:

* **codecs**: every compressor encodes and decodes CUDA tensors on the device, and its
  payload is byte-identical to the one the CPU writes for the same input and seed (so a
  CPU rank and a GPU rank, or a checkpoint moved between them, agree); error feedback keeps
  ``sum(sent) + residual == sum(gradients)``;
* **host syncs**: how many device-to-host synchronisations one encode and one decode make
  (``torch.cuda.set_sync_debug_mode``), since each one stalls the GPU's queue;
* **compiled kernels**: ``HVDGC_COMPILE=1`` (Triton) and ``=0`` (eager) give the same payloads;
* **speed**: encode and decode of a 25M-parameter model's gradients (six 2048x2048 tensors),
  CUDA-event timed, median of repeats;
* **deterministic mode**: the codecs run under ``torch.use_deterministic_algorithms(True)``;
* **DDP training**: the hook on NCCL (one rank) and on Gloo with CUDA tensors (two ranks on
  the one GPU, when this torch's Gloo takes CUDA tensors): uncompressed, TopKQSGD(1%, 8) and
  Auto, with momentum SGD and AdamW; the two ranks end with identical parameters; a
  checkpointed run resumes bit-identically.

Usage::

    python benchmarks/gpu_check.py --out runs/gpu            # on a machine with a GPU
    python benchmarks/gpu_check.py --out runs/gpu --device cpu   # the same checks on CPU
    python benchmarks/gpu_check.py --render runs/gpu/gpu_check.json --page benchmarks/results/GPU.md

Every check is recorded with ``ok`` and its figures; a check that raises is recorded with
its error and the others still run.
"""
from __future__ import annotations

import argparse
import copy
import hashlib
import datetime
import json
import queue as queue_mod
import os
import platform
import socket
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import hvd_gradcomp as gc  # noqa: E402

CODECS: Dict[str, Callable[[], Any]] = {
    "QSGD 8-bit": lambda: gc.QSGD(bits=8, seed=7),
    "QSGD 4-bit": lambda: gc.QSGD(bits=4, seed=7),
    "QSGD 2-bit": lambda: gc.QSGD(bits=2, seed=7),
    "TopK 1%": lambda: gc.TopK(ratio=0.01, seed=7),
    "TopKQSGD(1%, 8)": lambda: gc.TopKQSGD(ratio=0.01, bits=8, seed=7),
    "TopKQSGD(0.1%, 8)": lambda: gc.TopKQSGD(ratio=0.001, bits=8, seed=7),
}
SHAPES = [(2048, 2048), (1000,), (3, 333, 7)]


class Recorder:
    """Runs each check, keeps its result or its error, and saves after every check."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.results: Dict[str, Any] = {"checks": {}}

    def run(self, name: str, fn: Callable[[], Dict[str, Any]]) -> None:
        t0 = time.perf_counter()
        try:
            out = fn()
        except Exception as exc:  # recorded, and the next check still runs
            out = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc(limit=6)}
        out["seconds"] = round(time.perf_counter() - t0, 2)
        self.results["checks"][name] = out
        print(f"[{'ok' if out.get('ok') else 'FAIL'}] {name} ({out['seconds']} s): "
              f"{ {k: v for k, v in out.items() if k not in ('trace', 'ok', 'seconds')} }", flush=True)
        self.save()

    def save(self) -> None:
        self.path.write_text(json.dumps(self.results, indent=1, default=str))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_codecs(device: torch.device) -> Dict[str, Any]:
    """Payload bytes on the device equal the CPU's; decode lands on the device; errors bounded."""
    rows, ok = [], True
    for label, make in CODECS.items():
        for shape in SHAPES:
            g = torch.Generator().manual_seed(hash((label, shape)) % 2**31)
            x_cpu = torch.randn(shape, generator=g)
            x = x_cpu.to(device)
            c_dev, c_cpu = make(), make()
            p_dev = c_dev.encode(x, name="w")
            p_cpu = c_cpu.encode(x_cpu, name="w")
            y = c_dev.decode(p_dev)
            same_bytes = p_dev.numel() == p_cpu.numel() and bool(torch.equal(p_dev.cpu(), p_cpu))
            cross = c_cpu.decode(p_dev.cpu())  # a GPU payload read on CPU
            placed = y.device == x.device and y.dtype == x.dtype and tuple(y.shape) == tuple(shape)
            rel = float((y - x).norm() / x.norm())
            # Decoding may round differently on the device (fused multiply-add): same values to float32's precision.
            cross_diff = float((cross - y.cpu()).abs().max() / x_cpu.abs().max())
            row_ok = placed and bool(torch.isfinite(y).all()) and cross_diff < 1e-6
            ok &= row_ok
            rows.append({"codec": label, "shape": list(shape), "payload_bytes": p_dev.numel(),
                         "payload_equal_cpu": same_bytes, "decoded_on_device": placed, "cpu_decode_diff": cross_diff,
                         "rel_error": round(rel, 4), "ok": row_ok})
    return {"ok": ok, "rows": rows, "payloads_equal_cpu": all(r["payload_equal_cpu"] for r in rows)}


def check_feedback(device: torch.device) -> Dict[str, Any]:
    """Error feedback over 30 rounds: sum of what was sent + residual == sum of gradients."""
    rows, ok = [], True
    for label in ("TopK 1%", "TopKQSGD(1%, 8)", "QSGD 4-bit"):
        c = CODECS[label]()
        g = torch.Generator(device=device).manual_seed(3)
        total = torch.zeros(4096, 256, device=device, dtype=torch.float64)
        sent = torch.zeros_like(total)
        for _ in range(30):
            grad = torch.randn(4096, 256, device=device, generator=g)
            total += grad.double()
            sent += c.decode(c.compress_named("w", grad)).double()
        residual = c.state_dict()["residuals"]["w"].to(device).double().view_as(total)
        err = float((sent + residual - total).norm() / total.norm())
        row_ok = err < 1e-5
        ok &= row_ok
        rows.append({"codec": label, "rel_error_of_identity": err, "ok": row_ok})
    return {"ok": ok, "rows": rows}


def count_syncs(device: torch.device, fn: Callable[[], Any]) -> int:
    """Device-to-host synchronisations ``fn`` makes (CUDA's sync debug mode, one warning each)."""
    if device.type != "cuda":
        return -1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
            sync(device)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def check_syncs(device: torch.device) -> Dict[str, Any]:
    rows = []
    x = torch.randn(2048, 2048, device=device)
    for label, make in CODECS.items():
        c = make()
        c.encode(x, name="w")  # first call: compile and allocate outside the count
        p = c.encode(x, name="w")
        c.decode(p)
        rows.append({"codec": label, "encode": count_syncs(device, lambda: c.encode(x, name="w")),
                     "decode": count_syncs(device, lambda: c.decode(p)),
                     "compress_named": count_syncs(device, lambda: c.compress_named("w", x))})
    return {"ok": True, "rows": rows}


def timed(device: torch.device, fn: Callable[[], Any], repeats: int = 7) -> float:
    """Median milliseconds of ``fn`` (CUDA events on GPU, perf_counter on CPU), after a warm-up."""
    fn()
    sync(device)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def check_speed(device: torch.device, params: int) -> Dict[str, Any]:
    """Encode (with error feedback) and decode of a ``params``-parameter model's gradients."""
    n = max(1, params // (2048 * 2048))
    grads = [torch.randn(2048, 2048, device=device) for _ in range(n)]
    rows = []
    for label, make in CODECS.items():
        c = make()
        payloads: List[torch.Tensor] = []

        def encode_all() -> None:
            payloads[:] = [c.compress_named(f"w{i}", g) for i, g in enumerate(grads)]

        enc = timed(device, encode_all)
        dec = timed(device, lambda: [c.decode(p) for p in payloads])
        raw = sum(g.numel() * 4 for g in grads)
        rows.append({"codec": label, "encode_ms": round(enc, 2), "decode_ms": round(dec, 2),
                     "ratio": round(raw / sum(p.numel() for p in payloads), 1)})
    fp16 = timed(device, lambda: [g.half() for g in grads])
    return {"ok": True, "params": n * 2048 * 2048, "rows": rows, "fp16_cast_ms": round(fp16, 2)}


def check_compile(device: torch.device) -> Dict[str, Any]:
    """Compiled (HVDGC_COMPILE=1) and eager (=0) kernels write the same payloads and residuals."""
    out = {}
    x = torch.randn(2048, 2048, device=device)
    for mode in ("0", "1"):
        os.environ["HVDGC_COMPILE"] = mode
        c = gc.TopKQSGD(ratio=0.01, bits=8, seed=1)
        ps = [c.compress_named("w", x * (k + 1)) for k in range(3)]
        q = gc.QSGD(bits=4, seed=1)
        out[mode] = (ps, c.state_dict()["residuals"]["w"].cpu(), q.encode(x, name="w"),
                     timed(device, lambda: c.compress_named("w", x)))
    os.environ["HVDGC_COMPILE"] = "auto"
    same = all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(out["0"][0], out["1"][0]))
    same_res = bool(torch.allclose(out["0"][1], out["1"][1], rtol=0, atol=1e-6))
    same_q = bool(torch.equal(out["0"][2].cpu(), out["1"][2].cpu()))
    return {"ok": same and same_res and same_q, "payloads_equal": same, "residuals_equal": same_res,
            "qsgd_equal": same_q, "eager_ms": round(out["0"][3], 2), "compiled_ms": round(out["1"][3], 2)}


def check_deterministic(device: torch.device) -> Dict[str, Any]:
    """The codecs under torch.use_deterministic_algorithms(True), and two runs agree."""
    torch.use_deterministic_algorithms(True, warn_only=False)
    try:
        results = []
        for _ in range(2):
            c = gc.TopKQSGD(ratio=0.01, bits=8, seed=5)
            x = torch.randn(512, 1024, device=device, generator=torch.Generator(device=device).manual_seed(1))
            p = [c.compress_named("w", x), c.compress_named("w", x)]
            parts = [c.decode_parts(q) for q in p]
            acc = torch.zeros(x.numel(), device=device)
            for idx, vals in parts:
                acc.index_add_(0, idx, vals)
            results.append((p, acc))
    finally:
        torch.use_deterministic_algorithms(False)
    same = all(torch.equal(a, b) for a, b in zip(results[0][0], results[1][0]))
    return {"ok": same and bool(torch.equal(results[0][1], results[1][1])), "payloads_repeat": same}


# --------------------------------------------------------------------------- DDP
def _ddp_worker(rank: int, world: int, backend: str, device_type: str, port: int, queue: Any) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from hvd_gradcomp import ddp as gc_ddp

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    device = torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu")
    torch.set_num_threads(1)
    results: Dict[str, Any] = {}
    try:
        runs = os.environ.get("GPU_CHECK_RUNS", "none/sgd,none/adamw,topkqsgd/sgd,topkqsgd/adamw,auto/sgd,auto/adamw")
        for run in runs.split(","):
            setting, opt_name = run.split("/")
            results[run] = _train(rank, world, device, setting, opt_name, DDP, gc_ddp)
        if os.environ.get("GPU_CHECK_RESUME", "1") == "1":
            results["resume"] = _resume(rank, world, device, DDP, gc_ddp)
        queue.put((rank, results, None))
    except Exception:
        queue.put((rank, results, traceback.format_exc(limit=8)))
    finally:
        dist.destroy_process_group()


def _model(device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                               torch.nn.ReLU(), torch.nn.Linear(512, 10)).to(device)


def _batch(step: int, rank: int, device: torch.device) -> Any:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(64, 64, generator=g)
    teacher = torch.Generator().manual_seed(99)
    w = torch.randn(64, 10, generator=teacher)
    return x.to(device), (x @ w).argmax(1).to(device)


def _make(setting: str, opt_name: str, net: torch.nn.Module, DDP: Any, gc_ddp: Any, device: torch.device) -> Any:
    model = DDP(net, device_ids=[device.index] if device.type == "cuda" else None)
    opt = (torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9) if opt_name == "sgd"
           else torch.optim.AdamW(net.parameters(), lr=2e-3, weight_decay=0.01))
    state = None
    if setting != "none":
        comp = (gc.Auto() if setting == "auto" else
                gc.TopKQSGD(ratio=0.01, bits=8, seed=11, feedback="classic" if setting == "classic" else "auto"))
        state = gc_ddp.register(model, compression=comp, optimizer=opt)
    return model, opt, state


def _train(rank: int, world: int, device: torch.device, setting: str, opt_name: str, DDP: Any, gc_ddp: Any,
           steps: int = 300) -> Dict[str, Any]:
    net = _model(device)
    model, opt, state = _make(setting, opt_name, net, DDP, gc_ddp, device)
    losses, trace = [], []  # trace: a hash of the parameters every 10 steps
    t0 = time.perf_counter()
    for step in range(steps):
        x, y = _batch(step, rank, device)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step % 10 == 9:
            trace.append(hashlib.sha256(torch.cat([p.detach().reshape(-1) for p in net.parameters()])
                                        .cpu().numpy().tobytes()).hexdigest()[:12])
    sync(device)
    flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()]).cpu()
    out = {"final_loss": statistics.mean(losses[-30:]), "first_loss": losses[0],
           "ms_per_step": round((time.perf_counter() - t0) / steps * 1e3, 2), "params": hashlib.sha256(flat.numpy().tobytes()).hexdigest(), "trace": trace}
    if state is not None:
        out["bytes_ratio"] = state.comm_stats.summary() if hasattr(state.comm_stats, "summary") else None
    return out


def _resume(rank: int, world: int, device: torch.device, DDP: Any, gc_ddp: Any) -> Dict[str, Any]:
    """30 steps, checkpoint, 20 more; a fresh process state loads the checkpoint and redoes the 20."""
    def run(steps: range, ckpt: Optional[Dict[str, Any]] = None) -> Any:
        net = _model(device)
        model, opt, state = _make("topkqsgd", "sgd", net, DDP, gc_ddp, device)
        if ckpt is not None:
            net.load_state_dict(ckpt["model"])
            opt.load_state_dict(ckpt["opt"])
            state.load_state_dict(ckpt["hook"])
        for step in steps:
            x, y = _batch(step, rank, device)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        return {"model": copy.deepcopy(net.state_dict()), "opt": copy.deepcopy(opt.state_dict()),
                "hook": copy.deepcopy(state.state_dict())}

    first = run(range(30))
    straight = run(range(50))
    resumed = run(range(30, 50), ckpt=first)
    same = all(torch.equal(straight["model"][k], resumed["model"][k]) for k in resumed["model"])
    return {"bit_identical": same}


def check_ddp(device: torch.device, backend: str, world: int, timeout: float = 300) -> Dict[str, Any]:
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_ddp_worker, args=(r, world, backend, device.type, port, queue)) for r in range(world)]
    for p in procs:
        p.start()
    got: Dict[int, Any] = {}
    deadline = time.time() + timeout
    try:
        while len(got) < world and time.time() < deadline:
            try:
                rank, res, err = queue.get(timeout=5)
                got[rank] = (res, err)
            except queue_mod.Empty:
                if any(p.exitcode not in (None, 0) for p in procs) and len(got) < world:
                    time.sleep(2)
                    if queue.empty():
                        break
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    if len(got) < world:
        return {"ok": False, "error": f"{world - len(got)} rank(s) gave no result (exit codes "
                                      f"{[p.exitcode for p in procs]})"}
    errors = {r: e for r, (_, e) in got.items() if e}
    res0 = got[0][0]
    rows = []
    base = {o: res0.get(f"none/{o}", {}).get("final_loss") for o in ("sgd", "adamw")}
    for key, r in res0.items():
        if key == "resume":
            continue
        same_ranks = all(r["params"] == got[k][0][key]["params"] for k in got if key in got[k][0])
        opt_name = key.split("/")[1]
        gap = (r["final_loss"] / base[opt_name] - 1) if base[opt_name] else None
        first_diff = next((10 * (i + 1) for i, h in enumerate(r["trace"])
                           if any(got[k][0][key]["trace"][i] != h for k in got)), None)
        rows.append({"run": key, "first_divergent_step": first_diff, "first_loss": round(r["first_loss"], 4), "final_loss": round(r["final_loss"], 4),
                     "gap_vs_uncompressed": None if gap is None else round(gap, 4),
                     "ranks_identical": same_ranks, "ms_per_step": r["ms_per_step"]})
    resume = res0.get("resume", {}).get("bit_identical")
    ok = not errors and all(r["ranks_identical"] and r["final_loss"] < 0.7 * r["first_loss"] for r in rows) \
        and resume is not False
    return {"ok": ok, "backend": backend, "world": world, "rows": rows, "resume_bit_identical": resume,
            "errors": errors}


def environment(device: torch.device) -> Dict[str, Any]:
    env = {"torch": torch.__version__, "python": platform.python_version(), "device": str(device),
           "date": datetime.date.today().isoformat()}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
        try:
            import triton
            env["triton"] = triton.__version__
        except ImportError:
            env["triton"] = None
    return env


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, help="folder for gpu_check.json")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    ap.add_argument("--params", type=float, default=25e6, help="model size of the speed check")
    ap.add_argument("--ddp-timeout", type=float, default=300, help="seconds each DDP check may take")
    ap.add_argument("--only", help="run only the checks whose name contains this (e.g. DDP)")
    ap.add_argument("--render", type=Path, nargs="+",
                    help="gpu_check.json files to render as a page: a full run, then any later partial reruns")
    ap.add_argument("--page", type=Path, default=ROOT / "benchmarks" / "results" / "GPU.md")
    args = ap.parse_args(argv)
    if args.render:
        from benchmarks.gpu_page import render
        args.page.write_text(render([(json.loads(p.read_text()), p) for p in args.render]))
        print(f"wrote {args.page}")
        return 0
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("no CUDA device: run with --device cpu to do the same checks on CPU")
    args.out.mkdir(parents=True, exist_ok=True)
    rec = Recorder(args.out / "gpu_check.json")
    rec.results["environment"] = environment(device)
    env = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("GPU_CHECK_"))
    rec.results["command"] = (env + " " if env else "") + "python benchmarks/gpu_check.py " + \
        " ".join(argv if argv is not None else sys.argv[1:])
    checks: Dict[str, Callable[[], Dict[str, Any]]] = {
        "codecs": lambda: check_codecs(device),
        "error feedback": lambda: check_feedback(device),
        "host syncs": lambda: check_syncs(device),
        "compiled kernels": lambda: check_compile(device),
        "deterministic mode": lambda: check_deterministic(device),
        "speed": lambda: check_speed(device, int(args.params)),
    }
    if device.type == "cuda":
        checks["DDP, NCCL, 1 rank"] = lambda: check_ddp(device, "nccl", 1, args.ddp_timeout)
    checks["DDP, Gloo, 2 ranks"] = lambda: check_ddp(device, "gloo", 2, args.ddp_timeout)
    for name, fn in checks.items():
        if args.only is None or args.only.lower() in name.lower():
            rec.run(name, fn)
    failed = [k for k, v in rec.results["checks"].items() if not v.get("ok")]
    print("all checks passed" if not failed else f"FAILED: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
