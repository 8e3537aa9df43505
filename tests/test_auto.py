"""gc.Auto: argument checks (fast) and, on 2 ranks, identical decisions and correct training
across road switches, in hvd_gradcomp's optimizer and in stock Horovod's (one job per backend)."""
from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any, Dict

import pytest
import torch

import hvd_gradcomp as gc
from tests.harness import run_ranks

_cache: Dict[str, Any] = {}


def battery(backend: str):
    if backend not in _cache:
        _cache[backend] = run_ranks("auto:battery", backend=backend, timeout=300,
                                    scenarios=[{"fn": "switching"}, {"fn": "switching", "stock": True},
                                               {"fn": "fused"}])
    return _cache[backend]


@pytest.mark.parametrize("make,said", [
    (lambda ps: torch.optim.AdamW(ps, lr=1e-3), "feedback 'frozen'"),
    (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), "feedback 'momentum'"),
    (lambda ps: torch.optim.SGD(ps, lr=0.1), None)])
def test_auto_says_when_the_optimizer_has_a_recipe_its_roads_do_not_apply(make, said, caplog):
    """Auto's compressed roads use classic error feedback: with an optimizer that has a recipe of
    its own it says so once, on rank 0, and names the fixed compressor that applies it."""
    opt = make([torch.nn.Parameter(torch.zeros(4))])
    auto = gc.Auto()
    with caplog.at_level(logging.INFO, logger="hvd_gradcomp"):
        auto.note_optimizer(opt, rank=1)          # not rank 0: quiet
        auto.note_optimizer(opt, rank=0)
        auto.note_optimizer(opt, rank=0)          # once
    messages = [r.getMessage() for r in caplog.records]
    if said is None:
        assert messages == []
    else:
        assert len(messages) == 1 and said in messages[0] and "TopKQSGD(ratio=0.01, bits=8)" in messages[0], messages


@pytest.mark.parametrize("kw,match", [({"roads": ["zip"]}, "roads"), ({"roads": []}, "roads"),
                                      ({"roads": "dense"}, "roads"), ({"interval": 0}, "interval"),
                                      ({"explore_steps": 1.5}, "explore_steps"),
                                      ({"warmup_steps": -1}, "warmup_steps"), ({"hysteresis": 1.0}, "hysteresis"),
                                      ({"ratio": 2.0}, "ratio"), ({"bits": 1}, "bits")])
def test_bad_arguments_are_named(kw, match):
    with pytest.raises(ValueError, match=match):
        gc.Auto(**kw)


def test_outside_an_optimizer_tensors_pass_unchanged():
    import torch

    t = torch.randn(10)
    out, ctx = gc.Auto().compress(t)
    assert out is t and ctx is None and gc.Auto().decompress(out, ctx) is t


@pytest.mark.multirank
@pytest.mark.parametrize("which", [0, 1], ids=["ours", "stock"])
def test_same_decisions_and_correct_gradients_across_switches(backend, which):
    r0, r1 = battery(backend)[0][which], battery(backend)[1][which]
    # every applied gradient bit-identical on both ranks, at every step, across every switch
    assert all(r0["equal"]) and all(r1["equal"]) and len(r0["equal"]) >= 8
    # applied + still owed (residuals) == sum of true averaged gradients, at every step: error
    # feedback loses nothing and sends nothing twice when the road changes
    assert max(r0["gaps"]) < 1e-4, r0["gaps"]
    # the same decisions, from the same measurements, on both ranks
    assert r0["decisions"] == r1["decisions"] and r0["switches"] == r1["switches"]
    assert r0["roads"][:3] == ["explore"] * 3 and r0["roads"] == r1["roads"]
    assert set(r0["decisions"].values()) <= {"sparse", "qsgd", "qsgd-ag", "dense"} and r0["decisions"]
    # every road was measured during exploration, the link was probed
    assert all(len(v) == 3 for v in r0["codec_roads"].values())
    assert r0["bandwidth"] > 0 and r0["step"] == 8


