"""Discovery hands its verification to the open (issue 17): a resume verifies a checkpoint once and reads and hashes
each small file once, and a file that changes after it was verified is a typed error with nothing applied."""

from __future__ import annotations

import os
import random
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

import hf_resumable.checkpoint._reader as reader_module
import hf_resumable.checkpoint.api as api
import hf_resumable.checkpoint.verify as verify_module
from hf_resumable.checkpoint import (
    VerifyReport,
    find_latest_checkpoint,
    find_latest_verified,
    load_checkpoint,
    open_checkpoint,
    read_manifest,
    save_checkpoint,
    verify_checkpoint,
    wait_for_pending_saves,
)
from hf_resumable.checkpoint.commit._pins import live_pins
from hf_resumable.errors import CorruptCheckpointError, IncompleteCheckpointError
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
    root = tmp_path / "run"
    for step in (1, 2):
        save_checkpoint(root / f"checkpoint-{step}", model=model, optimizer=optimizer, scheduler=scheduler, step=step,
                        training_state={"global_step": step},
                        data_state={"kind": "map", "epoch": 0, "step": step, "num_batches": 5})
    wait_for_pending_saves()  # the deferred fsyncs open every file: not part of the loads counted here
    return root, root / "checkpoint-2", (model, optimizer, scheduler)


def _record_opens(monkeypatch, directory: Path) -> list[str]:
    """Every file under ``directory`` that is opened from now on (hf_resumable opens checkpoint files only through
    ``os.open``, in ``format/_safefile.open_regular``), by relative path."""
    opened, real_open, base = [], os.open, os.path.realpath(directory) + os.sep

    def recording(path, *args, **kwargs):
        real = os.path.realpath(path)
        if real.startswith(base):
            opened.append(os.path.relpath(real, base))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", recording)
    return opened


def _record_hashes(monkeypatch) -> tuple[list[int], list[str]]:
    """Hashes computed by verification (bytes hashed, per file) and files hash-checked while a load read them."""
    verified, on_read = [], []
    record_of, read_files = verify_module.record_of, reader_module.read_files
    monkeypatch.setattr(verify_module, "record_of",
                        lambda data, **kw: verified.append(len(data)) or record_of(data, **kw))
    monkeypatch.setattr(reader_module, "read_files", lambda reads, **kw: on_read.extend(
        str(r.path) for r in reads if r.expected is not None) or read_files(reads, **kw))
    monkeypatch.setattr(reader_module, "record_of",
                        lambda data, **kw: on_read.append(len(data)) or record_of(data, **kw))
    return verified, on_read


def _snapshot(model, optimizer, scheduler):
    return ({k: v.clone() for k, v in model.state_dict().items()}, dict(optimizer.state), scheduler.state_dict(),
            capture_rng_state())


def _assert_untouched(snapshot, model, optimizer, scheduler):
    weights, state, schedule, rng = snapshot
    assert_same_state(weights, model.state_dict())
    assert dict(optimizer.state) == state == {}
    assert scheduler.state_dict() == schedule
    assert capture_rng_state().equals(rng)


def _flip_last_byte(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0x01]))


def test_discovery_hands_its_verification_to_the_open_and_each_file_is_read_and_hashed_once(saved, monkeypatch):
    root, path, (model, optimizer, scheduler) = saved
    assert find_latest_checkpoint(root) == path
    files = set(read_manifest(path).files)
    draws = (random.random(), np.random.rand(), torch.rand(2))
    fresh, fresh_optimizer, fresh_scheduler = _setup(1)
    opens = _record_opens(monkeypatch, path)
    verified_hashes, read_hashes = _record_hashes(monkeypatch)
    verifications = []
    monkeypatch.setattr(api, "verify_checkpoint", lambda *a, **k: verifications.append(a) or verify_checkpoint(*a,
                                                                                                            **k))
    report = find_latest_verified(root)
    assert isinstance(report, VerifyReport) and report.ok and Path(report.path) == path
    assert live_pins(root, path.name, ignore_own=False)  # pinned, as find_latest_checkpoint pins it
    assert {"training_state.json", "model.safetensors", "rng/rank-00000.safetensors"} <= set(report.contents)
    assert "config.json" not in report.contents  # only what the open and load read is kept
    random.random()
    opened = open_checkpoint(report.path, verified=report)
    opened.load_into(model=fresh, optimizer=fresh_optimizer, scheduler=fresh_scheduler)
    opened.restore_rng()
    assert verifications == []  # the open did not verify again
    # every file opened once, by discovery; so is the durability record (its fsyncs are done: quick verification)
    assert Counter(opens) == Counter(sorted(files) + ["manifest.json", ".durability"])
    assert len(verified_hashes) == len(files) and read_hashes == []  # hashed once each (all are small here)
    assert report.contents == {}  # released by the load that used them
    assert (random.random(), np.random.rand()) == draws[:2] and torch.equal(torch.rand(2), draws[2])
    assert_same_state(model.state_dict(), fresh.state_dict())
    assert_same_optimizer(optimizer, fresh_optimizer)
    assert scheduler.state_dict() == fresh_scheduler.state_dict()


def test_a_plain_load_reads_each_small_file_once_too(saved, monkeypatch):
    _root, path, (model, optimizer, _) = saved
    fresh, fresh_optimizer, _ = _setup(1)
    files = sorted(read_manifest(path).files)
    opens = _record_opens(monkeypatch, path)
    load_checkpoint(path, model=fresh, optimizer=fresh_optimizer)
    assert Counter(opens) == Counter(files + ["manifest.json", ".durability"])  # the record: read once
    assert_same_state(model.state_dict(), fresh.state_dict())
    assert_same_optimizer(optimizer, fresh_optimizer)


