"""Which road a gradient should take: bytes per rank, the rank-count crossover, a time model.

Pure functions (no torch, no Horovod), used by :class:`hvd_gradcomp.Auto` and by
``benchmarks/bench_bytes_per_rank.py``. Roads:

========== ================================================ ===================== ===========
road       collective                                        bytes each rank sends rounds
========== ================================================ ===================== ===========
``dense``  ring allreduce of the float32 gradient (D bytes)  2(P-1)/P x D          2(P-1)
``fp16``   ring allreduce of the fp16 cast                   2(P-1)/P x D/2        2(P-1)
``qsgd``   QSGD compressed allreduce: alltoall + allgather   2(P-1)/P x            2(P-1)
           of one payload Q split in P chunks (h: a chunk's  (Q + (P-1) h)
           header, 48 B)
``qsgd-ag`` QSGD payload allgathered (stock Horovod's road)  (P-1) x Q             P-1
``sparse`` TopK/TopKQSGD payload S, allgathered              (P-1) x S             P-1
========== ================================================ ===================== ===========

Bytes are what crosses each rank's link, for ring algorithms (an allgather forwards every
other rank's payload once). Dense and QSGD stay flat as ranks are added; an allgather grows
linearly, so past ``P* = 2 D' / S`` ranks (D' the bytes of the road compared with) the sparse
payload moves more than the dense one, however small it is. :func:`crossover_ranks` finds P*.

>>> D = 4_000_000                        # 1M float32 values
>>> S = 23_400                           # a TopKQSGD(1%, 8) payload of them
>>> crossover_ranks("fp16", numel=1_000_000, sparse_payload=S)
171
>>> round(wire_bytes("sparse", 8, 1_000_000, S) / wire_bytes("fp16", 8, 1_000_000))
0
>>> round(wire_bytes("sparse", 1024, 1_000_000, S) / wire_bytes("fp16", 1024, 1_000_000), 1)
6.0
"""
from __future__ import annotations

import math

from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, Mapping, Optional, Tuple

DENSE, FP16, QSGD_AR, QSGD_AG, SPARSE = "dense", "fp16", "qsgd", "qsgd-ag", "sparse"
ROADS = (DENSE, FP16, QSGD_AR, QSGD_AG, SPARSE)
CHUNK_HEADER = 48  # wire.padded(HEADER_BYTES + 8): each QSGD chunk is a 1-D payload of its own
MAX_RANKS = 1 << 24


def _check(road: str, ranks: int) -> None:
    if road not in ROADS:
        raise ValueError(f"unknown road {road!r}; roads are {ROADS}")
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"ranks must be an int >= 1, got {ranks!r}")


def wire_bytes(road: str, ranks: int, numel: int, payload: float = 0.0, itemsize: int = 4) -> float:
    """Bytes each rank sends per exchange of one tensor of ``numel`` values on ``road``.

    ``payload``: the compressed payload's bytes (the whole tensor's for ``qsgd``, one rank's
    for ``sparse``); ``itemsize``: bytes per value of the dense gradient.

    >>> wire_bytes("dense", 2, 1000), wire_bytes("fp16", 4, 1000), wire_bytes("sparse", 4, 1000, 100)
    (4000.0, 3000.0, 300.0)
    """
    _check(road, ranks)
    p = ranks
    if p == 1:
        return 0.0
    ring = 2.0 * (p - 1) / p
    if road == DENSE:
        return ring * numel * itemsize
    if road == FP16:
        return ring * numel * 2
    if road == QSGD_AR:  # P chunk payloads: one header more per extra chunk
        return ring * (payload + (p - 1) * CHUNK_HEADER)
    return (p - 1) * float(payload)


