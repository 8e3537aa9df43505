"""The exchange step of :class:`~hvd_gradcomp.codecs.compressor.GradientCompressor` as a transaction, and
its checkpoints (a mixin, :class:`StepState`).

Once an optimizer claims the compressor (:meth:`StepState._claim`), every exchange step can be
undone: when an average is not finite (a loss scaler skips the step), the feedback state and the
random streams return to where the step began (:meth:`StepState.end_round`). The step count
travels in each payload's envelope. :meth:`StepState.state_dict` saves the same state, and
:meth:`StepState.load_state_dict` checks a checkpoint before changing anything.
"""
from __future__ import annotations

import math
import warnings
import weakref
import zlib
from typing import Any, Dict, Optional

import torch

from .. import feedback as fb


class StepState:
    """Exchange steps (claim, end, undo on overflow), the random stream per tensor name and step,
    and checkpoints. Mixed into :class:`~hvd_gradcomp.codecs.compressor.GradientCompressor`, which owns
    the policies whose state this rolls back and saves (``feedback``, ``_relay``, ``_half``)."""

    def _init_steps(self) -> None:
        self._steps: Dict[str, int] = {}
        self._owner: Optional[weakref.ref] = None
        self._world: Optional[int] = None                  # ranks of the owner's process set
        self._round = 0                                    # exchange steps ended (see end_round)
        self._in_flight: set = set()                       # see exchange_opened
        self._round_ok = True
        self.join_checked = False                          # this step checked hvd.join() (stock road)
        self._undo_steps: Optional[Dict[str, int]] = None  # random streams at the round's start
        self.elastic_synced = False                        # hvd.elastic's sync set every rank's step (horovod/elastic.py)

    @property
    def seed(self) -> int:
        """Seed of the rounding noise (with the rank's ``stream``, the tensor name and the step).

        Given as ``seed=``, that value; otherwise ``torch.initial_seed()`` (32 bits of it) when first
        needed, so ``torch.manual_seed(s)`` before training makes a compressed run repeatable, as it
        does an uncompressed one, without drawing from torch's random stream (which would change the
        run's data order or dropout). With no ``manual_seed`` torch's own seed is random per process,
        and so is this one.

        >>> from hvd_gradcomp import TopK
        >>> _ = torch.manual_seed(7)
        >>> TopK(ratio=0.01).seed, TopK(ratio=0.01, seed=3).seed
        (7, 3)
        """
        if self._seed is None:
            self._seed = torch.initial_seed() % 2**32
        return self._seed

    @seed.setter
    def seed(self, value: int) -> None:
        self._seed = value

    def _next_seed(self, name: str) -> int:
        """A 32-bit seed from (seed, stream, name, step): reproducible, distinct per call."""
        step = self._steps.get(name, 0)
        if self._undo_steps is not None:
            self._undo_steps.setdefault(name, step)
        self._steps[name] = step + 1
        return zlib.crc32(f"{self.seed}/{self.stream}/{name}/{step}".encode())

    # ------------------------------------------------------------ exchange steps
    def _claim(self, owner: Any, world_size: Optional[int] = None) -> None:
        """Serve ``owner`` (one optimizer) only; called by the optimizers, not by users.

        Residuals and random streams are keyed by parameter name, so two optimizers sharing
        one compressor would mix their residuals. Claiming also makes every exchange step a
        transaction (see :meth:`end_round`). :meth:`attach` (the feedback policy's choice)
        is the other half of binding to an optimizer.
        """
        current = self._owner() if self._owner is not None else None
        if current is not None and current is not owner:
            raise ValueError(
                f"this {type(self).__name__} already compresses the gradients of another optimizer "
                f"({type(current).__name__}); its residuals are keyed by parameter name and would be "
                "mixed. Give each optimizer its own compressor (a new object, or copy.deepcopy(c) "
                "before the first step), or call remove_hooks() on the old optimizer first.")
        self._owner = weakref.ref(owner)
        self._world = world_size
        self._track_rounds()
        if self._undo_steps is None:
            self._undo_steps = {}

    def _track_rounds(self) -> None:
        """Make the residual stores undoable per exchange step once an optimizer is claimed."""
        if self._owner is not None:
            for policy in (self.feedback, self._relay, self._half):
                policy.track_rounds(True)

    def detach(self) -> None:
        """Release the compressor from its optimizer (after ``remove_hooks()``)."""
        self.end_round(True)
        self._owner = None

    @property
    def exchange_step(self) -> int:
        """Exchange steps ended so far (it travels in each payload's envelope, see exchange.py)."""
        return self._round

    def end_round(self, ok: bool) -> None:
        """End one exchange step, on every rank alike.

        ``ok=False`` (an averaged gradient of the step was NaN/Inf, so a loss scaler skips
        it): the feedback state (residuals of the policy and of the relay, momentum
        correction's and ``feedback="frozen"``'s velocities) and random streams return to where
        the step began (``frozen`` also left the parameters alone), as if it
        had never run. Not rolled back: the local optimizers of ``feedback="update"``, which
        already applied the step to the parameters (a loss scaler does not fit that policy:
        its local optimizer steps on scaled gradients). Either way the step counter advances:
        the exchange did happen on every rank. A RuntimeWarning says so (each time, or once per
        process under Python's default warning filter).
        """
        self._close_round(ok)
        if not ok:
            # Not an error: a loss scaler (torch.amp.GradScaler) finds the same inf/NaN and skips the
            # step on every rank. Said because without a scaler it would be a silent NaN.
            warnings.warn("hvd_gradcomp: an averaged gradient is not finite (NaN or Inf) this step: the "
                          "compressor's state was kept as before it, and the gradients go to the optimizer as "
                          "they are (a torch.amp.GradScaler skips such a step; without one the parameters become "
                          "NaN). Check the loss and the inputs of this step.", RuntimeWarning, stacklevel=2)

    def _close_round(self, ok: bool) -> None:
        for policy in (self.feedback, self._relay, self._half):
            policy.end_round(ok)
        if not ok and self._undo_steps:
            self._steps.update(self._undo_steps)
        if self._undo_steps is not None:
            self._undo_steps = {}
        self._in_flight.clear()
        self._round_ok = True
        self.join_checked = False
        self._round += 1

    def abandon_round(self) -> None:
        """Undo an unfinished step and restart the step count (elastic reset, checkpoint load)."""
        self._close_round(False)
        self._round = 0

    def follow_world(self, world: int) -> float:
        """The owner's process set now has ``world`` ranks (an ``hvd.elastic`` reset): QSGD's relay residuals,
        kept per chunk of the ranks (``<name>#reduced<rank>``, whose sizes change with ``world``), are
        dropped, with a RuntimeWarning giving the L2 norm they held, which is returned."""
        before, self._world = self._world, world
        store = self.relay_residuals
        dropped = 0.0
        for name in [n for n in {*store._residuals, *store._shapes} if "#reduced" in n]:
            r = store.pop(name)
            store._shapes.pop(name, None)
            if r is not None:
                dropped += float(r.float().pow(2).sum())
        if dropped > 0:
            warnings.warn(f"hvd_gradcomp: {before} -> {world} ranks (an elastic reset): QSGD's relay residuals, kept per "
                          f"chunk of the ranks, were dropped (L2 norm {dropped ** 0.5:.4g})", RuntimeWarning, stacklevel=2)
        return dropped ** 0.5

    @property
    def in_step(self) -> bool:
        """Whether exchanges opened by :meth:`exchange_opened` are still in flight."""
        return bool(self._in_flight)

    def exchange_opened(self, name: str) -> None:
        """Step bookkeeping where only single exchanges are seen (inside ``hvd.DistributedOptimizer``).

        A name opened again while still in flight means its step was interrupted (an exception
        went by, an elastic reset): that step is abandoned, see :meth:`abandon_round`.
        """
        if name in self._in_flight:
            self.abandon_round()
        self._in_flight.add(name)

    def exchange_closed(self, name: str, finite: bool) -> bool:
        """The exchange of ``name`` finished; the last one of a step ends it (:meth:`end_round`) and
        returns True.

        Horovod starts every exchange of a step before it finishes the first, so "none left
        in flight" marks the end of the step on every rank alike.
        """
        self._in_flight.discard(name)
        self._round_ok = self._round_ok and finite
        if not self._in_flight:
            self.end_round(self._round_ok)
            return True
        return False

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> Dict[str, Any]:
        """Feedback state (residuals, velocities, held rates) and random state: restoring it
        continues the exact same sequence. ``residuals``/``shapes`` are the policy's residuals.

        Also records what the residuals mean (compressor kind and settings, world size), which
        :meth:`load_state_dict` checks.
        """
        state = self.feedback.state_dict()
        return {"compressor": repr(self), "kind": type(self).__name__, "error_feedback": self.error_feedback,
                "world_size": self._world, "seed": self.seed, "stream": self.stream, "steps": dict(self._steps),
                "residuals": state.pop("residuals"), "shapes": state.pop("shapes"),
                "feedback": state, "relay": self._relay.state_dict(), "half": self._half.state_dict()}

    def shared_state(self) -> Dict[str, Any]:
        """:meth:`state_dict` without this rank's own state (its residuals, the relay's and the float16
        road's, the policy's :attr:`~hvd_gradcomp.feedback.Feedback.rank_own_state`), with the exchange step:
        what every rank holds alike. After ``hvd.join()`` the ranks still training ran steps the others
        did not; the rank that trained last sends this and the others :meth:`load_shared_state` it."""
        state = self.state_dict()
        for key in _RANK_OWN:
            state.pop(key, None)
        own = self.feedback.rank_own_state
        state["feedback"] = {k: v for k, v in state["feedback"].items() if k not in own}
        state["round"] = self._round
        return state

    def load_shared_state(self, shared: Dict[str, Any]) -> None:
        """Take :meth:`shared_state` of another rank (the exchange step, random-stream counts, the policy's
        shared state: momentum correction's last average, ``frozen``'s ``v``, PowerSGD's ``Q``...) and keep
        this rank's own: its residuals are still there for its next step."""
        mine = self.state_dict()
        own = self.feedback.rank_own_state
        merged = {**shared, **{k: mine[k] for k in _RANK_OWN if k in mine},
                  "feedback": {**shared["feedback"], **{k: v for k, v in mine["feedback"].items() if k in own}}}
        step = int(merged.pop("round"))
        self.load_state_dict(merged)
        self._round = step

    def check_state(self, state: Any) -> None:
        """Raise ``ValueError`` naming every way ``state`` cannot be loaded (:meth:`load_state_dict`
        checks it before changing anything; so does ``GradientAccumulator.load_state_dict``)."""
        _check_compressor_state(self, state)

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; checks everything before changing anything.

        This rank's random stream is kept (each rank draws its own noise). A checkpoint of
        another kind of compressor, another ``error_feedback`` or another world size raises
        ``ValueError`` saying what differs; to restart error feedback from zero instead, load
        the rest of the checkpoint without it (``state["compression"] = None`` for
        :class:`~hvd_gradcomp.GradientAccumulator`).
        """
        self.check_state(state)
        if self._owner is not None and state.get("stream", self.stream) != self.stream:
            warnings.warn(f"compressor state saved by the rank with stream {state['stream']} is loaded "
                          f"on stream {self.stream}: residuals differ per rank, so each rank should load "
                          "its own file (ckpt-rank{hvd.rank()}.pt). Keeping this rank's stream.")
        self.abandon_round()
        self.seed = int(state["seed"])
        self._steps = {str(k): int(v) for k, v in state["steps"].items()}
        extra = dict(state.get("feedback", {"policy": self.feedback.key}))
        policy = extra.get("policy", self.feedback.key)
        if self.feedback_choice == "auto" and policy != self.feedback.key:
            self._set_policy(fb.make(policy))  # "auto" chose it before the checkpoint: keep it
        self._loaded_policy = self.feedback_choice == "auto"
        self.feedback.load_state_dict({**extra, "residuals": state["residuals"], "shapes": state.get("shapes", {})})
        if "relay" in state:
            self._relay.load_state_dict(state["relay"])
        self._half.load_state_dict(state.get("half", {}))


def _check_compressor_state(comp: StepState, state: Any) -> None:
    """Raise ValueError naming every way ``state`` cannot be loaded into ``comp``."""
    if not isinstance(state, dict):
        raise ValueError(f"compressor state must be the dict state_dict() returns, got {type(state).__name__}. "
                         "Nothing was changed.")
    missing = [k for k in ("seed", "steps", "residuals") if k not in state]
    if missing:
        raise ValueError(f"compressor state lacks {missing}: not a state_dict() of an hvd_gradcomp compressor. "
                         "Nothing was changed.")
    problems = []
    kind = state.get("kind", type(comp).__name__)
    if kind != type(comp).__name__:
        problems.append(f"it was saved by {state.get('compressor', kind)}, this is {comp!r}")
    if state.get("error_feedback", comp.error_feedback) != comp.error_feedback:
        problems.append(f"error_feedback was {state['error_feedback']}, is {comp.error_feedback}")
    saved_world = state.get("world_size")
    if saved_world is not None and comp._world is not None and saved_world != comp._world:
        problems.append(f"it was saved with {saved_world} ranks, this job has {comp._world} (residuals are "
                        "per rank, and QSGD's per chunk of the ranks)")
    residuals, shapes = state["residuals"], state.get("shapes", {})
    if not isinstance(residuals, dict) or not all(isinstance(r, torch.Tensor) for r in residuals.values()):
        problems.append("'residuals' is not a dict of tensors")
    else:
        bad = [n for n, r in residuals.items() if n in shapes and r.numel() != math.prod(shapes[n][0])]
        if bad:
            problems.append(f"residuals {bad} do not match their recorded shapes")
    saved_policy = state.get("feedback", {}).get("policy", comp.feedback.key) if isinstance(
        state.get("feedback", {}), dict) else None
    if saved_policy is None:
        problems.append("'feedback' is not a dict")
    elif comp.feedback_choice != "auto" and saved_policy != comp.feedback.key:
        problems.append(f"it holds state of feedback policy {saved_policy!r}, this compressor uses "
                        f"{comp.feedback.key!r} (build it with feedback={saved_policy!r})")
    if not isinstance(state["steps"], dict) or not all(isinstance(v, int) for v in state["steps"].values()):
        problems.append("'steps' is not a dict of ints")
    owed = state.get("half", {}).get("residuals") if isinstance(state.get("half", {}), dict) else None
    if owed and comp.exempt != "fp16":
        problems.append(f"it holds the float16 road's residuals of {len(owed)} exempt tensors, this compressor "
                        f"has exempt={comp.exempt!r} and would drop them (build it with exempt='fp16')")
    if problems:
        raise ValueError("cannot load this compressor state: " + "; ".join(problems) + ". Resume with the "
                         "same compressor and number of ranks, or drop the compressor state (error feedback "
                         "then restarts from zero: set state['compression'] = None before "
                         "GradientAccumulator.load_state_dict). Nothing was changed.")


_RANK_OWN = ("residuals", "relay", "half", "stream", "seed")   # a compressor's state_dict() keys that are this rank's own

_ON_DEVICE = "__hvdgc_on_device__"


def state_to_cpu(obj: Any) -> Any:
    """``obj`` (a compressor's or a hook's state) with every tensor inside on the CPU (dicts, lists and tuples
    walked), for a checkpoint that one rank writes for all: a tensor that was on an
    accelerator becomes ``{_ON_DEVICE: True, "tensor": cpu_copy}`` (plain types, so that ``torch.load``'s
    ``weights_only`` reads it), which :func:`state_to_device` puts back on the loading rank's device."""
    if isinstance(obj, torch.Tensor):
        return obj if obj.device.type == "cpu" else {_ON_DEVICE: True, "tensor": obj.cpu()}
    if isinstance(obj, dict):
        return {k: state_to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(state_to_cpu(v) for v in obj)
    return obj


def state_to_device(obj: Any, device: Optional[torch.device]) -> Any:
    """The inverse of :func:`state_to_cpu` on this rank: marked tensors go to ``device``, the others stay."""
    if isinstance(obj, dict):
        if obj.get(_ON_DEVICE) is True:
            return obj["tensor"].to(device) if device is not None else obj["tensor"]
        return {k: state_to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(state_to_device(v, device) for v in obj)
    return obj
