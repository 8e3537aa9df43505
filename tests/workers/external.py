"""Rank side of tests/test_external_codec.py and tests/test_sign_codec.py: a compressor written
outside the package on every road, through the package's public interface only. Two codecs:
``randomk`` (tests/external_randomk.py: sparse, TopK's layout) and ``ef-sign``
(tests/plugins/sign_plugin: dense, a payload layout of its own; its folder, or the folder pip
installed it into, must be on the ranks' path).

:func:`run` trains a small model a few steps and reports, per step, the identities the tests
assert: the average every rank gets is the mean of what each rank's payloads carried, and
what they carried is exactly what the codec makes of the compensated gradient (error feedback
keeps the rest); the bytes, against an independent calculation; and whether a run resumed from
a checkpoint continues bit-identically. The DDP worker (tests/ddp_external_workers.py) runs the
same function with torch.distributed.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

import torch
import torch.nn as nn

COMPRESSED = ("0.weight", "2.weight")   # 2,048 and 3,072 values; the rest is under min_compress_numel


@dataclass(frozen=True)
class Codec:
    """How :func:`run` builds a codec and checks what it sent, independently of its encoder.

    * ``make(seed)``: the compressor;
    * ``payload_bytes(comp, name, shape, step)``: the bytes of its payload, from its definition;
    * ``sent_error(compensated, sent)``: 0 when ``sent`` (what error feedback says went out) is
      what the codec's definition makes of ``compensated``, else the largest difference.
    """

    make: Callable[[int], Any]
    payload_bytes: Callable[[Any, str, Tuple[int, ...], int], int]
    sent_error: Callable[[torch.Tensor, torch.Tensor], float]


def _randomk() -> Codec:
    from tests.external_randomk import RandomK, expected_payload_bytes

    def sent_error(compensated: torch.Tensor, sent: torch.Tensor) -> float:
        at = sent != 0     # the k coordinates sent carry their compensated value exactly
        return float((sent[at] - compensated[at]).abs().max()) if bool(at.any()) else 0.0

    return Codec(lambda seed: RandomK(ratio=0.25, seed=seed), expected_payload_bytes, sent_error)


def _ef_sign() -> Codec:
    from hvdgc_sign_plugin import EFSign

    from hvd_gradcomp import wire

    def payload_bytes(comp: Any, name: str, shape: Tuple[int, ...], step: int) -> int:
        # header + shape, one float32 scale, one bit per value; each padded to 8 bytes
        return wire.padded(40 + 8 * len(shape)) + 8 + wire.padded(math.ceil(math.prod(shape) / 8))

    def sent_error(compensated: torch.Tensor, sent: torch.Tensor) -> float:
        scale = compensated.abs().mean()
        expect = torch.where(compensated < 0, -scale, scale)
        return float((sent - expect).abs().max() / scale)

    return Codec(lambda seed: EFSign(seed=seed), payload_bytes, sent_error)


def _ef_sign_reduced() -> Codec:
    """EF-Sign declared on the compressed allreduce (QSGD's road: chunks scattered, reduced and
    re-encoded, gathered): a dense codec of its own on that road too. Stock Horovod carries every
    payload by allgather."""
    from hvdgc_sign_plugin import EFSign

    from hvd_gradcomp import codecs

    class ReducedSign(EFSign):
        codec_name, collective = "ef-sign-reduced", codecs.COMPRESSED_ALLREDUCE

    spec = _ef_sign()
    return Codec(lambda seed: ReducedSign(seed=seed), spec.payload_bytes, spec.sent_error)


CODECS = {"randomk": _randomk, "ef-sign": _ef_sign, "ef-sign-reduced": _ef_sign_reduced}


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 10))


def batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)


def local_grads(model: nn.Module, rank: int, step: int) -> Dict[str, torch.Tensor]:
    """This rank's own gradient, from a copy of the model (the exchange may write ``p.grad`` during backward)."""
    ref = copy.deepcopy(model)
    x, y = batch(rank, step)
    names, params = zip(*ref.named_parameters())
    grads = torch.autograd.grad(nn.functional.cross_entropy(ref(x), y), params)
    return dict(zip(names, grads))


