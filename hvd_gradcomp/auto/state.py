"""What :class:`hvd_gradcomp.auto.Auto` reports and checkpoints: decisions, measured costs, the
link, verdicts and skipped roads; its state_dict and the checks before one loads. Functions of
Auto's parts (:mod:`~hvd_gradcomp.auto.schedule`, :mod:`~hvd_gradcomp.auto.measure`,
:mod:`~hvd_gradcomp.auto.decide`, :mod:`~hvd_gradcomp.auto.residuals`), which own the state.
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Dict, Optional

from . import policy
from .decide import Decider
from .measure import SAMPLES, Measurements  # noqa: F401  (SAMPLES: kept importable from here)
from .policy import Link
from .residuals import CompressedRoads
from .schedule import Schedule

STATE_KEYS = ("sparse", "qsgd", "step", "counts", "decisions")   # what every Auto state_dict holds


def report(schedule: Schedule, costs: Measurements, decider: Decider, link: Optional[Link],
           ranks: Optional[int]) -> Dict[str, Any]:
    """:meth:`hvd_gradcomp.auto.Auto.report` (``ranks``: None before Auto is configured).

    ``tensors[name]``: the road, the codec milliseconds and payload bytes measured per road,
    the modelled milliseconds per road and the exposed wait of the last exchange.
    ``verdicts``: each verification (:meth:`hvd_gradcomp.auto.Auto.verify`): the step, the
    milliseconds per step of the decisions and of what they were compared with, and what was
    kept. ``skipped``: the roads not explored (``explore_within``), with the milliseconds their
    bytes alone would take per step and the first road's measured step.

    >>> from hvd_gradcomp.auto import Auto
    >>> Auto().report()["summary"]
    'step 0: no tensor yet; link not probed yet'
    """
    tensors = {}
    for name, c in sorted(costs.costs.items()):
        model = policy.road_times(c, ranks or 1, link, c.codec_s) if link else {}
        tensors[name] = {"road": decider.decisions.get(name), "numel": c.numel,
                         "codec_ms": {r: 1e3 * v for r, v in c.codec_s.items()},
                         "payload_bytes": dict(c.payload), "model_ms": {r: 1e3 * v for r, v in model.items()},
                         "wait_ms": 1e3 * costs.last_wait_s.get(name, 0.0)}
    counts = Counter(decider.decisions.values())
    said = (f"link {8 * link.bandwidth / 1e9:.2f} Gbit/s, latency {1e3 * link.latency:.2f} ms"
            if link else "link not probed yet")
    state = ("exploring" if ranks and schedule.exploring else
             ", ".join(f"{r} x{n}" for r, n in sorted(counts.items())))
    if decider.verdicts:
        v = decider.verdicts[-1]
        against = ", ".join(f"{k} {ms:.0f}" for k, ms in sorted(v["against_ms"].items()))
        state += (f" (verified at step {v['step']}: decisions {v['plan_ms']:.0f} ms/step against {against}; "
                  f"kept {'the decisions' if v['kept'] == 'plan' else v['kept']})")
    if schedule.skipped:
        state += "; not explored: " + ", ".join(
            f"{r} (its bytes alone {v['transfer_ms']:.0f} ms/step against {v['first_road_ms']:.0f})"
            for r, v in schedule.skipped.items())
    return {"step": schedule.step, "ranks": ranks or 1, "decisions": dict(decider.decisions), "tensors": tensors,
            "verdicts": list(decider.verdicts), "skipped": {r: dict(v) for r, v in schedule.skipped.items()},
            "link": None if link is None else {"bandwidth_Bps": link.bandwidth, "latency_s": link.latency},
            "switches": [list(h) for h in decider.history],
            "summary": f"step {schedule.step}: {state or 'no tensor yet'}; {said}"}


def state_dict(roads: CompressedRoads, schedule: Schedule, costs: Measurements, decider: Decider) -> Dict[str, Any]:
    """:meth:`hvd_gradcomp.auto.Auto.state_dict`: its format is fixed (older checkpoints load).

    >>> from hvd_gradcomp.auto import Auto
    >>> a = Auto(); b = Auto(); b.load_state_dict(a.state_dict()); b.step
    0
    >>> sorted(a.state_dict())
    ['costs', 'counts', 'decisions', 'qsgd', 'skipped', 'sparse', 'step']
    """
    return {**roads.state_dict(), "step": schedule.step, "counts": dict(schedule.counts),
            "decisions": dict(decider.decisions), "costs": costs.state_dict(),
            "skipped": {r: dict(v) for r, v in schedule.skipped.items()}}


def check_state(state: Any, roads: CompressedRoads) -> None:
    """:meth:`hvd_gradcomp.auto.Auto.check_state`.

    >>> from hvd_gradcomp.auto import Auto
    >>> from hvd_gradcomp.codecs.topk import TopKQSGD
    >>> Auto().check_state(TopKQSGD().state_dict())
    Traceback (most recent call last):
    ...
    ValueError: state lacks ['counts', 'decisions', 'qsgd', 'sparse', 'step']: not a state_dict() of Auto (it was saved by TopKQSGD(ratio=0.01, bits=8, bucket_size=512, error_feedback=True)). Build the optimizer with the compression the checkpoint was taken with, or set state['compression'] = None to restart error feedback. Nothing was changed.
    """
    if not isinstance(state, dict):
        raise ValueError(f"Auto's state must be the dict state_dict() returns, got {type(state).__name__}. "
                         "Nothing was changed.")
    missing = sorted(set(STATE_KEYS) - set(state))
    if missing:
        saved = f" (it was saved by {state['compressor']})" if "compressor" in state else ""
        raise ValueError(f"state lacks {missing}: not a state_dict() of Auto{saved}. Build the optimizer with "
                         "the compression the checkpoint was taken with, or set state['compression'] = None "
                         "to restart error feedback. Nothing was changed.")
    roads.check_state(state)


def load_state_dict(state: Dict[str, Any], roads: CompressedRoads, schedule: Schedule, costs: Measurements,
                    decider: Decider) -> None:
    """:meth:`hvd_gradcomp.auto.Auto.load_state_dict`, checked first (:func:`check_state`); older
    checkpoints, without ``costs`` or ``skipped`` (they skipped none), load too."""
    check_state(state, roads)
    roads.load_state_dict(state)
    decider.load(state["decisions"])
    costs.load_state_dict(state.get("costs", {}))
    schedule.load(int(state["step"]), dict(state["counts"]), {r: dict(v) for r, v in state.get("skipped", {}).items()})
