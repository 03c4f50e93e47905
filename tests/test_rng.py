"""The CUDA device count of an RNG state (hf_resumable/format/rng.py), checked on CPU.

A checkpoint holds one generator state per visible CUDA device; restoring it where another number of devices is
visible would not continue the run exactly. The pure check is tested directly, and a checkpoint whose RNG state
claims a CUDA device is refused on this CPU-only machine before anything (weights, optimizer, any generator) has
changed. The same refusal on a GPU machine, and the restore of every device's generator, are in tests/test_gpu.py.
"""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest
import torch

from hf_resumable.checkpoint import load_checkpoint, save_checkpoint
from hf_resumable.errors import InexactResumeError
from hf_resumable.format.rng import (
    RngState,
    capture_rng_state,
    check_cuda_device_count,
    cuda_device_mismatch,
    restore_rng_state,
    visible_cuda_devices,
)

from helpers.tiny_models import tiny_gpt2, train_steps


def _with_cuda_generators(count: int) -> RngState:
    """The current CPU generators plus ``count`` CUDA generator states (uint8, as ``torch.cuda.get_rng_state``)."""
    state = capture_rng_state()
    fake = [torch.arange(16, dtype=torch.uint8) + i for i in range(count)]
    return RngState(state.python, state.numpy, state.torch_cpu, fake)


@pytest.mark.parametrize(("saved", "visible", "refused"), [(0, 0, False), (2, 2, False), (1, 0, True),
                                                          (0, 1, True), (8, 4, True)])
def test_cuda_device_mismatch_is_a_pure_comparison(saved, visible, refused):
    problem = cuda_device_mismatch(saved, visible)
    assert (problem is not None) == refused
    if refused:
        assert f"saved with {saved} CUDA device(s) but {visible} are visible" in problem
    state = _with_cuda_generators(saved)
    if refused:
        with pytest.raises(InexactResumeError, match=r"checkpoint-7/rng: RNG state was saved with .*CUDA_VISIBLE"):
            check_cuda_device_count(state, visible=visible, source="checkpoint-7/rng")
    else:
        check_cuda_device_count(state, visible=visible)


def test_a_refused_restore_changes_no_generator():
    saved = _with_cuda_generators(visible_cuda_devices() + 1)
    random.random(), np.random.rand(), torch.rand(())  # the live streams move on from the saved ones
    before = capture_rng_state()
    with pytest.raises(InexactResumeError, match="allow_inexact_resume=True"):
        restore_rng_state(saved)
    assert capture_rng_state().equals(before)
    restore_rng_state(saved, allow_device_mismatch=True)  # the CPU generators only, with a warning
    assert random.getstate() == saved.python and torch.equal(torch.get_rng_state(), saved.torch_cpu)


def test_a_checkpoint_with_another_cuda_device_count_is_refused_before_anything_is_loaded(tmp_path, caplog):
    model = tiny_gpt2(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train_steps(model, optimizer, steps=2)
    path = tmp_path / "checkpoint-2"
    save_checkpoint(path, model=model, optimizer=optimizer, step=2, training_state={"global_step": 2},
                    rng=_with_cuda_generators(visible_cuda_devices() + 1))

    live = tiny_gpt2(seed=1)
    live_optimizer = torch.optim.AdamW(live.parameters(), lr=1e-3)
    train_steps(live, live_optimizer, steps=1, seed=1)
    weights, moments, rng = (copy.deepcopy(live.state_dict()), copy.deepcopy(live_optimizer.state_dict()),
                             capture_rng_state())
    with pytest.raises(InexactResumeError, match=r"checkpoint-2: RNG state was saved with \d+ CUDA device\(s\)"):
        load_checkpoint(path, model=live, optimizer=live_optimizer)
    assert all(torch.equal(v, weights[k]) for k, v in live.state_dict().items()), "refused, but weights changed"
    assert live_optimizer.state_dict()["state"][0]["step"] == moments["state"][0]["step"]
    assert capture_rng_state().equals(rng)

    with caplog.at_level("WARNING"):
        loaded = load_checkpoint(path, model=live, optimizer=live_optimizer, allow_inexact_resume=True)
    assert loaded.step == 2 and "NOT bit-exact" in caplog.text
    assert all(torch.equal(v, p) for v, p in zip(live.state_dict().values(), model.state_dict().values()))
