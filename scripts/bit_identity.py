"""Prove that a refactor leaves training bit-identical: fingerprints of the weights after training.

A small fixed model (an embedding, an MLP, and biases small enough for the float16 small-tensor
wrapper) is trained on 2 ranks through every wrapper and codec, using only the public API as README.md
shows it:

* ``ours``: ``gc.DistributedOptimizer`` under ``horovodrun --gloo -np 2``;
* ``stock``: Horovod's own ``hvd.DistributedOptimizer`` with a ``gc`` compressor (no PowerSGD, no ``clip=``:
  both are refused there);
* ``ddp``: ``gc_ddp.register`` on a ``DistributedDataParallel`` model, Gloo, under
  ``python -m torch.distributed.run --standalone --nproc-per-node 2``;

times QSGD 4 and 8 bits, TopK 5%, TopKQSGD 5%/8 bits and PowerSGD rank 2, times SGD with momentum
and AdamW (plus TopKQSGD with ``clip=1.0`` on ``ours`` and ``ddp``), for enough steps that AdamW's
default ``frozen`` feedback passes its 100-step dense warm-up. Each case's record holds the SHA-256 of
the parameters' bytes after training (rank 0's; ``ranks_identical`` says whether every rank ended with
the same), and of the compressor's ``state_dict()`` (the DDP hook state's on ``ddp``), per rank.
All cases of one wrapper run inside one job: 3 jobs in all.

Use it across a refactor (the script imports ``hvd_gradcomp`` from the checkout it lives in)::

    git worktree add /tmp/base <old-commit>
    cp scripts/bit_identity.py /tmp/base/scripts/
    (cd /tmp/base && python scripts/bit_identity.py --out /tmp/base.json)
    python scripts/bit_identity.py --out /tmp/new.json
    python scripts/bit_identity.py --compare /tmp/base.json /tmp/new.json   # exit 1 if any case differs
    git worktree remove /tmp/base

``--wrappers ours,ddp`` runs only those wrappers. ``--worker WRAPPER OUTFILE`` is the rank side (internal).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path[:1]:
    sys.path.insert(0, str(ROOT))   # the checkout this script lives in, before any installed copy

WRAPPERS = ("ours", "stock", "ddp")
STEPS = 130          # AdamW's default "frozen" feedback is dense for its first 100 optimizer steps
BATCH, SEQ = 16, 8   # per rank and step: 16 sequences of 8 tokens
BUCKET_MB = 0.05     # DDP: several buckets for a ~32k-parameter model
JOB_TIMEOUT_S = 600.0
WORLD = 2

CODECS = ("qsgd4", "qsgd8", "topk", "topkqsgd", "powersgd")
OPTIMIZERS = ("sgd", "adamw")


# ---------------------------------------------------------------- the cases (rank side)
def make_compression(codec: str) -> Any:
    import hvd_gradcomp as gc
    return {"qsgd4": lambda: gc.QSGD(bits=4, seed=11),
            "qsgd8": lambda: gc.QSGD(bits=8, seed=12),
            "topk": lambda: gc.TopK(ratio=0.05, seed=13),
            "topkqsgd": lambda: gc.TopKQSGD(ratio=0.05, bits=8, seed=14),
            "topkqsgd-clip": lambda: gc.TopKQSGD(ratio=0.05, bits=8, clip=1.0, seed=15),
            "powersgd": lambda: gc.PowerSGD(rank=2, seed=16)}[codec]()


def make_optimizer(name: str, params: Any) -> Any:
    import torch
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-3)


def cases(wrapper: str) -> List[Tuple[str, str]]:
    """(codec, optimizer) pairs of ``wrapper``, in the order they run."""
    out = [(c, o) for c in CODECS for o in OPTIMIZERS if not (wrapper == "stock" and c == "powersgd")]
    if wrapper != "stock":
        out.append(("topkqsgd-clip", "adamw"))
    return out


def make_model() -> Any:
    import torch
    import torch.nn as nn

    class Net(nn.Module):
        """Embedding(200, 32) -> mean -> 32-256-64-10 MLP: three weights over 1,024 values (compressed),
        the head's weight and the biases under it (the small-tensor wrapper)."""

        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(200, 32)
            self.fc1 = nn.Linear(32, 256)
            self.fc2 = nn.Linear(256, 64)
            self.head = nn.Linear(64, 10)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            h = self.emb(tokens).mean(dim=1)
            return self.head(torch.relu(self.fc2(torch.relu(self.fc1(h)))))

    torch.manual_seed(0)
    return Net()


def batch(rank: int, step: int) -> Any:
    import torch
    g = torch.Generator().manual_seed(100_003 * step + 17 * rank + 1)
    return torch.randint(0, 200, (BATCH, SEQ), generator=g), torch.randint(0, 10, (BATCH,), generator=g)