def run(wrap: Callable[[nn.Module, Any, Any], Any], mean: Callable[[torch.Tensor], torch.Tensor],
        rank: int, steps: int = 4, resume_at: int = 2, codec: str = "randomk",
        comm_bytes: Optional[Callable[[Any, str], int]] = None,
        save: Optional[Callable[[Any, Any], Any]] = None,
        load: Optional[Callable[[Any, Any, Any], None]] = None) -> Dict[str, Any]:
    """``wrap(model, comp, optimizer) -> (handle, optimizer, module to call forward on)`` puts the
    compressor (``codec``, a key of :data:`CODECS`) on a road; ``comm_bytes(handle, name)``,
    ``save(handle, comp)`` and ``load(handle, comp, saved)`` take its handle."""
    spec = CODECS[codec]()
    model, comp = net(), spec.make(5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    handle, opt, fwd = wrap(model, comp, opt)
    out: Dict[str, Any] = {"ef_error": [], "avg_error": [], "sent_counts": [], "expected": {}, "codec": {},
                           "comm": {}, "feedback": None, "sent_error": []}
    saved = None
    for step in range(steps):
        if step == resume_at:
            saved = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()), save(handle, comp))
        local = local_grads(model, rank, step)
        before = {n: _residual(comp, n, local[n]) for n in COMPRESSED}
        opt.zero_grad()
        x, y = batch(rank, step)
        nn.functional.cross_entropy(fwd(x), y).backward()
        opt.step()
        grads = dict(model.named_parameters())
        for n in COMPRESSED:
            after = _residual(comp, n, local[n])
            compensated = local[n].reshape(-1) + before[n]
            sent = compensated - after          # what this rank's payload carried
            out["sent_error"].append(spec.sent_error(compensated, sent))
            out["sent_counts"].append(int((sent != 0).sum()))
            out["ef_error"].append(float((after[sent != 0]).abs().max()) if bool((sent != 0).any()) else 0.0)
            avg = mean(sent.clone())
            out["avg_error"].append(float((grads[n].grad.reshape(-1) - avg).abs().max() / avg.abs().max()))
            out["expected"][n] = out["expected"].get(n, 0) + spec.payload_bytes(comp, n, tuple(local[n].shape),
                                                                                  step)
    out["feedback"] = comp.feedback.key
    if hasattr(comp, "selected"):
        out["k"] = {n: comp.selected(dict(model.named_parameters())[n].numel()) for n in COMPRESSED}
    for n in COMPRESSED:
        out["codec"][n] = comp.stats.per_tensor[n][1] - comp.stats.per_tensor[n][2]   # payload: sent less framing
        if comm_bytes is not None:
            out["comm"][n] = comm_bytes(handle, n)
    # The one ledger: the road's counter is the compressor's, and its last step holds exactly the
    # compressed payloads of that step plus the small tensors' float16 casts; framing apart.
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    small = sum(math.prod(shape) for n, shape in shapes.items() if n not in COMPRESSED)
    out["ledger"] = comp.stats.report()
    out["ledger_last_payload"] = sum(spec.payload_bytes(comp, n, shapes[n], steps - 1) for n in COMPRESSED) + 2 * small
    out["ledger_shared"] = getattr(handle, "comm_stats", comp.stats) is comp.stats
    final = [p.detach().clone() for p in model.parameters()]

    # Resume: a new model, optimizer and compressor from the checkpoint taken at step ``resume_at``.
    model2, comp2 = net(), spec.make(123)   # the seed comes from the checkpoint
    model2.load_state_dict(saved[0])
    handle2, opt2, fwd2 = wrap(model2, comp2, torch.optim.SGD(model2.parameters(), lr=0.1))
    opt2.load_state_dict(saved[1])
    load(handle2, comp2, saved[2])
    for step in range(resume_at, steps):
        opt2.zero_grad()
        x, y = batch(rank, step)
        nn.functional.cross_entropy(fwd2(x), y).backward()
        opt2.step()
    out["resumed_identical"] = all(torch.equal(a, b) for a, b in zip(final, model2.parameters()))
    out["final"] = torch.cat([p.reshape(-1) for p in final]).tolist()
    return out


def _residual(comp: Any, name: str, like: torch.Tensor) -> torch.Tensor:
    r = comp.residuals.residual(name)
    return torch.zeros(like.numel()) if r is None else r.reshape(-1).clone()


# ---------------------------------------------------------------- the Horovod roads
def horovod_road(road: str, codec: str = "randomk") -> Dict[str, Any]:
    """``road``: "ours" (hvd_gradcomp.DistributedOptimizer) or "stock" (hvd.DistributedOptimizer)."""
    import horovod.torch as hvd

    import hvd_gradcomp as gc

    def wrap(model: nn.Module, comp: Any, opt: Any) -> Any:
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        cls = gc.DistributedOptimizer if road == "ours" else hvd.DistributedOptimizer
        opt = cls(opt, named_parameters=model.named_parameters(), compression=comp)
        return opt, opt, model

    def comm(opt: Any, name: str) -> int:
        return opt.comm_stats.per_tensor[name][1]

    calls = iter(range(1 << 30))

    def mean(t: torch.Tensor) -> torch.Tensor:
        return hvd.allreduce(t, op=hvd.Average, name=f"check.{next(calls)}")

    return run(wrap, mean, hvd.rank(), codec=codec, comm_bytes=comm if road == "ours" else None,
               save=lambda opt, comp: copy.deepcopy(comp.state_dict()),
               load=lambda opt, comp, state: comp.load_state_dict(state))

