"""Follow one gradient through the package's calls and count how often a call climbs back up the imports.

A "climb" is a call from one module of the package into another that it does not import, directly
or through the modules it imports (the import graph is ``tests/test_structure.py``'s, read with
``ast``, lazy imports included). Imports point one way, down the layers; a call that goes where no
import leads is a method reached through ``self`` that a mixin, a subclass or a sibling defines, or
a callback: a place where a reader following the gradient must jump to a module the file in front
of them never names. Issue 60 asks for
at most 3 on the path of a gradient through ``gc.Auto``.

What is traced: rank 0 of two (``horovodrun --gloo -np 2``: on one rank Horovod's optimizer
exchanges nothing), a
``Linear(64, 64)``, stock ``hvd.DistributedOptimizer`` with ``gc.Auto`` forced onto its sparse road
(``roads=("sparse",)``), one warm-up step untraced, then the calls under ``Auto.compress`` and
``Auto.decompress`` of the weight's gradient in the next step, with ``sys.setprofile``.

Run it from a checkout (it imports ``hvd_gradcomp`` and ``tests.test_structure`` from there)::

    python scripts/call_climbs.py            # prints the climbs, the modules visited, and a count
    python scripts/call_climbs.py --json     # the same as JSON (for tests)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Set, Tuple

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path[:1]:
    sys.path.insert(0, str(ROOT))   # the checkout this script lives in, before any installed copy

PACKAGE = "hvd_gradcomp"


def reachable() -> Dict[str, Set[str]]:
    """Module name relative to the package (``"codecs.topk"``) -> every module it imports, directly
    or not (itself included)."""
    from tests.test_structure import PACKAGE as SOURCE, import_graph

    graph = import_graph(SOURCE)
    closure: Dict[str, Set[str]] = {}
    for start in graph:
        seen, todo = {start}, [start]
        while todo:
            for dep in graph.get(todo.pop(), ()):
                if dep in graph and dep not in seen:
                    seen.add(dep)
                    todo.append(dep)
        closure[start] = seen
    return closure


def module_of(filename: str, modules: Mapping[str, Any]) -> Optional[str]:
    """The module of ``modules`` a source file belongs to (a package's ``__init__`` is the package), or None
    outside the package.

    >>> module_of("/x/hvd_gradcomp/codecs/topk.py", {"codecs.topk": 3})
    'codecs.topk'
    >>> module_of("/x/hvd_gradcomp/launchers/cli.py", {"launchers": 9})
    'launchers'
    >>> module_of("/usr/lib/python3/json/__init__.py", {}) is None
    True
    """
    parts = Path(filename).with_suffix("").parts
    if PACKAGE not in parts:
        return None
    rel = list(parts[len(parts) - parts[::-1].index(PACKAGE):])
    if rel and rel[-1] == "__init__":
        rel = rel[:-1]
    for i in range(len(rel), 0, -1):
        name = ".".join(rel[:i])
        if name in modules:
            return name
    return None


class CallTracer:
    """A ``sys.setprofile`` function that records every call between package modules."""

    def __init__(self, imports: Dict[str, Set[str]]) -> None:
        self.imports = imports
        self.climbs: List[Tuple[str, str, str]] = []    # (caller module, callee module, callee function)
        self.visits: List[str] = []                     # callee modules, in call order, repeats collapsed

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if event != "call" or frame.f_back is None:
            return
        callee = module_of(frame.f_code.co_filename, self.imports)
        caller = module_of(frame.f_back.f_code.co_filename, self.imports)
        if callee is None or caller is None or callee == caller:
            return
        if not self.visits or self.visits[-1] != callee:
            self.visits.append(callee)
        if callee not in self.imports[caller]:
            self.climbs.append((caller, callee, frame.f_code.co_name))


def trace() -> Dict[str, Any]:
    """Run the traced step (see the module docstring) and return what the tracer saw."""
    import horovod.torch as hvd
    import torch

    import hvd_gradcomp as gc
    from hvd_gradcomp.auto import Auto

    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    auto = gc.Auto(roads=("sparse",), explore_steps=1, warmup_steps=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), compression=auto)
    tracer = CallTracer(reachable())
    compress, decompress = Auto.compress, Auto.decompress

    def traced(fn):
        def run(self, *args, **kwargs):
            if args and getattr(args[0], "numel", lambda: 0)() != model.weight.numel():
                return fn(self, *args, **kwargs)            # only the weight's gradient
            sys.setprofile(tracer)
            try:
                return fn(self, *args, **kwargs)
            finally:
                sys.setprofile(None)
        return run

    def step(x: torch.Tensor) -> None:
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    step(torch.randn(8, 64))                   # warm-up: first-use set-up stays out of the trace
    Auto.compress, Auto.decompress = traced(compress), traced(decompress)
    try:
        step(torch.randn(8, 64))
    finally:
        Auto.compress, Auto.decompress = compress, decompress
    return {"climbs": tracer.climbs, "count": len(tracer.climbs), "visits": tracer.visits,
            "modules": sorted(set(tracer.visits))}


def run_ranks(timeout_s: float = 300.0) -> Dict[str, Any]:
    """Trace under ``horovodrun --gloo -np 2`` and return rank 0's result."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rank0.json"
        cmd = [str(Path(sys.executable).with_name("horovodrun")), "--gloo", "-np", "2",
               sys.executable, str(Path(__file__).resolve()), "--worker", str(out)]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0 or not out.exists():
            raise RuntimeError(f"the traced ranks failed (exit {done.returncode}):\n{done.stdout}\n{done.stderr}")
        return json.loads(out.read_text())


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)   # a rank's side (internal)
    args = parser.parse_args(argv)
    if args.worker:
        result = trace()
        if int(os.environ.get("HOROVOD_RANK", "0")) == 0:
            Path(args.worker).write_text(json.dumps(result))
        return 0
    result = run_ranks()
    if args.json:
        print(json.dumps(result))
        return 0
    for caller, callee, fn in result["climbs"]:
        print(f"climb: {caller} -> {callee}.{fn}")
    print(f"{len(result['visits'])} module visits, {len(result['modules'])} modules, "
          f"{result['count']} climbs (calls into a module the caller does not import)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
