"""Train on real data with compressed gradients: a character-level language model on Python's
own standard-library sources (default), or an MLP on scikit-learn's digits (``--data digits``).

Nothing is downloaded. Run on 2 ranks::

    horovodrun -np 2 -H localhost:2 --gloo python examples/train.py \\
        --compression topk-qsgd --ratio 0.01 --bits 8 --accumulate 4 --micro-batch 16 --steps 200
    hvdgc-launch -np 2 --compression topk-qsgd --accumulate 4 examples/train.py --steps 200

Compression flags default from the ``HVDGC_*`` variables that ``hvdgc-launch`` sets
(:func:`hvd_gradcomp.config.from_env`) and override them when given. Rank 0 shows its
progress (a bar on a terminal, a plain line every 10 s under a launcher) with loss, samples/s, bytes sent per step and the compression ratio, writes
one CSV row per optimizer step (``--out-dir``/``<run-name>.csv``), a JSON summary
(``<run-name>.json``, with the ``--eval-every`` held-out losses) and TensorBoard scalars when
``torch.utils.tensorboard`` imports.

The error-feedback recipe is the library's: by default (``--feedback auto``) the compressor
chooses it from the wrapped optimizer and says which on rank 0 (see
:mod:`hvd_gradcomp.feedback`). ``--feedback momentum`` is DGC's momentum correction (Lin et
al., 2018), ``--warmup-steps`` its sparsity warm-up (:class:`hvd_gradcomp.SparsityWarmup`).
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import data as datasets  # noqa: E402  (examples/data.py, beside this file)
from models import CharMLP, digits_mlp  # noqa: E402  (shared with train_ddp.py)

import horovod.torch as hvd  # noqa: E402
import hvd_gradcomp as gc  # noqa: E402
from hvd_gradcomp import feedback as gcfb  # noqa: E402
from hvd_gradcomp.config import CompressionConfig, from_env  # noqa: E402
from hvd_gradcomp.settings import compressions  # noqa: E402

CSV_FIELDS = ["step", "epoch", "loss", "samples_per_s", "step_s", "wall_s", "bytes_sent", "ratio", "comm_s", "lr"]


# ---------------------------------------------------------------- flags
def add_compression_args(parser: argparse.ArgumentParser) -> None:
    """The compression flags shared by the examples; None means "take it from the environment"."""
    g = parser.add_argument_group("compression (defaults: HVDGC_* variables set by hvdgc-launch)")
    g.add_argument("--compression", choices=compressions(), default=None,
                   help="none | fp16 | qsgd | topk | topk-qsgd | powersgd | auto, or a registered codec (env HVDGC_COMPRESSION, else none)")
    g.add_argument("--ratio", type=float, default=None, help="TopK fraction of elements sent, in (0, 1]")
    g.add_argument("--bits", type=int, default=None, help="QSGD bits per value, 2..8")
    g.add_argument("--error-feedback", action=argparse.BooleanOptionalAction, default=None,
                   help="keep what compression drops and add it to the next gradient (default on)")
    g.add_argument("--accumulate", type=int, default=None, help="backward passes (micro-batches) per optimizer step")
    g.add_argument("--seed", type=int, default=None, help="seed of data order, model init and stochastic rounding")
    g.add_argument("--min-compress-numel", type=int, default=1024,
                   help="tensors smaller than this go uncompressed in one fused allreduce")
    g.add_argument("--feedback", choices=("auto", *gcfb.POLICIES), default="auto",
                   help="error-feedback policy of hvd_gradcomp compressors (auto: chosen from the optimizer)")
    g.add_argument("--momentum-correction", action="store_true",
                   help="same as --feedback momentum: the library's DGC momentum correction (Lin et al., 2018)")
    g.add_argument("--momentum-masking", action=argparse.BooleanOptionalAction, default=False,
                   help="with --feedback momentum: DGC's momentum factor masking (zero the local velocity of "
                        "the coordinates sent)")
    g.add_argument("--warmup-steps", type=int, default=None,
                   help="topk/topk-qsgd: sparsity warm-up (DGC): the TopK ratio falls geometrically from "
                        "--warmup-ratio to --ratio over this many optimizer steps (more bytes sent then); "
                        "default: the feedback policy's (100 steps for momentum correction and frozen, else "
                        "none); 0: none")
    g.add_argument("--warmup-ratio", type=float, default=0.25, help="TopK ratio of the first warm-up step")


def resolve_config(args: argparse.Namespace, parser: argparse.ArgumentParser) -> CompressionConfig:
    """Environment defaults, overridden by the flags given; a bad value is a usage error.

    >>> p = argparse.ArgumentParser(); add_compression_args(p)
    >>> resolve_config(p.parse_args(["--compression", "topk", "--ratio", "0.05"]), p).ratio
    0.05
    """
    try:
        env = from_env()
    except ValueError as exc:
        parser.error(str(exc))
    given = {"compression": args.compression, "ratio": args.ratio, "bits": args.bits,
             "accumulate": args.accumulate, "error_feedback": args.error_feedback, "seed": args.seed}
    merged = {k: (v if v is not None else getattr(env, k)) for k, v in given.items()}
    if merged["seed"] is None:
        merged["seed"] = 0
    try:
        return CompressionConfig(**merged)
    except ValueError as exc:
        parser.error(str(exc))
    raise AssertionError("unreachable")


def parse_args(argv: Optional[Sequence[str]] = None) -> Tuple[argparse.Namespace, CompressionConfig]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--data", choices=("text", "digits"), default="text",
                        help="text: next-character prediction on stdlib sources; digits: sklearn digits")
    parser.add_argument("--micro-batch", type=int, default=32, help="samples per backward pass per rank")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps (0: run --epochs instead)")
    parser.add_argument("--epochs", type=int, default=0, help="passes over the training data (when --steps 0)")
    parser.add_argument("--lr", type=float, default=None, help="learning rate (default: 0.05 text, 0.1 digits)")
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--context", type=int, default=32, help="text: characters the model sees")
    parser.add_argument("--text-bytes", type=int, default=datasets.DEFAULT_TEXT_BYTES,
                        help="text: bytes of stdlib source read")
    parser.add_argument("--eval-every", type=int, default=0, help="held-out evaluation every N steps (0: end only)")
    parser.add_argument("--out-dir", default="runs/train", help="where the CSV/JSON logs (and TensorBoard) go")
    parser.add_argument("--run-name", default=None, help="file name stem of the logs (default from the settings)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (logs still written)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    add_compression_args(parser)
    args = parser.parse_args(argv)
    for flag in ("micro_batch", "context", "threads"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.steps < 0 or args.epochs < 0 or (args.steps == 0 and args.epochs == 0):
        parser.error("give --steps N (N >= 1) or --steps 0 --epochs E (E >= 1)")
    if args.eval_every < 0:
        parser.error("--eval-every must be >= 0")
    cfg = resolve_config(args, parser)
    if args.warmup_steps is not None and args.warmup_steps < 0:
        parser.error("--warmup-steps must be >= 0")
    if args.warmup_steps and cfg.compression not in ("topk", "topk-qsgd"):
        parser.error("--warmup-steps applies to --compression topk or topk-qsgd")
    if args.warmup_steps and not cfg.ratio <= args.warmup_ratio <= 1:
        parser.error(f"--warmup-ratio must be in [--ratio, 1] = [{cfg.ratio:g}, 1], got {args.warmup_ratio:g}")
    if args.lr is None:
        args.lr = 0.05 if args.data == "text" else 0.1
    return args, cfg


def default_run_name(data: str, cfg: CompressionConfig) -> str:
    """A file-name stem that names the settings.

    >>> default_run_name("text", CompressionConfig("topk-qsgd", accumulate=4, error_feedback=False))
    'text-topk-qsgd-r0.01-b8-noef-acc4'
    """
    parts = [data, cfg.compression]
    if cfg.compression in ("topk", "topk-qsgd"):
        parts.append(f"r{cfg.ratio:g}")
    if cfg.compression in ("qsgd", "topk-qsgd"):
        parts.append(f"b{cfg.bits}")
    if cfg.compression in ("qsgd", "topk", "topk-qsgd") and not cfg.error_feedback:
        parts.append("noef")
    parts.append(f"acc{cfg.accumulate}")
    return "-".join(parts)


# ---------------------------------------------------------------- task: model, batches, evaluation
@dataclass
class Task:
    """A model, a way to enumerate one epoch's micro-batches on this rank, and a held-out set."""

    model: nn.Module
    epoch_batches: Any          # (epoch) -> iterator of (x, y)
    val_x: torch.Tensor
    val_y: torch.Tensor
    train_size: int
    notes: Dict[str, Any] = field(default_factory=dict)


