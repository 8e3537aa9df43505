"""One 2-rank job of a check (:mod:`benchmarks.study.checks`): every rank calls the check's
``train`` with the job's arguments (JSON); rank 0 writes what it returns to the result file, a
``.jsonl`` file one line per record (appended: the runs of a check accumulate there), any other
one as JSON (replaced). ``study.py`` starts it (:func:`benchmarks.study.configs.check_job`), e.g.::

    horovodrun -np 2 -H localhost:2 --gloo python benchmarks/study/check_worker.py outside \\
        '{"opt": "adam", "wrapper": "gc", "setting": "tq1", "seed": 0, "steps": 20}' runs/outside.jsonl
"""
from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def write(path: Path, result: Any) -> None:
    """``result`` (a record or a list of them) into ``path``: appended as JSON lines to a ``.jsonl`` file,
    else as the file's JSON."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".jsonl":
        with path.open("a") as f:
            f.writelines(json.dumps(r) + "\n" for r in (result if isinstance(result, list) else [result]))
    else:
        path.write_text(json.dumps(result, indent=1) + "\n")


def main(check: str, job: str, result: str) -> int:
    import torch
    torch.set_num_threads(1)
    out = importlib.import_module(f"benchmarks.study.checks.{check}").train(**json.loads(job))
    if int(os.environ.get("HOROVOD_RANK", os.environ.get("RANK", "0"))) == 0:
        write(Path(result), out)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
