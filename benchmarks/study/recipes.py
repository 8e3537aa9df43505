"""Recipes as users copy them from well-known training scripts: model, parameter groups,
optimizer, schedule and clipping written the way those scripts write them (not the way this
library's own tasks do), for the study's recipe part (``study.py --recipes``, benchmarks/results/RECIPES.md).

* ``nanogpt``: nanoGPT's char model (2 pre-LayerNorm blocks, width 128, context 64, head without
  bias, N(0, 0.02) init), AdamW lr 2e-3 betas (0.9, 0.99), weight decay 0.1 on tensors with
  ``dim >= 2`` and 0 on the rest, 30-step warm-up then cosine to 10% at step 300;
* ``tied-1e-3`` / ``tied-2e-3``: 3 blocks with the embedding tied to the head, the same grouping,
  50-step warm-up then cosine over 400 steps, gradients clipped to norm 1.0 as the docs say;
* ``lstm``: PyTorch's word_language_model scaled down to characters (2-layer LSTM, dropout 0.2),
  plain SGD lr 20, gradients clipped to 0.25;
* ``bert-ft``: a BERT-style post-LayerNorm encoder classifier, AdamW betas (0.9, 0.999), weight
  decay 0.01 except biases and LayerNorm, linear warm-up (10%) then linear decay to 0;
* ``cnn-bn``: a CNN with BatchNorm, SGD nesterov momentum 0.9, weight decay 5e-4, cosine;
* ``adafactor``: issue 61's recipe, the ``nanogpt`` model (437,760 parameters) with
  ``torch.optim.Adafactor(lr=1e-2)`` (one group, no weight decay) and the tied recipes' schedule
  and clipping: 50-step warm-up then cosine to 10% at step 400, clipped at 1.0 by hand. Not on
  benchmarks/results/RECIPES.md: a configuration of its own, ``study.py --config adafactor`` (benchmarks/results/ADAFACTOR.md).

Each recipe is driven the way a user drives it on each road (:data:`ROADS`):
``zero_grad()``, ``backward()``, clipping where the recipe clips (Horovod:
``synchronize()``, clip, ``step()`` under ``skip_synchronize()``; DDP: after ``backward()``),
``step()``; the rate set each step through ``param_groups[i]["lr"]``. Through Lightning, the same
model, optimizer and batches in a ``LightningModule``, the rate set before each step, the clipping as
``gradient_clip_val``.

>>> sorted(RECIPES)
['adafactor', 'bert-ft', 'cnn-bn', 'lstm', 'nanogpt', 'tied-1e-3', 'tied-2e-3']
>>> PAGE_RECIPES
('nanogpt', 'tied-1e-3', 'tied-2e-3', 'lstm', 'bert-ft', 'cnn-bn')
>>> round(RECIPES["nanogpt"].lr_at(0), 6), round(RECIPES["nanogpt"].lr_at(300), 6)
(6.7e-05, 0.0002)
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import data as datasets  # noqa: E402

ROADS = {"none": "uncompressed `hvd.DistributedOptimizer`",
         "stock": "stock `hvd.DistributedOptimizer(compression=TopKQSGD)`",
         "gc": "`hvd_gradcomp.DistributedOptimizer(compression=TopKQSGD)`",
         "ddp": "DDP hook, `hvd_gradcomp.ddp.register(compression=TopKQSGD, optimizer=opt)`",
         "lightning": "Lightning, `Trainer(strategy=GradCompStrategy(compression=TopKQSGD))`"}
"""The roads a recipe runs on: the uncompressed reference and the three compressed roads of every recipe
(benchmarks/results/RECIPES.md), each ``TopKQSGD(ratio=0.01, bits=8, seed=...)`` with every other setting left at its
default; and the DDP hook through Lightning's ``Trainer`` (``study.py --config lightning``)."""
HOROVOD_ROADS = ("none", "stock", "gc")
TORCHRUN_ROADS = ("ddp", "lightning")
"""Roads that run alone, under torchrun (the others share one horovodrun job)."""


