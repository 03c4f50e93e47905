"""Local-filesystem primitives of the commit protocol: durable writes, owned temp names, no-replace and
compare-and-swap renames, claim-then-delete. Why each keeps concurrent writers, readers and cleaners safe:
docs/architecture.md, "Concurrency"."""

from __future__ import annotations

import atexit
import ctypes
import errno
import functools
import logging
import os
import shutil
import stat
from pathlib import Path

from ..._tuning import tuning_options
from ...constants import REMOVING_PREFIX, TMP_PREFIX, TRASH_PREFIX
from ...errors import CheckpointExistsError
from ...format._libc import libc_function
from ...format.safetensors_io import FileRecord, record_of
from ._owner import DELETING_MARK, member_name
from ._pins import live_pins
from ._threads import SerialThread

logger = logging.getLogger(__name__)

# The identity of a directory: (st_dev, st_ino). A save records the one it is allowed to replace.
DirIdentity = tuple[int, int]

_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a directory so renames and new entries in it are durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes_durably(path: Path, data: bytes, *, fsync: bool = True) -> FileRecord:
    """Create ``path`` exclusively, write ``data``, fsync (unless ``fsync=False``: a deferred save's, see
    ``_durability.py``); return its record (size and hashes)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        if fsync:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    os.close(fd)
    return record_of(data)


def fsync_tree(path: Path) -> None:
    """fsync every directory under ``path`` (files are fsynced as they are written)."""
    for root, _dirs, _files in os.walk(path):
        fsync_dir(root)


# ------------------------------------------------------------------------------------------------- atomic renames
_renameat2_function = libc_function("renameat2",
                                     (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint))


def _renameat2(src: Path, dst: Path, flags: int) -> bool:
    """``renameat2(src, dst, flags)``: ``True`` if done, ``False`` if this system or filesystem lacks it."""
    if _renameat2_function is None:
        return False
    if _renameat2_function(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), os.fspath(src), None, os.fspath(dst))


def rename_noreplace(src: Path, dst: Path) -> None:
    """Rename ``src`` to ``dst``, failing with ``FileExistsError`` if ``dst`` exists (even an empty directory).

    Without ``renameat2`` the check and the rename are two steps; a plain rename still refuses a non-empty
    directory, so a committed checkpoint is never replaced.
    """
    if _renameat2(src, dst, _RENAME_NOREPLACE):
        return
    if os.path.lexists(dst):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), os.fspath(dst))
    os.rename(src, dst)


def exchange(a: Path, b: Path) -> bool:
    """Atomically swap two existing paths; ``False`` if the system or filesystem cannot."""
    return _renameat2(a, b, _RENAME_EXCHANGE)


def dir_identity(path: Path) -> DirIdentity | None:
    """``(st_dev, st_ino)`` of the directory ``path`` (not following a symlink), or ``None`` if absent."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    return (info.st_dev, info.st_ino) if stat.S_ISDIR(info.st_mode) else None


