"""Reducing every rank's payloads once they arrived: decode them in rank order and sum them, the
same additions in the same order on every rank, so every rank gets the same bits. Generic: no
Horovod, no ``torch.distributed``; the Horovod exchanges (:mod:`hvd_gradcomp.collectives.exchange`) and the
DDP hook's drivers (:mod:`hvd_gradcomp.ddp`) both reduce with these.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from .. import wire
from ..codecs.compressor import GradientCompressor
from ..feedback import known_terms, residual_dtype


Parts = List[Tuple[Optional[torch.Tensor], torch.Tensor]]


def decode_payloads(compressor: GradientCompressor, payloads: List[torch.Tensor], size: int,
                    numel: Optional[int] = None, headers: Optional[List[wire.Header]] = None) -> Parts:
    """Every rank's payload decoded, in rank order, as (indices or None, values).

    With ``numel``, each payload must stand for a tensor of that many elements. ``headers``:
    the payloads' headers when already parsed (see :func:`wire.split_with_headers`); each
    read is a device-to-host copy on GPU, so none is read twice.
    """
    if len(payloads) != size:
        raise RuntimeError(f"expected {size} payloads, got {len(payloads)}: ranks disagree on this exchange")
    headers = headers if headers is not None else [wire.read_header(pl) for pl in payloads]
    if numel is not None:
        for rank, h in enumerate(headers):
            if h.numel != numel:
                raise wire.WireFormatError(f"the payload of rank {rank} holds {h.numel} elements, {numel} expected: "
                                           "ranks disagree on the tensor's shape")
    return [compressor.decode_parts(pl, h) for pl, h in zip(payloads, headers)]


def decode_flagged(compressor: GradientCompressor, payloads: List[Optional[torch.Tensor]], numel: int,
                   device: torch.device, mine: Optional[Tuple[int, Tuple[torch.Tensor, torch.Tensor]]] = None) -> Parts:
    """:func:`decode_payloads` of payloads where ``None`` flags a rank whose input held NaN/Inf:
    its part is NaN everywhere (float32 on ``device``), so every sum holding it is NaN.
    ``mine``: (this rank, its part as its encoder carried it), taken as is, not decoded.

    >>> from hvd_gradcomp.codecs.qsgd import QSGD
    >>> c = QSGD(bits=8, seed=0)
    >>> parts = decode_flagged(c, [c.compress_named("w", torch.ones(4)), None], 4, torch.device("cpu"))
    >>> [v.tolist() for _, v in parts][1]
    [nan, nan, nan, nan]
    """
    at, part = mine if mine is not None else (-1, None)
    sent = [pl for r, pl in enumerate(payloads) if pl is not None and r != at]
    decoded = iter(decode_payloads(compressor, sent, len(sent), numel))
    return [(None, torch.full((numel,), float("nan"), device=device)) if pl is None else part if r == at
            else next(decoded) for r, pl in enumerate(payloads)]


def sparse_support(parts: Parts) -> Optional[torch.Tensor]:
    """Every rank's sent indices, concatenated (repeats kept), when every part is sparse: outside
    them the sum of ``parts`` is zero, so a feedback policy can rewrite the average there alone
    (:meth:`hvd_gradcomp.feedback.Feedback.received`). None when a part is dense or non-finite.

    >>> sparse_support([(torch.tensor([0, 4]), torch.ones(2)), (torch.tensor([4]), torch.ones(1))]).tolist()
    [0, 4, 4]
    >>> sparse_support([(None, torch.ones(5))]) is None
    True
    """
    if not parts or any(idx is None for idx, _ in parts):
        return None
    return torch.cat([idx for idx, _ in parts])


def sums_in_place(out: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether :func:`sum_parts` adds a ``dtype`` gradient's parts straight into ``out``: contiguous
    and of the accumulation dtype (else it sums into a buffer and copies).

    >>> sums_in_place(torch.zeros(4), torch.float32), sums_in_place(torch.zeros(4, dtype=torch.half), torch.half)
    (True, False)
    """
    return out.dtype == residual_dtype(dtype) and out.is_contiguous()