@pytest.mark.multirank
def test_fused_sparse_allgathers(backend):
    for rank_result in battery(backend):
        one, many = rank_result[2][str(1 << 30)], rank_result[2][str(96 * 80 * 4)]
        for r in (one, many):
            # bit-identical to one allgather per tensor, and on every rank
            assert all(r["equal_to_unfused"]) and all(r["ranks_equal"])
            # the other rank's 4 payloads: each header parsed once, from the index; none re-read;
            # this rank's own 4 not at all (their parts come from its encoder: compress_carried)
            assert r["parse_header_calls"] == [4, 4, 4] and r["read_header_calls"] == [0, 0, 0]
        # 4 compressed tensors: one allgather per step instead of 4; from step 2 on it leaves
        # with the last hook, before synchronize()
        assert one["groups"] == [1, 1, 1] and one["launched_before_sync"] == [False, True, True]
        # the small tensors' fused allreduce leaves from the last small gradient's hook
        assert one["small_before_sync"] == [True, True, True]
        assert all(g >= 2 for g in many["groups"]) and many["launched_before_sync"][1:] == [True, True]
        # a group decoded before synchronize() writes its averages into p.grad then (bit-identical, above)
        assert all(n >= 1 for n in many["summed_before_sync"][1:]), many["summed_before_sync"]
        # exchanges leave no reference cycle behind (one held every step's gradients until a collection)
        assert one["cyclic"] == [] and many["cyclic"] == []
        # codec time measured apart from waiting; what synchronize() did is part of its time
        codec, codec_sync, wait, in_sync = one["timing"]
        assert 0 < codec_sync <= codec and wait >= 0 and codec_sync + wait <= in_sync


class _FakeSet:
    """A process set of 2 ranks, this one rank 1 (flush_residuals needs only size/rank)."""

    ranks = [0, 1]

    def size(self) -> int:
        return 2

    def rank(self) -> int:
        return 1


def _configured(op: str = "average") -> gc.Auto:
    import horovod.torch as hvd

    auto = gc.Auto()
    auto._configure("ours", hvd.Average if op == "average" else hvd.Sum, _FakeSet())
    return auto


@pytest.mark.parametrize("op,scale", [("average", 2.0), ("sum", 1.0)])
def test_residuals_follow_the_tensor_to_its_new_road(op, scale):
    import torch

    auto = _configured(op)
    g = torch.arange(6, dtype=torch.float32).view(2, 3)
    auto.sparse.residuals.commit("w", torch.full((6,), 0.5))
    auto.qsgd.relay_residuals.commit("w#reduced1", torch.tensor([1.0, 2.0, 3.0]))   # rank 1's chunk: [3, 6)
    out = auto.flush_residuals("w", g, "dense")
    expect = g.reshape(-1) + 0.5
    expect[3:] += scale * torch.tensor([1.0, 2.0, 3.0])   # a residual of the average: x P under Average
    assert torch.equal(out.reshape(-1), expect) and out.shape == g.shape
    assert auto.sparse.residuals.residual("w") is None and auto.qsgd.relay_residuals.residual("w#reduced1") is None
    assert torch.equal(g, torch.arange(6, dtype=torch.float32).view(2, 3))   # the gradient is not modified
    # a road keeps its own residual: nothing to flush, the same tensor comes back
    auto.sparse.residuals.commit("w", torch.full((6,), 0.5))
    assert auto.flush_residuals("w", g, "sparse") is g and auto.sparse.residuals.residual("w") is not None


def test_state_dict_round_trip_keeps_decisions_costs_and_residuals():
    import torch

    auto = _configured()
    auto.record("w", "dense", 1000, 4, 0.001, 0.0, 4000)
    auto.record("w", "sparse", 1000, 4, 0.004, 0.0, 60)
    auto.decisions["w"] = "sparse"
    auto.sparse.residuals.commit("w", torch.ones(1000))
    other = gc.Auto()
    other.load_state_dict(auto.state_dict())
    assert other.decisions == {"w": "sparse"} and other.costs["w"].codec_s == {"dense": 0.001, "sparse": 0.004}
    assert other.costs["w"].payload["sparse"] == 60 and torch.equal(other.sparse.residuals.residual("w"), torch.ones(1000))


