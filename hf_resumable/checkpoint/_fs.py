"""Local-filesystem primitives for the commit protocol: durable writes, temp dirs, atomic rename."""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import time
import uuid
from pathlib import Path

from ..constants import OWNER_FILE, TMP_PREFIX, TRASH_PREFIX
from ..safetensors_io import FileRecord, record_of

logger = logging.getLogger(__name__)


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a directory so renames and new entries in it are durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes_durably(path: Path, data: bytes) -> FileRecord:
    """Create ``path`` exclusively, write ``data``, fsync; return its record (size and hashes)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    os.close(fd)
    return record_of(data)


def temp_dir_for(target: Path, *, unique: bool) -> Path:
    """The sibling temp dir a save of ``target`` writes into (unique per process unless distributed)."""
    suffix = f"-{uuid.uuid4().hex[:8]}" if unique else ""
    return target.parent / f"{TMP_PREFIX}{target.name}{suffix}"


def create_temp_dir(path: Path) -> None:
    """Create ``path`` (removing a stale one of the same name) and record who writes it."""
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    owner = {"pid": os.getpid(), "host": socket.gethostname(), "created": time.time()}
    (path / OWNER_FILE).write_text(json.dumps(owner))


def fsync_tree(path: Path) -> None:
    """fsync every directory under ``path`` (files are fsynced as they are written)."""
    for root, _dirs, _files in os.walk(path):
        fsync_dir(root)


def commit_dir(tmp: Path, target: Path, *, overwrite: bool) -> None:
    """Atomically move ``tmp`` to ``target``; with ``overwrite`` the old target is swapped out first."""
    (tmp / OWNER_FILE).unlink(missing_ok=True)
    fsync_tree(tmp)
    trash = None
    if overwrite and target.exists():
        trash = target.parent / f"{TRASH_PREFIX}{target.name}-{uuid.uuid4().hex[:8]}"
        os.rename(target, trash)
    os.rename(tmp, target)
    fsync_dir(target.parent)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)


def remove_dir(path: Path) -> None:
    """Delete a directory so that no half-deleted copy can ever look like a checkpoint.

    The directory is first renamed to a trash name (atomic), then removed.
    """
    trash = path.parent / f"{TRASH_PREFIX}{path.name}-{uuid.uuid4().hex[:8]}"
    os.rename(path, trash)
    fsync_dir(path.parent)
    shutil.rmtree(trash, ignore_errors=True)


def is_stale_temp(path: Path) -> bool:
    """A temp/trash dir whose writer is gone (dead pid on this host), or with no owner record."""
    if path.name.startswith(TRASH_PREFIX):
        return True
    try:
        owner = json.loads((path / OWNER_FILE).read_text())
    except (OSError, ValueError):
        # No owner: the writer already removed it right before committing (and then died), or it is foreign.
        return True
    if owner.get("host") != socket.gethostname():
        return False
    try:
        os.kill(int(owner["pid"]), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, KeyError, ValueError):
        return False
    return False
