"""Reader pins: a reader that is about to load a checkpoint keeps retention from removing it under it.

A pin is an empty file ``.pin-<checkpoint>.<owner>.<nonce>`` next to the checkpoint. The protocol,
with the remover's steps in ``_fs.remove_dir``:

========================================  ==========================================================
reader (``pin``)                          remover (``remove_dir``)
========================================  ==========================================================
1. create the pin                         1. rename the checkpoint to its own trash name
2. if the checkpoint is there: pinned     2. if a live pin exists: rename it back, keep it
3. else wait while an undecided trash     3. else mark the trash decided (``.d``) and delete it
   of that name exists, then look again
========================================  ==========================================================

If the pin exists before the remover's step 2, the remover puts the checkpoint back and the reader,
waiting at its step 3, finds it; if it came later, the remover had already decided and the reader
sees the checkpoint gone (``find_latest_checkpoint`` then takes the next one). A reader therefore
never holds a path that retention deletes. Pins of dead processes are ignored and cleaned up; a pin
older than ``PIN_TTL`` stops protecting (a reader that sleeps for an hour does not block retention
forever). Where the directory is read-only nothing can be deleted anyway, and no pin is made.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from pathlib import Path

from ..constants import MANIFEST_FILE, PIN_PREFIX, PIN_TTL, TRASH_PREFIX
from ._owner import current_owner, member_name, owner_is_alive, parse_member_name

logger = logging.getLogger(__name__)

__all__ = ["pin", "unpin", "live_pins", "hold_pin", "release_held_pins"]

# How long a reader waits for a remover to decide about a checkpoint it has renamed away (it decides at once;
# this only bounds a remover that was stopped between its steps 1 and 3).
PIN_WAIT = 10.0

_held: dict[str, Path] = {}
_held_lock = threading.Lock()


def pin(directory: Path) -> Path | None:
    """Pin the checkpoint ``directory``; the pin's path (``None``: the checkpoint is gone).

    Where no pin can be created (a read-only directory), nothing can remove the checkpoint either: the
    checkpoint is reported present without a pin (the returned path then does not exist).
    """
    parent, name = directory.parent, directory.name
    pin_path = parent / member_name(PIN_PREFIX, name)
    try:
        os.close(os.open(pin_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    except OSError as err:
        logger.debug("Cannot pin %s (%s); reading it unpinned.", directory, err)
        return pin_path if _present(directory) else None
    if _present(directory):
        return pin_path
    deadline = time.monotonic() + PIN_WAIT
    while _undecided_trash(parent, name) and time.monotonic() < deadline:
        time.sleep(0.005)
    if _present(directory):
        return pin_path
    unpin(pin_path)
    return None


def unpin(pin_path: Path | None) -> None:
    """Remove a pin made by :func:`pin` (missing pins are fine)."""
    if pin_path is not None:
        try:
            os.unlink(pin_path)
        except OSError:
            pass


def hold_pin(key: str, pin_path: Path | None) -> None:
    """Keep ``pin_path`` as this process's pin for ``key`` (a run root), releasing the previous one."""
    with _held_lock:
        previous = _held.pop(key, None)
        if pin_path is not None:
            _held[key] = pin_path
    if previous is not None and previous != pin_path:
        unpin(previous)


@atexit.register
def release_held_pins() -> None:
    """Remove every pin this process holds (also run at interpreter exit)."""
    with _held_lock:
        pins = list(_held.values())
        _held.clear()
    for pin_path in pins:
        unpin(pin_path)


def live_pins(parent: Path, name: str, *, ignore_own: bool) -> list[Path]:
    """Pins on ``parent/name`` that still protect it (live owner, younger than ``PIN_TTL``)."""
    me = current_owner()
    found = []
    for entry in _entries(parent, f"{PIN_PREFIX}{name}."):
        owned = parse_member_name(entry.name)
        if owned is None or owned.target != name or (ignore_own and owned.owner == me):
            continue
        try:
            age = time.time() - entry.lstat().st_mtime
        except FileNotFoundError:
            continue
        if age < PIN_TTL and owner_is_alive(owned.owner):
            found.append(entry)
    return found


def _present(directory: Path) -> bool:
    return os.path.lexists(directory / MANIFEST_FILE)


def _undecided_trash(parent: Path, name: str) -> bool:
    for entry in _entries(parent, f"{TRASH_PREFIX}{name}."):
        owned = parse_member_name(entry.name)
        if owned is not None and owned.target == name and not owned.mark and owner_is_alive(owned.owner):
            return True
    return False


def _entries(parent: Path, prefix: str) -> list[Path]:
    try:
        with os.scandir(parent) as it:
            return [Path(e.path) for e in it if e.name.startswith(prefix)]
    except OSError:
        return []
