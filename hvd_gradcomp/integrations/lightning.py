"""The DDP hook in Lightning: ``Trainer(strategy=GradCompStrategy(compression=...))``.

::

    import lightning.pytorch as pl
    import hvd_gradcomp as gc
    from hvd_gradcomp.integrations.lightning import GradCompStrategy

    strategy = GradCompStrategy(compression=gc.TopKQSGD(ratio=0.01, bits=8))
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, gradient_clip_val=1.0,
                         accumulate_grad_batches=4)
    trainer.fit(model, ckpt_path=None)           # or ckpt_path="last.ckpt": every rank's hook state comes back
    print(strategy.gradcomp_state.comm_stats.summary())

``GradCompStrategy`` is Lightning's ``DDPStrategy`` (every keyword of it is accepted, e.g.
``bucket_cap_mb``, ``static_graph``, ``find_unused_parameters``) plus four things:

* **the hook is registered after setup**: once ``DDPStrategy.setup`` has wrapped the model in
  ``DistributedDataParallel`` and built the optimizer from ``configure_optimizers``, with that
  optimizer (the torch optimizer inside Lightning's wrapper), so the feedback policy fits it
  (``frozen`` for AdamW, momentum correction for SGD with momentum). Lightning's own
  ``ddp_comm_hook=`` cannot take this hook (its state needs the process group and the
  optimizer, and Lightning registers comm hooks on CUDA only), so it is refused here;
* **checkpoints keep every rank's residuals**: Lightning writes checkpoints from rank 0 only;
  :meth:`save_checkpoint` (run on every rank by ``trainer.save_checkpoint`` and ``ModelCheckpoint``)
  puts ``state.state_dict(all_ranks=True)`` under ``checkpoint["hvd_gradcomp"]``, and a resume
  (``trainer.fit(..., ckpt_path=...)``) gives each rank its own part after the optimizer's state;
* **``gradient_clip_val`` becomes the compressor's ``clip=``** (``gradient_clip_algorithm="norm"``,
  Lightning's default): each rank's whole gradient is clipped to that global norm before it is
  compressed, and Lightning does not clip the averages (the trainer's ``gradient_clip_val`` reads
  ``None`` during ``fit``). Clipping the averages would be wrong here: under ``frozen`` a
  compressed parameter's ``p.grad`` holds zeros at that point (its update is applied by the
  optimizer step itself), under ``classic`` and ``momentum`` each sent coordinate carries the
  steps it was held back. ``gradient_clip_algorithm="value"`` has no such counterpart and is refused;
* **accumulation**: ``accumulate_grad_batches=N`` runs the first N-1 micro-batches under
  ``no_sync`` (Lightning does), so the hook exchanges once per optimizer step, as
  :class:`hvd_gradcomp.ddp.GradientAccumulator`.

This module imports Lightning only when ``GradCompStrategy`` is first used (PEP 562): without it,
that raises an ImportError naming ``pip install 'hvd-gradcomp[lightning]'``.
"""
import copy
import warnings
from typing import Any, Dict, Optional

from .. import ddp as gc_ddp
from .. import feedback as fb
from ..auto import Auto
from ..codecs.compressor import GradientCompressor
from .extras import require

CHECKPOINT_KEY = "hvd_gradcomp"
"""Where :class:`GradCompStrategy` keeps the hook state in a Lightning checkpoint."""

# DDPStrategy's keywords for a hook of Lightning's own: they would register a second hook (CUDA) or none (CPU).
_REFUSED = ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper", "model_averaging_period")


