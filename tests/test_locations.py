"""The front for locations (:mod:`hf_resumable.locations`): ``storage_options`` reach fsspec for object stores and are
refused anywhere else, never silently dropped."""

from __future__ import annotations

import pytest
import torch

import hf_resumable.checkpoint as core
from hf_resumable import find_latest_checkpoint, load_checkpoint, open_checkpoint, save_checkpoint
from hf_resumable.remote import upload_checkpoint

from helpers.s3_fixtures import bucket, seaweed, storage_options  # noqa: F401 - fixtures

OPTIONS = {"client_kwargs": {"endpoint_url": "http://127.0.0.1:9"}}


@pytest.fixture
def saved(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    save_checkpoint(tmp_path / "run" / "checkpoint-3", model=model, step=3)
    return tmp_path / "run", model


@pytest.mark.parametrize("location", ["local", "hf://me/run", "hf://me/run/checkpoint-3"])
def test_storage_options_outside_object_stores_are_refused(saved, location):
    root, model = saved
    checkpoint = root / "checkpoint-3" if location == "local" else location
    run = root if location == "local" else location
    with pytest.raises(ValueError, match="storage_options apply only to object-store locations"):
        load_checkpoint(checkpoint, model=torch.nn.Linear(4, 4), storage_options=OPTIONS)
    with pytest.raises(ValueError, match="storage_options apply only to object-store locations"):
        open_checkpoint(checkpoint, storage_options=OPTIONS)
    with pytest.raises(ValueError, match="storage_options apply only to object-store locations"):
        find_latest_checkpoint(run, storage_options=OPTIONS)


def test_local_locations_without_storage_options_load(saved):
    root, model = saved
    fresh = torch.nn.Linear(4, 4)
    assert find_latest_checkpoint(root, storage_options={}) == root / "checkpoint-3"  # no options: nothing dropped
    assert load_checkpoint(root / "checkpoint-3", model=fresh).step == 3
    assert torch.equal(fresh.weight, model.weight)


def test_the_local_core_takes_no_storage_options(saved):
    root, _ = saved
    with pytest.raises(TypeError, match="storage_options"):
        core.load_checkpoint(root / "checkpoint-3", model=torch.nn.Linear(4, 4), storage_options=OPTIONS)
    with pytest.raises(TypeError, match="storage_options"):
        core.find_latest_checkpoint(root, storage_options=OPTIONS)


def test_storage_options_reach_fsspec_for_object_stores(saved, seaweed, bucket, tmp_path, monkeypatch):
    # The endpoint lives only in the options: without them fsspec would look for the bucket on AWS.
    monkeypatch.setenv("HF_RESUMABLE_CACHE", str(tmp_path / "cache"))
    root, model = saved
    opts = storage_options(seaweed.endpoint)
    upload_checkpoint(root / "checkpoint-3", f"s3://{bucket}/run/checkpoint-3", storage_options=opts)
    assert find_latest_checkpoint(f"s3://{bucket}/run", storage_options=opts) == f"s3://{bucket}/run/checkpoint-3"
    assert open_checkpoint(f"s3://{bucket}/run/checkpoint-3", storage_options=opts).step == 3
    fresh = torch.nn.Linear(4, 4)
    assert load_checkpoint(f"s3://{bucket}/run", model=fresh, storage_options=opts).step == 3
    assert torch.equal(fresh.weight, model.weight)
