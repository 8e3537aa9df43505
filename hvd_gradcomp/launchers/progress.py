"""Progress that reads cleanly both in a terminal and through a launcher.

In a terminal, a tqdm bar. Under ``horovodrun``/``mpirun`` a rank's stdout is a pipe whose
lines the launcher prefixes (``[0]<stdout>:``); a bar's carriage returns then pile up into
one garbled line. So when the stream is not a terminal, :func:`progress` prints plain lines
instead, at most one every ``every_s`` seconds, plus the last one::

    train: 40/120 steps (33%), 12s elapsed, ~24s left | loss 2.913 | 1,650 samples/s

Used by examples/train.py, examples/demo.py and the benchmark (benchmarks/).
"""
from __future__ import annotations

import sys
import time
from typing import Any, Callable, Optional, TextIO


class PlainProgress:
    """tqdm's small interface (update, set_postfix_str, set_description, write, close) as plain lines.

    >>> clock = iter([0.0, 1.0, 12.0, 13.0, 14.0]).__next__
    >>> p = PlainProgress(total=3, desc="train", unit="step", file=sys.stdout, every_s=10, clock=clock)
    >>> p.update(); p.set_postfix_str("loss 2.5"); p.update(); p.update(); p.close()
    train: 2/3 steps (67%), 12s elapsed, ~6s left | loss 2.5
    train: 3/3 steps (100%), 14s elapsed | loss 2.5
    """

    def __init__(self, total: Optional[int], desc: str = "", unit: str = "it", file: TextIO = sys.stdout,
                 every_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.total, self.desc, self.unit, self.file, self.every_s = total, desc, unit, file, every_s
        self.n = 0
        self.postfix = ""
        self._clock = clock
        self._start = clock()
        self._last_print = self._start
        self._printed_n = -1

    def update(self, n: int = 1) -> None:
        self.n += n
        now = self._clock()
        if now - self._last_print >= self.every_s:
            self._print(now)

    def set_postfix_str(self, text: str, refresh: bool = False) -> None:
        self.postfix = text

    def set_description(self, desc: str, refresh: bool = False) -> None:
        self.desc = desc

    def write(self, text: str) -> None:
        print(text, file=self.file, flush=True)

    def close(self) -> None:
        if self.n != self._printed_n:
            self._print(self._clock(), final=True)

    def _print(self, now: float, final: bool = False) -> None:
        self._last_print, self._printed_n = now, self.n
        elapsed = now - self._start
        done = f"{self.n}/{self.total}" if self.total else f"{self.n}"
        line = f"{self.desc}: {done} {self.unit}s"
        if self.total:
            line += f" ({100 * self.n / self.total:.0f}%)"
        line += f", {elapsed:.0f}s elapsed"
        if self.total and self.n and not final and self.n < self.total:
            line += f", ~{elapsed * (self.total - self.n) / self.n:.0f}s left"
        if self.postfix:
            line += f" | {self.postfix}"
        self.write(line)

    def __enter__(self) -> "PlainProgress":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def progress(total: Optional[int], desc: str = "", unit: str = "it", file: Optional[TextIO] = None,
             every_s: float = 10.0) -> Any:
    """A tqdm bar on a terminal, else :class:`PlainProgress` (same methods)."""
    file = sys.stdout if file is None else file
    if file.isatty():
        from tqdm import tqdm
        return tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True, mininterval=0.5, file=file)
    return PlainProgress(total, desc, unit, file, every_s)