def text_task(args: argparse.Namespace, seed: int) -> Task:
    train, val = datasets.load_text(args.text_bytes)
    rank, size = hvd.rank(), hvd.size()

    def epoch_batches(epoch: int) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        starts = datasets.shard(datasets.epoch_starts(len(train), args.context, seed, epoch), rank, size)
        for idx in datasets.micro_batches(starts, args.micro_batch):
            yield datasets.text_windows(train, idx, args.context)

    # A fixed held-out sample of 4,096 windows: the same on every rank and for every run.
    g = torch.Generator().manual_seed(1234)
    val_starts = torch.randint(0, len(val) - args.context - 1, (4096,), generator=g)
    vx, vy = datasets.text_windows(val, val_starts, args.context)
    files = len(datasets.stdlib_sources())
    return Task(CharMLP(args.context), epoch_batches, vx, vy, len(train),
                {"corpus": f"{len(train) + len(val):,} bytes of the first of {files} stdlib .py files",
                 "train_chars": len(train), "val_chars": len(val)})


def digits_task(args: argparse.Namespace, seed: int) -> Task:
    xtr, ytr, xte, yte = datasets.load_digits_split(seed=0)
    rank, size = hvd.rank(), hvd.size()

    def epoch_batches(epoch: int) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        perm = datasets.shard(torch.randperm(len(xtr), generator=g), rank, size)
        for idx in datasets.micro_batches(perm, args.micro_batch):
            yield xtr[idx], ytr[idx]

    return Task(digits_mlp(), epoch_batches, xte, yte, len(xtr), {"train_images": len(xtr), "test_images": len(xte)})


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, chunk: int = 1024) -> Tuple[float, float]:
    """(mean cross-entropy, accuracy) on a held-out set."""
    model.eval()
    loss_sum, correct = 0.0, 0
    for i in range(0, len(x), chunk):
        logits = model(x[i:i + chunk])
        loss_sum += F.cross_entropy(logits, y[i:i + chunk], reduction="sum").item()
        correct += int((logits.argmax(1) == y[i:i + chunk]).sum())
    model.train()
    return loss_sum / len(x), correct / len(x)


