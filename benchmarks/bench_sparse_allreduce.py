"""Bytes per rank of the sparse allreduce (issue 62, hvd_gradcomp/collectives/sparse_allreduce.py) against
today's sparse allgather, at 16 to 1,024 ranks simulated in one process
(hvd_gradcomp/collectives/simulate.py). No transport, no timing: the payloads' own bytes.

    .venv/bin/python benchmarks/bench_sparse_allreduce.py [--numel 65536] [--ratio 0.25] [--ranks 16 64 256 1024]
    .venv/bin/python benchmarks/bench_sparse_allreduce.py --numel 65536 1048576 --ratio 0.25 0.01 \\
        --page benchmarks/results/SPARSE_ALLREDUCE.md

Each rank's gradient is a view of one random tensor (shifted per rank: different top-k sets, and
memory for one tensor instead of 1,024); TopK and TopKQSGD(bits=8) without error feedback (one
step). Every run checks the result: the dense sum of what the global selection kept, the same bits
on every rank. ``--page`` also writes the byte model's figures for a 25M-value tensor
(:mod:`hvd_gradcomp.auto.policy`) and refuses a checkout with uncommitted changes, so that the
page's figures come from the commit it names.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import torch  # noqa: E402

from hvd_gradcomp.auto.policy import sparse_allreduce_bytes, wire_bytes  # noqa: E402
from hvd_gradcomp.codecs.qsgd import QSGD  # noqa: E402
from hvd_gradcomp.codecs.topk import TopK, TopKQSGD  # noqa: E402
from hvd_gradcomp.collectives.simulate import simulate  # noqa: E402
from hvd_gradcomp.collectives.sparse_allreduce import sparse_allreduce  # noqa: E402

STRIDE = 97
CODECS: Dict[str, Callable[[float, int], TopK]] = {
    "TopK": lambda ratio, seed: TopK(ratio=ratio, feedback="none", seed=seed),
    "TopKQSGD": lambda ratio, seed: TopKQSGD(ratio=ratio, bits=8, feedback="none", seed=seed),
}
MODEL_NUMEL, MODEL_RATIO = 25_000_000, 0.01
MODEL_RANKS = (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
GOAL_RANKS, GOAL_FACTOR = 128, 50
SCRIPT = "benchmarks/bench_sparse_allreduce.py"


class Recorded:
    """A codec whose ``compress_carried`` notes the (indices, values) it carried: what its rank sent."""

    def __init__(self, codec: TopK) -> None:
        self.codec = codec
        self.sent: Tuple[torch.Tensor, torch.Tensor] = (torch.zeros(0, dtype=torch.int64), torch.zeros(0))
        encode = codec.compress_carried

        def compress_carried(name, grad, relay=False):  # type: ignore[no-untyped-def]
            payload, carried = encode(name, grad, relay)
            self.sent = carried
            return payload, carried
        codec.compress_carried = compress_carried  # type: ignore[method-assign]


def kept_sum(sent: Sequence[Tuple[torch.Tensor, torch.Tensor]], kept: torch.Tensor, numel: int,
             world: int) -> torch.Tensor:
    """The dense sum (rank order, float32) of what each rank sent at the kept indices, averaged."""
    dense, mask = torch.zeros(numel), torch.zeros(numel, dtype=torch.bool)
    mask[kept] = True
    for idx, vals in sent:
        dense.index_add_(0, idx[mask[idx]], vals[mask[idx]].float())
    return dense / world


def measure(world: int, numel: int, ratio: float, codec: str = "TopK") -> Dict[str, float]:
    """One step at ``world`` simulated ranks: k, kept, bytes per rank (most, mean), the model's,
    and the allgather's (P-1) x a payload of ``codec``; raises unless the result is exact."""
    base = torch.randn(numel + world * STRIDE, generator=torch.Generator().manual_seed(world))
    grads = [base[r * STRIDE:r * STRIDE + numel] for r in range(world)]
    outs = [torch.empty(numel) for _ in range(world)]
    recs = [Recorded(CODECS[codec](ratio, r)) for r in range(world)]
    start = time.perf_counter()
    runs = [sparse_allreduce(rec.codec, [("w", g)], [o], world, r)
            for r, (rec, g, o) in enumerate(zip(recs, grads, outs))]
    kept, traffic = simulate(runs)
    if not all(torch.equal(outs[0], o) for o in outs[1:]):
        raise AssertionError("simulated ranks disagree")
    if not torch.equal(outs[0], kept_sum([rec.sent for rec in recs], kept[0][0], numel, world)):
        raise AssertionError("the result is not the dense sum of what the global selection kept")
    k = TopK(ratio=ratio).selected(numel)
    payload = CODECS[codec](ratio, 0).compress_named("w", grads[0]).numel()
    return {"ranks": world, "k": k, "kept": kept[0][0].numel(), "most": traffic.most(),
            "mean": sum(traffic.per_rank()) / world, "model": sparse_allreduce_bytes(world, k),
            "allgather": wire_bytes("sparse", world, numel, payload), "seconds": time.perf_counter() - start}