def test_report_before_and_after_measurements():
    auto = _configured()
    assert auto.report()["summary"].startswith("step 0: exploring")
    auto.record("w", "dense", 1000, 4, 0.001, 0.002, 4000)
    rep = auto.report()
    assert rep["tensors"]["w"]["codec_ms"] == {"dense": 1.0} and rep["tensors"]["w"]["wait_ms"] == 2.0
    assert rep["link"] is None and "link not probed yet" in rep["summary"]


class _FakeHvd:
    """Collectives of one rank standing for all (every rank would compute the same)."""

    Average, Sum = "average", "sum"

    def allreduce(self, t, **kw):
        return t.clone()

    broadcast = allgather = allreduce


def _run_clocked(monkeypatch, auto: gc.Auto, step_time, steps: int, decide=None) -> None:
    """Drive ``auto`` through ``steps`` steps of two tensors on a fake clock: each step lasts
    ``step_time(roads of its tensors)`` seconds; ``decide`` replaces the model's decisions."""
    import hvd_gradcomp.auto.auto as auto_mod
    import hvd_gradcomp.collectives.transport as transport_mod

    clock = [0.0]
    monkeypatch.setattr(auto_mod, "_hvd", lambda: _FakeHvd())
    monkeypatch.setattr(transport_mod, "_hvd", lambda: _FakeHvd())   # Auto's mean and broadcast
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    if decide is not None:
        monkeypatch.setattr(auto, "decide", lambda: decide(auto))
    for _ in range(steps):
        roads = (auto.road_for("w"), auto.road_for("v"))
        clock[0] += step_time(roads)


def test_verification_falls_back_to_the_fastest_road_measured_alone(monkeypatch):
    """The model picks sparse everywhere; the clock says dense alone is faster: every tensor goes dense."""
    auto = _configured()
    alone = {"sparse": 0.3, "qsgd": 0.5, "fp16": 0.7, "dense": 0.2}
    _run_clocked(monkeypatch, auto, lambda roads: alone[roads[0]] if roads[0] == roads[1] else 0.25, 16,
                 decide=lambda a: a.decisions.update(w="sparse", v="sparse"))
    assert auto.decisions == {"w": "dense", "v": "dense"}
    (v,) = auto.verdicts
    # 9 exploring steps (sparse, the first road: 2 warm-up + 2 measured; qsgd: 1 + 2; fp16, dense:
    # 1), decision at step 10, one untimed step (warmup_steps), its 2 timed steps, the verdict at 14
    assert v["step"] == 14 == auto.start_steps and v["kept"] == "dense" and round(v["plan_ms"]) == 300
    assert {k: round(ms) for k, ms in v["against_ms"].items()} == {r: round(1e3 * s) for r, s in alone.items()}
    assert (14, "w", "sparse", "dense") in auto.history
    assert "kept dense" in auto.report()["summary"]


def test_verification_keeps_faster_decisions_and_reverts_a_slower_re_decision(monkeypatch):
    """A mixed plan faster than every road alone is kept; a later re-decision that measures slower
    than the steps before it is undone."""
    auto = gc.Auto(interval=5)
    auto._configure("ours", "average", _FakeSet())
    plans = iter([{"w": "sparse", "v": "fp16"}, {"w": "qsgd", "v": "qsgd"}])
    times = {("sparse", "fp16"): 0.1, ("qsgd", "qsgd"): 0.5}
    _run_clocked(monkeypatch, auto, lambda roads: times.get(roads, 0.3), 19,
                 decide=lambda a: a.decisions.update(next(plans, {})))
    kept = [(v["step"], v["kept"]) for v in auto.verdicts]
    assert kept == [(14, "plan"), (19, "before")], auto.verdicts   # decisions at steps 10 and 15
    assert auto.decisions == {"w": "sparse", "v": "fp16"}


