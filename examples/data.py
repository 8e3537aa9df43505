"""Real data that needs no download: Python's own source text, and scikit-learn's digits.

* :func:`load_text` reads the ``.py`` files of the standard library (the directory of
  ``os.py``), sorted by name and capped in size, as one byte string: real English
  (docstrings, comments) and real code. A character-level language model learns it.
* :func:`load_digits_split` returns scikit-learn's bundled 8x8 digits (1,797 images).

Both are deterministic: the same files in the same order, the same split for a seed.

>>> train, val = load_text(max_bytes=100_000)
>>> train.dtype, len(train) + len(val)
(torch.int64, 100000)
>>> int(train.max()) < VOCAB
True
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator, List, Tuple

import torch

VOCAB = 128  # 7-bit ASCII; other bytes map to "?"
DEFAULT_TEXT_BYTES = 2_000_000


def stdlib_sources() -> List[Path]:
    """The standard library's top-level ``.py`` files, sorted (a fixed list on a given Python)."""
    root = Path(os.path.dirname(os.__file__))
    return sorted(p for p in root.glob("*.py") if p.is_file())


def load_text(max_bytes: int = DEFAULT_TEXT_BYTES, val_fraction: float = 0.1) -> Tuple[torch.Tensor, torch.Tensor]:
    """(train, val) byte codes of the first ``max_bytes`` of the standard library sources.

    The held-out part is the last ``val_fraction`` of the text (other files than training).
    """
    if max_bytes < 10_000:
        raise ValueError(f"max_bytes must be >= 10000 to leave text for training and validation, got {max_bytes}")
    chunks, total = [], 0
    for path in stdlib_sources():
        data = path.read_bytes()[: max_bytes - total]
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    codes = torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8).to(torch.int64)
    codes[codes >= VOCAB] = ord("?")
    cut = int(len(codes) * (1.0 - val_fraction))
    return codes[:cut], codes[cut:]


def text_windows(text: torch.Tensor, starts: torch.Tensor, context: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Inputs ``text[s:s+context]`` and next-character targets ``text[s+context]`` for each start.

    >>> x, y = text_windows(torch.arange(10), torch.tensor([0, 3]), 4)
    >>> x.tolist(), y.tolist()
    ([[0, 1, 2, 3], [3, 4, 5, 6]], [4, 7])
    """
    offsets = torch.arange(context)
    return text[starts.unsqueeze(1) + offsets], text[starts + context]


def epoch_starts(n: int, context: int, seed: int, epoch: int) -> torch.Tensor:
    """Window starts for one epoch: every non-overlapping window once, shuffled by (seed, epoch)."""
    starts = torch.arange(0, n - context - 1, context)
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return starts[torch.randperm(len(starts), generator=g)]


def load_digits_split(seed: int = 0, test_fraction: float = 0.2) -> Tuple[torch.Tensor, ...]:
    """(x_train, y_train, x_test, y_test): scikit-learn's digits, pixels scaled to [0, 1].

    >>> xtr, ytr, xte, yte = load_digits_split()
    >>> xtr.shape[1], len(xtr) + len(xte)
    (64, 1797)
    """
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    cut = int(len(x) * (1.0 - test_fraction))
    train, test = perm[:cut], perm[cut:]
    return x[train], y[train], x[test], y[test]


def shard(indices: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """This rank's share, every rank the same length (the tail that does not divide is dropped).

    >>> shard(torch.arange(7), 1, 2).tolist()
    [1, 3, 5]
    """
    usable = len(indices) - len(indices) % size
    return indices[:usable][rank::size]


def micro_batches(indices: torch.Tensor, micro_batch: int) -> Iterator[torch.Tensor]:
    """Consecutive slices of ``micro_batch`` indices; the last, short one is dropped."""
    for i in range(0, len(indices) - micro_batch + 1, micro_batch):
        yield indices[i:i + micro_batch]
