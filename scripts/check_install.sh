#!/usr/bin/env bash
# What a DDP user gets from `pip install hvd-gradcomp`, checked in a new virtual environment
# that has torch and nothing else (no Horovod, no MPI), outside this checkout:
#   (a) `import hvd_gradcomp` works and `import horovod` does not;
#   (b) 2 DDP ranks (torchrun, Gloo) train with hvd_gradcomp.ddp.register(TopKQSGD) and end identical;
#   (c) hvd_gradcomp.DistributedOptimizer raises one ImportError naming 'hvd-gradcomp[horovod]';
#   (d) `hvdgc-launch --help` runs;
#   (e) site-packages holds hvd_gradcomp (with its Slurm templates) and no top-level `launchers`.
# The working tree (tracked and untracked files, not ignored ones) is copied and installed
# non-editable; everything lives in a temporary folder, removed at the end. About 1-2 minutes.
#
#   bash scripts/check_install.sh            # PYTHON=python3.11 HVDGC_TORCH=torch==2.13.0 by default
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
TORCH_SPEC="${HVDGC_TORCH:-torch==2.13.0}"
WORK="$(mktemp -d -t hvdgc-install-XXXXXX)"
trap 'rm -rf "$WORK"' EXIT
T0=$(date +%s)
log() { printf '[check_install %4ss] %s\n' "$(( $(date +%s) - T0 ))" "$*"; }
fail() { printf '[check_install] FAILED: %s\n' "$*" >&2; exit 1; }

log "new venv from $PY, $TORCH_SPEC only"
"$PY" -m venv "$WORK/venv"
V="$WORK/venv/bin"
"$V/pip" install -q "$TORCH_SPEC"

log "pip install . (a copy of the working tree, non-editable)"
mkdir "$WORK/src"
( cd "$ROOT" && git ls-files -z --cached --others --exclude-standard \
    | while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done \
    | tar --null -T - -cf - ) | tar -xf - -C "$WORK/src"
"$V/pip" install -q "$WORK/src"

cd "$WORK"   # not the checkout: every import below must come from site-packages
export OMP_NUM_THREADS=1

log "(a) import hvd_gradcomp without Horovod"
"$V/python" -c 'import hvd_gradcomp, sys; assert "site-packages" in hvd_gradcomp.__file__, hvd_gradcomp.__file__' \
  || fail "import hvd_gradcomp"
if "$V/python" -c 'import horovod' 2>/dev/null; then fail "horovod imports: the core must not pull it in"; fi

log "(b) 2 DDP ranks under torchrun with hvd_gradcomp.ddp.register(TopKQSGD)"
cat >"$WORK/ddp_check.py" <<'PY'
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import hvd_gradcomp as gc
from hvd_gradcomp import ddp as gc_ddp

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)))
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
state = gc_ddp.register(model, compression=gc.TopKQSGD(ratio=0.05, bits=8), optimizer=opt)
data = torch.Generator().manual_seed(1 + rank)       # each rank its own batches
for _ in range(5):
    x = torch.randn(32, 64, generator=data)
    y = torch.randint(0, 10, (32,), generator=data)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
every = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
dist.all_gather(every, flat)
assert all(torch.equal(every[0], f) for f in every), "ranks ended with different parameters"
assert state.comm_stats.bytes_out < state.comm_stats.bytes_in, state.comm_stats.summary()
if rank == 0:
    print("ranks identical;", state.comm_stats.summary())
dist.destroy_process_group()
PY
"$V/torchrun" --standalone --nproc-per-node 2 "$WORK/ddp_check.py" || fail "2-rank DDP training"

log "(c) hvd_gradcomp.DistributedOptimizer without Horovod"
"$V/python" - <<'PY' || fail "DistributedOptimizer's error"
import torch
import hvd_gradcomp as gc
try:
    gc.DistributedOptimizer(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1))
except ImportError as exc:
    assert "hvd-gradcomp[horovod]" in str(exc) and "C++17" in str(exc), exc
    print("ImportError:", exc)
else:
    raise SystemExit("no ImportError")
PY

log "(d) hvdgc-launch --help"
"$V/hvdgc-launch" --help >/dev/null || fail "hvdgc-launch --help"

log "(e) what site-packages holds"
"$V/python" - <<'PY' || fail "site-packages"
import importlib.util, pathlib, sysconfig
site = pathlib.Path(sysconfig.get_paths()["purelib"])
assert not (site / "launchers").exists() and importlib.util.find_spec("launchers") is None, "a top-level launchers"
assert sorted(p.name for p in (site / "hvd_gradcomp" / "launchers" / "slurm").glob("*.sbatch")), "no Slurm templates"
print("top level:", sorted(p.name for p in site.iterdir() if p.name.startswith(("hvd", "launch"))))
PY
log "all checks passed"
