"""PowerSGD's math in one process (the rounds' averages are this rank's own factors), and its
checkpoints; the 2-rank roads are in tests/test_powersgd_ranks.py."""
from __future__ import annotations

import copy

import pytest
import torch

import hvd_gradcomp as gc
from hvd_gradcomp import codecs
from hvd_gradcomp.codecs.powersgd import PowerSGD, orthogonalize


def one_rank(c: PowerSGD, name: str, grad: torch.Tensor) -> torch.Tensor:
    """The result of both rounds when this rank is the only one."""
    work = c.first_round(name, grad)
    q = c.second_round(work, work.send.clone())
    out = torch.empty_like(grad)
    c.finish_rounds(work, q, out)
    return out


@pytest.mark.parametrize("rank", [1, 2, 4])
def test_a_rank_one_matrix_is_recovered_exactly(rank: int) -> None:
    g = torch.Generator().manual_seed(0)
    m = torch.outer(torch.randn(96, generator=g), torch.randn(40, generator=g))
    c = PowerSGD(rank=rank, seed=3)
    out = one_rank(c, "w", m)
    torch.testing.assert_close(out, m, rtol=1e-5, atol=1e-5)
    assert float(c.residuals.residual("w").abs().max()) < 1e-5


def test_the_residual_is_the_gradient_plus_residual_minus_the_approximation() -> None:
    g = torch.Generator().manual_seed(1)
    c = PowerSGD(rank=2, seed=0)
    grads = [torch.randn(64, 48, generator=g) for _ in range(4)]
    residual = torch.zeros(64 * 48)
    for grad in grads:
        out = one_rank(c, "w", grad)
        expected = grad.reshape(-1) + residual - out.reshape(-1)
        torch.testing.assert_close(c.residuals.residual("w"), expected, rtol=0, atol=1e-6)
        residual = c.residuals.residual("w").clone()


def test_without_error_feedback_nothing_is_kept_and_the_gradient_is_untouched() -> None:
    grad = torch.randn(64, 48)
    before = grad.clone()
    c = PowerSGD(rank=2, error_feedback=False)
    one_rank(c, "w", grad)
    assert torch.equal(grad, before) and c.residuals.residual("w") is None


def test_warm_start_converges_over_steps_to_the_best_rank_r_approximation() -> None:
    g = torch.Generator().manual_seed(2)
    u, _ = torch.linalg.qr(torch.randn(80, 80, generator=g))
    v, _ = torch.linalg.qr(torch.randn(60, 60, generator=g))
    s = torch.tensor([10.0, 5.0, 1.0] + [0.1] * 57)
    m = u[:, :60] @ torch.diag(s) @ v.T
    best = u[:, :2] @ torch.diag(s[:2]) @ v[:, :2].T
    warm, cold = PowerSGD(rank=2, error_feedback=False), PowerSGD(rank=2, error_feedback=False, warm_start=False)
    errs = {}
    for label, c in (("warm", warm), ("cold", cold)):
        for _ in range(6):
            out = one_rank(c, "w", m)
        errs[label] = float((out - best).norm() / best.norm())
    assert errs["warm"] < 1e-3 < errs["cold"], errs


class _Bucket:
    """The part of DDP's GradBucket that torch's hook reads (GradBucket has no public constructor)."""

    def __init__(self, grad: torch.Tensor) -> None:
        self.grad, self.flat = grad, grad.reshape(-1).clone()

    def buffer(self) -> torch.Tensor:
        return self.flat

    def index(self) -> int:
        return 0

    def is_last(self) -> bool:
        return True

    def gradients(self):
        return [self.flat.view_as(self.grad)]

    def parameters(self):
        return [self.grad]


