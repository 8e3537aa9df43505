"""The one byte ledger: what each rank hands to its collectives, per tensor, per step and per run.

Every driver counts into one :class:`ByteStats` (a compressor's ``stats``; the optimizer's and the
DDP state's ``comm_stats`` are that same object), at the one place where it hands bytes to a
collective (docs/ARCHITECTURE.md, "Where bytes are counted"). Each record has three parts:

* ``raw``: the gradient's own bytes (what an uncompressed allreduce would carry);
* ``payload``: what stands for the gradient on the wire: a codec's payloads (header and sections,
  :mod:`hvd_gradcomp.wire`), PowerSGD's factors, a float16 cast, or the tensor itself when it
  travels uncompressed;
* ``framing``: what a driver adds to carry payloads: Horovod's envelopes (step and NaN flag) and the
  fused allgather's index, the DDP hook's sizes, flags and padding to equal-sized buffers.

``bytes_out`` (what went to the collectives) is payload plus framing; ``ratio`` is raw over it.

>>> s = ByteStats()
>>> s.record("w", raw=4000, payload=60, framing=16); s.record("b", raw=40, payload=20); s.end_step()
>>> s.record("w", raw=4000, payload=60, framing=16); s.end_step()
>>> s.bytes_in, s.payload_bytes, s.framing_bytes, s.bytes_out, s.steps
(8040, 140, 32, 172, 2)
>>> s.last_step, s.per_tensor["w"]
(Bytes(raw=4000, payload=60, framing=16), [8000, 152, 32])
>>> print(s.summary())
2 steps, 2 tensors: 8,040 B raw, 140 B payload + 32 B framing = 172 B sent, ratio 46.7x; last step 76 B
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set


@dataclass
class Bytes:
    """Bytes of one step (or any span): raw, payload and framing; ``sent`` is payload + framing."""

    raw: int = 0
    payload: int = 0
    framing: int = 0

    @property
    def sent(self) -> int:
        return self.payload + self.framing

    def add(self, raw: int, payload: int, framing: int) -> None:
        self.raw += raw
        self.payload += payload
        self.framing += framing


@dataclass
class ByteStats:
    """Cumulative bytes per run and per tensor name, and per step (see the module docstring).

    ``per_tensor[name]`` is ``[raw, sent, framing]`` (framing charged to that name: a fused
    allgather's index is charged to its group's first tensor); the driver's own framing records
    carry names in parentheses (``"(sizes+padding)"``). ``step`` is the step being recorded;
    :meth:`end_step` closes it (the drivers call it, once per exchange step).
    """

    bytes_in: int = 0
    payload_bytes: int = 0
    framing_bytes: int = 0
    calls: int = 0
    per_tensor: Dict[str, List[int]] = field(default_factory=dict)
    step: int = 0
    counted_from: int = 0   # the step these counts begin at: a resumed run's ledger starts at its checkpoint
    _by_step: Dict[int, Bytes] = field(default_factory=dict, repr=False)
    _names_now: Set[str] = field(default_factory=set, repr=False)   # recorded in the step being recorded

    def record(self, name: str, raw: int, payload: int, framing: int = 0, step: Optional[int] = None) -> None:
        """Count bytes handed to a collective for ``name``; ``step``: the exchange step they belong
        to, when the driver knows it (the DDP hook's callbacks may finish after the next step began),
        else the step being recorded."""
        self.bytes_in += raw
        self.payload_bytes += payload
        self.framing_bytes += framing
        self.calls += 1
        entry = self.per_tensor.setdefault(name, [0, 0, 0])
        entry[0] += raw
        entry[1] += payload + framing
        entry[2] += framing
        self._by_step.setdefault(self.step if step is None else step, Bytes()).add(raw, payload, framing)
        self._names_now.add(name)

    def recorded_in_step(self, name: str) -> bool:
        """Whether ``name`` was counted in the step being recorded (a driver that is not told where
        steps end: a tensor counted twice begins the next)."""
        return name in self._names_now

    def end_step(self, next_step: Optional[int] = None) -> None:
        """Close the step being recorded: :attr:`last_step` reads it from now on. ``next_step``: the
        number of the step that follows (a driver that numbers its own steps), else one more."""
        self.step = self.step + 1 if next_step is None else next_step
        self._names_now.clear()
        for old in [s for s in self._by_step if s < self.step - 2]:
            del self._by_step[old]

    @property
    def bytes_out(self) -> int:
        """Bytes handed to the collectives: payload + framing."""
        return self.payload_bytes + self.framing_bytes

    @property
    def steps(self) -> int:
        """Exchange steps closed so far."""
        return self.step

    @property
    def last_step(self) -> Bytes:
        """The bytes of the last closed step."""
        return self.at(self.step - 1)

    def at(self, step: int) -> Bytes:
        """The bytes recorded for ``step`` (the last three steps are kept)."""
        got = self._by_step.get(step)
        return Bytes(got.raw, got.payload, got.framing) if got is not None else Bytes()

    @property
    def ratio(self) -> float:
        """bytes_in / bytes_out (how many times fewer bytes went out); 0 before any record."""
        return self.bytes_in / self.bytes_out if self.bytes_out else 0.0

    @property
    def counted_steps(self) -> int:
        """Steps whose bytes this ledger holds: :attr:`steps` less those before a resume."""
        return self.step - self.counted_from

    def resume_at(self, step: int) -> None:
        """Continue a run from a checkpoint taken after ``step`` exchange steps: steps are numbered on from
        there, and the counts (which a checkpoint does not keep) cover the steps from there on.

        >>> s = ByteStats(); s.resume_at(60); s.record("w", raw=400, payload=8); s.end_step()
        >>> s.steps, s.counted_steps
        (61, 1)
        """
        self.reset()
        self.step = self.counted_from = int(step)

    def reset(self) -> None:
        self.bytes_in = self.payload_bytes = self.framing_bytes = self.calls = 0
        self.per_tensor.clear()
        self._by_step.clear()
        self._names_now.clear()

    def report(self) -> Dict[str, Any]:
        """The run and the last step, payload and framing apart: what the benchmarks and examples print."""
        last = self.last_step
        return {"steps": self.steps, "counted_steps": self.counted_steps, "raw": self.bytes_in, "payload": self.payload_bytes,
                "framing": self.framing_bytes, "sent": self.bytes_out, "ratio": round(self.ratio, 2),
                "last_step": {"raw": last.raw, "payload": last.payload, "framing": last.framing, "sent": last.sent}}

    def summary(self) -> str:
        """One line: steps, tensors, bytes raw/payload/framing/sent, ratio, the last step; after a resume,
        which steps the bytes cover.

        >>> s = ByteStats(); s.resume_at(2); s.record("w", raw=400, payload=8); s.end_step()
        >>> print(s.summary())
        3 steps (bytes of steps 3-3, counted since the resume at step 2), 1 tensors: 400 B raw, 8 B payload + 0 B framing = 8 B sent, ratio 50.0x; last step 8 B
        """
        steps = f"{self.steps} steps"
        if self.counted_from:
            steps += (f" (bytes of steps {self.counted_from + 1}-{self.steps}, counted since the resume at step "
                      f"{self.counted_from})")
        return (f"{steps}, {len(self.per_tensor)} tensors: {self.bytes_in:,} B raw, "
                f"{self.payload_bytes:,} B payload + {self.framing_bytes:,} B framing = {self.bytes_out:,} B sent, "
                f"ratio {self.ratio:.1f}x; last step {self.last_step.sent:,} B")
