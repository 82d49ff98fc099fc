# `make test` and `make demo` set everything up from nothing (venv, torch, the package).
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
# The CPU build on local disk; an unpinned torch pulls a multi-GB CUDA build.
TORCH   := torch==2.13.0
STAMP   := $(VENV)/.setup-done

.PHONY: setup test demo bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

test: setup
	$(BIN)/python -m pytest -q

demo: setup
	$(BIN)/python demos/tour.py

bench: setup
	$(BIN)/python benchmarks/overhead.py

clean:
	rm -rf $(VENV) build dist *.egg-info
