"""``gc.Auto()``: pick, per tensor and while training runs, the road that costs least.

Compression pays only when the bytes it saves take longer to send than its codec takes to
run: on a slow link TopKQSGD wins by far, on a fast one (or on many ranks, where an allgather
grows with the rank count) the plain allreduce does. ``Auto`` measures instead of guessing:

1. **Explore**: every tensor takes each road in turn (``sparse``: TopKQSGD allgather,
   ``qsgd``: QSGD compressed allreduce, or allgather inside stock Horovod, for
   ``warmup_steps`` unmeasured steps, then ``explore_steps`` measured ones; ``fp16`` and
   ``dense`` for one measured step each), and its encode + decode seconds, payload bytes and
   the step's time are measured; the least of a road's samples counts. A codec road's first
   steps pay one-off costs (``torch.compile`` of its kernels, again on the first calls with
   new shapes or with a residual; buffers; Horovod's first negotiation of each name): measured,
   they made the road explored first look far slower than it runs.
   After the first road's steps the link is probed once: a road whose bytes alone would take
   more than ``explore_within`` (1.5) x the first road's measured step is not explored (at
   100 Mbit/s the dense road's one step of a 25M-parameter model takes 17 s).
2. **Probe** each road's collective: timed allreduces (a tiny one for latency, ``probe_numel``
   float32 values, as many fp16 values: Horovod reduces fp16 in half precision, on CPU far
   slower than its bytes suggest) and an allgather of ``probe_numel`` bytes.
3. **Decide**: the model of :mod:`hvd_gradcomp.policy` (codec + latency x rounds + bytes /
   the road's measured rate, with the rank count in the bytes, so the road switches past the
   crossover) picks each tensor's road. Measurements are averaged over ranks (allreduce) and
   rank 0's decisions are broadcast: every rank takes the same road for every tensor.
4. **Verify** with the clock: after a decision and ``warmup_steps`` more steps (the first
   uses of roads new to a tensor: a road not explored negotiates and allocates there), the
   ``explore_steps`` next steps are timed and compared with the step times measured for each
   road alone while exploring (the dense road included); if one road alone was faster by more
   than ``hysteresis``, every tensor takes it. After a re-decision the comparison is with the
   steps just before it, and the old decisions come back if they were that much faster. A
   model can be wrong; a step time is what the user waits for.
5. **Re-decide** every ``interval`` steps (re-probe, codec costs of the roads in use
   refreshed), switching a tensor only when the new road is ``hysteresis`` faster.

Error feedback across switches: what a compressed road left behind (its residual) is added
to the tensor's next send, whatever road that takes, and dropped from the old compressor; so
nothing is lost or sent twice. For QSGD's compressed allreduce, the residual of the re-quantised
reduced chunk this rank owns goes back in at its place, times the number of ranks under
``hvd.Average`` (it was a residual of the average).

Example::

    opt = gc.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                  compression=gc.Auto())
    # or stock: hvd.DistributedOptimizer(opt, named_parameters=..., compression=gc.Auto())
    ...
    print(opt.compression.report()["summary"])
    # step 120: sparse x6, dense x1; link 0.96 Gbit/s, latency 0.11 ms

Decisions and measurements: :meth:`Auto.report`.
"""
from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any, Deque, Dict, List, Optional, Sequence, Tuple

import torch

from . import feedback as fb
from . import policy
from .compressors import _compressible, payload_size
from .exchange import (AllgatherExchange, DenseExchange, FusedAllgatherExchange, Pending, ScatterReduceExchange,
                       TimedExchange, allreducible, chunk_bounds, wait_done)
from .feedback import residual_dtype
from .policy import DENSE, FP16, QSGD_AG, QSGD_AR, SPARSE, Link, TensorCosts
from .qsgd import QSGD
from .topk import TopKQSGD

OURS_ROADS = (SPARSE, QSGD_AR, FP16, DENSE)   # exploration order: the dense road last, so the
STOCK_ROADS = (SPARSE, QSGD_AG, FP16, DENSE)  # residuals are flushed when exploration ends
SAMPLES = 5
PROBE_SECONDS = 0.05   # about what each of the probe's large collectives takes on a slow link
PILOT_NUMEL = 1 << 16  # float32 values of the allreduce that sizes the first probe


