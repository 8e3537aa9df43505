"""``hvd.elastic`` with ``hvd_gradcomp.DistributedOptimizer``: the compressor's state committed, restored and
synced with the optimizer's.

``hvd.elastic.TorchState(model=model, optimizer=opt, ...)`` handles an optimizer with Horovod's
``OptimizerStateHandler`` (its ``state_dict()`` copied at each commit, loaded back after a failure,
broadcast from rank 0 after a reset). Building an ``hvd_gradcomp.DistributedOptimizer`` puts
:class:`CompressedOptimizerStateHandler` in front of it in Horovod's handler registry
(:func:`register`, once per process), so the same ``TorchState`` call also carries the compressor:

* **commit** (``state.commit()``): the optimizer's state and the compressor's whole
  ``state_dict()`` (this rank's residuals, random-stream counts, the policy's state) and its exchange
  step, copied;
* **restore** (a rank failed: Horovod raised ``HorovodInternalError`` on the others): exchanges left in
  flight are dropped (``opt.load_state_dict``) and the compressor is put back as committed, residuals
  included: what the interrupted steps left in them is undone with those steps;
* **sync** (after every reset but a removal-only one, on every rank, a collective): the optimizer's state
  from rank 0 (Horovod's), then rank 0's compressor *shared* state (the exchange step, the random streams'
  counts, ``frozen``'s ``v`` and warm-up, momentum correction's last average, PowerSGD's ``Q``: what
  every rank holds alike, see ``GradientCompressor.shared_state``) on every rank. **Each rank keeps its own
  residuals**: a rank that survived keeps what it committed, a rank that joins starts at zero; the
  residuals of a rank that left are gone with it (what it had computed and not yet sent: never applied).
  Each rank's noise stream is set to its new rank (independent noise after renumbering). When the
  number of ranks changed, QSGD's relay residuals (per chunk of the ranks) are dropped, with a warning
  saying how much they held (``GradientCompressor.follow_world``; after a removal-only reset, which Horovod does
  not follow by a sync, the compressed allreduce (QSGD) does it at its next exchange). The out-of-step check (``RankDivergenceError``) is on again from the
  first sync: every rank is at rank 0's exchange step.

``last_reset`` on the handler (``state._handlers["optimizer"].last_reset``) says what the last sync did.
"""
from __future__ import annotations

import copy
from typing import Any, Dict, Optional

import torch

from ..codecs.compressor import GradientCompressor
from ..codecs.steps import state_to_cpu, state_to_device

_REGISTERED = False


def is_wrapped(opt: Any) -> bool:
    """Whether ``opt`` is an ``hvd_gradcomp.DistributedOptimizer`` (its class is made per call, so a test
    of attributes, as :func:`hvd_gradcomp.DistributedOptimizer` refuses to wrap one twice)."""
    return isinstance(opt, torch.optim.Optimizer) and hasattr(opt, "_compressed") and hasattr(opt, "_pending")


class _WrappedMeta(type):
    def __instancecheck__(cls, obj: Any) -> bool:
        return is_wrapped(obj)


class WrappedOptimizer(metaclass=_WrappedMeta):
    """``isinstance(opt, WrappedOptimizer)``: :func:`is_wrapped` (the key of the handler registry)."""


def _compressor(opt: Any) -> Optional[GradientCompressor]:
    comp = getattr(opt, "compression", None)
    return comp if isinstance(comp, GradientCompressor) else None


def _make_handler():
    from horovod.torch.elastic.state import OptimizerStateHandler

    class CompressedOptimizerStateHandler(OptimizerStateHandler):
        """Horovod's optimizer handler, plus the compressor of an ``hvd_gradcomp.DistributedOptimizer``
        (see the module's docstring)."""

        def __init__(self, optimizer: Any) -> None:
            self.last_reset: Dict[str, Any] = {}
            self._saved_compressor: Optional[Dict[str, Any]] = None
            self._saved_round = 0
            super().__init__(optimizer)
            self._save_compressor()

        def _save_compressor(self) -> None:
            comp = _compressor(self.value)
            if comp is not None:
                self._saved_compressor = copy.deepcopy(comp.state_dict())
                self._saved_round = comp.exchange_step

        def save(self) -> None:
            super().save()
            self._save_compressor()

        def restore(self) -> None:
            super().restore()   # load_state_dict: exchanges in flight dropped, the step undone
            comp = _compressor(self.value)
            if comp is not None and self._saved_compressor is not None:
                comp.load_state_dict(copy.deepcopy(self._saved_compressor))
                comp._round = self._saved_round

        def sync(self) -> None:
            import horovod.torch as hvd
            opt, comp = self.value, _compressor(self.value)
            if not opt._included:
                super().sync()
                return
            if comp is None:
                super().sync()
                self._sync_parameters()
                return
            world = opt.process_set.size()
            before = comp._world
            # Rank 0's, read before Horovod's broadcast of the optimizer state (which leaves the compressor alone).
            shared = state_to_cpu(comp.shared_state()) if hvd.rank() == 0 else None
            super().sync()
            self._sync_parameters()
            shared = hvd.broadcast_object(shared, 0, name="hvdgc.elastic.compressor")
            dropped = comp.follow_world(world) if before is not None and before != world else 0.0
            comp._world = world
            shared["world_size"] = world
            params = [p for g in opt.param_groups for p in g["params"]]
            comp.load_shared_state(state_to_device(shared, params[0].device if params else None))
            comp.stream = hvd.rank()
            comp.elastic_synced = True   # every rank at rank 0's exchange step: the out-of-step check is on
            norm = sum(float(r.float().pow(2).sum()) for r in comp.residuals._residuals.values()) ** 0.5
            self.last_reset = {"world_before": before, "world": world, "rank": hvd.rank(),
                               "exchange_step": comp.exchange_step, "residual_norm": norm,
                               "relay_dropped_norm": dropped}

        def _sync_parameters(self) -> None:
            """Rank 0's parameters again. Why: on a rank that joins, Horovod's ``broadcast_optimizer_state``
            creates the missing state by a step of zero gradients, after ``TorchState`` broadcast the
            model: AdamW's weight decay moved that rank's weights (measured: replicas apart after a host
            came back, uncompressed too)."""
            import horovod.torch as hvd
            opt = self.value
            params = [p for g in opt.param_groups for p in g["params"]]
            hvd.broadcast_parameters([(f"hvdgc.elastic.{opt._parameter_names[p]}", p.data) for p in params], 0)

    return CompressedOptimizerStateHandler


_HANDLER = None


def handler_class():
    """:class:`CompressedOptimizerStateHandler` (made on first use: it subclasses Horovod's)."""
    global _HANDLER
    if _HANDLER is None:
        _HANDLER = _make_handler()
    return _HANDLER


def register() -> bool:
    """Put the handler first in ``horovod.torch.elastic``'s handler registry, once per process; False
    where Horovod's elastic module is not there."""
    global _REGISTERED
    if _REGISTERED:
        return True
    try:
        from horovod.torch.elastic import state as hvd_state
    except ImportError:
        return False
    registry = hvd_state.get_handler_registry()
    if not any(t is WrappedOptimizer for t, _ in registry):
        hvd_state.set_handler_registry([(WrappedOptimizer, handler_class()), *registry])
    _REGISTERED = True
    return True
