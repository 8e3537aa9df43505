"""What the DDP hook's exchange owes the optimizer when it steps (:class:`StepHandOff`): the averaged
updates of a feedback policy that moves the parameters itself (:class:`DeferredUpdates`), and the averages
of compressed parameters that DDP left without a gradient (:class:`UnusedGradients`).
"""
import re
import threading
import warnings
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from ..feedback import kernels
from .exchanges import _Segment

StepArgs = Optional[Tuple[Tuple[Any, ...], Dict[str, Any]]]


class DeferredUpdates:
    """The averages of a policy that moves the parameters (``"frozen"``, ``"update"``), kept apart from the
    exchange until the optimizer steps; one reused buffer per name.

    >>> d = DeferredUpdates()
    >>> d.pending
    0
    """

    def __init__(self) -> None:
        # names whose received() waits for the optimizer step, with their average kept apart (None: left in p.grad)
        self.at_step: Dict[str, Optional[torch.Tensor]] = {}
        self._kept: Dict[str, torch.Tensor] = {}   # one buffer per name, reused every step

    @property
    def pending(self) -> int:
        return len(self.at_step)

    def received(self, compression: Any, name: str, avg: torch.Tensor, support: Optional[torch.Tensor]) -> None:
        """Hand the average of ``name`` to ``compression``'s feedback policy now or, for a policy that moves
        the parameter itself, when the optimizer steps (not during backward: autograd, clipping and a
        skipped step all expect the parameters to stay put until then). ``support``: see
        :func:`hvd_gradcomp.collectives.reduce.sparse_support`."""
        if not compression.feedback.moves_parameters:
            compression.received(name, avg, support)
            return
        # The average is an update *direction* (FrozenVariance: momentum or gradient / sqrt(v)), not a gradient:
        # kept apart until the step, and zeros go to p.grad, as under the Horovod wrappers. Left in p.grad,
        # a clip_grad_norm_(model.parameters(), 1.0) before opt.step() saw its norm (far above a
        # gradient's) and shortened every step by as much. A non-finite average stays in p.grad,
        # where the optimizer meets it.
        kept = None
        if kernels.all_finite(avg):
            kept = self._kept.get(name)
            kept = self._kept[name] = avg.clone() if kept is None or kept.shape != avg.shape else kept.copy_(avg)
            avg.zero_()
        self.at_step[name] = kept

    def apply(self, compression: Any, by_name: Dict[str, torch.Tensor]) -> None:
        """The deferred ``received`` calls, on the averages kept apart or (non-finite) left in ``p.grad``."""
        pending, self.at_step = self.at_step, {}
        for name, kept in pending.items():
            avg = kept if kept is not None else by_name[name].grad
            if avg is not None:
                compression.received(name, avg)


