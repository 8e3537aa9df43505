#!/usr/bin/env bash
# One set-up for `make demo`, `make test` and `make unit`: Open MPI, .venv, torch, Horovod 0.28.1
# built from source (patched for PyTorch >= 2.1), then this package with its dependencies as
# pyproject.toml declares them (`pip install -e '.[dev,horovod]'`: no second list here).
# Root (or sudo) is needed only to install Open MPI when mpicc/mpirun are missing.
# Idempotent: a second run checks a stamp and returns in seconds.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${HVDGC_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
HOROVOD_VERSION="0.28.1"
TORCH_SPEC="${HVDGC_TORCH:-torch==2.13.0}"
CACHE="${HVDGC_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hvd-gradcomp}"
T0=$(date +%s)

log() { printf '[setup %4ss] %s\n' "$(( $(date +%s) - T0 ))" "$*"; }
die() { printf '[setup] ERROR: %s\n' "$*" >&2; exit 1; }

# ---------------------------------------------------------------- Open MPI
ensure_mpi() {
  if command -v mpirun >/dev/null 2>&1 && command -v mpicc >/dev/null 2>&1; then
    return
  fi
  if [ "$(id -u)" -ne 0 ] && ! sudo -n true 2>/dev/null; then
    die "no MPI found (mpirun/mpicc not on PATH) and not root.
  Install Open MPI first, e.g.:  sudo apt-get install -y libopenmpi-dev openmpi-bin
  (or load your cluster's MPI module), then run this again."
  fi
  local SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo -n"
  log "installing Open MPI from Debian (libopenmpi-dev openmpi-bin)"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libopenmpi-dev openmpi-bin >/dev/null
}

# ---------------------------------------------------------------- venv + torch
ensure_venv() {
  if [ ! -x "$VENV/bin/python" ]; then
    log "creating virtual environment $VENV"
    "$PY" -m venv "$VENV"
  fi
  # First and pinned: pyproject's torch>=2.1 then installs nothing more (unpinned, pip would
  # take PyPI's newest, a CUDA build of several GB).
  if ! "$VENV/bin/python" -c 'import torch' 2>/dev/null; then
    log "installing $TORCH_SPEC"
    "$VENV/bin/pip" install -q "$TORCH_SPEC"
  fi
}

# ---------------------------------------------------------------- Horovod
horovod_ok() {
  "$VENV/bin/python" - <<'PY' 2>/dev/null
import horovod, horovod.torch as hvd
assert horovod.__version__ == "0.28.1"
assert hvd.mpi_built() and hvd.gloo_built()
PY
}

build_horovod() {
  local torch_v py_v key wheel_dir
  torch_v=$("$VENV/bin/python" -c 'import torch; print(torch.__version__)')
  py_v=$("$VENV/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  # Defaults for a CPU build; any HOROVOD_* the user set (e.g. HOROVOD_GPU_OPERATIONS=NCCL)
  # passes through and becomes part of the cache key.
  export HOROVOD_WITH_PYTORCH="${HOROVOD_WITH_PYTORCH:-1}"
  export HOROVOD_WITHOUT_TENSORFLOW="${HOROVOD_WITHOUT_TENSORFLOW:-1}"
  export HOROVOD_WITHOUT_MXNET="${HOROVOD_WITHOUT_MXNET:-1}"
  export HOROVOD_WITH_MPI="${HOROVOD_WITH_MPI:-1}"
  export HOROVOD_WITH_GLOO="${HOROVOD_WITH_GLOO:-1}"
  local flags; flags=$(env | grep '^HOROVOD_' | sort | sha1sum | cut -c1-10)
  key="horovod-${HOROVOD_VERSION}_torch-${torch_v}_py-${py_v}_${flags}"
  wheel_dir="$CACHE/wheels/$key"
  if ! ls "$wheel_dir"/horovod-*.whl >/dev/null 2>&1; then
    local work; work=$(mktemp -d)
    local blog="$CACHE/build-$key.log"
    mkdir -p "$CACHE" "$wheel_dir"
    log "building Horovod $HOROVOD_VERSION from source for torch $torch_v (about 7-10 min on 2 cores)"
    log "  log: $blog"
    "$VENV/bin/pip" download -q --no-deps --no-binary :all: -d "$work" "horovod==$HOROVOD_VERSION"
    tar -xzf "$work"/horovod-*.tar.gz -C "$work"
    local src; src=$(ls -d "$work"/horovod-*/)
    # PyTorch >= 2.1 headers need C++17; 0.28.1 pins 14 (upstream PR #3998, never released).
    sed -i 's/CMAKE_CXX_STANDARD 14/CMAKE_CXX_STANDARD 17/' "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
    grep -q 'CMAKE_CXX_STANDARD 17' "$src/horovod/torch/CMakeLists.txt" || die "C++17 patch did not apply"
    ( cd "$src" && MAKEFLAGS="-j$(nproc)" "$VENV/bin/pip" wheel -v --no-build-isolation --no-deps -w "$wheel_dir" . ) >"$blog" 2>&1 &
    local pid=$! stage
    while kill -0 "$pid" 2>/dev/null; do
      sleep 20
      stage=$(grep -oE '\[ *[0-9]+%\][^/]*' "$blog" | tail -1 || true)
      log "  building Horovod... ${stage:-configuring}"
    done
    if ! wait "$pid"; then
      tail -40 "$blog" >&2
      rm -rf "$wheel_dir"
      die "Horovod build failed (full log: $blog). Try: check that mpicc, cmake and g++ are installed;
  that torch imports in $VENV; remove $CACHE and run again."
    fi
    rm -rf "$work"
    log "Horovod wheel cached in $wheel_dir"
  fi
  "$VENV/bin/pip" install -q --no-deps --force-reinstall "$wheel_dir"/horovod-*.whl
}

ensure_horovod() {
  if horovod_ok; then return; fi
  # Horovod's setup.py runs in this venv (--no-build-isolation, so that it builds against this
  # torch) and imports these while it builds; the cached wheel is installed --no-deps and needs
  # the last four at run time. They are Horovod's requirements, not hvd-gradcomp's.
  log "installing Horovod's build requirements"
  "$VENV/bin/pip" install -q setuptools wheel cffi numpy cloudpickle psutil pyyaml packaging
  build_horovod
  horovod_ok || die "Horovod installed but does not import with MPI and Gloo; see 'horovodrun --check-build'"
  "$VENV/bin/horovodrun" --check-build
}

# ---------------------------------------------------------------- this package
install_package() {
  # With dependencies, from pyproject.toml: Horovod 0.28.1 is already installed (the patched
  # wheel above), so the [horovod] extra's pin is checked and nothing is built again.
  log "installing hvd-gradcomp (editable) with pyproject.toml's dependencies: .[dev,horovod]"
  "$VENV/bin/pip" install -q -e ".[dev,horovod]"
}

# ---------------------------------------------------------------- main
STAMP="$VENV/.hvdgc-setup"
want=$( { cat scripts/setup.sh pyproject.toml; } | sha1sum | cut -c1-16)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && command -v mpirun >/dev/null && horovod_ok; then
  log "environment up to date ($VENV)"
  exit 0
fi
ensure_mpi
ensure_venv
ensure_horovod
install_package
echo "$want" >"$STAMP"
log "done"
