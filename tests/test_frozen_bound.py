"""``feedback="frozen"`` moves no coordinate further in answer to one gradient than Adam could:
``1 / sqrt(1 - b2)`` times the rate (tests/workers/frozen_bound.py is the rank side).

Before (40933ca) a coordinate without gradient during the dense warm-up (an embedding row of a rare
token) had the floor for its frozen ``denom``, and its first large gradient moved it hundreds of
times the rate: the mechanism behind a tied-embedding transformer diverging after the freeze
(benchmarks/results/RECIPES.md, ``tied-2e-3``).
"""
from __future__ import annotations

import pytest

from tests.harness import run_ranks

pytestmark = pytest.mark.multirank


@pytest.mark.parametrize("road", ["gc", "stock"])
@pytest.mark.parametrize("betas", [(0.9, 0.99), (0.9, 0.999)])
def test_a_rare_rows_first_large_gradient_moves_it_no_further_than_adam_could(road, betas):
    bound = (1.0 - betas[1]) ** -0.5
    ranks = run_ranks("frozen_bound:rare_row", road=road, betas=list(betas))
    for r in ranks:
        assert r["identical"], r
        assert 0.5 < r["moved"] <= bound * (1 + 1e-3), f"row moved {r['moved']:.1f}x the rate, Adam's bound {bound:.1f}"


def test_uncompressed_adam_moves_the_rare_row_by_about_the_rate():
    """The reference: Adam's first step on a fresh coordinate is about the rate, whatever the gradient."""
    for r in run_ranks("frozen_bound:rare_row", compressed=False):
        assert 0.2 < r["moved"] < 1.5, r   # ~0.49 at step 8 (bias corrections)
