""":class:`Decider`, the part of :class:`hvd_gradcomp.auto.Auto` that decides: which roads are not
worth exploring, each tensor's road (the model of :mod:`hvd_gradcomp.auto.policy` on measurements
averaged over ranks, rank 0's choices broadcast) and the verdict of the clock on a decision.
Each is a collective, called on every rank at the same step; ``comm`` is Auto's
(:class:`hvd_gradcomp.collectives.transport.Control`).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from . import policy
from .policy import DENSE, Link, TensorCosts


class Decider:
    """The decisions (tensor name -> road, identical on every rank), their ``history`` of
    switches (step, name, from, to) and ``verdicts`` (each verification: the times compared,
    what was kept). ``hysteresis``: a tensor switches, or a decision is undone, only past this
    fraction faster; ``explore_within``: see :meth:`skip_slow_roads`."""

    def __init__(self, hysteresis: float, explore_within: float) -> None:
        self.hysteresis, self.explore_within = hysteresis, explore_within
        self.decisions: Dict[str, str] = {}
        self.history: List[Tuple[int, str, Optional[str], str]] = []
        self.verdicts: List[Dict[str, Any]] = []
        self.baseline: Dict[str, float] = {}   # step seconds the next decision is verified against
        self.previous: Dict[str, str] = {}     # the decisions before the last re-decision

    def road_of(self, name: str) -> str:
        """``name``'s road once exploring is over (dense for a tensor not decided)."""
        return self.decisions.get(name, DENSE)

    def _switch(self, step: int, name: str, road: str) -> None:
        if self.decisions.get(name) != road:
            self.history.append((step, name, self.decisions.get(name), road))
        self.decisions[name] = road

    def skip_slow_roads(self, comm: Any, step: int, roads: Sequence[str], first_step_s: float,
                        probes: Tuple[float, ...], adopt: Callable[[Tuple[float, ...], int], Link],
                        sends: Callable[[str], List[Tuple[int, int, float]]]) -> Tuple[Tuple[float, ...],
                                                                                      Dict[str, Dict[str, float]]]:
        """After the first road's exploring steps: the roads whose bytes alone, at the probed rate,
        would take more than ``explore_within`` x the first road's measured step
        (:func:`policy.transfer_seconds` of ``sends(road)``, a lower bound on any step that sends
        them). At 100 Mbit/s exploring the dense road of a 25M-parameter model costs a 17 s step,
        fp16 9 s, QSGD three of 4 s, against 0.2 s on the sparse road: the start cost more than
        the rest of a short run. Returns the probes averaged over ranks (``adopt`` made them the
        link) and the roads skipped with their transfer and the first road's step, in ms."""
        rest = roads[1:]
        mean = comm.mean(torch.tensor([first_step_s, *probes], dtype=torch.float64), f"skip.{step}").tolist()
        step_s, probes = mean[0], tuple(mean[1:])
        link = adopt(probes, comm.size)
        transfer = {r: policy.transfer_seconds(r, comm.size, link, sends(r)) for r in rest}
        skip = torch.tensor([transfer[r] > self.explore_within * step_s for r in rest], dtype=torch.int32)
        skip = comm.broadcast(skip, f"skipped.{step}")
        return probes, {r: {"transfer_ms": 1e3 * transfer[r], "first_road_ms": 1e3 * step_s}
                        for r, flag in zip(rest, skip.tolist()) if flag}

    def open(self, durations: Dict[str, List[float]], roads: Sequence[str], first: bool) -> None:
        """Before a decision: what it is verified against, from the step ``durations`` since the
        last one: each road alone (the ``first`` decision, after exploring), else the steps before it."""
        self.baseline = ({r: min(durations[r]) for r in roads if r in durations} if first else
                         {"before": min(durations["before"])} if "before" in durations else {})
        self.previous = dict(self.decisions)

    def decide(self, comm: Any, step: int, roads: Sequence[str], costs: Dict[str, TensorCosts],
               probes: Tuple[float, ...], adopt: Callable[[Tuple[float, ...], int], Link],
               skipped: Sequence[str]) -> Dict[str, str]:
        """Average the measurements and ``probes`` over ranks (``adopt`` makes the probes the link),
        decide every tensor's road on rank 0 and broadcast."""
        names = sorted(costs)
        meas = torch.full((len(names) * len(roads) * 2 + len(probes),), -1.0, dtype=torch.float64)
        for i, n in enumerate(names):
            for j, r in enumerate(roads):
                k = 2 * (i * len(roads) + j)
                if r in costs[n].codec_s:
                    meas[k], meas[k + 1] = costs[n].codec_s[r], costs[n].payload.get(r, 0.0)
        meas[-len(probes):] = torch.tensor(probes, dtype=torch.float64)
        meas = comm.mean(meas, f"meas.{step}")
        link = adopt(tuple(float(v) for v in meas[-len(probes):]), comm.size)
        codes = torch.zeros(len(names), dtype=torch.int32)
        for i, n in enumerate(names):
            c = TensorCosts(costs[n].numel, costs[n].itemsize)
            for j, r in enumerate(roads):
                k = 2 * (i * len(roads) + j)
                if float(meas[k]) >= 0:
                    c.codec_s[r], c.payload[r] = float(meas[k]), float(meas[k + 1])
            if DENSE in skipped and DENSE not in c.codec_s:   # no codec: known without exploring
                c.codec_s[DENSE], c.payload[DENSE] = 0.0, float(c.numel * c.itemsize)
            choice = policy.decide(c, comm.size, link, roads, self.decisions.get(n), self.hysteresis)
            codes[i] = policy.ROADS.index(choice)
        codes = comm.broadcast(codes, f"decide.{step}")
        for n, code in zip(names, codes.tolist()):
            self._switch(step, n, policy.ROADS[code])
        return dict(self.decisions)

    def verify(self, comm: Any, step: int, plan: Optional[List[float]], names: Sequence[str]) -> None:
        """Compare the timed steps after the last decision (``plan``) with what it is verified
        against (each road alone, or the decisions before it) and keep the decision unless one of
        those was more than ``hysteresis`` faster, then the fastest (every tensor in ``names``)."""
        if not plan or not self.baseline:
            return
        keys = sorted(self.baseline)
        times = torch.tensor([min(plan)] + [self.baseline[k] for k in keys], dtype=torch.float64)
        times = comm.mean(times, f"verify.{step}")
        best = min(range(len(keys)), key=lambda i: float(times[i + 1]))
        # Kept unless the other is faster by more than ``hysteresis``, as a tensor switches road:
        # two timed steps each differ by a few percent run to run, and falling back sends every
        # tensor one way (at 1 Gbit/s, the small ones to the sparse road: ~15 ms a step more).
        faster = float(times[best + 1]) < float(times[0]) * (1.0 - self.hysteresis)
        code = torch.tensor([best + 1 if faster else 0], dtype=torch.int32)
        code = int(comm.broadcast(code, f"verdict.{step}")[0])
        kept = "plan" if code == 0 else keys[code - 1]
        self.verdicts.append({"step": step, "plan_ms": 1e3 * float(times[0]), "kept": kept,
                              "against_ms": {k: 1e3 * float(t) for k, t in zip(keys, times[1:].tolist())}})
        if code == 0:
            return
        names = sorted(set(self.decisions) | set(names))
        fallback = self.previous if kept == "before" else {n: kept for n in names}
        for n in names:
            self._switch(step, n, fallback.get(n, DENSE))

    def load(self, decisions: Dict[str, str]) -> None:
        """The decisions of a checkpoint."""
        self.decisions = dict(decisions)

    def keep_only(self, keep: Sequence[str]) -> None:
        """Forget the decisions of tensors not in ``keep``."""
        keep = set(keep)
        for n in [n for n in self.decisions if n not in keep]:
            del self.decisions[n]
