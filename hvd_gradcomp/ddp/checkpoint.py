"""Checkpoints of the DDP hook's state: one rank's, or every rank's in one dict that rank 0 writes.

Residuals differ between ranks, and Lightning, accelerate and most scripts write a checkpoint from rank
0 alone. :func:`state_dict` with ``all_ranks=True`` is a collective (call it on every rank): rank 0 gets
every rank's state, tensors on the CPU and plain types only (``torch.load(..., weights_only=True)`` reads
it); other ranks get a stub. Every rank loads that one file, and :func:`load_state_dict` takes its own part,
back on its parameters' device::

    hook = state.state_dict(all_ranks=True)                      # every rank
    if dist.get_rank() == 0:
        torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "hook": hook}, "ckpt.pt")
    ...
    state.load_state_dict(torch.load("ckpt.pt")["hook"])          # every rank: its own residuals

On another number of ranks an all-ranks state restarts error feedback (residuals are per rank, and
QSGD's per chunk of the ranks, so none fits); the exchange counter goes on and a warning says so. A
per-rank file loaded on another rank or rank count is refused naming both fixes.
"""
from __future__ import annotations

import warnings
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from ..auto import Auto
from ..codecs.compressor import GradientCompressor
from ..codecs.steps import state_to_cpu, state_to_device

STATE_VERSION = 1


def state_dict(state: Any, all_ranks: bool = False) -> Dict[str, Any]:
    """``state``'s (a :class:`~hvd_gradcomp.ddp.GradCompState`) checkpoint; see the module docstring."""
    comp = state.compression
    ours = isinstance(comp, (GradientCompressor, Auto))
    mine = {"version": STATE_VERSION, "iter": state.iter, "rank": state.rank, "world_size": state.world_size,
            "compressor": type(comp).__name__ if ours else repr(comp),
            "compression": comp.state_dict() if ours else None}
    if not all_ranks:
        return mine
    parts: Optional[List[Any]] = [None] * state.world_size if state.rank == 0 else None
    # on the CPU: every rank's tensors unpickle on rank 0 without touching the other ranks' devices
    dist.gather_object(state_to_cpu(mine), parts, dst=dist.get_global_rank(state.process_group, 0),
                       group=state.process_group)
    return {"version": STATE_VERSION, "all_ranks": True, "world_size": state.world_size, "iter": state.iter,
            "ranks": parts}


def load_state_dict(state: Any, saved: Dict[str, Any]) -> None:
    """Continue ``state`` from :func:`state_dict`'s ``saved``; see the module docstring."""
    if not isinstance(saved, dict) or saved.get("version") != STATE_VERSION:
        version = saved.get("version") if isinstance(saved, dict) else type(saved).__name__
        raise ValueError(f"hook state of version {version!r}; this library reads {STATE_VERSION}")
    if saved.get("all_ranks"):
        part = _own_part(state, saved)
        if part is None:
            return
        saved = part
    if (saved["rank"], saved["world_size"]) != (state.rank, state.world_size):
        raise ValueError(f"hook state saved by rank {saved['rank']} of {saved['world_size']} loaded on rank "
                         f"{state.rank} of {state.world_size}: residuals are per rank. Load each rank's own "
                         "file with the same number of ranks, or save with state.state_dict(all_ranks=True) "
                         "on every rank (one dict, written by rank 0, that every rank loads)")
    comp = state.compression
    ours = isinstance(comp, (GradientCompressor, Auto))
    mine = type(comp).__name__ if ours else repr(comp)
    if saved["compressor"] != mine:
        raise ValueError(f"hook state was saved with compression {saved['compressor']}, this state uses "
                         f"{mine}; build the state with the same compression")
    if ours:
        comp.load_state_dict(state_to_device(saved["compression"], _device(state)))
    _resume_at(state, int(saved["iter"]))


def _own_part(state: Any, saved: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """This rank's part of an all-ranks state; None when the job's rank count differs (error feedback
    restarts, said in a warning)."""
    parts = saved.get("ranks")
    if parts is None:
        raise ValueError("this hook state came from state_dict(all_ranks=True) on a rank other than 0, which "
                         "holds no rank's residuals: save the dict that rank 0 got")
    if saved["world_size"] != state.world_size:
        if state.rank == 0:
            warnings.warn(f"hvd_gradcomp DDP hook: the checkpoint's hook state was saved by {saved['world_size']} "
                          f"ranks and this job has {state.world_size}: residuals are per rank, so error feedback "
                          "restarts from zero here (as does a feedback policy's warm-up, e.g. 'frozen'); the "
                          f"exchange counter continues at {saved['iter']}. Resume on {saved['world_size']} ranks "
                          "to continue exactly.", RuntimeWarning, stacklevel=4)
        _resume_at(state, int(saved["iter"]))
        return None
    return parts[state.rank]


def _resume_at(state: Any, step: int) -> None:
    state.iter = step
    state.comm_stats.resume_at(step)


def _device(state: Any) -> Optional[torch.device]:
    """Where this rank's parameters (so its residuals) live."""
    return next(iter(state._names)).device if state._names else None