@pytest.mark.parametrize("relpath", ["training_state.json", "rng/rank-00000.safetensors", "data/rank-00000.json",
                                     "model.safetensors", "optimizer-00001-of-00001.safetensors",
                                     "optimizer.safetensors.index.json"])
def test_a_file_modified_after_discovery_is_a_typed_error_and_nothing_is_applied(saved, relpath):
    root, path, _ = saved
    fresh = _setup(1)
    snapshot = _snapshot(*fresh)
    report = find_latest_verified(root)
    _flip_last_byte(path / relpath)
    with pytest.raises(CorruptCheckpointError, match=f"{relpath}: changed after the checkpoint was verified"):
        opened = open_checkpoint(path, verified=report)
        opened.load_into(model=fresh[0], optimizer=fresh[1], scheduler=fresh[2], restore_rng=True)
    _assert_untouched(snapshot, *fresh)


def test_a_file_modified_between_open_and_load_is_refused_before_anything_is_applied(saved):
    root, path, _ = saved
    fresh = _setup(1)
    snapshot = _snapshot(*fresh)
    report = find_latest_verified(root)
    opened = open_checkpoint(path, verified=report)
    _flip_last_byte(path / "optimizer-00001-of-00001.safetensors")
    with pytest.raises(CorruptCheckpointError, match="changed after the checkpoint was verified"):
        opened.load_into(model=fresh[0], optimizer=fresh[1], scheduler=fresh[2], restore_rng=True)
    _assert_untouched(snapshot, *fresh)


def test_a_large_file_modified_after_discovery_is_refused_before_a_byte_of_it_is_read(saved, monkeypatch):
    """A file too large to hash in quick mode is hash-checked while it is read; one that changed since discovery
    is refused before that (its size, times or inode differ), so the model is untouched too."""
    root, path, _ = saved
    monkeypatch.setattr(verify_module, "QUICK_HASH_LIMIT", 100_000)  # model and optimizer files count as large
    fresh = _setup(1)
    snapshot = _snapshot(*fresh)
    report = find_latest_verified(root)
    assert "model.safetensors" not in report.contents and "model.safetensors" in report.identities
    _flip_last_byte(path / "model.safetensors")
    opened = open_checkpoint(path, verified=report)
    with pytest.raises(CorruptCheckpointError, match="model.safetensors: changed after the checkpoint was verified"):
        opened.load_into(model=fresh[0], optimizer=fresh[1], scheduler=fresh[2])
    _assert_untouched(snapshot, *fresh)


def test_a_rewrite_with_the_same_bytes_is_also_refused_and_a_removed_file_is_incomplete(saved):
    root, path, _ = saved
    report = find_latest_verified(root)
    target = path / "training_state.json"
    data = target.read_bytes()
    target.unlink()
    with pytest.raises(IncompleteCheckpointError, match="removed after the checkpoint was verified"):
        open_checkpoint(path, verified=report)
    target.write_bytes(data)  # the same bytes, another file: the report no longer stands for it
    with pytest.raises(CorruptCheckpointError, match="changed after the checkpoint was verified"):
        open_checkpoint(path, verified=report)
    open_checkpoint(path)  # verified afresh, it opens


def test_a_checkpoint_replaced_after_discovery_is_refused(saved):
    root, path, (model, optimizer, scheduler) = saved
    report = find_latest_verified(root)
    save_checkpoint(path, model=model, optimizer=optimizer, scheduler=scheduler, step=2, overwrite=True,
                    training_state={"global_step": 2})
    with pytest.raises(CorruptCheckpointError, match="manifest.json: changed after the checkpoint was verified"):
        open_checkpoint(path, verified=report)


def test_without_kept_bytes_every_file_is_read_again_and_checked(saved, monkeypatch):
    root, path, (model, optimizer, _) = saved
    monkeypatch.setattr(verify_module, "KEEP_BUDGET", 0)
    report = find_latest_verified(root)
    assert report.contents == {}
    fresh, fresh_optimizer, _ = _setup(1)
    open_checkpoint(path, verified=report).load_into(model=fresh, optimizer=fresh_optimizer)
    assert_same_state(model.state_dict(), fresh.state_dict())
    assert_same_optimizer(optimizer, fresh_optimizer)
    report = find_latest_verified(root)
    _flip_last_byte(path / "training_state.json")
    with pytest.raises(CorruptCheckpointError, match="training_state.json: changed after"):
        open_checkpoint(path, verified=report)


def test_a_report_stands_only_for_its_own_directory_and_mode(saved, monkeypatch):
    root, path, _ = saved
    report = find_latest_verified(root)
    with pytest.raises(ValueError, match="not of"):
        open_checkpoint(root / "checkpoint-1", verified=report)
    with pytest.raises(ValueError, match="VerifyReport"):
        open_checkpoint(path, verified=str(path))
    calls = []
    monkeypatch.setattr(api, "verify_checkpoint", lambda *a, **k: calls.append(k["full"]) or verify_checkpoint(*a,
                                                                                                             **k))
    open_checkpoint(path, verify="full", verified=report)  # a quick report does not stand for a full verification
    assert calls == [True]
    full = verify_checkpoint(path, full=True)
    open_checkpoint(path, verify="quick", verified=full)
    assert calls == [True]
    (path / "config.json").write_text("{}")
    bad = verify_checkpoint(path, full=False)
    assert not bad.ok
    with pytest.raises(CorruptCheckpointError, match="config.json"):
        open_checkpoint(path, verified=bad)


def test_find_latest_verified_skips_what_does_not_verify(saved):
    root, path, _ = saved
    _flip_last_byte(path / "training_state.json")
    report = find_latest_verified(root)
    assert Path(report.path) == root / "checkpoint-1" == find_latest_checkpoint(root)
    assert find_latest_verified(root / "nothing-here") is None