# One 4M-value tensor at 1 Gbit/s, two ranks (steady costs: what each road costs once warm).
_STEADY_CODEC = {"sparse": 0.03, "qsgd": 0.06, "fp16": 0.007, "dense": 0.004}
_PAYLOAD = {"sparse": 1e5, "qsgd": 4.2e6, "fp16": 8.4e6, "dense": 1.68e7}
_STEADY_STEP = {"sparse": 0.36, "qsgd": 0.5, "fp16": 1.1, "dense": 1.9}
_LINK_PROBE = (5e-4, 5e-4 + 4 * (1 << 20) / 1.25e8, 5e-4 + 2 * (1 << 20) / 1.25e8, 5e-4 + (1 << 20) / 1.25e8)


@pytest.mark.parametrize("explore_steps,start_up", [(1, [10.0]), (2, [10.0, 4.0])],
                         ids=["first-use-10x", "start-up-over-2-steps"])
def test_start_up_costs_of_a_road_stay_out_of_its_measured_costs(monkeypatch, explore_steps, start_up):
    """Each codec road's first uses cost ``start_up`` x its steady cost (codec and step time), as
    torch.compile, buffers and Horovod's first negotiations make them: the decision is the one
    the steady costs imply (sparse), and the step times verified against are the steady ones.
    Measured, the sparse road's start-up would send the tensor to qsgd (and the verdict would
    compare with start-up-inflated step times). fp16 and dense compile nothing: measured once."""
    import hvd_gradcomp.auto.auto as auto_mod
    import hvd_gradcomp.collectives.transport as transport_mod

    auto = gc.Auto(explore_steps=explore_steps)
    auto._configure("ours", "average", _FakeSet())
    clock, uses = [0.0], Counter()
    monkeypatch.setattr(auto_mod, "_hvd", lambda: _FakeHvd())
    monkeypatch.setattr(transport_mod, "_hvd", lambda: _FakeHvd())   # Auto's mean and broadcast
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(auto.prober, "measure", lambda *a: _LINK_PROBE)
    exploring = len(auto._setup.schedule)
    assert exploring == 2 * (1 + explore_steps) + 3   # warm-up steps for sparse (2, the first road) and qsgd
    for _ in range(exploring + 3 + explore_steps):   # exploration, decision, an untimed step, verification
        road = auto.road_for("w")
        factor = start_up[uses[road]] if uses[road] < len(start_up) and road in ("sparse", "qsgd") else 1.0
        uses[road] += 1
        auto.record("w", road, 1 << 22, 4, factor * _STEADY_CODEC[road], 0.0, _PAYLOAD[road])
        clock[0] += factor * _STEADY_STEP[road]
    assert auto.costs["w"].codec_s == pytest.approx(_STEADY_CODEC)
    assert auto.decisions == {"w": "sparse"} and auto.history[0][1:] == ("w", None, "sparse")
    (v,) = auto.verdicts
    assert v["kept"] == "plan" and v["plan_ms"] == pytest.approx(1e3 * _STEADY_STEP["sparse"])
    assert v["against_ms"] == pytest.approx({r: 1e3 * t for r, t in _STEADY_STEP.items()})


