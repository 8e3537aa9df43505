"""How the DDP hook splits a bucket (:class:`BucketPlans`): which of its parameters are compressed and
which join the dense allreduce, cached per bucket layout."""
import warnings
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist

from .. import wire
from .exchanges import _Plan, _Segment


class BucketPlans:
    """The layout of each DDP bucket (cached by its index and parameters), with this step's choices of the
    compressor applied: segments it does not compress now (``exclude=``, or its feedback's dense warm-up,
    e.g. ``"frozen"``) join the dense allreduce. The answers come from replicated state, so every rank
    splits a bucket the same way.

    The compressor is an argument of :meth:`plan`, not a part of this object: each of Auto's roads asks
    with its own (see :class:`hvd_gradcomp.ddp.auto._RoadView`).

    >>> plans = BucketPlans({}, rank=0)
    >>> plans.warned_outside
    False
    """

    def __init__(self, names: Dict[torch.Tensor, str], rank: int) -> None:
        self.names = names
        self.rank = rank
        self.warned_outside = False   # see outside_optimizer
        self._plans: Dict[Tuple[int, Tuple[int, ...]], _Plan] = {}

    def plan(self, bucket: dist.GradBucket, compression: Any, min_compress_numel: int) -> _Plan:
        """``bucket``'s layout under ``compression`` this step (parameters under ``min_compress_numel`` dense)."""
        params = bucket.parameters()
        key = (bucket.index(), tuple(id(p) for p in params))
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._make(bucket, params, compression, min_compress_numel)
        now_dense = tuple(s for s in plan.compressed if not compression.compresses(s.name)
                          or self.outside_optimizer(compression, s.name))
        if not now_dense:
            return plan
        return _Plan(tuple(s for s in plan.compressed if s not in now_dense), plan.dense + now_dense)

    def outside_optimizer(self, compression: Any, name: str) -> bool:
        """Whether ``name`` goes uncompressed because the feedback policy needs the optimizer's state of it
        and the optimizer passed to :func:`register` does not hold it (an optimizer over a part of the
        model: DDP still averages every parameter); said once, on rank 0."""
        feedback = getattr(compression, "feedback", None)
        if feedback is None or not feedback.needs_optimizer_state(name):
            return False
        if not self.warned_outside and self.rank == 0:
            self.warned_outside = True
            warnings.warn(f"hvd_gradcomp DDP hook: parameter {name!r} is not in the optimizer passed to register(): "
                          f"feedback={feedback.key!r} needs that optimizer's state to compress it, so it is averaged "
                          "uncompressed, as are the others outside it (said once). Pass an optimizer over the whole "
                          "model to compress them, or freeze them (requires_grad_(False)) before wrapping in DDP.",
                          RuntimeWarning, stacklevel=3)
        return True

    def _make(self, bucket: dist.GradBucket, params: List[torch.Tensor], compression: Any,
              min_compress_numel: int) -> _Plan:
        buffer = bucket.buffer()
        compressed, dense = [], []
        for p, g in zip(params, bucket.gradients()):
            name = self.names.get(p)
            if name is None:
                raise ValueError(f"a parameter of shape {tuple(p.shape)} in DDP bucket {bucket.index()} is not in "
                                 "named_parameters: pass the named_parameters() of the module DDP wraps")
            seg = _Segment(name, (g.data_ptr() - buffer.data_ptr()) // buffer.element_size(), p.numel(),
                           tuple(p.shape))
            small = p.numel() < min_compress_numel or buffer.dtype not in wire.DTYPES \
                or not compression.compressible(seg.shape)   # e.g. PowerSGD: 1-d tensors
            (dense if small else compressed).append(seg)
        return _Plan(tuple(compressed), tuple(dense))
