"""The DDP hook's side of :class:`hvd_gradcomp.Auto`: a road per bucket, measured while training
runs (sparse, QSGD, fp16 or dense), the same on every rank; see :class:`_AutoExchange` and docs/AUTO.md.
"""
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..feedback import kernels
from ..auto import Auto
from ..codecs.compressor import GradientCompressor, payload_size
from .exchanges import Future, State, _allgather, _allreduce, _Plan, _scatter_reduce, _Segment, _then, _when_all
from ..auto.policy import DENSE, FP16, QSGD_AR, SPARSE
from ..collectives.transport import TorchTransport


# ---------------------------------------------------------------- Auto: a road per bucket
class _RoadView:
    """The hook state as one of Auto's compressed roads sees it: ``compression`` is that road's
    compressor, everything else (counters, locks, the bucket order) is the state's own. It also
    times the road's codec work for Auto: what runs in the hook (encode), in the second round's
    launch (QSGD's reduce and re-quantisation) and in the decode, and sums the bytes sent.

    Why a view: the drivers (:func:`_allgather`, :func:`_scatter_reduce`) take their
    compressor from the state; a view lets Auto reuse them unchanged, one road per bucket.
    """

    _OWN = ("_state", "compression", "codec_s", "inline_s", "sent", "_clock", "_thread")

    def __init__(self, state: State, compressor: GradientCompressor, clock: Callable[[], float]) -> None:
        own = {"_state": state, "compression": compressor, "codec_s": 0.0, "inline_s": 0.0, "sent": 0,
               "_clock": clock, "_thread": threading.get_ident()}
        for name, value in own.items():
            object.__setattr__(self, name, value)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(type(self._state), name, None)
        if isinstance(attr, property):
            return attr.fget(self)
        if callable(attr):  # a method: bound to the view, so that it sees the road's compressor
            return attr.__get__(self)
        return getattr(self._state, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self._state, name, value)

    def _record(self, step: int, name: str, raw: int, payload: int, framing: int = 0) -> None:
        object.__setattr__(self, "sent", self.sent + payload + framing)
        self._state._record(step, name, raw, payload, framing)

    def _timed(self, fn: Callable[[], Any]) -> Any:
        t0 = self._clock()
        try:
            return fn()
        finally:
            dt = self._clock() - t0
            object.__setattr__(self, "codec_s", self.codec_s + dt)
            if threading.get_ident() == self._thread:   # ran inside the hook call: counted once
                object.__setattr__(self, "inline_s", self.inline_s + dt)

    def time_call(self, fn: Callable[..., Future], *args: Any) -> Future:
        """``fn(self, *args)`` (a driver), its own time in the hook added to ``codec_s``."""
        t0 = self._clock()
        fut = fn(self, *args)
        hook_s = self._clock() - t0 - self.inline_s
        object.__setattr__(self, "codec_s", self.codec_s + max(hook_s, 0.0))
        return fut

    def _then_in_order(self, deps: List[Future], launch: Callable[[], Optional[Tuple[Future, Callable]]],
                       result: Future, buffer: torch.Tensor, finish_dense: Callable[[], None]) -> None:
        def timed_launch() -> Optional[Tuple[Future, Callable]]:
            launched = self._timed(launch)
            if launched is None:
                return None
            fut, decode = launched
            return fut, lambda: self._timed(decode)

        self._state._then_in_order(deps, timed_launch, result, buffer, finish_dense)


KEY_SEP = "+"


def _bucket_key(plan: _Plan) -> str:
    """Auto's name for a bucket: its compressed parameters' names joined by ``+`` (so the road of
    each parameter can be read back from Auto's decisions alone, e.g. after a checkpoint)."""
    return KEY_SEP.join(s.name for s in plan.compressed)


