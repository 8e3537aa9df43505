"""A compressor is composed of parts it owns (issue 60): each exported codec class spans at most three
files of the package, each part works alone, no part reads what another part sets, and a round's undo
reaches every part with round state."""
from __future__ import annotations

import ast
import copy
import inspect
import pickle
import textwrap
import warnings
from pathlib import Path
from typing import Set

import pytest
import torch

import hvd_gradcomp as gc
from hvd_gradcomp.codecs import binding, clipping, exempt, steps
from hvd_gradcomp.codecs.compressor import GradientCompressor
from hvd_gradcomp.codecs.powersgd import Factors, PowerSGD
from hvd_gradcomp.codecs.qsgd import QSGD, Quantiser
from hvd_gradcomp.codecs.topk import TopK, TopKQSGD

CODECS = Path(__file__).resolve().parents[1] / "hvd_gradcomp" / "codecs"
MAX_MRO_FILES = 3
class Owner:
    """An optimizer, as far as claiming goes (weakly referenced)."""


OWNERS = []
PARTS = [steps.StepCounter, steps.Rounds, binding.OptimizerBinding, binding.Policies, exempt.Exemption,
         clipping.Clipping, Quantiser, Factors]


def mro_files(cls: type) -> Set[str]:
    """The files of hvd_gradcomp/codecs that define a class of ``cls``'s MRO."""
    files = set()
    for klass in cls.__mro__:
        try:
            path = Path(inspect.getsourcefile(klass) or "")
        except TypeError:   # a built-in
            continue
        if CODECS in path.parents:
            files.add(path.name)
    return files


@pytest.mark.parametrize("cls", [GradientCompressor, QSGD, TopK, TopKQSGD, PowerSGD])
def test_no_codec_class_spans_more_than_three_files(cls: type) -> None:
    assert len(mro_files(cls)) <= MAX_MRO_FILES, (cls.__name__, sorted(mro_files(cls)))


def test_the_exported_codecs_are_built_on_the_codecs_classes() -> None:
    for name in ("QSGD", "TopK", "TopKQSGD", "PowerSGD"):
        exported = getattr(gc, name)
        codec = next(k for k in exported.__mro__ if CODECS in Path(inspect.getsourcefile(k)).parents)
        assert len(mro_files(codec)) <= MAX_MRO_FILES, (name, sorted(mro_files(codec)))


# ---------------------------------------------------------------- each part alone
def test_step_counter_alone() -> None:
    s = steps.StepCounter(seed=5)
    first = s.next_seed("w")
    assert s.next_seed("w") != first and s.steps == {"w": 2}
    s.track_rounds(True)
    again = s.next_seed("w")
    s.end_round(False)
    assert s.next_seed("w") == again and s.steps == {"w": 3}


def test_rounds_alone() -> None:
    counter = steps.StepCounter(seed=0)
    r = steps.Rounds([counter])
    owner = Owner()
    r.claim("codec", owner, 2)
    with pytest.raises(ValueError, match="another optimizer"):
        r.claim("codec", Owner(), 2)
    r.exchange_opened("a")
    r.exchange_opened("b")
    assert r.in_step and not r.exchange_closed("a", True)
    assert r.exchange_closed("b", True) and r.round == 1 and not r.in_step


def test_policies_and_binding_alone() -> None:
    p = binding.Policies("auto")
    assert p.policy.key == "classic" and p.relay_policy() is p.relay
    w = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.SGD([w], lr=0.1, momentum=0.9)
    b = binding.OptimizerBinding()
    b.bound = (opt, {w: "w"})
    b.bind_policy(p.policy, None)
    assert b.groups_bound == 1 and b.handed.left > 0


def test_exemption_and_clipping_alone() -> None:
    e = exempt.Exemption(exclude="norm", mode="fp16")
    assert e.excluded("ln.norm.weight") and not e.excluded("fc.weight")
    with pytest.raises(ValueError, match="exempt must be one of"):
        exempt.Exemption(mode="fp8")
    c = clipping.Clipping(2.0)
    g = torch.full((4,), 3.0)
    assert float(c.local([g])) == pytest.approx(6.0) and float(g.norm()) == pytest.approx(2.0, rel=1e-4)


