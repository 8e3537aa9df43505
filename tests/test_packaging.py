"""Packaging: pyproject.toml is the one list of dependencies, Horovod is an extra that only the
Horovod roads ask for, and ``pip install`` puts nothing but ``hvd_gradcomp`` in site-packages.
The wheel is the library, ``hvdgc-launch`` and its Slurm scripts: the benchmarks (``benchmarks/``,
``python -m benchmarks``) and the test beds run from a checkout, and the library's tests (``tests/``)
import none of them.

The slow test installs the working tree into a new virtual environment that has torch and
nothing else (``scripts/check_install.sh``) and trains 2 DDP ranks there.
"""
from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:   # Python < 3.11
    tomllib = None

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hvd_gradcomp"


def _pyproject() -> dict:
    if tomllib is None:
        pytest.skip("tomllib needs Python >= 3.11")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _names(requirements: list) -> set:
    return {re.split(r"[\s<>=!~;\[]", r, maxsplit=1)[0].lower() for r in requirements}


def test_horovod_is_an_extra_and_every_core_dependency_is_imported() -> None:
    project = _pyproject()["project"]
    core = _names(project["dependencies"])
    assert "horovod" not in core and "mpi4py" not in core
    assert project["optional-dependencies"]["horovod"] == ["horovod==0.28.1"]
    sources = "\n".join(p.read_text() for p in PACKAGE.rglob("*.py"))
    imported = {"torch": "import torch", "click": "import click", "psutil": "import psutil",
                "tqdm": "from tqdm import", "numpy": ".numpy()"}
    for name in core:
        assert imported[name] in sources, f"{name} is a core dependency that hvd_gradcomp never uses"


def test_setup_script_installs_from_pyproject_not_a_list_of_its_own() -> None:
    script = (ROOT / "scripts" / "setup.sh").read_text()
    assert "-e \".[dev,horovod]\"" in script and "--no-deps -e" not in script
    for name in ("click", "tqdm", "pytest", "hypothesis", "matplotlib", "scikit-learn", "mpi4py"):
        assert not re.search(rf"pip\" install[^\n]*\b{name}\b", script), f"setup.sh installs {name} itself"
    assert "pyproject.toml" in script.split("want=")[1].splitlines()[0], "the stamp must hash pyproject.toml"


def test_entry_points_and_package_data_point_into_the_package() -> None:
    project = _pyproject()
    for target in project["project"]["scripts"].values():
        module = target.split(":")[0]
        assert module.startswith("hvd_gradcomp.launchers."), target
        assert (ROOT / (module.replace(".", "/") + ".py")).is_file(), target
    assert project["tool"]["setuptools"]["packages"]["find"]["include"] == ["hvd_gradcomp", "hvd_gradcomp.*"]
    pattern = project["tool"]["setuptools"]["package-data"]["hvd_gradcomp.launchers"][0]
    assert sorted((PACKAGE / "launchers").glob(pattern)), pattern
    assert not (ROOT / "launchers").exists() and not (ROOT / "setup.cfg").exists()


def test_the_wheel_is_the_library_the_launcher_and_its_slurm_scripts(tmp_path: Path) -> None:
    """Built (``pip wheel --no-build-isolation``: no download) from a copy of what it is made of, the
    wheel holds ``hvd_gradcomp`` and its metadata, one console script (``hvdgc-launch``) and the
    Slurm scripts beside the launcher; nothing of ``benchmarks/``, ``tests/`` or ``scripts/``."""
    pytest.importorskip("setuptools")
    src = tmp_path / "src"
    shutil.copytree(PACKAGE, src / "hvd_gradcomp", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    (wheel,) = (tmp_path / "dist").glob("hvd_gradcomp-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/RECORD"))
    assert {n.split("/")[0] for n in names} == {"hvd_gradcomp", info}, names
    sources = sorted(p.relative_to(ROOT).as_posix() for p in PACKAGE.rglob("*.py"))
    assert sorted(n for n in names if n.endswith(".py")) == sources
    assert sorted(n for n in names if n.endswith(".sbatch")) == sorted(
        p.relative_to(ROOT).as_posix() for p in (PACKAGE / "launchers" / "slurm").glob("*.sbatch")) != []
    entry_points = zipfile.ZipFile(wheel).read(f"{info}/entry_points.txt").decode()
    assert entry_points.split() == ["[console_scripts]", "hvdgc-launch", "=", "hvd_gradcomp.launchers.cli:main"]


def test_neither_the_library_nor_its_tests_import_the_benchmarks() -> None:
    """benchmarks/ is a product of its own: it imports the library, never the reverse; what the
    library's tests share with it lives in the library or in tests/."""
    for path in sorted([*PACKAGE.rglob("*.py"), *(ROOT / "tests").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            assert not any(n.split(".")[0] == "benchmarks" for n in names), \
                f"{path.relative_to(ROOT)} imports {names}"


def test_the_library_imports_no_launcher() -> None:
    """The launchers sit on top of the library (they read hvd_gradcomp.config); never the reverse."""
    for path in sorted(PACKAGE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ("." * node.level) + (node.module or "")
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            assert not any(n.lstrip(".").split(".")[0] == "launchers" or n.startswith("hvd_gradcomp.launchers")
                           for n in names), f"hvd_gradcomp/{path.name} imports a launcher: {names}"


def test_without_horovod_only_the_horovod_road_fails_and_names_the_extra() -> None:
    """Horovod is hidden (``sys.modules['horovod'] = None``): the compressors and the DDP hook
    load, and hvd_gradcomp.DistributedOptimizer raises one ImportError naming the extra."""
    code = """
import sys
sys.modules["horovod"] = None
import torch
import hvd_gradcomp as gc
from hvd_gradcomp import ddp
gc.TopKQSGD(ratio=0.01, bits=8); gc.QSGD(bits=8); gc.TopK(ratio=0.01); ddp.register
try:
    gc.DistributedOptimizer(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1))
except ImportError as exc:
    assert exc.__cause__ is None and exc.__suppress_context__, "one error, not a chain"
    print(exc)
"""
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == (
        "hvd_gradcomp.DistributedOptimizer needs Horovod: pip install 'hvd-gradcomp[horovod]' (on torch >= 2.1 "
        "Horovod 0.28.1 must be built with C++17: see docs/INSTALL.md or scripts/setup.sh)")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_pip_install_into_a_venv_with_only_torch_serves_ddp_without_horovod() -> None:
    """scripts/check_install.sh: (a) import without Horovod, (b) 2 DDP ranks end identical,
    (c) the one ImportError, (d) hvdgc-launch --help, (e) no top-level ``launchers``."""
    base = getattr(sys, "_base_executable", sys.executable)   # not this venv's Python: it has Horovod
    env = {**os.environ, "PYTHON": base}
    env.pop("PYTHONPATH", None)
    res = subprocess.run(["bash", str(ROOT / "scripts" / "check_install.sh")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=580)
    assert res.returncode == 0, f"{res.stdout}\n{res.stderr}"
    for check in ("(a)", "(b)", "(c)", "(d)", "(e)", "all checks passed"):
        assert check in res.stdout, res.stdout
    assert "ranks identical" in res.stdout and "hvd-gradcomp[horovod]" in res.stdout
