"""A codec with a payload layout of its own, written and installed outside the package: EF-SignSGD
(tests/plugins/sign_plugin, walked through in docs/WRITING_A_CODEC.md), installed with pip, runs on
all three roads and from ``hvdgc-launch --compression ef-sign`` (issue 54).

Per road, on 2 ranks (tests/workers/external.py): replicas identical, every rank gets the mean of
what the ranks sent, what was sent is exactly ``mean(|p|) * sign(p)`` of the compensated gradient
``p`` (error feedback keeps the rest), the bytes are those of the layout's definition, and a run
resumed from a checkpoint continues bit-identically.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict

import pytest

from tests.harness import ROOT, launch, rank_env
from tests.test_external_codec import run_road

PLUGIN = ROOT / "tests" / "plugins" / "sign_plugin"
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Dict[str, str]:
    """The ranks' environment once the plugin is installed with pip (into a folder of its own, on
    their path: the test venv is left as it was)."""
    target = tmp_path_factory.mktemp("sign-plugin")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(PLUGIN)], check=True, timeout=300)
    return {"PYTHONPATH": f"{ROOT}{os.pathsep}{target}"}


@pytest.fixture(scope="module", params=["ours", "stock", "ddp"])
def road(request, installed) -> Dict[str, Any]:
    return run_road(request.param, "ef-sign", installed)


@pytest.mark.multirank
def test_every_rank_ends_identical_with_the_mean_of_what_was_sent(road):
    r0, r1 = road["ranks"]
    assert r0["final"] == r1["final"]
    for r in (r0, r1):
        assert r["feedback"] == "classic"          # nature = DENSE: auto chooses classic under SGD
        assert max(r["avg_error"]) < 1e-5, r["avg_error"]


@pytest.mark.multirank
def test_what_was_sent_is_the_scaled_sign_and_feedback_keeps_the_rest(road):
    for r in road["ranks"]:
        assert max(r["sent_error"]) < 1e-6, r["sent_error"]
        assert min(r["sent_counts"]) > 2000      # every value, every step (a dense codec)


@pytest.mark.multirank
def test_bytes_are_the_layouts(road):
    for r in road["ranks"]:
        assert r["codec"] == r["expected"]      # 2,048 values: 56 + 8 + 256 bytes per step
        if road["road"] == "ddp":
            assert r["comm"] == r["expected"]
        elif road["road"] == "ours":   # plus the fused allgather's index, charged to a group's first tensor
            extra = {n: r["comm"][n] - r["expected"][n] for n in r["expected"]}
            assert all(0 <= e <= 4 * 400 for e in extra.values()) and sum(extra.values()) > 0, extra


@pytest.mark.multirank
def test_every_road_counts_into_the_one_ledger(road):
    from tests.test_external_codec import test_every_road_counts_into_the_one_ledger as same_check

    same_check(road)


@pytest.mark.multirank
def test_a_resumed_run_continues_bit_identically(road):
    assert all(r["resumed_identical"] for r in road["ranks"])


@pytest.mark.multirank
def test_hvdgc_launch_trains_with_it_by_name(installed, tmp_path):
    """The installed package's entry point is all the launcher needs: ``--compression ef-sign``."""
    argv = [str(BIN / "hvdgc-launch"), "-np", "2", "--compression", "ef-sign", str(ROOT / "examples/train.py"),
            "--steps", "4", "--no-progress", "--out-dir", str(tmp_path)]
    res = launch(argv, 300, rank_env(installed))
    assert res.returncode == 0, res.output
    assert "EFSign" in res.output, res.output


def test_a_codec_whose_layout_is_wrong_is_refused_when_registered():
    """Checked at ``codecs.register`` (and when first built): a kind of its own needs a declared layout,
    a built-in kind cannot be redeclared, a payload-sending codec needs ``unpack``."""
    import torch  # noqa: F401  (the codec classes below need it loaded)

    from hvd_gradcomp import GradientCompressor, codecs, wire

    def stub(self, flat, dtype, seed, contract=False, marked=None):
        raise NotImplementedError

    no_layout = type("NoLayout", (GradientCompressor,), {"codec_name": "no-layout", "kind": 99, "pack": stub,
                                                         "unpack": stub})
    with pytest.raises(ValueError, match=r"kind is 99, a layout of its own, but it declares none: set layout"):
        codecs.register("no-layout", no_layout)
    builtin = type("Builtin", (GradientCompressor,), {"codec_name": "builtin", "kind": 300, "pack": stub,
                                                      "unpack": stub})
    with pytest.raises(ValueError, match=r"kind is 300: use a built-in layout's"):
        builtin()
    no_unpack = type("NoUnpack", (GradientCompressor,), {"codec_name": "no-unpack", "kind": wire.KIND_TOPK,
                                                         "pack": stub})
    with pytest.raises(ValueError, match=r"does not implement unpack\(header, reader\)"):
        codecs.register("no-unpack", no_unpack)
    assert not {"no-layout", "builtin", "no-unpack"} & set(codecs.names())


def test_the_codec_layout_refuses_a_forged_payload_before_decoding():
    sys.path.insert(0, str(PLUGIN))
    try:
        import torch
        from hvdgc_sign_plugin import EFSign

        from hvd_gradcomp import WireFormatError
    finally:
        sys.path.remove(str(PLUGIN))
    c = EFSign(seed=0)
    payload = c.compress_named("w", torch.randn(1000))
    assert payload.numel() == c.payload_size((1000,)) == 48 + 8 + 128
    with pytest.raises(WireFormatError, match="truncated"):
        c.decode(payload[:100])
    forged = payload.clone()
    forged[5] = 3          # bits: 3, never written by pack
    with pytest.raises(WireFormatError, match="corrupt ef-sign payload"):
        c.decode(forged)


@pytest.fixture(scope="module", params=["ours", "ddp"])
def reduced_road(request, installed) -> Dict[str, Any]:
    return run_road(request.param, "ef-sign-reduced", installed)


@pytest.mark.multirank
def test_a_dense_codec_of_its_own_also_takes_the_compressed_allreduce(reduced_road):
    """The same class declared ``collective = COMPRESSED_ALLREDUCE`` (QSGD's road: each rank's chunk
    of every tensor scattered, reduced and re-encoded, gathered) needs nothing more: replicas
    identical, resume bit-identical, and each step's payloads are two chunk payloads per tensor (one
    sent to the other rank, one re-encoded and gathered), each of the layout's size."""
    def chunk(numel: int) -> int:          # a flat chunk: header + 1-d shape, scale, sign bits
        return 48 + 8 + -(-((numel + 7) // 8) // 8) * 8

    for r in reduced_road["ranks"]:
        assert r["resumed_identical"]
        assert r["codec"] == {"0.weight": 4 * 2 * chunk(1024), "2.weight": 4 * 2 * chunk(1536)}
    assert reduced_road["ranks"][0]["final"] == reduced_road["ranks"][1]["final"]