def test_warm_up_steps_are_not_measured():
    """``warmup_steps=0`` measures from the first step (the former schedule); by default each codec
    road's first exploring step is not measured (no codec sample, no device sync on GPU)."""
    auto = _configured()
    assert auto._setup.schedule == ("sparse",) * 4 + ("qsgd",) * 3 + ("fp16", "dense")
    assert auto._setup.measured == (False, False, True, True) + (False, True, True) + (True, True)
    measured = []
    for _ in range(9):
        auto.step += 1
        measured.append(auto.measuring)
        auto.record("w", auto.road_of("w"), 1000, 4, 0.001 * auto.step, 0.0, 100)
        assert not auto.warming_up == measured[-1]
    assert measured == list(auto._setup.measured)
    assert auto.costs["w"].codec_s == pytest.approx({"sparse": 0.003, "qsgd": 0.006, "fp16": 0.008, "dense": 0.009})
    assert gc.Auto().start_steps == len(auto._setup.schedule) + 1 + 1 + 2 + 1 == 14
    bare = gc.Auto(warmup_steps=0, explore_steps=1)
    bare._configure("ours", "average", _FakeSet())
    assert bare._setup.schedule == ("sparse", "qsgd", "fp16", "dense") and all(bare._setup.measured)


def _probe_at(bytes_per_s: float):
    """What Auto's probe measures on a link of ``bytes_per_s`` and 0.5 ms latency (2 ranks)."""
    mb = (1 << 20) / bytes_per_s
    return (5e-4, 5e-4 + 4 * mb, 5e-4 + 2 * mb, 5e-4 + mb)


@pytest.mark.parametrize("rate,sparse_step,skipped", [
    (1.25e7, 0.2, {"qsgd", "fp16", "dense"}),    # 100 Mbit/s: dense 1.34 s, fp16 0.67, qsgd 0.34 of bytes
    (1.25e8, 0.05, {"dense"}),                   # 1 Gbit/s, a fast step: only dense's 134 ms > 1.5 x 50
    (1.25e8, 0.36, set()),                       # 1 Gbit/s, the step of the test above: explore all
], ids=["100mbit", "1gbit-fast-step", "1gbit"])
def test_roads_whose_bytes_alone_outlast_the_first_roads_step_are_not_explored(monkeypatch, rate, sparse_step,
                                                                                skipped):
    """After the sparse road's exploring steps the link is probed once; a road whose bytes alone at
    that rate take more than 1.5 x the sparse road's measured step is skipped, and the decision
    comes that many steps sooner, verified against the roads explored. The dense road, which has
    no codec, stays open to the model's decisions."""
    import hvd_gradcomp.auto.auto as auto_mod
    import hvd_gradcomp.collectives.transport as transport_mod

    auto = gc.Auto()
    auto._configure("ours", "average", _FakeSet())
    clock, taken, probes = [0.0], [], []
    monkeypatch.setattr(auto_mod, "_hvd", lambda: _FakeHvd())
    monkeypatch.setattr(transport_mod, "_hvd", lambda: _FakeHvd())   # Auto's mean and broadcast
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(auto.prober, "measure", lambda *a: probes.append(auto.step) or _probe_at(rate))
    steady = {**_STEADY_STEP, "sparse": sparse_step}
    explored = [r for r in ("sparse", "qsgd", "fp16", "dense") if r not in skipped]
    exploring = sum({"sparse": 4, "qsgd": 3}.get(r, 1) for r in explored)   # sparse, the first road: 2 warm-ups
    for _ in range(exploring + 1 + 1 + 2 + 1):   # exploration, decision, untimed, 2 timed steps, verdict
        road = auto.road_for("w")
        taken.append(road)
        auto.record("w", road, 1 << 22, 4, _STEADY_CODEC[road], 0.0, _PAYLOAD[road])
        clock[0] += steady[road]
    assert taken[:exploring] == [r for r in explored for _ in range({"sparse": 4, "qsgd": 3}.get(r, 1))]
    assert set(auto.skipped) == skipped
    for road, seen in auto.skipped.items():
        wire = {"dense": 4 << 22, "fp16": 2 << 22, "qsgd": auto_mod.payload_size(auto.qsgd, (1 << 22,))}[road]
        assert seen["transfer_ms"] == pytest.approx(1e3 * wire / rate, rel=1e-3)
        assert seen["first_road_ms"] == pytest.approx(1e3 * sparse_step)
    # probed after the sparse road's 4 steps (kept for a decision at the same step), then to decide
    assert probes == ([5] if len(explored) == 1 else [5, exploring + 1]) if skipped else [exploring + 1]
    (v,) = auto.verdicts
    assert v["step"] == exploring + 1 + 1 + 2 + 1 <= auto.start_steps and v["kept"] in ("plan", "sparse")   # a tie
    assert set(v["against_ms"]) == set(explored) and auto.decisions == {"w": "sparse"}
    assert ("dense" in auto.costs["w"].codec_s) == ("dense" not in skipped)   # measured only when explored
    assert ("not explored: " in auto.report()["summary"]) == bool(skipped)
    # a checkpoint taken while exploring resumes the same exploring steps
    other = gc.Auto()
    other.load_state_dict(auto.state_dict())
    other._configure("ours", "average", _FakeSet())
    assert other._setup.schedule == auto._setup.schedule and other.skipped == auto.skipped


