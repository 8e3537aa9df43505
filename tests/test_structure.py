"""The layout holds: imports point one way, codecs know no Horovod, the package loads no torch
until asked, and every ``HVDGC_*`` variable is in the one table.

The import graph is read with ``ast`` from the sources, imports inside functions included
(a lazy import is still a dependency: ``compressors -> stock -> exchange -> compressors``
was a circle although the first edge was lazy).
"""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Set, Tuple

import pytest

from hvd_gradcomp import _LAZY, config

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hvd_gradcomp"
# What is sent and what is remembered: no Horovod, nothing from the layers above.
CODEC_MODULES = {"settings", "stats", "codecs", "codecs.registry", "wire", "wire.format", "wire.indices", "feedback", "feedback.residuals",
                 "feedback.kernels", "feedback.policy", "feedback.registry", "feedback.names", "feedback.momentum",
                 "feedback.frozen", "feedback.frozen_warmup", "feedback.frozen_scale", "feedback.frozen_momentum",
                 "feedback.frozen_adam", "feedback.frozen_denom",
                 "codecs.compressor", "codecs.interface", "codecs.exempt", "codecs.binding", "codecs.steps",
                 "codecs.clipping", "codecs.kernels", "codecs.protocol", "codecs.qsgd", "codecs.topk", "codecs.powersgd"}
# Horovod's private names and the frame tricks that reach them: hvd_gradcomp/horovod/stock.py only.
HOROVOD_ADAPTER = PACKAGE / "horovod" / "stock.py"
HOROVOD_INTERNAL_MARKS = ("_getframe", "f_locals", "_starting_models", '"_compression"', "'_compression'")


def modules_of(package: Path) -> Dict[str, List[Path]]:
    """Module name (dotted, relative to the package; a subpackage is its ``__init__``) -> its files.
    The ``launchers`` subpackage is one node, as its layer is."""
    out: Dict[str, List[Path]] = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package).with_suffix("").parts
        if parts == ("__init__",):
            continue
        name = "launchers" if parts[0] == "launchers" else \
            ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out.setdefault(name, []).append(path)
    return out


def import_graph(package: Path) -> Dict[str, Set[str]]:
    """module -> the package modules it imports (anywhere in the file), plus "HOROVOD"
    for an import of Horovod itself. ``from . import Name`` of a lazily exported name
    counts as an import of the module that defines it."""
    files = modules_of(package)
    graph: Dict[str, Set[str]] = {}
    for name, paths in files.items():
        deps: Set[str] = set()
        for path in paths:
            where = path.relative_to(package).with_suffix("").parts[:-1]   # the file's own package
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    deps |= {"HOROVOD" for a in node.names if a.name.split(".")[0] == "horovod"}
                    deps |= {_owner(a.name.split(".", 1)[1], files) for a in node.names
                             if a.name.startswith(f"{package.name}.")}
                elif isinstance(node, ast.ImportFrom):
                    deps |= _from_import(node, package.name, where, files)
        graph[name] = deps - {name}
    return graph


def _owner(dotted: str, files: Dict[str, List[Path]]) -> Optional[str]:
    """The module of ``files`` that ``dotted`` (relative to the package) is or lies in; None: a name
    of the package itself."""
    parts = dotted.split(".")
    if parts[0] == "launchers":
        return "launchers"
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in files:
            return ".".join(parts[:i])
    return None


def _from_import(node: ast.ImportFrom, package: str, where: Tuple[str, ...], files: Dict[str, List[Path]]) -> Set[str]:
    """What ``from X import a, b`` imports: for each name, the submodule it is, the module ``X`` it
    lies in, or (``X`` the package itself) the module :data:`_LAZY` says defines it."""
    base = node.module or ""
    if node.level == 0:
        if base.split(".")[0] == "horovod":
            return {"HOROVOD"}
        if not (base == package or base.startswith(f"{package}.")):
            return set()
        parts = base.split(".")[1:]
    else:
        parts = list(where[:len(where) - (node.level - 1)]) + (base.split(".") if base else [])
    found = {_owner(".".join(parts + [a.name]), files) or _LAZY.get(a.name) for a in node.names}
    return found - {None}


