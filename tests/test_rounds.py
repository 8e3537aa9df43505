"""The exchange algorithms written once (hvd_gradcomp/rounds.py), driven here by simulated ranks in
one process: what each rank ends with, against PowerSGD's rounds computed by hand."""
from typing import List

import pytest
import torch

from hvd_gradcomp.powersgd import PowerSGD, orthogonalize
from hvd_gradcomp.rounds import Average, low_rank_rounds


def drive_in_lockstep(runs: List) -> List[str]:
    """Every rank's generator to its end, each request answered with the average of every rank's
    (what any transport returns); the requests' tags, in order."""
    tags, requests = [], [next(r) for r in runs]
    while True:
        assert len({q.tag for q in requests}) == 1, "ranks asked for different collectives"
        tags.append(requests[0].tag)
        average = torch.stack([q.tensor for q in requests]).mean(0)
        done = []
        for i, r in enumerate(runs):
            try:
                requests[i] = r.send(average.clone())
            except StopIteration:
                done.append(i)
        if done:
            assert len(done) == len(runs), "ranks finished after different numbers of collectives"
            return tags


def test_two_ranks_end_with_the_rank_r_approximation_of_the_average():
    torch.manual_seed(0)
    grads = [{"a": torch.randn(48, 20), "b": torch.randn(32, 3, 2, 2)} for _ in range(2)]
    comps = [PowerSGD(rank=2, seed=7) for _ in range(2)]
    outs = [{n: torch.empty_like(g) for n, g in gs.items()} for gs in grads]
    runs = [low_rank_rounds(c, list(gs.items()), list(o.values())) for c, gs, o in zip(comps, grads, outs)]
    assert drive_in_lockstep(runs) == ["p", "q"]
    for name in ("a", "b"):
        assert torch.equal(outs[0][name], outs[1][name]), "ranks disagree"
        # by hand: the same first Q on both ranks (drawn from seed and name), P averaged and
        # orthogonalised, Q = M^T P averaged, out = P Q^T
        ms = [gs[name].reshape(gs[name].shape[0], -1) for gs in grads]
        q0 = PowerSGD(rank=2, seed=7)._start_q(name, ms[0].shape[1], 2, torch.device("cpu"))
        p = orthogonalize(torch.stack([m @ q0 for m in ms]).mean(0))
        q = torch.stack([m.T @ p for m in ms]).mean(0)
        expected = (p @ q.T).reshape(grads[0][name].shape)
        torch.testing.assert_close(outs[0][name], expected, rtol=1e-5, atol=1e-5)
        assert (outs[0][name] - torch.stack([g[name] for g in grads]).mean(0)).abs().max() > 1e-3, \
            "rank 2 of random matrices cannot be exact: the test would not see a wrong algorithm"


def test_a_rank_keeps_what_the_approximation_missed_as_its_residual():
    torch.manual_seed(1)
    comp = PowerSGD(rank=1, seed=0)
    grad, out = torch.randn(40, 30), torch.empty(40, 30)
    run = low_rank_rounds(comp, [("w", grad.clone())], [out])
    request = next(run)
    with pytest.raises(StopIteration):
        run.send(run.send(request.tensor).tensor)   # one rank: the average is its own
    torch.testing.assert_close(comp.residuals.residual("w"), (grad - out).reshape(-1), rtol=0, atol=1e-6)
    assert float((grad - out).abs().max()) > 0.1   # rank 1 of a random matrix misses much of it


def test_ranks_that_disagree_on_the_model_are_told():
    comp = PowerSGD(rank=2, seed=0)
    run = low_rank_rounds(comp, [("w", torch.randn(16, 16))], [torch.empty(16, 16)])
    request = next(run)
    assert isinstance(request, Average) and request.tensor.numel() == 16 * 2
    with pytest.raises(RuntimeError, match="ranks disagree on the model"):
        run.send(torch.zeros(16 * 3))
