"""PowerSGD (Vogels et al., 2019): low-rank gradient compression in two dependent allreduces.

Each matrix-shaped gradient ``M`` (a tensor seen as ``shape[0] x rest``, with this rank's
error-feedback residual added) travels as two thin float32 factors:

1. ``P = M Q`` (``n x r``), allreduced (averaged) and orthogonalised (Gram-Schmidt);
2. ``Q = M^T P`` (``m x r``), allreduced (averaged);

and every rank ends with the same rank-``r`` approximation ``P Q^T`` of the average. What the
approximation misses of this rank's ``M`` is its new residual (``M - P Q^T``, as
``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook``). With ``warm_start`` the
averaged ``Q`` of a step starts the next one (one power iteration per step, converging over
steps); without it, ``Q`` is drawn afresh each step. ``Q``'s first draw comes from
``(seed, tensor name)`` alone, so every rank draws the same one.

Bytes per matrix per step: ``(n + m) * r * 4`` sent into the allreduces instead of ``n * m * 4``.
1-d tensors, and matrices where the factors would save less than ``min_compression_rate``
times, are averaged as they are.

The codec here only computes; the rounds travel on ``hvd_gradcomp.DistributedOptimizer``
(:class:`hvd_gradcomp.collectives.exchange.RoundsExchange`, Horovod allreduces) and the DDP hook
(``hvd_gradcomp.ddp``, ``torch.distributed.all_reduce``). Stock ``hvd.DistributedOptimizer``
allreduces what ``compress()`` returns once, so it cannot carry two dependent rounds: the
Horovod adapter says so at the first step (:func:`hvd_gradcomp.horovod.stock.refuse_rounds`).

Example::

    >>> c = PowerSGD(rank=1, seed=0)
    >>> m = torch.outer(torch.arange(1.0, 65.0), torch.linspace(-1, 1, 32))   # rank 1
    >>> work = c.first_round("w", m)
    >>> q = c.second_round(work, work.send)        # one rank: the average is its own factor
    >>> out = torch.empty_like(m)
    >>> c.finish_rounds(work, q, out)
    >>> bool(torch.allclose(out, m, atol=1e-4))
    True
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple, Union

import torch

from .. import codecs
from .compressor import GradientCompressor, PartAttribute
from ..feedback import Feedback

_TINY = torch.finfo(torch.float32).tiny


@dataclass
class RoundsWork:
    """One tensor between its rounds: ``send`` is what the next allreduce averages."""

    name: str
    acc: torch.Tensor        # this rank's M, flat (gradient + residual), float32 or the gradient's dtype
    matrix: torch.Tensor     # acc viewed n x m, float32
    p: Optional[torch.Tensor]
    send: torch.Tensor


def orthogonalize(matrix: torch.Tensor) -> torch.Tensor:
    """Gram-Schmidt on the columns of ``matrix`` (n x r), in place; returns it. Each column is
    projected off the ones before it twice ("twice is enough", Giraud et al. 2005): once, a
    column that is nearly dependent on them (a gradient of lower rank than ``r``) kept a
    rounding residue whose normalised direction still leaned on them, and the approximation
    counted that part twice. A column that is all zero (a layer without gradient) stays zero
    instead of becoming NaN.

    >>> q = orthogonalize(torch.tensor([[3.0, 1.0], [4.0, 1.0]]))
    >>> bool(torch.allclose(q.T @ q, torch.eye(2), atol=1e-6))
    True
    """
    for i in range(matrix.shape[1]):
        col = matrix[:, i:i + 1]
        if i:
            done = matrix[:, :i]
            for _ in range(2):
                col.sub_(done @ (done.T @ col))
        col.div_(col.norm().clamp_min(_TINY))
    return matrix


class Factors:
    """PowerSGD's ``Q`` per tensor name, the start of its next step (warm start), a part of
    :class:`PowerSGD`: once rounds are tracked, the ``Q`` a round replaced is kept until it ends, and put
    back when it is undone (a non-finite step: its ``Q`` is NaN on every rank).

    >>> f = Factors(); f.track_rounds(True)
    >>> f.keep("w", torch.ones(2, 1)); f.end_round(True); f.keep("w", torch.zeros(2, 1)); f.end_round(False)
    >>> f.q["w"].tolist()
    [[1.0], [1.0]]
    """

    def __init__(self) -> None:
        self.q: Dict[str, torch.Tensor] = {}
        self.undo: Dict[str, Optional[torch.Tensor]] = {}   # Q of the round's start
        self.tracking = False

    def keep(self, name: str, q: torch.Tensor) -> None:
        if self.tracking and name not in self.undo:
            self.undo[name] = self.q.get(name)
        self.q[name] = q.clone()

    def track_rounds(self, on: bool) -> None:
        self.tracking = on

    def end_round(self, ok: bool) -> None:
        if not ok:
            for name, q in self.undo.items():
                if q is None:
                    self.q.pop(name, None)
                else:
                    self.q[name] = q
        self.undo = {}

    def state(self) -> Dict[str, torch.Tensor]:
        return {n: q.detach().clone() for n, q in self.q.items()}

    def load(self, q: Dict[str, torch.Tensor]) -> None:
        self.q = {str(n): t.detach().clone() for n, t in q.items()}
        self.undo = {}


class PowerSGD(GradientCompressor):
    """Low-rank compression: each matrix as rank-``rank`` factors, in two allreduces (see the module).

    Args:
        rank: columns of the factors (PowerSGD's ``matrix_approximation_rank``): more is closer
            to the average and sends more, ``(n + m) * rank * 4`` bytes per ``n x m`` matrix.
        warm_start: start each step's power iteration from the last step's ``Q`` (True, as
            torch's hook), or from a fresh random ``Q`` (False).
        min_compression_rate: a matrix is compressed only when ``n * m`` is at least this many
            times ``(n + m) * rank``; below, it is averaged as it is (so are 1-d tensors).
        error_feedback: keep what the approximation missed and add it to the next step (True).
        seed: seed of the first ``Q``; the same on every rank (default 0, as torch's hook; None is 0 too).
        exclude, exempt, clip: as for every compressor (:class:`~hvd_gradcomp.codecs.compressor.GradientCompressor`).

    Example::

        opt = gc.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                      compression=gc.PowerSGD(rank=4))
        state = gc_ddp.register(ddp_model, compression=gc.PowerSGD(rank=4))     # or in DDP
    """

    codec_name = "powersgd"
    collective = codecs.ALLREDUCE_ROUNDS
    _q = PartAttribute("_factors", "q", readonly=True)

    def __init__(self, rank: int = 4, warm_start: bool = True, min_compression_rate: float = 2.0,
                 error_feedback: bool = True, seed: Optional[int] = 0, clip: Optional[float] = None,
                 exclude: Optional[str] = None, exempt: str = "fp16",
                 feedback: Union[str, Feedback] = "auto") -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"rank must be an int >= 1 (columns of the low-rank factors), got {rank!r}")
        if not isinstance(warm_start, bool):
            raise ValueError(f"warm_start must be True or False, got {warm_start!r}")
        if isinstance(min_compression_rate, bool) or not isinstance(min_compression_rate, (int, float)) \
                or not min_compression_rate >= 1:
            raise ValueError(f"min_compression_rate must be a number >= 1, got {min_compression_rate!r}")
        if feedback not in ("auto", "classic", "none"):
            raise ValueError(f"PowerSGD runs classic error feedback (its residual is what the approximation "
                             f"missed) or none: feedback must be 'auto', 'classic' or 'none', got {feedback!r}")
        on = error_feedback and feedback != "none"
        super().__init__(error_feedback=on, seed=0 if seed is None else seed, feedback="classic" if on else "none",
                         clip=clip,
                         exclude=exclude, exempt=exempt)
        self.rank, self.warm_start, self.min_compression_rate = rank, warm_start, float(min_compression_rate)
        self._factors = Factors()
        self._rounds.add(self._factors)   # its Q is undone with the rest of a round
        self._shapes: Dict[str, Tuple[int, ...]] = {}

    def __repr__(self) -> str:
        extra = "" if self.warm_start else ", warm_start=False"
        return f"PowerSGD(rank={self.rank}{extra}, error_feedback={self.error_feedback}{self._extra_repr()})"

    def _extra_repr(self) -> str:
        # its feedback is classic error feedback, or none (error_feedback=False): not said twice
        return super()._extra_repr().replace(f", feedback={self.feedback.key!r}", "")

    # ------------------------------------------------------------ which tensors
    def factors(self, shape: Tuple[int, ...]) -> Optional[Tuple[int, int, int]]:
        """``(n, m, r)`` of a tensor of ``shape`` seen as an ``n x m`` matrix; None when it goes as it
        is (1-d, or factors saving less than ``min_compression_rate``).

        >>> PowerSGD(rank=4).factors((64, 32)), PowerSGD(rank=4).factors((4096,)), PowerSGD(rank=4).factors((8, 8))
        ((64, 32, 4), None, None)
        """
        if len(shape) < 2:
            return None
        n, m = shape[0], math.prod(shape[1:])
        r = min(self.rank, n, m)
        return (n, m, r) if n * m >= self.min_compression_rate * (n + m) * r else None

    def compressible(self, shape: Tuple[int, ...]) -> bool:
        return self.factors(tuple(shape)) is not None

    def compresses(self, name: str, numel: Optional[int] = None) -> bool:
        """As every compressor, and not a tensor whose shape :meth:`factors` refuses (its shape is
        learnt when bound to an optimizer)."""
        shape = self._shapes.get(name)
        if shape is not None and not self.compressible(shape):
            return False
        return super().compresses(name, numel)

    def attach(self, optimizer: Any, names: Dict[Any, str], rank: int = 0) -> None:
        self._shapes.update({n: tuple(p.shape) for p, n in names.items()})
        super().attach(optimizer, names, rank)

    def payload_size(self, shape: Tuple[int, ...], dtype: torch.dtype = torch.float32,
                     index_bytes: Optional[int] = None) -> int:
        """Bytes this rank hands to the two allreduces for a ``shape`` tensor: ``(n + m) * r * 4``
        (a tensor :meth:`factors` refuses: as it is).

        >>> PowerSGD(rank=4).payload_size((64, 32))
        1536
        """
        f = self.factors(tuple(shape))
        return math.prod(shape) * dtype.itemsize if f is None else (f[0] + f[1]) * f[2] * 4

    # ------------------------------------------------------------ the rounds
    def first_round(self, name: str, grad: torch.Tensor) -> RoundsWork:
        """This rank's ``M`` (gradient + residual) and ``P = M Q``, the first allreduce's input."""
        if not name:
            raise ValueError("PowerSGD needs a tensor name (residuals and Q are kept per name)")
        f = self.factors(tuple(grad.shape))
        if f is None:
            raise ValueError(f"tensor {name!r} of shape {tuple(grad.shape)} is not compressed by {self!r}: "
                             "send it as it is (see factors())")
        n, m, r = f
        self._shapes.setdefault(name, tuple(grad.shape))
        acc = self.feedback.prepare(name, self._clipping.clipped(grad))
        matrix = acc.view(n, m).float()
        q = self._start_q(name, m, r, matrix.device)
        p = matrix @ q
        return RoundsWork(name, acc, matrix, None, p)

    def second_round(self, work: RoundsWork, p_average: torch.Tensor) -> torch.Tensor:
        """``P`` averaged over the ranks, orthogonalised; returns ``Q = M^T P``, the second allreduce's input."""
        work.p = orthogonalize(p_average.reshape(work.matrix.shape[0], -1).float().clone())
        work.send = work.matrix.T @ work.p
        return work.send

    def finish_rounds(self, work: RoundsWork, q_average: torch.Tensor, out: torch.Tensor, scale: float = 1.0) -> None:
        """``out = scale * P Q^T`` (``scale``: 1 for the average, the number of ranks for a sum);
        this rank's residual becomes ``M - P Q^T`` and ``Q`` the next step's start."""
        q = q_average.reshape(work.matrix.shape[1], -1).float()
        approx = work.p @ q.T
        if self.error_feedback:   # acc is the policy's own buffer (without feedback: the gradient itself)
            work.acc.view(approx.shape).sub_(approx.to(work.acc.dtype))
        self.feedback.sent(work.name, work.acc, [])   # acc holds what was not sent: the new residual
        self._keep_q(work.name, q)
        result = approx if scale == 1.0 else approx * scale
        out.copy_(result.view(out.shape).to(out.dtype))

    def _start_q(self, name: str, m: int, r: int, device: torch.device) -> torch.Tensor:
        q = self._factors.q.get(name) if self.warm_start else None
        if q is None or q.shape != (m, r):
            g = torch.Generator().manual_seed(zlib.crc32(f"{self.seed}/{name}/q/{self._draws(name)}".encode()))
            q = torch.randn(m, r, generator=g)
        return orthogonalize(q.to(device, torch.float32).clone())

    def _draws(self, name: str) -> int:
        """Which draw of ``Q`` this is: 0 with warm start (drawn once), the step without."""
        return 0 if self.warm_start else self._steps.get(name, 0)

    def _keep_q(self, name: str, q: torch.Tensor) -> None:
        self._factors.keep(name, q)
        self._counter.advance(name)

    # ------------------------------------------------------------ no single payload
    def pack(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(f"{self!r} sends no single payload: its factors travel in two dependent allreduces, on "
                        "hvd_gradcomp.DistributedOptimizer or the DDP hook (hvd_gradcomp.ddp.register)")

    unpack = pack

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> Dict[str, Any]:
        """The compressor's state (residuals, steps) and each tensor's last ``Q``: loading it continues
        bit-identically."""
        state = super().state_dict()
        state["powersgd"] = {"rank": self.rank, "warm_start": self.warm_start,
                             "q": self._factors.state()}
        return state

    def check_state(self, state: Any) -> None:
        super().check_state(state)
        saved = state.get("powersgd", {}) if isinstance(state, dict) else {}
        if saved.get("rank", self.rank) != self.rank:
            raise ValueError(f"cannot load this compressor state: it was saved with rank={saved['rank']}, this is "
                             f"{self!r}; build PowerSGD(rank={saved['rank']}) to resume it. Nothing was changed.")

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._factors.load(state.get("powersgd", {}).get("q", {}))
