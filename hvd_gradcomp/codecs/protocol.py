"""Horovod's compressor protocol, on every codec: ``compress(tensor, name=None)``,
``decompress(tensor, ctx)`` and ``bind(named_parameters)``.

Why here: one object per codec serves every wrapper. ``hvd_gradcomp.TopK`` is
:class:`hvd_gradcomp.codecs.topk.TopK`, and the same object goes to stock
``hvd.DistributedOptimizer(compression=...)``, to ``hvd_gradcomp.DistributedOptimizer`` and to the
DDP hook, so :class:`~hvd_gradcomp.codecs.compressor.GradientCompressor` carries Horovod's
``compress``/``decompress`` itself (before, each codec had a second class, in the Horovod adapter,
that added them).

Why by name: the work is done by the Horovod adapter (:mod:`hvd_gradcomp.horovod.stock`, the one
module that knows Horovod's internals), a layer above the codecs. A codec may not import it, so
these functions name it as ``"module:attribute"`` strings (:data:`ADAPTER`), imported on first use,
as the codec registry names the built-in codecs (docs/ARCHITECTURE.md, "Three ways a module names
one built on it"). They are functions, not a mixin class: ``GradientCompressor`` takes them as
class attributes, so no codec's MRO gains a class.
"""
from __future__ import annotations

from importlib import import_module
from typing import Any, Callable, Dict, Iterable, Optional, Tuple

import torch

ADAPTER = {
    "compress": "hvd_gradcomp.horovod.stock:compress",
    "decompress": "hvd_gradcomp.horovod.stock:decompress",
    "name_map": "hvd_gradcomp.horovod.stock:name_map",
}
"""What each method of the protocol calls in the Horovod adapter, imported on first use."""

_resolved: Dict[str, Callable[..., Any]] = {}


def _adapter(what: str) -> Callable[..., Any]:
    """The adapter's function ``ADAPTER[what]``, imported once."""
    fn = _resolved.get(what)
    if fn is None:
        module, attribute = ADAPTER[what].split(":")
        fn = _resolved[what] = getattr(import_module(module), attribute)
    return fn


def bind(self: Any, named_parameters: Iterable[Tuple[str, torch.Tensor]]) -> Any:
    """Use these names for the gradients stock Horovod hands to :meth:`compress`; returns the codec.
    The constructor's ``named_parameters=`` calls it; without it the names come from Horovod's
    optimizer.

    >>> from hvd_gradcomp.codecs.topk import TopK
    >>> m = torch.nn.Linear(4, 4)
    >>> TopK(ratio=0.5).bind(m.named_parameters())
    TopK(ratio=0.5, error_feedback=True)
    """
    self._names = _adapter("name_map")(named_parameters)
    return self


def compress(self: Any, tensor: torch.Tensor, name: Optional[str] = None) -> Tuple[torch.Tensor, Any]:
    """Horovod's compressor entry point (:func:`hvd_gradcomp.horovod.stock.compress`).

    Called by ``hvd.DistributedOptimizer`` it starts an allgather of the payload and returns an
    empty tensor for Horovod's allreduce (see :mod:`hvd_gradcomp.horovod.stock`). Called directly
    it returns ``(payload, ctx)``; pass ``name=`` when error feedback is on. Integer and empty
    tensors pass through unchanged. A codec whose payload travels in dependent rounds (PowerSGD)
    is refused: stock Horovod allreduces what ``compress()`` returns once.

    >>> from hvd_gradcomp.codecs.qsgd import QSGD
    >>> c = QSGD(bits=8)
    >>> payload, ctx = c.compress(torch.ones(1000), name="w")
    >>> c.decompress(payload, ctx).shape
    torch.Size([1000])
    """
    return _adapter("compress")(self, tensor, name, self._names)


def decompress(self: Any, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
    """Inverse of :meth:`compress`: inside Horovod, the average (or sum) of every rank's payload."""
    return _adapter("decompress")(self, tensor, ctx)
