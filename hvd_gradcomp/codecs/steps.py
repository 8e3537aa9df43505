"""The exchange steps of a compressor (:class:`StepCounter`, a part it owns) and its checkpoints.

Once an optimizer claims the compressor (:meth:`StepCounter.claim`), every exchange step can be
undone: when an average is not finite (a loss scaler skips the step), every part with round state
(the feedback policies, the float16 cast, the step counts) returns to where the step began
(:meth:`~hvd_gradcomp.codecs.compressor.GradientCompressor.end_round` calls ``end_round(ok)`` on each).
The step count travels in each payload's envelope. :func:`compressor_state` assembles a checkpoint from
the parts, and :func:`_check_compressor_state` checks one before anything changes.
"""
from __future__ import annotations

import math
import warnings
import weakref
import zlib
from typing import Any, Dict, List, Optional

import torch

from .. import feedback as fb


class StepCounter:
    """Random streams: the exchange count per tensor name, from which each exchange's 32-bit seed differs
    per tensor, step and rank (:meth:`next_seed`), undoable per round once rounds are tracked.

    >>> s = StepCounter(seed=3)
    >>> s.track_rounds(True)                  # claimed: steps become undoable
    >>> a = s.next_seed("w"); s.end_round(False); s.next_seed("w") == a    # undone: the same draw
    True
    >>> s.steps
    {'w': 1}
    """

    def __init__(self, seed: Optional[int] = None) -> None:
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"seed must be an int or None, got {seed!r}")
        self.given_seed = seed   # None: torch's seed, read at first use (see seed)
        self.stream = 0          # set to the rank by every wrapper: ranks draw independent noise
        self.steps: Dict[str, int] = {}
        self.undo: Optional[Dict[str, int]] = None   # step counts at the round's start (None: not tracked)

    @property
    def seed(self) -> int:
        """``seed=``, or ``torch.initial_seed()`` (32 bits of it) when first needed (see
        :attr:`GradientCompressor.seed <hvd_gradcomp.codecs.compressor.GradientCompressor.seed>`)."""
        if self.given_seed is None:
            self.given_seed = torch.initial_seed() % 2**32
        return self.given_seed

    @seed.setter
    def seed(self, value: int) -> None:
        self.given_seed = value

    def advance(self, name: str) -> int:
        """Count one exchange of ``name`` (undoable within the round); returns its step before."""
        step = self.steps.get(name, 0)
        if self.undo is not None:
            self.undo.setdefault(name, step)
        self.steps[name] = step + 1
        return step

    def next_seed(self, name: str) -> int:
        """A 32-bit seed from (seed, stream, name, step): reproducible, distinct per call."""
        step = self.advance(name)
        return zlib.crc32(f"{self.seed}/{self.stream}/{name}/{step}".encode())

    def track_rounds(self, on: bool) -> None:
        if on and self.undo is None:
            self.undo = {}

    def end_round(self, ok: bool) -> None:
        """Keep the round's counts, or (``ok=False``) put back those of its start."""
        if not ok and self.undo:
            self.steps.update(self.undo)
        if self.undo is not None:
            self.undo = {}


