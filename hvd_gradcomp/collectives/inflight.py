"""What every Horovod driver shares: the tensor in flight (:class:`Pending`, with what the exchanges
and their callers note on it), the envelope around each payload, the step check.

Every payload travels behind a 16-byte envelope (:func:`seal`, not part of the codec's wire
format) carrying what the exchange needs besides the codec's bytes:

* the sender's exchange step: receivers compare them (:func:`check_steps`), so a rank that
  skipped or repeated part of a step stops the job with :class:`RankDivergenceError`
  naming every rank's step, instead of averaging gradients of different steps;
* a non-finite flag: a gradient holding NaN/Inf (a loss scaler's overflow step) is sent as
  an envelope without payload that decodes to NaN, so the average is non-finite on *every*
  rank and every rank's scaler skips the same step (the codec raised FloatingPointError
  before touching the residual or the random stream).

The fused allgather exchange carries the same two fields in each rank's group index instead (one
step per rank's part, one non-finite flag per tensor; see :class:`hvd_gradcomp.collectives.fused.FusedAllgatherExchange`).
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Tuple

import torch

from .. import wire
from ..codecs.compressor import GradientCompressor
from .reduce import Parts


@dataclass
class Pending:
    """One tensor in flight, with what its exchange and its callers note on it as it goes."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    handle: Any
    ctx: Any = None
    # bytes handed to Horovod for it, and how many of them are framing (envelopes, a fused group's index)
    bytes_sent: int = 0
    framing_bytes: int = 0
    stage: int = 1
    finished: bool = False
    # p.grad, final for this step (optimizer._start): an exchange may write the average there early
    out: Optional[torch.Tensor] = None
    # where the gradient lives (FusedAllgatherExchange.start, TimedExchange.start)
    device: torch.device = torch.device("cpu")
    # its fusion group, a _Group (FusedAllgatherExchange.start); the group lets go of it once decoded
    group: Any = None
    # this rank's sparse part as its encoder carried it or _prepare decoded it (the allgather exchanges), taken by the decode
    own: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
    # every rank's decoded part, in rank order (the allgather exchanges' decode), taken by finish
    parts: Optional[Parts] = None
    # out zeroed before the wait (FusedAllgatherExchange.before_wait), taken by the decode
    zeroed: bool = False
    # out already holds this rank's own part (before_wait, two ranks), taken by the decode
    held: bool = False
    # out holds the average (FusedAllgatherExchange._decode)
    summed: bool = False
    # ... and the feedback policy received it (FusedAllgatherExchange._decode)
    received: bool = False
    # whether the average is finite, read at the parts' indices (the allgather exchanges); None: not known
    finite: Optional[torch.Tensor] = None
    # codec seconds spent on it (TimedExchange; _charge for a fused group's decode run elsewhere)
    codec_s: float = 0.0
    # codec seconds spent inside its calls on other members of its group (_charge), not its own
    codec_elsewhere_s: float = 0.0
    # seconds blocked on the network for it (TimedExchange._wait)
    wait_s: float = 0.0
    # Auto's road for it, the payload bytes that road sends and the gradient's itemsize (auto.AutoExchange.start)
    road: Optional[str] = None
    payload_bytes: int = 0
    itemsize: int = 0
    # hvd.join(): the ranks that contributed to this step when fewer than all (0: all). The exchange then
    # carries this rank's part dense in one allreduce (Sum), and the average divides by them.
    joined: int = 0


# ---------------------------------------------------------------- envelope
_ENVELOPE = struct.Struct("<2sBBIQ")   # magic, version, flags, step mod 2**32, payload bytes
ENVELOPE_BYTES = _ENVELOPE.size       # 16: payloads behind it stay 8-byte aligned
_MAGIC, _VERSION, FLAG_NONFINITE = b"HX", 1, 1


@dataclass
class Envelope:
    """One rank's contribution as received: its step and its payload (None: NaN/Inf input)."""

    step: int
    payload: Optional[torch.Tensor]
    device: torch.device = torch.device("cpu")

    def nan(self, numel: int) -> torch.Tensor:
        """What a non-finite contribution decodes to."""
        return torch.full((numel,), float("nan"), device=self.device)