def sparse_allreduce_bytes(ranks: int, k: int, pair_bytes: int = 8) -> float:
    """Bytes each rank sends in the sparse allreduce (:mod:`hvd_gradcomp.collectives.sparse_allreduce`,
    issue 62; not a road :class:`hvd_gradcomp.Auto` chooses yet) of a tensor whose ranks each select
    ``k`` values: the alltoall of its k (index, value) pairs, all but those of its own region, then
    the ring allgather of the K pairs the owners keep, all but the next rank's:
    ``pair_bytes * (P-1)/P * (k + K)``. With regions that receive equal shares of the pairs (a
    balancer's aim; random indices), each owner receives k and keeps ``ceil(k / P)``, so
    ``K = P * ceil(k / P)``: k once k is a multiple of P, P when k < P. Fewer where ranks' selections
    overlap (an owner keeps distinct indices); each owner's ceiling over or under k/P moves K by at
    most P - 1. Flat in P, against the allgather's ``(P-1) x payload``.

    >>> sparse_allreduce_bytes(16, 16_384), sparse_allreduce_bytes(1024, 16_384)
    (245760.0, 261888.0)
    >>> sparse_allreduce_bytes(1024, 656)      # k < P: one pair kept per owner
    13426.875
    >>> sparse_allreduce_bytes(1, 16_384)
    0.0
    """
    _check(SPARSE, ranks)
    p = ranks
    kept = p * -(-k // p)
    return pair_bytes * (p - 1) / p * (k + kept)


def rounds(road: str, ranks: int) -> int:
    """Latency-bound steps of the ring algorithm behind ``road`` (each pays one link latency).

    >>> rounds("dense", 4), rounds("sparse", 4), rounds("qsgd", 1)
    (6, 3, 0)
    """
    _check(road, ranks)
    return (ranks - 1) * (1 if road in (QSGD_AG, SPARSE) else 2)


def crossover_ranks(road: str, numel: int, sparse_payload: float, payload: float = 0.0,
                    itemsize: int = 4) -> Optional[int]:
    """The smallest rank count at which allgathering ``sparse_payload`` sends more bytes per
    rank than ``road`` (``payload``: that road's payload, for ``qsgd``); None if never.

    >>> crossover_ranks("dense", 1000, 100)        # 2 x 4000 / 100 = 80: equal there
    81
    >>> crossover_ranks("qsgd", 1000, 100, payload=1100)   # 100 P > 2 (1100 + 48 (P-1))
    527
    """
    if sparse_payload <= 0:
        raise ValueError(f"sparse_payload must be > 0 bytes, got {sparse_payload!r}")

    return first_rank_where(lambda p: wire_bytes(SPARSE, p, numel, sparse_payload)
                            > wire_bytes(road, p, numel, payload, itemsize))


def first_rank_where(worse: Callable[[int], bool]) -> Optional[int]:
    """The smallest P >= 2 with ``worse(P)``, for a predicate that stays true once true (a
    linearly growing allgather against a flat road); None below 2**24 ranks.

    >>> first_rank_where(lambda p: 3 * (p - 1) > 100)
    35
    """
    hi = 2
    while not worse(hi):
        if hi >= MAX_RANKS:
            return None
        hi *= 2
    lo = hi // 2  # not worse (or 1, where nothing is sent)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if worse(mid) else (mid, hi)
    return hi


@dataclass(frozen=True)
class Link:
    """What a rank's link costs: ``bandwidth`` in bytes per second sent per rank, ``latency``
    in seconds per ring step (both measured by :class:`hvd_gradcomp.Auto`'s probe).

    ``roads``: the bytes per second measured for a road's own collective where it differs
    from the float32 allreduce's (an fp16 allreduce reduces in half precision, on CPU far
    slower than its bytes suggest; an allgather reduces nothing).

    >>> Link(1e9, roads={"fp16": 2e8}).bandwidth_of("fp16"), Link(1e9).bandwidth_of("fp16")
    (200000000.0, 1000000000.0)
    """

    bandwidth: float
    latency: float = 0.0
    roads: Mapping[str, float] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.bandwidth > 0 or self.latency < 0 or not all(v > 0 for v in self.roads.values()):
            raise ValueError(f"a link needs bandwidth > 0 and latency >= 0, got {self} {dict(self.roads)}")

    def bandwidth_of(self, road: str) -> float:
        return self.roads.get(road, self.bandwidth)


def link_from_probe(ranks: int, small_s: float, large_s: float, large_numel: int,
                    fp16_s: Optional[float] = None, gather_s: Optional[float] = None) -> Link:
    """The link from timed collectives: a 1-value allreduce (``small_s``, latency only), a
    float32 allreduce of ``large_numel`` values (``large_s``) and, where measured, an fp16
    allreduce of as many values (``fp16_s``, for the ``fp16`` road) and an allgather of
    ``large_numel`` bytes per rank (``gather_s``, for the allgather and QSGD roads).

    >>> link_from_probe(2, 0.001, 0.081, 10_000_000)      # 40 MB in 80 ms
    Link(bandwidth=500000000.0, latency=0.0005)
    >>> link_from_probe(2, 0.001, 0.081, 10_000_000, fp16_s=0.161).roads    # 20 MB in 160 ms
    {'fp16': 125000000.0}
    >>> link_from_probe(1, 0.0, 0.0, 10_000_000).bandwidth    # one rank: nothing crosses a link
    inf
    """
    steps = max(rounds(DENSE, ranks), 1)
    roads = {}

    def rate(nbytes: float, seconds: float) -> float:
        # One rank sends nothing: every road is free, so the codec cost alone decides (dense).
        return math.inf if nbytes == 0 else nbytes / max(seconds - small_s, 1e-9)

    if fp16_s is not None:
        roads[FP16] = rate(wire_bytes(FP16, ranks, large_numel), fp16_s)
    if gather_s is not None:
        roads[SPARSE] = roads[QSGD_AG] = roads[QSGD_AR] = rate(wire_bytes(SPARSE, ranks, 1, large_numel), gather_s)
    return Link(bandwidth=rate(wire_bytes(DENSE, ranks, large_numel), large_s),
                latency=max(small_s, 0.0) / steps, roads=roads)


def road_seconds(road: str, ranks: int, numel: int, link: Link, codec_s: float = 0.0,
                 payload: float = 0.0, itemsize: int = 4) -> float:
    """Modelled time of one exchange on ``road``: codec + latency x rounds + bytes / bandwidth.

    No credit is given for overlap with backward: the codec runs on the critical path, and a
    faster exchange is never worse.

    >>> road_seconds("dense", 2, 1_000_000, Link(1e8, 1e-4))    # 4 MB at 100 MB/s
    0.0402
    """
    return (codec_s + rounds(road, ranks) * link.latency
            + wire_bytes(road, ranks, numel, payload, itemsize) / link.bandwidth_of(road))


def transfer_seconds(road: str, ranks: int, link: Link, sizes: Iterable[Tuple[int, int, float]]) -> float:
    """Seconds the bytes of one step's exchanges take on ``road`` at the link's rate, codec and
    latency left out: no step that sends them can be shorter (an exchange overlapped with
    backward still has to end within the step). ``sizes``: (numel, itemsize, payload bytes) of
    each tensor, the payload as :func:`wire_bytes` takes it.

    >>> transfer_seconds("dense", 2, Link(1.25e7), [(1_000_000, 4, 0.0)])   # 4 MB at 100 Mbit/s
    0.32
    """
    return sum(wire_bytes(road, ranks, numel, payload, itemsize) for numel, itemsize, payload in sizes) \
        / link.bandwidth_of(road)


@dataclass
class TensorCosts:
    """What :class:`hvd_gradcomp.Auto` knows about one tensor: its size, the payload bytes and
    the measured codec seconds (encode + decode, per exchange) of each road tried."""

    numel: int
    itemsize: int = 4
    payload: Dict[str, float] = None  # type: ignore[assignment]
    codec_s: Dict[str, float] = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        self.payload = dict(self.payload or {})
        self.codec_s = dict(self.codec_s or {})


def road_times(costs: TensorCosts, ranks: int, link: Link, roads: Iterable[str]) -> Dict[str, float]:
    """Modelled seconds per exchange of every road in ``roads`` whose codec cost is known.

    >>> c = TensorCosts(1_000_000, payload={"sparse": 23_400}, codec_s={"dense": 0.0, "sparse": 0.02})
    >>> t = road_times(c, 2, Link(1.25e8), ["dense", "sparse"])      # 1 Gbit/s
    >>> round(t["dense"], 4), round(t["sparse"], 4)
    (0.032, 0.0202)
    """
    out = {}
    for road in roads:
        if road in costs.codec_s:
            out[road] = road_seconds(road, ranks, costs.numel, link, costs.codec_s[road],
                                     costs.payload.get(road, 0.0), costs.itemsize)
    return out


def choose(times: Mapping[str, float], current: Optional[str] = None, hysteresis: float = 0.1) -> str:
    """The fastest road, but keep ``current`` unless the best is more than ``hysteresis``
    (a fraction) faster: measurements are noisy, and switching roads has a cost.
    Ties go to the road listed first in :data:`ROADS` (dense first).

    >>> choose({"dense": 1.0, "sparse": 0.95}, current="dense")
    'dense'
    >>> choose({"dense": 1.0, "sparse": 0.5}, current="dense")
    'sparse'
    """
    if not times:
        raise ValueError("no road has a measured cost yet")
    if not 0.0 <= hysteresis < 1.0:
        raise ValueError(f"hysteresis must be in [0, 1), got {hysteresis!r}")
    order = {r: i for i, r in enumerate(ROADS)}
    best = min(times, key=lambda r: (times[r], order.get(r, len(order))))
    if current in times and times[best] >= times[current] * (1.0 - hysteresis):
        return current
    return best


def decide(costs: TensorCosts, ranks: int, link: Link, roads: Iterable[str],
           current: Optional[str] = None, hysteresis: float = 0.1) -> str:
    """:func:`choose` over :func:`road_times`: the road ``Auto`` takes for this tensor.

    Past the crossover (:func:`crossover_ranks`) the sparse road's bytes alone exceed the
    dense road's, so it loses whatever its codec costs:

    >>> c = TensorCosts(1_000_000, payload={"sparse": 23_400}, codec_s={"fp16": 0.001, "sparse": 0.001})
    >>> decide(c, 8, Link(1.25e8), ["fp16", "sparse"]), decide(c, 256, Link(1.25e8), ["fp16", "sparse"])
    ('sparse', 'fp16')
    """
    return choose(road_times(costs, ranks, link, roads), current, hysteresis)
