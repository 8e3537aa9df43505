"""The fused and refactored kernels against their plain references (hvd_gradcomp.codecs.kernels,
hvd_gradcomp.feedback.kernels)."""
from __future__ import annotations

import warnings

import pytest
import torch

from hvd_gradcomp import TopK, TopKQSGD
from hvd_gradcomp.codecs import kernels
from hvd_gradcomp.feedback import kernels as fk
from hvd_gradcomp.feedback import ErrorFeedback, subtract_sent

NAN, INF = float("nan"), float("inf")


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _inputs(n: int, kind: str, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = gen(seed)
    x = torch.randn(n, generator=g)
    if kind == "ties":      # few distinct magnitudes: ties at every threshold
        x = torch.randint(-3, 4, (n,), generator=g).float()
    elif kind == "zeros":   # mostly zeros: the sampled threshold can be 0
        x = x * (torch.rand(n, generator=g) < 0.003)
    elif kind == "nonfinite":
        x[:: max(1, n // 7)] = INF
        x[1:: max(1, n // 5)] = NAN
        x[2:: max(1, n // 3)] = -INF
    return x.to(dtype)


def _reference_topk(x: torch.Tensor, k: int) -> torch.Tensor:
    return torch.topk(x.float().abs(), k).indices.sort().values


def _check_topk(idx: torch.Tensor, x: torch.Tensor, k: int) -> None:
    """k distinct ascending indices holding the k largest magnitudes (any choice among ties)."""
    mags = x.double().abs()
    assert idx.numel() == k and bool((idx[1:] > idx[:-1]).all())
    kth = mags.sort(descending=True).values[k - 1]
    assert bool((mags[idx] >= kth).all())
    assert int((mags > kth).sum()) <= k and bool((mags[idx] > kth).sum() == (mags > kth).sum())


SIZES = [1, 7, 1000, 70_001, 300_000]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("kind", ["normal", "ties", "zeros", "nonfinite"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_marked_matches_the_unfused_passes(n, kind, dtype, with_residual):
    """Sum, threshold and mask equal a plain add, the sampled threshold of the sum and the compare."""
    flat = _inputs(n, kind, dtype, seed=n)
    res = _inputs(n, "normal", torch.float32, seed=n + 1) * 0.1 if with_residual else None
    want = flat.float() + res if with_residual else flat.float()
    k = max(1, n // 100)
    out = torch.full((n,), 7.0)
    marked = fk.add_marked(flat, res, out, k)
    assert torch.equal(out, want) or (kind == "nonfinite" and torch.equal(out.nan_to_num(), want.nan_to_num()))
    sl = fk.sample_slice(n, k)
    if sl is None:
        assert marked is None
        return
    threshold, mask = marked.threshold, marked.mask
    assert marked.total is None
    assert torch.equal(threshold, fk.sample_threshold(want[sl], k, n))
    assert mask.dtype == torch.uint8 and torch.equal(mask, (want.abs() >= threshold).to(torch.uint8))
    total = fk.add_marked(flat, res, torch.empty(n), k, total=True).total  # the input's sum, for finiteness
    assert bool(torch.isfinite(total)) == (kind != "nonfinite")


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("kind", ["normal", "ties", "zeros"])
@pytest.mark.parametrize("ratio", [0.001, 0.01, 0.1, 0.5])
def test_topk_from_marks_is_the_topk_of_the_sum(n, kind, ratio):
    flat = _inputs(n, kind, torch.float32, seed=3 * n)
    res = torch.randn(n, generator=gen(n)) * 0.01
    k = kernels.num_selected(ratio, n)
    out = torch.empty(n)
    marked = fk.add_marked(flat, res, out, k)
    idx = kernels.topk_indices(out, k, marked)
    assert torch.equal(idx, kernels.topk_indices(out, k))  # the same selection with or without marks
    _check_topk(idx, out, k)
    if kind == "normal":  # no ties: exactly torch.topk's set
        assert torch.equal(idx, _reference_topk(out, k))


def test_topk_survives_a_misjudged_sample():
    """A sample whose threshold lets fewer than k candidates through falls back to the exact top-k."""
    n, k = 300_000, 30_000
    flat = torch.randn(n, generator=gen(1))
    flat[fk.sample_slice(n, k)] = 1e6  # every sampled value huge: only they pass the threshold
    out = torch.empty(n)
    marked = fk.add_marked(flat, None, out, k)
    assert int(marked[1].sum()) < k
    assert torch.equal(kernels.topk_indices(out, k, marked), _reference_topk(out, k))


@pytest.mark.parametrize("c, k", [(10, 1), (10, 5), (10, 6), (10, 10), (1000, 999), (1000, 667)])
def test_top_of_takes_topk_choice_on_ties(c, k):
    for seed in range(5):
        mags = torch.randint(0, 4, (c,), generator=gen(seed)).float()
        keep = kernels._top_of(mags, k)
        assert keep.numel() == k and bool((keep[1:] > keep[:-1]).all())
        kth = mags.sort(descending=True).values[k - 1]
        if int((mags >= kth).sum()) == k:
            assert torch.equal(keep, (mags >= kth).nonzero().squeeze(1))
        else:  # a tie at the k-th value: torch.topk's own choice, as before
            assert torch.equal(keep, torch.topk(mags, k, sorted=False).indices.sort().values)


def test_sample_stride_is_odd_and_spans_the_columns():
    """An even stride on a 2048-wide matrix would sample the same columns of every row."""
    n = 2048 * 2048
    sl = fk.sample_slice(n, n // 100)
    assert sl.step % 2 == 1
    cols = set((torch.arange(n)[sl] % 2048).tolist())
    assert len(cols) > 1000


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_subtract_sent_equals_indexed_subtraction(dtype):
    acc = torch.randn(10_000, generator=gen(2))
    idx = torch.randperm(10_000, generator=gen(3))[:500].sort().values
    vals = (acc[idx] * 0.9 + 1e-3).to(dtype)
    want = acc.clone()
    want[idx] -= vals.float()
    subtract_sent(acc, (idx, vals))
    assert torch.equal(acc, want)


def test_error_feedback_marks_and_stays_exact():
    """prepare_marked builds the same sum as prepare, and sent + new residual == input + old residual."""
    a, b = ErrorFeedback(), ErrorFeedback()
    for step in range(3):
        g = torch.randn(300_000, generator=gen(step))
        old = a.residuals.residual("w")
        acc_a, marked = a.prepare_marked("w", g, 3000)
        acc_b = b.prepare("w", g)
        assert torch.equal(acc_a, acc_b) and marked is not None
        before = acc_a.clone()
        idx = kernels.topk_indices(acc_a, 3000, marked)
        sent = (idx, acc_a[idx] * 0.5)
        a.sent("w", acc_a, sent)
        b.sent("w", acc_b, (idx, acc_b[idx] * 0.5))
        rebuilt = a.residuals.residual("w").clone()
        rebuilt[idx] += sent[1]
        assert torch.equal(rebuilt, before)
        assert torch.equal(before, g if old is None else g + old)
        assert torch.equal(a.residuals.residual("w"), b.residuals.residual("w"))


@pytest.mark.slow
@pytest.mark.parametrize("with_residual, scale", [(False, None), (True, None), (True, 0.7)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_compiled_add_marked_matches_eager(monkeypatch, with_residual, scale, dtype):
    """HVDGC_COMPILE=1 (one fused loop) and =0 (two passes) write the same sum and mask, NaN/Inf included."""
    n = (1 << 20) + 37
    flat = _inputs(n, "nonfinite", dtype, seed=4)
    res = torch.randn(n, generator=gen(5)) if with_residual else None
    results = []
    for mode in ("0", "1"):
        monkeypatch.setenv("HVDGC_COMPILE", mode)
        out = torch.empty(n)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            threshold, mask, _ = fk.add_marked(flat, res, out, n // 100, scale=scale)
        # a fallback to eager kernels would make this test vacuous
        assert not [w for w in caught if "torch.compile failed" in str(w.message)]
        results.append((out, threshold, mask))
    (o0, t0, m0), (o1, t1, m1) = results
    assert torch.equal(o0.nan_to_num(), o1.nan_to_num()) and torch.equal(o0.isnan(), o1.isnan())
    torch.testing.assert_close(t0, t1, rtol=0, atol=0, equal_nan=True)  # NaN: sampled NaNs outrank all
    assert torch.equal(m0, m1)
    monkeypatch.setenv("HVDGC_COMPILE", "1")
    finite = flat.clone()
    finite[~torch.isfinite(finite)] = 0
    assert bool(torch.isfinite(fk.add_marked(finite, res, torch.empty(n), n // 100, total=True).total))
    assert not bool(torch.isfinite(fk.add_marked(flat, res, torch.empty(n), n // 100, total=True).total))


def _momentum_reference(grad, old, res, m, d):
    """Momentum correction's input, one rounding per operation: the product, then each sum."""
    g = grad.float()
    u = g.clone() if old is None else old * m + (g if not d else g * (1 - d))
    return u, u.clone() if res is None else u + res


@pytest.mark.parametrize("with_old, with_residual, dampening", [(False, False, 0.0), (True, False, 0.0),
                                                               (True, True, 0.0), (True, True, 0.25)])
def test_momentum_marked_is_velocity_residual_and_candidates(with_old, with_residual, dampening):
    """One pass: u = m*old + (1-d)*g, acc = u + residual, the mask of |acc| >= the sampled threshold and
    the sum of g, all as separate operations compute them (eager here: below the compile threshold)."""
    n, k = 300_000, 3000
    g = torch.randn(n, generator=gen(1))
    old = torch.randn(n, generator=gen(2)) if with_old else None
    res = torch.randn(n, generator=gen(3)) * 0.1 if with_residual else None
    u, acc = torch.empty(n), torch.empty(n)
    marks = fk.momentum_marked(g, old, res, u, acc, 0.9, dampening, k, total=True)
    want_u, want_acc = _momentum_reference(g, old, res, 0.9, dampening)
    assert torch.equal(u, want_u) and torch.equal(acc, want_acc)
    sl = fk.sample_slice(n, k)
    assert torch.equal(marks.threshold, fk.sample_threshold(want_acc[sl], k, n))
    assert torch.equal(marks.mask.bool(), want_acc.abs() >= marks.threshold)
    assert float(marks.total) == pytest.approx(float(g.double().sum()), rel=1e-4, abs=1e-2)
    assert torch.equal(kernels.topk_indices(acc, k, marks[:2]), _reference_topk(want_acc, k))
    # no k (or a small tensor): the velocity and the sum only, no candidates
    assert fk.momentum_marked(g, old, res, torch.empty(n), torch.empty(n), 0.9, dampening) is None


@pytest.mark.slow
@pytest.mark.parametrize("with_old, with_residual, dampening, scale", [
    (False, True, 0.0, None), (True, False, 0.0, None), (True, True, 0.1, None), (True, True, 0.0, 1.3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_momentum_marked_matches_eager(monkeypatch, with_old, with_residual, dampening, scale, dtype):
    """HVDGC_COMPILE=1 (one loop) and =0 (separate passes) write the same velocity, sum, mask and total,
    NaN/Inf included (CPU: both round the product before the sum)."""
    n = (1 << 20) + 37
    grad = _inputs(n, "nonfinite", dtype, seed=6)
    old = torch.randn(n, generator=gen(7)) if with_old else None
    res = torch.randn(n, generator=gen(8)) * 0.1 if with_residual else None
    results = []
    for mode in ("0", "1"):
        monkeypatch.setenv("HVDGC_COMPILE", mode)
        u, acc = torch.empty(n), torch.empty(n)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            marks = fk.momentum_marked(grad, old, res, u, acc, 0.9, dampening, n // 100, total=True,
                                            scale=scale)
        assert not [w for w in caught if "torch.compile failed" in str(w.message)]
        results.append((u, acc, marks))
    (u0, a0, k0), (u1, a1, k1) = results
    for x, y in ((u0, u1), (a0, a1)):
        assert torch.equal(x.nan_to_num(), y.nan_to_num()) and torch.equal(x.isnan(), y.isnan())
    torch.testing.assert_close(k0.threshold, k1.threshold, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(k0.mask, k1.mask) and not bool(torch.isfinite(k1.total))
    finite = grad.clone()
    finite[~torch.isfinite(finite)] = 0
    total = fk.momentum_marked(finite, old, res, torch.empty(n), torch.empty(n), 0.9, dampening, n // 100,
                                    total=True).total
    assert bool(torch.isfinite(total))


@pytest.mark.slow
@pytest.mark.parametrize("k, spread, offset", [(40_000, 100, 0), (50_000, 3, 3), (33_000, 1 << 30, 0),
                                               (70_000, 1, 0), (40_000, 1 << 40, 5), (40_000, -100, 0)])
def test_compiled_delta_decode_matches_wire(monkeypatch, k, spread, offset):
    """The compiled delta decoder returns wire's indices: narrow, wide (up to 41-bit deltas, values
    spanning two words) and all-zero (width 0) blocks, and a last block cut short; ``offset``: the
    section starts mid-word in its payload, as a slice of a received blob may."""
    from hvd_gradcomp import wire
    g = gen(k)
    steps = torch.randint(1, abs(spread) + 1, (k,), generator=g)
    steps[k // 3: k // 3 + 200] = 1           # whole blocks of zero deltas
    if spread < 0:
        steps[-300:] = 1                      # ...at the end too: zero-width blocks start past the last word
    idx = torch.cumsum(steps, 0) - 1
    widths, data = wire.delta_index_bytes(idx)
    data = torch.cat([torch.zeros(offset, dtype=torch.uint8), data])[offset:]
    assert data.storage_offset() == offset
    monkeypatch.setenv("HVDGC_COMPILE", "1")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = kernels.decode_deltas(widths, data, k)
    assert not [w for w in caught if "torch.compile failed" in str(w.message)]
    assert torch.equal(got, idx) and torch.equal(got, wire.decode_delta_indices(widths, data, k))
    assert torch.equal(wire.decode_delta_indices(widths, data, k, unpack=wire.unpack_deltas), idx)  # eager words


@pytest.mark.parametrize("n, k", [(1, 1), (5, 5), (1000, 10), (300_000, 3000), (300_000, 30_000)])
def test_topk_values_are_flat_at_the_indices(n, k):
    flat = torch.randn(n, generator=gen(n))
    idx, vals = kernels.topk(flat, k)
    assert torch.equal(idx, kernels.topk_indices(flat, k)) and torch.equal(vals, flat[idx])
    vals.zero_()  # never a view of flat
    assert bool(flat[idx].ne(0).all())


@pytest.mark.parametrize("cls", [TopK, TopKQSGD])
@pytest.mark.parametrize("bad", [NAN, INF, -INF])
def test_nonfinite_gradient_found_in_the_marking_pass_changes_nothing(cls, bad):
    """compress_named checks finiteness in the pass that adds the residual (large tensors): a
    NaN/Inf still raises before the residual or the random stream moves."""
    n = 300_000
    a, b = cls(ratio=0.01, seed=3), cls(ratio=0.01, seed=3)
    g0 = torch.randn(n, generator=gen(8))
    a.compress_named("w", g0)
    b.compress_named("w", g0)
    before = a.residuals.residual("w").clone()
    bad_grad = torch.randn(n, generator=gen(9))
    bad_grad[12345] = bad
    with pytest.raises(FloatingPointError, match="NaN/Inf"):
        a.compress_named("w", bad_grad)
    assert torch.equal(a.residuals.residual("w"), before)
    g1 = torch.randn(n, generator=gen(10))
    assert torch.equal(a.compress_named("w", g1), b.compress_named("w", g1))  # same stream, same residual


def test_finite_values_whose_sum_overflows_are_sent():
    n = 300_000
    g = torch.zeros(n)
    g[:4] = 3e38  # the float32 sum is inf, every value is finite
    c = TopK(ratio=0.01)
    y = c.decode(c.compress_named("w", g))
    assert torch.equal(y[:4], g[:4])


@pytest.mark.parametrize("n", [5000, 300_000])
def test_a_scaled_residual_adds_as_the_residual_times_the_scale(n):
    """``scale`` (a residual at another learning rate) multiplies in the same pass: the same sums,
    candidates and velocities, bit for bit, as adding the materialised product (small and sampled sizes)."""
    k = n // 100
    g, res = torch.randn(n, generator=gen(11)), torch.randn(n, generator=gen(12)) * 0.1
    old = torch.randn(n, generator=gen(13))
    a, b = torch.empty(n), torch.empty(n)
    ma, mb = fk.add_marked(g, res, a, k, scale=0.37), fk.add_marked(g, res * 0.37, b, k)
    assert torch.equal(a, b) and (ma is None) == (mb is None)
    if ma is not None:
        assert torch.equal(ma.threshold, mb.threshold) and torch.equal(ma.mask, mb.mask)
    (ua, aa, ub, ab) = (torch.empty(n) for _ in range(4))
    ka = fk.momentum_marked(g, old, res, ua, aa, 0.9, 0.0, k, scale=2.5)
    kb = fk.momentum_marked(g, old, res * 2.5, ub, ab, 0.9, 0.0, k)
    assert torch.equal(ua, ub) and torch.equal(aa, ab) and (ka is None) == (kb is None)
    if ka is not None:
        assert torch.equal(ka.mask, kb.mask)