def table(rows: List[Dict[str, float]]) -> str:
    head = "| ranks | k | kept K | bytes/rank (most) | mean | model | allgather (P-1)xS | allgather / this |"
    lines = [head, "|" + "---|" * 8]
    for r in rows:
        lines.append(f"| {r['ranks']} | {r['k']} | {r['kept']} | {r['most']:,.0f} | {r['mean']:,.0f} | "
                     f"{r['model']:,.0f} | {r['allgather']:,.0f} | {r['allgather'] / r['most']:.1f} |")
    return "\n".join(lines)


# ---------------------------------------------------------------- the model (no run)
def model_roads(numel: int = MODEL_NUMEL, ratio: float = MODEL_RATIO) -> Dict[str, Callable[[int], float]]:
    """Bytes each rank sends per step for one ``numel``-value float32 tensor, per road, as functions
    of the rank count, from :mod:`hvd_gradcomp.auto.policy`; the compressed ones at TopKQSGD(ratio, 8)
    and QSGD 8-bit. The sparse payload is encoded once from a random tensor (its index coding's size
    depends on the indices)."""
    qsgd = QSGD(bits=8).payload_size((numel,))
    codec = TopKQSGD(ratio=ratio, bits=8, feedback="none", seed=0)
    sparse = codec.compress_named("w", torch.randn(numel, generator=torch.Generator().manual_seed(0))).numel()
    k = codec.selected(numel)
    return {
        "uncompressed ring allreduce": lambda p: wire_bytes("dense", p, numel),
        "fp16 ring allreduce": lambda p: wire_bytes("fp16", p, numel),
        "QSGD 8-bit (alltoall + allgather)": lambda p: wire_bytes("qsgd", p, numel, qsgd),
        f"sparse allgather, TopKQSGD({ratio:g}, 8) (today's road)": lambda p: wire_bytes("sparse", p, numel, sparse),
        f"sparse allreduce, TopKQSGD({ratio:g}, 8) (issue 62)": lambda p: sparse_allreduce_bytes(p, k),
    }


def model_table(roads: Dict[str, Callable[[int], float]]) -> str:
    """Bytes per rank, then each road's share of the uncompressed ring allreduce's (1/x)."""
    ring = roads["uncompressed ring allreduce"]
    lines = ["| road | " + " | ".join(f"{p} ranks" for p in MODEL_RANKS) + " |",
             "| --- | " + " | ".join("---:" for _ in MODEL_RANKS) + " |"]
    lines += [f"| {name} | " + " | ".join(f"{f(p):,.0f}" for p in MODEL_RANKS) + " |" for name, f in roads.items()]
    lines += ["", "Each road's bytes against the uncompressed ring allreduce's (1/x: x times fewer):", "",
              lines[0], lines[1]]
    lines += [f"| {name} | " + " | ".join(f"1/{ring(p) / f(p):.2f}" for p in MODEL_RANKS) + " |"
              for name, f in roads.items()]
    return "\n".join(lines)


def goal_line(roads: Dict[str, Callable[[int], float]]) -> str:
    """Whether the issue's goal holds at :data:`GOAL_RANKS`, computed from the model."""
    names = list(roads)
    ring = roads[names[0]](GOAL_RANKS)
    best = min(names[1:], key=lambda n: roads[n](GOAL_RANKS))
    allreduce = ring / roads[names[-1]](GOAL_RANKS)
    factor = ring / roads[best](GOAL_RANKS)
    verdict = "met" if factor >= GOAL_FACTOR else "not met"
    return (f"The issue's goal, \"modelled at {GOAL_RANKS} ranks, the best compressed road sends at most "
            f"1/{GOAL_FACTOR} of what an uncompressed ring allreduce sends per rank\": **{verdict}**. At "
            f"{GOAL_RANKS} ranks the sparse allreduce sends 1/{allreduce:.2f} of the ring allreduce's bytes; "
            f"the best compressed road there is the {best}, at 1/{factor:.2f}.")


# ---------------------------------------------------------------- the page
NOT_MEASURED = (
    "Not measured yet: no wrapper drives the sparse allreduce (no Horovod or DDP driver issues it), so "
    "there are no bytes from real ranks (with a driver's framing: Horovod's envelopes, DDP's sizes and "
    "padding), no step times and no two-host figures; `gc.Auto()` does not price it "
    "(`sparse_allreduce_bytes` is not one of `hvd_gradcomp/auto/policy.py`'s roads), so no training run "
    "chooses it. The figures above are the payloads' own bytes.")


