"""The study's compression settings, shared by its two workers (``worker.py``: Horovod;
``ddp_worker.py``: DDP): each is a key of the JSON results and a row of benchmarks/results/STUDY.md.

Horovod-free, so the DDP worker can import it: ``worker.py`` adds the one setting that needs
Horovod (``fp16``, Horovod's own compression).

>>> label, factory = SETTINGS["tq1"]
>>> label, type(factory(None)).__name__
('TopKQSGD(1%, 8)', 'TopKQSGD')
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Tuple

import hvd_gradcomp as gc
from hvd_gradcomp import feedback as fb


def fixed_rate_topkqsgd(optimizer: Any) -> Any:
    """TopKQSGD(1%, 8) with the policy ``feedback="auto"`` picks for ``optimizer``, except that its
    residual stays at the learning rate it was computed at (``follow_lr = False``): the recipe
    before residuals followed the rate, so the study shows what that gained."""
    policy = fb.make(fb.choose(optimizer, False, False)[0])
    policy.follow_lr = False
    return gc.TopKQSGD(ratio=0.01, bits=8, feedback=policy)


def previous_default(ratio: float) -> Any:
    """TopKQSGD(ratio, 8) with ``FrozenVariance``'s defaults before they changed (Adam's momentum kept
    while the learning rate changes, a 100-step sparsity warm-up after the freeze; see
    benchmarks/results/FREEZE_CHECK.md), so the study shows what the change did. Under a schedule ``v`` was then
    frozen for good (``follow_scale=None``); at a constant rate it followed the gradients' scale both
    ways, averaged as Adam averages, which no option does now: those tasks' rows are older runs."""
    return gc.TopKQSGD(ratio=ratio, bits=8, feedback=gc.FrozenVariance(momentum=None, sparsity_warmup=100,
                                                                        follow_scale=None))


