# Two commands do everything on a fresh Debian machine (root or sudo):
#   make demo   -- set up, then a 2-rank compressed training run with a summary
#   make test   -- set up, ruff, then the whole test suite (Gloo, MPI, a local Slurm and two
#                  hosts: network namespaces hvdgc-a/hvdgc-b with ssh and a two-node Slurm,
#                  torn down again by the tests' session fixture)
# and two quick ones, as any user once Open MPI is installed (setup needs root only for that):
#   make unit   -- the tests that start no ranks, MPI, Slurm or namespaces (about 2 minutes)
#   make lint   -- ruff check, with the rules in pyproject.toml
# docs/INSTALL.md: pip install without make (DDP users need no Horovod).
VENV ?= .venv
PY := $(VENV)/bin/python
export OMPI_ALLOW_RUN_AS_ROOT ?= 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM ?= 1

.PHONY: setup demo test unit lint bench study slurm-up two-hosts-up two-hosts-down clean

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

test: setup lint slurm-up two-hosts-up
	@$(VENV)/bin/pytest -ra --doctest-modules tests hvd_gradcomp examples benchmarks

# `make test`'s tests less these markers; tests.unit_guard fails a test that starts a launcher,
# MPI, Slurm or a network namespace without its marker.
UNIT_MARKERS := not multirank and not slurm and not two_hosts and not slow
unit: setup
	@$(PY) -m pytest -q -p tests.unit_guard -m "$(UNIT_MARKERS)" --doctest-modules tests hvd_gradcomp benchmarks/tests

lint: setup
	@$(VENV)/bin/ruff check .

bench: setup
	@$(PY) -m benchmarks

# Compressed vs uncompressed training, 6 tasks x 3 seeds x 8+ settings on 2 ranks -> benchmarks/results/STUDY.md
study: setup
	@$(PY) benchmarks/study/study.py

clean:
	rm -rf $(VENV) build *.egg-info runs
