"""The exchange algorithms written once (hvd_gradcomp/collectives/rounds.py), driven here by simulated ranks in
one process: what each rank ends with, against PowerSGD's rounds computed by hand, and QSGD's
compressed allreduce against the average, with NaN flags and ranks that disagree."""
from typing import List

import pytest
import torch

from hvd_gradcomp.codecs.powersgd import PowerSGD, orthogonalize
from hvd_gradcomp.codecs.qsgd import QSGD
from hvd_gradcomp.codecs.topk import TopK, TopKQSGD
from hvd_gradcomp.collectives.rounds import (Allreduce, Gather, Scatter, compressed_allreduce, dense_fallback, finish,
                                             low_rank_rounds, sparse_allgather)


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
    assert isinstance(request, Allreduce) and request.tensor.numel() == 16 * 2
    with pytest.raises(RuntimeError, match="ranks disagree on the model"):
        run.send(torch.zeros(16 * 3))


def drive_compressed_allreduce(runs: List) -> None:
    """Every rank's :func:`compressed_allreduce` to its end: the alltoall and the allgather done by
    hand, payloads handed over as they are (a transport's framing removed)."""
    scatters = [next(r) for r in runs]
    assert all(isinstance(s, Scatter) for s in scatters)
    gathers = [r.send([scatters[src].payloads[me] for src in range(len(runs))]) for me, r in enumerate(runs)]
    assert all(isinstance(g, Gather) for g in gathers)
    for r in runs:
        finish(r, [g.payloads for g in gathers])


def test_three_ranks_end_with_the_same_bits_near_the_average():
    torch.manual_seed(2)
    world = 3
    grads = [{"a": torch.randn(1000), "b": torch.randn(7, 11)} for _ in range(world)]
    comps = [QSGD(bits=8, seed=rank) for rank in range(world)]
    outs = [{n: torch.empty(g.numel()) for n, g in gs.items()} for gs in grads]
    runs = [compressed_allreduce(c, list(gs.items()), list(o.values()), world, rank)
            for rank, (c, gs, o) in enumerate(zip(comps, grads, outs))]
    drive_compressed_allreduce(runs)
    for name in ("a", "b"):
        assert torch.equal(outs[0][name], outs[1][name]) and torch.equal(outs[0][name], outs[2][name])
        average = torch.stack([g[name].reshape(-1) for g in grads]).mean(0)
        err = float((outs[0][name] - average).norm() / average.norm())
        # QSGD's variance bound per pass, w = min(d/s^2, sqrt(d)/s) = 0.032 (512-value buckets, s = 127):
        # about 0.18 relative per pass at most; two passes measured about 0.08 here
        assert 0 < err < 0.15, f"{name}: 8-bit QSGD twice should land near the average, off by {err:.3f} (relative)"


def test_each_rank_reduces_its_chunk_and_requantises_it_with_its_own_residual():
    world, comps = 2, [QSGD(bits=2, seed=r) for r in range(2)]
    grads = [torch.linspace(-1, 1, 600), torch.linspace(1, -0.5, 600)]
    outs = [torch.empty(600) for _ in range(world)]
    runs = [compressed_allreduce(c, [("w", g)], [o], world, r) for r, (c, g, o) in enumerate(zip(comps, grads, outs))]
    drive_compressed_allreduce(runs)
    assert torch.equal(outs[0], outs[1])
    for rank, comp in enumerate(comps):   # 2-bit: the re-quantised chunk leaves a residual of its own
        relay = comp.relay_residuals.residual(f"w#reduced{rank}")
        assert relay is not None and relay.numel() == 300 and float(relay.abs().max()) > 0


