"""One class per codec (issue 60): ``hvd_gradcomp.TopK`` is :class:`hvd_gradcomp.codecs.topk.TopK`, and
the same class serves stock Horovod, ``hvd_gradcomp.DistributedOptimizer`` and the DDP hook: Horovod's
``compress``/``decompress`` come from :class:`~hvd_gradcomp.codecs.compressor.GradientCompressor`
(:mod:`hvd_gradcomp.codecs.protocol`), not from a second class per codec."""
from __future__ import annotations

import inspect
import warnings
from pathlib import Path

import pytest
import torch

import hvd_gradcomp as gc
from hvd_gradcomp import codecs
from hvd_gradcomp.codecs import powersgd, protocol, qsgd, topk
from hvd_gradcomp.codecs.compressor import GradientCompressor

PACKAGE = Path(gc.__file__).resolve().parent
CODECS = {"QSGD": qsgd.QSGD, "TopK": topk.TopK, "TopKQSGD": topk.TopKQSGD, "PowerSGD": powersgd.PowerSGD}


@pytest.mark.parametrize("name", sorted(CODECS))
def test_the_exported_class_is_the_codecs_own(name: str) -> None:
    from hvd_gradcomp import horovod
    from hvd_gradcomp.horovod import classes

    assert getattr(gc, name) is CODECS[name]
    assert getattr(horovod, name) is CODECS[name] and getattr(classes, name) is CODECS[name]   # old paths


@pytest.mark.parametrize("name, cls", [("qsgd", qsgd.QSGD), ("topk", topk.TopK), ("topk-qsgd", topk.TopKQSGD),
                                       ("powersgd", powersgd.PowerSGD)])
def test_the_registry_builds_the_codecs_classes(name: str, cls: type) -> None:
    assert type(codecs.build(name, ratio=0.05, bits=4, error_feedback=True, seed=3)) is cls


@pytest.mark.parametrize("name", sorted(CODECS))
def test_every_exported_codec_spans_at_most_three_files(name: str) -> None:
    files = set()
    for klass in getattr(gc, name).__mro__[:-1]:   # past object, a built-in
        path = Path(inspect.getsourcefile(klass))
        assert PACKAGE in path.parents, klass
        files.add(path)
    assert len(files) <= 3, (name, sorted(p.name for p in files))


def test_the_protocol_is_the_base_classs_and_names_the_adapter_without_importing_it() -> None:
    for cls in CODECS.values():
        assert (cls.compress, cls.decompress, cls.bind) == (protocol.compress, protocol.decompress, protocol.bind)
    assert set(protocol.ADAPTER.values()) <= {f"hvd_gradcomp.horovod.stock:{f}"
                                              for f in ("compress", "decompress", "name_map")}
    source = Path(protocol.__file__).read_text()
    assert "import hvd_gradcomp.horovod" not in source and "from ..horovod" not in source


def test_named_parameters_binds_on_every_codec_but_powersgd() -> None:
    model = torch.nn.Linear(4, 2)
    for cls in (qsgd.QSGD, topk.TopK, topk.TopKQSGD):
        assert sorted(cls(named_parameters=model.named_parameters())._names.values()) == ["bias", "weight"]
    c = topk.TopK()
    assert c._names is None and c.bind(model.named_parameters()) is c and repr(c) == repr(topk.TopK())


def test_powersgd_is_refused_by_the_adapter_by_its_declared_collective() -> None:
    from hvd_gradcomp.horovod import HorovodIntegrationError, refuse_rounds

    c = powersgd.PowerSGD(rank=4)
    with pytest.raises(HorovodIntegrationError, match="two dependent allreduces.*hvd_gradcomp.DistributedOptimizer"):
        c.compress(torch.ones(64, 48), name="w")
    with pytest.raises(HorovodIntegrationError, match="cannot run inside hvd.DistributedOptimizer"):
        c.decompress(torch.ones(3), None)
    rounds = type("Rounds", (), {"collective": codecs.ALLREDUCE_ROUNDS})()   # by the declaration, not the class
    with pytest.raises(HorovodIntegrationError, match="Rounds needs two dependent allreduces"):
        refuse_rounds(rounds)
    refuse_rounds(topk.TopK())   # one allreduce carries it: nothing to refuse


def test_the_deprecated_mixin_is_an_empty_marker_warned_at_definition() -> None:
    from hvd_gradcomp.horovod import HorovodCompressor

    assert gc.HorovodCompressor is HorovodCompressor
    with pytest.warns(DeprecationWarning, match="subclass GradientCompressor alone"):
        class Old(HorovodCompressor, topk.TopK):
            pass
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        class Older(Old):   # built on a warned class: not warned again
            pass
    c = Older(ratio=0.5)
    assert type(c).compress is GradientCompressor.compress
    payload, ctx = c.compress(torch.randn(4096), name="w")
    assert c.decompress(payload, ctx).shape == (4096,)


@pytest.mark.slow
def test_one_class_serves_stock_horovod_our_optimizer_and_the_ddp_hook() -> None:
    pytest.importorskip("horovod.torch")
    from tests.harness import run_single

    out = run_single("single:one_class_every_road")
    assert out == {road: ["hvd_gradcomp.codecs.topk:TopKQSGD", True] for road in ("stock", "ours", "ddp")}, out
