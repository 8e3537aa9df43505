"""Gradient accumulation: N small backward passes, one exchange and one optimizer step, on either
wrapper: :class:`GradientAccumulator` is the one class behind ``hvd_gradcomp.GradientAccumulator``
(Horovod) and ``hvd_gradcomp.ddp.GradientAccumulator`` (DDP).

Micro-batches of 1-4 samples fit in memory; summing gradients over N of them gives the
gradient of one N times larger batch, provided each loss is scaled by 1/N (without it the
effective learning rate is N times too large). :class:`GradientAccumulator` does the
scaling, counting and stepping once, for both wrappers; what differs between them is a small part
it owns (:class:`HorovodWrapper`, :class:`DDPWrapper`): how the window's exchange is held back and
how a partial window is averaged.

* Horovod: around a DistributedOptimizer built with ``backward_passes_per_step=N`` (ours or
  Horovod's), which exchanges once per window::

    opt = gc.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                  compression=gc.TopKQSGD(), backward_passes_per_step=8)
    acc = gc.GradientAccumulator(opt, steps=8, micro_batch=4)
    print(acc.describe())     # micro-batch 4 x 8 steps x 2 ranks = effective batch 64
    for x, y in loader:
        acc.backward(loss_fn(model(x), y))     # steps on every 8th call
    acc.flush()               # the last, partial window of the epoch: steps if anything is left

* DDP: the first N-1 micro-batches of a window run under ``ddp_model.no_sync()`` (forward *and*
  backward inside :meth:`GradientAccumulator.accumulate`, since DDP decides at the forward pass whether
  the backward pass synchronises); the N-th runs normally, so the hook compresses and exchanges the
  accumulated gradient once::

    acc = gc_ddp.GradientAccumulator(model, opt, steps=8, micro_batch=4)
    for x, y in loader:
        with acc.accumulate():
            acc.backward(loss_fn(model(x), y))      # steps on every 8th call
    acc.flush()

``max_grad_norm=1.0`` clips the averaged gradients before each step (``last_grad_norm`` holds
the norm before clipping), the usual recipe with AdamW.

The partial window: with k < N micro-batches left, each gradient was scaled by 1/N, so
``flush()`` rescales them by N/k before stepping: the step uses the mean over the k
micro-batches it saw, exactly as a full window uses the mean over N. Under DDP those gradients
never left the rank: ``flush()`` averages them with one uncompressed allreduce per dtype first
(the hook does not see that window: under ``feedback="frozen"`` the wrapped Adam steps it with its
own state). Call it on every rank.
"""
from __future__ import annotations

import io
import warnings
from contextlib import contextmanager, nullcontext
from typing import Any, ContextManager, Dict, Iterator, List, Optional, Tuple

import torch

from ..codecs.steps import state_to_cpu, state_to_device


