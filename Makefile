# make run   : create the virtualenv, install, fetch the default model, start the OpenAI-compatible server
# make test  : the same setup, then the whole test suite (CPU only)
# make demo  : one chat answer from the default model
# The interpreter for the virtualenv: PYTHON=... overrides; otherwise .ci/find-python picks one,
# run once and only when a recipe needs it (so `make clean` never searches).
ifndef PYTHON
PYTHON = $(eval PYTHON := $(shell .ci/find-python))$(PYTHON)
endif
VENV ?= .venv
BIN := $(VENV)/bin
MODEL ?= smollm2-135m-instruct
PROMPT ?= What is the capital of France?
PYTEST_ARGS ?=

.PHONY: install model run demo test clean

$(BIN)/.installed: pyproject.toml constraints.txt
	@test -n "$(PYTHON)"  # empty: .ci/find-python found none and said what to install
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 12), "jaxinfer needs Python >= 3.12; set PYTHON=/path/to/python3.12"'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[test,ray]'
	touch $@

install: $(BIN)/.installed

model: install
	$(BIN)/jaxinfer fetch --model $(MODEL)

HOST ?= 127.0.0.1
PORT ?= 8000

run: model
	$(BIN)/python server.py --model $(MODEL) --host $(HOST) --port $(PORT)

demo: model
	$(BIN)/jaxinfer generate --model $(MODEL) --chat --prompt "$(PROMPT)" --max-tokens 64

# The suite on TEST_WORKERS pytest processes (pytest-xdist), each taking whole test files so a
# module's fixtures (a loaded model, a started server) are built once. One process kept one of
# the two cores idle: the suite's CPU time was its wall time (~56 min on 2 cores). TEST_WORKERS=0
# runs in this process (PYTEST_ARGS: a file, -k, ... to run less). A process used to die ~1,150
# tests in once it ran out of memory mappings (vm.max_map_count); tests/map_budget.py now frees
# compiled programs first (docs/crash_investigation.md). The 25 slowest tests close every run's
# log: the suite must stay under 30 minutes on 2 cores.
TEST_WORKERS ?= 2
test: model
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25 $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .cache

-include golden.mk
