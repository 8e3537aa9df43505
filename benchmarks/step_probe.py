"""Per-step memory and CPU probe around ``examples/synthetic_benchmark.py`` (a diagnosis tool).

Runs the synthetic benchmark unchanged and prints, on rank 0 after every step (warm-up
included): wall and CPU milliseconds, system CPU, minor page faults (fresh pages the allocator
touched), max RSS, and the tensors still alive (count and MB of their storages, found through
``gc.get_objects()``).

``--sync-breakdown`` (first argument) instead prints, on every rank, where each step's
``synchronize()`` went, in wall and thread CPU time: zeroing ``p.grad`` before a wait, waiting on handles, decoding payloads, the
scatter into ``p.grad`` (zeroing included), the feedback policy's ``received``, the finiteness
check at the sparse indices, the small tensors' fused allreduce, the overall finiteness check,
``end_round`` and the rest; how many fused groups were decoded there (the others were decoded
during backward); the step's cycle time; the tail (from the step's last fused allgather
launched to the end of ``synchronize()``: the exposed decode wherever it ran, the last hook
included); and how late this rank entered ``synchronize()`` after the first rank did (the ranks
share one monotonic clock on one machine). Then, per rank, the medians over the steps after the
warm-up, and (LAST-IN) those of the steps where this rank entered last: its tail is then the
step's critical path. With ``--ab`` (next argument) the old code paths of
issue 13 and the new ones alternate step by step inside the job (see :func:`ab_variants`): on a
shared machine an A/B inside one job, in thread CPU time, is the comparison that holds.

In the memory probe, ``--garbage-at N,M`` (first argument) also runs a full collection under
``gc.DEBUG_SAVEALL`` after steps N and M and prints what only the cyclic collector would have
freed (object types; for each large tensor there, the chain of objects holding it).

Examples (2 ranks at 1 Gbit/s, as in docs/AUTO.md; then the A/B of synchronize(), unthrottled)::

    ip netns exec NS horovodrun -np 2 -H localhost:2 --gloo python benchmarks/step_probe.py \\
        --params 2.5e7 --batch-size 4 --warmup 10 --iters 10 --compression auto --ratio 0.01 --bits 8
    horovodrun -np 2 -H localhost:2 --gloo python benchmarks/step_probe.py --sync-breakdown --ab \\
        --params 2.5e7 --batch-size 4 --warmup 3 --iters 30 --compression topk-qsgd --ratio 0.01 --bits 8
"""
from __future__ import annotations

import collections
import gc
import os
import resource
import statistics
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


PHASES = ("prezero", "wait", "decode", "scatter", "received", "finite_at", "small", "finite", "end_round")


class Variant:
    """A code path for ``--ab``: ``apply()`` runs before each ``synchronize()`` the variant times."""

    def __init__(self, name: str, apply: Any) -> None:
        self.name, self.apply = name, apply


def ab_variants(probe: "SyncBreakdown") -> List[Variant]:
    """Code paths of issue 13, alternated step by step (the same on every rank) by ``--ab``:
    "decoded" (this rank's own payloads decoded while the allgather travels, ``p.grad`` zeroed
    after the wait: session 7's code), "carried" (own parts from the encoder, not decoded) and
    "prezero" (also ``p.grad`` zeroed before the wait) and "new" (with two ranks, this rank's part
    also added to it before the wait)."""
    from hvd_gradcomp.collectives import fused

    def use(carried: bool, prezero: bool, add_own: bool) -> Any:
        def apply() -> None:
            fused._CARRIED, fused._PREZERO, fused._ADD_OWN = carried, prezero, add_own
        return apply
    return [Variant("decoded", use(False, False, False)), Variant("carried", use(True, False, False)),
            Variant("prezero", use(True, True, False)), Variant("new", use(True, True, True))]


