"""ResumableAccelerator as a drop-in for accelerate scripts: what stock accelerate scripts do must just work.

Each test is a loop shape or a call that stock ``accelerate`` scripts use, run against the one-line import change.
"""

from __future__ import annotations

import os

import pytest
import torch
from accelerate.state import AcceleratorState, GradientState

from hf_resumable.checkpoint import list_checkpoints, read_manifest
from hf_resumable.integrations.accelerate import ResumableAccelerator


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    """accelerate keeps process-wide singletons; every test starts from a clean one."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def reset_accelerate() -> None:
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def weights_of(accelerator, model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}


def same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def build_plain(tmp_path, **options):
    accelerator = ResumableAccelerator(cpu=True, checkpoint_dir=tmp_path, handle_preemption=False, **options)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = accelerator.prepare(model, optimizer)
    return accelerator, model, optimizer


def plain_step(accelerator, model, optimizer, seed: int) -> None:
    """accelerate's nlp_example shape: backward, step, zero_grad; no ``accumulate()``."""
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(seed))
    accelerator.backward(model(x).pow(2).mean())
    optimizer.step()
    optimizer.zero_grad()


# ------------------------------------------------------------------ item 1: steps are counted however the loop looks


def test_loop_without_accumulate_saves_every_step_and_resumes_the_newest(tmp_path):
    accelerator, model, optimizer = build_plain(tmp_path, keep_last=None)
    saved = {}
    for step in range(1, 7):
        plain_step(accelerator, model, optimizer, step)
        assert accelerator.global_step == step
        if step % 2 == 0:
            assert accelerator.save_state() == tmp_path / f"checkpoint-{step}"
            saved[step] = weights_of(accelerator, model)
    assert [step for step, _ in list_checkpoints(tmp_path)] == [2, 4, 6]
    assert [read_manifest(tmp_path / f"checkpoint-{s}").step for s in (2, 4, 6)] == [2, 4, 6]
    assert not same_weights(saved[2], saved[6])

    reset_accelerate()
    resumed, model2, optimizer2 = build_plain(tmp_path)
    assert resumed.load_state().step == 6
    assert resumed.global_step == 6
    assert same_weights(weights_of(resumed, model2), saved[6])
    plain_step(resumed, model2, optimizer2, 7)
    assert resumed.global_step == 7 and resumed.save_state() == tmp_path / "checkpoint-7"


def test_micro_steps_of_an_accumulation_window_are_not_optimizer_steps(tmp_path):
    accelerator = ResumableAccelerator(cpu=True, gradient_accumulation_steps=2, checkpoint_dir=tmp_path,
                                       handle_preemption=False)
    model = torch.nn.Linear(3, 1)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for micro in range(1, 6):
        with accelerator.accumulate(model):
            accelerator.backward(model(torch.ones(2, 3)).sum())
            optimizer.step()  # accelerate steps only on the window's last micro-batch
            optimizer.zero_grad()
        assert accelerator.global_step == micro // 2, micro


def test_step_skipped_by_the_grad_scaler_is_not_counted(tmp_path):
    accelerator = ResumableAccelerator(cpu=True, checkpoint_dir=tmp_path, handle_preemption=False)
    accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4)  # fp16 on a GPU would create one
    model = torch.nn.Linear(3, 1)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    accelerator.backward(model(torch.ones(2, 3)).sum() * float("inf"))  # overflow: the scaler skips this step
    optimizer.step()
    optimizer.zero_grad()
    assert optimizer.step_was_skipped and accelerator.global_step == 0
    accelerator.backward(model(torch.ones(2, 3)).sum())
    optimizer.step()
    optimizer.zero_grad()
    assert not optimizer.step_was_skipped and accelerator.global_step == 1


def test_second_save_of_the_same_step_writes_unless_the_state_is_provably_identical(tmp_path):
    accelerator, model, optimizer = build_plain(tmp_path)
    plain_step(accelerator, model, optimizer, 1)
    target = accelerator.save_state()
    manifest = os.stat(target / "manifest.json")
    assert accelerator.save_state() == target  # nothing changed: nothing written
    assert os.stat(target / "manifest.json").st_ino == manifest.st_ino

    with torch.no_grad():  # weights edited without an optimizer step (the step counter does not move)
        accelerator.unwrap_model(model).weight.add_(1.0)
    edited = weights_of(accelerator, model)
    assert accelerator.save_state() == target and accelerator.global_step == 1
    assert os.stat(target / "manifest.json").st_ino != manifest.st_ino  # replaced atomically

    torch.rand(1)  # the RNG moved: the checkpoint of this step must hold the new RNG state
    manifest = os.stat(target / "manifest.json")
    accelerator.save_state()
    assert os.stat(target / "manifest.json").st_ino != manifest.st_ino

    reset_accelerate()
    resumed, model2, _ = build_plain(tmp_path)
    resumed.load_state()
    assert same_weights(weights_of(resumed, model2), edited)
