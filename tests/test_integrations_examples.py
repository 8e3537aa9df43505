"""The integrations' examples (examples/lightning_train.py, examples/accelerate_train.py) run for real on
2 Gloo ranks under torchrun, a resume of each included, and docs/INTEGRATIONS.md shows their code as it is."""
from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path
from typing import List

import pytest

from tests.harness import ROOT, launch, rank_env

PAGE = ROOT / "docs" / "INTEGRATIONS.md"
EXAMPLES = {name: ROOT / "examples" / f"{name}_train.py" for name in ("lightning", "accelerate")}


def test_the_page_shows_the_examples_code_as_it_is() -> None:
    """Every python block of docs/INTEGRATIONS.md is a piece of one of the examples (as written there, or
    indented one level, inside main()), so the page cannot drift from the files its tests run."""
    blocks = re.findall(r"^```python\n(.*?)^```", PAGE.read_text(), re.S | re.M)
    sources = [path.read_text() for path in EXAMPLES.values()]
    assert len(blocks) == 2
    for block in blocks:
        assert any(block in src or textwrap.indent(block, "    ") in src for src in sources), \
            f"this python block of INTEGRATIONS.md is in neither example:\n{block}"


def _run(argv: List[str], timeout: float = 120) -> str:
    program = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *argv]
    res = launch(program, timeout, rank_env())
    if res.returncode != 0:
        pytest.fail(f"{Path(argv[0]).name} exited {res.returncode}\n--- output of all ranks ---\n{res.output}")
    return res.output


def _summary(output: str) -> str:
    return next(line for line in output.splitlines() if re.match(r"\d+ steps", line))


@pytest.mark.multirank
@pytest.mark.timeout(300)
def test_the_lightning_example_trains_and_resumes(tmp_path: Path) -> None:
    out = tmp_path / "lit"
    first = _run([str(EXAMPLES["lightning"]), "--epochs", "1", "--out", str(out)])
    assert _summary(first).startswith("32 steps")   # 4096 / 2 ranks / 32 per batch / 2 accumulated
    assert "moved gradient_clip_val=1.0 into TopKQSGD" in first
    second = _run([str(EXAMPLES["lightning"]), "--epochs", "2", "--out", str(out),
                   "--resume", str(out / "checkpoints" / "last.ckpt")])
    assert _summary(second).startswith("64 steps (bytes of steps 33-64, counted since the resume at step 32)")


@pytest.mark.multirank
@pytest.mark.timeout(300)
def test_the_accelerate_example_trains_and_resumes(tmp_path: Path) -> None:
    first = _run([str(EXAMPLES["accelerate"]), "--epochs", "1", "--out", str(tmp_path / "a")])
    assert _summary(first).startswith("32 steps")
    assert "with AdamW: feedback 'frozen'" in first   # said by the compressor's attach(), as on Horovod
    second = _run([str(EXAMPLES["accelerate"]), "--epochs", "1", "--out", str(tmp_path / "b"),
                   "--resume", str(tmp_path / "a")])
    assert _summary(second).startswith("64 steps (bytes of steps 33-64, counted since the resume at step 32)")
