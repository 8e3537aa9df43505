"""QSGD, TopK and TopK+QSGD: round trips, statistics of the quantiser, exact selection,
payload sizes, argument checking and Horovod's compress/decompress protocol.

Expected values are computed here from the definitions (bucket norms, levels, torch.topk,
the documented size formulas), not copied from the code's output.
"""
import math
import warnings
from fractions import Fraction
from itertools import pairwise

import pytest
import torch

from hvd_gradcomp import QSGD, SparsityWarmup, TopK, TopKQSGD
from hvd_gradcomp.codecs import kernels
from hvd_gradcomp.feedback import kernels as fk
from hvd_gradcomp.codecs.compressor import payload_size
from hvd_gradcomp.settings import MIN_SELECTED

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
COMPRESSORS = {
    "qsgd8": lambda seed=0: QSGD(bits=8, seed=seed),
    "qsgd3-b16": lambda seed=0: QSGD(bits=3, bucket_size=16, seed=seed),
    "topk": lambda seed=0: TopK(ratio=0.1, seed=seed),
    "topkqsgd": lambda seed=0: TopKQSGD(ratio=0.2, bits=4, bucket_size=8, seed=seed),
}


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def pad8(n: int) -> int:
    return -(-n // 8) * 8


def expected_k(ratio: float, n: int, min_k: int = MIN_SELECTED) -> int:
    """k = max(min_k, ceil(ratio * n)), at most n, with the ratio read as the decimal the user wrote."""
    return min(n, max(min_k, math.ceil(Fraction(str(ratio)) * n)))


def bucket_norms(x: torch.Tensor, bucket: int) -> torch.Tensor:
    """Per-element L2 norm of the element's bucket (float64)."""
    flat = x.reshape(-1).double()
    out = torch.empty_like(flat)
    for s in range(0, flat.numel(), bucket):
        out[s:s + bucket] = flat[s:s + bucket].norm()
    return out


def topk_set(x: torch.Tensor, k: int) -> set:
    return set(torch.topk(x.reshape(-1).float().abs(), k).indices.tolist())


def delta_index_bytes(idx) -> int:
    """Documented delta coding size: 64 deltas per block, one width byte per block."""
    deltas = [idx[0]] + [b - a - 1 for a, b in pairwise(idx)]
    blocks = [deltas[i:i + 64] for i in range(0, len(deltas), 64)]
    return pad8(len(blocks)) + pad8(sum(int(max(b)).bit_length() * 8 for b in blocks))


def distinct_values(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """n values with distinct magnitudes, exactly representable in dtype, random signs and order."""
    g = gen(seed)
    mags = torch.randperm(n, generator=g).double() + 1
    if dtype == torch.bfloat16:
        assert n <= 256  # bfloat16 holds the integers 1..256 exactly
    sign = torch.randint(0, 2, (n,), generator=g).double() * 2 - 1
    return (mags * sign / 8).to(dtype)


# ------------------------------------------------------------------ construction
BAD_ARGS = [
    (QSGD, {"bits": 1}, "bits", ["2", "8"]), (QSGD, {"bits": 9}, "bits", ["2", "8"]),
    (QSGD, {"bits": 0}, "bits", ["2", "8"]), (QSGD, {"bits": 8.0}, "bits", ["2", "8"]),
    (QSGD, {"bits": "8"}, "bits", ["2", "8"]), (QSGD, {"bits": True}, "bits", ["2", "8"]),
    (QSGD, {"bits": None}, "bits", ["2", "8"]),
    (QSGD, {"bucket_size": 0}, "bucket_size", ["1"]), (QSGD, {"bucket_size": -3}, "bucket_size", ["1"]),
    (QSGD, {"bucket_size": 2.5}, "bucket_size", ["1"]), (QSGD, {"bucket_size": "512"}, "bucket_size", ["1"]),
    (TopK, {"ratio": 0}, "ratio", ["(0, 1]"]), (TopK, {"ratio": 1.5}, "ratio", ["(0, 1]"]),
    (TopK, {"ratio": -0.1}, "ratio", ["(0, 1]"]), (TopK, {"ratio": float("nan")}, "ratio", ["(0, 1]"]),
    (TopK, {"ratio": float("inf")}, "ratio", ["(0, 1]"]), (TopK, {"ratio": "0.1"}, "ratio", ["(0, 1]"]),
    (TopK, {"ratio": None}, "ratio", ["(0, 1]"]), (TopK, {"ratio": True}, "ratio", ["(0, 1]"]),
    (TopKQSGD, {"ratio": 0.0}, "ratio", ["(0, 1]"]), (TopKQSGD, {"bits": 10}, "bits", ["2", "8"]),
    (TopKQSGD, {"bucket_size": 0}, "bucket_size", ["1"]),
    (QSGD, {"error_feedback": 1}, "error_feedback", ["True", "False"]),
    (TopK, {"error_feedback": "yes"}, "error_feedback", ["True", "False"]),
    (QSGD, {"seed": 1.5}, "seed", ["int"]), (TopKQSGD, {"seed": "7"}, "seed", ["int"]),
]


@pytest.mark.parametrize("cls, kwargs, arg, range_parts", BAD_ARGS,
                         ids=[f"{c.__name__}-{k}" for c, k, _, _ in BAD_ARGS])
def test_invalid_arguments_raise_value_error(cls, kwargs, arg, range_parts):
    with pytest.raises(ValueError) as err:
        cls(**kwargs)
    msg = str(err.value)
    assert arg in msg
    for part in range_parts:
        assert part in msg


@pytest.mark.parametrize("cls, kwargs", [(QSGD, {"bits": 2}), (QSGD, {"bits": 8, "bucket_size": 1}),
                                         (TopK, {"ratio": 1}), (TopK, {"ratio": 1e-6}),
                                         (TopKQSGD, {"ratio": 1.0, "bits": 2})])
def test_boundary_arguments_are_accepted(cls, kwargs):
    c = cls(**kwargs)
    assert {k: getattr(c, k) for k in kwargs} == kwargs
    x = torch.randn(600, generator=gen(0))
    y = c.decode(c.encode(x))                      # the boundary value also works, not only constructs
    assert y.shape == x.shape and torch.isfinite(y).all() and (y != 0).any()


def test_reprs_match_docstrings():
    assert repr(QSGD(bits=4)) == "QSGD(bits=4, bucket_size=512, error_feedback=True)"
    assert repr(TopK(ratio=0.01)) == "TopK(ratio=0.01, error_feedback=True)"
    assert repr(TopKQSGD()) == "TopKQSGD(ratio=0.01, bits=8, bucket_size=512, error_feedback=True)"


# ------------------------------------------------------------------ round trips
SHAPES = [(), (1,), (17,), (5, 300), (2, 3, 4, 5)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("name", list(COMPRESSORS))
def test_round_trip_shape_dtype_and_error_bound(name, shape, dtype):
    c = COMPRESSORS[name]()
    x = torch.randn(shape, generator=gen(1)).to(dtype)
    y = c.decode(c.encode(x))
    assert y.shape == x.shape and y.dtype == dtype
    xd, yd = x.double().reshape(-1), y.double().reshape(-1)
    assert torch.isfinite(yd).all()
    eps = torch.finfo(dtype).eps
    if isinstance(c, TopK):
        k = expected_k(c.ratio, xd.numel())
        keep = sorted(topk_set(x, k))
        assert (yd != 0).sum() <= k
        rest = torch.ones_like(xd, dtype=torch.bool)
        rest[keep] = False
        assert torch.all(yd[rest] == 0)
        if type(c) is TopK:
            assert torch.equal(yd[keep], xd[keep])
        else:  # QSGD on the kept values, bucketed in index order
            kept = xd[keep]
            err = (yd[keep] - kept).abs()
            step = bucket_norms(kept, c.bucket_size) / (2 ** (c.bits - 1) - 1)
            assert torch.all(err <= step * (1 + 1e-5) + eps * (kept.abs() + step))
    else:
        err = (yd - xd).abs()
        step = bucket_norms(xd, c.bucket_size) / (2 ** (c.bits - 1) - 1)
        assert torch.all(err <= step * (1 + 1e-5) + eps * (xd.abs() + step))
        assert torch.all(yd * xd >= 0)  # never flips a sign


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(COMPRESSORS))
def test_non_contiguous_inputs_encode_like_their_contiguous_copy(name, dtype):
    base = torch.randn(6, 40, generator=gen(2)).to(dtype)
    views = [base.t(), base[:, ::3], base[1:5, 2:30:2].t(), base[:1].expand(5, 40)]
    for v in views:
        assert not v.is_contiguous()
        a, b = COMPRESSORS[name](seed=11), COMPRESSORS[name](seed=11)
        pa, pb = a.encode(v), b.encode(v.contiguous())
        assert torch.equal(pa, pb)
        assert a.decode(pa).shape == v.shape


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(COMPRESSORS))
def test_all_zero_tensor(name, dtype):
    c = COMPRESSORS[name]()
    for shape in [(), (7,), (3, 513)]:
        x = torch.zeros(shape, dtype=dtype)
        for _ in range(2):
            y = c.decode(c.compress_named(f"z{len(shape)}", x))
            assert torch.equal(y, x)
        r = c.residuals.residual(f"z{len(shape)}")
        assert torch.equal(r, torch.zeros_like(r))


def test_qsgd_encode_docstring_example():
    norms, codes = kernels.qsgd_encode(torch.tensor([3.0, -4.0]), bits=8, bucket_size=2, seed=0)
    assert norms.tolist() == [5.0] and codes.shape == (2,)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 8])
