"""Compressors declare what they send and by which collective; the rest of the package reads the
declaration (``codec_name``, ``collective``) and the registry (:mod:`hvd_gradcomp.codecs`), never
the class: no ``isinstance(x, QSGD)`` outside the module that defines a codec."""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set

import pytest
import torch

import hvd_gradcomp as gc
from hvd_gradcomp import codecs, wire
from hvd_gradcomp.codecs import compressor as compressors
from hvd_gradcomp.config import CompressionConfig, from_env
from hvd_gradcomp.settings import compressions

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hvd_gradcomp"


def concrete_codecs() -> Dict[str, Set[str]]:
    """Class name -> the modules defining a compressor class of that name that declares a ``codec_name``."""
    import hvd_gradcomp.horovod  # noqa: F401  (its protocol classes are the exported ones)

    found: Dict[str, Set[str]] = {}
    todo: List[type] = [compressors.GradientCompressor]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if getattr(cls, "codec_name", "") and cls.__module__.startswith("hvd_gradcomp."):
            found.setdefault(cls.__name__, set()).add(cls.__module__.split(".", 1)[1])
    return found


def class_checks(source: str, filename: str) -> List[tuple]:
    """(line, class name) of every ``isinstance(x, C)`` / ``issubclass(x, C)`` in ``source``,
    ``C`` a name, an attribute (``compressors.QSGD``) or a tuple of them."""
    out = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in (
                "isinstance", "issubclass") and len(node.args) == 2:
            target = node.args[1]
            for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                name = t.id if isinstance(t, ast.Name) else t.attr if isinstance(t, ast.Attribute) else None
                if name is not None:
                    out.append((node.lineno, name))
    return out


def violations(package: Path, concrete: Dict[str, Set[str]]) -> List[str]:
    bad = []
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)   # hvd_gradcomp.codecs.qsgd: codecs.qsgd
        for line, name in class_checks(path.read_text(), str(path)):
            if name in concrete and module not in concrete[name]:
                bad.append(f"{path.relative_to(package.parent)}:{line}: isinstance/issubclass on {name}")
    return bad


def test_the_checker_finds_a_planted_class_check(tmp_path: Path) -> None:
    pkg = tmp_path / "hvd_gradcomp"
    pkg.mkdir()
    (pkg / "ddp.py").write_text("from .compressors import QSGD\n"
                                "def road(c):\n    return 1 if isinstance(c, (int, QSGD)) else 2\n")
    (pkg / "exchange.py").write_text("def f(c, compressors):\n    return issubclass(type(c), compressors.TopKQSGD)\n")
    (pkg / "compressors.py").write_text("def own(c):\n    return isinstance(c, QSGD)\n")   # its own module
    found = violations(pkg, {"QSGD": {"compressors"}, "TopKQSGD": {"compressors"}})
    assert found == ["hvd_gradcomp/ddp.py:3: isinstance/issubclass on QSGD",
                     "hvd_gradcomp/exchange.py:2: isinstance/issubclass on TopKQSGD"]


def test_no_module_asks_which_concrete_codec_a_compressor_is() -> None:
    concrete = concrete_codecs()
    assert {"QSGD", "TopK", "TopKQSGD"} <= set(concrete)
    bad = violations(PACKAGE, concrete)
    assert not bad, ("read the compressor's declared collective/codec_name (hvd_gradcomp.codecs) instead:\n"
                     + "\n".join(bad))


@pytest.mark.parametrize("name, collective", [("qsgd", codecs.COMPRESSED_ALLREDUCE), ("topk", codecs.ALLGATHER),
                                              ("topk-qsgd", codecs.ALLGATHER)])
def test_builtin_codecs_declare_name_and_collective(name: str, collective: str) -> None:
    c = codecs.build(name, ratio=0.05, bits=4, error_feedback=True, seed=3)
    assert codecs.name_of(c) == name and codecs.collective_of(c) == collective
    assert type(c).__module__.startswith("hvd_gradcomp.codecs.")   # the codec's own class
    assert callable(c.compress) and callable(c.decompress)   # usable inside hvd.DistributedOptimizer too


def test_build_passes_only_the_settings_a_factory_takes() -> None:
    assert repr(codecs.build("topk", ratio=0.05, bits=4, seed=3)) == "TopK(ratio=0.05, error_feedback=True)"
    assert codecs.build("qsgd", ratio=0.05, bits=4, seed=3).seed == 3
    assert codecs.accepted_settings("topk-qsgd") == ("ratio", "bits", "error_feedback", "seed")


def test_config_builds_through_the_registry() -> None:
    c = CompressionConfig("topk-qsgd", ratio=0.02, bits=4, seed=9).make_compressor()
    assert isinstance(c, gc.TopKQSGD) and (c.ratio, c.bits, c.seed) == (0.02, 4, 9)
    assert CompressionConfig("none").make_compressor() is None


class _Halver(compressors.GradientCompressor):
    codec_name, collective, kind = "halver-test", codecs.ALLGATHER, wire.KIND_TOPK

    def pack(self, flat, dtype, seed, contract=False, marked=None):   # never called here
        raise NotImplementedError

    unpack = pack


def test_a_registered_compressor_is_a_setting_of_the_launcher_and_config() -> None:
    with pytest.raises(ValueError, match="unknown compression 'halver-test'"):
        from_env({"HVDGC_COMPRESSION": "halver-test"})
    codecs.register("halver-test", _Halver)
    try:
        assert "halver-test" in compressions() and "halver-test" in codecs.names()
        c = from_env({"HVDGC_COMPRESSION": "halver-test", "HVDGC_SEED": "4"}).make_compressor()
        assert isinstance(c, _Halver) and c.seed == 4 and c.error_feedback
        codecs.register("halver-test", _Halver)    # the same class again (a module imported twice): kept
        with pytest.raises(ValueError, match="registered already"):
            codecs.register("halver-test", type("Other", (_Halver,), {}))
        codecs.register("halver-test", _Halver, replace=True)
    finally:
        codecs.unregister("halver-test")
    assert "halver-test" not in compressions()


@pytest.mark.parametrize("name, words", [("none", "setting of HVDGC_COMPRESSION"), ("Bad Name", "lower-case"),
                                         ("", "non-empty")])
def test_register_refuses_reserved_and_malformed_names(name: str, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        codecs.register(name, _Halver)


def test_lookup_of_an_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(KeyError, match="registered: qsgd, topk, topk-qsgd"):
        codecs.lookup("nope")


def test_payload_size_is_the_codecs_own() -> None:
    q = gc.QSGD(bits=4, bucket_size=512)
    payload = q.compress(torch.randn(3000), name="w")[0]
    assert compressors.payload_size(q, (3000,)) == payload.numel() == q.payload_size((3000,))
    t = gc.TopKQSGD(ratio=0.01, bits=8)
    with pytest.raises(ValueError, match="index_bytes"):
        t.payload_size((3000,))
    with pytest.raises(NotImplementedError, match="_Halver"):
        _Halver().payload_size((10,))


def test_a_codec_with_a_collective_no_road_carries_is_refused() -> None:
    from hvd_gradcomp.collectives.exchange import choose_exchange

    class Odd(_Halver):
        collective = "broadcast"

    with pytest.raises(ValueError, match="collective='broadcast'"):
        choose_exchange(Odd(), None, None)
