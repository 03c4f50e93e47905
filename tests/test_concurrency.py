"""Concurrent writers, readers and cleaners on one checkpoint root, with real processes.

The commit protocol promises: no reader, cleanup or retention ever deletes or modifies a directory a live
writer owns or has committed; a path ``find_latest_checkpoint`` returns stays loadable while a concurrent
writer's retention runs; two writers of the same name: exactly one commits, the other gets
``CheckpointExistsError``. Each test here runs separate processes (tests/scripts/concurrent_checkpoints.py).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hf_resumable.checkpoint import (
    apply_retention,
    cleanup_stale_temp_dirs,
    find_latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
    verify_checkpoint,
    wait_for_pending_saves,
)
from hf_resumable.checkpoint.commit import _pins
from hf_resumable.checkpoint.commit._owner import current_owner, member_name, parse_member_name
from hf_resumable.constants import PIN_PREFIX, REMOVING_PREFIX, TMP_PREFIX, TRASH_PREFIX
from hf_resumable.errors import AsyncSaveError, CheckpointExistsError

from helpers import zygote

SCRIPT = Path(__file__).parent / "scripts" / "concurrent_checkpoints.py"


def _spawn(role: str, root: Path, log: Path, *extra: str) -> subprocess.Popen:
    return zygote.Popen([sys.executable, str(SCRIPT), role, "--root", str(root), "--log", str(log), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _records(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def _model(value: float) -> torch.nn.Module:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.fill_(value)
    return model


def _run_writer_and_readers(tmp_path: Path, *, saves: int, keep_last: int, commit_delay: float) -> tuple:
    root, done = tmp_path / "run", tmp_path / "writer-done"
    root.mkdir()
    logs = [tmp_path / f"{name}.jsonl" for name in ("writer", "reader-1", "reader-2")]
    readers = [_spawn("reader", root, log, "--until", str(done)) for log in logs[1:]]
    writer = _spawn("writer", root, logs[0], "--saves", str(saves), "--keep-last", str(keep_last),
                    "--commit-delay", str(commit_delay))
    try:
        out, _ = writer.communicate(timeout=240)
        assert writer.returncode == 0, out.decode()[-3000:]
    finally:
        done.touch()
        for process in readers:
            try:
                process.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
    return root, [_records(log) for log in logs]


def _assert_nothing_lost(root: Path, writer_log: list[dict], reader_logs: list[list[dict]]) -> None:
    errors = [r for r in writer_log if "error" in r]
    assert not errors, errors[:3]
    committed = [r["committed"] for r in writer_log if "committed" in r]
    removed = {name for r in writer_log for name in r.get("removed", [])}
    assert committed, "the writer committed nothing"
    for step in committed:
        path = root / f"checkpoint-{step}"
        if path.name in removed:
            assert not path.exists(), f"{path} was reported removed by retention but still exists"
            continue
        # Everything the writer reported committed and did not remove itself is whole and loads.
        assert verify_checkpoint(path, full=True).ok, verify_checkpoint(path, full=True).summary()
        model = _model(-1.0)
        load_checkpoint(path, model=model, restore_rng=False)
        assert all(bool((p == float(step)).all()) for p in model.parameters()), path
    for log in reader_logs:
        failures = [r for r in log if "got" in r and not r["ok"]]
        assert not failures, f"a reader got a path that then failed to load: {failures[:3]}"
        assert not [r for r in log if "error" in r and "got" not in r], log[:3]


@pytest.mark.slow
@pytest.mark.extended  # the stress version: the deterministic widened-window test below runs in make test
def test_concurrent_readers_and_cleanup_never_lose_a_committed_checkpoint(tmp_path):
    """One writer commits 120 checkpoints with keep_last=1 retention while two readers loop over
    cleanup + find_latest_checkpoint + load_checkpoint."""
    root, (writer_log, *reader_logs) = _run_writer_and_readers(tmp_path, saves=120, keep_last=1, commit_delay=0.0)
    _assert_nothing_lost(root, writer_log, reader_logs)
    assert sum(1 for log in reader_logs for r in log if "got" in r) >= 20, "the readers hardly raced the writer"
    assert [s for s, _ in list_checkpoints(root)][-1] == 120


@pytest.mark.slow
def test_widened_commit_window_cannot_be_cleaned_up_under_the_writer(tmp_path):
    """Deterministic version: every commit sleeps 0.15 s between finishing its temp dir and renaming it,
    while two readers run cleanup in a loop. Earlier versions removed the owner record before that window,
    so cleanup deleted the temp dir of a live writer (committed checkpoints came out empty)."""
    root, (writer_log, *reader_logs) = _run_writer_and_readers(tmp_path, saves=12, keep_last=2, commit_delay=0.15)
    _assert_nothing_lost(root, writer_log, reader_logs)
    remaining = [s for s, _ in list_checkpoints(root)]
    assert remaining[-2:] == [11, 12], remaining
    # Retention keeps an older one only while a reader holds it (a reader stalled by the machine's load can still hold
    # its pin of checkpoint-10 when the writer's last retention runs); every one a reader held, it loaded.
    loaded = {int(r["got"].rsplit("-", 1)[1]) for log in reader_logs for r in log if "got" in r}
    assert set(remaining[:-2]) <= loaded, (remaining, sorted(loaded))


@pytest.mark.slow
@pytest.mark.parametrize("existing", [False, True], ids=["new", "over-committed"])
def test_two_writers_of_one_name_exactly_one_commits(tmp_path, existing):
    """Two processes save the same checkpoint-N at once (both inside a widened commit window)."""
    root, go = tmp_path / "run", tmp_path / "go"
    root.mkdir()
    if existing:  # racing overwrites are refused too: a save replaces only what it checked at its start
        save_checkpoint(root / "checkpoint-1", model=_model(0.0), step=1, rng=False)
    logs = [tmp_path / f"racer-{i}.jsonl" for i in (1, 2)]
    extra = ["--until", str(go), "--commit-delay", "0.3"]
    racers = [_spawn("racer", root, log, "--value", str(i + 1), *extra) for i, log in enumerate(logs)]
    time.sleep(1.5)  # both processes are importing / waiting for the start file
    go.touch()
    for process in racers:
        out, _ = process.communicate(timeout=120)
        assert process.returncode == 0, out.decode()[-2000:]
    results = [[r for r in _records(log) if "committed" in r or "error" in r][0] for log in logs]
    if existing:
        # Without overwrite=True both are refused before writing anything; the old checkpoint is untouched.
        assert all(r.get("error") == "CheckpointExistsError" for r in results), results
        model = _model(-1.0)
        load_checkpoint(root / "checkpoint-1", model=model, restore_rng=False)
        assert all(bool((p == 0.0).all()) for p in model.parameters())
    else:
        winners = [r["committed"] for r in results if "committed" in r]
        losers = [r for r in results if "error" in r]
        assert len(winners) == 1 and len(losers) == 1, results
        assert losers[0]["error"] == "CheckpointExistsError" and "FileExistsError" in losers[0]["builtin"]
        model = _model(-1.0)
        load_checkpoint(root / "checkpoint-1", model=model, restore_rng=False)
        assert all(bool((p == winners[0]).all()) for p in model.parameters())
    assert verify_checkpoint(root / "checkpoint-1", full=True).ok
    assert sorted(p.name for p in root.iterdir()) == ["checkpoint-1"]  # no temp dir of the loser left


def test_racing_overwrites_replace_only_what_they_checked(tmp_path):
    """overwrite=True is a compare-and-swap: if the target changed since the save checked it, it is refused."""
    from hf_resumable.checkpoint.commit._fs import commit_dir, create_temp_dir, dir_identity

    target = tmp_path / "checkpoint-1"
    save_checkpoint(target, model=_model(1.0), step=1, rng=False)
    checked = dir_identity(target)
    save_checkpoint(target, model=_model(2.0), step=1, rng=False, overwrite=True)  # somebody else's overwrite
    tmp = create_temp_dir(target)
    (tmp / "manifest.json").write_text("{}")
    with pytest.raises(CheckpointExistsError, match="replaced by another process"):
        commit_dir(tmp, target, replaces=checked)
    model = _model(-1.0)
    load_checkpoint(target, model=model, restore_rng=False)
    assert all(bool((p == 2.0).all()) for p in model.parameters())


def _pin_holder(path: Path, ready: Path) -> subprocess.Popen:
    code = (f"import sys, time, pathlib\nfrom hf_resumable.checkpoint.commit import _pins\n"
            f"p = _pins.pin(pathlib.Path({str(path)!r}))\nassert p is not None\n"
            f"pathlib.Path({str(ready)!r}).write_text(str(p))\ntime.sleep(600)\n")
    return zygote.Popen([sys.executable, "-c", code])


def test_retention_keeps_a_checkpoint_pinned_by_a_live_reader_and_cleans_up_after_it_dies(tmp_path):
    root = tmp_path / "run"
    for step in (1, 2):
        save_checkpoint(root / f"checkpoint-{step}", model=_model(float(step)), step=step, rng=False)
    ready = tmp_path / "ready"
    holder = _pin_holder(root / "checkpoint-1", ready)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        pin_file = Path(ready.read_text())
        assert pin_file.exists()
        save_checkpoint(root / "checkpoint-3", model=_model(3.0), step=3, rng=False)
        assert [p.name for p in apply_retention(root, keep_last=1)] == ["checkpoint-2"]
        assert (root / "checkpoint-1").is_dir() and verify_checkpoint(root / "checkpoint-1").ok
        assert cleanup_stale_temp_dirs(root) == [] and pin_file.exists()  # a live reader's pin stays
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    cleanup_stale_temp_dirs(root)
    assert not pin_file.exists()
    assert [p.name for p in apply_retention(root, keep_last=1)] == ["checkpoint-1"]
    assert sorted(p.name for p in root.iterdir()) == ["checkpoint-3"]


def test_own_pins_do_not_block_own_retention(tmp_path):
    from hf_resumable.checkpoint import find_latest_checkpoint

    root = tmp_path / "run"
    save_checkpoint(root / "checkpoint-1", model=_model(1.0), step=1, rng=False)
    assert find_latest_checkpoint(root) == root / "checkpoint-1"  # pinned for this process
    save_checkpoint(root / "checkpoint-2", model=_model(2.0), step=2, rng=False, keep_last=1)
    wait_for_pending_saves()  # retention follows the deferred fsyncs
    assert [s for s, _ in list_checkpoints(root)] == [2]
    _pins.release_held_pins()
    assert not [p for p in root.iterdir() if p.name.startswith(PIN_PREFIX)]


def test_background_retention_renames_at_once_and_deletes_on_a_helper_thread(tmp_path, monkeypatch):
    """``apply_retention(background=True)`` (the Trainer's after a commit): the old checkpoint is no longer found when
    the call returns, its files go on a helper thread (held here until released), and ``wait_for_pending_saves``
    waits for them."""
    import threading

    from hf_resumable.checkpoint.commit import _fs

    root = tmp_path / "run"
    for step in (1, 2):
        save_checkpoint(root / f"checkpoint-{step}", model=_model(float(step)), step=step, rng=False)
    _pins.release_held_pins()
    release, deleting = threading.Event(), []
    original = _fs.shutil.rmtree

    def held_rmtree(path, *args, **kwargs):
        deleting.append(threading.current_thread().name)
        release.wait(60)
        return original(path, *args, **kwargs)

    monkeypatch.setattr(_fs.shutil, "rmtree", held_rmtree)
    assert apply_retention(root, keep_last=1, background=True) == [root / "checkpoint-1"]
    assert [s for s, _ in list_checkpoints(root)] == [2]
    trash = [p for p in root.iterdir() if p.name.startswith(TRASH_PREFIX)]
    assert len(trash) == 1 and parse_member_name(trash[0].name).owner == current_owner()  # ours, marked deleting
    release.set()
    wait_for_pending_saves()
    assert deleting == ["hf_resumable-trash"]
    assert sorted(p.name for p in root.iterdir()) == ["checkpoint-2"]


def test_a_save_right_after_a_background_retention_writes_once_the_deletion_is_done(tmp_path, monkeypatch):
    """The Trainer saves again right after retention started deleting the oldest checkpoint: the background save's
    call and the settle before it return without waiting for the deletion; its files are written only once the
    deletion is done (the disk holds the kept checkpoints and this one at most), then it commits."""
    import threading

    from hf_resumable.checkpoint.api import background_saver
    from hf_resumable.checkpoint.commit import _fs
    from hf_resumable.integrations._core import AfterCommit

    root = tmp_path / "run"
    for step in (1, 2):
        save_checkpoint(root / f"checkpoint-{step}", model=_model(float(step)), step=step, rng=False)
    _pins.release_held_pins()
    release = threading.Event()
    original = _fs.shutil.rmtree

    def held_rmtree(path, *args, **kwargs):
        release.wait(60)
        return original(path, *args, **kwargs)

    monkeypatch.setattr(_fs.shutil, "rmtree", held_rmtree)
    commits = AfterCommit()
    commits.attach(None, lambda: apply_retention(root, keep_last=1, background=True))  # a blocking save's follow-up
    commits.settle(removals=False)  # what the next save does first: returns with the deletion held
    save_checkpoint(root / "checkpoint-3", model=_model(3.0), step=3, rng=False, blocking=False)
    saver = background_saver()
    time.sleep(0.5)
    assert not saver.future.done()  # the write waits for the deletion...
    assert not [p for p in root.iterdir() if p.name.startswith(TMP_PREFIX) and any(p.iterdir())]  # ...and writes none
    assert any(p.name.startswith(TRASH_PREFIX) for p in root.iterdir())
    release.set()
    commits.settle()
    assert [s for s, _ in list_checkpoints(root)] == [2, 3]
    assert sorted(p.name for p in root.iterdir()) == ["checkpoint-2", "checkpoint-3"]


def _dead_owner_name(prefix: str, target: str, *, mark: str = "") -> str:
    probe = zygote.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = current_owner().__class__(current_owner().host, int(probe.stdout), 1)
    return member_name(prefix, target, dead, mark=mark)


@pytest.mark.slow
def test_cleanup_touches_only_provably_dead_owners(tmp_path):
    root = tmp_path / "run"
    save_checkpoint(root / "checkpoint-1", model=_model(1.0), step=1, rng=False)
    dead_tmp = root / _dead_owner_name(TMP_PREFIX, "checkpoint-2")
    live_tmp = root / member_name(TMP_PREFIX, "checkpoint-3")
    other_host = root / member_name(TMP_PREFIX, "checkpoint-4", current_owner().__class__("00000000", 1, 1))
    foreign = [root / ".tmp-theirs", root / ".trash-theirs-1234", root / ".pin-theirs"]
    for path in (dead_tmp, live_tmp, other_host, *foreign[:2]):
        path.mkdir()
        (path / "data.bin").write_bytes(b"x")
    foreign[2].write_text("not ours")
    dead_pin = root / _dead_owner_name(PIN_PREFIX, "checkpoint-1")
    dead_pin.touch()
    dead_announcement = root / _dead_owner_name(REMOVING_PREFIX, "checkpoint-1")
    dead_announcement.touch()
    removed = cleanup_stale_temp_dirs(root)
    assert sorted(p.name for p in removed) == [dead_tmp.name]
    assert not dead_tmp.exists() and not dead_pin.exists() and not dead_announcement.exists()
    for path in (live_tmp, other_host, *foreign):
        assert path.exists(), f"{path.name} was touched"
    assert not [p for p in root.iterdir() if p.name.startswith(TRASH_PREFIX) and parse_member_name(p.name)]


@pytest.mark.slow
def test_cleanup_puts_back_a_checkpoint_whose_overwrite_was_interrupted(tmp_path):
    """An overwrite without RENAME_EXCHANGE, killed between its two renames: the old checkpoint is put back."""
    root = tmp_path / "run"
    save_checkpoint(root / "checkpoint-1", model=_model(1.0), step=1, rng=False)
    trash = root / _dead_owner_name(TRASH_PREFIX, "checkpoint-1")
    os.rename(root / "checkpoint-1", trash)
    decided = root / _dead_owner_name(TRASH_PREFIX, "checkpoint-9", mark=".d")
    decided.mkdir()
    cleanup_stale_temp_dirs(root)
    assert verify_checkpoint(root / "checkpoint-1", full=True).ok
    assert sorted(p.name for p in root.iterdir()) == ["checkpoint-1"]


def test_owned_names_exist_from_the_first_instant(tmp_path, monkeypatch):
    """The temp dir's owner is in its name: there is no moment at which cleanup could take it for stale."""
    from hf_resumable.checkpoint.commit import _fs

    seen: list[str] = []
    original = _fs.fsync_tree

    def spy(path: Path) -> None:
        seen.append(path.name)
        assert cleanup_stale_temp_dirs(path.parent) == []
        original(path)

    monkeypatch.setattr(_fs, "fsync_tree", spy)
    # the fsyncs before the rename (a deferred save's follow it: the temp dir is gone by then)
    save_checkpoint(tmp_path / "checkpoint-1", model=_model(1.0), step=1, rng=False, durability="immediate")
    owned = parse_member_name(seen[0])
    assert owned is not None and owned.prefix == TMP_PREFIX and owned.owner == current_owner()


def _owned_entries(root: Path) -> list[str]:
    """Pins, removal announcements, temp and trash dirs (owned names) left under ``root``."""
    return sorted(p.name for p in root.iterdir() if parse_member_name(p.name) is not None)


@contextlib.contextmanager
def _small_disk(directory: Path, monkeypatch, *, capacity: int = 2 * 1024 * 1024) -> Iterator[Path]:
    """``directory`` on a full-able filesystem: a real ``capacity``-byte tmpfs (as root), or else ``os.write``
    answering ENOSPC, as the kernel would, once the files under ``directory`` have been written ``capacity`` bytes."""
    directory.mkdir()
    mounted = os.geteuid() == 0 and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={capacity}", "tmpfs", str(directory)], capture_output=True
    ).returncode == 0
    if not mounted:
        written, real_write = [0], os.write

        def write(fd: int, data) -> int:
            if os.readlink(f"/proc/self/fd/{fd}").startswith(f"{directory}/"):
                if written[0] + len(data) > capacity:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                written[0] += len(data)
            return real_write(fd, data)

        monkeypatch.setattr(os, "write", write)
    try:
        yield directory
    finally:
        if mounted:
            subprocess.run(["umount", str(directory)], check=False)


