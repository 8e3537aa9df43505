"""``GradientCompressor.follow_world`` (an ``hvd.elastic`` reset changed the number of ranks) without ranks: QSGD's
relay residuals, kept per chunk of the ranks, are dropped with a warning giving their norm; the others stay."""
from __future__ import annotations

import pytest
import torch

from hvd_gradcomp import QSGD


def test_follow_world_drops_only_the_relay_residuals() -> None:
    comp = QSGD(bits=8, seed=0)
    comp._world = 2
    relay, own = comp.relay_residuals, comp.residuals
    relay.compensate("w#reduced0", torch.zeros(4))
    relay.commit("w#reduced0", torch.full((4,), 2.0))
    own.compensate("w", torch.zeros(8))
    own.commit("w", torch.ones(8))
    with pytest.warns(RuntimeWarning, match=r"2 -> 1 ranks.*L2 norm 4"):
        assert comp.follow_world(1) == pytest.approx(4.0)
    assert comp._world == 1 and relay.residual("w#reduced0") is None
    relay.check_shape("w#reduced0", torch.zeros(8))   # the chunk's new size is accepted
    assert torch.equal(own.residual("w"), torch.ones(8))
