"""Bind each rank on a machine to its own share of that machine's cores, then run the program.

``hvdgc-launch --bind-cores`` starts every rank's program through this module
(``python -m hvd_gradcomp.launchers.bind PROGRAM ARGS...``): it finds the rank's index among the ranks of its
machine from the launcher's variables, restricts itself to one contiguous slice of the cores it
may use, and replaces itself with the program (``exec``), which inherits the binding, as do its
threads and data-loader workers.

Why: when ranks fill a machine's cores, the operating system moves them between cores, and
each rank's communication threads (Horovod's background loop, Gloo's event loop) take turns
with the other rank's training thread. One rank then enters ``synchronize()`` late while the
other waits for it. Measured here with 2 ranks on 2 cores (``docs/LAUNCHING.md``), binding made
every setting's step shorter and TopKQSGD's wait in ``synchronize()`` about half as long. Open
MPI's ``mpirun`` binds this way by default for 2 ranks or fewer; ``horovodrun --gloo`` and
``torchrun`` do not.

Example::

    hvdgc-launch -np 2 --bind-cores examples/train.py
    # each rank runs: python -m hvd_gradcomp.launchers.bind python examples/train.py
"""
from __future__ import annotations

import os
import sys
from typing import List, Mapping, Optional, Sequence, Tuple

LOCAL_RANK_VARIABLES: Tuple[Tuple[str, str], ...] = (
    ("HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE"),                   # horovodrun
    ("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),   # mpirun (Open MPI)
    ("LOCAL_RANK", "LOCAL_WORLD_SIZE"),                              # torchrun
)
"""(local rank, ranks on this machine) as each launcher names them, checked in this order."""


class BindError(RuntimeError):
    """The rank cannot be bound; the message names the problem and the fix."""


def local_rank(environ: Mapping[str, str]) -> Tuple[int, int]:
    """(this rank's index on its machine, ranks on the machine), from the launcher's variables.

    >>> local_rank({"HOROVOD_LOCAL_RANK": "1", "HOROVOD_LOCAL_SIZE": "2"})
    (1, 2)
    >>> local_rank({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "4"})
    (0, 4)
    """
    for rank_name, size_name in LOCAL_RANK_VARIABLES:
        if rank_name in environ and size_name in environ:
            try:
                rank, size = int(environ[rank_name]), int(environ[size_name])
            except ValueError:
                raise BindError(f"{rank_name}={environ[rank_name]!r} / {size_name}={environ[size_name]!r} "
                                "are not integers") from None
            if not 0 <= rank < size:
                raise BindError(f"{rank_name}={rank} is outside 0..{size - 1} ({size_name}={size})")
            return rank, size
    names = ", ".join(f"{r}/{s}" for r, s in LOCAL_RANK_VARIABLES)
    raise BindError(f"cannot tell this rank's place on its machine: none of {names} is set. --bind-cores works "
                    "under horovodrun, mpirun and torchrun; under srun, Slurm binds (--cpu-bind=cores)")


def core_share(cores: Sequence[int], rank: int, size: int) -> List[int]:
    """Rank ``rank`` of ``size``'s slice of ``cores``: contiguous, as equal as the count allows
    (the first ``len(cores) % size`` ranks get one more). With fewer cores than ranks, ranks
    share cores round-robin (one core each).

    >>> core_share([0, 1], 1, 2)
    [1]
    >>> core_share(range(8), 0, 3), core_share(range(8), 2, 3)
    ([0, 1, 2], [6, 7])
    >>> core_share([0, 1], 2, 3)
    [0]
    """
    cores = sorted(cores)
    if size > len(cores):
        return [cores[rank % len(cores)]]
    base, extra = divmod(len(cores), size)
    start = rank * base + min(rank, extra)
    return cores[start:start + base + (1 if rank < extra else 0)]


def bind() -> List[int]:
    """Restrict this process to its rank's share of the cores it may use now; returns the share."""
    rank, size = local_rank(os.environ)
    share = core_share(os.sched_getaffinity(0), rank, size)
    os.sched_setaffinity(0, share)
    return share


def main(argv: Optional[Sequence[str]] = None) -> None:
    """``python -m hvd_gradcomp.launchers.bind PROGRAM [ARGS...]``: bind, then exec the program."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        sys.exit("usage: python -m hvd_gradcomp.launchers.bind PROGRAM [ARGS...]")
    try:
        bind()
    except (BindError, OSError) as err:
        sys.exit(f"hvdgc-launch --bind-cores: {err}")
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main()
