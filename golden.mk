# Golden data for the model tests: tiny HF fixtures and transformers reference outputs.
# Included by the main Makefile; also usable alone: make -f golden.mk golden
#   golden-env  Python 3.11 venv at .venv-golden with CPU torch and pinned transformers
#   golden      regenerate tests/fixtures/* and tests/golden/* (a few minutes on 2 cores)

GOLDEN_VENV ?= .venv-golden
GOLDEN_PYTHON_BASE ?= $(or $(wildcard $(shell pyenv root 2>/dev/null)/versions/3.11.7/bin/python3),$(shell command -v python3.11))
GOLDEN_REQUIREMENTS := tests/golden/requirements-golden.txt

.PHONY: golden-env golden

golden-env: $(GOLDEN_VENV)/.installed

# The last step fails on a CUDA torch: it would run, but is gigabytes and not what the pins mean.
$(GOLDEN_VENV)/.installed: $(GOLDEN_REQUIREMENTS)
	test -x $(GOLDEN_VENV)/bin/python || $(GOLDEN_PYTHON_BASE) -m venv $(GOLDEN_VENV)
	$(GOLDEN_VENV)/bin/pip install -r $(GOLDEN_REQUIREMENTS)
	$(GOLDEN_VENV)/bin/python -c "import torch, sys; sys.exit(torch.version.cuda is not None)" \
		|| { echo "golden-env: expected a CPU-only torch build" >&2; exit 1; }
	touch $@

golden: golden-env
	$(GOLDEN_VENV)/bin/python tests/golden/make_golden.py
