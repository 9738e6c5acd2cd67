# Two entry points, each doing its own set-up on a fresh machine (see README):
#   make demo   -> install, then generate text with the demo model shipped in the package
#   make test   -> install with test extras, then run the test suite (what CI runs)
PYTHON ?= python3
PIP := $(PYTHON) -m pip
# A CPU build of torch by default: a bare `torch` requirement may pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
PROMPT ?= Once upon a time

.PHONY: setup setup-test demo test lint

setup:
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q --no-build-isolation -e .

setup-test: setup
	$(PIP) install -q -e ".[test]" --no-build-isolation

demo: setup
	$(PYTHON) -m graphrunner generate "$(PROMPT)"

test: setup-test
	$(PYTHON) -m pytest -q

lint:
	ruff check graphrunner model_states capture tests tools