def find_cycle(graph: Dict[str, Set[str]]) -> Optional[List[str]]:
    """One import circle as [a, b, ..., a], or None.

    >>> find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}})
    ['a', 'b', 'c', 'a']
    >>> find_cycle({"a": {"b"}, "b": set()}) is None
    True
    """
    state: Dict[str, int] = {}   # 1: on the current path, 2: done
    path: List[str] = []

    def visit(node: str) -> Optional[List[str]]:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state:
                found = visit(dep)
                if found:
                    return found
        state[node] = 2
        path.pop()
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start)
            if found:
                return found
    return None


def test_cycle_finder_and_graph_reader_catch_a_planted_circle(tmp_path: Path) -> None:
    pkg = tmp_path / "hvd_gradcomp"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "compressors.py").write_text("def f():\n    from . import stock\n")   # lazy, still an edge
    (pkg / "stock.py").write_text("from .exchange import X\nimport horovod.torch as hvd\n")
    (pkg / "exchange.py").write_text("from hvd_gradcomp.compressors import Y\n")
    graph = import_graph(pkg)
    assert graph == {"compressors": {"stock"}, "stock": {"exchange", "HOROVOD"}, "exchange": {"compressors"}}
    assert find_cycle(graph) == ["compressors", "stock", "exchange", "compressors"]


def test_no_import_circle_in_the_package() -> None:
    graph = import_graph(PACKAGE)
    assert {"horovod", "codecs.compressor", "collectives.exchange", "horovod.optimizer", "config"} <= set(graph)
    assert find_cycle(graph) is None, f"import circle: {' -> '.join(find_cycle(graph))}"


def test_codecs_import_neither_horovod_nor_the_layers_above() -> None:
    graph = import_graph(PACKAGE)
    for module in sorted(CODEC_MODULES):
        above = graph[module] - CODEC_MODULES
        assert not above, f"hvd_gradcomp.{module} imports {sorted(above)}: codecs depend on codecs only"


def test_only_the_adapter_touches_horovod_internals() -> None:
    assert any(mark in HOROVOD_ADAPTER.read_text() for mark in HOROVOD_INTERNAL_MARKS)   # the rule names the right file
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == HOROVOD_ADAPTER:
            continue
        found = [mark for mark in HOROVOD_INTERNAL_MARKS if mark in path.read_text()]
        rel = path.relative_to(PACKAGE).as_posix()
        assert not found, f"{rel} uses {found}: Horovod internals belong in hvd_gradcomp/horovod/stock.py"


def defining_inits(package: Path) -> List[str]:
    """Every subpackage ``__init__.py`` of ``package`` that defines a function or a class, at any depth,
    as ``path: name``. The package's own ``__init__`` is left out: its PEP 562 ``__getattr__`` loads the
    public names on first use.

    >>> import tempfile; d = Path(tempfile.mkdtemp())
    >>> (d / "sub").mkdir(); _ = (d / "__init__.py").write_text("def __getattr__(name): ...\\n")
    >>> _ = (d / "sub" / "__init__.py").write_text("from .m import f\\nif True:\\n    class C: ...\\n")
    >>> defining_inits(d)
    ['sub/__init__.py: C']
    """
    found = []
    for path in sorted(package.rglob("__init__.py")):
        if path.parent == package:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                found.append(f"{path.relative_to(package).as_posix()}: {node.name}")
    return found


def test_no_subpackage_init_defines_a_class_or_function() -> None:
    """A package's ``__init__.py`` says what the package is for and re-exports its modules' names;
    the code lives in modules named for what they do (docs/ARCHITECTURE.md)."""
    assert defining_inits(PACKAGE) == [], "move these into a module of the package and re-export them"


def test_public_names_are_defined_where_the_lazy_table_says() -> None:
    import hvd_gradcomp

    for name, module in _LAZY.items():
        assert getattr(hvd_gradcomp, name).__module__ == f"hvd_gradcomp.{module}", name


@pytest.mark.parametrize("statement", ["import hvd_gradcomp", "import hvd_gradcomp.config",
                                       "from hvd_gradcomp.config import from_env; from_env()",
                                       "import hvd_gradcomp.launchers.cli"])