def micro_stream(task: Task) -> Iterator[Tuple[int, Optional[Tuple[torch.Tensor, torch.Tensor]]]]:
    """(epoch, batch) forever; a ``None`` batch marks each epoch's end (time to flush)."""
    epoch = 0
    while True:
        for batch in task.epoch_batches(epoch):
            yield epoch, batch
        yield epoch, None
        epoch += 1


# ---------------------------------------------------------------- logging
class RunLog:
    """Rank 0's per-step CSV, optional TensorBoard, and the progress bar."""

    def __init__(self, out_dir: Path, name: str, total: Optional[int], progress: bool) -> None:
        self.active = hvd.rank() == 0
        self.rows: List[Dict[str, Any]] = []
        self.csv_path = out_dir / f"{name}.csv"
        self.json_path = out_dir / f"{name}.json"
        self.bar = None
        self.tb = None
        if not self.active:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        self._file = open(self.csv_path, "w", newline="")
        self._csv = csv.DictWriter(self._file, fieldnames=CSV_FIELDS)
        self._csv.writeheader()
        self.tb = _tensorboard(out_dir / "tb" / name)
        if progress:  # a bar on a terminal, plain periodic lines under horovodrun (hvd_gradcomp.launchers.progress)
            from hvd_gradcomp.launchers.progress import progress as make_progress
            self.bar = make_progress(total=total, desc=name, unit="step")

    def step(self, row: Dict[str, Any]) -> None:
        if not self.active:
            return
        self.rows.append(row)
        self._csv.writerow({k: row[k] for k in CSV_FIELDS})
        self._file.flush()
        if self.tb is not None:
            for key in ("loss", "samples_per_s", "bytes_sent", "ratio", "comm_s"):
                self.tb.add_scalar(f"train/{key}", row[key], row["step"])
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix_str(f"loss {row['loss']:.3f} | {row['samples_per_s']:,.0f} samples/s | "
                                     f"{_fmt_bytes(row['bytes_sent'])}/step | ratio {row['ratio']:.1f}x",
                                     refresh=False)

    def note(self, text: str) -> None:
        if not self.active:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def scalar(self, key: str, value: float, step: int) -> None:
        if self.active and self.tb is not None:
            self.tb.add_scalar(key, value, step)

    def close(self, summary: Dict[str, Any]) -> None:
        if not self.active:
            return
        if self.bar is not None:
            self.bar.close()
        self._file.close()
        if self.tb is not None:
            self.tb.close()
        self.json_path.write_text(json.dumps(summary, indent=2) + "\n")


