# One-command set-up. Each target builds its own virtualenv from scratch if needed.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: venv test test-all test-gpu test-gpu-on-cpu test-upstream demo bench clean

$(VENV)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	# torch first, pinned: a bare `torch` requirement would pull a multi-GB CUDA build.
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e ".[test]"
	# DeepSpeed for the ZeRO engine tests, from its sdist without compiled ops (its CPU accelerator uses gloo).
	DS_BUILD_OPS=0 $(PIP) install --quiet "deepspeed==0.19.8"
	touch $@

venv: $(VENV)/.installed

# Lint, the package's doctests, then the suite in three tiers, fastest first: unit (in-process), process (kills and
# restarts of one process, servers), distributed (torch.distributed process groups). Every guarantee at least once;
# further kill/restart variants are marked `extended` and run by `make test-all`. This is what CI runs.
# Two pytest workers (a file at a time each) keep both cores busy while one test waits on its processes.
PYTEST := $(PY) -m pytest -q -p no:cacheprovider --durations=10
WORKERS ?= 2
XDIST := -n $(WORKERS) --dist loadfile
TIERS := "not slow and not distributed" "slow and not distributed" "distributed"
# `make test` runs the unit tier first (a broken build fails in about two minutes), then the process and distributed
# tiers in one pytest session: one start of the workers and one collection instead of two, and no idle worker
# between them.
TEST_TIERS := "not slow and not distributed" "slow or distributed"

test: venv
	$(VENV)/bin/ruff check .
	$(PYTEST) --doctest-modules hf_resumable
	@for tier in $(TEST_TIERS); do echo "== tests: $$tier (not extended)"; \
		$(PYTEST) $(XDIST) -m "($$tier) and not extended" tests || exit 1; done

# Everything, including the further kill/restart variants marked `extended` (about twice as long).
test-all: venv
	$(VENV)/bin/ruff check .
	$(PYTEST) --doctest-modules hf_resumable
	@for tier in $(TIERS); do echo "== tests: $$tier"; $(PYTEST) $(XDIST) -m "$$tier" tests || exit 1; done

# The CUDA tier (tests marked `gpu`, tests/test_gpu.py): without a CUDA device every test skips, saying why (so
# `make test` collects them and moves on). Plain interpreters (no test zygote: CUDA must not be set up before a
# fork) and cuBLAS's deterministic workspace. The whole GPU check, benchmarks included: benchmarks/gpu_check.sh.
test-gpu: venv
	HF_RESUMABLE_TEST_ZYGOTE=0 CUBLAS_WORKSPACE_CONFIG=:4096:8 $(PYTEST) -m gpu tests/test_gpu.py

# The same test bodies on the CPU (--device cpu, gloo for NCCL): a dry run of the GPU tier's harness.
test-gpu-on-cpu: venv
	HFR_GPU_TESTS_DEVICE=cpu $(PYTEST) -m gpu tests/test_gpu.py

# accelerate's own checkpointing tests against ResumableAccelerator (also part of `make test`).
test-upstream: venv
	$(PY) tests/upstream/run_accelerate_upstream.py

demo: venv
	$(VENV)/bin/hf-resumable demo

clean:
	rm -rf $(VENV) build dist *.egg-info
