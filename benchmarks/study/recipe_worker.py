"""One 2-rank job of the recipe study: a recipe and a seed on one or more roads, each driven as a
user drives it (see :mod:`benchmarks.study.recipes`). Rank 0 writes one JSON per road into ``--out``.

    horovodrun -np 2 -H localhost:2 --gloo python benchmarks/study/recipe_worker.py --recipe nanogpt --roads none,stock,gc
    torchrun --standalone --nproc-per-node 2 benchmarks/study/recipe_worker.py --recipe nanogpt --roads ddp
    torchrun --standalone --nproc-per-node 2 benchmarks/study/recipe_worker.py --recipe nanogpt --roads lightning

``--setting KEY=VALUE`` passes a compressor argument (for the probes of a search: e.g.
``min_compress_numel=1`` on the gc road, ``feedback=classic``); the JSON file then carries it in its name.
"""
from __future__ import annotations

import argparse
import ast
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import torch  # noqa: E402

import hvd_gradcomp as gc  # noqa: E402
from benchmarks.study import recipes  # noqa: E402
from benchmarks.study.loop import code_version, wrap_as_user  # noqa: E402


class Comm:
    """The few collectives the workers need (this one and the wrapper check's), on Horovod or torch.distributed."""

    def __init__(self, ddp: bool) -> None:
        self.ddp = ddp
        if ddp:
            import datetime
            import torch.distributed as dist
            if not dist.is_initialized():
                dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=10))
            self.dist, self.rank, self.size = dist, dist.get_rank(), dist.get_world_size()
        else:
            import horovod.torch as hvd
            hvd.init()
            self.hvd, self.rank, self.size = hvd, hvd.rank(), hvd.size()

    def identical(self, model: torch.nn.Module) -> bool:
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        if self.ddp:
            every = [torch.empty_like(flat) for _ in range(self.size)]
            self.dist.all_gather(every, flat)
        else:
            every = list(self.hvd.allgather(flat[None]))
        return all(bool(torch.equal(every[0], e)) for e in every)


def counter(road: str, opt: Any, comp: Any, state: Any, raw: int) -> Callable[[], int]:
    """Bytes this rank handed to the collectives in the last step, on each road (:data:`recipes.ROADS`)."""
    seen = [0]

    def step() -> int:
        if road == "none":
            return raw
        if road == "gc":
            return opt.last_step_bytes
        if road == "ddp":
            return state.last_step_bytes
        now = comp.stats.bytes_out            # stock road: the compressor's count over all steps
        sent, seen[0] = now - seen[0], now
        return sent
    return step


def fit_as_user(recipe: recipes.Recipe, road: str, built: recipes.Built, comp: Any, comm: Comm, hand_clip: bool,
                evals: List[Dict[str, float]], sent: List[int]) -> None:
    """The Horovod roads and ``ddp``: the README's wrapping (:func:`wrap_as_user`), then the recipe's loop as
    users write it; appends the held-out evaluations to ``evals`` and each step's bytes to ``sent``."""
    net = built.model
    model, opt, state = wrap_as_user(road, net, built.optimizer, comp, None if road == "ddp" else comm.hvd)
    count = counter(road, opt, comp, state, recipes.raw_bytes(net))
    for step in range(recipe.steps):
        for group in opt.param_groups:
            group["lr"] = recipe.lr_at(step)
        x, y = built.batch()
        opt.zero_grad()
        recipes.loss_of(model(x), y).backward()
        if hand_clip and road != "ddp":        # Horovod's documented pattern
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(net.parameters(), recipe.clip)
            with opt.skip_synchronize():
                opt.step()
        else:
            if hand_clip:                      # DDP: the averaged gradients are there after backward
                torch.nn.utils.clip_grad_norm_(net.parameters(), recipe.clip)
            opt.step()
        sent.append(count())
        if recipes.evals_due(step + 1, recipe.steps):
            loss, acc = recipes.evaluate(net, built.val)
            evals.append({"step": step + 1, "val_loss": loss, "val_accuracy": acc})


