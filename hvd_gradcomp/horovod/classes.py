"""The compressor classes ``hvd_gradcomp`` exports (``gc.QSGD``, ``gc.TopK``, ``gc.TopKQSGD``,
``gc.PowerSGD``): each codec of :mod:`hvd_gradcomp.codecs` with Horovod's compressor protocol
(:class:`HorovodCompressor`: ``compress``/``decompress``, see :mod:`hvd_gradcomp.horovod.stock`), so
one object serves ``hvd.DistributedOptimizer(compression=...)``, ``hvd_gradcomp.DistributedOptimizer``
and the DDP hook.
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, Optional, Tuple

import torch

from ..codecs import powersgd, qsgd, topk
from .stock import HorovodIntegrationError, compress, decompress, name_map


class HorovodCompressor:
    """Horovod's compressor protocol (``compress``/``decompress``) on top of a codec.

    ``named_parameters``: the model's ``named_parameters()``, so compress() never needs
    Horovod's private parameter table; without it the names come from Horovod's optimizer.
    """

    error_feedback: bool

    def __init__(self, *args: Any, named_parameters: Optional[Iterable[Tuple[str, torch.Tensor]]] = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._names: Optional[Dict[torch.Tensor, str]] = None
        if named_parameters is not None:
            self.bind(named_parameters)

    def bind(self, named_parameters: Iterable[Tuple[str, torch.Tensor]]) -> "HorovodCompressor":
        """Use these names for the gradients Horovod hands to compress(); returns self.

        >>> m = torch.nn.Linear(4, 4)
        >>> TopK(ratio=0.5).bind(m.named_parameters())
        TopK(ratio=0.5, error_feedback=True)
        """
        self._names = name_map(named_parameters)
        return self

    def compress(self, tensor: torch.Tensor, name: Optional[str] = None) -> Tuple[torch.Tensor, Any]:
        """Horovod's compressor entry point.

        Called by ``hvd.DistributedOptimizer`` it starts an allgather of the payload and
        returns an empty tensor for Horovod's allreduce (see the module docstring). Called
        directly it returns ``(payload, ctx)``; pass ``name=`` when error feedback is on.
        Integer and empty tensors pass through unchanged.

        >>> c = QSGD(bits=8)
        >>> payload, ctx = c.compress(torch.ones(1000), name="w")
        >>> c.decompress(payload, ctx).shape
        torch.Size([1000])
        """
        return compress(self, tensor, name, self._names)

    def decompress(self, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Inverse of :meth:`compress`: inside Horovod, the average (or sum) of every rank's payload."""
        return decompress(self, tensor, ctx)


class QSGD(HorovodCompressor, qsgd.QSGD):
    """:class:`hvd_gradcomp.codecs.qsgd.QSGD`, usable as ``hvd.DistributedOptimizer(compression=...)``.

    >>> QSGD(bits=4)
    QSGD(bits=4, bucket_size=512, error_feedback=True)
    """


class TopK(HorovodCompressor, topk.TopK):
    """:class:`hvd_gradcomp.codecs.topk.TopK`, usable as ``hvd.DistributedOptimizer(compression=...)``.

    >>> TopK(ratio=0.01)
    TopK(ratio=0.01, error_feedback=True)
    """


class TopKQSGD(TopK, topk.TopKQSGD):  # a TopK, as topk.TopKQSGD is
    """:class:`hvd_gradcomp.codecs.topk.TopKQSGD`, usable as ``hvd.DistributedOptimizer(compression=...)``.

    >>> TopKQSGD()
    TopKQSGD(ratio=0.01, bits=8, bucket_size=512, error_feedback=True)
    """


class PowerSGD(powersgd.PowerSGD):
    """:class:`hvd_gradcomp.codecs.powersgd.PowerSGD`, refused by stock ``hvd.DistributedOptimizer`` at its
    first step with what to use instead: stock Horovod allreduces what ``compress()`` returns once,
    and PowerSGD needs two dependent allreduces (``Q`` is computed from the averaged ``P``).

    >>> PowerSGD(rank=4)
    PowerSGD(rank=4, error_feedback=True)
    """

    def compress(self, tensor: torch.Tensor, name: Optional[str] = None) -> Tuple[torch.Tensor, Any]:
        raise HorovodIntegrationError(
            f"{self!r} cannot run inside hvd.DistributedOptimizer(compression=...): Horovod allreduces what "
            "compress() returns once, and PowerSGD needs two dependent allreduces (P, then Q computed from the "
            "averaged P). Use hvd_gradcomp.DistributedOptimizer(...) (same arguments) or, with PyTorch DDP, "
            "hvd_gradcomp.ddp.register(model, compression=...).")

    def decompress(self, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return self.compress(tensor)[0]
