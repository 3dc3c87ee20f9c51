# make run   : create the virtualenv, install, fetch the default model, start the OpenAI-compatible server
# make test  : the same setup, then the whole test suite (CPU only)
# make demo  : one chat answer from the default model
PYTHON ?= python3.12
VENV ?= .venv
BIN := $(VENV)/bin
MODEL ?= smollm2-135m-instruct
PROMPT ?= What is the capital of France?
PYTEST_ARGS ?=

.PHONY: install model run demo test clean

$(BIN)/.installed: pyproject.toml constraints.txt
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 12), "jaxinfer needs Python >= 3.12; set PYTHON=/path/to/python3.12"'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[test,server,ray]'
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

test: model
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .cache

-include golden.mk
