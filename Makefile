# The two commands of the README. Both create .venv and install everything on a fresh machine.
#   make demo   run the main job on its built-in default
#   make test   lint and run the test suite
# Before you submit: make test-load (the suite on a fresh clone with one core busy; RUNS=3, TARGET=slow-test).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint slow-test test-load

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch first, pinned: a plain torch requirement would pull a multi-GB CUDA build.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/swarmtrain demo

lint: $(STAMP)
	$(BIN)/ruff check swarmtrain tests benchmarks
	$(BIN)/ruff format --check swarmtrain tests benchmarks

test: lint
	$(BIN)/python -m pytest

slow-test: $(STAMP)
	$(BIN)/python -m pytest -m slow

RUNS ?= 1
TARGET ?= test
test-load:
	RUNS=$(RUNS) TARGET=$(TARGET) bash .ci/test-load