def test_a_rank_with_nan_makes_the_result_nan_everywhere_and_keeps_its_residual():
    world = 2
    comps = [QSGD(bits=4, seed=r) for r in range(world)]
    grads = [torch.randn(500), torch.full((500,), float("nan"))]
    outs = [torch.zeros(500) for _ in range(world)]
    runs = [compressed_allreduce(c, [("w", g)], [o], world, r) for r, (c, g, o) in enumerate(zip(comps, grads, outs))]
    scatters = [next(r) for r in runs]
    assert scatters[1].payloads == [[None], [None]], "a non-finite input travels as the flag alone"
    gathers = [r.send([scatters[src].payloads[me] for src in range(world)]) for me, r in enumerate(runs)]
    for r in runs:
        finish(r, [g.payloads for g in gathers])
    assert all(bool(o.isnan().all()) for o in outs)
    assert comps[1].residuals.residual("w") is None, "the rank with NaN kept nothing of it"


@pytest.mark.parametrize("flags", [True, False])
def test_a_reduced_chunk_that_overflows_is_flagged_or_refused(flags):
    """2e38 + 2e38 overflows float32: flagged as NaN for Horovod's envelopes; refused where the
    driver (DDP's) checked only its inputs and has no flag to send."""
    comp = QSGD(bits=8, seed=0)
    run = compressed_allreduce(comp, [("w", torch.full((2,), 2e38))], [torch.empty(2)], world=2, rank=0,
                               average=False, flags=flags)
    scatter = next(run)
    if flags:
        assert run.send([scatter.payloads[0], scatter.payloads[0]]).payloads == [None]
    else:
        with pytest.raises(FloatingPointError, match="w#reduced0"):
            run.send([scatter.payloads[0], scatter.payloads[0]])


def test_a_driver_that_stops_early_or_a_rank_missing_is_told():
    comp = QSGD(bits=8, seed=0)
    run = compressed_allreduce(comp, [("w", torch.randn(100))], [torch.empty(100)], world=2, rank=0)
    scatter = next(run)
    with pytest.raises(RuntimeError, match="ranks disagree on this exchange"):
        run.send([scatter.payloads[0]])   # one rank's payloads where two were expected
    run = compressed_allreduce(comp, [("w", torch.randn(100))], [torch.empty(100)], world=1, rank=0)
    with pytest.raises(RuntimeError, match="one more collective"):
        finish(run, next(run).payloads)   # the scatter's result handed over as if it were the last


# ---------------------------------------------------------------- the sparse allgather
def drive_allgather(runs: List) -> List:
    """Each rank's allgather to its end: every rank sent every rank's payloads, in rank order."""
    gathers = [next(r) for r in runs]
    every = [g.payloads for g in gathers]
    return [finish(r, every) for r in runs]


def test_sparse_allgather_gives_every_rank_the_same_bits_the_average_of_what_was_sent():
    torch.manual_seed(2)
    grads = [torch.randn(3, 5000) for _ in range(3)]
    comps = [TopKQSGD(ratio=0.01, bits=8, seed=r) for r in range(3)]
    outs = [torch.empty(3, 5000) for _ in range(3)]
    runs = [sparse_allgather(c, [("w", g.clone())], [o], world=3, rank=r)
            for r, (c, g, o) in enumerate(zip(comps, grads, outs))]
    parts = drive_allgather(runs)
    assert all(torch.equal(outs[0], o) for o in outs[1:]), "ranks disagree"
    # what each rank sent, decoded: their mean is the average (each rank's own part is the one it
    # carried, not decoded, and must be the same bits)
    sent = [TopKQSGD(ratio=0.01, bits=8, seed=r).decode(TopKQSGD(ratio=0.01, bits=8, seed=r).compress_named("w", g))
            for r, g in enumerate(grads)]
    torch.testing.assert_close(outs[0], torch.stack(sent).mean(0), rtol=0, atol=1e-6)
    assert [len(p[0]) for p in parts] == [3, 3, 3]   # one segment, 3 ranks' parts, for the policy's received()


