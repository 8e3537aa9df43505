"""This step's exchanges in ``hvd_gradcomp.DistributedOptimizer``: started per parameter, finished together.

:class:`StepExchanges` starts each gradient's exchange when the optimizer's hook says it is final
(compressed, Horovod's sparse allreduce, or the small tensors' fused allreduce), decodes those already
done while backward goes on, and at ``synchronize()`` starts what is left and finishes them all,
writing each average into ``p.grad``.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch

from ..collectives.exchange import Pending, SparseExchange
from .small import Fused, SmallTensors


class StepExchanges:
    """The exchanges of one step: per parameter, and the small tensors' fused ones.

    ``compressed``: the exchange of the compressed gradients (``choose_exchange``); ``sparse``: Horovod's
    sparse allreduce; ``small``: the fuser of the uncompressed ones; ``record(name, raw bytes, pending)``
    counts each finished exchange; ``names``: the parameters' names.
    """

    def __init__(self, compressed: Any, sparse: SparseExchange, small: SmallTensors,
                 record: Callable[[str, int, Pending], None], names: Dict[torch.Tensor, str],
                 sparse_as_dense: bool) -> None:
        self.compressed = compressed   # an attribute: tests swap the exchange (tests/workers/auto.py)
        self._sparse, self._fuser, self._record, self._names = sparse, small, record, names
        self._sparse_as_dense = sparse_as_dense
        self.pending: Dict[torch.Tensor, Pending] = {}
        self.sparse_pending: Dict[torch.Tensor, Pending] = {}
        self._densified: List[torch.Tensor] = []   # sparse gradients exchanged dense (sparse_as_dense)
        self._small: Optional[List[torch.Tensor]] = None   # tensors of the fused allreduce (see gradient_final)
        self._small_ready = 0
        self.early_fused: Optional[List[Fused]] = None

    def busy(self) -> bool:
        """Whether an exchange of this step is in flight."""
        return bool(self.pending or self.sparse_pending or self.early_fused is not None)

    def started(self, p: torch.Tensor) -> bool:
        """Whether ``p``'s exchange started this step."""
        return p in self.pending or p in self.sparse_pending

    def gradient_final(self, p: torch.Tensor, hooked: Callable[[], List[torch.Tensor]]) -> bool:
        """``p``'s gradient is final (from its hook): start its exchange, or count it among the small
        ones, whose fused allreduce leaves with the last of them. ``hooked()``: the hooked parameters.
        Returns whether an exchange of ``p`` alone started (the caller then decodes what is done)."""
        if p.grad.is_sparse or not self._fuser.is_small(p):
            self.start(p)
            return True
        if not self._sparse_as_dense:
            self._small_ready += 1
            if self._small is None:   # this step's: requires_grad may have changed since the last
                self._small = [q for q in hooked() if self._fuser.is_small(q) and q.requires_grad]
            if self._small_ready == len(self._small):
                # Every small gradient is final: their fused allreduce leaves now, overlapping the
                # rest of backward, instead of from synchronize(). (A step where one has no gradient
                # never gets here: synchronize() starts it, with zeros for the missing ones.)
                self.early_fused = self._fuser.start(self._small)
        return False

    def start(self, p: torch.Tensor) -> None:
        """Start ``p``'s exchange (zeros where this rank has no gradient)."""
        if p.grad is None:  # unused on this rank: others may have a gradient, so send zeros
            p.grad = torch.zeros_like(p)
        name = self._names[p]
        if p.grad.is_sparse:
            if not self._sparse_as_dense:  # already small: Horovod's sparse allreduce, uncompressed
                self.sparse_pending[p] = self._sparse.start(name, p.grad)
                return
            p.grad = p.grad.to_dense()
            self._densified.append(p)
            if self._fuser.is_small(p):
                return  # joins the fused allreduce of small tensors
        pending = self.pending[p] = self.compressed.start(name, p.grad)
        pending.out = p.grad   # final for this step: an exchange may write the average early

    def progress(self) -> None:
        """Decode the exchanges already done while backward goes on, instead of all at synchronize()."""
        for pending in self.pending.values():
            if not pending.finished:
                self.compressed.progress(pending)

    def finish(self, params: Iterable[torch.Tensor]) -> Tuple[List[torch.Tensor], Dict[torch.Tensor, Any]]:
        """Start the exchanges of ``params`` not started yet, then finish every one: the averages are
        in ``p.grad``. Returns the parameters exchanged and, per parameter, whether its average is
        finite where its exchange knows it (``Pending.finite``)."""
        fused = self._start_small(self._rest(params))
        for pending in self.pending.values():
            if not pending.finished:
                self.compressed.advance(pending)
        for p, pending in self.pending.items():
            if not pending.finished:
                self.compressed.finish(pending, p.grad)
            # Counted once finished: the QSGD exchange adds its allgather's bytes in advance().
            self._record(pending.name, p.numel() * p.element_size(), pending)
        self._fuser.finish(fused)
        for p, pending in self.sparse_pending.items():
            self._sparse.finish(pending, p.grad)
            self._record(pending.name, pending.bytes_sent, pending)
        known = {p: pending.finite for p, pending in self.pending.items()}
        return [*self.pending, *self.sparse_pending, *(p for f in fused for p in f.params)], known

    def _rest(self, params: Iterable[torch.Tensor]) -> List[torch.Tensor]:
        """Start the exchanges of ``params`` not started (a partial window, a parameter without gradient this
        step); returns the small ones, which go in a fused allreduce."""
        small = []
        for p in params:
            if self.started(p):
                continue
            if p.grad is None and not p.requires_grad:
                continue   # frozen since this optimizer was built: not exchanged, not stepped, as in PyTorch
            if self._fuser.is_small(p) and not (p.grad is not None and p.grad.is_sparse):
                small.append(p)
            else:
                self.start(p)
        return small + [p for p in self._densified if p not in self.pending and p not in small]

    def _start_small(self, small: List[torch.Tensor]) -> List[Fused]:
        if self.early_fused is None:
            return self._fuser.start(small)
        # launched during backward; a parameter adopted just now goes in a fused exchange of its own
        early = {p for f in self.early_fused for p in f.params}
        return self.early_fused + self._fuser.start([p for p in small if p not in early], tag="late")

    def end_step(self) -> None:
        """After :meth:`finish`: the sparse layout back where it was densified, and a new step."""
        for p in self._densified:  # the optimizer (SparseAdam, ...) expects the sparse layout back
            p.grad = p.grad.to_sparse()
        self.clear()

    def clear(self) -> None:
        """Forget the exchanges in flight (an elastic reset interrupted a step) and start a new step."""
        self._densified.clear()
        self.pending.clear()
        self.sparse_pending.clear()
        self.early_fused, self._small, self._small_ready = None, None, 0
