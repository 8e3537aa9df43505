"""The measurements and decisions of :class:`hvd_gradcomp.auto.Auto`: each step's duration, each
tensor's codec seconds and payload bytes per road, the link's probe, the decision per tensor and
its verification with the clock.
"""
from __future__ import annotations

import time
from collections import deque
from typing import Any, Dict, Tuple

import torch

from . import policy
from ..codecs.compressor import payload_size
from .policy import DENSE, FP16, QSGD_AG, QSGD_AR, SPARSE, Link, TensorCosts

SAMPLES = 5
PROBE_SECONDS = 0.05   # about what each of the probe's large collectives takes on a slow link
PILOT_NUMEL = 1 << 16  # float32 values of the allreduce that sizes the first probe


class RoadMeasure:
    """:class:`hvd_gradcomp.auto.Auto`'s part that measures and decides: collectives called on every
    rank at the same step (times averaged over ranks, rank 0's choices broadcast). Uses Auto's
    settings, its compressors (``sparse``, ``qsgd``) for payload sizes, its ``_setup`` and the
    step bookkeeping of :class:`hvd_gradcomp.auto.schedule.RoadSchedule`."""

    def _on_new_step(self) -> None:
        """All exchanges of the previous step are done on every rank: the link is idle."""
        now = time.perf_counter()
        label = self._phase(self.step - 1) if self._step_t0 is not None and self.step > 1 else None
        if label is not None:
            self._durations.setdefault(label, []).append(now - self._step_t0)
        self._step_t0 = now
        first = sum(self._exploring_steps(self._setup.roads[0], first=True))
        if self.step == first + 1 and len(self._setup.roads) > 1:   # once per exploration
            self._skip_slow_roads()
            self._step_t0 = time.perf_counter()   # the probe is not part of the next step's time
        verdict = self.warmup_steps + self.explore_steps + 1   # steps after a decision
        done = self.step - 1 - len(self._setup.schedule)
        if done >= 0 and done % self.interval == 0:
            roads = [r for r in self._setup.roads if r in self._durations]
            self._baseline = ({r: min(self._durations[r]) for r in roads} if done == 0 else
                              {"before": min(self._durations["before"])} if "before" in self._durations else {})
            self._previous = dict(self.decisions)
            self._durations = {}
            self.decide()
            self._step_t0 = time.perf_counter()   # the probe is not part of the next step's time
        elif done >= 0 and done % self.interval == verdict and self.interval > verdict:
            self.verify()

    def _skip_slow_roads(self) -> None:
        """After the first road's exploring steps: probe the link, and skip the roads whose bytes
        alone, at the probed rate, would take more than ``explore_within`` x the first road's
        measured step (:func:`policy.transfer_seconds`, a lower bound on any step that sends
        them). At 100 Mbit/s exploring the dense road of a 25M-parameter model costs a 17 s
        step, fp16 9 s, QSGD three of 4 s, against 0.2 s on the sparse road: the start cost
        more than the rest of a short run. A collective, called on every rank at the same step
        (times averaged over ranks, rank 0's choice broadcast); the probe is kept for a
        decision at this same step."""
        s = self._setup
        first, rest = s.roads[0], s.roads[1:]
        if first not in self._durations or not self.costs:
            return
        probes = self._probe()
        mean = s.comm.mean(torch.tensor([min(self._durations[first]), *probes], dtype=torch.float64),
                           f"skip.{self.step}").tolist()
        step_s, probes = mean[0], tuple(mean[1:])
        self._fresh_probe = (self.step, probes)
        link = self.link = self._link(probes)
        transfer = {r: policy.transfer_seconds(r, s.ranks, link, [
            (c.numel, c.itemsize, c.payload.get(r, self._least_payload(r, c.numel))) for c in self.costs.values()])
            for r in rest}
        skip = torch.tensor([transfer[r] > self.explore_within * step_s for r in rest], dtype=torch.int32)
        skip = s.comm.broadcast(skip, f"skipped.{self.step}")
        self.skipped = {r: {"transfer_ms": 1e3 * transfer[r], "first_road_ms": 1e3 * step_s}
                        for r, flag in zip(rest, skip.tolist()) if flag}
        self._plan()

    def _least_payload(self, road: str, numel: int) -> float:
        """A road's payload bytes for a tensor it has not sent yet, never more than it will be:
        QSGD's exactly, a sparse payload's without its indices (dense and fp16 need none)."""
        if road in (QSGD_AR, QSGD_AG):
            return float(payload_size(self.qsgd, (numel,)))
        if road == SPARSE:
            return float(payload_size(self.sparse, (numel,), index_bytes=0))
        return 0.0

    def _link(self, probes: Tuple[float, ...]) -> Link:
        small, large, fp16, gather = probes
        return policy.link_from_probe(self._setup.ranks, small, large, self._probed_numel, fp16 if fp16 >= 0 else None,
                                      gather if gather >= 0 else None)

    # ------------------------------------------------------------ measure
    def record(self, name: str, road: str, numel: int, itemsize: int, codec_s: float, wait_s: float,
               payload: float, measured: bool = True) -> None:
        """One finished exchange: its codec seconds, its exposed wait, its payload bytes.
        ``measured=False``: the codec time was taken without synchronising the device (GPU, not
        measuring): only the wait counts. Nothing but the wait in a warm-up step (:attr:`warming_up`)."""
        self.last_wait_s[name] = wait_s
        if not measured or self.warming_up:
            return
        self._samples.setdefault((name, road), deque(maxlen=SAMPLES)).append(codec_s)
        c = self.costs.setdefault(name, TensorCosts(numel, itemsize))
        c.codec_s[road] = min(self._samples[(name, road)])
        c.payload[road] = payload

    # ------------------------------------------------------------ decide
    def decide(self) -> Dict[str, str]:
        """Probe the link, average the measurements over ranks, decide every tensor's road on
        rank 0 and broadcast: a collective, called on every rank at the same step."""
        s = self._setup
        names = sorted(self.costs)
        roads = s.roads
        fresh, self._fresh_probe = self._fresh_probe, None
        probes = fresh[1] if fresh is not None and fresh[0] == self.step else self._probe()
        meas = torch.full((len(names) * len(roads) * 2 + len(probes),), -1.0, dtype=torch.float64)
        for i, n in enumerate(names):
            for j, r in enumerate(roads):
                k = 2 * (i * len(roads) + j)
                if r in self.costs[n].codec_s:
                    meas[k], meas[k + 1] = self.costs[n].codec_s[r], self.costs[n].payload.get(r, 0.0)
        meas[-len(probes):] = torch.tensor(probes, dtype=torch.float64)
        meas = s.comm.mean(meas, f"meas.{self.step}")
        self.link = self._link(tuple(float(v) for v in meas[-len(probes):]))
        codes = torch.zeros(len(names), dtype=torch.int32)
        for i, n in enumerate(names):
            c = TensorCosts(self.costs[n].numel, self.costs[n].itemsize)
            for j, r in enumerate(roads):
                k = 2 * (i * len(roads) + j)
                if float(meas[k]) >= 0:
                    c.codec_s[r], c.payload[r] = float(meas[k]), float(meas[k + 1])
            if DENSE in self.skipped and DENSE not in c.codec_s:   # no codec: known without exploring
                c.codec_s[DENSE], c.payload[DENSE] = 0.0, float(c.numel * c.itemsize)
            choice = policy.decide(c, s.ranks, self.link, roads, self.decisions.get(n), self.hysteresis)
            codes[i] = policy.ROADS.index(choice)
        codes = s.comm.broadcast(codes, f"decide.{self.step}")
        for n, code in zip(names, codes.tolist()):
            road = policy.ROADS[code]
            if self.decisions.get(n) != road:
                self.history.append((self.step, n, self.decisions.get(n), road))
            self.decisions[n] = road
        return dict(self.decisions)

    def _probe(self) -> Tuple[float, float, float, float]:
        """Seconds of a 1-value and of an n-value float32 allreduce, of an n-value fp16 allreduce
        and of an allgather of n bytes per rank (least of 3 / 2 / 2 / 2; -1 for a road not
        allowed), n from :meth:`_probe_size` (kept in ``_probed_numel``)."""
        comm = self._setup.comm
        roads = set(self._setup.roads)
        device = getattr(comm, "device", torch.device("cpu"))

        def timed(collective: Any, numel: int, dtype: torch.dtype, tag: str, times: int = 2) -> float:
            best = float("inf")
            for i in range(times):
                t = torch.zeros(numel, dtype=dtype, device=device)
                t0 = time.perf_counter()
                collective(t, f"{tag}{i}.{self.step}")
                best = min(best, time.perf_counter() - t0)
            return best

        small = timed(comm.probe_allreduce, 1, torch.float32, "s", 3)
        n = self._probed_numel = self._probe_size(lambda numel: timed(comm.probe_allreduce, numel, torch.float32, "p", 1))
        large = timed(comm.probe_allreduce, n, torch.float32, "l")
        fp16 = timed(comm.probe_allreduce, n, torch.float16, "h") if FP16 in roads else -1.0
        gather = timed(comm.probe_allgather, n, torch.uint8, "g") if roads & {SPARSE, QSGD_AR, QSGD_AG} else -1.0
        return small, large, fp16, gather

    def _probe_size(self, pilot: Any) -> int:
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
            seconds = float(self._setup.comm.mean(torch.tensor([pilot(PILOT_NUMEL)], dtype=torch.float64),
                                                  f"pilot.{self.step}")[0])
            rate = policy.wire_bytes(DENSE, self._setup.ranks, PILOT_NUMEL) / max(seconds, 1e-9)
        wanted = rate * PROBE_SECONDS / max(policy.wire_bytes(DENSE, self._setup.ranks, 1), 1.0)
        return int(min(self.probe_numel, max(PILOT_NUMEL, wanted)))

    def verify(self) -> None:
        """Compare the timed steps after the last decision with what it is verified against (each
        road alone, or the decisions before it) and keep the decision unless one of those was
        more than ``hysteresis`` faster, then the fastest: a collective,
        called on every rank at the same step (times averaged over ranks, rank 0's verdict
        broadcast)."""
        plan = self._durations.get("plan")
        if not plan or not self._baseline:
            return
        s = self._setup
        keys = sorted(self._baseline)
        times = torch.tensor([min(plan)] + [self._baseline[k] for k in keys], dtype=torch.float64)
        times = s.comm.mean(times, f"verify.{self.step}")
        best = min(range(len(keys)), key=lambda i: float(times[i + 1]))
        # Kept unless the other is faster by more than ``hysteresis``, as a tensor switches road:
        # two timed steps each differ by a few percent run to run, and falling back sends every
        # tensor one way (at 1 Gbit/s, the small ones to the sparse road: ~15 ms a step more).
        faster = float(times[best + 1]) < float(times[0]) * (1.0 - self.hysteresis)
        code = torch.tensor([best + 1 if faster else 0], dtype=torch.int32)
        code = int(s.comm.broadcast(code, f"verdict.{self.step}")[0])
        kept = "plan" if code == 0 else keys[code - 1]
        self.verdicts.append({"step": self.step, "plan_ms": 1e3 * float(times[0]), "kept": kept,
                              "against_ms": {k: 1e3 * float(t) for k, t in zip(keys, times[1:].tolist())}})
        if code == 0:
            return
        names = sorted(set(self.decisions) | set(self.costs))
        fallback = self._previous if kept == "before" else {n: kept for n in names}
        for n in names:
            road = fallback.get(n, DENSE)
            if self.decisions.get(n) != road:
                self.history.append((self.step, n, self.decisions.get(n), road))
            self.decisions[n] = road
