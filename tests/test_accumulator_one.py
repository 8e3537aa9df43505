"""Issue 60: one accumulator, one name map, one place that chooses the feedback policy, and a DDP hook
state built of small parts. The behaviour of each is tested where it was (test_ddp.py, test_integration.py,
test_horovod_adapter.py...); here: that there is one of each."""
import ast
from pathlib import Path
from types import SimpleNamespace
from typing import List

import pytest
import torch

import hvd_gradcomp
import hvd_gradcomp.ddp as gc_ddp
from hvd_gradcomp.feedback import names, registry
from hvd_gradcomp.horovod import accumulate

DDP = Path(__file__).resolve().parents[1] / "hvd_gradcomp" / "ddp"
COMPRESSOR_NAMES = {"comp", "compression", "compressor", "codec"}   # how ddp/ names a compressor


def test_the_two_accumulator_paths_are_one_class() -> None:
    assert gc_ddp.GradientAccumulator is hvd_gradcomp.GradientAccumulator is accumulate.GradientAccumulator
    from hvd_gradcomp.ddp.accumulate import GradientAccumulator
    assert GradientAccumulator is accumulate.GradientAccumulator


def test_the_first_argument_picks_the_wrapper_part() -> None:
    acc = hvd_gradcomp.GradientAccumulator(SimpleNamespace(backward_passes_per_step=2), steps=2, micro_batch=3)
    assert isinstance(acc.wrapper, accumulate.HorovodWrapper) and acc.model is None
    assert acc.effective_batch(ranks=2) == 12
    with pytest.raises(TypeError, match="takes the DistributedDataParallel model, got Linear"):
        gc_ddp.GradientAccumulator(torch.nn.Linear(2, 2), torch.optim.SGD([torch.zeros(1)], lr=0.1), steps=2)
    with pytest.raises(TypeError):   # the DDP form needs the optimizer too
        gc_ddp.GradientAccumulator(torch.nn.Linear(2, 2), steps=2)


def test_the_horovod_form_counts_scales_and_flushes() -> None:
    """The shared logic once: loss / N, a step every N-th backward, the tail rescaled by N/k."""
    w = torch.nn.Parameter(torch.zeros(2))
    inner = torch.optim.SGD([w], lr=1.0)
    steps: List[int] = []
    opt = SimpleNamespace(backward_passes_per_step=4, param_groups=inner.param_groups,
                          step=lambda: steps.append(1) or inner.step(), zero_grad=inner.zero_grad)
    acc = hvd_gradcomp.GradientAccumulator(opt, steps=4)
    for _ in range(6):
        acc.backward((w * torch.tensor([1.0, 2.0])).sum())
    assert acc.optimizer_steps == 1 and acc.pending == 2 and w.tolist() == [-1.0, -2.0]
    assert acc.flush() and acc.pending == 0 and acc.optimizer_steps == 2 and w.tolist() == [-2.0, -4.0]
    assert not acc.flush() and len(steps) == 2


def test_one_name_map() -> None:
    from hvd_gradcomp import horovod
    from hvd_gradcomp.ddp import state
    from hvd_gradcomp.horovod import stock
    assert stock.name_map is horovod.name_map is state._name_map is names.name_map
    source = (DDP.parent / "horovod" / "optimizer.py").read_text()
    assert "from ..feedback.names import name_map" in source


def test_the_names_module_imports_no_horovod_nor_torch_distributed() -> None:
    tree = ast.parse(Path(names.__file__).read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not any(m.startswith(("horovod", "torch.distributed")) for m in imported), imported


def test_the_hook_policies_live_in_the_feedback_registry() -> None:
    assert gc_ddp.HOOK_POLICIES is registry.HOOK_POLICIES
    assert set(registry.HOOK_POLICIES) <= set(registry.POLICIES)


def private_compressor_reads(source: str) -> List[str]:
    """``X._name`` (not a dunder) where ``X`` names a compressor: ``comp._x``, ``state.compression._x``...

    >>> private_compressor_reads("comp._restored; self.compression._x; self._plans; state._lock; comp.feedback")
    ['comp._restored', 'self.compression._x']
    """
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
            continue
        owner = node.value
        named = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else None
        if named in COMPRESSOR_NAMES:
            found.append(ast.unparse(node))
    return found


def test_the_ddp_side_reads_no_private_compressor_attributes() -> None:
    assert private_compressor_reads("comp._contracting") == ["comp._contracting"]   # the check itself
    bad = {path.name: private_compressor_reads(path.read_text()) for path in sorted(DDP.glob("*.py"))}
    bad = {k: v for k, v in bad.items() if v}
    assert not bad, f"hvd_gradcomp/ddp/ reads private compressor attributes (use its public API): {bad}"


def test_no_ddp_class_passes_200_lines() -> None:
    for path in sorted(DDP.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                assert node.end_lineno - node.lineno + 1 <= 200, f"{path.name}: class {node.name}"
