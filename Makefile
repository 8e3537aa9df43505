# Two commands do everything on a fresh Debian machine (root or sudo):
#   make demo   -- set up, then a 2-rank compressed training run with a summary
#   make test   -- set up, then the whole test suite (Gloo, MPI and a local Slurm)
VENV ?= .venv
PY := $(VENV)/bin/python
export OMPI_ALLOW_RUN_AS_ROOT ?= 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM ?= 1

.PHONY: setup demo test bench slurm-up clean

setup:
	@bash scripts/setup.sh

slurm-up: setup
	@bash scripts/slurm_up.sh

demo: setup
	@$(PY) examples/demo.py

test: setup slurm-up
	@$(VENV)/bin/pytest -ra --doctest-modules tests hvd_gradcomp launchers examples benchmarks

bench: setup
	@$(PY) -m benchmarks

clean:
	rm -rf $(VENV) build *.egg-info runs