def _build() -> type:
    """GradCompStrategy, a subclass of the installed ``lightning.pytorch`` ``DDPStrategy``."""
    pl = require("lightning.pytorch", "lightning", "hvd_gradcomp.integrations.lightning.GradCompStrategy")
    from lightning.pytorch.strategies import DDPStrategy
    from lightning.pytorch.trainer.states import TrainerFn

    class GradCompStrategy(DDPStrategy):
        """Lightning's ``DDPStrategy`` with the hvd-gradcomp DDP hook (see :mod:`hvd_gradcomp.integrations.lightning`).

        Args:
            compression: as :func:`hvd_gradcomp.ddp.register` takes it (a compressor, ``gc.Auto()``,
                ``None``, ``torch.float16``); the default, a fresh ``TopKQSGD(ratio=0.01, bits=8)``.
            start_compress_iter, min_compress_numel: as :func:`hvd_gradcomp.ddp.register`.
            **kwargs: ``DDPStrategy``'s (``bucket_cap_mb=``, ``static_graph=``, ``process_group_backend=``, ...).

        After ``trainer.fit`` has set up, ``strategy.gradcomp_state`` is the
        :class:`hvd_gradcomp.ddp.GradCompState` (``comm_stats``, ``iter``: exchanges so far).
        """

        strategy_name = "hvdgc_ddp"

        def __init__(self, compression: Any = gc_ddp._DEFAULT_COMPRESSION, start_compress_iter: int = 0,
                     min_compress_numel: Optional[int] = None, **kwargs: Any) -> None:
            refused = [k for k in _REFUSED if kwargs.get(k) is not None]
            if refused:
                raise ValueError(f"GradCompStrategy registers hvd-gradcomp's hook itself; drop {', '.join(refused)} "
                                 "(DDP takes one communication hook per model)")
            if compression is gc_ddp._DEFAULT_COMPRESSION:
                compression = copy.deepcopy(compression)
            gc_ddp._check_compression(compression)
            super().__init__(**kwargs)
            self.compression = compression
            self.start_compress_iter = start_compress_iter
            self.min_compress_numel = min_compress_numel
            self.gradcomp_state: Optional[gc_ddp.GradCompState] = None
            self._spare = copy.deepcopy(compression)   # a second fit() on this strategy needs a compressor of its own
            self._clip_moved: Optional[Any] = None     # (trainer, its gradient_clip_val), given back at teardown

        def setup(self, trainer: "pl.Trainer") -> None:
            super().setup(trainer)   # wraps the model in DDP, then builds the optimizers
            if trainer.state.fn == TrainerFn.FITTING:
                self._register(trainer)

        def _register(self, trainer: "pl.Trainer") -> None:
            previous = self.gradcomp_state
            if previous is not None:   # fit() again: a fresh compressor carrying on from this rank's state
                self.compression = copy.deepcopy(self._spare)
            optimizer = _one_optimizer(self.optimizers)
            self._take_clipping(trainer)
            extra: Dict[str, Any] = {} if self.min_compress_numel is None else {
                "min_compress_numel": self.min_compress_numel}
            self.gradcomp_state = gc_ddp.register(self.model, compression=self.compression, optimizer=optimizer,
                                                  start_compress_iter=self.start_compress_iter, **extra)
            if previous is not None:
                self.gradcomp_state.load_state_dict(previous.state_dict())

        def _take_clipping(self, trainer: "pl.Trainer") -> None:
            """``gradient_clip_val`` (norm) -> the compressor's ``clip=``; Lightning then clips nothing."""
            value, algorithm = trainer.gradient_clip_val, trainer.gradient_clip_algorithm
            if not value:   # None or 0: Lightning does not clip
                return
            comp = self.compression
            if isinstance(comp, Auto):
                raise ValueError("gradient_clip_val with GradCompStrategy(compression=gc.Auto()): Auto's sparse road "
                                 "hands the optimizer coordinates that carry the steps they were held back, which "
                                 "clipping the averages would shrink far more than meant, and Auto has no clip=; "
                                 "drop gradient_clip_val or use a compressor with clip=")
            if not isinstance(comp, GradientCompressor):
                return   # None, float16: the averages are plain DDP's, Lightning clips them as it would
            if algorithm is not None and str(getattr(algorithm, "value", algorithm)) != "norm":
                raise ValueError(f"gradient_clip_algorithm={str(getattr(algorithm, 'value', algorithm))!r} with "
                                 f"GradCompStrategy({comp!r}): the compressor clips each rank's gradient by its "
                                 "global norm only (clip=), and clipping the compressed averages by value would act "
                                 "on what they carry (held-back coordinates, or zeros under 'frozen'). Use "
                                 "gradient_clip_algorithm='norm' (the default)")
            if comp.clip is not None and comp.clip != value:
                raise ValueError(f"gradient_clip_val={value} and the compressor's clip={comp.clip} disagree: give "
                                 "the norm once (either moves into the compressor's clip=)")
            comp.clip = float(value)
            self._clip_moved = (trainer, value)
            trainer.gradient_clip_val = None
            if self.global_rank == 0:
                fb.announce(f"GradCompStrategy moved gradient_clip_val={value} into {comp!r}: each rank's whole "
                            "gradient is clipped to that global norm before it is compressed; Lightning does not "
                            "clip the averages.")

        def save_checkpoint(self, checkpoint: Dict[str, Any], filepath: Any,
                            storage_options: Optional[Any] = None) -> None:
            """Lightning's save (rank 0 writes), with every rank's hook state under ``checkpoint["hvd_gradcomp"]``.

            Runs on every rank (``trainer.save_checkpoint`` and ``ModelCheckpoint`` call it there), so the
            collective ``state_dict(all_ranks=True)`` meets every rank. Weights-only checkpoints, which hold
            no optimizer state either, hold no hook state."""
            state = self.gradcomp_state
            if state is not None and "optimizer_states" in checkpoint:
                checkpoint[CHECKPOINT_KEY] = state.state_dict(all_ranks=True)
            super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

        def load_optimizer_state_dict(self, checkpoint: Any) -> None:
            """Lightning's restore of the optimizers (on every rank, after :meth:`setup`), then this rank's part of
            the hook state, as :func:`hvd_gradcomp.ddp.register`'s state expects: after the optimizer's."""
            super().load_optimizer_state_dict(checkpoint)
            state = self.gradcomp_state
            if state is None:
                return
            if CHECKPOINT_KEY in checkpoint:
                state.load_state_dict(checkpoint[CHECKPOINT_KEY])
            elif isinstance(state.compression, (GradientCompressor, Auto)) and self.global_rank == 0:
                warnings.warn("GradCompStrategy: the checkpoint holds no hvd_gradcomp hook state (it was not saved "
                              "through GradCompStrategy): error feedback and the feedback policy's state start "
                              "afresh", RuntimeWarning, stacklevel=2)

        def teardown(self) -> None:
            if self._clip_moved is not None:   # the trainer as it was built (a later fit() moves it again)
                trainer, value = self._clip_moved
                trainer.gradient_clip_val = value
            self._clip_moved = None
            super().teardown()

    GradCompStrategy.__module__ = __name__
    GradCompStrategy.__qualname__ = "GradCompStrategy"   # pickled by name (spawned launchers), found by __getattr__
    return GradCompStrategy


def _one_optimizer(optimizers: Any) -> Any:
    """The one torch optimizer Lightning built (``None`` without any); the hook takes one."""
    optimizers = list(optimizers or [])
    if len(optimizers) > 1:
        raise ValueError(f"GradCompStrategy: configure_optimizers returned {len(optimizers)} optimizers; the hook's "
                         "feedback policy follows one optimizer (the one stepping the model's parameters)")
    return gc_ddp.torch_optimizer(optimizers[0]) if optimizers else None


_BUILT: Dict[str, type] = {}


def __getattr__(name: str) -> Any:
    if name == "GradCompStrategy":
        if name not in _BUILT:
            _BUILT[name] = _build()
        return _BUILT[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["GradCompStrategy", "CHECKPOINT_KEY"]  # noqa: F822 - GradCompStrategy: module __getattr__