def _hvd():
    import horovod.torch as hvd
    return hvd


class HorovodComm:
    """The collectives :class:`Auto` decides with, over Horovod (a process set).

    Another framework's adapter (``hvd_gradcomp.ddp`` has one over ``torch.distributed``)
    provides the same methods, so that the decision logic is the same on every road.
    """

    def __init__(self, process_set: Any) -> None:
        self.process_set = process_set

    size = property(lambda self: self.process_set.size())
    rank = property(lambda self: self.process_set.rank())

    def mean(self, t: torch.Tensor, tag: str) -> torch.Tensor:
        """The average of ``t`` over the ranks (float64 on the host)."""
        hvd = _hvd()
        return hvd.allreduce(t, op=hvd.Average, name=f"hvdgc.auto.{tag}", process_set=self.process_set)

    def broadcast(self, t: torch.Tensor, tag: str) -> torch.Tensor:
        """Rank 0's ``t`` (of the process set) on every rank."""
        ranks = getattr(self.process_set, "ranks", None)
        return _hvd().broadcast(t, root_rank=ranks[0] if ranks else 0, name=f"hvdgc.auto.{tag}",
                                process_set=self.process_set)

    def allreduce(self, t: torch.Tensor, tag: str) -> None:
        """A blocking allreduce of ``t``, for the probe's timing."""
        _hvd().allreduce(t, name=f"hvdgc.auto.probe.{tag}", process_set=self.process_set)

    def allgather(self, t: torch.Tensor, tag: str) -> None:
        """A blocking allgather of ``t``, for the probe's timing."""
        _hvd().allgather(t, name=f"hvdgc.auto.probe.{tag}", process_set=self.process_set)


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