class UnusedGradients:
    """A compressed parameter that DDP left without a gradient (unused by every rank in this step's
    forward, with ``find_unused_parameters=True``) gets its exchange's average as its gradient before the
    optimizer steps, as the Horovod wrappers give one to every parameter.

    Why: the hook ran its error-feedback policy on the zeros DDP put in the bucket (the residual and DGC's
    velocity moved on, what they owed was sent and averaged), and momentum correction rewrote the average
    for SGD's momentum buffer. Skipped by the optimizer, that movement was lost and SGD's momentum fell
    out of step with the correction: momentum SGD through TopKQSGD(1%, 8) diverged on a model with a layer
    used every other step. Only a gradient left ``None``: a zero gradient kept by
    ``zero_grad(set_to_none=False)`` cannot be told from the user's own, and is left alone.

    >>> UnusedGradients().warned
    False
    """

    def __init__(self) -> None:
        # compressed segments whose average this step's exchange wrote, by name
        self._exchanged: Dict[str, Tuple[torch.Tensor, _Segment]] = {}
        self.warned = False

    def note(self, feedback: Any, seg: _Segment, buffer: torch.Tensor) -> None:
        """The exchange wrote ``seg``'s average into ``buffer``; kept only where the feedback policy keeps
        state that the optimizer must stay in step with."""
        if feedback.key != "none" and not feedback.moves_parameters:
            self._exchanged[seg.name] = (buffer, seg)

    def take(self) -> Dict[str, Tuple[torch.Tensor, _Segment]]:
        """This step's noted segments, forgotten here."""
        done, self._exchanged = self._exchanged, {}
        return done

    def give(self, done: Dict[str, Tuple[torch.Tensor, _Segment]], by_name: Dict[str, torch.Tensor],
             rank: int) -> None:
        """Set each noted average as the gradient of a parameter left with none; said once on rank 0."""
        for name, (buffer, seg) in done.items():
            p = by_name[name]
            if p.grad is not None:
                continue
            p.grad = seg.view(buffer).view(seg.shape).clone()
            if not self.warned and rank == 0:
                self.warned = True
                warnings.warn(
                    f"hvd_gradcomp DDP hook: parameter {name!r} got no gradient from DDP in this step (unused by "
                    "every rank's forward); its compressed exchange still carried what error feedback owed it, "
                    "so that average is set as its gradient and the optimizer steps it, as under the Horovod wrappers "
                    f"(said once). To keep such a parameter out of compression: exclude=r'^{re.escape(name)}$'.",
                    RuntimeWarning, stacklevel=5)   # the user's opt.step(), past torch's step wrapper


class StepHandOff:
    """The optimizer step pre-hook of the DDP hook's state: before the optimizer's arithmetic, finish this
    step's exchange for it (:meth:`finish`: the :class:`DeferredUpdates`, then the :class:`UnusedGradients`).

    ``lock``: the state's, held while the compressor is used (the hook and callback threads use it too).
    """

    def __init__(self, compression: Any, by_name: Dict[str, torch.Tensor], lock: threading.Lock,
                 rank: int) -> None:
        self.compression, self.by_name, self.rank = compression, by_name, rank
        self.deferred = DeferredUpdates()
        self.unused = UnusedGradients()
        self._lock = lock

    def before_step(self, optimizer: torch.optim.Optimizer, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> StepArgs:
        """Optimizer step pre-hook: finish this step's exchange for the optimizer (:meth:`finish`).

        With ``optimizer.step(closure)`` (Lightning's automatic optimization, LBFGS) the closure runs the
        forward and backward passes *inside* ``step``, after this hook: the exchange it starts is
        finished when the closure returns, before the optimizer's arithmetic, so a step with a closure
        moves the parameters exactly as ``backward()`` then ``step()``. Finished here instead, each
        ``frozen`` update landed one step late and the last one never. Returns the arguments with the
        closure wrapped (torch's step pre-hook protocol)."""
        self.finish()   # a backward() before step(closure), or no closure at all
        return after_closure(args, kwargs, self.finish)

    def finish(self) -> None:
        """Hand the optimizer what this step's exchange owes it: the deferred updates, then the averages
        of parameters DDP left without a gradient."""
        with self._lock:
            self.deferred.apply(self.compression, self.by_name)
        with self._lock:
            done = self.unused.take()
        self.unused.give(done, self.by_name, self.rank)


def after_closure(args: Tuple[Any, ...], kwargs: Dict[str, Any], then: Callable[[], None]) -> StepArgs:
    """``optimizer.step``'s arguments with its closure (positional or ``closure=``) followed by ``then()`` each
    time the optimizer calls it (LBFGS calls it several times); None without a closure.

    >>> after_closure((None,), {}, print) is None
    True
    """
    at_args = len(args) > 1 and args[1] is not None
    closure = args[1] if at_args else kwargs.get("closure")
    if closure is None:
        return None

    def wrapped() -> Any:
        loss = closure()
        then()
        return loss
    return ((args[0], wrapped, *args[2:]), kwargs) if at_args else (args, {**kwargs, "closure": wrapped})
