"""``hvdgc-bench``: the benchmark runs from a checkout of the repository, not from an installed package.

The benchmark (``benchmarks/``, ``make bench``) runs this repository's ``examples/`` and
writes its ``docs/``, so an installed package cannot carry it. ``hvdgc-bench`` finds the
checkout it was started in (the current directory or one above it) and runs
``python -m benchmarks`` there; elsewhere it says how to get one.

    $ hvdgc-bench --quick                  # inside a clone: same as python -m benchmarks --quick
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import List, Optional, Sequence

HOW = ("hvdgc-bench runs from a checkout of the hvd-gradcomp repository (it runs the repository's examples/ "
       "and writes its docs/): clone it, then run `make bench` (or `python -m benchmarks --quick`) inside it.")


def find_checkout(start: Path) -> Optional[Path]:
    """The nearest directory at or above ``start`` holding ``benchmarks/__main__.py`` and ``examples/train.py``."""
    for folder in (start, *start.parents):
        if (folder / "benchmarks" / "__main__.py").is_file() and (folder / "examples" / "train.py").is_file():
            return folder
    return None


def main(argv: Optional[Sequence[str]] = None) -> None:
    args: List[str] = list(sys.argv[1:] if argv is None else argv)
    root = find_checkout(Path.cwd())
    if root is None:
        sys.exit(f"hvdgc-bench: no checkout here ({Path.cwd()}). {HOW}")
    os.chdir(root)
    env_path = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    os.environ["PYTHONPATH"] = env_path
    os.execv(sys.executable, [sys.executable, "-m", "benchmarks", *args])


if __name__ == "__main__":
    main()
