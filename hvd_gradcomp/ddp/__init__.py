"""The hvd-gradcomp compressors for PyTorch ``DistributedDataParallel``: a communication hook.

One call registers the hook on a DDP model and returns its state::

    import torch.distributed as dist
    import hvd_gradcomp as gc
    from hvd_gradcomp import ddp as gc_ddp

    dist.init_process_group("nccl")          # or "gloo" on CPU
    model = torch.nn.parallel.DistributedDataParallel(net, device_ids=[local_rank])
    state = gc_ddp.register(model, compression=gc.TopKQSGD(ratio=0.01, bits=8))
    ...
    loss.backward(); opt.step()
    print(state.comm_stats.summary(), state.last_step_bytes)

Underneath is a hook + state pair in the style of ``torch.distributed.algorithms.ddp_comm_hooks``
(:func:`gradcomp_hook`, :class:`GradCompState`), which can also be registered by hand::

    state = gc_ddp.GradCompState(None, gc.QSGD(bits=8), named_parameters=net.named_parameters())
    model.register_comm_hook(state, gc_ddp.gradcomp_hook)

How each bucket travels (``torch.distributed`` collectives only, so Gloo, NCCL and MPI alike):

* sparse payloads (TopK, TopKQSGD): every parameter of the bucket is compressed on its own
  (error feedback keyed by its name); the payloads are concatenated, the ranks all_gather
  their sizes, then the payloads padded to the largest; every rank decodes all of them in
  rank order, so every rank ends with bit-identical gradients;
* PowerSGD: two ``all_reduce`` rounds of float32 factors (``P``, then ``Q`` from the averaged
  ``P``), as torch's PowerSGD hook, with each parameter's residual and ``Q`` kept by its name;
* QSGD: the compressed allreduce of the Horovod wrappers: each parameter is quantised in P
  chunks, ``all_to_all_single`` sends chunk i to rank i, rank i averages and re-quantises it
  (with its own error feedback) and an ``all_gather`` returns every chunk;
* dense: parameters smaller than ``min_compress_numel`` and dtypes the codecs do not carry
  (float64) are averaged by ``all_reduce`` (float32 ones under ``min_compress_numel`` or
  ``exclude=``d as float16 with error feedback of the cast: the compressor's
  ``exempt="fp16"``), as are whole buckets before ``start_compress_iter`` and with
  ``compression=None``; ``compression=torch.float16`` casts like torch's fp16 hook.
* ``compression=gc.Auto()``: each bucket takes the road that costs least, measured while
  training runs (sparse, QSGD, fp16 or dense; see :class:`_AutoExchange` and docs/AUTO.md), the
  same on every rank; ``state.auto_report()`` says which and why.

The hook returns a future and never waits: second-round collectives are chained on the
first round's futures and issued, in bucket order, on a second process group, so that their
order is the same on every rank whichever thread completes a future first.

Non-finite gradients (NaN/Inf, e.g. a loss-scaler overflow) on any rank make that bucket NaN
on every rank, as uncompressed DDP would, so ``GradScaler`` skips the step everywhere; the
rank with the bad values leaves its residuals untouched and nobody hangs.

The package's modules:

* :mod:`~hvd_gradcomp.ddp.hook`: :func:`gradcomp_hook` and :func:`register`;
* :mod:`~hvd_gradcomp.ddp.state`: :class:`GradCompState`, the hook's state, built of its parts:
  :mod:`~hvd_gradcomp.ddp.plans` (each bucket's layout) and :mod:`~hvd_gradcomp.ddp.handoff` (what the
  exchange owes the optimizer when it steps); :mod:`~hvd_gradcomp.ddp.policy`: its feedback policy;
* :mod:`~hvd_gradcomp.ddp.exchanges`: the drivers, how a bucket travels on ``torch.distributed``, one
  per declared collective; :mod:`~hvd_gradcomp.ddp.auto`: Auto's road per bucket;
* :mod:`~hvd_gradcomp.ddp.env`: :func:`compression_from_env` and the warning about ``HVDGC_*`` settings
  the script did not read;
* :mod:`~hvd_gradcomp.ddp.accumulate`: :class:`GradientAccumulator` (the one of
  :mod:`hvd_gradcomp.horovod.accumulate`, which serves both wrappers);
* :mod:`~hvd_gradcomp.ddp.checkpoint`: the hook's state in a checkpoint; :mod:`~hvd_gradcomp.ddp.join`:
  steps after a rank joined under ``model.join()``.
"""
from .state import DENSE_DTYPES, HOOK_POLICIES, STATE_VERSION, GradCompState, torch_optimizer
from .hook import gradcomp_hook, register
from .env import compression_from_env, unread_settings_message
from .accumulate import GradientAccumulator
from ..codecs.compressor import DEFAULT_MIN_COMPRESS_NUMEL   # register()'s default min_compress_numel
# Private names the integrations and tests read here: the state register() gave each model, the check of
# register()'s compression argument, and its default compressor.
from .state import _STATES, _check_compression  # noqa: F401
from .hook import _DEFAULT_COMPRESSION  # noqa: F401

__all__ = ["GradCompState", "gradcomp_hook", "register", "compression_from_env", "GradientAccumulator",
           "torch_optimizer", "DENSE_DTYPES", "STATE_VERSION", "HOOK_POLICIES", "unread_settings_message",
           "DEFAULT_MIN_COMPRESS_NUMEL"]