# setting -> (label, compressor factory). Every compressor uses the library's defaults
# (feedback="auto") except "tq1-classic" (error feedback on gradients, the pre-issue-9 recipe) and
# "tq1-update" (compress the update: the previous default for Adam and AdamW).
SETTINGS: Dict[str, Tuple[str, Callable[[Any], Any]]] = {
    "none": ("uncompressed", lambda opt: None),
    "qsgd8": ("QSGD 8-bit", lambda opt: gc.QSGD(bits=8)),
    "qsgd4": ("QSGD 4-bit", lambda opt: gc.QSGD(bits=4)),
    "topk": ("TopK 1%", lambda opt: gc.TopK(ratio=0.01)),
    "tq1": ("TopKQSGD(1%, 8)", lambda opt: gc.TopKQSGD(ratio=0.01, bits=8)),
    "tq01": ("TopKQSGD(0.1%, 8)", lambda opt: gc.TopKQSGD(ratio=0.001, bits=8)),
    # The sparsity warm-up of 100 steps whatever the ratio (before it kept its pace below 1%): as a
    # schedule of the user's own, which counts the same compressed steps as the policy's
    "tq01-spw100": ("TopKQSGD(0.1%, 8), 100-step sparsity warm-up",
                    lambda opt: gc.TopKQSGD(ratio=gc.SparsityWarmup(0.001, steps=100), bits=8)),
    # momentum correction's sparsity warm-up at 0.1% before it lasted sqrt(1%/ratio) times its 100 steps
    # (317): 172 steps, the pace it has at 1%, as a schedule of the user's own
    "tq01-spw172": ("TopKQSGD(0.1%, 8), 172-step sparsity warm-up",
                    lambda opt: gc.TopKQSGD(ratio=gc.SparsityWarmup(0.001, steps=172), bits=8)),
    # char-MLP's output layer (out.weight, 65,536 values: 66 a step at 0.1%) kept at 1% (min_ratio=)
    "tq01-out1": ("TopKQSGD(0.1%, 8), output layer at 1% (min_ratio)",
                  lambda opt: gc.TopKQSGD(ratio=0.001, bits=8, min_ratio={r"^out\.": 0.01})),
    "tq1-classic": ("TopKQSGD(1%, 8), classic EF", lambda opt: gc.TopKQSGD(ratio=0.01, bits=8, feedback="classic")),
    "tq1-momentum": ("TopKQSGD(1%, 8), momentum correction",
                     lambda opt: gc.TopKQSGD(ratio=0.01, bits=8, feedback="momentum")),
    "tq1-update": ("TopKQSGD(1%, 8), compress the update", lambda opt: gc.TopKQSGD(ratio=0.01, bits=8, feedback="update")),
    # Momentum correction's default sparsity warm-up switched off: the default before it was one.
    "tq1-nospw": ("TopKQSGD(1%, 8), no sparsity warm-up",
                  lambda opt: gc.TopKQSGD(ratio=0.01, bits=8, feedback=gc.MomentumCorrection(sparsity_warmup=0))),
    # The residual kept at the rate it was computed (before it followed the learning rate)
    "tq1-fixedlr": ("TopKQSGD(1%, 8), residual not following the rate", fixed_rate_topkqsgd),
    # Adam and AdamW: FrozenVariance's default before it dropped Adam's momentum and its sparsity
    # warm-up (benchmarks/results/FREEZE_CHECK.md); Adam's first moment kept by every tensor; the default with the
    # sparsity warm-up back. All with the 100-step sparsity warm-up they ran with.
    "tq1-prev": ("TopKQSGD(1%, 8), previous default", lambda opt: previous_default(0.01)),
    "tq01-prev": ("TopKQSGD(0.1%, 8), previous default", lambda opt: previous_default(0.001)),
    "tq1-mom": ("TopKQSGD(1%, 8), Adam's momentum kept",
                lambda opt: gc.TopKQSGD(ratio=0.01, bits=8, feedback=gc.FrozenVariance(momentum=True, sparsity_warmup=100))),
    "tq01-mom": ("TopKQSGD(0.1%, 8), Adam's momentum kept",
                 lambda opt: gc.TopKQSGD(ratio=0.001, bits=8, feedback=gc.FrozenVariance(momentum=True, sparsity_warmup=100))),
    "tq1-nomom": ("TopKQSGD(1%, 8), sparsity warm-up after the freeze",
                  lambda opt: gc.TopKQSGD(ratio=0.01, bits=8, feedback=gc.FrozenVariance(sparsity_warmup=100))),
    "tq01-nomom": ("TopKQSGD(0.1%, 8), sparsity warm-up after the freeze",
                   lambda opt: gc.TopKQSGD(ratio=0.001, bits=8, feedback=gc.FrozenVariance(sparsity_warmup=100))),
    # Below 1% with Adam, "auto" gives FrozenVariance a sparsity warm-up after the freeze, sending
    # Adam's momentum while it is dense (compressors.LOW_RATIO_FROZEN); before, it had neither:
    "tq01-nowarm": ("TopKQSGD(0.1%, 8), no sparsity warm-up after the freeze",
                    lambda opt: gc.TopKQSGD(ratio=0.001, bits=8, feedback=gc.FrozenVariance())),
    # The frozen v never following the gradients' scale (the default follows it where it shrinks):
    # under a schedule, the default before it did
    "tq1-vfrozen": ("TopKQSGD(1%, 8), v frozen for good",
                    lambda opt: gc.TopKQSGD(ratio=0.01, bits=8, feedback=gc.FrozenVariance(follow_scale=None))),
    # Adam's second moment frozen after a third of the CNN's 600 steps (the default: 100)
    "tq1-warm200": ("TopKQSGD(1%, 8), second moment frozen after 200 steps",
                    lambda opt: gc.TopKQSGD(ratio=0.01, bits=8, feedback=gc.FrozenVariance(warmup=200))),
    # Adam's second moment frozen 3x later than the default (100 steps): the run-length configuration's longer runs
    "tq1-warm300": ("TopKQSGD(1%, 8), second moment frozen after 300 steps",
                    lambda opt: gc.TopKQSGD(ratio=0.01, bits=8, feedback=gc.FrozenVariance(warmup=300))),
}