def test_a_background_save_that_fails_on_a_full_disk_leaves_no_pin(tmp_path, monkeypatch):
    """The process found (pinned) its checkpoint, then a background save failed with ENOSPC and the process lives
    on: its pin used to stay, protecting a checkpoint nobody was going to read, until the process exited."""
    with _small_disk(tmp_path / "disk", monkeypatch) as root:
        save_checkpoint(root / "checkpoint-1", model=_model(1.0), step=1, rng=False)
        assert find_latest_checkpoint(root) == root / "checkpoint-1"
        assert [name for name in _owned_entries(root) if name.startswith(PIN_PREFIX)]  # pinned, as documented
        big = {"w": torch.ones(1024, 1024)}  # 4 MiB: does not fit
        save_checkpoint(root / "checkpoint-2", model=big, step=2, rng=False, blocking=False)
        with pytest.raises(AsyncSaveError) as raised:
            wait_for_pending_saves()
        assert isinstance(raised.value.__cause__, OSError) and raised.value.__cause__.errno == errno.ENOSPC
        assert _owned_entries(root) == [] and sorted(p.name for p in root.iterdir()) == ["checkpoint-1"]
        assert verify_checkpoint(root / "checkpoint-1", full=True).ok
        model = _model(-1.0)
        load_checkpoint(root / "checkpoint-1", model=model, restore_rng=False)
        assert all(bool((p == 1.0).all()) for p in model.parameters())


