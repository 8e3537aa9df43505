"""benchmarks/ is a product of its own: its code imports the library, never tests/, and no two of
its modules import each other (imports inside functions and under ``TYPE_CHECKING`` count: a lazy
import is still a dependency). Read with ``ast`` from the sources: nothing is imported."""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"


def _module_files() -> Dict[str, Path]:
    """Dotted module name -> file, for the benchmarks' code (not their tests or results)."""
    out = {}
    for path in sorted(BENCHMARKS.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[1] in ("tests", "results"):
            continue
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imported(path: Path, name: str) -> Set[str]:
    """Every dotted name ``path`` imports (relative imports resolved against ``name``'s package)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    names: Set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            names |= {base} | {f"{base}.{a.name}" for a in node.names}
    return names


def import_graph() -> Dict[str, Set[str]]:
    files = _module_files()
    return {name: {n for n in _imported(path, name) if n in files and n != name} for name, path in files.items()}


def cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Each import circle, as the path that closes it.

    >>> cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}})
    [['a', 'b', 'a']]
    """
    found: List[List[str]] = []
    state: Dict[str, int] = {}
    path: List[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                found.append(path[path.index(dep):] + [dep])
            elif dep not in state:
                visit(dep)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


def test_no_import_circle_in_benchmarks() -> None:
    assert not cycles(import_graph())


def test_benchmarks_import_the_library_not_the_tests() -> None:
    for name, path in _module_files().items():
        wrong = sorted(n for n in _imported(path, name) if n.split(".")[0] == "tests")
        assert not wrong, f"{path.relative_to(ROOT)} imports {wrong}: benchmarks/ may use hvd_gradcomp, not tests/"