def test_importing_the_package_or_the_launcher_loads_no_torch(statement: str) -> None:
    code = f"import sys; {statement}; print(sorted(m for m in ('torch', 'horovod') if m in sys.modules))"
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"


def test_a_tensor_facing_name_loads_its_module_on_first_use() -> None:
    code = ("import sys, hvd_gradcomp as gc; assert 'torch' not in sys.modules; c = gc.TopKQSGD(); "
            "print(type(c).__module__, 'torch' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["hvd_gradcomp.codecs.topk", "True"]


def test_every_hvdgc_variable_is_in_the_one_table() -> None:
    used: Set[str] = set()
    for folder in ("hvd_gradcomp", "benchmarks", "examples"):
        for path in (ROOT / folder).rglob("*.py"):
            used |= set(re.findall(r"\bHVDGC_[A-Z_]*[A-Z]\b", path.read_text()))
    assert used <= set(config.VARIABLES), f"not in hvd_gradcomp.config.VARIABLES: {sorted(used - set(config.VARIABLES))}"
    table = config.__doc__
    for var, (_, meaning, default) in config.VARIABLES.items():
        row = next((ln for ln in table.splitlines() if ln.startswith(var + " ")), "")
        assert meaning in row and default in row, f"{var} is missing from the table in config's docstring"


# The layers, lowest first: a module imports only modules of its own layer or lower ones.
# docs/ARCHITECTURE.md shows the same table (checked below); a new module needs a row here.
LAYERS = (
    ("settings", ("settings", "stats", "codecs", "codecs.registry")),
    ("wire", ("wire", "wire.format", "wire.indices")),
    ("feedback", ("feedback", "feedback.kernels", "feedback.residuals", "feedback.policy", "feedback.registry", "feedback.names", "feedback.momentum", "feedback.frozen", "feedback.frozen_warmup", "feedback.frozen_scale",
                  "feedback.frozen_momentum", "feedback.frozen_adam", "feedback.frozen_denom")),
    ("codecs", ("codecs.kernels", "codecs.interface", "codecs.exempt", "codecs.binding", "codecs.steps", "codecs.clipping",
                "codecs.protocol", "codecs.compressor",
                "codecs.qsgd", "codecs.topk", "codecs.powersgd")),
    ("collectives", ("collectives", "collectives.reduce", "collectives.rounds", "collectives.transport",
                     "collectives.inflight", "collectives.exchange", "collectives.fused", "collectives.fused_group",
                     "collectives.sparse_allreduce", "collectives.simulate")),
    ("horovod", ("horovod", "horovod.stock", "horovod.classes")),
    ("auto", ("auto", "auto.auto", "auto.policy", "auto.schedule", "auto.measure", "auto.decide", "auto.residuals",
              "auto.stock", "auto.state")),
    ("optimizers", ("horovod.elastic", "horovod.optimizer", "horovod.small", "horovod.watch", "horovod.hooks",
                    "horovod.exchanges", "horovod.accumulate", "ddp", "ddp.state", "ddp.hook", "ddp.env",
                    "ddp.accumulate", "ddp.exchanges", "ddp.sparse_exchange", "ddp.auto", "ddp.checkpoint", "ddp.plans", "ddp.handoff", "ddp.policy",
                    "ddp.join", "config")),
    ("integrations", ("integrations", "integrations.extras", "integrations.lightning", "integrations.accelerate")),
    ("launchers", ("launchers",)),
)
FIRST_WITH_HOROVOD = "collectives"   # layers below it import no Horovod


def layered_graph(package: Path) -> Dict[str, Set[str]]:
    """:func:`import_graph`, whose nodes are the layers' modules (the ``launchers`` subpackage is one)."""
    return import_graph(package)


def layer_violations(graph: Dict[str, Set[str]], layers=LAYERS) -> List[str]:
    """Every import that points up the layers, or into Horovod below :data:`FIRST_WITH_HOROVOD`.

    >>> layer_violations({"wire": {"kernels"}, "kernels": {"wire"}}, (("wire", ("wire",)), ("kernels", ("kernels",))))
    ['wire (layer wire) imports kernels (layer kernels)']
    """
    level = {m: i for i, (_, ms) in enumerate(layers) for m in ms}
    names = {m: name for name, ms in layers for m in ms}
    horovod_from = next((i for i, (name, _) in enumerate(layers) if name == FIRST_WITH_HOROVOD), len(layers))
    bad = []
    for module in sorted(graph):
        for dep in sorted(graph[module]):
            if dep == "HOROVOD":
                if level[module] < horovod_from:
                    bad.append(f"{module} (layer {names[module]}) imports Horovod")
            elif level[dep] > level[module]:
                bad.append(f"{module} (layer {names[module]}) imports {dep} (layer {names[dep]})")
    return bad


def test_every_module_has_a_layer() -> None:
    placed = {m for _, ms in LAYERS for m in ms}
    modules = set(layered_graph(PACKAGE))
    assert modules == placed, (f"modules without a layer: {sorted(modules - placed)}; layers naming no module: "
                               f"{sorted(placed - modules)} (tests/test_structure.py LAYERS, docs/ARCHITECTURE.md)")


def test_imports_point_down_the_layers() -> None:
    bad = layer_violations(layered_graph(PACKAGE))
    assert not bad, "imports against the layers (docs/ARCHITECTURE.md):\n" + "\n".join(bad)


def test_the_layer_checker_catches_an_upward_import(tmp_path: Path) -> None:
    pkg = tmp_path / "hvd_gradcomp"
    for folder in ("launchers", "wire", "collectives"):
        (pkg / folder).mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "collectives" / "__init__.py").write_text("")
    (pkg / "wire" / "__init__.py").write_text("def f():\n    from ..collectives.exchange import X\n")   # lazy, still up
    (pkg / "collectives" / "exchange.py").write_text("import horovod.torch\nfrom .. import wire\n")
    (pkg / "wire" / "format.py").write_text("import horovod.torch as hvd\n")
    (pkg / "launchers" / "cli.py").write_text("from .. import collectives\nfrom ..wire import f\n")
    graph = layered_graph(pkg)
    assert graph["launchers"] == {"collectives", "wire"}
    assert graph["collectives.exchange"] == {"HOROVOD", "wire"}
    assert layer_violations(graph) == ["wire (layer wire) imports collectives.exchange (layer collectives)",
                                       "wire.format (layer wire) imports Horovod"]


