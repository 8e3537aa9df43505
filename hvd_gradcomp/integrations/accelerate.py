"""The DDP hook under Hugging Face accelerate: what ``accelerator.prepare`` returns goes in as it is.

::

    from accelerate import Accelerator
    import hvd_gradcomp as gc
    from hvd_gradcomp.integrations import accelerate as gc_accelerate

    accelerator = Accelerator(gradient_accumulation_steps=4)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    state = gc_accelerate.register(model, opt, compression=gc.TopKQSGD(ratio=0.01, bits=8, clip=1.0))
    gc_accelerate.register_for_checkpointing(accelerator, state)   # save_state/load_state keep every rank's part
    for x, y in loader:
        with accelerator.accumulate(model):                         # no_sync for 3 of 4: one exchange per step
            accelerator.backward(loss_fn(model(x), y))
            opt.step(); opt.zero_grad()

Why a helper for checkpoints: ``accelerator.save_state`` calls ``state_dict()`` of every object given
to ``register_for_checkpointing`` on *every* process (``accelerate.checkpointing.save_custom_state``),
but only the main process writes the file; ``load_state`` has every process read that one file.
The hook's own ``state_dict()`` is this rank's residuals only, so a resume would give every rank
rank 0's. :class:`AllRanksHookState` answers ``state_dict()`` with
``state.state_dict(all_ranks=True)`` (a collective: it meets every rank because ``save_state`` runs
there) and loads each rank's own part. Call ``accelerator.save_state`` on every process, as
accelerate requires (it also saves every process's random states); called on the main process only,
the collective would wait for the others until the process group's timeout.

Clipping: ``accelerator.clip_grad_norm_`` clips the averaged, compressed gradients (under ``frozen``
a compressed parameter's ``p.grad`` holds zeros there); give the norm to the compressor instead,
``clip=``, which clips each rank's whole gradient before it is compressed.

This module needs accelerate only for :func:`register_for_checkpointing` (``pip install
'hvd-gradcomp[accelerate]'``); :func:`register` takes any DDP model and optimizer.
"""
from typing import Any, Dict

import torch

from .. import ddp as gc_ddp
from .extras import require


def register(model: Any, optimizer: Any = None, compression: Any = gc_ddp._DEFAULT_COMPRESSION,
             **kwargs: Any) -> gc_ddp.GradCompState:
    """:func:`hvd_gradcomp.ddp.register` on what ``accelerator.prepare`` returned.

    Args:
        model: the prepared model: ``DistributedDataParallel`` (what ``prepare`` makes of a model
            when several processes run), or ``torch.compile``'s wrapper around one.
        optimizer: the prepared optimizer (an ``AcceleratedOptimizer``: the torch optimizer inside it
            picks the feedback policy and gets the step pre-hooks, :func:`hvd_gradcomp.ddp.torch_optimizer`)
            or a torch optimizer; None: classic error feedback.
        compression: as :func:`hvd_gradcomp.ddp.register` (a fresh ``TopKQSGD(ratio=0.01, bits=8)`` by default).
        **kwargs: :func:`hvd_gradcomp.ddp.register`'s others (``start_compress_iter``, ``min_compress_numel``,
            ``process_group``).

    >>> register(torch.nn.Linear(2, 2))
    Traceback (most recent call last):
    ...
    TypeError: register() takes the model accelerator.prepare() returned, a DistributedDataParallel; got Linear. prepare() wraps the model in DDP only when several processes run (torchrun --nproc-per-node N) and, without a GPU, only with Accelerator(cpu=True): otherwise each process trains alone and there is nothing to exchange
    """
    inner = getattr(model, "_orig_mod", model)   # torch.compile (accelerate's dynamo_backend) wraps the DDP model
    if not isinstance(inner, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(f"register() takes the model accelerator.prepare() returned, a DistributedDataParallel; got "
                        f"{type(inner).__name__}. prepare() wraps the model in DDP only when several processes run "
                        "(torchrun --nproc-per-node N) and, without a GPU, only with Accelerator(cpu=True): otherwise "
                        "each process trains alone and there is nothing to exchange")
    return gc_ddp.register(inner, compression=compression, optimizer=optimizer, **kwargs)


class AllRanksHookState:
    """A :class:`hvd_gradcomp.ddp.GradCompState` as ``accelerator.register_for_checkpointing`` needs it:
    ``state_dict()`` is every rank's state (a collective, ``state.state_dict(all_ranks=True)``),
    ``load_state_dict()`` restores this rank's own part (see the module's docstring for why)."""

    def __init__(self, state: gc_ddp.GradCompState) -> None:
        if not isinstance(state, gc_ddp.GradCompState):
            raise TypeError(f"AllRanksHookState wraps the GradCompState that register() returned, got "
                            f"{type(state).__name__}")
        self.state = state

    def state_dict(self) -> Dict[str, Any]:
        return self.state.state_dict(all_ranks=True)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.state.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"AllRanksHookState({self.state!r})"


def register_for_checkpointing(accelerator: Any, state: gc_ddp.GradCompState) -> AllRanksHookState:
    """``accelerator.register_for_checkpointing`` for the hook's state, keeping every rank's part.

    ``accelerator.save_state(dir)`` (on every process) then writes every rank's residuals into the main
    process's file, and ``accelerator.load_state(dir)`` gives each rank its own, after the optimizer's
    state (accelerate loads registered objects last), as the hook expects. Returns the registered object.
    """
    accelerate = require("accelerate", "accelerate", "register_for_checkpointing")
    if not isinstance(accelerator, accelerate.Accelerator):
        raise TypeError(f"register_for_checkpointing takes the Accelerator, got {type(accelerator).__name__}")
    holder = AllRanksHookState(state)
    accelerator.register_for_checkpointing(holder)
    return holder


__all__ = ["register", "register_for_checkpointing", "AllRanksHookState"]
