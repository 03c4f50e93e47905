"""Reader pins: a reader about to load a checkpoint keeps retention from removing it under it. The pin and remover
protocol (each side writes its own flag, then looks for the other's) is docs/architecture.md's "Reader pins". Flags
of dead processes, and the pin of a process being killed, are ignored and cleaned up.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
import time
from pathlib import Path

from ...constants import MANIFEST_FILE, PIN_PREFIX, PIN_TTL, REMOVING_PREFIX
from ._owner import current_owner, member_name, owner_can_act, owner_is_alive, parse_member_name

logger = logging.getLogger(__name__)

__all__ = ["pin", "unpin", "live_pins", "removal_announced", "hold_pin", "release_pin", "release_held_pins",
           "entries_named"]

# How long a reader waits for a live remover to finish (removals take as long as deleting the files; this only
# bounds a remover that was stopped between its steps 1 and 3).
PIN_WAIT = 60.0

_held: dict[str, Path] = {}
_held_lock = threading.Lock()


def pin(directory: Path) -> Path | None:
    """Pin the checkpoint ``directory``; the pin's path (``None``: the checkpoint is gone). Where no pin can be created
    (a read-only directory, where nothing can remove it either) the checkpoint is reported present without one."""
    parent, name = directory.parent, directory.name
    pin_path = parent / member_name(PIN_PREFIX, name)
    try:
        os.close(os.open(pin_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    except OSError as err:
        logger.debug("Cannot pin %s (%s); reading it unpinned.", directory, err)
        return pin_path if _present(directory) else None
    deadline = time.monotonic() + PIN_WAIT
    while removal_announced(parent, name) and time.monotonic() < deadline:
        time.sleep(0.002)
    if _present(directory):
        return pin_path
    unpin(pin_path)
    return None


def unpin(pin_path: Path | None) -> None:
    """Remove a pin made by :func:`pin` (missing pins are fine)."""
    if pin_path is not None:
        with contextlib.suppress(OSError):
            os.unlink(pin_path)


def hold_pin(key: str, pin_path: Path | None) -> None:
    """Keep ``pin_path`` as this process's pin for ``key`` (a run root), releasing the previous one."""
    with _held_lock:
        previous = _held.pop(key, None)
        if pin_path is not None:
            _held[key] = pin_path
    if previous is not None and previous != pin_path:
        unpin(previous)


def release_pin(root: str | os.PathLike) -> None:
    """Release this process's pin for the run ``root`` (held since :func:`hold_pin`), if any: a save into ``root``
    calls it, so that the pin does not outlive a save that fails in a process that keeps running."""
    hold_pin(os.path.abspath(root), None)


@atexit.register
def release_held_pins() -> None:
    """Remove every pin this process holds (also run at interpreter exit)."""
    with _held_lock:
        pins = list(_held.values())
        _held.clear()
    for pin_path in pins:
        unpin(pin_path)


def live_pins(parent: Path, name: str, *, ignore_own: bool) -> list[Path]:
    """Pins on ``parent/name`` that still protect it (younger than ``PIN_TTL``, of an owner that can still read: not
    dead, not being killed)."""
    me = current_owner()
    found = []
    for entry in entries_named(parent, f"{PIN_PREFIX}{name}."):
        owned = parse_member_name(entry.name)
        if owned is None or owned.target != name or (ignore_own and owned.owner == me):
            continue
        try:
            age = time.time() - entry.lstat().st_mtime
        except FileNotFoundError:
            continue
        if age < PIN_TTL and owner_can_act(owned.owner):
            found.append(entry)
    return found


def _present(directory: Path) -> bool:
    return os.path.lexists(directory / MANIFEST_FILE)


def removal_announced(parent: Path, name: str) -> bool:
    """Whether a live remover has announced that it is removing ``parent/name``."""
    for entry in entries_named(parent, f"{REMOVING_PREFIX}{name}."):
        owned = parse_member_name(entry.name)
        if owned is not None and owned.target == name and owner_is_alive(owned.owner):
            return True
    return False


def entries_named(parent: Path, prefix: str | tuple[str, ...]) -> list[Path]:
    """The entries of ``parent`` whose names start with ``prefix`` (none if it cannot be listed)."""
    try:
        with os.scandir(parent) as it:
            return [Path(e.path) for e in it if e.name.startswith(prefix)]
    except OSError:
        return []