def test_a_skipped_dense_road_stays_open_to_the_decisions(monkeypatch):
    """Dense, skipped at a slow link, has no codec to measure: at a re-decision on a link that
    became fast, the model sends a tensor whose codec costs more than its bytes there dense."""
    import hvd_gradcomp.auto.auto as auto_mod
    import hvd_gradcomp.collectives.transport as transport_mod

    auto = gc.Auto(interval=6)
    auto._configure("ours", "average", _FakeSet())
    clock, link = [0.0], [1.25e7]
    monkeypatch.setattr(auto_mod, "_hvd", lambda: _FakeHvd())
    monkeypatch.setattr(transport_mod, "_hvd", lambda: _FakeHvd())   # Auto's mean and broadcast
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(auto.prober, "measure", lambda *a: _probe_at(link[0]))
    for step in range(1, 13):
        if step == 9:
            link[0] = 1.25e10   # 100 Gbit/s from here on
        road = auto.road_for("w")
        auto.record("w", road, 1 << 22, 4, _STEADY_CODEC[road], 0.0, _PAYLOAD[road])
        clock[0] += {**_STEADY_STEP, "sparse": 0.2}[road]
    assert auto.skipped.keys() == {"qsgd", "fp16", "dense"}
    assert [h[1:] for h in auto.history] == [("w", None, "sparse"), ("w", "sparse", "dense")]   # steps 5 and 11
    assert auto.history[1][0] == 11   # decided on the model alone: dense was never measured before


def test_the_probe_is_sized_to_the_link(monkeypatch):
    """The probe's large collectives carry ``probe_numel`` values, or as many as the link sends in
    about 50 ms where it is slower: at 100 Mbit/s the full probe took 2 s, again at every
    re-decision. Sized from the last decision's link, else from a timed pilot allreduce."""
    import hvd_gradcomp.auto.auto as auto_mod
    import hvd_gradcomp.collectives.transport as transport_mod
    from hvd_gradcomp.auto.policy import Link

    monkeypatch.setattr(auto_mod, "_hvd", lambda: _FakeHvd())
    monkeypatch.setattr(transport_mod, "_hvd", lambda: _FakeHvd())   # Auto's mean and broadcast
    auto = _configured()
    pilots = []

    def pilot(numel):
        pilots.append(numel)
        return 4 * numel / 1.25e7   # 100 Mbit/s
    size = auto.prober.size(pilot, auto._setup.comm, auto.step)
    assert size == pytest.approx(1.25e7 * 0.05 / 4, rel=1e-6) and pilots == [1 << 16]
    auto.link = Link(1.25e9)   # 10 Gbit/s: the full probe, no pilot
    assert auto.prober.size(pilot, auto._setup.comm, auto.step) == 1 << 20 == auto.probe_numel and len(pilots) == 1
    auto.link = Link(1e5)      # never below the pilot's size
    assert auto.prober.size(pilot, auto._setup.comm, auto.step) == 1 << 16
    small = gc.Auto(probe_numel=1 << 12)   # a probe no larger than the pilot is taken as set, unsized
    small._configure("ours", "average", _FakeSet())
    assert small.prober.size(pilot, small._setup.comm, small.step) == 1 << 12 and len(pilots) == 1