class Rounds:
    """Exchange steps as transactions: the owner (one optimizer, :meth:`claim`) and its number of ranks,
    the names in flight and the verdict of the round in progress, and the parts with state per round
    (``parts``: each has ``track_rounds(on)`` and ``end_round(ok)``), on all of which a round ends.

    >>> counter = StepCounter(seed=0)
    >>> owner = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    >>> r = Rounds([counter]); r.claim("codec", owner, 2)
    >>> r.exchange_opened("w"); _ = counter.next_seed("w")
    >>> import warnings; warnings.simplefilter("ignore")
    >>> r.exchange_closed("w", finite=False), counter.steps, r.round    # undone on every part
    (True, {'w': 0}, 1)
    """

    def __init__(self, parts: List[Any]) -> None:
        self.parts = list(parts)
        self.owner: Optional[weakref.ref] = None
        self.world: Optional[int] = None             # ranks of the owner's process set
        self.round = 0                               # exchange steps ended
        self.in_flight: set = set()                  # see exchange_opened
        self.round_ok = True
        self.join_checked = False                    # this step checked hvd.join() (stock Horovod)
        self.elastic_synced = False                  # hvd.elastic's sync set every rank's step (horovod/elastic.py)

    def add(self, part: Any) -> None:
        """One more part with round state (a codec's own, e.g. PowerSGD's ``Q``)."""
        self.parts.append(part)
        if self.claimed:
            part.track_rounds(True)

    def claim(self, codec: Any, owner: Any, world_size: Optional[int] = None) -> None:
        """Serve ``owner`` (one optimizer) only; called by the optimizers, not by users. Residuals and random
        streams are keyed by parameter name, so two optimizers sharing one compressor (``codec``) would mix
        their residuals. Claiming also makes every exchange step a transaction (see :meth:`end_round`):
        every part's state is undoable per round. ``codec.attach`` (the feedback policy's choice) is the
        other half of binding to an optimizer."""
        current = self.owner() if self.owner is not None else None
        if current is not None and current is not owner:
            raise ValueError(
                f"this {type(codec).__name__} already compresses the gradients of another optimizer "
                f"({type(current).__name__}); its residuals are keyed by parameter name and would be "
                "mixed. Give each optimizer its own compressor (a new object, or copy.deepcopy(c) "
                "before the first step), or call remove_hooks() on the old optimizer first.")
        self.owner = weakref.ref(owner)
        self.world = world_size
        for part in self.parts:
            part.track_rounds(True)

    def follow_world(self, codec: Any, world: int) -> float:
        """The owner's process set now has ``world`` ranks (an ``hvd.elastic`` reset): QSGD's relay residuals
        of ``codec``, kept per chunk of the ranks (``<name>#reduced<rank>``, whose sizes change with
        ``world``), are dropped, with a RuntimeWarning giving the L2 norm they held, which is returned."""
        before, self.world = self.world, world
        return drop_relay_chunks(codec.relay_residuals, before, world)

    @property
    def claimed(self) -> bool:
        return self.owner is not None

    def detach(self) -> None:
        """Release the compressor from its optimizer (after ``remove_hooks()``)."""
        self.end_round(True)
        self.owner = None

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
        self.close(ok)
        if not ok:
            # Not an error: a loss scaler (torch.amp.GradScaler) finds the same inf/NaN and skips the
            # step on every rank. Said because without a scaler it would be a silent NaN.
            warnings.warn("hvd_gradcomp: an averaged gradient is not finite (NaN or Inf) this step: the "
                          "compressor's state was kept as before it, and the gradients go to the optimizer as "
                          "they are (a torch.amp.GradScaler skips such a step; without one the parameters become "
                          "NaN). Check the loss and the inputs of this step.", RuntimeWarning, stacklevel=2)

    def close(self, ok: bool) -> None:
        """End the round on every part, without a word."""
        for part in self.parts:
            part.end_round(ok)
        self.in_flight.clear()
        self.round_ok = True
        self.join_checked = False
        self.round += 1

    def abandon_round(self) -> None:
        """Undo an unfinished step and restart the step count (elastic reset, checkpoint load)."""
        self.close(False)
        self.round = 0

    @property
    def in_step(self) -> bool:
        """Whether exchanges opened by :meth:`exchange_opened` are still in flight."""
        return bool(self.in_flight)

    def exchange_opened(self, name: str) -> None:
        """Step bookkeeping where only single exchanges are seen (inside ``hvd.DistributedOptimizer``).

        A name opened again while still in flight means its step was interrupted (an exception
        went by, an elastic reset): that step is abandoned, see :meth:`abandon_round`.
        """
        if name in self.in_flight:
            self.abandon_round()
        self.in_flight.add(name)

    def exchange_closed(self, name: str, finite: bool) -> bool:
        """The exchange of ``name`` finished; the last one of a step ends it (:meth:`end_round`) and
        returns True.

        Horovod starts every exchange of a step before it finishes the first, so "none left
        in flight" marks the end of the step on every rank alike.
        """
        self.in_flight.discard(name)
        self.round_ok = self.round_ok and finite
        if not self.in_flight:
            self.end_round(self.round_ok)
            return True
        return False


def drop_relay_chunks(store: fb.ResidualStore, before: Optional[int], world: int) -> float:
    """Drop QSGD's relay residuals kept per chunk of the ranks (``#reduced`` in their name) from ``store``,
    saying with a RuntimeWarning how much they held (the L2 norm, returned)."""
    dropped = 0.0
    for name in [n for n in {*store._residuals, *store._shapes} if "#reduced" in n]:
        r = store.pop(name)
        store._shapes.pop(name, None)
        if r is not None:
            dropped += float(r.float().pow(2).sum())
    if dropped > 0:
        warnings.warn(f"hvd_gradcomp: {before} -> {world} ranks (an elastic reset): QSGD's relay residuals, kept per "
                      f"chunk of the ranks, were dropped (L2 norm {dropped ** 0.5:.4g})", RuntimeWarning, stacklevel=3)
    return dropped ** 0.5


