# The two commands of the README:
#   make demo   set up .venv and run the demo: the model cache serving a locally built ControlNet pipeline,
#               timed against plain from_pretrained
#   make test   set up .venv (with stable-fast, built from source) and run everything CI runs: ruff (lint +
#               format check), lint-imports (import layers), mypy, pytest (the whole suite, in parallel)
#   make test-fast  the edit-run loop: the tests not marked slow, in parallel; no lint, no type check
#
# Every pip step passes constraints.txt: it pins the CPU build of torch.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# pip's output with this machine's package mirrors names every mirror folder a package is not in ("WARNING:
# Location 'file:///...' is ignored: it is neither a file nor a directory."), dozens of lines per install that
# say nothing about this project: drop exactly those, keep every other line and pip's exit status.
SHELL  := /bin/bash
.SHELLFLAGS := -o pipefail -c
QUIETPIP := 2>&1 | { grep -v "' is ignored: it is neither a file nor a directory" || true; }
STAMP  := $(VENV)/.installed
TESTSTAMP := $(VENV)/.installed-test
DEMOSTAMP := $(VENV)/.installed-demo

.PHONY: setup setup-test demo docs test test-fast lint typecheck pytest bench clean

setup: $(STAMP)

setup-test: $(TESTSTAMP)

# setuptools' note on every editable install that uses an import hook (ours does: quirks/ installs as
# zerocopy_pickle_quirks) says nothing about this project either: that one warning is ignored, by its message.
INSTALL := PYTHONWARNINGS="ignore:Editable installation.:UserWarning" PIP_CONSTRAINT=$(CURDIR)/constraints.txt \
	$(PIP) install --quiet -c constraints.txt

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	@$(PIP) install --quiet --upgrade pip $(QUIETPIP)

$(STAMP): pyproject.toml constraints.txt $(VENV)/bin/python
	@echo "installing zerocopy-pickle with its [dev] extra into $(VENV) (torch pinned by constraints.txt) ..."
	@$(INSTALL) -e '.[dev]' $(QUIETPIP)
	touch $(STAMP) $(DEMOSTAMP)

# The demo needs only the [demo] extra (the libraries the cache patches, safetensors): a fraction of [dev]'s
# download and install time on a fresh machine. A venv set up for the tests has it already.
$(DEMOSTAMP): pyproject.toml constraints.txt $(VENV)/bin/python
	@echo "installing zerocopy-pickle with its [demo] extra into $(VENV) (torch pinned by constraints.txt) ..."
	@$(INSTALL) -e '.[demo]' $(QUIETPIP)
	touch $(DEMOSTAMP)

$(TESTSTAMP): $(STAMP)
# stable-fast, for the stable-fast quirk's tests: an sdist that compiles against the installed torch, so
# without build isolation (its build tools first) and CPU-only. pip's wheel cache keeps the build (minutes)
# to the first setup of a machine; after changing the torch pin, run `$(PIP) cache remove stable_fast`.
	@echo "building stable-fast 1.0.5 (CPU-only) for the stable-fast quirk's tests: minutes the first time ..."
	@PIP_CONSTRAINT=$(CURDIR)/constraints.txt $(PIP) install --quiet -c constraints.txt setuptools wheel ninja \
		$(QUIETPIP)
	@PIP_CONSTRAINT=$(CURDIR)/constraints.txt WITH_CUDA=0 $(PIP) install --quiet --no-build-isolation \
		-c constraints.txt stable-fast==1.0.5 $(QUIETPIP)
	touch $(TESTSTAMP)

demo: $(DEMOSTAMP)
	$(VENV)/bin/zerocopy-pickle demo

# The documentation site (mkdocs-material, API reference from the docstrings) into site/; --strict turns a broken
# link, a missing anchor or a page left out of the nav into an error. The test suite builds it the same way
# (tests/test_docs.py), so `make test` fails on what fails here.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict  # the variable drops mkdocs-material's end-of-life banner

lint: $(TESTSTAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports  # the layers of docs/design.md, no cycles, quirks on the public API ([tool.importlinter])

typecheck: $(TESTSTAMP)
	$(VENV)/bin/mypy

# The suite runs in pytest-xdist's worker processes, handed out test by test (worksteal: a worker that runs dry
# takes half of another's queue). Four workers on any machine: most tests wait on the interpreters, servers and
# workers they start, so more workers than this VM's two cores pays (docs/contributing.md). Every worker starts on
# its share of the tests marked slow (tests/conftest.py).
# The suite starts some 370 interpreters: bytecode is written (into the checkout's ignored __pycache__ folders) even
# where the environment sets PYTHONDONTWRITEBYTECODE, or each of them compiles the library again (0.35 s of CPU).
PYTEST_WORKERS ?= 4
PARALLEL := -n $(PYTEST_WORKERS) --dist worksteal
PYTEST_ENV := env -u PYTHONDONTWRITEBYTECODE ZEROCOPY_PICKLE_STRICT_SKIPS=1

pytest: $(TESTSTAMP)
	$(PYTEST_ENV) $(PY) -m pytest $(PARALLEL)

test-fast: $(TESTSTAMP)
	$(PYTEST_ENV) $(PY) -m pytest $(PARALLEL) -m "not slow" -q

test: lint typecheck pytest

bench: $(STAMP)
	$(PY) benchmarks/snapshot.py
	$(PY) benchmarks/dump.py
	$(PY) benchmarks/semantics.py --cases sd,gpt,sd100k --repeat 7

clean:
	rm -rf $(VENV) build site *.egg-info