def test_quantiser_and_factors_alone() -> None:
    q = Quantiser(2, 512)
    assert q.contracting and q.ef_scale(False) == 1.0 and q.ef_scale(True) < 1.0
    with pytest.raises(ValueError):
        q.bits = 9
    f = Factors()
    f.keep("w", torch.ones(3, 1))   # not tracked: nothing kept to undo
    f.end_round(False)
    assert torch.equal(f.q["w"], torch.ones(3, 1))


# ---------------------------------------------------------------- attribute ownership
def _self_reads_and_writes(cls: type):
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    reads, writes = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            (writes if isinstance(node.ctx, ast.Store) else reads).add(node.attr)
    return reads, writes


@pytest.mark.parametrize("part", PARTS, ids=lambda c: c.__name__)
def test_no_part_reads_what_another_part_sets(part: type) -> None:
    """Every ``self.X`` a part reads is set in that part or is a method, property or class attribute of it."""
    reads, writes = _self_reads_and_writes(part)
    own = writes | {name for klass in part.__mro__ if klass is not object for name in vars(klass)}
    assert reads - own == set(), f"{part.__name__} reads {sorted(reads - own)}, set by no code of its own"


def test_the_ownership_check_catches_a_part_reading_another_parts_attribute() -> None:
    class Nosy:
        def __init__(self) -> None:
            self.mine = 1

        def peek(self) -> int:
            return self.mine + self._steps   # set by the step counter, not here

    reads, writes = _self_reads_and_writes(Nosy)
    assert reads - (writes | set(vars(Nosy))) == {"_steps"}


# ---------------------------------------------------------------- round undo reaches every part
def _claimed(c: GradientCompressor) -> GradientCompressor:
    OWNERS.append(Owner())
    c._claim(OWNERS[-1], 1)
    return c


def test_a_non_finite_round_rolls_back_every_part() -> None:
    c = _claimed(QSGD(bits=8, seed=1))
    g = torch.randn(4096)
    c.compress_named("w", g)                                 # round 1: residual of w, step 1
    c.compress_chunks("v", torch.randn(4096), [0, 2048, 4096])
    c.compress_named("v#reduced0", torch.randn(2048), relay=True)
    c.encode_half([("b", torch.tensor([1.0, 1e-9]))], world=1)
    c.end_round(True)
    before = (c.residuals.residual("w").clone(), c._relay.residuals.residual("v#reduced0").clone(),
              c.half_residuals.residual("b").clone(), dict(c._steps))
    c.compress_named("w", torch.randn(4096))                 # round 2, undone
    c.compress_named("v#reduced0", torch.randn(2048), relay=True)
    c.encode_half([("b", torch.tensor([3.0, 2e-9]))], world=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        c.end_round(False)
    assert torch.equal(c.residuals.residual("w"), before[0])
    assert torch.equal(c._relay.residuals.residual("v#reduced0"), before[1])
    assert torch.equal(c.half_residuals.residual("b"), before[2])
    assert c._steps == before[3] and c.exchange_step == 2


def test_a_non_finite_round_rolls_back_powersgd_q() -> None:
    c = _claimed(PowerSGD(rank=2))
    grad = torch.randn(64, 32)

    def one_round(ok: bool) -> None:
        work = c.first_round("w", grad)
        q = c.second_round(work, work.send)
        c.finish_rounds(work, q, torch.empty_like(grad))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            c.end_round(ok)

    one_round(True)
    q, steps_before = c._q["w"].clone(), dict(c._steps)
    one_round(False)
    assert torch.equal(c._q["w"], q) and c._steps == steps_before


def test_state_dict_format_and_copies() -> None:
    c = _claimed(TopKQSGD(ratio=0.01, bits=8, seed=3))
    c.compress_named("w", torch.randn(8192))
    c.end_round(True)
    state = c.state_dict()
    assert list(state) == ["compressor", "kind", "error_feedback", "world_size", "seed", "stream", "steps",
                           "residuals", "shapes", "feedback", "relay", "half"]
    unclaimed = TopKQSGD(ratio=0.01, bits=8, seed=3)
    unclaimed.load_state_dict(state)   # as before the parts: a claimed one pickles no better (its owner's weakref)
    for twin in (copy.deepcopy(c), pickle.loads(pickle.dumps(unclaimed))):
        assert twin.state_dict()["steps"] == state["steps"]
        assert torch.equal(twin.residuals.residual("w"), c.residuals.residual("w"))
    fresh = TopKQSGD(ratio=0.01, bits=8)
    fresh.load_state_dict(state)
    assert fresh.seed == 3 and fresh._steps == {"w": 1}

