"""Codecs of other packages: found through the ``hvd_gradcomp.codecs`` entry points or a module named
by ``--codec-module`` / ``HVDGC_CODEC_MODULE``, and checked when registered (issue 54).

The plugin (tests/plugins/randomk_plugin) is installed with pip into a folder of its own, which the
subprocesses put on their path: the test venv is left as it was.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hvd_gradcomp import codecs
from hvd_gradcomp.codecs.compressor import GradientCompressor
from hvd_gradcomp.horovod import HorovodCompressor

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory) -> str:
    target = tmp_path_factory.mktemp("plugin")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(ROOT / "tests/plugins/randomk_plugin")], check=True)
    return f"{target}{os.pathsep}{ROOT}"


def _run(argv, path: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": path, **env})


def test_an_installed_packages_codec_is_built_from_the_environment(plugin_path):
    code = ("from hvd_gradcomp.config import from_env; "
            "c = from_env({'HVDGC_COMPRESSION': 'randomk-plugin', 'HVDGC_RATIO': '0.05'}).make_compressor(); "
            "print(type(c).__name__, c.ratio)")
    res = _run([sys.executable, "-c", code], plugin_path)
    assert res.returncode == 0 and res.stdout.split() == ["PluginRandomK", "0.05"], res.stderr


def test_hvdgc_launch_finds_it_by_name(plugin_path):
    res = _run([str(BIN / "hvdgc-launch"), "--dry-run", "-np", "2", "--compression", "randomk-plugin",
                str(ROOT / "examples/train.py")], plugin_path)
    assert res.returncode == 0 and "HVDGC_COMPRESSION=randomk-plugin" in res.stdout, res.stdout + res.stderr


def test_without_the_package_the_name_is_refused_naming_the_known_ones():
    res = _run([str(BIN / "hvdgc-launch"), "--dry-run", "-np", "2", "--compression", "randomk-plugin",
                str(ROOT / "examples/train.py")], str(ROOT))
    assert res.returncode != 0 and "unknown compression 'randomk-plugin'" in res.stderr and "topk-qsgd" in res.stderr


def test_codec_module_is_imported_by_the_launcher_and_handed_to_the_ranks():
    res = _run([str(BIN / "hvdgc-launch"), "--dry-run", "-np", "2", "--codec-module", "tests.external_randomk",
                "--compression", "randomk", str(ROOT / "examples/train.py")], str(ROOT))
    assert res.returncode == 0 and "HVDGC_CODEC_MODULE=tests.external_randomk" in res.stdout, res.stdout + res.stderr
    code = ("from hvd_gradcomp.config import from_env; "
            "print(type(from_env().make_compressor()).__name__)")
    ranks = _run([sys.executable, "-c", code], str(ROOT), HVDGC_CODEC_MODULE="tests.external_randomk",
                 HVDGC_COMPRESSION="randomk")
    assert ranks.stdout.split() == ["RandomK"], ranks.stderr
    bad = _run([str(BIN / "hvdgc-launch"), "--dry-run", "-np", "2", "--codec-module", "no_such_codecs",
                "--compression", "randomk", str(ROOT / "examples/train.py")], str(ROOT))
    assert bad.returncode != 0 and "cannot import the codec module 'no_such_codecs'" in bad.stderr, bad.stderr


def test_a_class_the_roads_cannot_carry_is_refused_when_registered():
    class Odd(GradientCompressor):
        codec_name, collective = "odd", "broadcast"

    with pytest.raises(ValueError, match=r"collective is 'broadcast': declare one of"):
        codecs.register("odd", Odd)

    class Misnamed(GradientCompressor):
        codec_name, collective = "other", codecs.ALLGATHER

    with pytest.raises(ValueError, match=r"set codec_name = 'odd'"):
        codecs.register("odd", Misnamed)
    assert "odd" not in codecs.names()


def test_a_class_of_the_deprecated_spelling_still_works_and_is_warned():
    """``class C(HorovodCompressor, GradientCompressor)``, how codecs served stock Horovod before every
    compressor did: ``HorovodCompressor`` is an empty marker now, warned at the class's definition; the
    class keeps Horovod's protocol (from ``GradientCompressor``) and its settings are read from its own
    ``__init__``."""
    import torch

    with pytest.warns(DeprecationWarning, match="Signs: HorovodCompressor is deprecated"):
        class Signs(HorovodCompressor, GradientCompressor):
            codec_name, collective, kind = "signs-test", codecs.ALLGATHER, 2   # TopK's layout

            def __init__(self, error_feedback: bool = True, seed=None, **kwargs) -> None:
                super().__init__(error_feedback=error_feedback, seed=seed, **kwargs)

            def pack(self, flat, dtype, seed, contract=False, marked=None):   # never called here
                raise NotImplementedError

            unpack = pack

    assert Signs.__mro__[1:3] == (HorovodCompressor, GradientCompressor)
    assert Signs.compress is GradientCompressor.compress
    assert not {"compress", "decompress", "bind", "__init__"} & set(vars(HorovodCompressor))
    m = torch.nn.Linear(2, 2)
    assert sorted(Signs(named_parameters=m.named_parameters())._names.values()) == ["bias", "weight"]
    codecs.register("signs-test", Signs)
    try:
        assert codecs.accepted_settings("signs-test") == ("error_feedback", "seed")
        assert isinstance(codecs.build("signs-test", ratio=0.01, bits=4, error_feedback=False, seed=3), Signs)
    finally:
        codecs.unregister("signs-test")


def test_feedback_auto_chooses_by_the_codecs_declared_nature():
    """A codec on the allgather that declares ``nature = codecs.DENSE`` (a sign or a dense quantiser
    gathered per rank) gets ``classic`` under AdamW, not the sparse codecs' ``frozen`` warm-up."""
    import torch

    from tests.external_randomk import RandomK

    class DenseGathered(RandomK):
        codec_name, nature = "dense-gathered", codecs.DENSE

    chosen = {}
    for cls in (RandomK, DenseGathered):
        w = torch.nn.Parameter(torch.zeros(2048))
        c = cls(ratio=0.5, seed=0)
        c.attach(torch.optim.AdamW([w]), {w: "w"})
        chosen[cls.__name__] = (codecs.nature_of(c), c.feedback.key)
    assert chosen == {"RandomK": ("sparse", "frozen"), "DenseGathered": ("dense", "classic")}