def weights_hash(model: Any) -> str:
    h = hashlib.sha256()
    for _, p in model.named_parameters():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _feed(h: Any, value: Any) -> None:
    """Feed ``value`` to ``h`` deterministically: dicts in sorted key order, tensors as bytes."""
    import numpy as np
    import torch
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        h.update(f"tensor{tuple(t.shape)}{t.dtype}:".encode())
        flat = t.reshape(-1)
        flat = flat.to(torch.uint8) if t.dtype == torch.bool else flat.view(torch.uint8)   # bfloat16 too
        h.update(flat.numpy().tobytes())
    elif isinstance(value, np.ndarray):
        h.update(f"ndarray{value.shape}{value.dtype}:".encode())
        h.update(np.ascontiguousarray(value).tobytes())
    elif isinstance(value, dict):
        h.update(b"{")
        for key in sorted(value, key=repr):
            h.update(repr(key).encode() + b":")
            _feed(h, value[key])
            h.update(b",")
        h.update(b"}")
    elif isinstance(value, (list, tuple)):
        h.update(b"[" if isinstance(value, list) else b"(")
        for item in value:
            _feed(h, item)
            h.update(b",")
        h.update(b"]")
    elif isinstance(value, (bytes, bytearray)):
        h.update(b"bytes:" + bytes(value))
    elif value is None or isinstance(value, (bool, int, float, str)):
        h.update(repr(value).encode())
    elif hasattr(value, "__dict__") and not callable(value):
        h.update(f"<{type(value).__name__}>".encode())
        _feed(h, dict(vars(value)))
    else:
        h.update(_ADDRESS.sub("", repr(value)).encode())


def state_hash(obj: Any) -> Optional[str]:
    if not callable(getattr(obj, "state_dict", None)):
        return None
    h = hashlib.sha256()
    _feed(h, obj.state_dict())
    return h.hexdigest()