@dataclass
class Recipe:
    """One recipe: ``build(seed, rank, world)`` returns the model and its param groups,
    ``lr_at(step)`` the peak-relative schedule times ``peak``."""

    name: str
    steps: int
    peak: float
    warmup: int
    decay: str                      # "cosine10" (to 10% at the end), "cosine" (to 0), "linear" (to 0), "const"
    clip: float                     # 0: none
    optimizer: str                  # "adamw", "sgd" or "adafactor"
    opt_kw: Dict[str, Any] = field(default_factory=dict)
    what: str = ""

    def lr_at(self, step: int) -> float:
        """The rate of optimizer step ``step`` (0-based): linear warm-up over ``warmup`` steps, then the decay."""
        if step < self.warmup:
            return self.peak * (step + 1) / self.warmup
        done = min(1.0, (step - self.warmup) / max(1, self.steps - self.warmup))
        if self.decay == "cosine10":
            return self.peak * (0.1 + 0.45 * (1.0 + math.cos(math.pi * done)))
        if self.decay == "cosine":
            return self.peak * 0.5 * (1.0 + math.cos(math.pi * done))
        if self.decay == "linear":
            return self.peak * (1.0 - done)
        return self.peak


RECIPES: Dict[str, Recipe] = {r.name: r for r in (
    Recipe("nanogpt", 300, 2e-3, 30, "cosine10", 0.0, "adamw", dict(betas=(0.9, 0.99), wd=0.1, group="dim"),
           "nanoGPT char transformer, 2 blocks, AdamW (0.9, 0.99), decay on dim >= 2 only"),
    Recipe("tied-1e-3", 400, 1e-3, 50, "cosine10", 1.0, "adamw", dict(betas=(0.9, 0.99), wd=0.1, group="dim"),
           "3 blocks, tied embedding and head, lr 1e-3, clipped at 1.0"),
    Recipe("tied-2e-3", 400, 2e-3, 50, "cosine10", 1.0, "adamw", dict(betas=(0.9, 0.99), wd=0.1, group="dim"),
           "3 blocks, tied embedding and head, lr 2e-3, clipped at 1.0"),
    Recipe("lstm", 300, 20.0, 0, "const", 0.25, "sgd", dict(),
           "word_language_model, 2-layer LSTM on characters, SGD lr 20, clipped at 0.25"),
    Recipe("bert-ft", 400, 5e-4, 40, "linear", 0.0, "adamw", dict(betas=(0.9, 0.999), wd=0.01, group="bert"),
           "BERT-style encoder classifier, AdamW (0.9, 0.999), decay 0.01 except biases and LayerNorm"),
    Recipe("cnn-bn", 600, 0.1, 0, "cosine", 0.0, "sgd", dict(momentum=0.9, nesterov=True, weight_decay=5e-4),
           "CNN with BatchNorm, SGD nesterov 0.9, weight decay 5e-4"),
    Recipe("adafactor", 400, 1e-2, 50, "cosine10", 1.0, "adafactor", dict(),
           "nanoGPT char transformer, 2 blocks, torch.optim.Adafactor lr 1e-2, 400 steps, clipped at 1.0"),
)}
PAGE_RECIPES = ("nanogpt", "tied-1e-3", "tied-2e-3", "lstm", "bert-ft", "cnn-bn")
"""The recipes of benchmarks/results/RECIPES.md (``study.py --recipes``); the others have a configuration and page of their own."""


def _gpt_init(model: nn.Module) -> None:
    """nanoGPT's init: Linear and Embedding weights N(0, 0.02), biases 0."""
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, 0.0, 0.02)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)


