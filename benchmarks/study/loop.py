"""What the study's two workers share (``worker.py``: Horovod; ``ddp_worker.py``: DDP): the
training loop with its held-out evaluations, the JSON record of a run, and the command line."""
from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Sequence, Tuple

import torch

from benchmarks.study.tasks import TASKS, Task, evaluate, lr_factor


ROOT = Path(__file__).resolve().parents[2]


def wrap_as_user(road: str, net: torch.nn.Module, opt: Any, comp: Any, hvd: Any = None) -> Tuple[Any, Any, Any]:
    """The README's lines for ``road``: ``"ddp"`` wraps ``net`` in DDP and registers the hook (``comp``,
    ``opt``); ``"gc"`` and ``"stock"``/``"none"`` wrap ``opt`` in ``hvd_gradcomp.DistributedOptimizer``
    or Horovod's, then broadcast the parameters and the optimizer's state. Returns (the model to call,
    the optimizer to step, the hook's state or None)."""
    if road == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        from hvd_gradcomp import ddp as gc_ddp
        model = DDP(net)
        return model, opt, gc_ddp.register(model, compression=comp, optimizer=opt)
    import hvd_gradcomp as gc
    kw: Dict[str, Any] = dict(named_parameters=net.named_parameters())
    if comp is not None:
        kw["compression"] = comp
    opt = gc.DistributedOptimizer(opt, **kw) if road == "gc" else hvd.DistributedOptimizer(opt, **kw)
    hvd.broadcast_parameters(net.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    return net, opt, None


def code_version() -> str:
    """The checkout's commit, ``+changes`` when the code that trains (the library, the study,
    the examples) differs from it, so that a page mixing runs of several code versions says so;
    "unknown" outside a git checkout. Results files changing (a rerun) do not count."""
    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)
    try:
        head = git("rev-parse", "--short", "HEAD")
        if head.returncode != 0:
            return "unknown"
        changed = git("diff", "--quiet", "HEAD", "--", "hvd_gradcomp", "benchmarks/study", "examples").returncode
        return head.stdout.strip() + ("+changes" if changed else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def train(task: Task, optimizer: Any, one_step: Callable[[], None], step_bytes: Callable[[], int],
          what: str) -> Tuple[List[Dict[str, float]], List[int], float]:
    """``task.steps`` calls of ``one_step`` under the task's lr schedule (on ``optimizer``), 20
    held-out evaluations; returns (evaluations, bytes per step, seconds). A NaN loss raises.

    The rate is set each step through ``param_groups[i]["lr"]``, as users write it (the same floats
    as ``LambdaLR``'s ``base_lr * factor``, which the study used before: its results hold)."""
    base = [group["lr"] for group in optimizer.param_groups]
    every = max(1, task.steps // 20)
    evals: List[Dict[str, float]] = [dict(zip(("step", "val_loss", "val_accuracy"), (0, *evaluate(task))))]
    sent: List[int] = []
    t0 = time.perf_counter()
    for step in range(1, task.steps + 1):
        for group, lr in zip(optimizer.param_groups, base):
            group["lr"] = lr * lr_factor(step - 1, task.steps, task.warmup)
        one_step()
        sent.append(step_bytes())
        if step % every == 0 or step == task.steps:
            vl, va = evaluate(task)
            if vl != vl:
                raise FloatingPointError(f"{what}: held-out loss is NaN at step {step}")
            evals.append({"step": step, "val_loss": vl, "val_accuracy": va})
    return evals, sent, time.perf_counter() - t0


def record(task: Task, task_name: str, setting: str, label: str, seed: int, ranks: int, compression: Any,
           trained: Tuple[List[Dict[str, float]], List[int], float], raw: int) -> Dict[str, Any]:
    """The JSON record of one run (what ``report.py`` reads)."""
    evals, sent, wall = trained
    half = sent[len(sent) // 2:]
    return {"task": task_name, "setting": setting, "label": label, "seed": seed, "ranks": ranks,
            "wrapper": task.wrapper, "optimizer": type(task.optimizer).__name__, "steps": task.steps,
            "accumulate": task.accumulate, "compressor": repr(compression),
            "feedback": getattr(getattr(compression, "feedback", None), "key", None),
            "val_loss": evals[-1]["val_loss"], "val_accuracy": evals[-1]["val_accuracy"], "evals": evals,
            "raw_bytes_per_step": raw, "bytes_second_half": sum(half) / len(half),
            "ratio_second_half": raw * len(half) / max(1, sum(half)), "wall_s": wall, "code": code_version()}


def main(doc: str, settings_table: Dict[str, Any], defaults: Sequence[str], init: Callable[[], None],
         rank: Callable[[], int], run: Callable[[str, str, int, int, float], Dict[str, Any]]) -> int:
    """A worker's command line: runs each setting of ``--settings`` in turn; rank 0 writes the JSON."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--task", choices=TASKS, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--settings", default=",".join(defaults), help=f"comma-separated, of {list(settings_table)}")
    ap.add_argument("--out", default="runs/study")
    ap.add_argument("--steps", type=int, default=0, help="override the task's steps (smoke tests)")
    ap.add_argument("--clip", type=float, default=0.0,
                    help="clip_grad_norm_ of the averaged gradients to this norm before each optimizer step, as "
                         "users do (0: none); the JSON files then end in -clipNORM")
    args = ap.parse_args()
    settings = args.settings.split(",")
    bad = [s for s in settings if s not in settings_table]
    if bad:
        ap.error(f"unknown settings {bad}; choose from {list(settings_table)}")
    torch.set_num_threads(1)
    init()
    out = Path(args.out)
    for setting in settings:
        result = run(args.task, setting, args.seed, args.steps, args.clip)
        result["clip"] = args.clip
        if rank() == 0:
            out.mkdir(parents=True, exist_ok=True)
            suffix = f"-clip{args.clip:g}" if args.clip else ""
            (out / f"{result['task']}-{setting}-s{args.seed}{suffix}.json").write_text(json.dumps(result, indent=1) + "\n")
            print(f"{result['task']} {setting} seed {args.seed}: held-out loss {result['val_loss']:.4f} "
                  f"acc {result['val_accuracy']:.3f} ratio(2nd half) {result['ratio_second_half']:.0f}x "
                  f"feedback {result['feedback']} {result['wall_s']:.0f}s", flush=True)
    return 0
