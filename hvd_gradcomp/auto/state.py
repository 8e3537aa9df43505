"""What :class:`hvd_gradcomp.auto.Auto` reports and checkpoints: decisions, measured costs, the
link, verdicts and skipped roads; its state_dict and the checks before one loads.
"""
from __future__ import annotations

from collections import Counter, deque
from typing import Any, Dict

from . import policy
from .measure import SAMPLES
from .policy import TensorCosts


class AutoState:
    """:class:`hvd_gradcomp.auto.Auto`'s report and checkpoints (its compressors' state, the step,
    the decisions, the measured costs and the roads skipped)."""

    # ------------------------------------------------------------ report / checkpoints
    def report(self) -> Dict[str, Any]:
        """Decisions, measured costs and the link, for logs and the benchmark.

        ``tensors[name]``: the road, the codec milliseconds and payload bytes measured per road,
        the modelled milliseconds per road and the exposed wait of the last exchange.
        ``verdicts``: each verification (:meth:`verify`): the step, the milliseconds per step of
        the decisions and of what they were compared with, and what was kept. ``skipped``: the
        roads not explored (``explore_within``), with the milliseconds their bytes alone would
        take per step and the first road's measured step.
        """
        s = self._setup
        ranks = s.ranks if s else 1
        tensors = {}
        for name, c in sorted(self.costs.items()):
            model = policy.road_times(c, ranks, self.link, c.codec_s) if self.link else {}
            tensors[name] = {"road": self.decisions.get(name), "numel": c.numel,
                             "codec_ms": {r: 1e3 * v for r, v in c.codec_s.items()},
                             "payload_bytes": dict(c.payload), "model_ms": {r: 1e3 * v for r, v in model.items()},
                             "wait_ms": 1e3 * self.last_wait_s.get(name, 0.0)}
        counts = Counter(self.decisions.values())
        link = (f"link {8 * self.link.bandwidth / 1e9:.2f} Gbit/s, latency {1e3 * self.link.latency:.2f} ms"
                if self.link else "link not probed yet")
        state = "exploring" if s and self.exploring else ", ".join(f"{r} x{n}" for r, n in sorted(counts.items()))
        if self.verdicts:
            v = self.verdicts[-1]
            against = ", ".join(f"{k} {ms:.0f}" for k, ms in sorted(v["against_ms"].items()))
            state += (f" (verified at step {v['step']}: decisions {v['plan_ms']:.0f} ms/step against {against}; "
                      f"kept {'the decisions' if v['kept'] == 'plan' else v['kept']})")
        if self.skipped:
            state += "; not explored: " + ", ".join(
                f"{r} (its bytes alone {v['transfer_ms']:.0f} ms/step against {v['first_road_ms']:.0f})"
                for r, v in self.skipped.items())
        return {"step": self.step, "ranks": ranks, "decisions": dict(self.decisions), "tensors": tensors,
                "verdicts": list(self.verdicts), "skipped": {r: dict(v) for r, v in self.skipped.items()},
                "link": None if self.link is None else {"bandwidth_Bps": self.link.bandwidth,
                                                        "latency_s": self.link.latency},
                "switches": [list(h) for h in self.history],
                "summary": f"step {self.step}: {state or 'no tensor yet'}; {link}"}

    def state_dict(self) -> Dict[str, Any]:
        """Both compressors' residuals and random state, the step, the decisions, the measured
        costs and the roads skipped (residuals differ per rank: one file per rank, as for the
        compressors).

        >>> from hvd_gradcomp.auto import Auto
        >>> a = Auto(); b = Auto(); b.load_state_dict(a.state_dict()); b.step
        0
        """
        return {"sparse": self.sparse.state_dict(), "qsgd": self.qsgd.state_dict(), "step": self.step,
                "counts": dict(self._counts), "decisions": dict(self.decisions),
                "costs": {n: {"numel": c.numel, "itemsize": c.itemsize, "payload": dict(c.payload),
                              "codec_s": dict(c.codec_s)} for n, c in self.costs.items()},
                "skipped": {r: dict(v) for r, v in self.skipped.items()}}

    def check_state(self, state: Any) -> None:
        """Raise ``ValueError`` naming what keeps ``state`` from loading (:meth:`load_state_dict` checks
        everything before it changes anything; so does ``GradientAccumulator.load_state_dict``).

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
        missing = sorted({"sparse", "qsgd", "step", "counts", "decisions"} - set(state))
        if missing:
            saved = f" (it was saved by {state['compressor']})" if "compressor" in state else ""
            raise ValueError(f"state lacks {missing}: not a state_dict() of Auto{saved}. Build the optimizer with "
                             "the compression the checkpoint was taken with, or set state['compression'] = None "
                             "to restart error feedback. Nothing was changed.")
        self.sparse.check_state(state["sparse"])
        self.qsgd.check_state(state["qsgd"])

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict`, checked first (:meth:`check_state`)."""
        self.check_state(state)
        self.sparse.load_state_dict(state["sparse"])
        self.qsgd.load_state_dict(state["qsgd"])
        self.step, self._counts = int(state["step"]), dict(state["counts"])
        self.decisions = dict(state["decisions"])
        self.costs = {n: TensorCosts(c["numel"], c["itemsize"], c["payload"], c["codec_s"])
                      for n, c in state.get("costs", {}).items()}
        self._samples = {(n, r): deque([v], maxlen=SAMPLES) for n, c in self.costs.items() for r, v in c.codec_s.items()}
        # a checkpoint taken while exploring resumes the same exploring steps (older ones skipped none)
        self.skipped = {r: dict(v) for r, v in state.get("skipped", {}).items()}
        if self._setup is not None:
            self._plan()