def sum_parts(parts: Parts, average: bool, numel: int, dtype: torch.dtype,
              out: Optional[torch.Tensor] = None, zeroed: bool = False, held: Optional[int] = None) -> torch.Tensor:
    """The average (``average=True``) or sum of decoded parts; no collective, any backend.

    Every rank runs the same additions in the same order on the same bytes, so every rank
    gets bit-identical results. Sums run in float32 for 16-bit gradients. Sparse parts are
    added straight into one zeroed buffer; with ``out`` (where :func:`sums_in_place`) the result
    is written there. ``zeroed``: ``out`` already holds zeros (see
    :meth:`FusedAllgatherExchange.before_wait`), so the pass that zeroes it is skipped. ``held``:
    the index of a part that ``out`` holds already, added by :func:`add_part` onto those zeros
    (two ranks only: see :meth:`FusedAllgatherExchange.before_wait`); it is not added again.

    >>> parts = [(torch.tensor([0, 2]), torch.tensor([1.0, 2.0])), (torch.tensor([2]), torch.tensor([4.0]))]
    >>> sum_parts(parts, True, 3, torch.float32).tolist()
    [0.5, 0.0, 3.0]
    >>> out = add_part(torch.zeros(3), parts[1], 0.5)
    >>> sum_parts(parts, True, 3, torch.float32, out=out, zeroed=True, held=1).tolist()
    [0.5, 0.0, 3.0]
    """
    scale = 1.0 / len(parts) if average else 1.0
    acc_dtype = residual_dtype(dtype)
    direct = out is not None and sums_in_place(out, dtype)
    if held is not None and not (direct and zeroed):
        raise ValueError("sum_parts(held=...) needs an out that holds the part already (zeroed=True, summed in place)")
    acc = out.view(-1) if direct else torch.empty(numel, dtype=acc_dtype, device=parts[0][1].device)
    if not (direct and zeroed):
        acc.zero_()
    for i, part in enumerate(parts):
        if i != held:
            add_part(acc, part, scale)
    if out is not None and not direct:
        out.copy_(acc.view_as(out))
        return out
    return acc if acc.dtype == dtype else acc.to(dtype)


def add_part(acc: torch.Tensor, part: Tuple[Optional[torch.Tensor], torch.Tensor], scale: float) -> torch.Tensor:
    """``acc += scale * part`` in place (a sparse part's values at its indices, or a dense part),
    in ``acc``'s dtype; returns ``acc``, flat.

    >>> add_part(torch.zeros(4), (torch.tensor([1, 3]), torch.tensor([2.0, 4.0])), 0.5).tolist()
    [0.0, 1.0, 0.0, 2.0]
    """
    idx, vals = part
    acc = acc.view(-1)
    if idx is None:
        return acc.add_(vals.to(acc.dtype), alpha=scale)
    return acc.index_add_(0, idx, vals.to(acc.dtype), alpha=scale)


def own_dense(compressor: GradientCompressor, payload: Optional[torch.Tensor], numel: int, device: torch.device,
              own: Optional[Tuple[Optional[torch.Tensor], torch.Tensor]] = None) -> torch.Tensor:
    """This rank's part of an exchange as a dense float32 tensor of ``numel`` values: what its payload
    carries (``own``: as its encoder carried it, not decoded), or NaN everywhere for a payload flagged
    ``None`` (its input held NaN/Inf). What a rank sends when ranks inside ``hvd.join()`` leave an
    allgather impossible: summed by an allreduce, to which a joined rank adds zeros.

    >>> from hvd_gradcomp import TopK
    >>> c = TopK(ratio=0.5, min_k=1)
    >>> own_dense(c, c.compress_named("w", torch.tensor([1.0, -4.0, 0.5, 3.0])), 4, torch.device("cpu")).tolist()
    [0.0, -4.0, 0.0, 3.0]
    >>> own_dense(c, None, 2, torch.device("cpu")).tolist()
    [nan, nan]
    """
    if payload is None:
        return torch.full((numel,), float("nan"), dtype=torch.float32, device=device)
    part = own if own is not None else compressor.decode_parts(payload)
    return add_part(torch.zeros(numel, dtype=torch.float32, device=device), part, 1.0)


