# The two commands of the README:
#   make demo   set up .venv and run the demo (dump and load a locally built model, timed
#               against torch.load and safetensors)
#   make test   set up .venv and run everything CI runs: ruff (lint + format check), mypy, pytest
#
# Every pip step passes constraints.txt: it pins the CPU build of torch.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: setup demo test lint typecheck pytest bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	PIP_CONSTRAINT=$(CURDIR)/constraints.txt $(PIP) install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/zerocopy-pickle demo

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

pytest: $(STAMP)
	$(PY) -m pytest

test: lint typecheck pytest

bench: $(STAMP)
	$(PY) benchmarks/snapshot.py

clean:
	rm -rf $(VENV) build *.egg-info
