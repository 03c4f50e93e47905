# One-command set-up. Each target builds its own virtualenv from scratch if needed.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: venv test test-all test-upstream demo bench clean

$(VENV)/.installed: setup.cfg setup.py pyproject.toml hf_resumable/_fastcopy.c
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	# torch first, pinned: a bare `torch` requirement would pull a multi-GB CUDA build.
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e ".[test]"
	# DeepSpeed for the ZeRO engine tests, from its sdist without compiled ops (its CPU accelerator uses gloo).
	DS_BUILD_OPS=0 $(PIP) install --quiet "deepspeed==0.19.8"
	touch $@

venv: $(VENV)/.installed

# Lint, the package's doctests, then the suite: every guarantee at least once (what CI runs; 15-22 min of pytest on 2 cores, 2026-12-01/02).
test: venv
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -p no:cacheprovider --doctest-modules hf_resumable
	$(PY) -m pytest -q -m "not extended" tests

# Everything, including the further kill/restart variants marked `extended` (about twice as long).
test-all: venv
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -p no:cacheprovider --doctest-modules hf_resumable
	$(PY) -m pytest -q tests

# accelerate's own checkpointing tests against ResumableAccelerator (also part of `make test`).
test-upstream: venv
	$(PY) tests/upstream/run_accelerate_upstream.py

demo: venv
	$(VENV)/bin/hf-resumable demo

clean:
	rm -rf $(VENV) build dist *.egg-info