def _tensorboard(path: Path) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # TensorBoard is optional
        return None
    return SummaryWriter(str(path))


def _fmt_bytes(n: float) -> str:
    """Bytes in human units.

    >>> _fmt_bytes(2_500_000)
    '2.50 MB'
    """
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


# ---------------------------------------------------------------- training
def make_compression(cfg: CompressionConfig, feedback: str = "auto", masking: bool = False,
                     warmup_steps: Optional[int] = None, warmup_ratio: float = 0.25) -> Any:
    """The compressor the settings name, with the feedback policy and sparsity warm-up asked for.

    >>> make_compression(CompressionConfig("topk-qsgd"), "momentum", warmup_steps=100).ratio_at(50)
    0.05
    """
    compression = cfg.make_compressor()
    if not isinstance(compression, gc.GradientCompressor):
        return compression
    if feedback != "auto" and compression.error_feedback:
        compression.set_feedback(gc.MomentumCorrection(masking=masking) if feedback == "momentum"
                                 else feedback)
    if warmup_steps is not None and isinstance(compression, gc.TopK):  # 0: a constant ratio, no warm-up
        compression.schedule = gc.SparsityWarmup(cfg.ratio, warmup_steps, warmup_ratio)
    return compression


def build_optimizer(model: nn.Module, compression: Any, cfg: CompressionConfig, lr: float, momentum: float,
                    min_compress_numel: int) -> torch.optim.Optimizer:
    """SGD wrapped by ``gc.DistributedOptimizer``, exactly as the README shows."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    opt = gc.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=compression,
                                  backward_passes_per_step=cfg.accumulate, min_compress_numel=min_compress_numel)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    return opt


def train(args: argparse.Namespace, cfg: CompressionConfig) -> Dict[str, Any]:
    """Run the training loop; returns the summary (also written by rank 0 as JSON)."""
    torch.manual_seed(cfg.seed)
    task = text_task(args, cfg.seed) if args.data == "text" else digits_task(args, cfg.seed)
    model = task.model
    compression = make_compression(cfg, "momentum" if args.momentum_correction else args.feedback,
                                   args.momentum_masking, args.warmup_steps, args.warmup_ratio)
    opt = build_optimizer(model, compression, cfg, args.lr, args.momentum, args.min_compress_numel)
    evals: List[Dict[str, float]] = []
    acc = gc.GradientAccumulator(opt, steps=cfg.accumulate, micro_batch=args.micro_batch)
    raw_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    name = args.run_name or default_run_name(args.data, cfg)
    log = RunLog(Path(args.out_dir), name, args.steps or None, progress=not args.no_progress)
    log.note(f"{name}: {sum(p.numel() for p in model.parameters()):,} params, {acc.describe()}, "
             f"compression={compression!r}")
    samples_per_step = args.micro_batch * cfg.accumulate * hvd.size()
    start = last = time.perf_counter()
    comm_before = opt.comm_wait_s
    window_loss: List[float] = []
    epoch = 0
    for epoch, batch in micro_stream(task):
        if args.steps == 0 and epoch >= args.epochs:
            break
        if batch is None:
            stepped = acc.flush()
        else:
            x, y = batch
            loss = F.cross_entropy(model(x), y)
            window_loss.append(loss.item())
            stepped = acc.backward(loss)
        if not stepped:
            continue
        now = time.perf_counter()
        row = _step_row(acc.optimizer_steps, epoch, window_loss, now - last, now - start, opt, raw_bytes,
                        opt.comm_wait_s - comm_before, args.lr, samples_per_step)
        log.step(row)
        last, comm_before, window_loss = now, opt.comm_wait_s, []
        if args.eval_every and acc.optimizer_steps % args.eval_every == 0:
            vl, va = evaluate(model, task.val_x, task.val_y)
            log.note(f"step {acc.optimizer_steps}: held-out loss {vl:.4f}, accuracy {va:.3f}")
            evals.append({"step": acc.optimizer_steps, "val_loss": vl, "val_accuracy": va})
            log.scalar("val/loss", vl, acc.optimizer_steps)
        if args.steps and acc.optimizer_steps >= args.steps:
            break
    wall = time.perf_counter() - start
    val_loss, val_acc = evaluate(model, task.val_x, task.val_y)
    summary = _summary(args, cfg, name, log.rows, wall, val_loss, val_acc, opt, compression, acc, task, epoch)
    summary["evals"] = evals
    log.close(summary)             # the progress's last line first, then the summary under it
    log.note(_summary_line(summary))
    return summary


def _step_row(step: int, epoch: int, losses: List[float], step_s: float, wall_s: float, opt: Any,
              raw_bytes: int, comm_s: float, lr: float, samples_per_step: int) -> Dict[str, Any]:
    sent = opt.last_step_bytes
    loss = _allreduce_mean(sum(losses) / max(len(losses), 1))
    return {"step": step, "epoch": epoch, "loss": loss, "samples_per_s": samples_per_step / step_s,
            "step_s": step_s, "wall_s": wall_s, "bytes_sent": sent, "ratio": raw_bytes / sent if sent else 0.0,
            "comm_s": comm_s, "lr": lr}


def _allreduce_mean(value: float) -> float:
    """The loss averaged over ranks (what the whole job trained on this step)."""
    return float(hvd.allreduce(torch.tensor([value], dtype=torch.float64), name="train.loss").item())


def _summary(args: argparse.Namespace, cfg: CompressionConfig, name: str, rows: List[Dict[str, Any]],
             wall: float, val_loss: float, val_acc: float, opt: Any, compression: Any, acc: Any,
             task: Task, epoch: int) -> Dict[str, Any]:
    tail = rows[-max(1, len(rows) // 10):] if rows else []
    timed = rows[1:] if len(rows) > 1 else rows  # the first step includes warm-up
    step_s = sum(r["step_s"] for r in timed) / max(len(timed), 1)
    return {
        "run_name": name, "data": args.data, "config": asdict(cfg), "compressor": repr(compression),
        "ranks": hvd.size(), "micro_batch": args.micro_batch, "accumulate": cfg.accumulate,
        "effective_batch": acc.effective_batch(), "lr": args.lr, "momentum": args.momentum,
        "feedback": getattr(getattr(compression, "feedback", None), "key", None),
        "momentum_masking": bool(getattr(getattr(compression, "feedback", None), "masking", False)),
        "warmup_steps": (args.warmup_steps if args.warmup_steps is not None  # else the policy's own
                         else getattr(getattr(compression, "feedback", None), "sparsity_warmup", 0)),
        "warmup_ratio": args.warmup_ratio if args.warmup_steps else None,
        "min_compress_numel": args.min_compress_numel, "steps": acc.optimizer_steps, "epochs_seen": epoch + 1,
        "params": sum(p.numel() for p in task.model.parameters()), "task": task.notes, "val_size": len(task.val_x),
        "first_loss": rows[0]["loss"] if rows else math.nan,
        "final_train_loss": sum(r["loss"] for r in tail) / max(len(tail), 1),
        "val_loss": val_loss, "val_accuracy": val_acc, "wall_s": wall,
        "step_s": step_s, "samples_per_s": args.micro_batch * cfg.accumulate * hvd.size() / step_s if step_s else 0.0,
        "bytes_per_step": opt.comm_stats.bytes_out / max(acc.optimizer_steps, 1),
        "raw_bytes_per_step": opt.comm_stats.bytes_in / max(acc.optimizer_steps, 1),
        "ratio": opt.comm_stats.ratio, "comm_s_total": opt.comm_wait_s,
        "comm_stats": opt.comm_stats.summary(), "csv": str(_csv_path(args, name)),
    }


def _csv_path(args: argparse.Namespace, name: str) -> Path:
    return Path(args.out_dir) / f"{name}.csv"


def _summary_line(s: Dict[str, Any]) -> str:
    return (f"done: {s['steps']} steps in {s['wall_s']:.1f}s | train loss {s['first_loss']:.3f} -> "
            f"{s['final_train_loss']:.3f} | held-out loss {s['val_loss']:.4f}, accuracy {s['val_accuracy']:.3f} | "
            f"{s['samples_per_s']:,.0f} samples/s | {_fmt_bytes(s['bytes_per_step'])}/step sent, "
            f"ratio {s['ratio']:.1f}x | logs: {s['csv']}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    args, cfg = parse_args(argv)
    torch.set_num_threads(args.threads)
    hvd.init()
    train(args, cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