class Auto:
    """Automatic road per tensor: dense, fp16, QSGD or TopKQSGD, measured and re-decided.

    Args:
        ratio, bits: TopKQSGD's settings for the sparse road.
        qsgd_bits: QSGD's bits for the compressed-allreduce road.
        roads: the roads allowed (default all: ``"sparse", "qsgd", "fp16", "dense"``).
        explore_steps: measured steps each codec road (sparse, qsgd) is tried for at the start
            (the least of the samples is used; fp16 and dense, with nothing to warm up, take one
            step each), and steps timed after each decision to verify it.
        warmup_steps: unmeasured steps each codec road takes first while exploring: its
            one-off start-up costs (kernel compilation, buffers, Horovod's negotiation of new
            names) stay out of its codec costs and step times; as many steps after each
            decision go untimed before the steps that verify it.
        explore_within: after the first road's exploring steps the link is probed, and a road
            whose bytes alone, at the probed rate, would take more than this multiple of the first
            road's measured step is not explored (it cannot be faster, and on a slow link each of
            its steps costs seconds); ``math.inf`` explores every road.
        interval: steps between re-decisions.
        hysteresis: a tensor switches only if the new road is this fraction faster.
        probe_numel: float32 values of the bandwidth probe's allreduce (fewer on a slow link:
            as many as it sends in about 50 ms).
        error_feedback, seed: as for the compressors.
        named_parameters: for stock Horovod, as the compressors' (see :meth:`bind`).

    >>> Auto()
    Auto(roads=('sparse', 'qsgd', 'fp16', 'dense'), ratio=0.01, bits=8, qsgd_bits=8, interval=200)
    """

    def __init__(self, ratio: float = 0.01, bits: int = 8, qsgd_bits: int = 8,
                 roads: Optional[Sequence[str]] = None, explore_steps: int = 2, warmup_steps: int = 1,
                 explore_within: float = 1.5, interval: int = 200,
                 hysteresis: float = 0.1, probe_numel: int = 1 << 20, error_feedback: bool = True,
                 seed: Optional[int] = None, named_parameters: Any = None) -> None:
        # exempt="fp32": Auto's small tensors keep the dense road on every wrapper (in the DDP hook
        # they would otherwise go float16 in the buckets that take a compressed road only).
        self.sparse = TopKQSGD(ratio=ratio, bits=bits, error_feedback=error_feedback, seed=seed, exempt="fp32")
        self.qsgd = QSGD(bits=qsgd_bits, error_feedback=error_feedback, seed=seed, exempt="fp32")
        self.roads = _check_roads(roads)
        for arg, value, low in (("explore_steps", explore_steps, 1), ("warmup_steps", warmup_steps, 0),
                                ("interval", interval, 1), ("probe_numel", probe_numel, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{arg} must be an int >= {low}, got {value!r}")
        if isinstance(hysteresis, bool) or not isinstance(hysteresis, (int, float)) or not 0 <= hysteresis < 1:
            raise ValueError(f"hysteresis must be a number in [0, 1) (a fraction), got {hysteresis!r}")
        if isinstance(explore_within, bool) or not isinstance(explore_within, (int, float)) or not explore_within >= 1:
            raise ValueError(f"explore_within must be a number >= 1 (a multiple of the first road's step; "
                             f"math.inf explores every road), got {explore_within!r}")
        self.explore_within = float(explore_within)
        self.explore_steps, self.warmup_steps, self.interval = explore_steps, warmup_steps, interval
        self.hysteresis, self.probe_numel = float(hysteresis), probe_numel
        self.step = 0                       # steps begun (the first exchange of a step starts it)
        self.decisions: Dict[str, str] = {}  # tensor name -> road, identical on every rank
        self.costs: Dict[str, TensorCosts] = {}
        self.link: Optional[Link] = None
        self.history: List[Tuple[int, str, Optional[str], str]] = []  # (step, name, from, to)
        self.last_wait_s: Dict[str, float] = {}
        self.verdicts: List[Dict[str, Any]] = []   # each verification: the times compared, what was kept
        # roads not explored (see _skip_slow_roads): road -> its transfer and the first road's step, ms
        self.skipped: Dict[str, Dict[str, float]] = {}
        self._fresh_probe: Optional[Tuple[int, Tuple[float, ...]]] = None   # (step, probes) for decide()
        self._probed_numel = probe_numel   # values of the last probe's large collectives (_probe_size)
        self._counts: Dict[str, int] = {}
        self._step_t0: Optional[float] = None
        self._durations: Dict[str, List[float]] = {}   # step seconds: per road (exploring), "plan", "before"
        self._baseline: Dict[str, float] = {}          # what the plan is verified against
        self._previous: Dict[str, str] = {}            # the decisions before the last re-decision
        self._samples: Dict[Tuple[str, str], Deque[float]] = {}
        self._setup: Optional[_Setup] = None
        self._names: Optional[Dict[torch.Tensor, str]] = None
        self._noted = False   # see note_optimizer
        if named_parameters is not None:
            self.bind(named_parameters)

    def __repr__(self) -> str:
        return (f"Auto(roads={self.roads or OURS_ROADS}, ratio={self.sparse.ratio}, bits={self.sparse.bits}, "
                f"qsgd_bits={self.qsgd.bits}, interval={self.interval})")

    # Its sparse road's error feedback is classic whatever the optimizer (see GradientCompressor.policy_settled)
    policy_settled = True

    def note_optimizer(self, optimizer: Any, rank: int) -> None:
        """Say once, on rank 0, when ``optimizer`` has a feedback recipe of its own (momentum
        correction for SGD with momentum, ``frozen`` for Adam/AdamW, see
        :func:`hvd_gradcomp.feedback.choose`) that Auto's compressed roads do not apply: their error
        feedback is classic, since a tensor may change road at any re-decision and those recipes
        keep state tied to one road. Called by the optimizers and the DDP hook."""
        if self._noted or rank != 0 or optimizer is None:
            return
        self._noted = True
        key, _ = fb.choose(optimizer, False, True)
        if key in ("classic", "none"):
            return
        name = fb.plain_class(optimizer).__name__
        fb.announce(f"{self!r} with {name}: error feedback on its compressed roads is classic (on gradients), "
                    f"not the recipe a fixed compressor applies for {name} (feedback '{key}'). Where it picks a "
                    f"compressed road (a slow link), compression=hvd_gradcomp.TopKQSGD(ratio={self.sparse.ratio}, "
                    f"bits={self.sparse.bits}) trains closer to uncompressed (docs/AUTO.md, docs/STUDY.md).")

    # ------------------------------------------------------------ set-up
    def make_exchange(self, op: Any, process_set: Any) -> "AutoExchange":
        """Called by ``hvd_gradcomp.DistributedOptimizer``: the exchange that routes each tensor."""
        self._configure("ours", op, process_set)
        return AutoExchange(self, op, process_set)

    def _configure(self, mode: str, op: Any, process_set: Any) -> None:
        if self._setup is None:
            self.configure(mode, HorovodComm(process_set), op == _hvd().Average)
        elif self._setup.mode != mode:
            raise ValueError("this Auto() is already used by another optimizer; give each optimizer its own")

    def configure(self, mode: str, comm: Any, average: bool) -> None:
        """Bind to where it runs (once): ``mode`` ``"ours"`` (hvd_gradcomp's optimizer), ``"stock"``
        (inside ``hvd.DistributedOptimizer``) or ``"ddp"`` (the DDP hook); ``comm``: its
        collectives (:class:`HorovodComm` or the same methods over another library)."""
        if self._setup is not None:
            raise ValueError("this Auto() is already used by another optimizer or hook; give each its own")
        allowed = STOCK_ROADS if mode == "stock" else OURS_ROADS
        roads = self.roads or allowed
        # "qsgd" names QSGD's road everywhere: the compressed allreduce in ours and in the DDP
        # hook, the allgather inside stock Horovod.
        roads = tuple((QSGD_AG if mode == "stock" else QSGD_AR) if r in (QSGD_AR, QSGD_AG) else r for r in roads)
        # A codec road first runs warmup_steps unmeasured steps, then explore_steps measured ones
        # (least sample counts). Its first calls pay one-off costs that spread over two steps
        # (torch.compile at the first call, again at the first with new shapes or with a
        # residual; buffers; Horovod negotiating new names): a 1 Gbit/s benchmark whose first
        # road measured them ran 12% slower than its best fixed setting, one warm-up step plus
        # the least of two samples leaves them out. fp16 and dense run once, measured: a cast
        # compiles nothing, their first-use cost (a negotiation) is small against their step, and
        # on a slow link each of their steps is the slowest of the run.
        self._setup = _Setup(mode, comm, average, roads, (), ())
        self._plan()
        self.sparse.stream = self.qsgd.stream = comm.rank  # independent noise per rank

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

        small = timed(comm.allreduce, 1, torch.float32, "s", 3)
        n = self._probed_numel = self._probe_size(lambda numel: timed(comm.allreduce, numel, torch.float32, "p", 1))
        large = timed(comm.allreduce, n, torch.float32, "l")
        fp16 = timed(comm.allreduce, n, torch.float16, "h") if FP16 in roads else -1.0
        gather = timed(comm.allgather, n, torch.uint8, "g") if roads & {SPARSE, QSGD_AR, QSGD_AG} else -1.0
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

    # ------------------------------------------------------------ error feedback across roads
    def owes(self, name: str, road: str) -> bool:
        """Whether a road other than ``road`` holds a residual of ``name`` (which
        :meth:`flush_residuals` would add to its next send)."""
        s = self._setup
        return ((road != SPARSE and self.sparse.residuals.residual(name) is not None)
                or (road not in (QSGD_AR, QSGD_AG) and self.qsgd.residuals.residual(name) is not None)
                or (road != QSGD_AR and s.mode != "stock"
                    and self.qsgd.relay_residuals.residual(f"{name}#reduced{s.rank}") is not None))

    def flush_residuals(self, name: str, grad: torch.Tensor, road: str) -> torch.Tensor:
        """``grad`` plus whatever residual another road left for ``name`` (then dropped there)."""
        s = self._setup
        extra = []
        if road != SPARSE:
            extra.append((self.sparse.residuals.pop(name), 0, 1.0))
        if road not in (QSGD_AR, QSGD_AG):
            extra.append((self.qsgd.residuals.pop(name), 0, 1.0))
        if road != QSGD_AR and s.mode != "stock":
            # The residual of this rank's reduced chunk belongs to the average at that chunk:
            # sent from this rank alone it is averaged again, hence the factor P.
            chunk = self.qsgd.relay_residuals.pop(f"{name}#reduced{s.rank}")
            scale = float(s.ranks) if s.average else 1.0
            start = chunk_bounds(grad.numel(), s.ranks)[s.rank]
            extra.append((chunk, start, scale))
        extra = [e for e in extra if e[0] is not None]
        if not extra:
            return grad
        flat = grad.reshape(-1).to(residual_dtype(grad.dtype), copy=True)
        for res, start, scale in extra:
            flat[start:start + res.numel()].add_(res.to(flat.device), alpha=scale)
        return flat.to(grad.dtype).view(grad.shape)

    # ------------------------------------------------------------ stock Horovod's protocol
    def bind(self, named_parameters: Any) -> "Auto":
        """Use these names for the gradients stock Horovod hands to compress() (as the
        compressors' ``bind``); without it the names come from Horovod's optimizer. Returns self."""
        from .horovod import name_map

        self._names = name_map(named_parameters)
        return self

    def compress(self, tensor: torch.Tensor, name: Optional[str] = None) -> Tuple[torch.Tensor, Any]:
        """Inside stock ``hvd.DistributedOptimizer``: the tensor's road (see :mod:`hvd_gradcomp.horovod`).
        Anywhere else (e.g. hvd_gradcomp's fused small tensors) the tensor passes unchanged."""
        from . import horovod

        if not _compressible(tensor):
            return tensor, None
        call = horovod.find_horovod_call(tensor, self._names)
        if call is None:
            return tensor, None
        self._configure("stock", call.op, call.process_set)
        self.note_optimizer(call.optimizer, call.process_set.rank())
        road = self.road_for(call.name)
        tensor = self.flush_residuals(call.name, tensor, road)
        t0 = time.perf_counter()
        if road == DENSE:
            out, inner = allreducible(tensor), None   # decompress() casts back
            payload = out.numel() * out.element_size()
        elif road == FP16:
            out, inner = _hvd().Compression.fp16.compress(tensor)
            payload = out.numel() * out.element_size()
        else:
            exchange = AllgatherExchange(self.sparse if road == SPARSE else self.qsgd, call.op, call.process_set)
            inner = (exchange, exchange.start(call.name, tensor))
            out, payload = allreducible(tensor.new_empty(0)), inner[1].bytes_sent
        ctx = _StockCtx(call.name, road, inner, tensor, time.perf_counter() - t0, payload)
        return out, ctx

    def decompress(self, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Inverse of :meth:`compress`: inside Horovod, the averaged (or summed) gradient."""
        if ctx is None:
            return tensor
        wait = 0.0
        if ctx.road in (SPARSE, QSGD_AG):
            wait = wait_done(ctx.inner[1].handle)
        t0 = time.perf_counter()
        if ctx.road == DENSE:
            out = tensor.to(ctx.like.dtype)
        elif ctx.road == FP16:
            out = _hvd().Compression.fp16.decompress(tensor, ctx.inner)
        else:
            exchange, pending = ctx.inner
            out = torch.empty(pending.shape, dtype=pending.dtype, device=ctx.like.device)
            exchange.finish(pending, out)
        self.record(ctx.name, ctx.road, ctx.like.numel(), ctx.like.element_size(),
                    ctx.codec_s + time.perf_counter() - t0, wait, ctx.payload)
        return out

    # ------------------------------------------------------------ report / checkpoints
    def report(self) -> Dict[str, Any]:
        """Decisions, measured costs and the link, for logs and the benchmark.

        ``tensors[name]``: the road, the codec milliseconds and payload bytes measured per road,
        the modelled milliseconds per road and the exposed wait of the last exchange.
        ``verdicts``: each verification (:meth:`verify`): the step, the milliseconds per step of
        the decisions and of what they were compared with, and what was kept. ``skipped``: the
        roads not explored (``explore_within``), with the milliseconds their bytes alone would
        take per step and the first road's measured step.
        """
        s = self._setup
        ranks = s.ranks if s else 1
        tensors = {}
        for name, c in sorted(self.costs.items()):
            model = policy.road_times(c, ranks, self.link, c.codec_s) if self.link else {}
            tensors[name] = {"road": self.decisions.get(name), "numel": c.numel,
                             "codec_ms": {r: 1e3 * v for r, v in c.codec_s.items()},
                             "payload_bytes": dict(c.payload), "model_ms": {r: 1e3 * v for r, v in model.items()},
                             "wait_ms": 1e3 * self.last_wait_s.get(name, 0.0)}
        counts = Counter(self.decisions.values())
        link = (f"link {8 * self.link.bandwidth / 1e9:.2f} Gbit/s, latency {1e3 * self.link.latency:.2f} ms"
                if self.link else "link not probed yet")
        state = "exploring" if s and self.exploring else ", ".join(f"{r} x{n}" for r, n in sorted(counts.items()))
        if self.verdicts:
            v = self.verdicts[-1]
            against = ", ".join(f"{k} {ms:.0f}" for k, ms in sorted(v["against_ms"].items()))
            state += (f" (verified at step {v['step']}: decisions {v['plan_ms']:.0f} ms/step against {against}; "
                      f"kept {'the decisions' if v['kept'] == 'plan' else v['kept']})")
        if self.skipped:
            state += "; not explored: " + ", ".join(
                f"{r} (its bytes alone {v['transfer_ms']:.0f} ms/step against {v['first_road_ms']:.0f})"
                for r, v in self.skipped.items())
        return {"step": self.step, "ranks": ranks, "decisions": dict(self.decisions), "tensors": tensors,
                "verdicts": list(self.verdicts), "skipped": {r: dict(v) for r, v in self.skipped.items()},
                "link": None if self.link is None else {"bandwidth_Bps": self.link.bandwidth,
                                                        "latency_s": self.link.latency},
                "switches": [list(h) for h in self.history],
                "summary": f"step {self.step}: {state or 'no tensor yet'}; {link}"}

    def state_dict(self) -> Dict[str, Any]:
        """Both compressors' residuals and random state, the step, the decisions, the measured
        costs and the roads skipped (residuals differ per rank: one file per rank, as for the
        compressors).

        >>> a = Auto(); b = Auto(); b.load_state_dict(a.state_dict()); b.step
        0
        """
        return {"sparse": self.sparse.state_dict(), "qsgd": self.qsgd.state_dict(), "step": self.step,
                "counts": dict(self._counts), "decisions": dict(self.decisions),
                "costs": {n: {"numel": c.numel, "itemsize": c.itemsize, "payload": dict(c.payload),
                              "codec_s": dict(c.codec_s)} for n, c in self.costs.items()},
                "skipped": {r: dict(v) for r, v in self.skipped.items()}}

    def check_state(self, state: Any) -> None:
        """Raise ``ValueError`` naming what keeps ``state`` from loading (:meth:`load_state_dict` checks
        everything before it changes anything; so does ``GradientAccumulator.load_state_dict``).

        >>> Auto().check_state(TopKQSGD().state_dict())
        Traceback (most recent call last):
        ...
        ValueError: state lacks ['counts', 'decisions', 'qsgd', 'sparse', 'step']: not a state_dict() of Auto (it was saved by TopKQSGD(ratio=0.01, bits=8, bucket_size=512, error_feedback=True)). Build the optimizer with the compression the checkpoint was taken with, or set state['compression'] = None to restart error feedback. Nothing was changed.
        """
        if not isinstance(state, dict):
            raise ValueError(f"Auto's state must be the dict state_dict() returns, got {type(state).__name__}. "
                             "Nothing was changed.")
        missing = sorted({"sparse", "qsgd", "step", "counts", "decisions"} - set(state))
        if missing:
            saved = f" (it was saved by {state['compressor']})" if "compressor" in state else ""
            raise ValueError(f"state lacks {missing}: not a state_dict() of Auto{saved}. Build the optimizer with "
                             "the compression the checkpoint was taken with, or set state['compression'] = None "
                             "to restart error feedback. Nothing was changed.")
        self.sparse.check_state(state["sparse"])
        self.qsgd.check_state(state["qsgd"])

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict`, checked first (:meth:`check_state`)."""
        self.check_state(state)
        self.sparse.load_state_dict(state["sparse"])
        self.qsgd.load_state_dict(state["qsgd"])
        self.step, self._counts = int(state["step"]), dict(state["counts"])
        self.decisions = dict(state["decisions"])
        self.costs = {n: TensorCosts(c["numel"], c["itemsize"], c["payload"], c["codec_s"])
                      for n, c in state.get("costs", {}).items()}
        self._samples = {(n, r): deque([v], maxlen=SAMPLES) for n, c in self.costs.items() for r, v in c.codec_s.items()}
        # a checkpoint taken while exploring resumes the same exploring steps (older ones skipped none)
        self.skipped = {r: dict(v) for r, v in state.get("skipped", {}).items()}
        if self._setup is not None:
            self._plan()


@dataclass
class _StockCtx:
    """decompress()'s context inside stock Horovod: the road and what is in flight on it."""

    name: str
    road: str
    inner: Any
    like: torch.Tensor
    codec_s: float
    payload: float


def _check_roads(roads: Optional[Sequence[str]]) -> Optional[Tuple[str, ...]]:
    if roads is None:
        return None
    if isinstance(roads, str) or not roads:
        raise ValueError(f"roads must be a non-empty list of {OURS_ROADS}, got {roads!r}")
    bad = [r for r in roads if r not in policy.ROADS]
    if bad or len(set(roads)) != len(roads):
        raise ValueError(f"roads must be distinct names among {OURS_ROADS}, got {list(roads)}")
    return tuple(roads)


class AutoExchange:
    """hvd_gradcomp.DistributedOptimizer's exchange for :class:`Auto`: routes each tensor to
    its road's exchange, whose codec seconds are timed apart from the waits (:class:`TimedExchange`)."""

    def __init__(self, auto: Auto, op: Any, process_set: Any) -> None:
        hvd = _hvd()
        self.auto = auto
        self.exchanges = {road: TimedExchange(ex) for road, ex in (
            (DENSE, DenseExchange(op, process_set, hvd.Compression.none)),
            (FP16, DenseExchange(op, process_set, hvd.Compression.fp16)),
            (QSGD_AR, ScatterReduceExchange(auto.qsgd, op, process_set)),
            (SPARSE, FusedAllgatherExchange(auto.sparse, op, process_set)))}

    codec_s = property(lambda self: sum(e.codec_s for e in self.exchanges.values()))
    codec_sync_s = property(lambda self: sum(e.codec_sync_s for e in self.exchanges.values()))
    wait_s = property(lambda self: sum(e.wait_s for e in self.exchanges.values()))

    def start(self, name: str, grad: torch.Tensor) -> Pending:
        road = self.auto.road_for(name)
        grad = self.auto.flush_residuals(name, grad, road)
        self.exchanges[road].device_sync = self.auto.measuring
        p = self.exchanges[road].start(name, grad)
        payload = (payload_size(self.auto.qsgd, (grad.numel(),)) if road == QSGD_AR else
                   grad.numel() * (2 if road == FP16 else grad.element_size()) if road in (DENSE, FP16)
                   else p.bytes_sent)
        p.road, p.payload_bytes, p.itemsize = road, payload, grad.element_size()
        return p

    def progress(self, p: Pending) -> None:
        self.exchanges[p.road].progress(p)

    def advance(self, p: Pending) -> None:
        self.exchanges[p.road].advance(p)

    def finish(self, p: Pending, out: torch.Tensor) -> None:
        road = p.road
        self.exchanges[road].finish(p, out)
        timed = self.exchanges[road].device_sync or out.device.type != "cuda"
        self.auto.record(p.name, road, out.numel(), p.itemsize, p.codec_s, p.wait_s, p.payload_bytes,
                         measured=timed)
