"""What :class:`hvd_gradcomp.auto.Auto` measures, one part each: each tensor's codec seconds and
payload bytes per road (:class:`Costs`), each step's duration (:class:`StepClock`) and the link
(:class:`LinkProbe`, timed collectives called on every rank at the same step).
"""
from __future__ import annotations

import time
from collections import deque
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple

import torch

from . import policy
from .policy import DENSE, FP16, QSGD_AG, QSGD_AR, SPARSE, Link, TensorCosts

SAMPLES = 5
PROBE_SECONDS = 0.05   # about what each of the probe's large collectives takes on a slow link
PILOT_NUMEL = 1 << 16  # float32 values of the allreduce that sizes the first probe


class Measurements:
    """Per tensor: codec seconds (the least of the last ``SAMPLES``) and payload bytes per road,
    and the exposed wait of its last exchange.

    >>> c = Measurements()
    >>> c.record("w", "dense", 1000, 4, 0.002, 0.0, 4000); c.record("w", "dense", 1000, 4, 0.001, 0.0, 4000)
    >>> c.costs["w"].codec_s
    {'dense': 0.001}
    """

    def __init__(self) -> None:
        self.costs: Dict[str, TensorCosts] = {}
        self.last_wait_s: Dict[str, float] = {}
        self.samples: Dict[Tuple[str, str], Deque[float]] = {}

    def record(self, name: str, road: str, numel: int, itemsize: int, codec_s: float, wait_s: float,
               payload: float, counted: bool = True) -> None:
        """One finished exchange; its codec seconds and payload count only when ``counted``."""
        self.last_wait_s[name] = wait_s
        if not counted:
            return
        self.samples.setdefault((name, road), deque(maxlen=SAMPLES)).append(codec_s)
        c = self.costs.setdefault(name, TensorCosts(numel, itemsize))
        c.codec_s[road] = min(self.samples[(name, road)])
        c.payload[road] = payload

    def keep_only(self, keep: Sequence[str]) -> None:
        """Forget the tensors not in ``keep``."""
        keep = set(keep)
        for table in (self.costs, self.last_wait_s):
            for n in [n for n in table if n not in keep]:
                del table[n]
        self.samples = {k: v for k, v in self.samples.items() if k[0] in keep}

    def state_dict(self) -> Dict[str, Dict[str, Any]]:
        return {n: {"numel": c.numel, "itemsize": c.itemsize, "payload": dict(c.payload),
                    "codec_s": dict(c.codec_s)} for n, c in self.costs.items()}

    def load_state_dict(self, state: Dict[str, Dict[str, Any]]) -> None:
        self.costs = {n: TensorCosts(c["numel"], c["itemsize"], c["payload"], c["codec_s"]) for n, c in state.items()}
        self.samples = {(n, r): deque([v], maxlen=SAMPLES) for n, c in self.costs.items() for r, v in c.codec_s.items()}


class StepClock:
    """Step durations in seconds, by what they measure (a road alone while exploring, ``"plan"``,
    ``"before"``: :meth:`hvd_gradcomp.auto.schedule.Schedule.phase`)."""

    def __init__(self) -> None:
        self.t0: Optional[float] = None
        self.durations: Dict[str, List[float]] = {}

    @property
    def running(self) -> bool:
        return self.t0 is not None

    def lap(self, label: Optional[str]) -> None:
        """A step ends (all its exchanges done on every rank): its time counts under ``label``."""
        now = time.perf_counter()
        if label is not None:
            self.durations.setdefault(label, []).append(now - self.t0)
        self.t0 = now

    def restart(self) -> None:
        """The next step's time starts now (what ran since, a probe or a decision, is no step's)."""
        self.t0 = time.perf_counter()

    def take(self) -> Dict[str, List[float]]:
        """The durations so far, forgotten here."""
        durations, self.durations = self.durations, {}
        return durations

    def reset(self) -> None:
        self.t0, self.durations = None, {}


