"""Shared fixtures: global-state hygiene and tiny real transformers models."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

# Quiet, offline-safe defaults for every test process (subprocesses inherit them).
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# Under pytest-xdist (make test runs two workers on two cores) one intra-op thread each, not two apiece.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else min(2, torch.get_num_threads()))


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
    """Stop the zygotes that forked this session's test processes (tests/zygote.py)."""
    import zygote

    zygote.shutdown()