def test_similar_error_to_torchs_powersgd_on_one_matrix() -> None:
    """torch's hook, run on one process (a 1-rank gloo group), against this codec: same matrix, same
    rank, warm start, error feedback: both errors close after a few steps."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)   # in-process: no port
    try:
        g = torch.Generator().manual_seed(4)
        grads = [torch.randn(128, 64, generator=g) + torch.outer(torch.arange(128.0), torch.ones(64)) / 64
                 for _ in range(5)]
        state = ps.PowerSGDState(process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=2,
                                 min_compression_rate=1, warm_start=True)
        ours = PowerSGD(rank=4, min_compression_rate=1)
        theirs_err, ours_err = [], []
        state.iter = 2   # past its warm-up (which waits for DDP's bucket rebuild)
        for grad in grads + grads:
            theirs = ps.powerSGD_hook(state, _Bucket(grad)).wait()
            mine = one_rank(ours, "w", grad)
            theirs_err.append(float((theirs.view(128, 64) - grad).norm() / grad.norm()))
            ours_err.append(float((mine - grad).norm() / grad.norm()))
    finally:
        dist.destroy_process_group()
    assert abs(sum(ours_err) - sum(theirs_err)) < 0.2 * sum(theirs_err), (ours_err, theirs_err)


def test_vectors_and_matrices_that_would_not_shrink_go_as_they_are() -> None:
    c = PowerSGD(rank=4)
    assert c.factors((1024,)) is None and c.factors((16, 8)) is None and c.factors((3, 16, 4, 4)) is None
    assert c.factors((64, 3, 3, 3)) == (64, 27, 4)
    with pytest.raises(ValueError, match="not compressed"):
        c.first_round("b", torch.ones(1024))
    assert c.payload_size((1024,)) == 4096 and c.payload_size((64, 32)) == (64 + 32) * 4 * 4


def test_a_checkpoint_resumes_bit_identically() -> None:
    g = torch.Generator().manual_seed(5)
    grads = [torch.randn(64, 48, generator=g) for _ in range(6)]
    a = PowerSGD(rank=2)
    for grad in grads[:3]:
        one_rank(a, "w", grad)
    saved = copy.deepcopy(a.state_dict())
    rest_a = [one_rank(a, "w", grad) for grad in grads[3:]]
    b = PowerSGD(rank=2, seed=99)
    b.load_state_dict(saved)
    rest_b = [one_rank(b, "w", grad) for grad in grads[3:]]
    assert all(torch.equal(x, y) for x, y in zip(rest_a, rest_b))
    assert torch.equal(a.residuals.residual("w"), b.residuals.residual("w"))
    with pytest.raises(ValueError, match="rank=2"):
        PowerSGD(rank=3).load_state_dict(saved)


def test_a_non_finite_round_puts_back_q_and_the_residual() -> None:
    c = PowerSGD(rank=2)
    c._claim(torch.nn.Linear(1, 1), 1)   # rounds are undoable once an optimizer (any object) owns it
    grad = torch.randn(64, 48)
    one_rank(c, "w", grad)
    c.end_round(True)
    q, r = c._q["w"].clone(), c.residuals.residual("w").clone()
    bad = grad.clone()
    bad[0, 0] = float("nan")
    one_rank(c, "w", bad)
    with pytest.warns(RuntimeWarning, match="not finite"):
        c.end_round(False)
    assert torch.equal(c._q["w"], q) and torch.equal(c.residuals.residual("w"), r)


def test_orthogonalize_leaves_a_zero_column_zero() -> None:
    m = torch.zeros(5, 2)
    m[:, 0] = 1.0
    out = orthogonalize(m)
    assert torch.isfinite(out).all() and float(out[:, 1].abs().sum()) == 0.0


def test_exported_registered_and_refused_by_stock_horovod() -> None:
    c = gc.PowerSGD(rank=4, warm_start=True)
    assert type(c) is PowerSGD and codecs.name_of(c) == "powersgd"
    assert codecs.collective_of(c) == codecs.ALLREDUCE_ROUNDS
    assert isinstance(codecs.build("powersgd", ratio=0.5, bits=4, seed=1), PowerSGD)
    with pytest.raises(gc.HorovodIntegrationError, match="hvd_gradcomp.DistributedOptimizer"):
        c.compress(torch.ones(64, 48))
    with pytest.raises(TypeError, match="two dependent allreduces"):
        c.encode(torch.ones(64, 48))


@pytest.mark.parametrize("kwargs, words", [({"rank": 0}, "rank must be"), ({"warm_start": 1}, "warm_start"),
                                           ({"min_compression_rate": 0.5}, "min_compression_rate"),
                                           ({"feedback": "momentum"}, "classic error feedback")])
def test_bad_arguments_say_what_to_change(kwargs, words) -> None:
    with pytest.raises(ValueError, match=words):
        PowerSGD(**kwargs)