def fit_lightning(recipe: recipes.Recipe, road: str, built: recipes.Built, comp: Any, comm: Comm, hand_clip: bool,
                  evals: List[Dict[str, float]], sent: List[int]) -> None:
    """The ``lightning`` road: the recipe's model and optimizer (its parameter groups) in a LightningModule,
    ``Trainer(strategy=GradCompStrategy(compression=comp))`` as docs/INTEGRATIONS.md shows it, on the
    ``ddp`` road's batches (this rank's ``built.batch()`` draws, in order, one per step) with the same rate
    per optimizer step (set before each step) and the recipe's clipping as ``gradient_clip_val`` (the
    strategy makes it the compressor's ``clip=``); fills ``evals`` and ``sent`` as :func:`fit_as_user` does."""
    import lightning.pytorch as pl

    from hvd_gradcomp.integrations.lightning import GradCompStrategy

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = built.model

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return built.optimizer

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            for group in self.trainer.optimizers[0].param_groups:
                group["lr"] = recipe.lr_at(self.global_step)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return recipes.loss_of(self.net(batch[0]), batch[1])

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            sent.append(strategy.gradcomp_state.last_step_bytes)
            if recipes.evals_due(self.global_step, recipe.steps):
                loss, acc = recipes.evaluate(self.net, built.val)
                evals.append({"step": self.global_step, "val_loss": loss, "val_accuracy": acc})

    batches = [built.batch() for _ in range(recipe.steps)]
    # in order, and a generator of its own: a DataLoader draws its base seed, which would move dropout's masks
    loader = torch.utils.data.DataLoader(batches, batch_size=None, generator=torch.Generator())
    strategy = GradCompStrategy(compression=comp)
    trainer = pl.Trainer(accelerator="cpu", devices=comm.size, strategy=strategy, max_steps=recipe.steps,
                         gradient_clip_val=recipe.clip if hand_clip else None, use_distributed_sampler=False,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(Module(), loader)


def run(recipe: recipes.Recipe, road: str, seed: int, comm: Comm, extra: Dict[str, Any]) -> Dict[str, Any]:
    built = recipes.build(recipe, seed, comm.rank, comm.size)
    net = built.model
    comp = None if road == "none" else gc.TopKQSGD(ratio=0.01, bits=8, seed=1000 * seed + comm.rank, **extra)
    # every rank built the same weights (one seed): the wrappers' broadcasts change none of them
    start = torch.cat([p.detach().reshape(-1) for p in net.parameters()]).clone()
    raw = recipes.raw_bytes(net)
    hand_clip = bool(recipe.clip) and "clip" not in extra   # a probe with the compressor's clip= clips nothing by hand
    evals: List[Dict[str, float]] = [dict(zip(("step", "val_loss", "val_accuracy"), (0, *recipes.evaluate(net, built.val))))]
    sent: List[int] = []
    t0 = time.perf_counter()
    (fit_lightning if road == "lightning" else fit_as_user)(recipe, road, built, comp, comm, hand_clip, evals, sent)
    wall = time.perf_counter() - t0
    # how far training moved the weights: a compressed road ending far below uncompressed training
    # with a longer distance took longer steps (benchmarks/results/RECIPES.md)
    distance = float((torch.cat([p.detach().reshape(-1) for p in net.parameters()]) - start).norm())
    return {"recipe": recipe.name, "road": road, "seed": seed, "steps": recipe.steps, "extra": extra,
            "parameters": sum(p.numel() for p in net.parameters()), "identical": comm.identical(net),
            "feedback": getattr(getattr(comp, "feedback", None), "key", None), "wall_s": wall, "distance": distance,
            "code": code_version(), **recipes.summary(evals, sent, raw)}


def file_name(recipe: str, road: str, seed: int, extra: Dict[str, Any]) -> str:
    """``nanogpt-gc-s0.json``; a probe's settings go into the name: ``nanogpt-gc+min_compress_numel=1-s0.json``.

    >>> file_name("lstm", "ddp", 2, {}), file_name("nanogpt", "gc", 0, {"feedback": "classic"})
    ('lstm-ddp-s2.json', 'nanogpt-gc+feedback=classic-s0.json')
    """
    tag = "".join(f"+{k}={v}" for k, v in sorted(extra.items()))
    return f"{recipe}-{road}{tag}-s{seed}.json"


def setting_value(text: str) -> Any:
    """A ``--setting`` value as Python reads it (``0.25``, ``'classic'``), else the text itself.

    >>> setting_value("0.25"), setting_value("classic")
    (0.25, 'classic')
    """
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", choices=sorted(recipes.RECIPES), required=True)
    ap.add_argument("--roads", default="none,stock,gc", help=f"comma-separated, of {list(recipes.ROADS)}")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=0, help="override the recipe's steps (smoke tests)")
    ap.add_argument("--peak", type=float, default=0.0, help="override the recipe's peak learning rate (a probe)")
    ap.add_argument("--clip", type=float, default=0.0, help="override the recipe's clipping threshold (a probe)")
    ap.add_argument("--setting", action="append", default=[], metavar="KEY=VALUE",
                    help="a compressor argument for the compressed roads (a probe), repeatable")
    ap.add_argument("--out", default="runs/recipes")
    args = ap.parse_args()
    roads = args.roads.split(",")
    alone = [r for r in roads if r in recipes.TORCHRUN_ROADS]
    if alone and len(roads) > 1:
        ap.error(f"the {alone[0]} road runs alone, under torchrun")
    extra = {k: setting_value(v) for k, v in (s.split("=", 1) for s in args.setting)}
    torch.set_num_threads(1)
    comm = Comm(ddp=bool(alone))
    recipe = recipes.RECIPES[args.recipe]
    if args.steps or args.peak or args.clip:
        recipe = recipes.Recipe(**{**recipe.__dict__, "steps": args.steps or recipe.steps,
                                   "peak": args.peak or recipe.peak, "clip": args.clip or recipe.clip,
                                   "name": recipe.name + (f"@{args.peak:g}" if args.peak else "")
                                   + (f"@clip{args.clip:g}" if args.clip else "")})
    out = Path(args.out)
    for road in roads:
        rec = run(recipe, road, args.seed, comm, extra if road != "none" else {})
        if comm.rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            (out / file_name(recipe.name, road, args.seed, rec["extra"])).write_text(json.dumps(rec, indent=1) + "\n")
            print(f"{recipe.name} {road} seed {args.seed} {rec['extra'] or ''}: held-out loss {rec['val_loss']:.4f} "
                  f"whole-run {rec['ratio_whole_run']:.1f}x steady {rec['ratio_steady']:.0f}x "
                  f"identical {rec['identical']} feedback {rec['feedback']} {rec['wall_s']:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