class _AutoExchange:
    """The hook's side of :class:`hvd_gradcomp.Auto`: a road per bucket (its compressed
    parameters; the small ones always go dense), decided by Auto from measured codec seconds,
    payload bytes and the probed link, the same on every rank (measurements averaged over the
    ranks, rank 0's decisions broadcast: :meth:`Auto.decide`).

    Roads: ``sparse`` (Auto's TopKQSGD, :func:`_allgather`), ``qsgd`` (Auto's QSGD compressed
    allreduce, :func:`_scatter_reduce`), ``fp16`` (allreduce of an fp16 cast), ``dense``. A
    residual left by one road is added to the parameter's next send on whatever road it takes
    (:meth:`Auto.flush_residuals`), only once the bucket is known finite, so a non-finite step
    loses nothing.

    DDP changes its buckets once, after its first iteration (one bucket first, then buckets in
    the order gradients became ready), and again after a restart. While exploring, a new layout
    starts the exploration again (every road is measured on the buckets that stay). A bucket
    Auto has not decided for (the first iteration after a checkpoint) sends each parameter on
    the road decided for it, one collective per road, so a resumed run is bit-identical.
    """

    def __init__(self, state: State, auto: Auto) -> None:
        self.state, self.auto = state, auto
        self._step_seen = -1
        self._keys: Dict[str, None] = {}       # buckets of the current step
        self._last_keys: Dict[str, None] = {}  # buckets of the previous step

    def hook(self, bucket: dist.GradBucket, buffer: torch.Tensor, step: int) -> Future:
        state, auto = self.state, self.auto
        if auto._setup is None:
            auto.configure("ddp", TorchTransport(state.process_group, state.world_size, buffer.device), average=True)
        if step != self._step_seen:
            self._begin_step(step)
        clock = self._clock(buffer.device)
        sparse = _RoadView(state, auto.sparse, clock)
        plan = sparse._plan(bucket)
        if not plan.compressed:
            return _allreduce(state, buffer, step, "dense", None)
        key = _bucket_key(plan)
        self._keys[key] = None
        if not auto.exploring and key not in auto.decisions:
            return self._per_parameter(buffer, plan, step)
        road = auto.road_of(key)
        self._flush(plan, buffer, road)
        numel = sum(s.numel for s in plan.compressed)
        itemsize = buffer.element_size()
        # On GPU the codec is timed only while Auto measures (the clock then synchronises).
        timed = buffer.device.type != "cuda" or auto.measuring
        if road in (DENSE, FP16):
            t0 = clock()
            fut = _allreduce(state, buffer, step, road, torch.float16 if road == FP16 else None)
            codec, payload = clock() - t0, numel * (2 if road == FP16 else itemsize)
            return _then(fut, lambda f: self._done(f, key, road, numel, itemsize, codec, payload, timed))
        view = sparse if road == SPARSE else _RoadView(state, auto.qsgd, clock)
        fut = view.time_call(_allgather if road == SPARSE else _scatter_reduce, buffer, plan, step)

        def done(f: Future) -> torch.Tensor:
            payload = (sum(payload_size(auto.qsgd, (s.numel,)) for s in plan.compressed) if road == QSGD_AR
                       else view.sent)
            return self._done(f, key, road, numel, itemsize, view.codec_s, payload, timed)

        return _then(fut, done)

    def _begin_step(self, step: int) -> None:
        """The first bucket of a step (the previous step's exchanges are done on every rank):
        Auto's step begins, and decides when due (a collective)."""
        auto = self.auto
        changed = bool(self._last_keys) and bool(self._keys) and set(self._keys) != set(self._last_keys)
        if self._keys:
            auto.keep_only(list(self._keys) + [k for k in auto.decisions if k not in self._keys and not changed])
        if changed and auto.exploring:   # DDP rebuilt its buckets: measure every road on the new ones
            auto.restart()
        self._step_seen, self._last_keys, self._keys = step, self._keys or self._last_keys, {}
        auto.start_step()

    def _per_parameter(self, buffer: torch.Tensor, plan: _Plan, step: int) -> Future:
        """A bucket Auto did not decide for: each parameter on the road decided for it (dense if
        none), one collective per road; unmeasured."""
        roads = {n: road for key, road in self.auto.decisions.items() for n in key.split(KEY_SEP)}
        by_road: Dict[str, List[_Segment]] = {}
        for s in plan.compressed:
            by_road.setdefault(roads.get(s.name, DENSE), []).append(s)
        for road, segs in by_road.items():
            self._flush(_Plan(tuple(segs), ()), buffer, road)
        state, auto, clock = self.state, self.auto, time.perf_counter
        dense = plan.dense + tuple(by_road.pop(DENSE, ()))
        futs: List[Future] = []
        for road, comp, fn in ((SPARSE, auto.sparse, _allgather), (QSGD_AR, auto.qsgd, _scatter_reduce)):
            if road in by_road:   # the dense segments ride with the first compressed road
                futs.append(fn(_RoadView(state, comp, clock), buffer, _Plan(tuple(by_road[road]), dense), step))
                dense = ()
        for segs, cast in ((by_road.get(FP16, ()), torch.float16), (dense, None)):
            if segs:
                futs.append(_allreduce_segments(state, buffer, tuple(segs), step, cast))
        return _when_all(futs, buffer)

    def _done(self, fut: Future, key: str, road: str, numel: int, itemsize: int, codec_s: float,
              payload: float, timed: bool) -> torch.Tensor:
        out = fut.value()   # raises a failed exchange
        with self.state._lock:
            self.auto.record(key, road, numel, itemsize, codec_s, 0.0, payload, measured=timed)
        return out

    def _flush(self, plan: _Plan, buffer: torch.Tensor, road: str) -> None:
        """Residuals other roads hold for the bucket's parameters go into this send."""
        owed = [s for s in plan.compressed if self.auto.owes(s.name, road)]
        if not owed or not kernels.all_finite(buffer):   # a non-finite step keeps them for the next one
            return
        with self.state._lock:
            for s in owed:
                view = s.view(buffer)
                flushed = self.auto.flush_residuals(s.name, view, road)
                if flushed is not view:
                    view.copy_(flushed.reshape(-1))

    def _clock(self, device: torch.device) -> Callable[[], float]:
        """perf_counter, after the device's queued work while Auto measures (GPU kernels run
        asynchronously: without a sync the codec would look free)."""
        if device.type == "cuda" and self.auto.measuring:
            return lambda: (torch.cuda.synchronize(device), time.perf_counter())[1]
        return time.perf_counter


def _allreduce_segments(state: State, buffer: torch.Tensor, segs: Tuple[_Segment, ...], step: int,
                        cast: Optional[torch.dtype]) -> Future:
    """Average some segments of ``buffer`` by one allreduce (of a ``cast`` copy when given)."""
    flat = torch.cat([s.view(buffer) for s in segs])

    def copy_back(f: Future) -> torch.Tensor:
        f.value()
        offset = 0
        for s in segs:
            s.view(buffer).copy_(flat[offset:offset + s.numel])
            offset += s.numel
        return buffer

    return _then(_allreduce(state, flat, step, "fp16" if cast is not None else "dense", cast), copy_back)