def test_a_payload_layout_of_a_codecs_own_is_read_once_registered():
    """A codec with a layout of its own (here: one float32 scale, then a bit per value) registers its
    kind with ``wire.register_layout``; a receiving rank then checks such payloads like the built-in
    ones (truncation refused before decoding), and an unregistered kind is refused naming the fix."""
    import torch

    from hvd_gradcomp import wire

    signs = wire.register_layout(41, wire.Layout("signs-test", lambda h: wire.padded(4) + wire.padded((h.numel + 7) // 8)))
    bits = wire.pack_bits(torch.tensor([1, 0, 1, 1, 0, 0, 1, 0, 1, 1], dtype=torch.uint8), 1)
    scale = wire.as_bytes(torch.tensor([0.5]))
    header = wire.Header(signs, torch.float32, 1, wire.INDEX_NONE, (10,), 10, 10, 0, 0)
    payload = wire.assemble(header, [scale, bits], torch.device("cpu"))
    assert wire.read_header(payload).kind == signs
    with pytest.raises(wire.WireFormatError, match="truncated"):
        wire.read_header(payload[:wire.padded(wire.HEADER_BYTES + 8) + 8])   # the sign bits cut off
    unknown = payload.clone()
    unknown[3] = 42
    with pytest.raises(wire.WireFormatError, match="unknown payload kind 42: .*register_layout"):
        wire.read_header(unknown)
    with pytest.raises(wire.WireFormatError, match="taken by layout 'signs-test'"):
        wire.register_layout(41, wire.Layout("other", lambda h: 0))


def test_a_codec_written_against_the_old_private_names_still_works_with_a_warning():
    """``_encode``/``_decode``/``_decode_sparse`` were the codec methods before the interface was public
    (``pack``/``unpack``/``unpack_sparse``): such a class is warned at its definition and works."""
    import torch

    from tests.external_randomk import RandomK

    with pytest.warns(DeprecationWarning, match=r"OldNames\._encode is the old name of the codec method pack"):
        class OldNames(GradientCompressor):
            codec_name, collective, kind = "old-names", codecs.ALLGATHER, 2

            def _encode(self, flat, dtype, seed, contract=False, marked=None):
                return RandomK.pack(self, flat, dtype, seed)

            def _decode_sparse(self, h, reader):
                return RandomK.unpack_sparse(self, h, reader)

            def _decode(self, h, reader):
                return RandomK.unpack(self, h, reader)

            def indices(self, numel, seed, device=torch.device("cpu")):
                return torch.arange(0, numel, 2, device=device)

    c = OldNames(seed=0)
    payload = c.compress_named("w", torch.arange(10.0))
    idx, vals = c.decode_parts(payload)
    assert idx.tolist() == [0, 2, 4, 6, 8] and vals.tolist() == [0.0, 2.0, 4.0, 6.0, 8.0]
    assert c.decode(payload).tolist() == [0.0, 0.0, 2.0, 0.0, 4.0, 0.0, 6.0, 0.0, 8.0, 0.0]


def test_a_codec_without_a_repr_of_its_own_prints_its_class_and_settings(caplog):
    """A codec that defines no ``__repr__`` prints as ``ClassName(setting=value, ...)`` (its constructor's
    arguments that it keeps, followed through ``**kwargs``), not ``<module.Class object at 0x...>``,
    in the library's log lines (the feedback announcement) and ``state_dict``."""
    import logging

    import torch

    from hvd_gradcomp import wire
    from hvd_gradcomp.settings import Checked, check_ratio

    class Halves(GradientCompressor):
        codec_name, collective, kind = "halves-test", codecs.ALLGATHER, wire.KIND_TOPK
        share = Checked(check_ratio, "Share of entries sent.")

        def __init__(self, share: float = 0.5, scale: float = 1.0, tag: str = "a", window: int = 3,
                     **kwargs) -> None:
            super().__init__(**kwargs)
            self.share, self.scale, self.tag = share, scale, tag   # window is not kept

        def pack(self, flat, dtype, seed, contract=False, marked=None):   # never called here
            raise NotImplementedError

        unpack = pack

    class Bare(Halves):
        def __init__(self) -> None:
            super().__init__()

    class Untouched(GradientCompressor):   # no __init__ at all
        codec_name, collective, kind = "untouched-test", codecs.ALLGATHER, wire.KIND_TOPK
        pack = unpack = Halves.pack

    c = Halves(share=0.25, tag="b", window=9, seed=4, clip=2.0, exclude="bias", feedback="classic")
    assert repr(c) == ("Halves(share=0.25, scale=1.0, tag='b', error_feedback=True, feedback='classic', "
                       "clip=2.0, exclude='bias')")
    assert str(c) == repr(c)
    assert repr(Halves(error_feedback=False)) == "Halves(share=0.5, scale=1.0, tag='a', error_feedback=False)"
    assert repr(Bare()) == "Bare()"
    assert repr(Untouched()) == "Untouched(error_feedback=True)"
    assert c.state_dict()["compressor"] == repr(c)

    w = torch.nn.Parameter(torch.zeros(8))
    d = Halves(share=0.1)
    with caplog.at_level(logging.INFO, logger="hvd_gradcomp"):
        d.attach(torch.optim.SGD([w], lr=0.1), {w: "w"})
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert "Halves(share=0.1, scale=1.0, tag='a', error_feedback=True) with SGD: feedback" in logged, logged
    assert " object at 0x" not in logged


def test_the_built_in_codecs_keep_their_own_reprs():
    from hvd_gradcomp import QSGD, PowerSGD, TopK, TopKQSGD
    from tests.external_randomk import RandomK

    assert repr(TopK(ratio=0.05)) == "TopK(ratio=0.05, error_feedback=True)"
    assert repr(QSGD(bits=4)) == "QSGD(bits=4, bucket_size=512, error_feedback=True)"
    assert repr(TopKQSGD(clip=1.0)) == "TopKQSGD(ratio=0.01, bits=8, bucket_size=512, error_feedback=True, clip=1.0)"
    assert repr(PowerSGD(rank=2)).startswith("PowerSGD(rank=2")
    # a plugin's hand-written repr and the default agree on the same codec
    r = RandomK(ratio=0.1, seed=0, exempt="fp32")
    assert repr(r) == GradientCompressor.__repr__(r) == "RandomK(ratio=0.1, error_feedback=True, exempt='fp32')"
