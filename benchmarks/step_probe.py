"""Per-step memory and CPU probe around ``examples/synthetic_benchmark.py`` (a diagnosis tool).

Runs the synthetic benchmark unchanged and prints, on rank 0 after every step (warm-up
included): wall and CPU milliseconds, system CPU, minor page faults (fresh pages the allocator
touched), max RSS, and the tensors still alive (count and MB of their storages, found through
``gc.get_objects()``). ``--garbage-at N,M`` (first argument) also runs a full collection under
``gc.DEBUG_SAVEALL`` after steps N and M and prints what only the cyclic collector would have
freed (object types; for each large tensor there, the chain of objects holding it).

Example (2 ranks at 1 Gbit/s, as in docs/AUTO.md)::

    ip netns exec NS horovodrun -np 2 -H localhost:2 --gloo python benchmarks/step_probe.py \\
        --params 2.5e7 --batch-size 4 --warmup 10 --iters 10 --compression auto --ratio 0.01 --bits 8
"""
from __future__ import annotations

import collections
import gc
import os
import resource
import sys
import time
from typing import Any, List, Set

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
import synthetic_benchmark as sb  # noqa: E402

import horovod.torch as hvd  # noqa: E402
import torch  # noqa: E402


def live_tensors() -> List[torch.Tensor]:
    out = []
    for o in gc.get_objects():
        try:
            if type(o) in (torch.Tensor, torch.nn.Parameter):
                out.append(o)
        except ReferenceError:  # a dead weak proxy
            pass
    return out


def garbage_report(step: int) -> None:
    """What a full collection frees (kept for inspection by DEBUG_SAVEALL), and who holds its large tensors."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    gc.collect()
    gc.set_debug(0)
    garbage = list(gc.garbage)
    gc.garbage.clear()
    ids = {id(o) for o in garbage}
    big = [o for o in garbage if type(o) is torch.Tensor and o.numel() >= 1 << 20]
    kinds = collections.Counter(type(o).__name__ for o in garbage).most_common(8)
    print(f"GARBAGE step {step}: {len(garbage)} objects, {len(big)} tensors of >= 1M values; {kinds}", flush=True)
    for t in big[:3]:
        chain: List[str] = []
        cur: Any = t
        for _ in range(6):
            refs = [r for r in gc.get_referrers(cur) if id(r) in ids and r is not garbage]
            if not refs:
                break
            cur = refs[0]
            chain.append(type(cur).__name__ + ("{" + ",".join(map(str, list(cur)[:6])) + "}" if isinstance(cur, dict)
                                               else ""))
        print(f"  {tuple(t.shape)} held by " + " <- ".join(chain), flush=True)


def main(argv: List[str]) -> int:
    garbage_at: Set[int] = set()
    if argv[:1] == ["--garbage-at"]:
        garbage_at, argv = {int(s) for s in argv[1].split(",") if s}, argv[2:]
    plain = sb.StepTimer.step
    count = [0]

    def step(self: Any) -> Any:
        r0, c0 = resource.getrusage(resource.RUSAGE_SELF), time.process_time()
        out = plain(self)
        r1, cpu = resource.getrusage(resource.RUSAGE_SELF), time.process_time() - c0
        count[0] += 1
        if hvd.rank() == 0:
            tensors = live_tensors()
            mb = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values()) / 1e6
            print(f"PROBE step {count[0]}: {1e3 * out[0]:.0f} ms, cpu {1e3 * cpu:.0f} ms "
                  f"(sys {1e3 * (r1.ru_stime - r0.ru_stime):.0f}), minor faults {r1.ru_minflt - r0.ru_minflt}, "
                  f"max rss {r1.ru_maxrss // 1024} MB, live tensors {len(tensors)} ({mb:.0f} MB)", flush=True)
            del tensors
            if count[0] in garbage_at:
                garbage_report(count[0])
        return out

    sb.StepTimer.step = step
    return sb.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
