""":class:`CompressedRoads`, the part of :class:`hvd_gradcomp.auto.Auto` that owns its compressed
roads' compressors and hands what one road left behind (its residual) to the tensor's next send,
whatever road that takes: nothing is lost or sent twice across switches.
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch

from .. import feedback as fb
from ..codecs.compressor import payload_size
from ..codecs.qsgd import QSGD
from ..codecs.topk import TopKQSGD
from ..collectives.reduce import chunk_bounds
from .policy import QSGD_AG, QSGD_AR, SPARSE, TensorCosts


class CompressedRoads:
    """The sparse road's TopKQSGD and the qsgd road's QSGD, and their residuals across roads.

    For QSGD's compressed allreduce, the residual of the re-quantised reduced chunk this rank owns
    goes back in at its place, times the number of ranks under ``hvd.Average`` (it was a residual
    of the average). ``relayed``: whether that road runs (not inside stock Horovod, where QSGD
    travels by allgather); ``rank``, ``ranks``, ``average``: where Auto runs (:meth:`bind`).
    """

    def __init__(self, sparse: TopKQSGD, qsgd: QSGD) -> None:
        self.sparse, self.qsgd = sparse, qsgd
        self.relayed, self.rank, self.ranks, self.average = False, 0, 1, False
        self.noted = False   # see note_optimizer

    def bind(self, relayed: bool, rank: int, ranks: int, average: bool) -> None:
        """Where Auto runs (see the class); each rank draws its own rounding noise."""
        self.relayed, self.rank, self.ranks, self.average = relayed, rank, ranks, average
        self.sparse.stream = self.qsgd.stream = rank

    def note_optimizer(self, optimizer: Any, rank: int, owner: str) -> None:
        """Say once, on rank 0, when ``optimizer`` has a feedback recipe of its own (momentum
        correction for SGD with momentum, ``frozen`` for Adam/AdamW, see
        :func:`hvd_gradcomp.feedback.choose`) that these roads do not apply: their error feedback is
        classic, since a tensor may change road at any re-decision and those recipes keep state
        tied to one road. ``owner``: who says it (Auto's repr)."""
        if self.noted or rank != 0 or optimizer is None:
            return
        self.noted = True
        key, _ = fb.choose(optimizer, False, True)
        if key in ("classic", "none"):
            return
        name = fb.plain_class(optimizer).__name__
        fb.announce(f"{owner} with {name}: error feedback on its compressed roads is classic (on gradients), "
                    f"not the recipe a fixed compressor applies for {name} (feedback '{key}'). Where it picks a "
                    f"compressed road (a slow link), compression=hvd_gradcomp.TopKQSGD(ratio={self.sparse.ratio}, "
                    f"bits={self.sparse.bits}) trains closer to uncompressed (docs/AUTO.md, benchmarks/results/STUDY.md).")

    def owes(self, name: str, road: str) -> bool:
        """Whether a road other than ``road`` holds a residual of ``name``."""
        return ((road != SPARSE and self.sparse.residuals.residual(name) is not None)
                or (road not in (QSGD_AR, QSGD_AG) and self.qsgd.residuals.residual(name) is not None)
                or (road != QSGD_AR and self.relayed
                    and self.qsgd.relay_residuals.residual(f"{name}#reduced{self.rank}") is not None))

    def flush(self, name: str, grad: torch.Tensor, road: str) -> torch.Tensor:
        """``grad`` plus whatever residual another road left for ``name`` (then dropped there)."""
        extra: List[Tuple[Optional[torch.Tensor], int, float]] = []
        if road != SPARSE:
            extra.append((self.sparse.residuals.pop(name), 0, 1.0))
        if road not in (QSGD_AR, QSGD_AG):
            extra.append((self.qsgd.residuals.pop(name), 0, 1.0))
        if road != QSGD_AR and self.relayed:
            # The residual of this rank's reduced chunk belongs to the average at that chunk:
            # sent from this rank alone it is averaged again, hence the factor P.
            chunk = self.qsgd.relay_residuals.pop(f"{name}#reduced{self.rank}")
            scale = float(self.ranks) if self.average else 1.0
            start = chunk_bounds(grad.numel(), self.ranks)[self.rank]
            extra.append((chunk, start, scale))
        extra = [e for e in extra if e[0] is not None]
        if not extra:
            return grad
        flat = grad.reshape(-1).to(fb.residual_dtype(grad.dtype), copy=True)
        for res, start, scale in extra:
            flat[start:start + res.numel()].add_(res.to(flat.device), alpha=scale)
        return flat.to(grad.dtype).view(grad.shape)

    def sends(self, road: str, costs: Iterable[TensorCosts]) -> List[Tuple[int, int, float]]:
        """(numel, itemsize, payload bytes) of each tensor on ``road``: measured, else
        :meth:`least_payload` (what :func:`hvd_gradcomp.auto.policy.transfer_seconds` takes)."""
        return [(c.numel, c.itemsize, c.payload.get(road, self.least_payload(road, c.numel))) for c in costs]

    def least_payload(self, road: str, numel: int) -> float:
        """A road's payload bytes for a tensor it has not sent yet, never more than it will be:
        QSGD's exactly, a sparse payload's without its indices (dense and fp16 need none)."""
        if road in (QSGD_AR, QSGD_AG):
            return float(payload_size(self.qsgd, (numel,)))
        if road == SPARSE:
            return float(payload_size(self.sparse, (numel,), index_bytes=0))
        return 0.0

    def state_dict(self) -> Dict[str, Any]:
        return {"sparse": self.sparse.state_dict(), "qsgd": self.qsgd.state_dict()}

    def check_state(self, state: Dict[str, Any]) -> None:
        self.sparse.check_state(state["sparse"])
        self.qsgd.check_state(state["qsgd"])

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.sparse.load_state_dict(state["sparse"])
        self.qsgd.load_state_dict(state["qsgd"])