def test_qsgd_decodes_to_adjacent_levels_of_the_bucket_norm(bits):
    """One draw: every value is sign(x) * l * norm / s with l one of the two levels around |x|*s/norm."""
    s = 2 ** (bits - 1) - 1
    x = torch.randn(1037, generator=gen(bits)) * torch.linspace(0.1, 10, 1037)  # short last bucket
    c = QSGD(bits=bits, bucket_size=100, error_feedback=False, seed=3)
    y = c.decode(c.encode(x)).double()
    norm = bucket_norms(x, 100)
    scaled = x.double().abs() * s / norm
    level = y.abs() * s / norm
    assert torch.allclose(level, level.round(), atol=1e-4)
    lo = scaled.floor()
    assert torch.all((level.round() == lo) | (level.round() == lo + 1))
    assert torch.all(level.round() <= s)
    assert torch.all((y == 0) | (y.sign() == x.sign()))


# ------------------------------------------------------------------ QSGD statistics
DRAWS = 2000


def _draws(x: torch.Tensor, bits: int, bucket: int, copies: int = 100) -> torch.Tensor:
    """DRAWS independent quantisations of x: ``copies`` bucket-aligned copies of x per call
    (the noise differs per element position), over DRAWS / copies calls (it differs per call).
    A short last bucket is padded with zeros, which leaves its norm unchanged."""
    n = x.numel()
    padded = -(-n // bucket) * bucket
    row = torch.cat([x.reshape(-1), x.new_zeros(padded - n)])
    c = QSGD(bits=bits, bucket_size=bucket, error_feedback=False, seed=2017)
    out = [c.decode(c.encode(row.repeat(copies))).double().view(copies, padded)[:, :n]
           for _ in range(DRAWS // copies)]
    return torch.cat(out)


@pytest.mark.parametrize("bits, dtype", [(b, d) for b in (2, 4, 8) for d in DTYPES] + [(3, torch.float32)])
def test_qsgd_is_unbiased(bits, dtype):
    """|mean - x| <= 5 sigma / sqrt(N), sigma = norm/s * sqrt(p(1-p)) the rounding's std.

    Two small additive terms: one level step / N (a Bernoulli with p*N << 1 is not yet
    normal: a single up-rounding moves the mean by step/N), and the rounding of the decoded
    value to a 16-bit dtype (at most eps * (|x| + step)).
    """
    s = 2 ** (bits - 1) - 1
    bucket = 64
    x = (torch.randn(150, generator=gen(bits)) * 3).to(dtype)  # buckets of 64, 64 and 22 values
    mean = _draws(x, bits, bucket).mean(0)
    xd = x.double()
    step = bucket_norms(x, bucket) / s
    scaled = xd.abs() / step
    p = scaled - scaled.floor()
    sigma = step * torch.sqrt(p * (1 - p))
    eps = torch.finfo(dtype).eps if dtype != torch.float32 else 1e-6
    bound = 5 * sigma / math.sqrt(DRAWS) + step / DRAWS + eps * (xd.abs() + step)
    dev = (mean - xd).abs()
    assert torch.all(dev <= bound), f"worst element: dev {dev.max():.3g}, ratio {(dev / bound).max():.3g}"


@pytest.mark.parametrize("bits, kind", [(b, k) for b in (2, 4, 8) for k in ("gaussian", "equal", "one-hot-ish")]
                         + [(3, "gaussian")])
def test_qsgd_variance_matches_rounding_and_lemma_3_1(bits, kind):
    """E||Q(v)-v||^2 per bucket equals sum (norm/s)^2 p(1-p) and is <= min(d/s^2, sqrt(d)/s) ||v||^2."""
    s = 2 ** (bits - 1) - 1
    d = 64
    g = gen(100 + bits)
    if kind == "gaussian":
        x = torch.randn(2 * d, generator=g)
    elif kind == "equal":  # near the worst case of the lemma for s = 1
        x = torch.full((2 * d,), 0.7) * torch.where(torch.rand(2 * d, generator=g) < 0.5, -1.0, 1.0)
    else:
        x = torch.randn(2 * d, generator=g) * 1e-2
        x[[3, 70]] = torch.tensor([5.0, -4.0])
    draws = _draws(x, bits, d)
    xd = x.double()
    err2 = ((draws - xd) ** 2).view(DRAWS, 2, d).sum(-1).mean(0)  # per bucket
    step = bucket_norms(x, d) / s
    scaled = xd.abs() / step
    p = scaled - scaled.floor()
    exact = (step ** 2 * p * (1 - p)).view(2, d).sum(-1)
    assert torch.allclose(err2, exact, rtol=0.1, atol=1e-12)
    vnorm2 = (xd.view(2, d) ** 2).sum(-1)
    lemma = min(d / s ** 2, math.sqrt(d) / s) * vnorm2
    assert torch.all(err2 <= lemma)


# ------------------------------------------------------------------ seeds
@pytest.mark.parametrize("make", [lambda seed: QSGD(bits=4, seed=seed),
                                  lambda seed: TopKQSGD(ratio=0.1, bits=3, seed=seed)])
def test_stochastic_rounding_is_reproducible_from_the_seed(make):
    x = torch.randn(5000, generator=gen(4))
    a, b, other = make(123), make(123), make(124)
    pa = [a.encode(x, name="w") for _ in range(3)]
    pb = [b.encode(x, name="w") for _ in range(3)]
    for u, v in zip(pa, pb):
        assert torch.equal(u, v)
    assert not torch.equal(pa[0], pa[1])  # each call draws fresh noise
    assert not torch.equal(other.encode(x, name="w"), pa[0])
    rank1 = make(123)
    rank1.stream = 1  # another rank: independent noise
    assert not torch.equal(rank1.encode(x, name="w"), pa[0])
    # with error feedback too
    ea, eb = make(9), make(9)
    for _ in range(3):
        g = torch.randn(5000, generator=gen(_))
        assert torch.equal(ea.compress_named("w", g), eb.compress_named("w", g))


# ------------------------------------------------------------------ top-k selection
def _adversarial(n: int, kind: str, g: torch.Generator) -> torch.Tensor:
    if kind == "normal":
        return torch.randn(n, generator=g)
    if kind == "heavy":
        u = torch.rand(n, generator=g)
        return torch.tan(math.pi * (u - 0.5))  # Cauchy
    if kind == "ramp":
        return (torch.randperm(n, generator=g).float() + 1) * torch.where(torch.rand(n, generator=g) < .5, -1., 1.)
    x = ((torch.randperm(n, generator=g).double() + 1) / n).float()  # distinct, non-zero, also after += 10
    sl = fk.sample_slice(n, max(1, n // 100))  # where the threshold is sampled (ratio 0.01)
    sampled = torch.arange(n)[sl] if sl is not None else torch.arange(0)
    if kind == "large-at-sample":
        x[sampled] += 10
    else:  # "small-at-sample"
        x += 10
        x[sampled] -= 10
    return x


@pytest.mark.parametrize("n", [1, 10, 1000, 300_000])
@pytest.mark.parametrize("kind", ["normal", "heavy", "ramp", "large-at-sample", "small-at-sample"])
def test_topk_support_is_the_exact_top_k(n, kind):
    x = _adversarial(n, kind, gen(n))
    for ratio in (0.01, 0.2):
        k = expected_k(ratio, n)
        vals = x.abs().sort(descending=True).values
        assume_gap = k == n or vals[k - 1] > vals[k]
        assert assume_gap, "test input has a tie at the k-th value"
        y = TopK(ratio=ratio, error_feedback=False).decode(TopK(ratio=ratio).encode(x))
        support = set(y.nonzero().squeeze(1).tolist())
        assert support == topk_set(x, k)
        assert torch.equal(y[list(support)], x[list(support)])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_topk_exact_on_half_precision(dtype):
    """Half types repeat values: pick a k with a strict gap at the k-th magnitude."""
    n = 300_000
    x = torch.randn(n, generator=gen(5)).to(dtype)
    mags = x.double().abs().sort(descending=True).values
    k = next(k for k in range(3000, n) if mags[k - 1] > mags[k])
    c = TopK(ratio=k / n)
    assert kernels.num_selected(c.ratio, n) == k
    y = c.decode(c.encode(x))
    support = y.nonzero().squeeze(1)
    assert set(support.tolist()) == set((x.double().abs() >= mags[k - 1]).nonzero().squeeze(1).tolist())
    assert torch.equal(y[support], x[support])


@pytest.mark.parametrize("ratio, n", [(0.01, 1), (0.01, 99), (0.01, 100), (0.01, 101), (0.07, 100),
                                      (0.29, 100), (0.57, 100), (0.3, 10), (1.0, 17), (1e-9, 10),
                                      (0.001, 10 ** 6 + 1), (0.07, 3 * 10 ** 9), (0.07, 10 ** 10)])
def test_k_is_ceil_of_ratio_times_n(ratio, n):
    assert kernels.num_selected(ratio, n) == max(1, expected_k(ratio, n, min_k=1))
    if n <= 10 ** 6 + 1:
        x = torch.randn(n, generator=gen(6)) + 0.5  # no zeros: the support counts the kept entries
        x[x == 0] = 1.0
        y = TopK(ratio=ratio).decode(TopK(ratio=ratio).encode(x))
        assert int((y != 0).sum()) == expected_k(ratio, n)


@pytest.mark.parametrize("make", [lambda **kw: TopK(ratio=0.001, **kw), lambda **kw: TopKQSGD(ratio=0.001, **kw)])
def test_a_compressed_tensor_sends_at_least_min_k_values(make):
    """At ratio 0.001 a 4096-element tensor would send 5 values: the floor sends 32 (min_k), the
    exact top 32; a tensor of at most min_k elements goes whole; a large one is not affected."""
    for n, want in ((4096, 32), (20, 20), (100_000, 100)):
        x = distinct_values(n, torch.float32, seed=n)
        y = make(error_feedback=False).decode(make().encode(x))
        assert set(y.nonzero().squeeze(1).tolist()) <= topk_set(x, want)
        assert int((y != 0).sum()) >= want - 1  # TopKQSGD may round one value to zero
    assert make(min_k=1).selected(4096) == 5 and make().selected(4096) == MIN_SELECTED == 32
    assert "min_k=8" in repr(make(min_k=8)) and "min_k" not in repr(make())
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="min_k must be an int >= 1"):
            make(min_k=bad)
        c = make()
        with pytest.raises(ValueError, match="min_k must be an int >= 1"):
            c.min_k = bad  # checked on assignment too, and left as it was
        assert c.min_k == MIN_SELECTED


@pytest.mark.parametrize("make", [lambda **kw: TopK(ratio=0.001, **kw), lambda **kw: TopKQSGD(ratio=0.001, **kw)])
@pytest.mark.parametrize("feedback", ["classic", "momentum"])
def test_min_ratio_raises_the_share_of_the_tensors_it_names(make, feedback):
    """``min_ratio={pattern: share}``: a tensor whose name matches sends at least that share (the
    largest matching floor), the exact top values, through error feedback and momentum correction
    (whose top-k candidates are marked ahead); the others keep ``ratio``; a sparsity warm-up above
    the floor still rules while it lasts."""
    from hvd_gradcomp import MomentumCorrection
    policy = MomentumCorrection(momentum=0.9, sparsity_warmup=0) if feedback == "momentum" else feedback
    c = make(feedback=policy, min_ratio={r"^out\.": 0.01, r"out\.weight$": 0.02, "never": 0.5})
    n = 50_000
    for name, want in (("out.weight", 1000), ("out.bias", 500), ("fc1.weight", 50), ("head.out.weight", 1000)):
        x = distinct_values(n, torch.float32, seed=len(name))
        payload = c.compress_named(name, x)
        idx, vals = c.decode_parts(payload)
        assert idx.numel() == want, name
        assert set(idx.tolist()) == topk_set(x, want), name  # first step: the residual is zero
    warm = type(make())(ratio=SparsityWarmup(0.001, steps=10), min_ratio={"^out": 0.01})
    assert warm.share("out.weight", 0) == 0.25 and warm.share("out.weight", 9) == 0.01
    assert warm.share("fc.weight", 10) == 0.001 and warm.share("out.weight", 10) == 0.01
    assert "min_ratio={'^out': 0.01}" in repr(warm) and "min_ratio" not in repr(make())
    c.min_ratio = None
    assert c.share("out.weight") == 0.001 and c.min_ratio == {}
    for bad, says in (({"(": 0.1}, "regular expressions"), ({"x": 0}, r"min_ratio\['x'\] must be in \(0, 1\]"),
                      ({"x": 1.5}, "must be in"), ({"x": True}, "must be in"), ([0.01], "must be a dict")):
        with pytest.raises(ValueError, match=says):
            make(min_ratio=bad)
        c = make(min_ratio={"^out": 0.01})
        with pytest.raises(ValueError, match=says):
            c.min_ratio = bad  # checked on assignment too, and left as it was
        assert c.min_ratio == {"^out": 0.01}


def test_topkqsgd_keeps_the_exact_top_k_and_quantises_them():
    x = torch.randn(20_000, generator=gen(7))
    c = TopKQSGD(ratio=0.01, bits=8, bucket_size=512, error_feedback=False, seed=1)
    y = c.decode(c.encode(x)).double()
    keep = sorted(topk_set(x, 200))
    assert set(y.nonzero().squeeze(1).tolist()) <= set(keep)
    kept = x.double()[keep]
    step = kept.norm() / 127  # 200 kept values: one bucket
    assert torch.all((y[keep] - kept).abs() <= step * (1 + 1e-6))
    assert torch.all(y[keep] * kept >= 0)


# ------------------------------------------------------------------ sizes
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(), (1,), (513,), (1000,), (3, 5, 7), (2, 3, 4, 5)], ids=str)
@pytest.mark.parametrize("bits, bucket", [(8, 512), (4, 512), (2, 512), (3, 7), (5, 1), (7, 100)])
def test_qsgd_payload_size_is_the_documented_formula(bits, bucket, shape, dtype):
    """40 + 8*ndim + pad8(4 * ceil(n / bucket_size)) + pad8(ceil(n * bits / 8))."""
    c = QSGD(bits=bits, bucket_size=bucket, seed=0)
    n = math.prod(shape)
    want = 40 + 8 * len(shape) + pad8(4 * -(-n // bucket)) + pad8(-(-n * bits // 8))
    assert c.encode(torch.randn(shape).to(dtype)).numel() == want
    assert payload_size(c, shape, dtype) == want


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ratio", [0.01, 0.1, 0.5, 1.0])
@pytest.mark.parametrize("make", [lambda r: TopK(ratio=r), lambda r: TopKQSGD(ratio=r, bits=5, bucket_size=16, seed=0)])
def test_sparse_payload_size_is_header_plus_indices_plus_values(make, ratio, dtype):
    c = make(ratio)
    shape = (10, 20) if dtype == torch.bfloat16 else (40, 50)
    n = math.prod(shape)
    x = distinct_values(n, dtype, seed=8).view(shape)
    k = expected_k(ratio, n)
    idx = sorted(topk_set(x, k))
    index_bytes = min(delta_index_bytes(idx), pad8(-(-n // 8)))
    if isinstance(c, TopKQSGD):
        values = pad8(4 * -(-k // c.bucket_size)) + pad8(-(-k * c.bits // 8))
    else:
        values = pad8(k * dtype.itemsize)
    want = 40 + 8 * len(shape) + index_bytes + values
    assert c.encode(x).numel() == want
    assert payload_size(c, shape, dtype, index_bytes=index_bytes) == want
    with pytest.raises(ValueError, match="index_bytes"):
        payload_size(c, shape, dtype)


@pytest.mark.parametrize("ratio", [0.001, 0.01, 0.1, 0.5, 1.0])
def test_indices_cost_less_than_int32(ratio):
    n = 100_000
    x = torch.randn(n, generator=gen(9))
    k = expected_k(ratio, n)
    p = TopK(ratio=ratio).encode(x)
    index_bytes = p.numel() - 48 - pad8(4 * k)
    assert 0 < index_bytes < 4 * k


def test_size_targets_on_one_million_values():
    n = 1 << 20
    x = torch.randn(n, generator=gen(10))
    fp32 = 4 * n
    assert TopKQSGD(ratio=0.01, bits=8, seed=0).encode(x).numel() <= fp32 / 150
    for bits, factor in [(8, 3.9), (4, 7.8), (2, 15)]:
        c = QSGD(bits=bits, seed=0)
        assert c.encode(x).numel() <= fp32 / factor
        assert payload_size(c, (n,)) <= fp32 / factor


# ------------------------------------------------------------------ stats
@pytest.mark.parametrize("name", list(COMPRESSORS))
def test_direct_calls_leave_the_byte_ledger_to_the_roads(name):
    """``compressor.stats`` is the one ledger every road counts into as it hands bytes to a collective
    (hvd_gradcomp.stats): a payload made outside any road is sent by no one, so it is not counted
    (before, the codec counted it too and the roads' counters disagreed with it)."""
    c = COMPRESSORS[name]()
    for i, (tname, shape, dtype) in enumerate([("a", (100,), torch.float32), ("b", (7, 3), torch.bfloat16)]):
        c.compress_named(tname, torch.randn(shape, generator=gen(i)).to(dtype))
    assert (c.stats.bytes_in, c.stats.bytes_out, c.stats.calls, c.stats.per_tensor) == (0, 0, 0, {})


def test_the_ledger_keeps_steps_payload_and_framing_apart():
    from hvd_gradcomp.stats import ByteStats, Bytes

    s = ByteStats()
    s.record("w", 4000, 100, 16)
    s.record("(flags)", 0, 0, 8)
    assert s.recorded_in_step("w") and not s.recorded_in_step("b")
    s.end_step()
    s.record("w", 4000, 90, 16, step=1)
    s.record("w", 4000, 80, 16, step=2)   # a callback of the next step, before this one closed
    s.end_step()
    assert s.last_step == Bytes(4000, 90, 16) and s.at(2) == Bytes(4000, 80, 16)
    assert (s.bytes_in, s.payload_bytes, s.framing_bytes, s.bytes_out) == (12000, 270, 56, 326)
    assert s.per_tensor["w"] == [12000, 318, 48] and s.per_tensor["(flags)"] == [0, 8, 8]
    assert s.report()["last_step"] == {"raw": 4000, "payload": 90, "framing": 16, "sent": 106}


# ------------------------------------------------------------------ bad inputs
@pytest.mark.parametrize("tensor", [torch.arange(10), torch.arange(10, dtype=torch.int8),
                                    torch.ones(3, 4, dtype=torch.uint8), torch.tensor([True, False]),
                                    torch.zeros(0), torch.zeros(2, 0, 3), torch.zeros(0, dtype=torch.bfloat16)],
                         ids=["int64", "int8", "uint8", "bool", "empty", "empty-3d", "empty-bf16"])
@pytest.mark.parametrize("name", list(COMPRESSORS))
def test_integer_and_empty_tensors_pass_through_compress(name, tensor):
    c = COMPRESSORS[name]()
    for kwargs in ({"name": "w"}, {}):
        out, ctx = c.compress(tensor, **kwargs)
        assert out is tensor
        assert c.decompress(out, ctx) is tensor
    assert c.residuals.residual("w") is None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(COMPRESSORS))
def test_compress_decompress_protocol(name, dtype):
    c = COMPRESSORS[name]()
    x = torch.randn(4, 9).to(dtype)
    out, ctx = c.compress(x, name="fc.weight")
    assert out.dtype == torch.uint8 and out.dim() == 1
    y = c.decompress(out, ctx)
    assert y.shape == x.shape and y.dtype == dtype
    with pytest.raises(ValueError, match="name="):
        c.compress(x)  # error feedback on and no name: the residual has no key


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(COMPRESSORS))
def test_non_finite_gradient_raises_and_keeps_residual(name, dtype, bad):
    c = COMPRESSORS[name]()
    tname = "encoder.layer3.weight"
    c.compress_named(tname, torch.randn(60, generator=gen(1)).to(dtype))
    before = c.residuals.residual(tname).clone()
    g = torch.randn(60, generator=gen(2)).to(dtype)
    g[17] = bad
    for call in (lambda: c.compress_named(tname, g), lambda: c.compress(g, name=tname),
                 lambda: c.compress_chunks(tname, g, [0, 30, 60])):
        with pytest.raises(FloatingPointError, match=tname):
            call()
        assert torch.equal(c.residuals.residual(tname), before)


@pytest.mark.parametrize("name", list(COMPRESSORS))
def test_non_finite_gradient_raises_without_error_feedback(name):
    """compress() with error_feedback=False and no name must still refuse NaN/Inf."""
    c = COMPRESSORS[name]()
    c.error_feedback = False
    g = torch.randn(60)
    g[3] = float("nan")
    with pytest.raises(FloatingPointError):
        c.compress(g)
    with pytest.raises(FloatingPointError):
        c.compress_named("w", g)


def test_large_finite_gradient_is_not_reported_as_nan():
    """Finite values near float32's maximum are valid gradients (their sum overflows, they don't)."""
    x = torch.tensor([3e38, -1.0, 3e38, 1.0])
    c = TopK(ratio=0.5, min_k=1)
    y = c.decode(c.compress_named("w", x))
    assert torch.equal(y, torch.tensor([3e38, 0.0, 3e38, 0.0]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 700, 100_000, pytest.param(1_500_000, marks=pytest.mark.slow)])
@pytest.mark.parametrize("make", [lambda: TopK(ratio=0.01), lambda: TopKQSGD(ratio=0.01, bits=8),
                                  lambda: TopKQSGD(ratio=0.05, bits=4, bucket_size=64),
                                  lambda: TopKQSGD(ratio=0.01, bits=2, feedback="momentum"),
                                  lambda: TopKQSGD(ratio=SparsityWarmup(0.01, steps=2), bits=8)],
                         ids=["topk", "topkqsgd8", "topkqsgd4", "topkqsgd2-momentum", "topkqsgd8-warmup"])
def test_what_a_payload_carries_is_what_it_decodes_to(make, n, dtype):
    """Issue 13: the fused exchange sums this rank's own part from compress_carried's (indices,
    values) instead of decoding its payload, while the other ranks decode the payload: any bit of
    difference would make the ranks' gradients drift apart. Over several steps (residuals, ratio
    schedule, contracting low-bit QSGD), sizes on both sides of the compiled kernels' threshold."""
    c = make()
    gen = torch.Generator().manual_seed(n)
    for step in range(3):
        g = (torch.randn(n, generator=gen) * 10 ** (step - 1)).to(dtype)
        payload, (idx, vals) = c.compress_carried("w", g)
        d_idx, d_vals = c.decode_parts(payload)
        mine, theirs = idx.argsort(), d_idx.argsort()
        assert idx.unique().numel() == idx.numel() > 0
        assert torch.equal(idx[mine], d_idx[theirs]), step
        assert vals.dtype == d_vals.dtype and torch.equal(vals[mine], d_vals[theirs]), step


def test_qsgd_carries_its_codes():
    """Dense QSGD's payload carries its codes, not (indices, values), so an exchange decodes its
    own payload; the codes still stand for exactly what the payload decodes to."""
    c = QSGD(bits=4)
    payload, carried = c.compress_carried("w", torch.randn(1000, generator=torch.Generator().manual_seed(0)))
    assert isinstance(carried, kernels.QSGDDecoded)
    minus = torch.zeros(1000)
    carried.subtract_from(minus)
    assert torch.equal(-minus, c.decode(payload))


def test_compress_named_needs_a_name():
    with pytest.raises(ValueError, match="name"):
        QSGD().compress_named("", torch.randn(3))


@pytest.mark.parametrize("bounds", [[0, 5], [1, 10], [0, 5, 5, 10], [0, 6, 4, 10], [0, 11]])
def test_compress_chunks_rejects_bad_bounds(bounds):
    with pytest.raises(ValueError, match="bounds"):
        QSGD().compress_chunks("w", torch.randn(10), bounds)


# ------------------------------------------------------------------ compiled kernels
@pytest.mark.slow
def test_compiled_kernels_match_eager(monkeypatch):
    """HVDGC_COMPILE=1 (torch.compile) and =0 (eager) give the same payload bytes on 2**20+ values."""
    n = (1 << 20) + 37  # a short last bucket too
    x = torch.randn(n, generator=gen(11))
    makers = [lambda: QSGD(bits=8, seed=5), lambda: QSGD(bits=3, bucket_size=1000, seed=5),
              lambda: TopKQSGD(ratio=0.01, bits=4, seed=5), lambda: TopK(ratio=0.001),
              lambda: TopKQSGD(ratio=0.05, bits=8, seed=5)]  # 52K kept values: compiled under "auto" too
    monkeypatch.setenv("HVDGC_COMPILE", "0")
    eager = [m().encode(x) for m in makers]
    monkeypatch.setenv("HVDGC_COMPILE", "1")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = [m().encode(x) for m in makers]
        decoded = [m().decode(p) for m, p in zip(makers, compiled)]
    # a fallback to eager kernels would make this test vacuous
    assert not [w for w in caught if "torch.compile failed" in str(w.message)]
    for e, c_, d, m in zip(eager, compiled, decoded, makers):
        assert torch.equal(e, c_), repr(m())
        monkeypatch.setenv("HVDGC_COMPILE", "0")
        assert torch.equal(d, m().decode(e))
        monkeypatch.setenv("HVDGC_COMPILE", "1")
