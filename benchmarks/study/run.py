"""What the study's runner runs, as data: a configuration (:class:`Config`), one invocation of it
(:class:`Run`), the 2-rank jobs it plans (:class:`Job`) and the refusal of an invocation it cannot run
(:class:`Refused`). :mod:`.configs` lists the configurations and the renderers each names; the
renderers of :mod:`.pages` read a :class:`Run`. Both import this module, so neither imports the
other.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, List, Mapping, NamedTuple, Tuple


class Refused(Exception):
    """An invocation a configuration cannot run; the message names the problem and the choices."""


class Job(NamedTuple):
    """One 2-rank job: what it trains (printed as it starts) and its command."""

    what: str
    argv: List[str]


@dataclass(frozen=True)
class Config:
    """One investigation. ``tasks``, ``settings``, ``roads``: what ``--tasks``, ``--settings`` and
    ``--roads`` pick from (none: the option is refused); the defaults: all of them unless given.
    ``steps``: the default of ``--steps`` (0: no ``--steps``, each task trains for its own);
    ``options``: what its ``jobs`` and ``render`` read beside those (small-mlp's take
    ``--data``, ``--cosine``, ``--section``)."""

    name: str
    about: str                                  # one line, for --list
    page: str                                   # under benchmarks/results/
    out: str                                    # its results, relative to the checkout: a folder or a file
    jobs: Callable[[Run], List[Job]]
    render: Callable[[Run], str]
    tasks: Tuple[str, ...] = ()
    default_tasks: Tuple[str, ...] = ()
    settings: Tuple[str, ...] = ()
    default_settings: Tuple[str, ...] = ()
    roads: Tuple[str, ...] = ()
    seeds: Tuple[int, ...] = (0, 1, 2)
    steps: int = 0
    options: Tuple[Tuple[str, Any], ...] = ()
    timeout: int = 1800                         # seconds per 2-rank job


@dataclass(frozen=True)
class Run:
    """One invocation of a configuration: what it trains, where its results and page go, and the
    command the page names."""

    config: Config
    tasks: Tuple[str, ...]
    settings: Tuple[str, ...]
    roads: Tuple[str, ...]
    seeds: Tuple[int, ...]
    steps: int
    out: Path
    docs: Path
    command: str
    options: Mapping[str, Any] = field(default_factory=dict)
    started: float = field(default_factory=time.time)

    @property
    def page(self) -> Path:
        return self.docs / self.config.page
