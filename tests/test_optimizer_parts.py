"""``hvd_gradcomp.DistributedOptimizer`` is built of parts it owns (issue 60): each a small class in its own
module of ``hvd_gradcomp/horovod/``, and the wrapped optimizer is still an instance of the user's class.

The parts' behaviour across ranks is checked by the multi-rank files (test_horovod_features.py,
test_closure_horovod.py, test_horovod_join.py, test_clipping.py, test_wrappers_agree.py) and by
scripts/bit_identity.py; here: their sizes, and what one process shows.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.harness import ROOT, rank_env
from tests.test_structure import oversized

HOROVOD = ROOT / "hvd_gradcomp" / "horovod"
PARTS = {"optimizer.py": "_GradCompOptimizer", "exchanges.py": "StepExchanges", "hooks.py": "GradientHooks",
         "small.py": "SmallTensors", "watch.py": "ChangeWatch"}


@pytest.mark.parametrize("module", sorted(PARTS))
def test_each_part_is_small(module: str, tmp_path: Path) -> None:
    """No class parked under the 300-line cap: each part under 200 lines, its module under 500."""
    (tmp_path / module).write_text((HOROVOD / module).read_text())
    assert oversized(tmp_path, max_module=500, max_class=200) == []
    assert f"class {PARTS[module]}" in (HOROVOD / module).read_text()


def test_hooks_count_the_backward_passes() -> None:
    from hvd_gradcomp.horovod.hooks import GradientHooks
    calls = []
    w, frozen = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2), requires_grad=False)
    hooks = GradientHooks(passes=2, hook=calls.append)
    hooks.register([{"params": [w, frozen]}])
    assert hooks.params() == [w]
    (w * 2).sum().backward()
    assert calls == [w] and not hooks.count(w) and hooks.count(w)
    frozen.requires_grad_(True)      # unfrozen since: hooked at the next synchronize()
    frozen.grad = torch.zeros(2)
    hooks.adopt([{"params": [w, frozen]}])
    assert hooks.params() == [w, frozen]
    hooks.rearm()
    assert not hooks.count(w)
    hooks.remove()
    (w * 2).sum().backward()
    assert calls == [w]


def test_change_watch_names_a_gradient_changed_after_backward() -> None:
    from hvd_gradcomp.horovod.watch import ChangeWatch
    w = torch.nn.Parameter(torch.ones(3))
    watch = ChangeWatch({w: "w"})
    w.register_post_accumulate_grad_hook(watch.watch)   # final at each pass; versions taken as backward ends
    (w * 2).sum().backward()
    assert watch.taken() and watch.changed() is None
    (w * 2).sum().backward()
    w.grad.mul_(0.5)                 # clip_grad_norm_ before synchronize()
    assert watch.changed() == "w"
    with pytest.raises(RuntimeError, match="'w' was changed after backward"):
        watch.refuse("w")


def test_wrapped_optimizer_keeps_its_surface() -> None:
    """One rank: the user's class, the methods and attributes users, tests and horovod/elastic.py read."""
    code = textwrap.dedent("""
        import torch, horovod.torch as hvd, hvd_gradcomp as gc
        hvd.init()
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 4))
        opt = gc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      named_parameters=model.named_parameters(), compression=gc.TopKQSGD(ratio=0.1))
        assert isinstance(opt, torch.optim.SGD) and type(opt).__name__ == "SGD"
        for name in ("synchronize", "skip_synchronize", "step", "zero_grad", "sync_after_join", "remove_hooks",
                     "state_dict", "load_state_dict", "add_param_group", "compression", "comm_stats", "comm_wait_s",
                     "exchange_timing", "last_local_norm", "last_step_bytes", "process_set", "op",
                     "backward_passes_per_step", "min_compress_numel", "sparse_as_dense",
                     "_compressed", "_pending", "_early_fused", "_progress", "_included", "_parameter_names"):
            assert hasattr(opt, name), name
        model(torch.randn(8, 64)).sum().backward()
        assert len(opt._pending) == 1 and opt._early_fused is not None   # started from the hooks
        try:
            opt.zero_grad()
        except AssertionError:
            pass
        else:
            raise SystemExit("zero_grad() with exchanges in flight must refuse")
        opt._progress()
        opt.synchronize()
        assert not opt._pending and opt._early_fused is None and opt.last_step_bytes > 0
        with opt.skip_synchronize():
            opt.step()
        road = opt._compressed
        opt._compressed = road               # tests swap the road: the part's
        assert opt._compressed is road
        print("OK")
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=rank_env(), capture_output=True,
                         text=True, timeout=300)
    assert out.stdout.strip().endswith("OK"), out.stdout + out.stderr
