# Two commands do everything on a fresh Debian machine (root or sudo):
#   make demo   -- set up, then a 2-rank compressed training run with a summary
#   make test   -- set up, then the whole test suite (Gloo, MPI, a local Slurm and two hosts:
#                  network namespaces hvdgc-a/hvdgc-b with ssh and a two-node Slurm, torn
#                  down again by the tests' session fixture)
VENV ?= .venv
PY := $(VENV)/bin/python
export OMPI_ALLOW_RUN_AS_ROOT ?= 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM ?= 1

.PHONY: setup demo test bench study slurm-up two-hosts-up two-hosts-down clean

setup:
	@bash scripts/setup.sh

slurm-up: setup
	@bash scripts/slurm_up.sh

two-hosts-up: slurm-up
	@bash scripts/two_hosts.sh up

two-hosts-down:
	@bash scripts/two_hosts.sh down

demo: setup
	@$(PY) examples/demo.py

test: setup slurm-up two-hosts-up
	@$(VENV)/bin/pytest -ra --doctest-modules tests hvd_gradcomp examples benchmarks

bench: setup
	@$(PY) -m benchmarks

# Compressed vs uncompressed training, 6 tasks x 3 seeds x 8+ settings on 2 ranks -> docs/STUDY.md
study: setup
	@$(PY) benchmarks/study/study.py

clean:
	rm -rf $(VENV) build *.egg-info runs
