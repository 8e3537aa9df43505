"""One name per concept (docs/ARCHITECTURE.md, "Glossary"): "road" names only Auto's per-tensor choice.

The wrapper, the exchange, the driver and the float16 cast each have their own word; code that means
one of them says it. Identifiers are checked (names, attributes, function, class and argument names),
not prose: a reviewer reads that.
"""
import ast
import re
from pathlib import Path
from typing import Iterator, Tuple

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hvd_gradcomp"

# Where "road" is Auto's choice, and so the right word.
AUTO = {"auto", "ddp/auto.py"}
# Identifiers outside AUTO that hold Auto's choice all the same: (module, identifier) -> why.
AUTO_CHOICE = {
    ("collectives/inflight.py", "road"): "Pending.road: the road Auto picked for the tensor (auto.AutoExchange)",
}
KNOWN_EXCEPTIONS: set = set()   # files allowed a road identifier until renamed: none left
_WORD = re.compile(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])|\d+")


def words(identifier: str) -> list:
    """The words of a snake_case or CamelCase identifier, lower-cased.

    >>> words("_AutoRoads"), words("road_clips"), words("broadcast_parameters")
    (['auto', 'roads'], ['road', 'clips'], ['broadcast', 'parameters'])
    """
    return [w.lower() for w in _WORD.findall(identifier)]


def identifiers(tree: ast.AST) -> Iterator[Tuple[int, str]]:
    """Every name the code gives or reads: variables, attributes, functions, classes, arguments,
    keywords and import aliases, with their line."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            yield node.lineno, node.id
        elif isinstance(node, ast.Attribute):
            yield node.lineno, node.attr
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node.lineno, node.name
        elif isinstance(node, ast.arg):
            yield node.lineno, node.arg
        elif isinstance(node, ast.keyword) and node.arg:
            yield node.lineno, node.arg
        elif isinstance(node, ast.alias):
            yield node.lineno, node.asname or node.name


def _exempt(rel: str) -> bool:
    return rel in KNOWN_EXCEPTIONS or rel in AUTO or rel.split("/")[0] in AUTO


def road_identifiers() -> list:
    """``module:line: identifier`` for each identifier outside Auto's code that says road."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if _exempt(rel):
            continue
        for line, name in identifiers(ast.parse(path.read_text(), str(path))):
            if {"road", "roads"} & set(words(name)) and (rel, name) not in AUTO_CHOICE:
                found.append(f"{rel}:{line}: {name}")
    return sorted(set(found))


def test_road_names_only_autos_choice():
    """Outside ``auto/`` and ``ddp/auto.py``, no identifier says road: the wrapper, the exchange, the
    driver or the float16 cast is meant, and the glossary has a word for each."""
    found = road_identifiers()
    assert not found, ("'road' is only Auto's choice (docs/ARCHITECTURE.md, Glossary); say wrapper, exchange, "
                       "driver or float16 cast instead:\n" + "\n".join(found))


def test_allowances_still_needed():
    """Each allowance names a module that exists and an identifier still in it."""
    for rel in KNOWN_EXCEPTIONS | {rel for rel, _ in AUTO_CHOICE}:
        assert (PACKAGE / rel).exists(), rel
    for rel, name in AUTO_CHOICE:
        assert name in {n for _, n in identifiers(ast.parse((PACKAGE / rel).read_text()))}, (rel, name)


def test_renamed_modules_still_import():
    """The modules renamed for the glossary keep their old paths, deprecated."""
    import importlib
    import sys
    import warnings

    for old, new in (("hvd_gradcomp.ddp.roads", "hvd_gradcomp.ddp.exchanges"),
                     ("hvd_gradcomp.codecs.contract", "hvd_gradcomp.codecs.interface")):
        sys.modules.pop(old, None)   # imported earlier (say, by a module not yet moved to the new path)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            module = importlib.import_module(old)
        assert module is importlib.import_module(new)
        assert any(issubclass(w.category, DeprecationWarning) and new in str(w.message) for w in caught), old
