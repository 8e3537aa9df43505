"""The study's tasks: small models on data that ships offline, each with the optimizer and
learning-rate schedule people use for it, and the DistributedOptimizer it is trained through.

* ``transformer``: a 4-layer decoder-only character transformer on the standard library's
  sources, AdamW with linear warm-up and cosine decay (``hvd_gradcomp.DistributedOptimizer``);
  ``transformer-const`` the same at a constant learning rate (no schedule: error feedback's
  lag and a frozen second moment are not hidden by a rate decaying to zero);
* ``cnn-sgd`` / ``cnn-adam``: a small CNN on scikit-learn's digits with momentum SGD / Adam
  (stock ``hvd.DistributedOptimizer``); ``cnn-adam-const`` the latter at a constant rate;
* ``char-mlp``: the model and data of ``examples/train.py`` (momentum SGD, cosine decay,
  gradient accumulation over 2 micro-batches; ``hvd_gradcomp.DistributedOptimizer``);
* ``teacher-mlp``: an MLP with LayerNorm learning the classes of a fixed random teacher network
  on fresh Gaussian inputs, AdamW with a long warm-up (30%) then cosine, 2400 steps: added
  after the recipes were chosen, with settings not tuned for it (a check on a task the
  library's defaults were not chosen on).
"""
from __future__ import annotations

import functools
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import data as datasets  # noqa: E402


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a 4x MLP."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class CharTransformer(nn.Module):
    """Decoder-only character model: token + position embeddings, ``layers`` blocks, a linear head."""

    def __init__(self, vocab: int = datasets.VOCAB, d: int = 64, layers: int = 4, heads: int = 4,
                 context: int = 32) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(context, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)
        self.register_buffer("mask", torch.triu(torch.ones(context, context, dtype=torch.bool), 1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        h = self.tok(x) + self.pos(torch.arange(t, device=x.device))
        for b in self.blocks:
            h = b(h, self.mask[:t, :t])
        return self.head(self.ln(h))


def teacher_mlp(inputs: int = 64, hidden: int = 512, classes: int = 10) -> nn.Module:
    """inputs -> hidden (GELU, LayerNorm) -> hidden (GELU) -> classes."""
    return nn.Sequential(nn.Linear(inputs, hidden), nn.GELU(), nn.LayerNorm(hidden), nn.Linear(hidden, hidden),
                         nn.GELU(), nn.Linear(hidden, classes))


@functools.lru_cache(maxsize=None)
def _teacher_weights(inputs: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    return torch.randn(inputs, 256, generator=g), torch.randn(256, 256, generator=g), torch.randn(256, 10, generator=g)


@torch.no_grad()
def teacher_labels(x: torch.Tensor) -> torch.Tensor:
    """The class a fixed random tanh network (seeded, the same on every rank and run) gives ``x``."""
    w1, w2, w3 = _teacher_weights(x.shape[1])
    h = torch.tanh(x @ w1 * (1.5 / x.shape[1] ** 0.5))
    h = torch.tanh(h @ w2 * (1.5 / 256 ** 0.5))
    return (h @ w3).argmax(-1)


def digits_cnn() -> nn.Module:
    """1x8x8 -> conv 16 -> conv 32 -> pool -> 128 -> 10."""
    return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Flatten(), nn.Linear(512, 128), nn.ReLU(), nn.Linear(128, 10))


@dataclass
class Task:
    """Everything a run needs; ``batch(step)`` gives this rank's micro-batches of one step."""

    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    wrapper: str                 # "gc" (hvd_gradcomp.DistributedOptimizer) or "hvd" (stock)
    steps: int
    accumulate: int
    warmup: Optional[float]      # share of the steps with linear lr warm-up (then cosine decay to 0);
                                 # None: a constant rate
    batch: Callable[[], Tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
    val: Tuple[torch.Tensor, torch.Tensor]


@torch.no_grad()
def evaluate(task: Task) -> Tuple[float, float]:
    """(held-out loss, accuracy) of the model on the task's fixed held-out set."""
    task.model.eval()
    x, y = task.val
    out = task.model(x)
    out, y = out.reshape(-1, out.shape[-1]), y.reshape(-1)
    loss, acc = F.cross_entropy(out, y).item(), (out.argmax(-1) == y).float().mean().item()
    task.model.train()
    return loss, acc


def lr_factor(step: int, steps: int, warmup: Optional[float]) -> float:
    """Linear warm-up over ``warmup * steps``, then cosine decay to 0; ``warmup=None``: constant.

    >>> [round(lr_factor(s, 100, 0.1), 3) for s in (0, 9, 10, 55, 100)]
    [0.1, 1.0, 1.0, 0.5, 0.0]
    >>> lr_factor(99, 100, None)
    1.0
    """
    if warmup is None:
        return 1.0
    wu = int(warmup * steps)
    if step < wu:
        return (step + 1) / wu
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - wu) / max(1, steps - wu))))


