"""A real ``hvd.elastic`` job (tests/test_horovod_elastic.py): two "hosts" on this machine (localhost and
127.0.0.1, one slot each), ``hvd_gradcomp.DistributedOptimizer`` (TopKQSGD + AdamW, or uncompressed)
under ``@hvd.elastic.run`` with ``hvd.elastic.TorchState(model=..., optimizer=...)``.

Faults, at fixed steps so that a compressed and an uncompressed run go through the same ones:

* step ``KILL``: the rank on 127.0.0.1 removes its host from the discovery file and dies (``os._exit``)
  after its forward pass: the other rank, its step's exchanges in flight, gets ``HorovodInternalError``,
  restores the last commit and goes on alone;
* step ``GROW``: the rank left puts 127.0.0.1 back and waits at its commit for Horovod's
  ``HostsUpdatedInterrupt``: a new process starts there and joins (``sync()``).

With MODE ``remove``, at step ``KILL`` rank 0 takes 127.0.0.1 out of the discovery file and both ranks
wait at their commit: Horovod interrupts them, stops the rank there and, the hosts only removed, skips
``sync()``: the rank left goes on with the state it has.

Usage: python tests/elastic_worker.py OUTDIR HOSTS_FILE COMPRESSION(topkqsgd|qsgd|none) [STEPS KILL GROW [MODE]] (24 8 14 kill)
Each rank still there at the end writes OUTDIR/rank<r>.json; the rank that dies writes OUTDIR/dead.json.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import horovod.torch as hvd

import hvd_gradcomp as gc

# Set from the command line (see Usage) when run as a script; importing it (pytest's --doctest-modules) reads none.
OUT, HOSTS, COMPRESSION = Path("."), Path("hosts"), "topkqsgd"
STEPS, KILL, GROW = 24, 8, 14
MODE = "kill"   # "remove": at KILL the host leaves the discovery file only


def batch(step: int, rank: int, n: int = 32):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(n, 256, generator=g)
    return x, TEACHER(x)


torch.manual_seed(0)
TEACHER = torch.nn.Sequential(torch.nn.Linear(256, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8)).requires_grad_(False)
HELD_OUT = batch(10_000, 0, 512)


def residual_norm(opt) -> float:
    comp = opt.compression
    if not isinstance(comp, gc.GradientCompressor):
        return 0.0
    return sum(float(r.float().pow(2).sum()) for r in comp.residuals._residuals.values()) ** 0.5


def flat_state(model, opt) -> torch.Tensor:
    """Parameters and the optimizer's state, flat (to compare ranks)."""
    parts = [p.detach().reshape(-1) for p in model.parameters()]
    for st in opt.state.values():
        parts += [v.detach().float().reshape(-1) for v in st.values() if isinstance(v, torch.Tensor)]
    return torch.cat(parts)


def identical(t: torch.Tensor) -> bool:
    every = hvd.allgather(t.unsqueeze(0))
    return all(torch.equal(every[0], every[r]) for r in range(every.shape[0]))


def wait_for_hosts(state, commits, opt) -> None:
    """Commit, then wait (checking, a collective) until Horovod raises ``HostsUpdatedInterrupt``: the
    reset comes at this step in every run."""
    commits[state.step] = residual_norm(opt)
    state.commit()
    deadline = time.time() + 120
    while time.time() < deadline:
        time.sleep(0.5)
        state.check_host_updates()
    raise RuntimeError("the hosts did not change within 120 s")


def main() -> None:
    hvd.init()
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 8))
    compression = {"topkqsgd": lambda: gc.TopKQSGD(ratio=0.01, bits=8, feedback=gc.FrozenVariance(warmup=4)),
                   "qsgd": lambda: gc.QSGD(bits=8, feedback=gc.FrozenVariance(warmup=4)),
                   "none": lambda: None}[COMPRESSION]()
    opt = gc.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-3),
                                  named_parameters=model.named_parameters(), compression=compression)
    state = hvd.elastic.TorchState(model=model, optimizer=opt, step=0)
    handler = state._handlers["optimizer"]
    events, commits = [], {}

    @hvd.elastic.run
    def train(state) -> None:
        events.append({"at_step": state.step, "world": hvd.size(), "rank": hvd.rank(),
                       "last_reset": getattr(handler, "last_reset", None),
                       "exchange_step": getattr(opt.compression, "exchange_step", None),
                       "residual_norm": residual_norm(opt), "identical": identical(flat_state(model, opt))})
        while state.step < STEPS:
            x, y = batch(state.step, hvd.rank())
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            if state.step == KILL and MODE == "kill" and os.environ.get("HOROVOD_HOSTNAME") == "127.0.0.1":
                HOSTS.write_text("localhost:1\n")
                (OUT / "dead.json").write_text(json.dumps({"residual_norm_lost": residual_norm(opt),
                                                           "step": state.step}))
                os._exit(1)              # mid-step: the other rank's exchanges of this step are in flight
            loss.backward()
            opt.step()
            state.step += 1
            if state.step == KILL and MODE == "remove" and hvd.size() == 2:
                if hvd.rank() == 0:
                    HOSTS.write_text("localhost:1\n")
                wait_for_hosts(state, commits, opt)   # both ranks, in step: Horovod interrupts them together
            if state.step == GROW and hvd.size() == 1:
                HOSTS.write_text("localhost:1\n127.0.0.1:1\n")
                wait_for_hosts(state, commits, opt)
            commits[state.step] = residual_norm(opt)
            state.commit()

    train(state)
    x, y = HELD_OUT
    with torch.no_grad():
        held_out = float(F.mse_loss(model(x), y))
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    every = hvd.allgather(flat.unsqueeze(0))
    comp = opt.compression
    # The random streams' counts per tensor; QSGD's relay chunks ("#reduced<rank>") are each rank's own.
    steps = [comp.exchange_step, sorted((k, v) for k, v in comp._steps.items() if "#reduced" not in k)] \
        if isinstance(comp, gc.GradientCompressor) else None
    all_steps = hvd.allgather_object(steps)
    result = {"rank": hvd.rank(), "size": hvd.size(), "step": state.step, "held_out": held_out,
              "replicas_identical": all(torch.equal(every[0], every[r]) for r in range(every.shape[0])),
              "steps_agree": all(s == all_steps[0] for s in all_steps), "exchange_step": steps and steps[0],
              "elastic_synced": getattr(comp, "elastic_synced", None), "events": events,
              "residual_norm": residual_norm(opt), "commits": commits}
    (OUT / f"rank{hvd.rank()}.json").write_text(json.dumps(result, default=str))


if __name__ == "__main__":
    OUT, HOSTS, COMPRESSION = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    if len(sys.argv) > 4:
        STEPS, KILL, GROW = (int(a) for a in sys.argv[4:7])
    if len(sys.argv) > 7:
        MODE = sys.argv[7]
    main()
