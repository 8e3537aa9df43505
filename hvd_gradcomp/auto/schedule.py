"""The road bookkeeping of :class:`hvd_gradcomp.auto.Auto`: where it runs, which road each exploring
step takes (each road's warm-up steps, then its measured ones), which step is which, and the road a
tensor takes in the current step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

from .policy import DENSE, FP16, QSGD_AG, QSGD_AR, SPARSE

OURS_ROADS = (SPARSE, QSGD_AR, FP16, DENSE)   # exploration order: the dense road last, so the
STOCK_ROADS = (SPARSE, QSGD_AG, FP16, DENSE)  # residuals are flushed when exploration ends


@dataclass
class _Setup:
    """Where Auto runs: set at the first exchange (hvd_gradcomp's optimizer, stock Horovod's or
    the DDP hook). ``average``: the exchange averages (a residual of the average, sent again
    by one rank, is then scaled by the number of ranks)."""

    mode: str
    comm: Any
    average: bool
    roads: Tuple[str, ...]
    schedule: Tuple[str, ...]   # the road of each exploring step
    measured: Tuple[bool, ...]  # per exploring step: False for a codec road's warm-up steps

    @property
    def ranks(self) -> int:
        return self.comm.size

    @property
    def rank(self) -> int:
        return self.comm.rank


class RoadSchedule:
    """:class:`hvd_gradcomp.auto.Auto`'s part that counts steps and says which road each takes:
    exploring, a decision's untimed and timed steps, the steps before a re-decision. Uses Auto's
    settings (``warmup_steps``, ``explore_steps``, ``interval``, ``roads``), its ``_setup``, ``step``,
    ``skipped`` and ``decisions``; a new step is handed to ``_on_new_step`` (:mod:`hvd_gradcomp.auto.measure`)."""

    def _plan(self) -> None:
        """The exploring steps of the roads not skipped (:meth:`_skip_slow_roads`)."""
        plan = self._exploring_plan(self._setup.roads, self.skipped)
        self._setup.schedule, self._setup.measured = tuple(r for r, _ in plan), tuple(m for _, m in plan)

    def _exploring_plan(self, roads: Sequence[str], skipped: Any = ()) -> List[Tuple[str, bool]]:
        """(road, measured) of each exploring step: each road in turn, its warm-up steps then its
        measured ones, less the ``skipped`` roads."""
        plan: List[Tuple[str, bool]] = []
        for r in roads:
            if r not in skipped:
                warm, measured = self._exploring_steps(r, first=r == roads[0])
                plan += [(r, False)] * warm + [(r, True)] * measured
        return plan


    # ------------------------------------------------------------ the schedule
    def _exploring_steps(self, road: str, first: bool = False) -> Tuple[int, int]:
        """(warm-up, measured) steps ``road`` takes while exploring (see :meth:`configure`). The
        ``first`` road explored also pays the training's own start (the optimizer's state, the
        heap growing to its size: in the benchmark's fixed rows the third step is still slower
        than the next ones, docs/AUTO.md), so it warms up one step more."""
        warm, measured = (0, 1) if road in (FP16, DENSE) else (self.warmup_steps, self.explore_steps)
        return warm + (1 if first and self.warmup_steps else 0), measured

    @property
    def start_steps(self) -> int:
        """Steps of Auto's start: exploring, the decision's step, ``warmup_steps`` untimed and
        ``explore_steps`` timed steps of the decision, and the verdict's step (a benchmark that
        excludes Auto's start from its timing warms up this many steps). With every road
        explored: fewer when roads are skipped (``explore_within``).

        >>> from hvd_gradcomp.auto import Auto
        >>> Auto().start_steps   # sparse 2 warm-up + 2, qsgd 1 + 2; fp16, dense: 1; 1 + 1 + 2 + 1
        14
        """
        exploring = len(self._exploring_plan(self.roads or OURS_ROADS))
        return exploring + 1 + self.warmup_steps + self.explore_steps + 1

    @property
    def exploring(self) -> bool:
        return self.step <= len(self._setup.schedule)

    def road_for(self, name: str) -> str:
        """Begin a step on the first exchange of it (deciding when due), and give ``name``'s road."""
        count = self._counts[name] = self._counts.get(name, 0) + 1
        if count > self.step:
            self.start_step(count)
        return self.road_of(name)

    def start_step(self, step: Optional[int] = None) -> None:
        """Begin exchange step ``step`` (default: the next one), deciding or verifying when due:
        a collective when it decides, called on every rank at the same step. The optimizers call
        it through :meth:`road_for`; the DDP hook at the first bucket of each step."""
        self.step = self.step + 1 if step is None else step
        self._on_new_step()

    def keep_only(self, names: Sequence[str]) -> None:
        """Forget the measurements and decisions of tensors not in ``names`` (the DDP hook's
        buckets of its first iteration, before DDP rebuilt them); same on every rank."""
        keep = set(names)
        for table in (self.costs, self.decisions, self.last_wait_s):
            for n in [n for n in table if n not in keep]:
                del table[n]
        self._samples = {k: v for k, v in self._samples.items() if k[0] in keep}

    def restart(self) -> None:
        """Explore again from the first road (the DDP hook, when DDP changed its buckets while
        Auto explored): the step count and the step times start over, measurements stay; every
        road is explored again, unless the first road's steps show it too slow once more."""
        self.step, self._step_t0, self._durations = 0, None, {}
        self.skipped = {}
        if self._setup is not None:
            self._plan()

    def road_of(self, name: str) -> str:
        """The road ``name`` takes in the current step."""
        if self.exploring:
            return self._setup.schedule[self.step - 1]
        return self.decisions.get(name, DENSE)

    @property
    def warming_up(self) -> bool:
        """In a codec road's unmeasured warm-up steps (exploring): nothing is recorded."""
        s = self._setup
        return s is not None and 1 <= self.step <= len(s.schedule) and not s.measured[self.step - 1]

    @property
    def measuring(self) -> bool:
        """In a measured exploring step, or in the ``explore_steps`` steps before a re-decision:
        codec times then count, and on GPU they are taken with the device synchronised."""
        done = self.step - 1 - len(self._setup.schedule)
        if done < 0:
            return not self.warming_up
        return done % self.interval >= self.interval - self.explore_steps

    def _phase(self, step: int) -> Optional[str]:
        """What the duration of ``step`` measures: a road (all tensors took it while exploring),
        ``"plan"`` (the steps after a decision and its ``warmup_steps``: on CPU the heap grows for a
        step or two after a switch, each step faulting in fresh pages), ``"before"`` (the steps
        before a re-decision)."""
        w, e = self.warmup_steps, self.explore_steps
        done = step - 1 - len(self._setup.schedule)
        if done < 0:   # a road's step time, unless a warm-up step
            return self._setup.schedule[step - 1] if self._setup.measured[step - 1] else None
        r = done % self.interval
        if w < r <= w + e:
            return "plan"
        return "before" if r >= self.interval - e and r > w + e else None