def finite_at_indices(compressor: GradientCompressor, parts: Parts, out: torch.Tensor,
                      name: str = "") -> Optional[torch.Tensor]:
    """Whether ``out`` (the sum of sparse ``parts`` by :func:`sum_parts`, then the feedback policy's
    ``received`` of tensor ``name``) is all finite, read at the parts' indices only: everywhere else
    it is zero, or changed by the policy at indices it names
    (:meth:`~hvd_gradcomp.feedback.Feedback.received_terms`: momentum correction's previous
    average). A 0-dim bool tensor (no host sync), or None when that shortcut does not hold (a dense
    part, or a policy whose rewrite is not known): then the caller checks all of ``out``.

    Checking a 25M-value gradient in full costs a pass over it in ``synchronize()`` (with momentum
    SGD and AdamW it was done for every tensor there); this reads the ~1% of it that can differ
    from zero. On the CPU even that gather (a cache miss per index: ~1 ms for a
    4M-value tensor's two parts, in ``synchronize()``) is skipped when the values alone prove it
    (:func:`_parts_bounded`).

    >>> from hvd_gradcomp import TopK
    >>> c = TopK(ratio=0.5)
    >>> parts = [(torch.tensor([1, 3]), torch.tensor([1.0, 3e38])), (torch.tensor([3]), torch.tensor([3e38]))]
    >>> bool(finite_at_indices(c, parts[:1], sum_parts(parts[:1], False, 4, torch.float32)))
    True
    >>> bool(finite_at_indices(c, parts, sum_parts(parts, False, 4, torch.float32)))  # 6e38 overflows
    False
    """
    terms = known_terms(compressor.feedback, name)
    if not parts or any(idx is None for idx, _ in parts) or terms is None:
        return None
    terms = list(parts) + terms
    if out.device.type == "cpu":   # reading the bound is free there; on a GPU it would be a sync
        bounded = _parts_bounded(terms, out.dtype)
        if bool(bounded):
            return bounded
    flat = out.reshape(-1)
    return torch.stack([torch.isfinite(flat[idx]).all() for idx, _ in terms]).all()


def _parts_bounded(parts: Parts, dtype: torch.dtype) -> torch.Tensor:
    """0-dim bool: True proves that any sum of the parts' values, scaled by at most 1 (an average or
    a sum), is finite in ``dtype``: the sum of every value's magnitude stays under half its
    largest value (the margin absorbs float32 rounding). False: a value is NaN/Inf, or the values
    are too large to tell (the caller then reads the sums themselves). No random access: the
    values are contiguous, ~1% of the tensor."""
    total = torch.stack([vals.abs().sum(dtype=torch.float32) for _, vals in parts]).sum()
    return total < torch.finfo(dtype).max / 2


def reduce_payloads(compressor: GradientCompressor, payloads: List[torch.Tensor], average: bool, size: int,
                    dtype: torch.dtype, out: Optional[torch.Tensor] = None,
                    headers: Optional[List[wire.Header]] = None) -> torch.Tensor:
    """The average (or sum) of every rank's payload, decoded in rank order (see :func:`sum_parts`)."""
    headers = headers if headers is not None else [wire.read_header(pl) for pl in payloads]
    numel = headers[0].numel if headers else 0
    return sum_parts(decode_payloads(compressor, payloads, size, numel, headers), average, numel, dtype, out)


def chunk_bounds(n: int, parts: int) -> List[int]:
    """Boundaries of ``parts`` nearly equal chunks of n elements: [0, ..., n].

    >>> chunk_bounds(10, 3)
    [0, 4, 7, 10]
    """
    base, extra = divmod(n, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    return bounds