def test_sparse_allgather_with_a_nan_rank_is_nan_everywhere_and_the_sum_without_average():
    comps = [TopK(ratio=0.5, min_k=1, seed=r) for r in range(2)]
    grads = [torch.tensor([1.0, 0.0, 3.0, 0.0]), torch.tensor([0.0, 2.0, 0.0, 4.0])]
    outs = [torch.empty(4) for _ in range(2)]
    drive_allgather([sparse_allgather(c, [("w", g)], [o], 2, r, average=False)
                     for r, (c, g, o) in enumerate(zip(comps, grads, outs))])
    assert outs[0].tolist() == outs[1].tolist() == [1.0, 2.0, 3.0, 4.0]
    grads[1] = torch.tensor([float("nan"), 2.0, 0.0, 4.0])
    drive_allgather([sparse_allgather(c, [("w", g)], [o], 2, r) for r, (c, g, o) in enumerate(zip(comps, grads, outs))])
    assert all(torch.isnan(o).all() for o in outs)


# ---------------------------------------------------------------- the dense fallback
def drive_dense(runs: List, world: int) -> List:
    """Each rank's dense fallback to its end, each request answered as a transport would: summed
    over ranks, divided by them where it asks for the average."""
    requests = [next(r).requests for r in runs]
    assert len({tuple(q.tag for q in rs) for rs in requests}) == 1, "ranks asked for different collectives"
    results = []
    for i, first in enumerate(requests[0]):
        total = torch.stack([rs[i].tensor for rs in requests]).sum(0)
        results.append(total / world if first.average else total)
    for r in runs:
        finish(r, [t.clone() for t in results])
    return requests[0]


def test_dense_fallback_sends_the_small_tensors_as_float16_and_the_rest_per_dtype():
    torch.manual_seed(3)
    world = 2
    comps = [TopKQSGD(seed=r) for r in range(world)]
    biases = [torch.randn(10) for _ in range(world)]
    counts = [torch.randn(6, dtype=torch.float64) for _ in range(world)]
    expected = (torch.stack(biases).mean(0), torch.stack(counts).mean(0))
    opened = []
    runs = [dense_fallback(c, [("bias", b), ("count", n)], [b, n], world, min_compress_numel=1024,
                           opening=opened.append) for c, b, n in zip(comps, biases, counts)]
    requests = drive_dense(runs, world)
    assert [(q.tag, q.tensor.dtype, q.average, q.raw_bytes) for q in requests] == \
        [("float64", torch.float64, True, 48), ("fp16", torch.float16, False, 40)]
    assert opened == ["bias", "bias"], "each rank opens the float16 tensor's step before encoding it"
    assert torch.equal(biases[0], biases[1]) and torch.equal(counts[0], counts[1])
    torch.testing.assert_close(counts[0], expected[1])   # float64: exact average
    torch.testing.assert_close(biases[0], expected[0], rtol=0, atol=2e-3)   # float16's rounding
    # the cast's error feedback: what float16 rounded away goes out with the next step's cast
    carried, _ = comps[0].encode_half([("bias", torch.zeros(10))], world)
    assert carried.abs().max() > 0


def test_dense_fallback_averages_a_bucket_in_place_and_gives_the_sum_when_asked():
    world = 2
    buffers = [torch.arange(8.0) + r for r in range(world)]
    views = [[b[:3], b[3:]] for b in buffers]
    runs = [dense_fallback(None, [("a", v[0]), ("b", v[1])], v, world, min_compress_numel=1, average=False)
            for v in views]
    requests = [next(r).requests for r in runs]
    assert [q.tag for q in requests[0]] == ["float32"]
    assert requests[0][0].tensor.data_ptr() == buffers[0].data_ptr(), "segments end to end: no copy"
    total = requests[0][0].tensor + requests[1][0].tensor
    for r in runs:
        finish(r, [total.clone()])
    assert buffers[0].tolist() == buffers[1].tolist() == (2 * torch.arange(8.0) + 1).tolist()