class _Attention(nn.Module):
    """nanoGPT's CausalSelfAttention: one ``c_attn`` projection to q, k, v, ``c_proj`` after."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads, self.c_attn, self.c_proj = heads, nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in self.c_attn(x).split(d, 2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, d))


class _GPTBlock(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(d), _Attention(d, heads), nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """nanoGPT's GPT as its model.py writes it (token and learned position embeddings, pre-LayerNorm
    blocks, a final LayerNorm, ``lm_head`` without bias, optionally tied to the token embedding),
    with every Linear and Embedding weight N(0, 0.02) and biases 0."""

    def __init__(self, vocab: int = datasets.VOCAB, d: int = 128, layers: int = 2, heads: int = 4,
                 context: int = 64, tied: bool = False) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(context, d)
        self.h = nn.ModuleList(_GPTBlock(d, heads) for _ in range(layers))
        self.ln_f, self.lm_head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)
        if tied:
            self.lm_head.weight = self.wte.weight
        _gpt_init(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.wte(x) + self.wpe(torch.arange(x.shape[1], device=x.device))
        for block in self.h:
            h = block(h)
        return self.lm_head(self.ln_f(h))


class CharLSTM(nn.Module):
    """word_language_model's RNNModel on characters: embedding, 2-layer LSTM, dropout, decoder."""

    def __init__(self, vocab: int = datasets.VOCAB, emb: int = 64, hidden: int = 192, dropout: float = 0.2) -> None:
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(vocab, emb)
        self.rnn = nn.LSTM(emb, hidden, 2, dropout=dropout, batch_first=True)
        self.decoder = nn.Linear(hidden, vocab)
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1)
        nn.init.uniform_(self.decoder.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.drop(self.encoder(x)))
        return self.decoder(self.drop(out))