def train_horovod(wrapper: str, codec: str, optimizer: str, hvd: Any) -> Tuple[Any, Any]:
    import torch.nn.functional as F

    import hvd_gradcomp as gc
    model = make_model()
    comp = make_compression(codec)
    opt = make_optimizer(optimizer, model.parameters())
    wrap = gc.DistributedOptimizer if wrapper == "ours" else hvd.DistributedOptimizer
    opt = wrap(opt, named_parameters=model.named_parameters(), compression=comp)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    for step in range(STEPS):
        x, y = batch(hvd.rank(), step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return model, comp


def train_ddp(codec: str, optimizer: str) -> Tuple[Any, Any]:
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hvd_gradcomp import ddp as gc_ddp
    model = DDP(make_model(), bucket_cap_mb=BUCKET_MB)
    opt = make_optimizer(optimizer, model.parameters())
    state = gc_ddp.register(model, compression=make_compression(codec), optimizer=opt)
    for step in range(STEPS):
        x, y = batch(dist.get_rank(), step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return model.module, state


def worker(wrapper: str, outfile: Path) -> None:
    """One rank: every case of ``wrapper`` in turn; rank 0 writes ``outfile``."""
    import warnings

    import torch

    import hvd_gradcomp as gc
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")   # the policies' one-time notes; the fingerprints say what matters
    if wrapper == "ddp":
        import datetime

        import torch.distributed as dist
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
        rank = dist.get_rank()

        def gather(obj: Any) -> List[Any]:
            out: List[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(out, obj)
            return out
    else:
        import horovod.torch as hvd
        hvd.init()
        rank = hvd.rank()
        gather = hvd.allgather_object
    if rank == 0:
        print(f"[bit_identity] {wrapper}: hvd_gradcomp from {Path(gc.__file__).resolve().parent}", flush=True)
    results: Dict[str, Any] = {}
    name = ""
    try:
        for codec, optimizer in cases(wrapper):
            name = f"{wrapper}/{codec}/{optimizer}"
            t0 = time.perf_counter()
            if wrapper == "ddp":
                model, stateful = train_ddp(codec, optimizer)
            else:
                model, stateful = train_horovod(wrapper, codec, optimizer, hvd)
            mine = {"weights": weights_hash(model), "state": state_hash(stateful)}
            every = gather(mine)
            results[name] = {"weights": every[0]["weights"],
                             "ranks_identical": all(r["weights"] == every[0]["weights"] for r in every),
                             "state": [r["state"] for r in every]}
            if rank == 0:
                print(f"[bit_identity] {name}: {time.perf_counter() - t0:.1f}s", flush=True)
    except BaseException:
        print(f"[rank {rank}] FAILED in {name}", file=sys.stderr, flush=True)
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)   # the launcher then stops the other rank instead of leaving it in a collective
    if rank == 0:
        meta = {"package": str(Path(gc.__file__).resolve().parent)}
        outfile.write_text(json.dumps({"meta": meta, "cases": results}, indent=1, sort_keys=True))
    if wrapper == "ddp":
        dist.destroy_process_group()
    else:
        hvd.shutdown()


# ---------------------------------------------------------------- the launcher
def rank_env() -> Dict[str, str]:
    """As the test harness's: this checkout first on PYTHONPATH, Open MPI allowed as root, one thread,
    eager kernels, and no stray HVDGC_* setting from the caller's shell."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HVDGC_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    env["OMP_NUM_THREADS"] = "1"
    env["HVDGC_COMPILE"] = "0"
    return env


def job_argv(wrapper: str, outfile: Path) -> List[str]:
    program = [sys.executable, str(Path(__file__).resolve()), "--worker", wrapper, str(outfile)]
    if wrapper == "ddp":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WORLD),
                *program[1:]]
    horovodrun = str(Path(sys.executable).parent / "horovodrun")
    return [horovodrun, "-np", str(WORLD), "-H", f"localhost:{WORLD}", "--gloo", *program]


def _kill_group(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=10)
            return
        except subprocess.TimeoutExpired:
            continue


def run_wrapper(wrapper: str, timeout: float) -> Dict[str, Any]:
    """Run ``wrapper``'s job; return its cases. Exits 2, with every rank's output, when the job fails."""
    with tempfile.TemporaryDirectory(prefix="bitid-") as tmp:
        outfile = Path(tmp) / f"{wrapper}.json"
        argv = job_argv(wrapper, outfile)
        t0 = time.perf_counter()
        proc = subprocess.Popen(argv, cwd=str(ROOT), env=rank_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout)
            failed = f"exited {proc.returncode}" if proc.returncode else ""
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            out, _ = proc.communicate()
            failed = f"timed out after {timeout:.0f}s"
        except BaseException:
            _kill_group(proc)
            raise
        if not failed and not outfile.exists():
            failed = "wrote no result"
        if failed:
            print(f"{wrapper}: {' '.join(argv)} {failed}\n--- output of all ranks ---\n{out}", file=sys.stderr)
            sys.exit(2)
        data = json.loads(outfile.read_text())
    package = Path(data["meta"]["package"])
    if package != ROOT / "hvd_gradcomp":
        print(f"{wrapper}: the ranks imported hvd_gradcomp from {package}, not from {ROOT}:\n{out}", file=sys.stderr)
        sys.exit(2)
    print(f"{wrapper}: {len(data['cases'])} cases in {time.perf_counter() - t0:.0f}s (hvd_gradcomp from {package})",
          flush=True)
    return data["cases"]


def compare(a: Path, b: Path) -> int:
    """Print every case whose record differs between ``a`` and ``b``; 1 if any, else 0."""
    left, right = json.loads(a.read_text()), json.loads(b.read_text())
    differ = 0
    for key in sorted(set(left) | set(right)):
        if key != "cases" and left.get(key) != right.get(key):
            print(f"setting {key}: {left.get(key)!r} != {right.get(key)!r}")
            differ += 1
    lc, rc = left.get("cases", {}), right.get("cases", {})
    for name in sorted(set(lc) | set(rc)):
        if name not in lc or name not in rc:
            print(f"{name}: only in {a if name in lc else b}")
            differ += 1
            continue
        parts = [k for k in sorted(set(lc[name]) | set(rc[name])) if lc[name].get(k) != rc[name].get(k)]
        if parts:
            print(f"{name}: {', '.join(parts)} differ")
            differ += 1
    both = len(set(lc) & set(rc))
    print(f"{differ} difference(s); {both} case(s) in both files" if differ
          else f"identical: {both} case(s)")
    return 1 if differ else 0


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="write the fingerprints here (JSON)")
    parser.add_argument("--wrappers", default=",".join(WRAPPERS), help=f"comma-separated subset of {','.join(WRAPPERS)}")
    parser.add_argument("--timeout", type=float, default=JOB_TIMEOUT_S, help="seconds per job (one per wrapper)")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("A", "B"), help="compare two JSON files")
    parser.add_argument("--worker", nargs=2, metavar=("WRAPPER", "OUTFILE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker[0], Path(args.worker[1]))
        return 0
    if args.compare:
        return compare(*args.compare)
    if args.out is None:
        parser.error("give --out FILE.json (or --compare A.json B.json)")
    wrappers = [r for r in args.wrappers.split(",") if r]
    bad = [r for r in wrappers if r not in WRAPPERS]
    if bad or not wrappers:
        parser.error(f"--wrappers takes a comma-separated subset of {','.join(WRAPPERS)}, got {args.wrappers!r}")
    t0 = time.perf_counter()
    found: Dict[str, Any] = {}
    for wrapper in wrappers:
        found.update(run_wrapper(wrapper, args.timeout))
    settings = {"steps": STEPS, "batch": BATCH, "seq": SEQ, "world": WORLD, "bucket_mb": BUCKET_MB}
    args.out.write_text(json.dumps({"settings": settings, "cases": found}, indent=1, sort_keys=True) + "\n")
    split = [n for n, c in found.items() if not c["ranks_identical"]]
    print(f"{len(found)} cases in {time.perf_counter() - t0:.0f}s -> {args.out}"
          + (f"; ranks differ in {', '.join(split)}" if split else "; every case identical on every rank"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

