"""Rank side of benchmarks/tests/test_recipe_study.py's check of the recipe worker's ``lightning`` road:
``python -m torch.distributed.run --nproc-per-node 2 benchmarks/tests/recipe_lightning_worker.py JOBS OUTDIR``.

Each job trains one recipe twice from the same seed: on the ``ddp`` road (:func:`fit_as_user`) with the
model inside a module that names it ``net``, as the ``lightning`` road's ``LightningModule`` does (the
compressor's rounding noise is drawn per parameter name), and on the ``lightning`` road
(:func:`fit_lightning`). A recipe that clips gets the compressor's ``clip=`` on the ``ddp`` road and
``gradient_clip_val`` through Lightning. Every rank writes ``OUTDIR/rank<r>.json``; a failing rank
exits at once, so torchrun stops the other.
"""
from __future__ import annotations

import json
import os
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any, Dict

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import hvd_gradcomp as gc  # noqa: E402
from benchmarks.study import recipe_worker, recipes  # noqa: E402


class Named(torch.nn.Module):
    """The recipe's model under the attribute name the ``lightning`` road's module gives it."""

    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def both_roads(comm: recipe_worker.Comm, recipe: str, steps: int, seed: int) -> Dict[str, Any]:
    r = recipes.Recipe(**{**recipes.RECIPES[recipe].__dict__, "steps": steps})
    out: Dict[str, Any] = {}
    for road in ("ddp", "lightning"):
        built = recipes.build(r, seed, comm.rank, comm.size)
        clip = {"clip": r.clip} if r.clip and road == "ddp" else {}
        comp = gc.TopKQSGD(ratio=0.01, bits=8, seed=1000 * seed + comm.rank, **clip)
        if road == "ddp":
            built.model = Named(built.model)
        evals: list = []
        sent: list = []
        fit = recipe_worker.fit_lightning if road == "lightning" else recipe_worker.fit_as_user
        fit(r, road, built, comp, comm, bool(r.clip) and road == "lightning", evals, sent)
        out[road] = {"weights": torch.cat([p.detach().reshape(-1) for p in built.model.parameters()]),
                     "evals": evals, "sent": sent, "feedback": comp.feedback.key, "clip": comp.clip}
    ddp, lit = out["ddp"], out["lightning"]
    return {"identical": bool(torch.equal(ddp["weights"], lit["weights"])),
            "max_diff": float((ddp["weights"] - lit["weights"]).abs().max()),
            "evals_equal": ddp["evals"] == lit["evals"], "sent_equal": ddp["sent"] == lit["sent"],
            "evals": len(lit["evals"]), "last_sent": lit["sent"][-1], "raw": recipes.raw_bytes(built.model),
            "feedback": lit["feedback"], "clip": lit["clip"]}


def main() -> None:
    jobs, outdir = json.loads(sys.argv[1]), Path(sys.argv[2])
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    comm = recipe_worker.Comm(ddp=True)
    results = []
    job: Dict[str, Any] = {}
    try:
        for job in jobs:
            results.append(both_roads(comm, **job))
    except BaseException:
        print(f"[rank {comm.rank}] FAILED in {job}", file=sys.stderr, flush=True)
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    (outdir / f"rank{comm.rank}.json").write_text(json.dumps(results))
    comm.dist.destroy_process_group()


if __name__ == "__main__":
    main()
