"""Deferred durability (checkpoint/commit/_durability.py): a blocking save commits before its fsyncs, which follow on
the
saver's thread; what a crash of the process or of the machine costs then."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from hf_resumable.checkpoint import (
    apply_retention,
    find_latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
    verify_checkpoint,
    wait_for_pending_saves,
)
from hf_resumable.checkpoint.commit import _durability
from hf_resumable.constants import DURABILITY_FILE
from hf_resumable.errors import AsyncSaveError


def _model(value: float, size: int = 64) -> torch.nn.Module:
    model = torch.nn.Linear(size, size)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    return model


class _Fsyncs:
    """Counts the ``os.fsync`` calls (every fsync of the package goes through it) of this thread (``count``) and of
    the background saver's (``saver``); other threads' (a previous test's helpers) are not counted."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import threading

        self.count, self.saver, self.total, real, caller = 0, 0, 0, os.fsync, threading.get_ident()

        def counting(fd: int) -> None:
            self.total += 1  # every thread's (a writer's helper threads too)
            if threading.get_ident() == caller:
                self.count += 1
            elif threading.current_thread().name == "hf_resumable-save":
                self.saver += 1
            real(fd)

        monkeypatch.setattr(os, "fsync", counting)


def _hold_fsyncs(monkeypatch: pytest.MonkeyPatch):
    """Hold the saver thread's fsyncs of deferred saves until the returned event is set."""
    import threading

    from hf_resumable.checkpoint.background import async_save

    release, real = threading.Event(), async_save.make_durable

    def held(*args, **kwargs) -> None:
        release.wait(60)
        real(*args, **kwargs)

    monkeypatch.setattr(async_save, "make_durable", held)
    return release


def test_a_blocking_save_commits_before_its_fsyncs_which_follow_on_the_saver_thread(tmp_path, monkeypatch):
    fsyncs, release = _Fsyncs(monkeypatch), _hold_fsyncs(monkeypatch)
    target = tmp_path / "checkpoint-1"
    model = _model(1.0)
    save_checkpoint(target, model=model, optimizer=torch.optim.AdamW(model.parameters()), step=1)
    files = len(verify_checkpoint(target).manifest.files)
    assert fsyncs.count == 2  # the marker and its directory entry, before the rename; no data file
    release.set()
    assert json.loads((target / DURABILITY_FILE).read_text()) == {"boot_id": _durability.boot_id(), "durable": False}
    assert not _durability.is_durable(target) and not _durability.needs_every_byte(target)
    wait_for_pending_saves()
    assert json.loads((target / DURABILITY_FILE).read_text())["durable"] is True and _durability.is_durable(target)
    assert not [p for p in tmp_path.iterdir() if p.name != "checkpoint-1"]  # the staged record was renamed in
    assert fsyncs.count == 2 and fsyncs.saver >= files + 1  # every file (manifest included), then the directories


def test_immediate_durability_fsyncs_every_file_before_the_commit(tmp_path, monkeypatch):
    fsyncs = _Fsyncs(monkeypatch)
    target = tmp_path / "checkpoint-1"
    save_checkpoint(target, model=_model(1.0), step=1, durability="immediate")
    assert fsyncs.total >= len(verify_checkpoint(target).manifest.files) + 1 and fsyncs.saver == 0
    assert not (target / DURABILITY_FILE).exists()


def test_an_overwrite_is_always_immediate(tmp_path):
    target = tmp_path / "checkpoint-1"
    save_checkpoint(target, model=_model(1.0), step=1)
    wait_for_pending_saves()
    save_checkpoint(target, model=_model(2.0), step=1, overwrite=True)  # the old one is gone at the rename
    assert not (target / DURABILITY_FILE).exists()


def test_a_copy_made_while_the_fsyncs_run_finds_every_file(tmp_path, monkeypatch):
    """The record is replaced, never removed: shutil.copytree of a checkpoint right after the call (a user's backup)
    never lists a file that is gone when it copies it."""
    import shutil

    release = _hold_fsyncs(monkeypatch)
    target = tmp_path / "checkpoint-1"
    save_checkpoint(target, model=_model(1.0), step=1)
    names = sorted(os.listdir(target))
    release.set()
    for attempt in range(20):  # races the fsyncs and the record's replacement
        shutil.copytree(target, tmp_path / f"copy-{attempt}")
    wait_for_pending_saves()
    assert sorted(os.listdir(target)) == names and _durability.is_durable(target)
    assert verify_checkpoint(tmp_path / "copy-19", full=True).ok


def test_an_unknown_durability_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(ValueError, match="durability must be one of 'deferred', 'immediate'"):
        save_checkpoint(tmp_path / "checkpoint-1", model=_model(1.0), step=1, durability="eventually")
    assert not (tmp_path / "checkpoint-1").exists()


def _torn(directory: Path) -> None:
    """What a machine crash can leave of a file whose pages never reached the disk: the right size, other bytes."""
    path = directory / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-16:] = bytes(16)
    path.write_bytes(bytes(data))


def _pending(directory: Path, boot: str) -> None:
    """A checkpoint whose fsyncs never finished, written on boot ``boot``."""
    (directory / DURABILITY_FILE).write_text(json.dumps({"boot_id": boot, "durable": False}))


