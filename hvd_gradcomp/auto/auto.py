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

import time
from dataclasses import dataclass
from typing import Any, Deque, Dict, List, Optional, Sequence, Tuple

import torch

from .. import feedback as fb
from . import policy
from ..codecs.contract import _compressible
from ..codecs.compressor import payload_size
from ..collectives.exchange import (AllgatherExchange, DenseExchange, FusedAllgatherExchange, Pending,
                                    ScatterReduceExchange, TimedExchange, allreducible, wait_done)
from ..feedback import residual_dtype
from ..collectives.reduce import chunk_bounds
from ..collectives.transport import HorovodTransport
from .measure import RoadMeasure
from .schedule import OURS_ROADS, STOCK_ROADS, RoadSchedule, _Setup
from .state import AutoState
from .policy import DENSE, FP16, QSGD_AG, QSGD_AR, SPARSE, Link, TensorCosts
from ..codecs.qsgd import QSGD
from ..codecs.topk import TopKQSGD


def _hvd():
    import horovod.torch as hvd
    return hvd


HorovodComm = HorovodTransport
"""Auto's collectives over Horovod: :class:`hvd_gradcomp.collectives.transport.HorovodTransport` (the name kept
for code that imported it from here)."""


class Auto(RoadSchedule, RoadMeasure, AutoState):
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
            self.configure(mode, HorovodTransport(process_set), op == _hvd().Average)
        elif self._setup.mode != mode:
            raise ValueError("this Auto() is already used by another optimizer; give each optimizer its own")

    def configure(self, mode: str, comm: Any, average: bool) -> None:
        """Bind to where it runs (once): ``mode`` ``"ours"`` (hvd_gradcomp's optimizer), ``"stock"``
        (inside ``hvd.DistributedOptimizer``) or ``"ddp"`` (the DDP hook); ``comm``: its
        collectives (a :class:`hvd_gradcomp.collectives.transport.Control`: Horovod's or ``torch.distributed``'s
        transport, or the same methods over another library)."""
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
        from ..horovod.stock import name_map

        self._names = name_map(named_parameters)
        return self

    def compress(self, tensor: torch.Tensor, name: Optional[str] = None) -> Tuple[torch.Tensor, Any]:
        """Inside stock ``hvd.DistributedOptimizer``: the tensor's road (see :mod:`hvd_gradcomp.horovod`).
        Anywhere else (e.g. hvd_gradcomp's fused small tensors) the tensor passes unchanged."""
        from ..horovod.stock import find_horovod_call

        if not _compressible(tensor):
            return tensor, None
        call = find_horovod_call(tensor, self._names)
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