@pytest.mark.parametrize("dense_alone,kept", [(0.28, "plan"), (0.26, "dense")])
def test_verification_keeps_decisions_a_road_alone_beats_by_less_than_the_hysteresis(monkeypatch, dense_alone, kept):
    """The decisions (0.3 s a step) stand against a road alone up to ``hysteresis`` (10%) faster,
    as a tensor switches road only past it: two timed steps differ by a few percent run to run."""
    auto = _configured()
    alone = {"sparse": 0.4, "qsgd": 0.5, "fp16": 0.7, "dense": dense_alone}
    _run_clocked(monkeypatch, auto, lambda roads: alone[roads[0]] if roads[0] == roads[1] else 0.3, 16,
                 decide=lambda a: a.decisions.update(w="sparse", v="dense"))
    (v,) = auto.verdicts
    assert v["kept"] == kept and auto.decisions == ({"w": "sparse", "v": "dense"} if kept == "plan" else
                                                    {"w": "dense", "v": "dense"})


# ---------------------------------------------------------------- structure: parts, not mixins
def foreign_reads(source: str) -> Dict[str, list]:
    """Per class of ``source``: the ``self.<name>`` it reads but neither assigns nor defines (a
    mixin reading what another class sets). A part owns what it reads.

    >>> foreign_reads("class A:\\n    def __init__(self):\\n        self.a = 1\\n"
    ...               "    def f(self):\\n        return self.a + self.b")
    {'A': ['b']}
    """
    import ast

    found = {}
    for cls in [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef)]:
        defined = {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        for n in cls.body:
            targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, ast.AnnAssign) else []
            defined |= {t.id for t in targets if isinstance(t, ast.Name)}
        on_self = [n for n in ast.walk(cls) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
                   and n.value.id == "self"]
        assigned = {n.attr for n in on_self if isinstance(n.ctx, ast.Store)}
        reads = sorted({n.attr for n in on_self if isinstance(n.ctx, ast.Load)} - assigned - defined)
        if reads:
            found[cls.name] = reads
    return found


def test_the_ownership_check_catches_a_mixin():
    mixin = ("class Schedule:\n    def exploring(self):\n        return self.step <= len(self._setup.schedule)\n"
             "class Auto(Schedule):\n    def __init__(self):\n        self.step = 0\n")
    assert foreign_reads(mixin) == {"Schedule": ["_setup", "step"]}


def test_auto_is_built_of_parts_that_own_what_they_read():
    """Auto is one class of one file (no mixins) and holds its parts; no class of hvd_gradcomp.auto
    reads an attribute of ``self`` it does not assign or define (so no part reads what another sets)."""
    import inspect
    from pathlib import Path

    import hvd_gradcomp.auto as auto_pkg
    from hvd_gradcomp.auto.decide import Decider
    from hvd_gradcomp.auto.measure import LinkProbe, Measurements, StepClock
    from hvd_gradcomp.auto.residuals import CompressedRoads
    from hvd_gradcomp.auto.schedule import Schedule

    files = {inspect.getsourcefile(c) for c in gc.Auto.__mro__ if c.__module__.startswith("hvd_gradcomp")}
    assert len(files) <= 3 and gc.Auto.__mro__ == (gc.Auto, object), gc.Auto.__mro__
    auto = gc.Auto()
    parts = {"compressed": CompressedRoads, "schedule": Schedule, "measurements": Measurements,
             "clock": StepClock, "prober": LinkProbe, "decider": Decider}
    assert {name: type(getattr(auto, name)) for name in parts} == parts
    assert len({id(getattr(auto, name)) for name in parts}) == len(parts)   # each its own
    for path in sorted(Path(auto_pkg.__file__).parent.glob("*.py")):
        assert foreign_reads(path.read_text()) == {}, path.name
