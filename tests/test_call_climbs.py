"""Issue 60's measure of how far a reader must jump: a gradient followed from ``gc.Auto.compress``
through the calls climbs back up the imports at most 3 times (6 before the parts redesign, 5 when
``scripts/call_climbs.py`` was first run; each remaining climb is a named override of the codec,
``pack`` or ``_selects``, which a codec of one's own implements)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "call_climbs.py"


def _script():
    spec = importlib.util.spec_from_file_location("call_climbs", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_call_into_a_module_not_imported_is_a_climb() -> None:
    tracer = _script().CallTracer({"codecs.compressor": {"codecs.compressor"},
                                   "codecs.topk": {"codecs.topk", "codecs.compressor"}})

    class Frame:
        def __init__(self, filename, name, back=None):
            self.f_code = type("Code", (), {"co_filename": filename, "co_name": name})()
            self.f_back = back

    base = Frame("/x/hvd_gradcomp/codecs/compressor.py", "compress")
    tracer(Frame("/x/hvd_gradcomp/codecs/topk.py", "pack", base), "call", None)      # up: a climb
    sub = Frame("/x/hvd_gradcomp/codecs/topk.py", "pack")
    tracer(Frame("/x/hvd_gradcomp/codecs/compressor.py", "helper", sub), "call", None)  # down: fine
    assert tracer.climbs == [("codecs.compressor", "codecs.topk", "pack")]


@pytest.mark.multirank
def test_a_gradient_through_auto_climbs_at_most_three_times() -> None:
    result = _script().run_ranks(timeout_s=600)
    assert result["visits"], "the trace saw no call: Auto.compress was not reached"
    assert result["count"] <= 3, result["climbs"]
