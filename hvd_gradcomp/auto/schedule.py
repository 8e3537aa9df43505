""":class:`Schedule`, the part of :class:`hvd_gradcomp.auto.Auto` that counts steps: which road each
exploring step takes (each road's warm-up steps, then its measured ones), which step is which
(measured, a decision's timed steps, the steps before a re-decision) and what is due when a step
begins (the link's probe, a decision, a verdict).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

from .policy import DENSE, FP16, QSGD_AG, QSGD_AR, SPARSE

OURS_ROADS = (SPARSE, QSGD_AR, FP16, DENSE)   # exploration order: the dense road last, so the
STOCK_ROADS = (SPARSE, QSGD_AG, FP16, DENSE)  # residuals are flushed when exploration ends


def roads_in(mode: str, roads: Optional[Sequence[str]] = None) -> Tuple[str, ...]:
    """The roads (``roads``, default all) as named where Auto runs: "qsgd" names QSGD's road
    everywhere, the compressed allreduce in hvd_gradcomp's optimizer and in the DDP hook, the
    allgather inside stock Horovod.

    >>> roads_in("stock", ["qsgd", "dense"])
    ('qsgd-ag', 'dense')
    """
    qsgd = QSGD_AG if mode == "stock" else QSGD_AR
    roads = roads or (STOCK_ROADS if mode == "stock" else OURS_ROADS)
    return tuple(qsgd if r in (QSGD_AR, QSGD_AG) else r for r in roads)


class Schedule:
    """Steps begun, the exploring plan and the phase of each step; the same on every rank.

    A codec road first runs ``warmup_steps`` unmeasured steps, then ``explore_steps`` measured ones
    (the least sample counts): its first calls pay one-off costs that spread over two steps
    (torch.compile at the first call, again at the first with new shapes or with a residual;
    buffers; Horovod negotiating new names). fp16 and dense run once, measured: a cast compiles
    nothing, their first-use cost (a negotiation) is small against their step, and on a slow link
    each of their steps is the slowest of the run. ``skipped``: roads not explored (their
    transfer and the first road's step, in ms; chosen by :class:`hvd_gradcomp.auto.decide.Decider`).

    >>> s = Schedule(warmup_steps=1, explore_steps=2, interval=200)
    >>> s.use(("sparse", "dense")); s.plan, s.measured
    (('sparse', 'sparse', 'sparse', 'sparse', 'dense'), (False, False, True, True, True))
    >>> [s.count("w") for _ in range(2)], s.step   # each tensor's first exchange of a step begins it
    ([1, 2], 0)
    """

    def __init__(self, warmup_steps: int, explore_steps: int, interval: int) -> None:
        self.warmup_steps, self.explore_steps, self.interval = warmup_steps, explore_steps, interval
        self.step = 0                        # steps begun (the first exchange of a step starts it)
        self.counts: Dict[str, int] = {}     # exchanges per tensor: the step its next exchange is in
        self.roads: Optional[Tuple[str, ...]] = None   # the roads where it runs, once known (use)
        self.skipped: Dict[str, Dict[str, float]] = {}
        self.plan: Tuple[str, ...] = ()      # the road of each exploring step
        self.measured: Tuple[bool, ...] = ()  # per exploring step: False for a codec road's warm-up steps

    def use(self, roads: Tuple[str, ...]) -> None:
        """The roads where Auto runs (known once it is configured): plan their exploring steps."""
        self.roads = roads
        self._replan()

    def skip(self, skipped: Dict[str, Dict[str, float]]) -> None:
        """Explore no more the roads in ``skipped`` (the link's probe showed them too slow)."""
        self.skipped = skipped
        self._replan()

    def _replan(self) -> None:
        if self.roads is not None:
            plan = self.exploring_plan(self.roads, self.skipped)
            self.plan, self.measured = tuple(r for r, _ in plan), tuple(m for _, m in plan)

    def exploring_plan(self, roads: Sequence[str], skipped: Sequence[str] = ()) -> List[Tuple[str, bool]]:
        """(road, measured) of each exploring step: each road in turn, its warm-up steps then its
        measured ones, less the ``skipped`` roads."""
        plan: List[Tuple[str, bool]] = []
        for r in roads:
            if r not in skipped:
                warm, measured = self.exploring_steps(r, first=r == roads[0])
                plan += [(r, False)] * warm + [(r, True)] * measured
        return plan

    def exploring_steps(self, road: str, first: bool = False) -> Tuple[int, int]:
        """(warm-up, measured) steps ``road`` takes while exploring. The ``first`` road explored
        also pays the training's own start (the optimizer's state, the heap growing to its size:
        in the benchmark's fixed rows the third step is still slower than the next ones,
        docs/AUTO.md), so it warms up one step more."""
        warm, measured = (0, 1) if road in (FP16, DENSE) else (self.warmup_steps, self.explore_steps)
        return warm + (1 if first and self.warmup_steps else 0), measured

    def start_steps(self, roads: Sequence[str]) -> int:
        """Steps of Auto's start on ``roads``: exploring, the decision's step, ``warmup_steps``
        untimed and ``explore_steps`` timed steps of the decision, and the verdict's step (a
        benchmark that excludes Auto's start from its timing warms up this many steps). With
        every road explored: fewer when roads are skipped (``explore_within``)."""
        return len(self.exploring_plan(roads)) + 1 + self.warmup_steps + self.explore_steps + 1

    # ------------------------------------------------------------ steps
    def count(self, name: str) -> int:
        """One more exchange of ``name``: the step it belongs to (past :attr:`step`: a new step)."""
        count = self.counts[name] = self.counts.get(name, 0) + 1
        return count

    def begin(self, step: Optional[int] = None) -> None:
        """Begin step ``step`` (default: the next one)."""
        self.step = self.step + 1 if step is None else step

    def restart(self) -> None:
        """Explore again from the first road, every road (the steps start over)."""
        self.step = 0
        self.skip({})

    @property
    def exploring(self) -> bool:
        return self.step <= len(self.plan)

    @property
    def exploring_road(self) -> str:
        """The road every tensor takes in the current exploring step."""
        return self.plan[self.step - 1]

    @property
    def warming_up(self) -> bool:
        """In a codec road's unmeasured warm-up steps (exploring): nothing is recorded."""
        return 1 <= self.step <= len(self.plan) and not self.measured[self.step - 1]

    @property
    def measuring(self) -> bool:
        """In a measured exploring step, or in the ``explore_steps`` steps before a re-decision."""
        done = self.step - 1 - len(self.plan)
        if done < 0:
            return not self.warming_up
        return done % self.interval >= self.interval - self.explore_steps

    def phase(self, step: int) -> Optional[str]:
        """What the duration of ``step`` measures: a road (all tensors took it while exploring),
        ``"plan"`` (the steps after a decision and its ``warmup_steps``: on CPU the heap grows for a
        step or two after a switch, each step faulting in fresh pages), ``"before"`` (the steps
        before a re-decision)."""
        w, e = self.warmup_steps, self.explore_steps
        done = step - 1 - len(self.plan)
        if done < 0:   # a road's step time, unless a warm-up step
            return self.plan[step - 1] if self.measured[step - 1] else None
        r = done % self.interval
        if w < r <= w + e:
            return "plan"
        return "before" if r >= self.interval - e and r > w + e else None

    # ------------------------------------------------------------ what is due
    @property
    def probe_due(self) -> bool:
        """The first road's exploring steps just ended: time to probe the link (once per exploration)."""
        first = sum(self.exploring_steps(self.roads[0], first=True))
        return self.step == first + 1 and len(self.roads) > 1

    @property
    def due(self) -> Optional[str]:
        """``"decide"``, ``"first decision"`` (the one after exploring), ``"verify"`` or None at this step."""
        verdict = self.warmup_steps + self.explore_steps + 1   # steps after a decision
        done = self.step - 1 - len(self.plan)
        if done >= 0 and done % self.interval == 0:
            return "first decision" if done == 0 else "decide"
        if done >= 0 and done % self.interval == verdict and self.interval > verdict:
            return "verify"
        return None

    # ------------------------------------------------------------ checkpoints
    def load(self, step: int, counts: Dict[str, int], skipped: Dict[str, Dict[str, float]]) -> None:
        """Resume at ``step`` (a checkpoint taken while exploring resumes the same exploring steps)."""
        self.step, self.counts = step, counts
        self.skip(skipped)
