"""Shared fixtures: global-state hygiene and tiny real transformers models."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

# The helpers' own asserts (assert_identical, assert_same_run, ...) report their operands as a test module's do.
pytest.register_assert_rewrite("helpers")

from helpers.distributed_launch import shared_env  # noqa: E402

# Quiet, offline-safe defaults for every test process (subprocesses inherit them).
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# One intra-op thread in every test process and every process a test starts (they inherit the variable): the tests
# train tiny models, where a second thread only adds synchronisation, and the suite runs two pytest workers and their
# torchrun ranks on two cores, where threads that spin-wait for a core another process holds make a step 10-30x
# slower. A test that wants more threads sets them itself.
# Every process a test starts can also import the repository (its scripts, hf_resumable from this tree) and writes
# its output unbuffered. Set once here, so that most test processes share one environment and so one test zygote
# (tests/helpers/zygote.py keeps a preloaded interpreter per environment).
os.environ.update(shared_env(os.environ))
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(autouse=True)
def _restore_global_state():
    """Tests may seed or change global RNGs and the default dtype; put everything back."""
    saved = (random.getstate(), np.random.get_state(), torch.get_rng_state(), torch.get_default_dtype())
    yield
    random.setstate(saved[0])
    np.random.set_state(saved[1])
    torch.set_rng_state(saved[2])
    torch.set_default_dtype(saved[3])


def pytest_sessionfinish(session, exitstatus):
    """Stop the zygotes that forked this session's test processes (tests/helpers/zygote.py)."""
    from helpers import zygote

    zygote.shutdown()
