"""The DDP hook inside the training frameworks most people use (docs/INTEGRATIONS.md).

* :mod:`hvd_gradcomp.integrations.lightning`: ``GradCompStrategy``, a Lightning ``DDPStrategy`` that
  registers the hook once Lightning has wrapped the model, with the trainer's optimizer, keeps every
  rank's hook state in Lightning's checkpoints and turns ``gradient_clip_val`` into the compressor's
  ``clip=`` (``pip install 'hvd-gradcomp[lightning]'``).
* :mod:`hvd_gradcomp.integrations.accelerate`: ``register`` for what ``accelerator.prepare`` returns,
  and ``register_for_checkpointing``, which keeps every rank's hook state in ``accelerator.save_state``
  (``pip install 'hvd-gradcomp[accelerate]'``).

Each module imports its framework on first use, so importing them needs neither; a missing one
raises an ImportError naming the extra (:func:`~hvd_gradcomp.integrations.extras.require`).
"""
from .extras import require

__all__ = ["require"]