def seal(payload: Optional[torch.Tensor], step: int, device: torch.device) -> torch.Tensor:
    """Envelope + payload, one uint8 tensor; ``payload=None`` sends the non-finite flag alone.

    >>> [e.step for e in unseal(torch.cat([seal(torch.ones(8, dtype=torch.uint8), 3, "cpu"),
    ...                                    seal(None, 3, "cpu")]))]
    [3, 3]
    """
    size = 0 if payload is None else payload.numel()
    head = _ENVELOPE.pack(_MAGIC, _VERSION, FLAG_NONFINITE if payload is None else 0, step % (1 << 32), size)
    head_t = torch.frombuffer(bytearray(head), dtype=torch.uint8).to(device)
    return head_t if payload is None else torch.cat([head_t, payload])


def unseal(blob: torch.Tensor) -> List[Envelope]:
    """Split concatenated sealed payloads (an allgather's or alltoall's output), in rank order."""
    out, pos, n = [], 0, blob.numel()
    while pos < n:
        if n - pos < ENVELOPE_BYTES:
            raise wire.WireFormatError(f"truncated exchange: {n - pos} bytes left where a {ENVELOPE_BYTES}-byte "
                                       "envelope was expected")
        magic, version, flags, step, size = _ENVELOPE.unpack(blob[pos:pos + ENVELOPE_BYTES].cpu().numpy().tobytes())
        if magic != _MAGIC or version != _VERSION or flags & ~FLAG_NONFINITE or size > n - pos - ENVELOPE_BYTES:
            raise wire.WireFormatError(f"corrupt exchange envelope at byte {pos}: run the same hvd-gradcomp "
                                       "version on every rank")
        start = pos + ENVELOPE_BYTES
        out.append(Envelope(step, None if flags & FLAG_NONFINITE else blob[start:start + size], blob.device))
        pos = start + size
    return out


def encode_or_flag(encode: Callable[..., Any], *args: Any) -> Any:
    """``encode(*args)``, or None when the gradient held NaN/Inf (the codec then changed nothing).
    Pass the compressor's method and its arguments, not a lambda: the call then goes straight from
    here to the codec, as a reader following it expects (``scripts/call_climbs.py``)."""
    try:
        return encode(*args)
    except FloatingPointError:
        return None


class RankDivergenceError(RuntimeError):
    """Ranks exchanged gradients of different steps: one skipped or repeated a step."""


def check_steps(compressor: GradientCompressor, name: str, steps: List[int]) -> None:
    """Raise :class:`RankDivergenceError` unless every rank's step (index = rank) is this rank's step."""
    if os.environ.get("HOROVOD_ELASTIC") == "1" and not getattr(compressor, "elastic_synced", False):
        return  # ranks that join an elastic job start at step 0, until hvd.elastic's sync aligns them
    mine = compressor.exchange_step % (1 << 32)
    if any(s != mine for s in steps):
        where = ", ".join(f"rank {r} at step {s}" for r, s in enumerate(steps))
        raise RankDivergenceError(
            f"ranks exchanged different steps of {name!r} ({where}; this rank is at step {mine}): a rank "
            "skipped or repeated a step (caught an exception and went on, skipped step() or called "
            "synchronize() once more than the others; or, after hvd.join(), the ranks still training ran "
            "steps the others did not: call optimizer.sync_after_join(hvd.join()) on every rank). Every rank "
            "must run the same steps; stopping instead of averaging gradients of different steps.")


def _hvd():
    import horovod.torch as hvd
    return hvd


def is_average(op: Any) -> bool:
    """True for ``hvd.Average``, False for ``hvd.Sum``; anything else is refused."""
    hvd = _hvd()
    if op == hvd.Average:
        return True
    if op == hvd.Sum:
        return False
    raise ValueError(f"unsupported reduction op {op}; use hvd.Average or hvd.Sum")


def _begin(exchange: Any) -> None:
    if exchange.join_guard is not None:
        exchange.join_guard.begin()


def _confirm(exchange: Any) -> int:
    """The ranks still training this step when some are inside ``hvd.join()`` (0: all of them, or no
    guard counts them); a guard that cannot fall back raises instead (see ``exchange.JoinGuard``)."""
    if exchange.join_guard is None:
        return 0
    return exchange.join_guard.joined()