def compressor_state(comp: Any) -> Dict[str, Any]:
    """:meth:`GradientCompressor.state_dict`, assembled from the compressor's parts (the format every
    release wrote: old checkpoints load)."""
    state = comp.feedback.state_dict()
    return {"compressor": repr(comp), "kind": type(comp).__name__, "error_feedback": comp.error_feedback,
            "world_size": comp._world, "seed": comp.seed, "stream": comp.stream, "steps": dict(comp._steps),
            "residuals": state.pop("residuals"), "shapes": state.pop("shapes"),
            "feedback": state, "relay": comp._relay.state_dict(), "half": comp._half.state_dict()}


def shared_state(comp: Any) -> Dict[str, Any]:
    """``comp``'s state_dict() without this rank's own state (its residuals, the relay's and the float16
    cast's, the policy's :attr:`~hvd_gradcomp.feedback.Feedback.rank_own_state`), with the exchange step:
    what every rank holds alike. After ``hvd.join()`` the ranks still training ran steps the others
    did not; the rank that trained last sends this and the others :func:`load_shared_state` it."""
    state = comp.state_dict()
    for key in _RANK_OWN:
        state.pop(key, None)
    own = comp.feedback.rank_own_state
    state["feedback"] = {k: v for k, v in state["feedback"].items() if k not in own}
    state["round"] = comp.exchange_step
    return state


def load_shared_state(comp: Any, shared: Dict[str, Any]) -> None:
    """Take :func:`shared_state` of another rank (the exchange step, random-stream counts, the policy's
    shared state: momentum correction's last average, ``frozen``'s ``v``, PowerSGD's ``Q``...) and keep
    this rank's own: its residuals are still there for its next step."""
    mine = comp.state_dict()
    own = comp.feedback.rank_own_state
    merged = {**shared, **{k: mine[k] for k in _RANK_OWN if k in mine},
              "feedback": {**shared["feedback"], **{k: v for k, v in mine["feedback"].items() if k in own}}}
    step = int(merged.pop("round"))
    comp.load_state_dict(merged)
    comp._round = step


def load_state(comp: Any, state: Dict[str, Any]) -> None:
    """Restore ``comp.state_dict()``; checks everything before changing anything.

    This rank's random stream is kept (each rank draws its own noise). A checkpoint of
    another kind of compressor, another ``error_feedback`` or another world size raises
    ``ValueError`` saying what differs; to restart error feedback from zero instead, load
    the rest of the checkpoint without it (``state["compression"] = None`` for
    :class:`~hvd_gradcomp.GradientAccumulator`).
    """
    comp.check_state(state)
    if comp._rounds.claimed and state.get("stream", comp.stream) != comp.stream:
        warnings.warn(f"compressor state saved by the rank with stream {state['stream']} is loaded "
                      f"on stream {comp.stream}: residuals differ per rank, so each rank should load "
                      "its own file (ckpt-rank{hvd.rank()}.pt). Keeping this rank's stream.", stacklevel=3)
    comp.abandon_round()
    comp.seed = int(state["seed"])
    comp._steps = {str(k): int(v) for k, v in state["steps"].items()}
    extra = dict(state.get("feedback", {"policy": comp.feedback.key}))
    policy = extra.get("policy", comp.feedback.key)
    if comp.feedback_choice == "auto" and policy != comp.feedback.key:
        comp._set_policy(fb.make(policy))  # "auto" chose it before the checkpoint: keep it
    comp._loaded_policy = comp.feedback_choice == "auto"
    comp.feedback.load_state_dict({**extra, "residuals": state["residuals"], "shapes": state.get("shapes", {})})
    if "relay" in state:
        comp._relay.load_state_dict(state["relay"])
    comp._half.load_state_dict(state.get("half", {}))


def _check_compressor_state(comp: Any, state: Any) -> None:
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
        problems.append(f"it holds the float16 cast's residuals of {len(owed)} exempt tensors, this compressor "
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