class RowEncoder(nn.Module):
    """A BERT-style classifier of 8x8 digits read as 8 tokens of 8 pixels: [CLS] + rows, learned
    positions, 2 post-LayerNorm encoder layers (GELU), a pooler and a classifier."""

    def __init__(self, d: int = 64, layers: int = 2, heads: int = 4, classes: int = 10) -> None:
        super().__init__()
        self.embed, self.cls, self.pos = nn.Linear(8, d), nn.Parameter(torch.zeros(1, 1, d)), nn.Embedding(9, d)
        self.ln = nn.LayerNorm(d)
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.1, activation="gelu", batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.pooler, self.classifier = nn.Linear(d, d), nn.Linear(d, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.cat([self.cls.expand(x.shape[0], -1, -1), self.embed(x.view(-1, 8, 8))], 1)
        h = self.encoder(self.ln(h + self.pos.weight))
        return self.classifier(torch.tanh(self.pooler(h[:, 0])))


def bn_cnn() -> nn.Module:
    """1x8x8 -> conv 32 + BN -> conv 64 + BN -> pool -> 128 -> 10."""
    return nn.Sequential(nn.Conv2d(1, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
                         nn.Conv2d(32, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Flatten(), nn.Linear(1024, 128), nn.ReLU(), nn.Linear(128, 10))


def param_groups(model: nn.Module, recipe: Recipe) -> List[Dict[str, Any]]:
    """The recipe's parameter groups, as its source script builds them: nanoGPT's (decay on tensors
    with ``dim >= 2``), BERT's (no decay on biases and LayerNorm), or one group."""
    kw = recipe.opt_kw
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if kw.get("group") == "dim":
        return [{"params": [p for _, p in named if p.dim() >= 2], "weight_decay": kw["wd"]},
                {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0}]
    if kw.get("group") == "bert":
        no_decay = ("bias", "ln", "norm", "LayerNorm")
        return [{"params": [p for n, p in named if not any(k in n for k in no_decay)], "weight_decay": kw["wd"]},
                {"params": [p for n, p in named if any(k in n for k in no_decay)], "weight_decay": 0.0}]
    return [{"params": [p for _, p in named]}]


@dataclass
class Built:
    """One rank's model, optimizer, batches and held-out set for a recipe and seed."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    batch: Callable[[], Tuple[torch.Tensor, torch.Tensor]]
    val: Tuple[torch.Tensor, torch.Tensor]
    sequence: bool


def build(recipe: Recipe, seed: int, rank: int, world: int) -> Built:
    """The recipe's model (initialised from ``seed``), optimizer and this rank's data (from seed and rank)."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(1000 * seed + rank)
    kind = recipe.name.split("@")[0]    # "tied-2e-3@0.004": the recipe at another peak rate (a probe)
    if kind in ("nanogpt", "tied-1e-3", "tied-2e-3", "lstm", "adafactor"):
        ctx, batch_size = (64, 16) if kind != "lstm" else (35, 20)
        if kind == "lstm":
            model: nn.Module = CharLSTM()
        else:
            model = NanoGPT(layers=3 if kind.startswith("tied") else 2, context=ctx, tied=kind.startswith("tied"))
        train, val = datasets.load_text(datasets.DEFAULT_TEXT_BYTES)
        share = len(train) // world
        mine = train[rank * share:(rank + 1) * share]          # each rank a contiguous part
        offs = torch.arange(ctx)
        vs = torch.randint(0, len(val) - ctx - 1, (256,), generator=torch.Generator().manual_seed(1))

        def batch() -> Tuple[torch.Tensor, torch.Tensor]:
            s = torch.randint(0, len(mine) - ctx - 1, (batch_size,), generator=g)
            return mine[s[:, None] + offs], mine[s[:, None] + offs + 1]
        val_set = (val[vs[:, None] + offs], val[vs[:, None] + offs + 1])
        sequence = True
    else:
        xtr, ytr, xte, yte = datasets.load_digits_split(seed=0)
        model = RowEncoder() if kind == "bert-ft" else bn_cnn()
        shape = (-1, 64) if kind == "bert-ft" else (-1, 1, 8, 8)

        def batch() -> Tuple[torch.Tensor, torch.Tensor]:
            i = torch.randint(0, len(xtr), (32,), generator=g)
            return xtr[i].view(shape), ytr[i]
        val_set = (xte.view(shape), yte)
        sequence = False
    groups = param_groups(model, recipe)
    if recipe.optimizer == "adamw":
        opt: torch.optim.Optimizer = torch.optim.AdamW(groups, lr=recipe.peak, betas=recipe.opt_kw["betas"])
    elif recipe.optimizer == "adafactor":
        opt = torch.optim.Adafactor(groups, lr=recipe.peak)
    else:
        opt = torch.optim.SGD(groups, lr=recipe.peak, **recipe.opt_kw)
    return Built(model, opt, batch, val_set, sequence)


def loss_of(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


@torch.no_grad()
def evaluate(model: nn.Module, val: Tuple[torch.Tensor, torch.Tensor]) -> Tuple[float, float]:
    """(held-out loss, accuracy)."""
    model.eval()
    out = model(val[0])
    loss = loss_of(out, val[1]).item()
    acc = (out.reshape(-1, out.shape[-1]).argmax(-1) == val[1].reshape(-1)).float().mean().item()
    model.train()
    return loss, acc


def raw_bytes(model: nn.Module) -> int:
    """Bytes of one float32 gradient of every trained parameter (tied ones once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def diverged(loss: float, start: float) -> bool:
    """A run that ends above its own starting held-out loss (or NaN) diverged.

    >>> diverged(5.0, 4.8), diverged(2.1, 4.8), diverged(float("nan"), 4.8)
    (True, False, True)
    """
    return not loss == loss or loss > start


def summary(evals: List[Dict[str, float]], sent: List[int], raw: int) -> Dict[str, Any]:
    """Bytes and losses of one run: whole-run and steady-state (second half) ratios against float32."""
    half = sent[len(sent) // 2:]
    return {"val_loss": evals[-1]["val_loss"], "val_accuracy": evals[-1]["val_accuracy"], "evals": evals,
            "ratio_whole_run": raw * len(sent) / max(1, sum(sent)),
            "ratio_steady": raw * len(half) / max(1, sum(half)),
            "diverged": diverged(evals[-1]["val_loss"], evals[0]["val_loss"])}


def evals_due(step: int, steps: int) -> bool:
    """Held-out evaluations: 10 per run and the last step."""
    return step == steps or step % max(1, steps // 10) == 0

