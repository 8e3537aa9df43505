"""A small real training script for the launcher's end-to-end tests.

Every rank prints what it received, so the tests can check that the launcher delivered
it: ``rank=R size=S compression=... args=[...]`` (args as JSON, exactly sys.argv[1:]).
Then it trains a tiny linear model with ``hvd.DistributedOptimizer``, using the
compressor the ``HVDGC_*`` variables name when the hvd_gradcomp compressors import, and
prints ``done rank=R steps=N loss=L params=P``; P is identical on every rank when the
gradients really were averaged.

Each rank also prints ``rank=R host=H netns=NS pid=P`` (host name and network namespace), so
multi-host tests can check where each rank ran.

Options for the tests (read leniently; everything stays in args=[...]):
``--steps N``, ``--step-sleep S`` (pause after each step; ``rank=R trained step 1`` is
printed after the first), ``--sleep S`` (print ``pid=`` and sleep, for Ctrl-C), ``--exit-code K``
with ``--fail-rank R`` (rank R exits with K).
"""
import argparse
import json
import os
import socket
import sys
import time

import horovod.torch as hvd
import torch

from hvd_gradcomp.config import from_env


def _options() -> argparse.Namespace:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--exit-code", type=int, default=0)
    parser.add_argument("--fail-rank", type=int, default=-1)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    return parser.parse_known_args()[0]


def _compressor(cfg):
    """The configured compressor, or Horovod's none when the compressors cannot be imported."""
    try:
        return cfg.make_compressor() or hvd.Compression.none, None
    except ImportError as err:
        return hvd.Compression.none, f"unavailable ({err})"


def _train(cfg, steps: int, step_sleep: float = 0.0) -> tuple:
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 1)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    compression, why = _compressor(cfg)
    print(f"rank={hvd.rank()} compressor={why or compression!r}", flush=True)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), compression=compression,
                                   backward_passes_per_step=cfg.accumulate)
    gen = torch.Generator().manual_seed(100 + hvd.rank())  # different data on each rank
    loss = torch.tensor(0.0)
    for step in range(steps):
        for _ in range(cfg.accumulate):
            x = torch.randn(32, 16, generator=gen)
            loss = ((model(x) - x.sum(dim=1, keepdim=True)) ** 2).mean()
            loss.backward()
        opt.step()
        opt.zero_grad()
        if step == 0:
            print(f"rank={hvd.rank()} trained step 1", flush=True)
        time.sleep(step_sleep)
    params = sum(float(p.detach().double().sum()) for p in model.parameters())
    return float(loss.detach()), params


def _netns() -> str:
    """The name of this process's network namespace (as ``ip netns`` names it), or ``-``."""
    try:
        mine = os.stat("/proc/self/ns/net").st_ino
        return next((n for n in sorted(os.listdir("/run/netns")) if os.stat(f"/run/netns/{n}").st_ino == mine), "-")
    except OSError:
        return "-"


def main() -> int:
    opts = _options()
    hvd.init()
    cfg = from_env()
    print(f"rank={hvd.rank()} size={hvd.size()} compression={cfg.compression} ratio={cfg.ratio} "
          f"bits={cfg.bits} accumulate={cfg.accumulate} error_feedback={int(cfg.error_feedback)} "
          f"args={json.dumps(sys.argv[1:])}", flush=True)
    print(f"rank={hvd.rank()} host={socket.gethostname()} netns={_netns()} pid={os.getpid()}", flush=True)
    if opts.sleep:
        print(f"rank={hvd.rank()} pid={os.getpid()}", flush=True)
        time.sleep(opts.sleep)
    if hvd.rank() == opts.fail_rank:
        print(f"rank={hvd.rank()} exiting with {opts.exit_code}", flush=True)
        sys.stdout.flush()
        os._exit(opts.exit_code)  # no Horovod shutdown: a crashed rank, as the launcher sees it
    loss, params = _train(cfg, opts.steps, opts.step_sleep)
    print(f"done rank={hvd.rank()} steps={opts.steps} loss={loss:.6f} params={params:.10f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