# ------------------------------------------------------------------------------------------------- the commit
def create_temp_dir(target: Path) -> Path:
    """Create and return a fresh owned sibling ``.tmp-<target>.<owner>.<nonce>`` for a save of ``target``."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / member_name(TMP_PREFIX, target.name)
    tmp.mkdir()
    return tmp


def commit_dir(tmp: Path, target: Path, *, replaces: DirIdentity | None, sync: bool = True) -> None:
    """Move the finished ``tmp`` to ``target`` atomically: no-replace where ``replaces`` is ``None``, else a
    compare-and-swap against ``replaces``, the directory the caller checked (``_writer.check_target``). With
    ``sync=False`` (a deferred save, never with ``replaces``) nothing is fsynced.

    Raises:
        CheckpointExistsError: ``target`` appeared, or was replaced by somebody else, since the save started.
    """
    # 1. Make every entry of the temp dir durable before its name changes.
    if sync:
        fsync_tree(tmp)
    # 2. Rename into place: no-replace for a new target, compare-and-swap for an overwrite.
    old = None if replaces is None else _swap_in(tmp, target, replaces)
    if replaces is None:
        try:
            rename_noreplace(tmp, target)
        except OSError as err:
            if err.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            raise CheckpointExistsError(
                f"{target} was created by another process while this save was written; this save was not "
                "committed (the other one was). Save under another name, or pass overwrite=True."
            ) from None
    # 3. Make the rename durable, then delete what was replaced.
    if sync:
        fsync_dir(target.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _changed(target: Path) -> CheckpointExistsError:
    return CheckpointExistsError(
        f"{target} was replaced by another process while this save was written; this save was not committed, "
        "so the other save is kept. Save under another name to keep both."
    )


def _swap_in(tmp: Path, target: Path, replaces: DirIdentity) -> Path:
    """Replace ``target`` (still the directory ``replaces``) with ``tmp``; return where the old one now is."""
    if dir_identity(target) != replaces:
        raise _changed(target)
    if exchange(tmp, target):
        if dir_identity(tmp) != replaces:  # somebody swapped target between the check and the exchange
            exchange(tmp, target)
            raise _changed(target)
        return tmp
    # No RENAME_EXCHANGE (e.g. some network filesystems): two renames. A crash between them leaves the old
    # checkpoint in an unmarked trash dir, which cleanup puts back (see discovery.cleanup_stale_temp_dirs).
    trash = target.parent / member_name(TRASH_PREFIX, target.name)
    os.rename(target, trash)
    if dir_identity(trash) != replaces:
        rename_noreplace(trash, target)
        raise _changed(target)
    try:
        rename_noreplace(tmp, target)
    except OSError:
        try:
            rename_noreplace(trash, target)
        except OSError:
            logger.error("Could not put %s back at %s; it is kept there.", trash, target)
        raise _changed(target) from None
    return trash


# ------------------------------------------------------------------------------------------------- removal
def claim(entry: Path, target_name: str) -> Path | None:
    """Rename ``entry`` to a trash name this process owns, marked for deletion; ``None`` if it vanished."""
    mine = entry.parent / member_name(TRASH_PREFIX, target_name, mark=DELETING_MARK)
    try:
        os.rename(entry, mine)
    except FileNotFoundError:
        return None
    return mine


# Deletes the trash directories this process claimed, one at a time (should the process die first, the next cleaner
# deletes them). At the training loop's priority: the next save's write waits for it (``_writer.write_payload``).
_REMOVER = SerialThread("hf_resumable-trash")
atexit.register(_REMOVER.wait)


def wait_for_removals() -> None:
    """Block until every checkpoint this process removed with ``background=True`` is deleted from disk."""
    _REMOVER.wait()


def remove_dir(path: Path, *, background: bool = False) -> bool:
    """Remove a committed checkpoint directory unless a live reader pinned it; ``True`` if removed.

    1. Announce the removal (an owned ``.removing-`` file): readers that pin from now on wait for it.
    2. If a reader in another process has pinned it, withdraw and keep it; it was never moved.
    3. Rename it to a trash name this process owns (from now on nobody finds it as a checkpoint), make that
       durable, delete the trash (``background``: on a helper thread, see :func:`wait_for_removals`, unless
       ``HF_RESUMABLE_BACKGROUND_DELETES=0``), and withdraw the announcement.
    """
    announcement = path.parent / member_name(REMOVING_PREFIX, path.name)
    os.close(os.open(announcement, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    try:
        if live_pins(path.parent, path.name, ignore_own=True):
            logger.info("Kept %s: a reader has pinned it.", path)
            return False
        trash = claim(path, path.name)
        if trash is None:
            return False
        fsync_dir(path.parent)
        if background and tuning_options().background_deletes:
            _REMOVER.submit(functools.partial(shutil.rmtree, trash, ignore_errors=True))
        else:
            shutil.rmtree(trash, ignore_errors=True)
        return True
    finally:
        os.unlink(announcement)


def discard(path: Path) -> None:
    """Delete a temp dir this process owns (a failed save)."""
    shutil.rmtree(path, ignore_errors=True)
