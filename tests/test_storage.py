"""Object-store checkpoints against a real S3 server (SeaweedFS) the suite starts on 127.0.0.1."""

from __future__ import annotations

import pytest
import torch

from hf_resumable import find_latest_checkpoint, load_checkpoint, save_checkpoint
from hf_resumable._urls import is_object_store_url
from hf_resumable.errors import CheckpointExistsError, StorageError
from hf_resumable.remote import (
    CheckpointMirror,
    apply_remote_retention,
    download_checkpoint,
    is_committed_remote,
    list_remote_checkpoints,
    upload_checkpoint,
)

from helpers.s3_fixtures import CuttableProxy, bucket, seaweed, storage_options  # noqa: F401 - fixtures
from helpers.tiny_models import assert_same_optimizer, assert_same_state, tiny_gpt2, train_steps


def _trained(tmp_path, steps=(1,), big=False):
    model = tiny_gpt2(n_embd=256 if big else 32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in steps:
        train_steps(model, optimizer, steps=1, seed=step)
        save_checkpoint(tmp_path / f"checkpoint-{step}", model=model, optimizer=optimizer, step=step,
                        max_shard_size="1MB")
    return model, optimizer


def test_is_object_store_url():
    assert is_object_store_url("s3://b/run") and is_object_store_url("gs://b/x")
    assert not is_object_store_url("/tmp/x") and not is_object_store_url("file:///tmp/x")
    assert not is_object_store_url("hf://u/r")


@pytest.mark.slow
def test_upload_find_latest_and_resume_from_s3_bit_exact(tmp_path, seaweed, bucket):
    opts = storage_options(seaweed.endpoint)
    model, optimizer = _trained(tmp_path / "local", steps=(1, 2))
    for step in (1, 2):
        upload_checkpoint(tmp_path / "local" / f"checkpoint-{step}", f"s3://{bucket}/run/checkpoint-{step}",
                          storage_options=opts)
    latest = find_latest_checkpoint(f"s3://{bucket}/run", storage_options=opts)
    assert latest == f"s3://{bucket}/run/checkpoint-2"
    fresh = tiny_gpt2(seed=9)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    loaded = load_checkpoint(f"s3://{bucket}/run", model=fresh, optimizer=fresh_optimizer, storage_options=opts)
    assert loaded.step == 2
    assert_same_state(model.state_dict(), fresh.state_dict())
    assert_same_optimizer(optimizer, fresh_optimizer)
    with pytest.raises(CheckpointExistsError):
        upload_checkpoint(tmp_path / "local" / "checkpoint-2", latest, storage_options=opts)


@pytest.mark.slow
def test_connection_cut_mid_upload_never_looks_committed(tmp_path, seaweed, bucket):
    proxy = CuttableProxy(seaweed.s3_port)
    opts = storage_options(proxy.endpoint)
    _trained(tmp_path / "local", steps=(1, 2), big=True)
    upload_checkpoint(tmp_path / "local" / "checkpoint-1", f"s3://{bucket}/run/checkpoint-1", storage_options=opts)
    proxy.cut_after(2_000_000)  # mid-way through checkpoint-2's shards
    with pytest.raises((StorageError, OSError)):
        upload_checkpoint(tmp_path / "local" / "checkpoint-2", f"s3://{bucket}/run/checkpoint-2",
                          storage_options=opts)
    direct = storage_options(seaweed.endpoint)
    steps = [s for s, _ in list_remote_checkpoints(f"s3://{bucket}/run", storage_options=direct)]
    assert 2 in steps, "some files of checkpoint-2 should have reached the store"
    assert not is_committed_remote(f"s3://{bucket}/run/checkpoint-2", storage_options=direct)
    assert find_latest_checkpoint(f"s3://{bucket}/run", storage_options=direct) == f"s3://{bucket}/run/checkpoint-1"
    proxy.restore()
    upload_checkpoint(tmp_path / "local" / "checkpoint-2", f"s3://{bucket}/run/checkpoint-2", storage_options=opts)
    assert find_latest_checkpoint(f"s3://{bucket}/run", storage_options=direct) == f"s3://{bucket}/run/checkpoint-2"


def test_remote_checkpoint_with_missing_file_is_skipped(tmp_path, seaweed, bucket):
    import s3fs

    opts = storage_options(seaweed.endpoint)
    _trained(tmp_path / "local", steps=(1, 2))
    for step in (1, 2):
        upload_checkpoint(tmp_path / "local" / f"checkpoint-{step}", f"s3://{bucket}/run/checkpoint-{step}",
                          storage_options=opts)
    fs = s3fs.S3FileSystem(**opts)
    fs.rm_file(f"{bucket}/run/checkpoint-2/model.safetensors")
    assert find_latest_checkpoint(f"s3://{bucket}/run", storage_options=opts) == f"s3://{bucket}/run/checkpoint-1"


@pytest.mark.slow
def test_download_detects_tampered_bytes(tmp_path, seaweed, bucket):
    import s3fs

    from hf_resumable.errors import CorruptCheckpointError

    opts = storage_options(seaweed.endpoint)
    _trained(tmp_path / "local", steps=(1,))
    url = upload_checkpoint(tmp_path / "local" / "checkpoint-1", f"s3://{bucket}/run/checkpoint-1",
                            storage_options=opts)
    fs = s3fs.S3FileSystem(**opts)
    path = f"{bucket}/run/checkpoint-1/training_state.json"
    data = bytearray(fs.cat_file(path))
    data[10] ^= 1
    fs.pipe_file(path, bytes(data))
    with pytest.raises(CorruptCheckpointError, match="training_state.json: downloaded xxh3-128 is"):
        download_checkpoint(url, tmp_path / "dl", storage_options=opts)
    assert not (tmp_path / "dl").exists()
    assert not any(p.name.startswith(".tmp-") for p in tmp_path.iterdir())


@pytest.mark.slow
def test_mirror_queues_every_upload_and_applies_remote_retention(tmp_path, seaweed, bucket):
    opts = storage_options(seaweed.endpoint)
    _trained(tmp_path / "local", steps=(1, 2, 3))
    mirror = CheckpointMirror(f"s3://{bucket}/run", keep_last=2, storage_options=opts)
    for step in (1, 2, 3):
        mirror.submit(tmp_path / "local" / f"checkpoint-{step}")
    assert mirror.pending()  # uploads are in flight, not skipped
    mirror.wait(timeout=120)
    assert mirror.pending() == set()
    assert list(mirror.results().values()) == [f"s3://{bucket}/run/checkpoint-{s}" for s in (1, 2, 3)]
    committed = [s for s, p in list_remote_checkpoints(f"s3://{bucket}/run", storage_options=opts)
                 if is_committed_remote(p, storage_options=opts)]
    assert committed == [2, 3]


@pytest.mark.slow
def test_mirror_failure_is_raised_not_lost(tmp_path, seaweed, bucket):
    proxy = CuttableProxy(seaweed.s3_port)
    opts = storage_options(proxy.endpoint)
    _trained(tmp_path / "local", steps=(1,))
    mirror = CheckpointMirror(f"s3://{bucket}/run", storage_options=opts)
    proxy.cut()
    mirror.submit(tmp_path / "local" / "checkpoint-1")
    with pytest.raises(StorageError):
        mirror.wait(timeout=120)
    assert mirror.confirmed() == set()
    proxy.restore()


@pytest.mark.slow
def test_remote_retention_keeps_newest_committed(tmp_path, seaweed, bucket):
    opts = storage_options(seaweed.endpoint)
    _trained(tmp_path / "local", steps=(1, 2, 3))
    for step in (1, 2, 3):
        upload_checkpoint(tmp_path / "local" / f"checkpoint-{step}", f"s3://{bucket}/run/checkpoint-{step}",
                          storage_options=opts)
    deleted = apply_remote_retention(f"s3://{bucket}/run", keep_last=1, storage_options=opts)
    assert deleted == [f"s3://{bucket}/run/checkpoint-1", f"s3://{bucket}/run/checkpoint-2"]
    remaining = [(s, u) for s, u in list_remote_checkpoints(f"s3://{bucket}/run", storage_options=opts)]
    assert [s for s, u in remaining if is_committed_remote(u, storage_options=opts)] == [3]
    import s3fs

    fs = s3fs.S3FileSystem(**opts)
    for step in (1, 2):
        prefix = f"{bucket}/run/checkpoint-{step}"
        assert [p for p in fs.find(prefix) if p.rstrip("/") != prefix] == []  # no object left under it
