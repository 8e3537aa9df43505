"""The task of train.py under PyTorch DDP, with the hvd-gradcomp communication hook (no Horovod).

A character-level model on Python's standard-library sources (default) or an MLP on
scikit-learn's digits (``--data digits``); nothing is downloaded. Run on 2 ranks::

    torchrun --standalone --nproc-per-node 2 examples/train_ddp.py --compression topk-qsgd --steps 200
    hvdgc-launch --torchrun -np 2 --compression topk-qsgd --accumulate 4 examples/train_ddp.py --steps 200

Compression flags default from the ``HVDGC_*`` variables that ``hvdgc-launch`` sets and
override them when given. Accumulation uses ``hvd_gradcomp.ddp.GradientAccumulator``
(``no_sync()`` for the first N-1 micro-batches). Rank 0 prints one line per ``--log-every``
steps (loss, bytes this rank sent per step, compression ratio) and writes a JSON summary
with the held-out loss to ``--out``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Dict, Iterator, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import data as datasets  # noqa: E402  (examples/data.py, beside this file)
from models import CharMLP, digits_mlp  # noqa: E402

from hvd_gradcomp import ddp as gc_ddp  # noqa: E402
from hvd_gradcomp.config import CompressionConfig, from_env  # noqa: E402
from hvd_gradcomp.settings import compressions  # noqa: E402


def parse_args(argv: Optional[Sequence[str]] = None) -> Tuple[argparse.Namespace, CompressionConfig]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data", choices=("text", "digits"), default="text")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps")
    p.add_argument("--micro-batch", type=int, default=32, help="samples per backward pass per rank")
    p.add_argument("--lr", type=float, default=None, help="learning rate (default: 0.05 text, 0.1 digits)")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--cosine", action="store_true",
                   help="decay the learning rate to 0 over --steps (cosine), so the loss settles by the end")
    p.add_argument("--context", type=int, default=32, help="text: characters the model sees")
    p.add_argument("--text-bytes", type=int, default=datasets.DEFAULT_TEXT_BYTES)
    p.add_argument("--start-compress-iter", type=int, default=0, help="uncompressed exchanges first (warm-up)")
    p.add_argument("--powersgd-rank", type=int, default=0,
                   help="instead of our hook, torch's PowerSGD hook of this rank, starting after 10%% of --steps "
                        "(its docs' advice; at least 2)")
    p.add_argument("--backend", default=None, help="torch.distributed backend [default: nccl on GPU, else gloo]")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--eval-every", type=int, default=0,
                   help="also record the held-out loss every this many steps (summary's val_curve); 0: only at the end")
    p.add_argument("--out", default=None, help="JSON summary written by rank 0")
    g = p.add_argument_group("compression (defaults: HVDGC_* variables set by hvdgc-launch)")
    g.add_argument("--compression", choices=compressions(), default=None)
    g.add_argument("--ratio", type=float, default=None)
    g.add_argument("--bits", type=int, default=None)
    g.add_argument("--accumulate", type=int, default=None, help="micro-batches per optimizer step")
    g.add_argument("--error-feedback", action=argparse.BooleanOptionalAction, default=None)
    g.add_argument("--feedback", choices=("auto", "classic", "momentum", "none"), default="auto",
                   help="feedback policy of our hook; auto: momentum correction for SGD with momentum")
    g.add_argument("--seed", type=int, default=None)
    args = p.parse_args(argv)
    if args.steps < 1 or args.micro_batch < 1:
        p.error("--steps and --micro-batch must be >= 1")
    if args.eval_every < 0:
        p.error("--eval-every must be >= 0 (0: held-out loss at the end only)")
    try:
        env = from_env()
        given = {k: getattr(args, k) for k in ("compression", "ratio", "bits", "accumulate", "error_feedback", "seed")}
        cfg = CompressionConfig(**{k: (v if v is not None else getattr(env, k)) for k, v in given.items()})
    except ValueError as exc:
        p.error(str(exc))
    if args.lr is None:
        args.lr = 0.05 if args.data == "text" else 0.1
    return args, cfg


def batches(args: argparse.Namespace, seed: int) -> Tuple[torch.nn.Module, Iterator, torch.Tensor, torch.Tensor]:
    """(model, endless micro-batches of this rank's shard, held-out x, held-out y)."""
    rank, size = dist.get_rank(), dist.get_world_size()
    if args.data == "digits":
        xtr, ytr, xte, yte = datasets.load_digits_split(seed=0)

        def stream() -> Iterator:
            for epoch in range(1 << 30):
                g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
                for idx in datasets.micro_batches(datasets.shard(torch.randperm(len(xtr), generator=g), rank, size),
                                                  args.micro_batch):
                    yield xtr[idx], ytr[idx]
        return digits_mlp(), stream(), xte, yte
    train, val = datasets.load_text(args.text_bytes)

    def text_stream() -> Iterator:
        for epoch in range(1 << 30):
            starts = datasets.shard(datasets.epoch_starts(len(train), args.context, seed, epoch), rank, size)
            for idx in datasets.micro_batches(starts, args.micro_batch):
                yield datasets.text_windows(train, idx, args.context)
    g = torch.Generator().manual_seed(1234)  # the held-out windows of train.py
    vx, vy = datasets.text_windows(val, torch.randint(0, len(val) - args.context - 1, (4096,), generator=g),
                                   args.context)
    return CharMLP(args.context), text_stream(), vx, vy


class _PowerSGDBytes:
    """torch's PowerSGD hook, with ``last_step_bytes`` / ``comm_stats.ratio`` read from its own counters."""

    def __init__(self, model: DDP, rank: int, start: int) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

        self.state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=rank, start_powerSGD_iter=start)
        model.register_comm_hook(self.state, powerSGD_hook.powerSGD_hook)
        self.comm_stats = self
        self._seen = 0
        self._raw = sum(p.numel() * p.element_size() for p in model.parameters())

    @property
    def ratio(self) -> float:
        return self.state.compression_stats()[0]

    @property
    def last_step_bytes(self) -> int:
        """Bytes of the steps since the last call (read once per step): P and Q, or plain allreduce."""
        after = self.state.compression_stats()[2]
        sent, self._seen = (after - self._seen) * 4, after
        return sent or self._raw