class LinkProbe:
    """The link, from timed collectives: a 1-value and an n-value float32 allreduce, an n-value
    fp16 allreduce, an allgather of n bytes per rank (:meth:`measure`); n sized to the link
    (:meth:`size`: ``probe_numel`` at most, fewer on a slow link, as many as it sends in about 50 ms).
    ``link``: the last one averaged over ranks (:meth:`adopt`)."""

    def __init__(self, probe_numel: int) -> None:
        self.probe_numel = probe_numel
        self.probed_numel = probe_numel   # values of the last probe's large collectives
        self.link: Optional[Link] = None
        self.fresh: Optional[Tuple[int, Tuple[float, ...]]] = None   # (step, probes) kept for a decision

    def keep(self, step: int, probes: Tuple[float, ...]) -> None:
        """Keep ``probes`` for a decision at this same ``step`` (:meth:`take`)."""
        self.fresh = (step, probes)

    def take(self, step: int) -> Optional[Tuple[float, ...]]:
        """The probes kept at ``step`` if any (forgotten either way)."""
        fresh, self.fresh = self.fresh, None
        return fresh[1] if fresh is not None and fresh[0] == step else None

    def adopt(self, probes: Tuple[float, ...], ranks: int) -> Link:
        """The link these probes (averaged over ranks) measure, kept as :attr:`link`."""
        small, large, fp16, gather = probes
        self.link = policy.link_from_probe(ranks, small, large, self.probed_numel, fp16 if fp16 >= 0 else None,
                                           gather if gather >= 0 else None)
        return self.link

    def measure(self, comm: Any, roads: Sequence[str], step: int) -> Tuple[float, float, float, float]:
        """Seconds of a 1-value and of an n-value float32 allreduce, of an n-value fp16 allreduce
        and of an allgather of n bytes per rank (least of 3 / 2 / 2 / 2; -1 for a road not
        allowed), n from :meth:`size` (kept in ``probed_numel``)."""
        roads = set(roads)
        device = getattr(comm, "device", torch.device("cpu"))

        def timed(collective: Any, numel: int, dtype: torch.dtype, tag: str, times: int = 2) -> float:
            best = float("inf")
            for i in range(times):
                t = torch.zeros(numel, dtype=dtype, device=device)
                t0 = time.perf_counter()
                collective(t, f"{tag}{i}.{step}")
                best = min(best, time.perf_counter() - t0)
            return best

        small = timed(comm.probe_allreduce, 1, torch.float32, "s", 3)
        n = self.probed_numel = self.size(lambda k: timed(comm.probe_allreduce, k, torch.float32, "p", 1), comm, step)
        large = timed(comm.probe_allreduce, n, torch.float32, "l")
        fp16 = timed(comm.probe_allreduce, n, torch.float16, "h") if FP16 in roads else -1.0
        gather = timed(comm.probe_allgather, n, torch.uint8, "g") if roads & {SPARSE, QSGD_AR, QSGD_AG} else -1.0
        return small, large, fp16, gather

    def size(self, pilot: Callable[[int], float], comm: Any, step: int) -> int:
        """Values of the probe's large collectives: ``probe_numel``, or as many as the link sends
        in about ``PROBE_SECONDS`` where it is slower (at 100 Mbit/s the full probe took 2 s, at
        every re-decision). The rate is the last decision's link, else a ``PILOT_NUMEL``-value
        allreduce timed by ``pilot`` (the time averaged over ranks: every rank gets the same size,
        as its collectives need)."""
        if self.probe_numel <= PILOT_NUMEL:
            return self.probe_numel
        if self.link is not None:
            rate = self.link.bandwidth
        else:
            seconds = float(comm.mean(torch.tensor([pilot(PILOT_NUMEL)], dtype=torch.float64), f"pilot.{step}")[0])
            rate = policy.wire_bytes(DENSE, comm.size, PILOT_NUMEL) / max(seconds, 1e-9)
        wanted = rate * PROBE_SECONDS / max(policy.wire_bytes(DENSE, comm.size, 1), 1.0)
        return int(min(self.probe_numel, max(PILOT_NUMEL, wanted)))
