"""``hvd.join()`` with compression (issue 63): what each rank hands to Horovod per step, and what
its residual holds, when the data is uneven. Rank ``r`` has ``BATCHES - r`` batches, then calls
``hvd.join()`` and ``opt.sync_after_join``. No timing.

    .venv/bin/horovodrun -np 2 -H localhost:2 --gloo .venv/bin/python benchmarks/bench_join.py
    .venv/bin/horovodrun -np 3 -H localhost:3 --gloo .venv/bin/python benchmarks/bench_join.py

Printed by rank 0: Horovod's own ``Average`` of a probe while a rank is inside ``hvd.join()`` (its
divisor), then per step and rank the ranks still training, the bytes handed to Horovod and the
L2 norm of the rank's residuals (TopKQSGD(1%, 8), momentum correction under SGD(momentum=0.9)),
and for each rank whether the residuals it had when it joined are those it holds after the sync.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import horovod.torch as hvd  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import hvd_gradcomp as gc  # noqa: E402

BATCHES = 5


def residual_norm(comp: Any) -> float:
    res = comp.state_dict()["residuals"]
    return float(torch.linalg.vector_norm(torch.cat([r.reshape(-1) for r in res.values()]))) if res else 0.0


def horovod_average_under_join() -> List[float]:
    """Horovod's own Average of (rank + 1) while the last rank is inside hvd.join()."""
    if hvd.rank() == hvd.size() - 1:
        hvd.join()
        return []
    out = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Average, name="probe.average").tolist()
    hvd.join()
    return out


def main() -> None:
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    probe = horovod_average_under_join()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Tanh(), torch.nn.Linear(512, 10))
    comp = gc.TopKQSGD(ratio=0.01, bits=8, seed=0)
    opt = gc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                  named_parameters=model.named_parameters(), compression=comp)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    rows: List[Dict[str, Any]] = []
    g = torch.Generator().manual_seed(rank)
    for step in range(BATCHES - rank):
        x, y = torch.randn(32, 256, generator=g), torch.randint(0, 10, (32,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        rows.append({"step": step, "active": sum(1 for r in range(size) if BATCHES - r > step),
                     "bytes": opt.last_step_bytes, "residual": residual_norm(comp)})
    before = {n: r.clone() for n, r in comp.state_dict()["residuals"].items()}
    last = hvd.join()
    opt.sync_after_join(last)
    after = comp.state_dict()["residuals"]
    kept = before.keys() == after.keys() and all(torch.equal(before[n], after[n]) for n in before)
    report = hvd.allgather_object({"rank": rank, "rows": rows, "kept": kept, "residual": residual_norm(comp),
                                   "step": comp.exchange_step})
    if rank == 0:
        print(f"{size} ranks, rank r has {BATCHES} - r batches; Horovod's Average of (rank + 1) with rank "
              f"{size - 1} inside hvd.join(): {probe} (sum {sum(range(1, size))} / {size} ranks)")
        print("| step | rank | ranks training | bytes handed to Horovod | residual L2 norm after the step |")
        print("| ---: | ---: | ---: | ---: | ---: |")
        for rep in report:
            for row in rep["rows"]:
                print(f"| {row['step']} | {rep['rank']} | {row['active']} | {row['bytes']:,} | {row['residual']:.4f} |")
        for rep in report:
            print(f"rank {rep['rank']}: residuals after sync_after_join({last}) identical to those it joined with: "
                  f"{rep['kept']} (norm {rep['residual']:.4f}); exchange step {rep['step']}")


if __name__ == "__main__":
    main()
