"""Rank-side code of tests/test_numerics_and_payload_integrity.py (runs under horovodrun; see tests/harness.py)."""
from __future__ import annotations

from typing import Any, Dict, List

import horovod.torch as hvd
import torch

import hvd_gradcomp as gc
from tests.workers.integration import all_ranks_equal, error_bound, expected, grads_of, make_compressor

SETTINGS = {"qsgd": {"bits": 8}, "topk": {"ratio": 0.05}, "topkqsgd": {"ratio": 0.05, "bits": 8}, "none": {}}


def channels_last_gradient(kind: str, stock: bool = False) -> Dict[str, Any]:
    """One step of a channels_last conv model against an uncompressed reference computed here."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(8, 16, 3), torch.nn.Tanh(), torch.nn.Conv2d(16, 32, 3))
    model = model.to(memory_format=torch.channels_last)   # weights of 1152 and 4608 values: compressed
    kw = SETTINGS[kind]
    wrap = hvd.DistributedOptimizer if stock else gc.DistributedOptimizer
    opt = wrap(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
               compression=make_compressor(kind, **kw))
    x = torch.randn(4, 8, 10, 10, generator=torch.Generator().manual_seed(hvd.rank()))
    # The local gradient from a twin model: stock Horovod allreduces uncompressed tensors (the
    # biases) in place on p.grad in its background thread, so p.grad cannot be read back.
    torch.manual_seed(0)
    twin = torch.nn.Sequential(torch.nn.Conv2d(8, 16, 3), torch.nn.Tanh(), torch.nn.Conv2d(16, 32, 3))
    twin = twin.to(memory_format=torch.channels_last)
    twin(x.to(memory_format=torch.channels_last)).pow(2).mean().backward()
    local = grads_of(twin)
    model(x.to(memory_format=torch.channels_last)).pow(2).mean().backward()
    weights = [p for p in model.parameters() if p.dim() == 4]
    channels_last = all(p.grad.is_contiguous(memory_format=torch.channels_last) and not p.grad.is_contiguous()
                        for p in weights)
    opt.synchronize()
    out: Dict[str, Any] = {"channels_last": channels_last, "names": [], "identical": [], "max_err": [],
                           "bound": []}
    for name, p in model.named_parameters():
        ref = expected(kind, local[name], hvd.Average, kw, stock)
        out["names"].append(name)
        out["identical"].append(all_ranks_equal(p.grad))
        out["max_err"].append((p.grad - ref).abs().max().item())
        out["bound"].append(error_bound(kind, local[name], hvd.Average, kw, stock))
    return out


def fp16_steady_training(kind: str, steps: int) -> Dict[str, Any]:
    """An fp16 Linear whose weight gradient is ~1000 everywhere, every step, through
    gc.DistributedOptimizer: count non-finite entries of the averaged gradient per step."""
    torch.manual_seed(0)
    model = torch.nn.Linear(100, 100, bias=False).half()
    comp = {"topk": lambda: gc.TopK(ratio=0.01), "qsgd2": lambda: gc.QSGD(bits=2),
            "topkqsgd": lambda: gc.TopKQSGD(ratio=0.01, bits=8)}[kind]()
    opt = gc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                  named_parameters=model.named_parameters(), compression=comp)
    non_finite: List[int] = []
    max_abs = 0.0
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 * hvd.rank() + step)
        x = (1000 + torch.randn(1, 100, generator=g)).half()   # d(sum of outputs)/dW[i, j] = x[j]
        opt.zero_grad()
        model(x).float().sum().backward()
        opt.synchronize()
        grad = model.weight.grad
        non_finite.append(int((~torch.isfinite(grad)).sum()))
        max_abs = max(max_abs, float(grad.float().abs().max()))
        with opt.skip_synchronize():
            opt.step()
    residuals = comp.state_dict()["residuals"].values()
    return {"non_finite": non_finite, "max_abs": max_abs,
            "residual_finite": all(bool(torch.isfinite(r).all()) for r in residuals)}


def battery(scenarios: List[Dict[str, Any]]) -> List[Any]:
    """Run several scenarios in one job: [{"fn": name, **kwargs}]."""
    return [globals()[sc.pop("fn")](**sc) for sc in scenarios]
