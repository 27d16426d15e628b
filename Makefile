# Two commands keep working on a fresh machine: `make demo` and `make test`.
#
# They share one venv with one stamp per install: `make demo` installs the core package only (everything the
# demo runs: convert, inspect, validate, infer on the CPU), `make test` the [dev] extra on top (pytest, torch,
# transformers, gguf, hypothesis). Either order works, and editing pyproject.toml or the converter's C loops
# (colibri_format/convert/_native.c, which the install compiles) reinstalls on the next run.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
CORE_STAMP := $(VENV)/.installed-core
DEV_STAMP  := $(VENV)/.installed-dev

.PHONY: demo test install install-dev clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(CORE_STAMP): pyproject.toml colibri_format/convert/_native.c | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e .
	touch $@

$(DEV_STAMP): pyproject.toml colibri_format/convert/_native.c | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $@

install: $(CORE_STAMP)

install-dev: $(DEV_STAMP)

# The suite on up to 4 cores (pytest-xdist; worksteal: a worker that runs dry takes tests queued on another).
# `-n logical`, not `-n auto`: auto counts physical cores once psutil is installed (any dependency may pull it in),
# which is one worker on a 2-vCPU VM of one hyperthreaded core; logical counts logical CPUs (without psutil, the
# ones this process may run on: sched_getaffinity). PYTEST_XDIST_AUTO_NUM_WORKERS=N overrides the count.
# One process: `.venv/bin/python -m pytest -q -p no:xdist` (or `-n 0`). The GPU suite (benchmarks/gpu_suite.sh)
# runs serially.
test: $(DEV_STAMP)
	$(BIN)/python -m pytest -q -n logical --maxprocesses 4 --dist worksteal

demo: $(CORE_STAMP)
	$(BIN)/python tools/demo.py

clean:
	rm -rf $(VENV) demo-out .pytest_cache