def dirty_files(root: Path = ROOT) -> List[str]:
    """Tracked files under hvd_gradcomp/ and benchmarks/ with uncommitted changes."""
    out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "hvd_gradcomp", "benchmarks"],
                         cwd=root, capture_output=True, text=True, check=True).stdout
    return [line[3:] for line in out.splitlines() if line.strip()]


def head_commit(root: Path = ROOT) -> str:
    return subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True, text=True,
                          check=True).stdout.strip()


def render_page(measured: Dict[Tuple[int, float, str], List[Dict[str, float]]],
                roads: Dict[str, Callable[[int], float]], command: str, commit: str, model_numel: int) -> str:
    """The whole SPARSE_ALLREDUCE.md."""
    out = ["# The sparse allreduce: bytes per rank, measured on simulated ranks and modelled", "",
           f"<!-- generated by `{command}`; do not edit by hand -->",
           f"Generated by `{command}` from commit `{commit}` (a clean checkout: the command refuses "
           "uncommitted changes under `hvd_gradcomp/` and `benchmarks/`); rerun it to regenerate the page. "
           "The sparse allreduce is Ok-Topk's exchange "
           "([sparse_allreduce.py](../../hvd_gradcomp/collectives/sparse_allreduce.py)); today's sparse road "
           "allgathers every rank's payload instead.", "",
           "## Simulated ranks (measured)", "",
           "All ranks simulated in one process ([simulate.py](../../hvd_gradcomp/collectives/simulate.py)): "
           "one step, each rank's gradient a shifted view of one random tensor, no error feedback. *bytes/rank*: "
           "the payloads each rank sent (the most over ranks, and the mean), no driver's framing; *model*: "
           "`sparse_allreduce_bytes(P, k)`; *allgather*: `wire_bytes(\"sparse\", P, numel, S)`, S one rank's "
           "payload of the same codec on the same tensor (`hvd_gradcomp/auto/policy.py`).", ""]
    for (numel, ratio, codec), rows in measured.items():
        name = f"TopKQSGD(ratio={ratio:g}, bits=8)" if codec == "TopKQSGD" else f"TopK(ratio={ratio:g})"
        out += [f"### {name} of {numel:,} float32 values", "", table(rows), "",
                "exact: yes (every rank's result is the dense sum of what the global selection kept, "
                "divided by the ranks, the same bits on every rank; checked at every rank count above)", ""]
    out += ["## Modelled (no run)", "",
            f"Bytes each rank sends per step for one tensor of {model_numel:,} float32 values, from "
            "`hvd_gradcomp/auto/policy.py` (`wire_bytes`, `sparse_allreduce_bytes`; ring algorithms), "
            f"ratio {MODEL_RATIO:g} with 8-bit values where compressed:", "",
            model_table(roads), "", goal_line(roads), "",
            "## Not measured yet", "", NOT_MEASURED]
    return "\n".join(out) + "\n"


def write_page(path: Path, cases: Sequence[Tuple[int, float]], ranks: Sequence[int], command: str, commit: str,
               model_numel: int = MODEL_NUMEL) -> str:
    """Measure every case with both codecs (asserting exactness), model, and write the page."""
    measured = {(numel, ratio, codec): [measure(w, numel, ratio, codec) for w in ranks]
                for numel, ratio in cases for codec in CODECS}
    page = render_page(measured, model_roads(model_numel), command, commit, model_numel)
    Path(path).write_text(page)
    return page


def main(argv: List[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, nargs="+", default=[1 << 16])
    parser.add_argument("--ratio", type=float, nargs="+", default=[0.25], help="one per --numel")
    parser.add_argument("--ranks", type=int, nargs="+", default=[16, 64, 256, 1024])
    parser.add_argument("--page", type=Path, help="write the report page (measured and modelled) here")
    args = parser.parse_args(argv)
    if len(args.numel) != len(args.ratio):
        parser.error("give one --ratio per --numel")
    dirty = dirty_files() if args.page else []
    if dirty:
        raise SystemExit(f"refusing to write {args.page}: uncommitted changes in {', '.join(dirty)}; "
                         "commit them first, so that the page's figures come from the commit it names")
    torch.set_num_threads(1)   # a million small ops: threads only contend
    cases = list(zip(args.numel, args.ratio))
    if args.page:
        command = " ".join(["python", SCRIPT, *argv])
        print(write_page(args.page, cases, args.ranks, command, head_commit()))
        print(f"wrote {args.page}")
        return
    for numel, ratio in cases:
        for codec in CODECS:
            rows = [measure(w, numel, ratio, codec) for w in args.ranks]
            print(f"{codec}(ratio={ratio}) of {numel} float32 values, one step, payload bytes only; exact: yes")
            print(table(rows))


if __name__ == "__main__":
    main(sys.argv[1:])