class SyncBreakdown:
    """Wraps the functions ``synchronize()`` calls and charges their seconds to phases (see module doc)."""

    def __init__(self) -> None:
        from hvd_gradcomp.codecs import compressor as compressors
        from hvd_gradcomp.collectives import exchange, fused
        from hvd_gradcomp.horovod import optimizer
        self.inside, self.now = False, collections.Counter()
        self.last_exit = 0.0
        self.last_tc, self.last_pc = time.thread_time(), time.process_time()
        self.last_faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        self.rows: List[dict] = []
        self.groups_in_sync = self.groups_early = 0
        cls = optimizer._GradCompOptimizer
        self._wrap(fused.FusedAllgatherExchange, "before_wait", "prezero")
        self._wrap(exchange, "wait_done", "wait")
        for module in (exchange, fused):   # the roads of one tensor each, and the fused allgather
            self._wrap(module, "sum_parts", "scatter")
            self._wrap(module, "finite_at_indices", "finite_at")
        self._wrap(compressors.GradientCompressor, "decode_parts", "decode")
        self._wrap(compressors.GradientCompressor, "received", "received")
        self._wrap(compressors.GradientCompressor, "end_round", "end_round")
        self._wrap(optimizer._SmallTensors, "finish", "small")
        self._wrap(cls, "_all_finite", "finite")
        decode, launch = fused.FusedAllgatherExchange._decode, fused.FusedAllgatherExchange._launch
        self.last_launch = 0.0

        def launched(ex: Any, g: Any) -> Any:
            try:
                return launch(ex, g)
            finally:
                self.last_launch = time.perf_counter()
        fused.FusedAllgatherExchange._launch = launched

        def counted(ex: Any, g: Any, caller: Any) -> Any:
            if self.inside:
                self.groups_in_sync += 1
            else:
                self.groups_early += 1
            return decode(ex, g, caller)
        fused.FusedAllgatherExchange._decode = counted
        self.variants = [Variant("new", lambda: None)]

    def _wrap(self, owner: Any, attr: str, phase: str) -> None:
        fn = getattr(owner, attr)
        is_static = isinstance(owner.__dict__.get(attr), staticmethod)

        def timed(*a: Any, **k: Any) -> Any:
            if not self.inside:
                return fn(*a, **k)
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                self.now[phase] += time.perf_counter() - t0
                self.now["cpu_" + phase] += time.thread_time() - c0
        setattr(owner, attr, staticmethod(timed) if is_static else timed)

    def install(self, opt: Any) -> None:
        """Time ``opt.synchronize`` (the class is made per optimizer: patch the instance)."""
        plain = type(opt).synchronize
        self.variants[0].apply()

        def synchronize(o: Any) -> None:
            t_enter, c_enter = time.perf_counter(), time.thread_time()
            variant = self.variants[len(self.rows) % len(self.variants)]   # applied since the last step
            self.inside, self.now = True, collections.Counter()
            self.groups_in_sync = 0
            try:
                plain(o)
            finally:
                self.inside = False
                total, cpu = time.perf_counter() - t_enter, time.thread_time() - c_enter
                row = {p: self.now[p] for p in PHASES}
                row["other"] = total - sum(row.values())
                row["cpu_decode_scatter"] = self.now["cpu_decode"] + self.now["cpu_scatter"]
                row.update({"cpu_" + p: self.now["cpu_" + p] for p in PHASES})
                # the step's cycle: from the end of the last synchronize() to the end of this one
                cycle = time.perf_counter() - self.last_exit if self.rows else float("nan")
                self.last_exit = time.perf_counter()
                # CPU over the cycle: this thread's (forward, backward, hooks, step) and the process's
                # (Horovod's and Gloo's threads too): a rank whose thread CPU matches the other's but
                # whose cycle is longer was starved of a core
                tc, pc = time.thread_time(), time.process_time()
                row["cycle_thread_cpu"], row["cycle_process_cpu"] = tc - self.last_tc, pc - self.last_pc
                self.last_tc, self.last_pc = tc, pc
                faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
                row["faults"], self.last_faults = faults - self.last_faults, faults
                # the tail: from the step's last fused allgather launched (its payloads encoded) to the
                # end of synchronize(), wherever the decode ran (the last hook or synchronize())
                row["tail"] = self.last_exit - self.last_launch
                row.update(total=total, cpu=cpu, enter=t_enter, exit=self.last_exit, cycle=cycle, in_sync=self.groups_in_sync,
                           early=self.groups_early, variant=variant.name)
                self.groups_early = 0
                self.rows.append(row)
                self.variants[len(self.rows) % len(self.variants)].apply()   # for the next step's backward
        opt.synchronize = synchronize.__get__(opt)

    def summary(self, skip: int) -> None:
        """Every step's row, then the medians after ``skip`` warm-up steps. The ranks' entry times
        are gathered here, once, not per step: a collective inside the step would time the ranks'
        imbalance into the probe's own figures."""
        enters = hvd.allgather_object([(r["enter"], r["exit"]) for r in self.rows], name="probe.enter")
        for i, r in enumerate(self.rows):
            r["late"] = r["enter"] - min(e[i][0] for e in enters)
            r["late_exit"] = r["exit"] - min(e[i][1] for e in enters)
            print(f"SYNC rank {hvd.rank()} step {i + 1} ({r['variant']}): {1e3 * r['cycle']:.0f} ms, "
                  f"tail {1e3 * r['tail']:.1f} ms, in synchronize() {1e3 * r['total']:.1f} ms = "
                  + ", ".join(f"{p} {1e3 * r[p]:.1f}" for p in (*PHASES, "other"))
                  + f"; groups decoded in sync {r['in_sync']}, early {r['early']}; entered "
                  f"{1e3 * r['late']:.1f} ms after the first rank, left {1e3 * r['late_exit']:.1f} ms after; cycle cpu "
                  f"thread {1e3 * r['cycle_thread_cpu']:.0f} ms, process {1e3 * r['cycle_process_cpu']:.0f} ms, "
                  f"minor faults {r['faults']}", flush=True)
        for v in self.variants:
            rows = [r for r in self.rows[skip:] if r["variant"] == v.name]
            if not rows:
                continue
            med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "variant"}
            late = [r for r in rows if r["late"] > 0]
            if late:   # this rank entered synchronize() last: its tail is the step's critical path
                print(f"SYNC LAST-IN {v.name} rank {hvd.rank()} over {len(late)} steps: tail "
                      f"{1e3 * statistics.median(r['tail'] for r in late):.1f} ms, in synchronize() "
                      f"{1e3 * statistics.median(r['total'] for r in late):.1f} ms", flush=True)
            print(f"SYNC MEDIAN {v.name} rank {hvd.rank()} over {len(rows)} steps: step {1e3 * med['cycle']:.1f} ms, "
                  f"in synchronize() {1e3 * med['total']:.1f} ms "
                  f"(cpu {1e3 * med['cpu']:.2f} ms, of which decode+scatter {1e3 * med['cpu_decode_scatter']:.2f}) = "
                  + ", ".join(f"{p} {1e3 * med[p]:.1f}" for p in (*PHASES, "other"))
                  + f"; groups in sync {med['in_sync']:g}, early {med['early']:g}; late {1e3 * med['late']:.1f} ms"
                  + f"; thread cpu {1e3 * med['cycle_thread_cpu']:.1f} ms, minor faults {med['faults']:g}"
                  + "; cpu: " + ", ".join(f"{p} {1e3 * med['cpu_' + p]:.2f}" for p in PHASES), flush=True)


def main(argv: List[str]) -> int:
    if argv[:1] == ["--sync-breakdown"]:
        return breakdown_main(argv[1:])
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


def breakdown_main(argv: List[str]) -> int:
    probe = SyncBreakdown()
    if argv[:1] == ["--ab"]:
        argv = argv[1:]
        probe.variants = ab_variants(probe)
    make = sb.make_optimizer

    def make_optimizer(*a: Any, **k: Any) -> Any:
        opt = make(*a, **k)
        probe.install(opt)
        return opt

    sb.make_optimizer = make_optimizer
    rc = sb.main(argv)
    probe.summary(skip=int(argv[argv.index("--warmup") + 1]) if "--warmup" in argv else 3)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
