"""How a collective travels: one interface, a Horovod and a ``torch.distributed`` implementation.

An exchange algorithm (:mod:`hvd_gradcomp.rounds`) asks for collectives without knowing who
carries them; a driver hands each request to a :class:`Transport`:

* :class:`HorovodTransport`: Horovod's asynchronous collectives on a process set, matched
  across ranks by name (``hvd_gradcomp.DistributedOptimizer``'s roads);
* :class:`TorchTransport`: ``torch.distributed`` on a process group (Gloo, NCCL, MPI), matched
  by issue order (the DDP hook's roads).

Both return a :class:`Work`: ``done()`` never blocks, ``wait()`` blocks and returns the result.
A ``TorchTransport`` work also has ``future``, for drivers that chain callbacks on it.

Example (one process, Gloo)::

    >>> import torch.distributed as dist
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> work = TorchTransport(None, 1).allreduce(torch.tensor([2.0, 4.0]), "x", average=True)
    >>> work.wait()
    tensor([2., 4.])
    >>> dist.destroy_process_group()
"""
from __future__ import annotations

from typing import Any, Optional, Protocol

import torch


class Work(Protocol):
    """A collective in flight."""

    def done(self) -> bool:
        """Whether the result is ready; never blocks."""

    def wait(self) -> torch.Tensor:
        """Block until done; the result (the same tensor on every later call)."""


class Transport(Protocol):
    """What an exchange algorithm needs of the network."""

    def allreduce(self, tensor: torch.Tensor, tag: str, average: bool) -> Work:
        """The sum over ranks of ``tensor`` (divided by the number of ranks when ``average``)."""


def _hvd() -> Any:
    import horovod.torch as hvd
    return hvd


class _HorovodWork:
    """A Horovod handle; ``handle`` stays readable for callers that poll or time it."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self._result: Optional[torch.Tensor] = None

    def done(self) -> bool:
        return self._result is not None or bool(_hvd().poll(self.handle))

    def wait(self) -> torch.Tensor:
        if self._result is None:
            self._result = _hvd().synchronize(self.handle)
        return self._result


class HorovodTransport:
    """Horovod's collectives on ``process_set`` (its background thread runs them)."""

    def __init__(self, process_set: Any) -> None:
        self.process_set = process_set

    def allreduce(self, tensor: torch.Tensor, tag: str, average: bool) -> _HorovodWork:
        hvd = _hvd()
        return _HorovodWork(hvd.allreduce_async(tensor, name=tag, op=hvd.Average if average else hvd.Sum,
                                                process_set=self.process_set))


class _TorchWork:
    """A ``torch.distributed`` work's future; the average is taken in place on ``wait()``."""

    def __init__(self, tensor: torch.Tensor, future: torch.futures.Future, divisor: int) -> None:
        self.tensor, self.future, self._divisor = tensor, future, divisor

    def done(self) -> bool:
        return self.future.done()

    def wait(self) -> torch.Tensor:
        self.future.wait()   # raises a failed collective; on CUDA, the current stream waits for it
        if self._divisor != 1:
            self.tensor.div_(self._divisor)
            self._divisor = 1
        return self.tensor


class TorchTransport:
    """``torch.distributed`` collectives on ``group`` (None: the default group) of ``world_size``
    ranks. In-place: ``allreduce`` overwrites the tensor it is given."""

    def __init__(self, group: Any, world_size: int) -> None:
        self.group, self.world_size = group, world_size

    def allreduce(self, tensor: torch.Tensor, tag: str, average: bool) -> _TorchWork:
        import torch.distributed as dist
        future = dist.all_reduce(tensor, group=self.group, async_op=True).get_future()
        return _TorchWork(tensor, future, self.world_size if average else 1)
