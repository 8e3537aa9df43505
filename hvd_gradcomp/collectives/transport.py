"""How a collective travels: one interface, a Horovod and a ``torch.distributed`` implementation.

An exchange algorithm (:mod:`hvd_gradcomp.collectives.rounds`) asks for collectives without knowing who
carries them; a driver hands each request to a :class:`Transport`:

* :class:`HorovodTransport`: Horovod's asynchronous collectives on a process set, matched
  across ranks by name (``hvd_gradcomp.DistributedOptimizer``'s drivers);
* :class:`TorchTransport`: ``torch.distributed`` on a process group (Gloo, NCCL, MPI), matched
  by issue order (the DDP hook's drivers).

Both return a :class:`Work`: ``done()`` never blocks, ``wait()`` blocks and returns the result.
A ``TorchTransport`` work also has ``future``, for drivers that chain callbacks on it.

Both also carry :class:`hvd_gradcomp.Auto`'s blocking collectives (:class:`Control`): the mean of
its measurements, rank 0's decisions broadcast, and the link probe's timed allreduce and
allgather, so its decision logic is the same under every wrapper.

Example (one process, Gloo)::

    >>> import torch.distributed as dist
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> work = TorchTransport(None, 1).allreduce(torch.tensor([2.0, 4.0]), "x", average=True)
    >>> work.wait()
    tensor([2., 4.])
    >>> dist.destroy_process_group()
"""
from __future__ import annotations

from functools import cached_property
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


class Control(Protocol):
    """The blocking collectives :class:`hvd_gradcomp.Auto` decides with; ``size`` and ``rank`` too."""

    size: int
    rank: int

    def mean(self, t: torch.Tensor, tag: str) -> torch.Tensor:
        """The average of ``t`` over the ranks, on the host."""

    def broadcast(self, t: torch.Tensor, tag: str) -> torch.Tensor:
        """The first rank's ``t`` on every rank, on the host."""

    def probe_allreduce(self, t: torch.Tensor, tag: str) -> None:
        """An allreduce of ``t``, returning once it is done: the link probe times it."""

    def probe_allgather(self, t: torch.Tensor, tag: str) -> None:
        """An allgather of ``t``, returning once it is done: the link probe times it."""


def _hvd() -> Any:
    import horovod.torch as hvd
    return hvd


def all_gather_single(out: torch.Tensor, tensor: torch.Tensor, group: Any = None, async_op: bool = False) -> Any:
    """``torch.distributed``'s gather of equal-sized tensors into one: ``all_gather_single`` from
    torch 2.10, ``all_gather_into_tensor`` before (the same collective, renamed)."""
    import torch.distributed as dist
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(out, tensor, group=group, async_op=async_op)


class _HorovodWork:
    """A Horovod handle; ``handle`` stays readable for callers that poll or time it. ``divisor``: the
    result is divided by it on ``wait()`` (an average over the ranks still training, see
    :meth:`HorovodTransport.allreduce`)."""

    def __init__(self, handle: Any, divisor: int = 1) -> None:
        self.handle, self._divisor = handle, divisor
        self._result: Optional[torch.Tensor] = None

    def done(self) -> bool:
        return self._result is not None or bool(_hvd().poll(self.handle))

    def wait(self) -> torch.Tensor:
        if self._result is None:
            self._result = _hvd().synchronize(self.handle)
            if self._divisor != 1:
                self._result.div_(self._divisor)
        return self._result


class HorovodTransport:
    """Horovod's collectives on ``process_set`` (its background thread runs them); the blocking
    ones (:class:`Control`) are named ``hvdgc.auto.*``."""

    def __init__(self, process_set: Any) -> None:
        self.process_set = process_set

    size = property(lambda self: self.process_set.size())
    rank = property(lambda self: self.process_set.rank())

    def allreduce(self, tensor: torch.Tensor, tag: str, average: bool, joined: int = 0) -> _HorovodWork:
        """``joined``: the ranks still training when others are inside ``hvd.join()`` (they add zeros, and
        Horovod's Average divides by every rank): then the sum, divided by ``joined`` for an ``average``."""
        hvd = _hvd()
        if joined:
            return _HorovodWork(hvd.allreduce_async(tensor, name=tag, op=hvd.Sum, process_set=self.process_set),
                                joined if average else 1)
        return _HorovodWork(hvd.allreduce_async(tensor, name=tag, op=hvd.Average if average else hvd.Sum,
                                                process_set=self.process_set))

    def mean(self, t: torch.Tensor, tag: str) -> torch.Tensor:
        hvd = _hvd()
        return hvd.allreduce(t, op=hvd.Average, name=f"hvdgc.auto.{tag}", process_set=self.process_set)

    def broadcast(self, t: torch.Tensor, tag: str) -> torch.Tensor:
        ranks = getattr(self.process_set, "ranks", None)   # the process set's first rank
        return _hvd().broadcast(t, root_rank=ranks[0] if ranks else 0, name=f"hvdgc.auto.{tag}",
                                process_set=self.process_set)

    def probe_allreduce(self, t: torch.Tensor, tag: str) -> None:
        _hvd().allreduce(t, name=f"hvdgc.auto.probe.{tag}", process_set=self.process_set)

    def probe_allgather(self, t: torch.Tensor, tag: str) -> None:
        _hvd().allgather(t, name=f"hvdgc.auto.probe.{tag}", process_set=self.process_set)


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
    ranks. In-place: ``allreduce`` overwrites the tensor it is given. ``device``: where the
    blocking ones (:class:`Control`) run (NCCL reduces only CUDA tensors); their results come
    back to the host."""

    def __init__(self, group: Any, world_size: int, device: torch.device = torch.device("cpu")) -> None:
        self.group, self.world_size, self.device = group, world_size, device

    size = property(lambda self: self.world_size)

    @cached_property
    def rank(self) -> int:   # asked once per use, not at construction: the DDP drivers build one per bucket
        import torch.distributed as dist
        return dist.get_rank(self.group)

    def allreduce(self, tensor: torch.Tensor, tag: str, average: bool) -> _TorchWork:
        import torch.distributed as dist
        future = dist.all_reduce(tensor, group=self.group, async_op=True).get_future()
        return _TorchWork(tensor, future, self.world_size if average else 1)

    def mean(self, t: torch.Tensor, tag: str) -> torch.Tensor:
        import torch.distributed as dist
        t = t.to(self.device, copy=True)
        dist.all_reduce(t, group=self.group)
        return t.div_(self.world_size).cpu()

    def broadcast(self, t: torch.Tensor, tag: str) -> torch.Tensor:
        import torch.distributed as dist
        t = t.to(self.device, copy=True)
        dist.broadcast(t, src=self._root(), group=self.group)
        return t.cpu()

    def probe_allreduce(self, t: torch.Tensor, tag: str) -> None:
        import torch.distributed as dist
        dist.all_reduce(t, group=self.group)
        self._sync()

    def probe_allgather(self, t: torch.Tensor, tag: str) -> None:
        all_gather_single(torch.empty(self.world_size * t.numel(), dtype=t.dtype, device=t.device), t, self.group)
        self._sync()

    def _root(self) -> int:
        """The group's first rank, as a global rank (what ``broadcast`` takes)."""
        import torch.distributed as dist
        if self.group is None or self.group is dist.group.WORLD:
            return 0
        return dist.get_global_rank(self.group, 0)

    def _sync(self) -> None:   # the probe times the collective, not its launch
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
