"""Open once, fill later (issue 14 item 1): one verification and one decode per resume."""

from __future__ import annotations

import logging
import random

import numpy as np
import pytest
import torch

import hf_resumable
import hf_resumable.checkpoint.api as api
from hf_resumable import data
from hf_resumable.checkpoint import (
    LoadedCheckpoint,
    OpenedCheckpoint,
    load_checkpoint,
    open_checkpoint,
    read_manifest,
    save_checkpoint,
)
from hf_resumable.checkpoint.commit.manifest import Manifest
from hf_resumable.checkpoint.state import _validate
from hf_resumable.errors import ConfigDriftError, IncompleteCheckpointError, InexactResumeError
from hf_resumable.format.rng import capture_rng_state

from helpers.tiny_models import assert_same_optimizer, assert_same_state, tiny_gpt2, train_steps


def _setup(seed):
    model = tiny_gpt2(seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.5, total_iters=4)
    return model, optimizer, scheduler


@pytest.fixture
def saved(tmp_path):
    model, optimizer, scheduler = _setup(0)
    train_steps(model, optimizer, scheduler, steps=2)
    path = tmp_path / "checkpoint-2"
    save_checkpoint(path, model=model, optimizer=optimizer, scheduler=scheduler, step=2,
                    training_state={"global_step": 2}, extra={"note": "x"},
                    data_state={"kind": "map", "epoch": 0, "step": 2, "num_batches": 5})
    draws = (random.random(), np.random.rand(), torch.rand(2))
    return path, (model, optimizer, scheduler), draws


def test_open_decodes_once_and_touches_nothing(saved):
    path, _, _ = saved
    rng = capture_rng_state()
    opened = open_checkpoint(path)
    assert isinstance(opened, OpenedCheckpoint) and isinstance(opened, LoadedCheckpoint)
    assert opened.step == 2 and opened.training_state == {"global_step": 2} and opened.extra == {"note": "x"}
    assert opened.data_state == {"kind": "map", "epoch": 0, "step": 2, "num_batches": 5}
    assert opened.rng_state is not None
    assert capture_rng_state().equals(rng)  # opening restores nothing


def test_fill_later_equals_load_checkpoint_with_one_verification(saved, monkeypatch):
    path, (model, optimizer, scheduler), draws = saved
    calls = []
    verify = api.verify_checkpoint
    monkeypatch.setattr(api, "verify_checkpoint", lambda *a, **k: calls.append(a) or verify(*a, **k))
    opened = open_checkpoint(path)
    fresh, fresh_optimizer, fresh_scheduler = _setup(1)
    random.random()
    opened.load_into(model=fresh, optimizer=fresh_optimizer, scheduler=fresh_scheduler)
    opened.restore_rng()
    assert len(calls) == 1
    assert (random.random(), np.random.rand()) == draws[:2] and torch.equal(torch.rand(2), draws[2])
    assert_same_state(model.state_dict(), fresh.state_dict())
    assert_same_optimizer(optimizer, fresh_optimizer)
    assert scheduler.state_dict() == fresh_scheduler.state_dict()


def test_load_checkpoint_is_the_thin_wrapper(saved):
    path, (model, _, _), _ = saved
    fresh, _, _ = _setup(1)
    loaded = load_checkpoint(path, model=fresh)
    assert isinstance(loaded, OpenedCheckpoint) and loaded.step == 2
    assert_same_state(model.state_dict(), fresh.state_dict())


def test_parts_can_be_filled_one_at_a_time(saved):
    path, (model, optimizer, scheduler), _ = saved
    opened = open_checkpoint(path)
    fresh, fresh_optimizer, fresh_scheduler = _setup(1)
    opened.load_into(model=fresh)
    opened.load_into(model=fresh, optimizer=fresh_optimizer)
    opened.load_into(scheduler=fresh_scheduler)
    assert_same_optimizer(optimizer, fresh_optimizer)
    assert scheduler.state_dict() == fresh_scheduler.state_dict()


def test_exports(saved):
    # The top level exports the location-aware front (hf_resumable.locations), which opens local paths as is.
    path, _, _ = saved
    assert "open_checkpoint" in hf_resumable.__all__ and "OpenedCheckpoint" in hf_resumable.checkpoint.__all__
    assert "open_checkpoint" in hf_resumable.checkpoint.__all__
    opened = hf_resumable.open_checkpoint(path, verify="full")
    assert isinstance(opened, OpenedCheckpoint) and opened.step == open_checkpoint(path).step == 2