def test_after_a_machine_crash_an_unconfirmed_checkpoint_is_verified_byte_for_byte(tmp_path, monkeypatch):
    """Written on another boot and never confirmed durable: quick verification hashes every byte, so a torn
    checkpoint is skipped and the previous one (durable) is found. The same checkpoint on this boot is trusted as
    quick verification trusts any (the kernel holds its bytes)."""
    for step in (1, 2):  # a model file over the size quick verification hashes (4 MiB)
        save_checkpoint(tmp_path / f"checkpoint-{step}", model=_model(float(step), size=1200), step=step, rng=False)
        wait_for_pending_saves()
    newest = tmp_path / "checkpoint-2"
    _torn(newest)
    _pending(newest, _durability.boot_id())
    assert find_latest_checkpoint(tmp_path) == newest  # this boot: quick verification, as for any checkpoint
    _pending(newest, "another-boot")
    assert verify_checkpoint(newest, full=False).full
    assert find_latest_checkpoint(tmp_path) == tmp_path / "checkpoint-1"
    (newest / DURABILITY_FILE).write_bytes(b"\x00" * 7)  # a torn marker trusts no boot
    assert _durability.needs_every_byte(newest)
    assert find_latest_checkpoint(tmp_path) == tmp_path / "checkpoint-1"


def test_retention_never_deletes_the_newest_durable_checkpoint(tmp_path):
    for step in (1, 2):
        save_checkpoint(tmp_path / f"checkpoint-{step}", model=_model(float(step)), step=step, rng=False)
        wait_for_pending_saves()
    _pending(tmp_path / "checkpoint-2", _durability.boot_id())  # another process's, still being fsynced
    assert apply_retention(tmp_path, keep_last=1) == []
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1, 2]
    _pending(tmp_path / "checkpoint-2", _durability.boot_id())
    (tmp_path / "checkpoint-2" / DURABILITY_FILE).write_text(json.dumps({"durable": True}))  # its fsyncs are done
    assert apply_retention(tmp_path, keep_last=1) == [tmp_path / "checkpoint-1"]


def test_a_failed_fsync_is_raised_at_the_next_wait_and_the_checkpoint_never_counts_as_durable(tmp_path, monkeypatch):
    save_checkpoint(tmp_path / "checkpoint-1", model=_model(1.0), step=1, rng=False)
    wait_for_pending_saves()

    def failing(path: Path) -> bool:
        raise OSError(errno.EIO, "Input/output error", str(path))

    monkeypatch.setattr(_durability, "_fsync_file", failing)
    model = _model(2.0)
    save_checkpoint(tmp_path / "checkpoint-2", model=model, step=2)
    not_durable = r"checkpoint-2 was committed, but making its files durable failed.*Fix the cause \(the disk"
    with pytest.raises(AsyncSaveError, match=not_durable):
        wait_for_pending_saves()
    newest = tmp_path / "checkpoint-2"
    assert not _durability.is_durable(newest)
    assert apply_retention(tmp_path, keep_last=1) == []  # checkpoint-1 stays: the newest durable one
    fresh = _model(0.0)
    load_checkpoint(find_latest_checkpoint(tmp_path), model=fresh)  # this boot: the kernel has every byte
    assert torch.equal(fresh.weight, model.weight)


def test_a_checkpoint_removed_before_its_fsyncs_is_left_alone(tmp_path, monkeypatch, caplog):
    import logging
    import shutil

    release = _hold_fsyncs(monkeypatch)
    target = tmp_path / "checkpoint-1"
    save_checkpoint(target, model=_model(1.0), step=1, rng=False)
    shutil.rmtree(target)  # the user's own cleanup, before the fsyncs ran
    release.set()
    with caplog.at_level(logging.WARNING):
        wait_for_pending_saves()  # no error: nothing of ours is left to fsync
    assert "before its files were fsynced" in caplog.text


@pytest.mark.slow
def test_a_process_killed_right_after_a_deferred_save_loses_nothing(tmp_path):
    """SIGKILL right after the call returns, before any fsync: the kernel holds the bytes; the checkpoint is found
    and loads exactly on this boot, and verifies byte for byte as if read after a reboot."""
    script = textwrap.dedent(f"""
        import os, signal, torch
        from safetensors.torch import save_file
        from hf_resumable.checkpoint import save_checkpoint
        from hf_resumable.checkpoint.background import async_save
        async_save.make_durable = lambda *args, **kwargs: signal.pause()  # the fsyncs never run
        torch.manual_seed(0)
        model = torch.nn.Linear(256, 256)
        save_file(model.state_dict(), {str(tmp_path / "expected.safetensors")!r})
        save_checkpoint({str(tmp_path / "checkpoint-7")!r}, model=model, step=7)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=300)
    assert result.returncode == -signal.SIGKILL, result.stderr.decode()[-2000:]
    target = tmp_path / "checkpoint-7"
    assert (target / DURABILITY_FILE).exists()
    assert find_latest_checkpoint(tmp_path) == target
    assert verify_checkpoint(target, full=True).ok
    fresh = torch.nn.Linear(256, 256)
    load_checkpoint(target, model=fresh)
    from safetensors.torch import load_file

    expected = load_file(tmp_path / "expected.safetensors")
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in expected.items())


@pytest.mark.timeout(120)
def test_a_fifo_planted_as_the_record_never_blocks_a_reader(tmp_path):
    """A hostile `.durability` (a FIFO) is an unreadable record: no boot is trusted, nothing blocks."""
    save_checkpoint(tmp_path / "checkpoint-1", model=_model(1.0), step=1)
    wait_for_pending_saves()
    record = tmp_path / "checkpoint-1" / DURABILITY_FILE
    record.unlink()
    os.mkfifo(record)
    checkpoint = tmp_path / "checkpoint-1"
    assert _durability.needs_every_byte(checkpoint) and not _durability.is_durable(checkpoint)
    assert verify_checkpoint(tmp_path / "checkpoint-1", full=False).full
    assert find_latest_checkpoint(tmp_path) == tmp_path / "checkpoint-1"  # every byte verified, and sound