def _seq_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = model(x)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y)


def make_task(name: str, seed: int, rank: int) -> Task:
    """The task ``name`` with model initialised from ``seed``; data order from (seed, rank)."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    if name in ("transformer", "transformer-const"):
        ctx = 32
        train, val = datasets.load_text(400_000)
        vs = torch.randint(0, len(val) - ctx - 1, (512,), generator=torch.Generator().manual_seed(1))
        offs = torch.arange(ctx)
        model = CharTransformer(context=ctx)

        def batch():
            s = torch.randint(0, len(train) - ctx - 1, (16,), generator=g)
            return train[s[:, None] + offs], train[s[:, None] + offs + 1]
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
        return Task(name, model, opt, "gc", 400, 1, 0.1 if name == "transformer" else None, batch, _seq_loss,
                    (val[vs[:, None] + offs], val[vs[:, None] + offs + 1]))
    if name in ("cnn-sgd", "cnn-adam", "cnn-adam-const", "cnn-sgd-const"):
        xtr, ytr, xte, yte = datasets.load_digits_split(seed=0)
        model = digits_cnn()

        def batch():
            i = torch.randint(0, len(xtr), (32,), generator=g)
            return xtr[i].view(-1, 1, 8, 8), ytr[i]
        opt = (torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9) if name.startswith("cnn-sgd")
               else torch.optim.Adam(model.parameters(), lr=2e-3))
        return Task(name, model, opt, "hvd", 600, 1, None if name.endswith("-const") else 0.05, batch, _loss,
                    (xte.view(-1, 1, 8, 8), yte))
    if name in ("char-mlp", "char-mlp-const"):
        sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
        from train import CharMLP
        ctx = 32
        train, val = datasets.load_text(datasets.DEFAULT_TEXT_BYTES)
        vs = torch.randint(0, len(val) - ctx - 1, (4096,), generator=torch.Generator().manual_seed(1234))
        model = CharMLP(ctx)

        def batch():
            s = torch.randint(0, len(train) - ctx - 1, (16,), generator=g)
            return datasets.text_windows(train, s, ctx)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        return Task(name, model, opt, "gc", 500, 2, None if name.endswith("-const") else 0.0, batch, _loss, datasets.text_windows(val, vs, ctx))
    if name == "teacher-mlp":
        xte = torch.randn(4096, 64, generator=torch.Generator().manual_seed(99))
        model = teacher_mlp()

        def batch():
            x = torch.randn(64, 64, generator=g)
            return x, teacher_labels(x)
        opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.05, betas=(0.9, 0.98))
        return Task(name, model, opt, "gc", 2400, 1, 0.3, batch, _loss, (xte, teacher_labels(xte)))
    raise ValueError(f"unknown task {name!r}")


TASKS = ("transformer", "cnn-sgd", "cnn-adam", "char-mlp", "teacher-mlp", "transformer-const", "cnn-adam-const",
         "cnn-sgd-const", "char-mlp-const")