def _retention_run_stopped_midway(root: Path, midway: Path) -> int:
    """Fork a process that finds (pins) the newest checkpoint and applies retention; from its fifth deletion on,
    each deletion waits a second (``shutil.rmtree`` slowed in that process only), and ``midway`` appears."""
    pid = os.fork()
    if pid != 0:
        return pid
    try:  # the retention run (only file operations: safe in a forked child)
        from hf_resumable.checkpoint.commit import _fs

        real_rmtree, calls = _fs.shutil.rmtree, []

        def slow_rmtree(path, *args, **kwargs):
            calls.append(path)
            if len(calls) >= 5:
                midway.touch()
                time.sleep(1.0)
            real_rmtree(path, *args, **kwargs)

        _fs.shutil.rmtree = slow_rmtree
        find_latest_checkpoint(root, cleanup=False)
        apply_retention(root, keep_last=2)
    finally:
        os._exit(1)


def _is_zombie(pid: int) -> bool:
    return Path(f"/proc/{pid}/stat").read_bytes().rsplit(b") ", 1)[1].startswith(b"Z")


def test_a_sigkilled_retention_run_leaves_nothing_a_later_cleanup_keeps(tmp_path):
    """A process finds (pins) the newest of 30 checkpoints and applies retention; it is SIGKILLed mid-way. The
    cleanup that follows at once removes its pin while another process's live pin stays. Right after the kill, the
    process may still be running with the SIGKILL pending (on a loaded machine, for a while), then it is a zombie
    until reaped (``kill(pid, 0)`` succeeds, ``/proc`` shows its start time): in both states its pin used to look
    like a live reader's, and the next cleanup kept it."""
    root, midway, ready = tmp_path / "run", tmp_path / "midway", tmp_path / "ready"
    for step in range(1, 31):
        save_checkpoint(root / f"checkpoint-{step}", model=_model(float(step)), step=step, rng=False)
    wait_for_pending_saves()
    _pins.release_held_pins()
    holder = _pin_holder(root / "checkpoint-3", ready)  # a live reader of an old checkpoint
    try:
        deadline = time.monotonic() + 60
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        live_pin = Path(ready.read_text())
        pid = _retention_run_stopped_midway(root, midway)
        try:
            deadline = time.monotonic() + 120
            while not midway.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            os.kill(pid, signal.SIGKILL)
            left = [p.name for _, p in list_checkpoints(root)]
            assert 4 < len(left) < 30, left  # killed mid-way: some removed, more than it keeps still there
            assert [n for n in _owned_entries(root) if n.startswith(PIN_PREFIX) and str(pid) in n.split(".")]
            cleanup_stale_temp_dirs(root)  # the next run, at once
            pins = [n for n in _owned_entries(root) if n.startswith(PIN_PREFIX)]
            assert pins == [live_pin.name], pins  # the killed process's pin is gone, the live reader's stays
            while not _is_zombie(pid):
                time.sleep(0.01)
            cleanup_stale_temp_dirs(root)  # its announcement too, once it is dead
            assert _owned_entries(root) == [live_pin.name]
        finally:
            os.waitpid(pid, 0)
        assert [p.name for p in apply_retention(root, keep_last=2)] == [n for n in left[:-2] if n != "checkpoint-3"]
        assert [p.name for _, p in list_checkpoints(root)] == ["checkpoint-3", "checkpoint-29", "checkpoint-30"]
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    cleanup_stale_temp_dirs(root)
    assert _owned_entries(root) == []
    assert verify_checkpoint(root / "checkpoint-30", full=True).ok
