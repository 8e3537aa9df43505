"""The example models, shared by train.py (Horovod) and train_ddp.py (PyTorch DDP)."""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from typing import List

from data import VOCAB


class CharMLP(nn.Module):
    """Next-character model: embed the last ``context`` characters, then a 2-layer MLP (~0.9M params)."""

    def __init__(self, context: int, vocab: int = VOCAB, embed: int = 32, hidden: int = 512) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, embed)
        self.fc1 = nn.Linear(context * embed, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x).flatten(1)
        h = F.gelu(self.fc1(h))
        h = F.gelu(self.fc2(h))
        return self.out(h)


def digits_mlp() -> nn.Module:
    """64 pixels -> 256 -> 256 -> 10 classes."""
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))


def layer_plan(params: float, width: int) -> int:
    """How many ``width x width`` Linear layers (with bias) come closest to ``params``, at least 1.

    >>> layer_plan(25e6, 2048)
    6
    """
    per_layer = width * width + width
    return max(1, round(params / per_layer))


def build_model(params: float, width: int, classes: int = 1000) -> nn.Module:
    """``depth`` square Linear+ReLU layers, then a classifier head of ``classes`` outputs."""
    depth = layer_plan(params, width)
    layers: List[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, classes))
    return nn.Sequential(*layers)


def iterations_for(min_seconds: float, step_s: float, iters: int, max_iters: int, batches: int = 1) -> int:
    """Timed iterations: ``iters``, or more (at most ``max_iters``) so that about ``min_seconds``
    are timed at ``step_s`` per step: a comparison of two fast settings then rests on as many
    seconds of samples as one of slow ones.

    >>> iterations_for(12.0, 0.45, 10, 60), iterations_for(12.0, 2.0, 10, 60), iterations_for(0.0, 0.1, 10, 60)
    (27, 10, 10)
    """
    if min_seconds <= 0 or step_s <= 0:
        return iters
    return max(iters, min(max_iters, math.ceil(min_seconds / (step_s * batches))))