def test_rng_policy_lives_in_the_object(tmp_path, caplog):
    model, _, _ = _setup(0)
    save_checkpoint(tmp_path / "c", model=model, rng=False)
    opened = open_checkpoint(tmp_path / "c")
    opened.load_into(model=model)  # weights alone need no RNG
    with pytest.raises(InexactResumeError, match="no RNG state for rank 0"):
        opened.restore_rng()
    with pytest.raises(InexactResumeError, match="no RNG state"):
        opened.load_into(model=model, restore_rng=True)
    with caplog.at_level(logging.WARNING, logger="hf_resumable"):
        opened.restore_rng(allow_inexact_resume=True)
    assert "NOT bit-exact" in caplog.text
    open_checkpoint(tmp_path / "c", allow_inexact_resume=True).restore_rng()


def _written_by_two(path):
    manifest = read_manifest(path)
    (path / "manifest.json").write_bytes(Manifest(files=manifest.files, step=manifest.step, world_size=2).to_json())


def test_world_size_policy_lives_in_the_object(saved):
    path, (model, _, _), _ = saved
    _written_by_two(path)
    fresh, _, _ = _setup(1)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    opened = open_checkpoint(path)
    with pytest.raises(ConfigDriftError, match="written by 2 process"):
        opened.load_into(model=fresh)
    assert_same_state(before, fresh.state_dict())
    opened.load_into(model=fresh, allow_inexact_resume=True)
    assert_same_state(model.state_dict(), fresh.state_dict())
    with pytest.raises(ConfigDriftError):
        opened.restore_rng()
    resharded = open_checkpoint(path, reshard=True)  # resharded weights carry over; RNG streams do not
    resharded.load_into(model=fresh)
    with pytest.raises(InexactResumeError, match="per-rank RNG streams"):
        resharded.restore_rng()


def test_missing_parts_are_named(saved):
    path, _, _ = saved
    opened = open_checkpoint(path)
    with pytest.raises(IncompleteCheckpointError, match="no scaler state"):
        opened.load_into(scaler=torch.amp.GradScaler("cpu"))


def test_data_position_keys_match_the_data_layer():
    assert (_validate.DATA_KIND, _validate.DATA_EPOCH, _validate.DATA_STEP, _validate.DATA_NUM_BATCHES,
            _validate.DATA_LOADER) == (data.DATA_KIND, data.DATA_EPOCH, data.DATA_STEP, data.DATA_NUM_BATCHES,
                                       data.DATA_LOADER)
    from hf_resumable.integrations import accelerate

    assert _validate.DATA_LOADERS == accelerate.DATA_LOADERS


def test_every_torch_scheduler_and_the_scaler_pass_the_live_check(tmp_path):
    # The scheduler/scaler check must never refuse a state that the same object wrote (after steps).
    lr = torch.optim.lr_scheduler
    builders = {
        "step": lambda o: lr.StepLR(o, step_size=2), "multistep": lambda o: lr.MultiStepLR(o, [1, 3]),
        "exponential": lambda o: lr.ExponentialLR(o, 0.9), "cosine": lambda o: lr.CosineAnnealingLR(o, 5),
        "warm_restarts": lambda o: lr.CosineAnnealingWarmRestarts(o, 2), "onecycle": lambda o: lr.OneCycleLR(
            o, max_lr=0.1, total_steps=10), "cyclic": lambda o: lr.CyclicLR(o, 0.01, 0.1, step_size_up=2),
        "plateau": lambda o: lr.ReduceLROnPlateau(o), "polynomial": lambda o: lr.PolynomialLR(o, 5),
        "sequential": lambda o: lr.SequentialLR(o, [lr.ConstantLR(o, 0.5, 2), lr.ExponentialLR(o, 0.9)], [2]),
        "lambda": lambda o: lr.LambdaLR(o, lambda s: 0.9 ** s),
    }
    from transformers import get_cosine_schedule_with_warmup, get_linear_schedule_with_warmup

    builders["hf_linear"] = lambda o: get_linear_schedule_with_warmup(o, 2, 10)
    builders["hf_cosine"] = lambda o: get_cosine_schedule_with_warmup(o, 2, 10)
    for name, build in builders.items():
        model = torch.nn.Linear(2, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        scheduler, scaler = build(optimizer), torch.amp.GradScaler("cpu")
        for step in range(3):
            optimizer.step()
            scheduler.step(1.0) if name == "plateau" else scheduler.step(step + 0.5) if name == "warm_restarts" \
                else scheduler.step()
        save_checkpoint(tmp_path / name, model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler,
                        rng=False)
        model2 = torch.nn.Linear(2, 2)
        optimizer2 = torch.optim.SGD(model2.parameters(), lr=0.05, momentum=0.9)
        scheduler2, scaler2 = build(optimizer2), torch.amp.GradScaler("cpu")
        load_checkpoint(tmp_path / name, model=model2, optimizer=optimizer2, scheduler=scheduler2, scaler=scaler2,
                        restore_rng=False)
        expected = {k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"}
        assert {k: v for k, v in scheduler2.state_dict().items() if k != "lr_lambdas"} == expected, name
        assert scaler2.state_dict() == scaler.state_dict()
