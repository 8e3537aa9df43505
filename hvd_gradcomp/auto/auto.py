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
3. **Decide**: the model of :mod:`hvd_gradcomp.auto.policy` (codec + latency x rounds + bytes /
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

from dataclasses import dataclass
from typing import Any, Dict, NamedTuple, Optional, Sequence, Tuple

import torch

from . import policy, state
from ..codecs.compressor import payload_size
from ..collectives.exchange import (DenseExchange, FusedAllgatherExchange, Pending,
                                    ScatterReduceExchange, TimedExchange)
from ..collectives.transport import HorovodTransport
from .decide import Decider
from .measure import LinkProbe, Measurements, StepClock
from .residuals import CompressedRoads
from .schedule import OURS_ROADS, Schedule, roads_in
from .stock import StockCtx, StockProtocol, _hvd
from .policy import DENSE, FP16, QSGD_AR, SPARSE
from ..codecs.qsgd import QSGD
from ..codecs.topk import TopKQSGD


HorovodComm = HorovodTransport
"""Auto's collectives over Horovod: :class:`hvd_gradcomp.collectives.transport.HorovodTransport` (the name kept
for code that imported it from here)."""


@dataclass(frozen=True)
class _Where:
    """Where Auto runs, set once (:meth:`Auto.configure`): ``mode``, its collectives, and whether
    the exchange averages."""

    mode: str
    comm: Any
    average: bool


class _Setup(NamedTuple):
    """What ``auto._setup`` reads (None before Auto is configured; the DDP hook checks it): where
    it runs, with its roads and exploring plan (:class:`hvd_gradcomp.auto.schedule.Schedule`)."""

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


def _part(part: str, name: str, doc: str, settable: bool = False) -> property:
    """A property of Auto that is ``name`` of its part ``part`` (read-only unless ``settable``)."""
    def get(self: Any) -> Any:
        return getattr(getattr(self, part), name)

    def put(self: Any, value: Any) -> None:
        setattr(getattr(self, part), name, value)

    return property(get, put if settable else None, doc=doc)


class Auto:
    """Automatic road per tensor: dense, fp16, QSGD or TopKQSGD, measured and re-decided.

    Args:
        ratio, bits: TopKQSGD's settings for the sparse road; qsgd_bits: QSGD's for the qsgd road.
        roads: the roads allowed (default all: ``"sparse", "qsgd", "fp16", "dense"``).
        explore_steps, warmup_steps, interval: measured and unmeasured steps each codec road is
            tried for at the start (and after each decision, to verify it); steps between
            re-decisions (:class:`~hvd_gradcomp.auto.schedule.Schedule`).
        hysteresis, explore_within: a tensor switches only if the new road is this fraction faster;
            a road whose bytes alone, at the probed rate, would take more than this multiple of the
            first road's step is not explored (``math.inf`` explores every road)
            (:class:`~hvd_gradcomp.auto.decide.Decider`).
        probe_numel: float32 values of the link probe (:class:`~hvd_gradcomp.auto.measure.LinkProbe`).
        error_feedback, seed: as for the compressors; named_parameters: for stock Horovod (:meth:`bind`).

    Auto wires parts that each own their state: ``compressed`` (:mod:`~hvd_gradcomp.auto.residuals`),
    ``schedule``, ``measurements``, ``clock``, ``prober`` (:mod:`~hvd_gradcomp.auto.measure`), ``decider``,
    ``stock`` (:mod:`~hvd_gradcomp.auto.stock`).

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
        self.compressed = CompressedRoads(
            TopKQSGD(ratio=ratio, bits=bits, error_feedback=error_feedback, seed=seed, exempt="fp32"),
            QSGD(bits=qsgd_bits, error_feedback=error_feedback, seed=seed, exempt="fp32"))
        self.roads = _check_roads(roads)
        _check_settings(explore_steps, warmup_steps, interval, probe_numel, hysteresis, explore_within)
        self.schedule = Schedule(warmup_steps, explore_steps, interval)
        self.measurements, self.clock = Measurements(), StepClock()
        self.prober = LinkProbe(probe_numel)
        self.decider = Decider(float(hysteresis), float(explore_within))
        self._where: Optional[_Where] = None
        self.stock = StockProtocol()   # inside stock hvd.DistributedOptimizer: compress/decompress
        if named_parameters is not None:
            self.bind(named_parameters)

    sparse = _part("compressed", "sparse", "The sparse road's TopKQSGD.")
    qsgd = _part("compressed", "qsgd", "The qsgd road's QSGD.")
    explore_steps = _part("schedule", "explore_steps", "As the argument.")
    warmup_steps = _part("schedule", "warmup_steps", "As the argument.")
    interval = _part("schedule", "interval", "As the argument.")
    hysteresis = _part("decider", "hysteresis", "As the argument.")
    explore_within = _part("decider", "explore_within", "As the argument.")
    probe_numel = _part("prober", "probe_numel", "As the argument.")
    step = _part("schedule", "step", "Steps begun (the first exchange of a step begins it).", settable=True)
    exploring = _part("schedule", "exploring", "Whether the current step explores.")
    warming_up = _part("schedule", "warming_up", "In a codec road's unmeasured warm-up steps: nothing is recorded.")
    measuring = _part("schedule", "measuring", "Codec times count now (on GPU: taken with the device synchronised).")
    skipped = _part("schedule", "skipped", "Roads not explored: road -> its transfer and the first road's step, ms.")
    decisions = _part("decider", "decisions", "Tensor name -> road, identical on every rank.")
    history = _part("decider", "history", "Switches: (step, name, from, to).")
    verdicts = _part("decider", "verdicts", "Each verification: the times compared, what was kept.")
    costs = _part("measurements", "costs", "Tensor name -> its measured costs (:class:`~.policy.TensorCosts`).")
    link = _part("prober", "link", "The link measured at the last probe (None before).", settable=True)

    def __repr__(self) -> str:
        return (f"Auto(roads={self.roads or OURS_ROADS}, ratio={self.sparse.ratio}, bits={self.sparse.bits}, "
                f"qsgd_bits={self.qsgd.bits}, interval={self.interval})")

    # Its sparse road's error feedback is classic whatever the optimizer (see GradientCompressor.policy_settled)
    policy_settled = True

    def note_optimizer(self, optimizer: Any, rank: int) -> None:
        """Say once, on rank 0, when ``optimizer`` has a feedback recipe of its own that Auto's
        compressed roads do not apply (:meth:`hvd_gradcomp.auto.residuals.CompressedRoads.note_optimizer`).
        Called by the optimizers and the DDP hook."""
        self.compressed.note_optimizer(optimizer, rank, repr(self))

    # ------------------------------------------------------------ set-up
    def make_exchange(self, op: Any, process_set: Any) -> "AutoExchange":
        """Called by ``hvd_gradcomp.DistributedOptimizer``: the exchange that routes each tensor."""
        self._configure("ours", op, process_set)
        return AutoExchange(self, op, process_set)

    def _configure(self, mode: str, op: Any, process_set: Any) -> None:
        """:meth:`configure` over Horovod, once; the same ``mode`` again is a no-op."""
        if self._where is None:
            self.configure(mode, HorovodTransport(process_set), op == _hvd().Average)
        elif self._where.mode != mode:
            raise ValueError("this Auto() is already used by another optimizer; give each optimizer its own")

    def configure(self, mode: str, comm: Any, average: bool) -> None:
        """Bind to where it runs (once): ``mode`` ``"ours"`` (hvd_gradcomp's optimizer), ``"stock"``
        (inside ``hvd.DistributedOptimizer``) or ``"ddp"`` (the DDP hook); ``comm``: its
        collectives (a :class:`hvd_gradcomp.collectives.transport.Control`: Horovod's or ``torch.distributed``'s
        transport, or the same methods over another library)."""
        if self._where is not None:
            raise ValueError("this Auto() is already used by another optimizer or hook; give each its own")
        self._where = _Where(mode, comm, average)
        self.schedule.use(roads_in(mode, self.roads))
        self.compressed.bind(mode != "stock", comm.rank, comm.size, average)

    @property
    def _setup(self) -> Optional[_Setup]:
        w, s = self._where, self.schedule
        return None if w is None else _Setup(w.mode, w.comm, w.average, s.roads, s.plan, s.measured)

    @property
    def start_steps(self) -> int:
        """Steps of Auto's start (:meth:`hvd_gradcomp.auto.schedule.Schedule.start_steps`).

        >>> Auto().start_steps   # sparse 2 warm-up + 2, qsgd 1 + 2; fp16, dense: 1; 1 + 1 + 2 + 1
        14
        """
        return self.schedule.start_steps(self.roads or OURS_ROADS)

    # ------------------------------------------------------------ error feedback across roads
    def owes(self, name: str, road: str) -> bool:
        """Whether a road other than ``road`` holds a residual of ``name`` (:meth:`flush_residuals` adds it)."""
        return self.compressed.owes(name, road)

    def flush_residuals(self, name: str, grad: torch.Tensor, road: str) -> torch.Tensor:
        """``grad`` plus whatever residual another road left for ``name`` (then dropped there)."""
        return self.compressed.flush(name, grad, road)

    # ------------------------------------------------------------ steps
    def road_for(self, name: str) -> str:
        """Begin a step on the first exchange of it (deciding when due), and give ``name``'s road."""
        step = self.schedule.count(name)
        if step > self.schedule.step:
            self.start_step(step)
        return self.road_of(name)

    def road_of(self, name: str) -> str:
        """The road ``name`` takes in the current step."""
        return self.schedule.exploring_road if self.schedule.exploring else self.decider.road_of(name)

    def start_step(self, step: Optional[int] = None) -> None:
        """Begin exchange step ``step`` (default: the next one), deciding or verifying when due:
        a collective when it decides, called on every rank at the same step. The optimizers call
        it through :meth:`road_for`; the DDP hook at the first bucket of each step. All exchanges
        of the previous step are done on every rank: the link is idle."""
        schedule = self.schedule
        schedule.begin(step)
        step = schedule.step
        self.clock.lap(schedule.phase(step - 1) if self.clock.running and step > 1 else None)
        if schedule.probe_due:
            self._skip_slow_roads()
            self.clock.restart()   # the probe is not part of the next step's time
        due = schedule.due
        if due in ("first decision", "decide"):
            self.decider.open(self.clock.take(), schedule.roads, first=due == "first decision")
            self.decide()
            self.clock.restart()   # the probe is not part of the next step's time
        elif due == "verify":
            self.verify()

    def keep_only(self, names: Sequence[str]) -> None:
        """Forget the measurements and decisions of tensors not in ``names`` (the DDP hook's
        buckets of its first iteration, before DDP rebuilt them); same on every rank."""
        self.measurements.keep_only(names)
        self.decider.keep_only(names)

    def restart(self) -> None:
        """Explore every road again, the steps and step times from zero, measurements kept (the DDP
        hook, when DDP changed its buckets while Auto explored)."""
        self.schedule.restart()
        self.clock.reset()

    # ------------------------------------------------------------ measure and decide
    def record(self, name: str, road: str, numel: int, itemsize: int, codec_s: float, wait_s: float,
               payload: float, measured: bool = True) -> None:
        """One finished exchange: its codec seconds, its exposed wait, its payload bytes.
        ``measured=False``: the codec time was taken without synchronising the device (GPU, not
        measuring): only the wait counts. Nothing but the wait in a warm-up step (:attr:`warming_up`)."""
        counted = measured and not self.schedule.warming_up
        self.measurements.record(name, road, numel, itemsize, codec_s, wait_s, payload, counted)

    def _skip_slow_roads(self) -> None:
        """Probe the link, explore no further the roads too slow to win (:meth:`Decider.skip_slow_roads
        <hvd_gradcomp.auto.decide.Decider.skip_slow_roads>`); the probe is kept for a decision at this step."""
        comm, roads, step = self._where.comm, self.schedule.roads, self.step
        durations = self.clock.durations.get(roads[0])
        if not durations or not self.costs:
            return
        probes, skipped = self.decider.skip_slow_roads(
            comm, step, roads, min(durations), self.prober.measure(comm, roads, step), self.prober.adopt,
            lambda road: self.compressed.sends(road, self.costs.values()))
        self.prober.keep(step, probes)
        self.schedule.skip(skipped)

    def decide(self) -> Dict[str, str]:
        """Probe the link, average the measurements over ranks, decide every tensor's road on
        rank 0 and broadcast: a collective, called on every rank at the same step."""
        comm, roads, step = self._where.comm, self.schedule.roads, self.step
        probes = self.prober.take(step) or self.prober.measure(comm, roads, step)
        return self.decider.decide(comm, step, roads, self.costs, probes, self.prober.adopt, self.skipped)

    def verify(self) -> None:
        """Keep the last decision unless the clock says otherwise (:meth:`hvd_gradcomp.auto.decide.Decider.verify`):
        a collective, called on every rank at the same step."""
        self.decider.verify(self._where.comm, self.step, self.clock.durations.get("plan"), list(self.costs))

    # ------------------------------------------------------------ report / checkpoints
    def report(self) -> Dict[str, Any]:
        """Decisions, measured costs and the link, for logs and the benchmark (what each entry
        holds: :func:`hvd_gradcomp.auto.state.report`)."""
        ranks = None if self._where is None else self._where.comm.size
        return state.report(self.schedule, self.measurements, self.decider, self.link, ranks)

    def state_dict(self) -> Dict[str, Any]:
        """Both compressors' residuals and random state, the step, the decisions, the measured costs
        and the roads skipped: one file per rank, as for the compressors (:func:`.state.state_dict`)."""
        return state.state_dict(self.compressed, self.schedule, self.measurements, self.decider)

    def check_state(self, state_: Any) -> None:
        """Raise ``ValueError`` naming what keeps ``state_`` from loading (:meth:`load_state_dict` checks first)."""
        state.check_state(state_, self.compressed)

    def load_state_dict(self, state_: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict`, checked first (:meth:`check_state`)."""
        state.load_state_dict(state_, self.compressed, self.schedule, self.measurements, self.decider)

    # ------------------------------------------------------------ stock Horovod's protocol
    def bind(self, named_parameters: Any) -> "Auto":
        """Use these names for the gradients stock Horovod hands to compress() (as the
        compressors' ``bind``); without it the names come from Horovod's optimizer. Returns self."""
        self.stock.bind(named_parameters)
        return self

    def compress(self, tensor: torch.Tensor, name: Optional[str] = None) -> Tuple[torch.Tensor, Any]:
        """Inside stock ``hvd.DistributedOptimizer``: the tensor's road (see :mod:`hvd_gradcomp.horovod`).
        Anywhere else (e.g. hvd_gradcomp's fused small tensors) the tensor passes unchanged."""
        call = self.stock.call_of(tensor)
        if call is None:
            return tensor, None
        self._configure("stock", call.op, call.process_set)
        self.note_optimizer(call.optimizer, call.process_set.rank())
        road = self.road_for(call.name)
        tensor = self.flush_residuals(call.name, tensor, road)
        return self.stock.send(call, road, tensor, self.sparse if road == SPARSE else self.qsgd)

    def decompress(self, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Inverse of :meth:`compress`: inside Horovod, the averaged (or summed) gradient."""
        if ctx is None:
            return tensor
        out, codec_s, wait = self.stock.receive(tensor, ctx)
        self.record(ctx.name, ctx.road, ctx.like.numel(), ctx.like.element_size(), codec_s, wait, ctx.payload)
        return out


def _check_settings(explore_steps: Any, warmup_steps: Any, interval: Any, probe_numel: Any, hysteresis: Any,
                    explore_within: Any) -> None:
    """Raise ``ValueError`` naming the first of Auto's step and probe settings out of range."""
    for arg, value, low in (("explore_steps", explore_steps, 1), ("warmup_steps", warmup_steps, 0),
                            ("interval", interval, 1), ("probe_numel", probe_numel, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{arg} must be an int >= {low}, got {value!r}")
    if isinstance(hysteresis, bool) or not isinstance(hysteresis, (int, float)) or not 0 <= hysteresis < 1:
        raise ValueError(f"hysteresis must be a number in [0, 1) (a fraction), got {hysteresis!r}")
    if isinstance(explore_within, bool) or not isinstance(explore_within, (int, float)) or not explore_within >= 1:
        raise ValueError(f"explore_within must be a number >= 1 (a multiple of the first road's step; "
                         f"math.inf explores every road), got {explore_within!r}")


_StockCtx = StockCtx   # the name from before stock.py


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
