# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# No .pyc precompilation of every installed file: imports compile what they use (saves ~40 s).
PIP := $(BIN)/pip install --quiet --no-compile --disable-pip-version-check

.PHONY: demo test test-slow lint bench install

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/everyprompt demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

lint: $(STAMP)
	$(BIN)/ruff check src tests bench

bench: $(STAMP)
	$(PIP) -e ".[bench]"
	$(BIN)/python bench/algorithms.py