def check_max_grad_norm(value: Any) -> Optional[float]:
    """``value`` as a float if it is a positive number, None for None, else a ValueError.

    >>> check_max_grad_norm(1), check_max_grad_norm(None)
    (1.0, None)
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or value == float("inf"):
        raise ValueError(f"max_grad_norm must be a positive number (the norm clip_grad_norm_ clips the averaged "
                         f"gradients to before each step) or None, got {value!r}")
    return float(value)


def check_clippable(compression: Any) -> None:
    """Raise a ValueError when clipping the averaged gradients would be wrong for ``compression``.

    A TopK-type compressor under error feedback on gradients (``classic``) or DGC's momentum
    correction hands the optimizer each sent coordinate's update accumulated over the steps it was
    held back: its norm is ~1/sqrt(ratio) times a gradient's, so ``clip_grad_norm_`` shrinks every
    step far more than meant (the study's CNN with momentum SGD and ``clip_grad_norm_(1.0)``: about
    4x uncompressed's held-out loss, 3 seeds). ``frozen`` and ``update`` hand it zeros (they move
    the parameters themselves), QSGD an unbiased average: those clip what they can. ``Auto``'s
    sparse road is classic.

    >>> check_clippable(None)
    """
    from ..auto import Auto

    if isinstance(compression, Auto) or getattr(compression, "carries_held_back", False):
        what = "Auto()'s sparse road (classic error feedback)" if isinstance(compression, Auto) else \
            f"{compression!r} with feedback '{compression.feedback.key}'"
        raise ValueError(
            f"max_grad_norm cannot clip the averaged gradients of {what}: each sent coordinate carries the update "
            "of the steps it was held back, whose norm is far above a gradient's, so clipping would shrink every "
            "step far more than meant. Bound each rank's gradient before it is compressed instead, with the "
            "compressor's clip= (e.g. TopKQSGD(ratio=0.01, bits=8, clip=1.0)), and drop max_grad_norm.")


Settings = Tuple[int, Optional[int], Optional[float]]   # steps, micro_batch, max_grad_norm


class GradientAccumulator:
    """Scale, count and step; see the module docstring. Two call forms, one per wrapper::

        GradientAccumulator(optimizer, steps, micro_batch=None, max_grad_norm=None)             # Horovod
        GradientAccumulator(ddp_model, optimizer, steps, micro_batch=None, max_grad_norm=None)  # DDP

    The first argument tells them apart: a ``torch.nn.Module`` (the ``DistributedDataParallel`` model)
    or a DistributedOptimizer (hvd_gradcomp's or Horovod's, built with ``backward_passes_per_step=steps``).

    ``max_grad_norm``: clip the averaged gradients to this norm before each step (Horovod:
    ``synchronize()``, ``clip_grad_norm_``, ``step()``); the norm before clipping is kept in
    ``last_grad_norm`` (a tensor). Under ``feedback="frozen"`` (Adam/AdamW with a TopK compressor),
    once a tensor's dense warm-up is over its ``p.grad`` holds zeros at the step (its update is
    applied there): the norm and the clipping then cover the uncompressed tensors only; the
    compressor's ``clip=`` bounds the compressed ones. Refused (a ValueError, when built or at the
    first step) where clipping the averages would be wrong: see :func:`check_clippable`.

    Attributes: ``steps`` (N), ``micro_batch``, ``optimizer``, ``optimizer_steps`` (steps taken so far),
    ``pending`` (micro-batches in the current window), ``last_grad_norm``; with DDP also ``model``.

    >>> from types import SimpleNamespace
    >>> acc = GradientAccumulator(SimpleNamespace(backward_passes_per_step=4), steps=4, micro_batch=2)
    >>> acc.effective_batch(ranks=3), type(acc.wrapper).__name__
    (24, 'HorovodWrapper')
    """

    def __init__(self, model_or_optimizer: Any, *args: Any, **kwargs: Any) -> None:
        form = _ddp_form if isinstance(model_or_optimizer, torch.nn.Module) else _horovod_form
        self.wrapper, (steps, micro_batch, max_grad_norm) = form(model_or_optimizer, *args, **kwargs)
        self.wrapper.check(steps)
        self.optimizer = self.wrapper.optimizer
        self.steps = steps
        self.micro_batch = micro_batch
        self.max_grad_norm = max_grad_norm
        if self.max_grad_norm is not None and self.wrapper.policy_settled():
            # the policy is chosen already (hvd_gradcomp.DistributedOptimizer when built, the DDP hook in
            # register()): refuse now, not at the first step
            check_clippable(self.wrapper.compression())
        self.last_grad_norm: Optional[torch.Tensor] = None
        self.pending = 0
        self.optimizer_steps = 0
        self._inside = False

    @property
    def model(self) -> Any:
        """The ``DistributedDataParallel`` model (DDP); None around a Horovod optimizer."""
        return getattr(self.wrapper, "model", None)

    @contextmanager
    def accumulate(self) -> Iterator[None]:
        """Wrap one micro-batch's forward and backward (DDP: ``no_sync()`` unless it completes the window;
        Horovod: nothing to do, the optimizer holds the exchange back)."""
        self._inside = True
        try:
            with self.wrapper.hold_back(self.pending + 1 < self.steps):
                yield
        finally:
            self._inside = False

    def backward(self, loss: torch.Tensor) -> bool:
        """``(loss / steps).backward()``; on every ``steps``-th call, step and zero the gradients.

        Returns True when this call stepped the optimizer.
        """
        if self.wrapper.needs_accumulate and not self._inside:
            raise RuntimeError("call backward() inside `with acc.accumulate():`, around the forward pass too "
                               "(DDP decides at the forward pass whether to synchronise)")
        if loss.dim() != 0:
            raise ValueError(f"loss must be a scalar (reduce it with .mean()), got shape {tuple(loss.shape)}")
        (loss / self.steps).backward()
        self.pending += 1
        if self.pending == self.steps:
            self._step()
            return True
        return False

    def flush(self) -> bool:
        """Step on a partial window (see the module docstring); False if nothing is pending."""
        if self.pending == 0:
            return False
        self.wrapper.average_partial(self.steps / self.pending)
        self._step()
        return True

    def _step(self) -> None:
        self.last_grad_norm = self.wrapper.step(self.max_grad_norm, self.last_grad_norm)
        self.optimizer.zero_grad()
        self.pending = 0
        self.optimizer_steps += 1

    def effective_batch(self, ranks: Optional[int] = None) -> Optional[int]:
        """micro_batch x steps x ranks (None when micro_batch is unknown)."""
        if self.micro_batch is None:
            return None
        return self.micro_batch * self.steps * (ranks if ranks is not None else self.wrapper.ranks())

    def describe(self) -> str:
        ranks = self.wrapper.ranks()
        mb = "?" if self.micro_batch is None else str(self.micro_batch)
        eff = self.effective_batch(ranks)
        return f"micro-batch {mb} x {self.steps} steps x {ranks} ranks = effective batch {eff if eff else '?'}"

    # ------------------------------------------------------------ checkpoints
    def state_dict(self, all_ranks: bool = False) -> Dict[str, Any]:
        """Optimizer state, compressor residuals and random state (DDP: the hook state's), and the window
        counters.

        Residuals differ between ranks. ``all_ranks=True`` (a collective: call it on every rank) puts every
        rank's compressor state into the dict rank 0 gets, for a checkpoint that rank 0 alone writes; each
        rank's :meth:`load_state_dict` of that one file takes its own part::

            state = acc.state_dict(all_ranks=True)          # every rank
            if hvd.rank() == 0:
                torch.save(state, "ckpt.pt")

        The default is this rank's own: save one file per rank, e.g.
        ``torch.save(acc.state_dict(), f"ckpt-rank{hvd.rank()}.pt")``. Only between windows
        (after a step or ``flush()``): gradients accumulated mid-window are not part of it.
        """
        if self.pending:
            raise ValueError(_MID_WINDOW)
        return {"optimizer": self.optimizer.state_dict(), "compression": self.wrapper.compression_state(all_ranks),
                "pending": self.pending, "optimizer_steps": self.optimizer_steps, "steps": self.steps}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (this rank's own, or on every rank the one ``all_ranks=True`` gave rank 0).
        Everything is checked before anything changes; a ``ValueError`` says what differs and what to do.
        ``state["compression"] = None`` loads the rest and restarts error feedback from zero, as does an
        all-ranks state taken on another number of ranks (with a warning)."""
        if not isinstance(state, dict):
            raise ValueError(f"expected the dict GradientAccumulator.state_dict() returns, got {type(state).__name__}")
        missing = [k for k in ("optimizer", "compression", "pending", "optimizer_steps", "steps") if k not in state]
        if missing:
            raise ValueError(f"checkpoint lacks {missing}: not a GradientAccumulator.state_dict(). Nothing was changed.")
        if state["steps"] != self.steps:
            raise ValueError(f"checkpoint was taken with steps={state['steps']}, this accumulator has "
                             f"steps={self.steps}: build the optimizer and accumulator with {state['steps']}. "
                             "Nothing was changed.")
        if state["pending"]:
            raise ValueError(_MID_WINDOW)
        compression = self.wrapper.own_compression(state["compression"])
        if compression is not None:
            self.wrapper.check_compression(compression)
        self.optimizer.load_state_dict(state["optimizer"])
        if compression is not None:
            self.wrapper.load_compression(compression)
        self.pending = 0
        self.optimizer_steps = int(state["optimizer_steps"])
        self.wrapper.resume_at(self.optimizer_steps)


def _horovod_form(optimizer: Any, steps: int, micro_batch: Optional[int] = None,
                  max_grad_norm: Optional[float] = None) -> Tuple["HorovodWrapper", Settings]:
    """``GradientAccumulator(optimizer, steps, micro_batch=None, max_grad_norm=None)``."""
    settings = _check_settings(steps, micro_batch, max_grad_norm)
    return HorovodWrapper(optimizer), settings


def _ddp_form(ddp_model: Any, optimizer: Any, steps: int, micro_batch: Optional[int] = None,
              max_grad_norm: Optional[float] = None) -> Tuple["DDPWrapper", Settings]:
    """``GradientAccumulator(ddp_model, optimizer, steps, micro_batch=None, max_grad_norm=None)``."""
    wrapper = DDPWrapper(ddp_model, optimizer)
    return wrapper, _check_settings(steps, micro_batch, max_grad_norm)


def _check_settings(steps: Any, micro_batch: Any, max_grad_norm: Any) -> Settings:
    """The checked settings of either form.

    >>> _check_settings(8, None, 1)
    (8, None, 1.0)
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1 (micro-batches, i.e. backward passes, per optimizer step), "
                         f"got {steps!r}")
    if micro_batch is not None and (isinstance(micro_batch, bool) or not isinstance(micro_batch, int)
                                    or micro_batch < 1):
        raise ValueError(f"micro_batch must be an int >= 1 (samples per backward pass) or None, got {micro_batch!r}")
    return steps, micro_batch, check_max_grad_norm(max_grad_norm)


class HorovodWrapper:
    """The Horovod side of :class:`GradientAccumulator`: a DistributedOptimizer (hvd_gradcomp's or Horovod's)
    built with ``backward_passes_per_step=steps`` holds the exchange back by itself; a partial window is
    rescaled in place; checkpoints gather every rank's compressor state through Horovod."""

    needs_accumulate = False   # backward() outside accumulate() is fine: the optimizer counts the passes

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer

    def check(self, steps: int) -> None:
        bpps = getattr(self.optimizer, "backward_passes_per_step", None)
        if bpps is None:
            raise ValueError("GradientAccumulator wraps a DistributedOptimizer (hvd_gradcomp's or Horovod's); "
                             "got a plain optimizer")
        if bpps != steps:
            raise ValueError(f"the optimizer was built with backward_passes_per_step={bpps} but steps={steps}: "
                             f"build it with backward_passes_per_step={steps}, or the exchange would happen "
                             "at the wrong time")

    def compression(self) -> Any:
        return _compressor(self.optimizer)

    def policy_settled(self) -> bool:
        """hvd_gradcomp.DistributedOptimizer chose the policy when it was built; inside stock Horovod's
        optimizer the choice waits for the first step."""
        return getattr(self.compression(), "policy_settled", False)

    def hold_back(self, hold: bool) -> ContextManager[None]:
        return nullcontext()

    def average_partial(self, scale: float) -> None:
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(scale)

    def step(self, max_grad_norm: Optional[float], last_norm: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """Step (clipped: synchronize, clip, step without a second synchronize); the norm before clipping."""
        if max_grad_norm is None:
            self.optimizer.step()
            return last_norm
        self.optimizer.synchronize()   # inside Horovod's optimizer the policy is chosen by now
        check_clippable(self.compression())
        norm = torch.nn.utils.clip_grad_norm_([p for g in self.optimizer.param_groups for p in g["params"]],
                                              max_grad_norm)
        with self.optimizer.skip_synchronize():
            self.optimizer.step()
        return norm

    def ranks(self) -> int:
        return _size()

    def compression_state(self, all_ranks: bool) -> Optional[Dict[str, Any]]:
        comp = self.compression()
        mine = comp.state_dict() if comp is not None else None
        if all_ranks and mine is not None:
            mine = _gather_ranks(mine, getattr(self.optimizer, "process_set", None))
        return mine

    def own_compression(self, saved: Any) -> Optional[Dict[str, Any]]:
        if isinstance(saved, dict) and saved.get("all_ranks"):
            return _own_part(saved, self.optimizer)
        return saved

    def check_compression(self, saved: Dict[str, Any]) -> None:
        comp = self.compression()
        if comp is None:
            raise ValueError("checkpoint holds compressor state but this optimizer has no hvd_gradcomp "
                             "compressor: build it with the same compression, or set "
                             "state['compression'] = None. Nothing was changed.")
        comp.check_state(saved)   # a fixed compressor's or Auto's checks

    def load_compression(self, saved: Dict[str, Any]) -> None:
        self.compression().load_state_dict(saved)

    def resume_at(self, optimizer_steps: int) -> None:
        stats = getattr(self.compression(), "stats", None)
        if stats is not None and hasattr(stats, "resume_at"):   # one exchange per optimizer step
            stats.resume_at(optimizer_steps)


class DDPWrapper:
    """The DDP side of :class:`GradientAccumulator`: ``no_sync()`` holds the exchange back for the first N-1
    micro-batches; a partial window, which never left the rank, is averaged with one uncompressed allreduce
    per dtype; checkpoints hold the hook state that :func:`hvd_gradcomp.ddp.register` gave the model."""

    needs_accumulate = True   # DDP decides at the forward pass whether the backward pass synchronises

    def __init__(self, ddp_model: Any, optimizer: Any) -> None:
        if not isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel):
            raise TypeError(f"GradientAccumulator takes the DistributedDataParallel model, got "
                            f"{type(ddp_model).__name__}")
        self.model, self.optimizer = ddp_model, optimizer

    def check(self, steps: int) -> None:
        """Nothing to check: DDP holds no count of its own."""

    def _state(self) -> Any:
        from ..ddp.state import _STATES   # the same layer; imported late: hvd_gradcomp.ddp imports this module

        return _STATES.get(self.model)

    def compression(self) -> Any:
        state = self._state()
        return state.compression if state is not None else None

    def policy_settled(self) -> bool:
        """register() chose the hook's policy (a hook registered after the accumulator is checked at its
        first step)."""
        return self._state() is not None

    def hold_back(self, hold: bool) -> ContextManager[None]:
        return self.model.no_sync() if hold else nullcontext()

    def average_partial(self, scale: float) -> None:
        import torch.distributed as dist

        params = [p for p in self.model.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        group = self.model.process_group
        scale = scale / dist.get_world_size(group)
        by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
        for p in params:
            by_dtype.setdefault(p.grad.dtype, []).append(p)
        for dtype in sorted(by_dtype, key=str):  # the same order on every rank
            grads = [p.grad for p in by_dtype[dtype]]
            flat = torch.cat([g.reshape(-1) for g in grads]).mul_(scale)
            dist.all_reduce(flat, group=group)
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()

    def step(self, max_grad_norm: Optional[float], last_norm: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """Step (clipped: the hook's exchange is done by now, so clip, then step); the norm before clipping."""
        norm = last_norm
        if max_grad_norm is not None:
            check_clippable(self.compression())
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_grad_norm)
        self.optimizer.step()
        return norm

    def ranks(self) -> int:
        import torch.distributed as dist

        return dist.get_world_size(self.model.process_group)

    def compression_state(self, all_ranks: bool) -> Optional[Dict[str, Any]]:
        state = self._state()
        return state.state_dict(all_ranks=all_ranks) if state is not None else None

    def own_compression(self, saved: Any) -> Optional[Dict[str, Any]]:
        return saved   # the hook state takes its own part of an all-ranks dict (hvd_gradcomp.ddp.checkpoint)

    def check_compression(self, saved: Dict[str, Any]) -> None:
        if self._state() is None:
            raise ValueError("checkpoint holds the DDP hook's state but this model has no hvd_gradcomp hook: "
                             "register() it with the same compression first, or set state['compression'] = None. "
                             "Nothing was changed.")

    def load_compression(self, saved: Dict[str, Any]) -> None:
        self._state().load_state_dict(saved)   # its exchange counter and byte ledger resume with it

    def resume_at(self, optimizer_steps: int) -> None:
        """Nothing: the hook state's own counter came back with it."""


_MID_WINDOW = ("checkpoints are taken between accumulation windows, not in the middle of one (the "
               "gradients accumulated so far are not saved): save right after a step, or call flush() first")


def _compressor(optimizer: Any) -> Any:
    from .stock import compressor_of  # Horovod's optimizer keeps it under a private name

    comp = compressor_of(optimizer)
    return comp if callable(getattr(comp, "state_dict", None)) else None


def _gather_ranks(mine: Dict[str, Any], process_set: Any) -> Dict[str, Any]:
    """Every rank's ``mine`` in rank 0's result (a collective: Horovod's ``allgather_object``); other ranks
    keep a stub saying that rank 0 holds them."""
    import horovod.torch as hvd

    # Horovod 0.28.1's allgather_object takes no process set: pickled bytes through allgather, which takes
    # uint8 and a first dimension that differs between ranks
    kw = {"process_set": process_set} if process_set is not None else {}
    buffer = io.BytesIO()
    torch.save(state_to_cpu(mine), buffer)
    data = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
    sizes = hvd.allgather(torch.tensor([data.numel()]), name="hvdgc.state.sizes", **kw).tolist()
    gathered = hvd.allgather(data, name="hvdgc.state.bytes", **kw)
    rank = process_set.rank() if process_set is not None else hvd.rank()
    if rank != 0:
        return {"all_ranks": True, "world_size": len(sizes), "ranks": None}
    parts, offset = [], 0
    for size in sizes:
        parts.append(torch.load(io.BytesIO(gathered[offset:offset + size].numpy().tobytes()), weights_only=True))
        offset += size
    return {"all_ranks": True, "world_size": len(parts), "ranks": parts}


def _own_part(state: Dict[str, Any], optimizer: Any) -> Optional[Dict[str, Any]]:
    """This rank's compressor state from an all-ranks one; None (error feedback restarts, with a warning)
    when the job has another number of ranks."""
    import horovod.torch as hvd

    if state.get("ranks") is None:
        raise ValueError("this checkpoint's compressor state came from state_dict(all_ranks=True) on a rank other "
                         "than 0, which holds no rank's residuals: save the dict that rank 0 got. Nothing was changed.")
    process_set = getattr(optimizer, "process_set", None)
    rank, size = (process_set.rank(), process_set.size()) if process_set is not None else (hvd.rank(), hvd.size())
    if state["world_size"] != size:
        if rank == 0:
            warnings.warn(f"hvd_gradcomp: the checkpoint's compressor state was saved by {state['world_size']} ranks "
                          f"and this job has {size}: residuals are per rank, so error feedback restarts from zero "
                          f"(as does a feedback policy's warm-up). Resume on {state['world_size']} ranks to continue "
                          "exactly.", RuntimeWarning, stacklevel=3)
        return None
    params = [p for g in getattr(optimizer, "param_groups", []) for p in g["params"]]
    return state_to_device(state["ranks"][rank], params[0].device if params else None)


def _size() -> int:
    try:
        import horovod.torch as hvd
        return hvd.size()
    except (ImportError, ValueError):
        return 1