@torch.no_grad()
def held_out_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    loss = sum(F.cross_entropy(model(x[i:i + 1024]), y[i:i + 1024], reduction="sum").item()
               for i in range(0, len(x), 1024)) / len(x)
    model.train()
    return loss


def train(args: argparse.Namespace, cfg: CompressionConfig) -> Dict[str, Any]:
    torch.manual_seed(cfg.seed or 0)  # the same initial model on every rank (DDP also broadcasts it)
    net, stream, vx, vy = batches(args, cfg.seed or 0)
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    net, vx, vy = net.to(device), vx.to(device), vy.to(device)
    # torch's PowerSGD hook waits inside Gloo's callback threads; with several buckets it hung on
    # CPU (see benchmarks/bench_ddp.py), so under Gloo it gets a single bucket.
    one_bucket = args.powersgd_rank and dist.get_backend() == "gloo"
    model = DDP(net, device_ids=[device.index] if device.type == "cuda" else None,
                bucket_cap_mb=1e5 if one_bucket else 25)
    compression = gc_ddp.compression_from_env(cfg.to_env())
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    if args.powersgd_rank:
        compression = f"PowerSGD(rank={args.powersgd_rank})"
        state = _PowerSGDBytes(model, args.powersgd_rank, start=max(2, args.steps // 10))
    else:
        if args.feedback != "auto" and compression is not None and compression is not torch.float16:
            compression.set_feedback(args.feedback)
        # optimizer=: feedback "auto" picks DGC momentum correction for this momentum SGD
        state = gc_ddp.register(model, compression=compression, start_compress_iter=args.start_compress_iter,
                                optimizer=opt)
    feedback = getattr(getattr(compression, "feedback", None), "key", None)
    acc = gc_ddp.GradientAccumulator(model, opt, steps=cfg.accumulate, micro_batch=args.micro_batch)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.steps) if args.cosine else None
    rank0 = dist.get_rank() == 0
    if rank0:
        print(f"DDP x {dist.get_world_size()} ({dist.get_backend()}): {sum(p.numel() for p in net.parameters()):,} "
              f"params, compression={compression}, feedback={feedback}, accumulate={cfg.accumulate}", flush=True)
    start, losses, sent, val_curve = time.perf_counter(), [], [], []
    while acc.optimizer_steps < args.steps:
        x, y = (t.to(device) for t in next(stream))
        with acc.accumulate():
            loss = F.cross_entropy(model(x), y)
            stepped = acc.backward(loss)
        losses.append(loss.item())
        if not stepped:
            continue
        sent.append(state.last_step_bytes)
        if schedule is not None:
            schedule.step()
        if args.eval_every and acc.optimizer_steps % args.eval_every == 0 and acc.optimizer_steps < args.steps:
            val_curve.append([acc.optimizer_steps, held_out_loss(model.module, vx, vy)])
        if rank0 and acc.optimizer_steps % args.log_every == 0:
            print(f"step {acc.optimizer_steps}: loss {sum(losses[-cfg.accumulate:]) / cfg.accumulate:.4f}, "
                  f"{sent[-1]:,} B/step sent, ratio {state.comm_stats.ratio:.1f}x", flush=True)
    wall_s, val_loss = time.perf_counter() - start, held_out_loss(model.module, vx, vy)
    tail = losses[-max(1, len(losses) // 10):]  # the last 10% of micro-batches: less noisy than the last one
    summary = {"compression": compression if isinstance(compression, str) else repr(compression),
               "feedback": feedback, "steps": acc.optimizer_steps, "ranks": dist.get_world_size(), "seed": cfg.seed or 0,
               "lr": args.lr, "cosine": args.cosine, "momentum": args.momentum, "micro_batch": args.micro_batch, "data": args.data,
               "params": sum(p.numel() for p in net.parameters()), "val_size": len(vx),
               "wall_s": wall_s, "val_loss": val_loss, "val_curve": val_curve + [[acc.optimizer_steps, val_loss]],
               "train_loss_last": losses[-1], "final_train_loss": sum(tail) / len(tail),
               "bytes_per_step": sum(sent) / len(sent), "ratio": state.comm_stats.ratio}
    if rank0:
        print(json.dumps(summary), flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(summary, indent=1))
    return summary


def main(argv: Optional[Sequence[str]] = None) -> int:
    args, cfg = parse_args(argv)
    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=5))
    try:
        train(args, cfg)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