ARITHMETIC_NAMES = re.compile(r"qsgd|topk|top_of|marked|momentum|residual|finite|half|norm|sample|compile")
"""Words of the codecs' and error feedback's arithmetic (hvd_gradcomp/codecs/kernels.py,
hvd_gradcomp/feedback/kernels.py), which no name defined in ``wire/`` may hold."""


def wire_arithmetic(package: Path) -> List[str]:
    """What in ``package/wire`` is not the byte format: a public function or class the ``wire``
    package does not export (its ``__all__``), a name of the codecs' or feedback's arithmetic
    (:data:`ARITHMETIC_NAMES`), a use of ``torch.compile`` (compiling is done on demand above it,
    :func:`hvd_gradcomp.feedback.kernels.kernel`).

    >>> import tempfile; d = Path(tempfile.mkdtemp()); (d / "wire").mkdir()
    >>> _ = (d / "wire" / "__init__.py").write_text("__all__ = ['pack_bits']")
    >>> _ = (d / "wire" / "kernels.py").write_text("def pack_bits(): pass\\ndef qsgd_encode(): torch.compile(f)")
    >>> for line in wire_arithmetic(d): print(line)
    wire/kernels.py: qsgd_encode (not in wire.__all__)
    wire/kernels.py: qsgd_encode (arithmetic)
    wire/kernels.py: torch.compile
    """
    init = ast.parse((package / "wire" / "__init__.py").read_text())
    exported = next((set(ast.literal_eval(n.value)) for n in init.body if isinstance(n, ast.Assign)
                     and any(isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets)), set())
    found = []
    for path in sorted((package / "wire").glob("*.py")):
        rel = path.relative_to(package).as_posix()
        tree = ast.parse(path.read_text(), str(path))
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                if not node.name.startswith("_") and node.name not in exported:
                    found.append(f"{rel}: {node.name} (not in wire.__all__)")
                if ARITHMETIC_NAMES.search(node.name.lower()):
                    found.append(f"{rel}: {node.name} (arithmetic)")
        found += [f"{rel}: torch.compile" for n in ast.walk(tree)
                  if isinstance(n, ast.Attribute) and n.attr == "compile" and isinstance(n.value, ast.Name)
                  and n.value.id == "torch"]
    return found


def test_the_wire_holds_only_the_byte_format() -> None:
    """``wire/`` is the byte format: every function and class it defines is its public API or a
    helper of it; QSGD's rounding, top-k selection, error feedback's sums and finiteness checks
    live with the codecs and feedback (hvd_gradcomp/codecs/kernels.py, hvd_gradcomp/feedback/kernels.py)."""
    assert wire_arithmetic(PACKAGE) == []


def test_the_architecture_page_shows_the_layers() -> None:
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    rows = re.findall(r"^\| (\w+) \| ((?:`[\w.]+`(?:, )?)+) \|", text, flags=re.M)
    shown = tuple((name, tuple(re.findall(r"`([\w.]+)`", mods))) for name, mods in rows)
    assert shown == LAYERS, "docs/ARCHITECTURE.md's layer table differs from tests/test_structure.py LAYERS"


@pytest.mark.parametrize("module", ["reduce", "rounds"])
def test_the_reduction_helpers_import_no_collective_library(module: str) -> None:
    """hvd_gradcomp/collectives/reduce.py and the algorithms written once (rounds.py) serve both the Horovod
    exchanges and the DDP hook: neither Horovod nor torch.distributed."""
    tree = ast.parse((PACKAGE / "collectives" / f"{module}.py").read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [m for m in names if m.startswith(("horovod", "torch.distributed"))], names


MAX_MODULE_LINES = 900
MAX_CLASS_LINES = 300
"""Size limits of the package's parts: a module or a class past them holds more than one idea
(GradientCompressor reached 718 lines and about ten responsibilities before it was split)."""


def oversized(package: Path, max_module: int = MAX_MODULE_LINES, max_class: int = MAX_CLASS_LINES) -> List[str]:
    """Every module of ``package`` (subpackages included) over ``max_module`` lines and every class
    over ``max_class``, as ``path: what (lines)``.

    >>> import tempfile; d = Path(tempfile.mkdtemp())
    >>> _ = (d / "m.py").write_text("class A:\\n" + "    x = 1\\n" * 4)
    >>> oversized(d, max_module=10, max_class=4)
    ['m.py: class A (5 lines)']
    """
    found = []
    for path in sorted(package.rglob("*.py")):
        text = path.read_text()
        rel = path.relative_to(package).as_posix()
        if len(text.splitlines()) > max_module:
            found.append(f"{rel}: module ({len(text.splitlines())} lines)")
        for node in ast.walk(ast.parse(text, str(path))):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > max_class:
                found.append(f"{rel}: class {node.name} ({node.end_lineno - node.lineno + 1} lines)")
    return found


def test_no_module_or_class_past_the_size_limits() -> None:
    assert oversized(PACKAGE) == [], (f"split these along their responsibilities (modules <= {MAX_MODULE_LINES} "
                                      f"lines, classes <= {MAX_CLASS_LINES}; docs/ARCHITECTURE.md)")


HEADROOM_CLASS_LINES = MAX_CLASS_LINES * 5 // 6


def test_the_largest_class_leaves_headroom_under_the_cap() -> None:
    """No class is over 5/6 of the cap (250 of 300 lines). Why: a cap that classes are cut to just pass
    stops meaning anything; a class parked at 291 lines grows past 300 with its next feature, and is
    then split in a hurry, along whatever seam makes it pass rather than along its problem's."""
    assert HEADROOM_CLASS_LINES == 250
    big = oversized(PACKAGE, max_module=sys.maxsize, max_class=HEADROOM_CLASS_LINES)
    assert big == [], f"split these along their responsibilities (classes <= {HEADROOM_CLASS_LINES} lines)"


def test_the_size_check_catches_a_long_class(tmp_path: Path) -> None:
    (tmp_path / "big.py").write_text("class Big:\n" + "    x = 1\n" * MAX_CLASS_LINES + "y = 2\n" * MAX_MODULE_LINES)
    assert oversized(tmp_path) == [f"big.py: module ({1 + MAX_CLASS_LINES + MAX_MODULE_LINES} lines)",
                                   f"big.py: class Big ({1 + MAX_CLASS_LINES} lines)"]


def test_module_paths_from_before_the_layout_still_import_with_a_warning() -> None:
    """Code written against the flat layout (``from hvd_gradcomp.compressors import GradientCompressor``,
    ``from hvd_gradcomp import kernels``) gets the module at its new path and a DeprecationWarning
    naming it; every entry of ``hvd_gradcomp.MOVED`` points at a module that exists."""
    import importlib
    import warnings

    import hvd_gradcomp

    assert not set(hvd_gradcomp.MOVED) & set(modules_of(PACKAGE))   # no module kept its old path as well
    code = ("import warnings, sys; warnings.simplefilter('error'); "
            "import hvd_gradcomp.codecs.compressor as new\n"
            "try:\n    from hvd_gradcomp.compressors import GradientCompressor\n"
            "except DeprecationWarning as w:\n    print(w)")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert res.stdout.strip() == "hvd_gradcomp.compressors moved to hvd_gradcomp.codecs.compressor: import it from there"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        for old, new in hvd_gradcomp.MOVED.items():
            if isinstance(new, str):
                assert importlib.import_module(f"hvd_gradcomp.{old}") is importlib.import_module(f"hvd_gradcomp.{new}")
                continue
            merged = importlib.import_module(f"hvd_gradcomp.{old}")   # a module split in two: the names of both
            for part in new:
                module = importlib.import_module(f"hvd_gradcomp.{part}")
                assert all(getattr(merged, n) is v for n, v in vars(module).items() if not n.startswith("_")), part


def test_the_split_kernels_still_import_from_the_wire_with_a_warning() -> None:
    """``hvd_gradcomp.wire.kernels`` (the codecs' and error feedback's arithmetic, in the byte format's
    folder until it was split) still imports, with a DeprecationWarning naming both new homes."""
    code = ("import warnings; warnings.simplefilter('error')\n"
            "try:\n    from hvd_gradcomp.wire.kernels import add_marked\n"
            "except DeprecationWarning as w:\n    print(w)\n"
            "warnings.simplefilter('ignore')\n"
            "from hvd_gradcomp.wire.kernels import add_marked, qsgd_encode\n"
            "from hvd_gradcomp.feedback import kernels as f; from hvd_gradcomp.codecs import kernels as c\n"
            "print(add_marked is f.add_marked and qsgd_encode is c.qsgd_encode)")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert res.stdout.split("\n")[:2] == ["hvd_gradcomp.wire.kernels moved to hvd_gradcomp.codecs.kernels and "
                                          "hvd_gradcomp.feedback.kernels: import it from there", "True"], res.stderr


def deprecated_imports(package: Path = PACKAGE) -> List[str]:
    """Imports inside the package of a module path kept only for old code (``hvd_gradcomp.MOVED``):
    they work, with a DeprecationWarning on every fresh process, and hide which module is meant."""
    from hvd_gradcomp import MOVED

    found = []
    for path in sorted(package.rglob("*.py")):
        where = path.relative_to(package).with_suffix("").parts[:-1]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = list(where[:len(where) - node.level + 1]) + (node.module.split(".") if node.module else [])
            elif node.module and node.module.split(".")[0] == package.name:
                base = node.module.split(".")[1:]
            else:
                continue
            targets = [".".join(base)] + [".".join(base + [a.name]) for a in node.names]
            found += [f"{path.relative_to(package)}: {t}" for t in targets if t in MOVED]
    return found


def test_the_package_imports_no_deprecated_path() -> None:
    assert deprecated_imports() == []
