"""Deferred durability: a blocking save commits once its files are in the page cache and fsyncs them afterwards on the
saver's thread, with a ``.durability`` record (the writer's boot id) written before the rename and replaced by a
durable one once every fsync is done. What each failure then costs: docs/checkpoints.md#guarantees; the steps:
docs/architecture.md, "Deferred durability". Overwrites and systems without a boot id fsync before the commit.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ...constants import DURABILITY_FILE, TMP_PREFIX
from ...distributed import all_gather_json, broadcast_json, rank_and_world_size
from ...errors import CorruptCheckpointError
from ...format._jsonio import json_bytes, parse_json
from ...format._safefile import open_regular, read_regular_file
from ._fs import fsync_dir, fsync_tree, write_bytes_durably
from ._owner import member_name

logger = logging.getLogger(__name__)

DURABILITY_MODES = ("deferred", "immediate")
_BOOT_ID_FILE = "/proc/sys/kernel/random/boot_id"
_MAX_RECORD_BYTES = 4096


@functools.cache
def boot_id() -> str | None:
    """This machine's boot id (Linux), or ``None`` where there is none: deferral is then off."""
    try:
        with open(_BOOT_ID_FILE, encoding="ascii") as f:
            value = f.read(64).strip()
    except OSError:
        return None
    return value or None


def check_durability(durability: str) -> str:
    """``durability`` if it is one of :data:`DURABILITY_MODES`.

    Raises:
        ValueError: naming the accepted values.
    """
    if durability not in DURABILITY_MODES:
        raise ValueError(f"durability must be one of {', '.join(map(repr, DURABILITY_MODES))}, got {durability!r}: "
                         "'deferred' commits once the files are written and fsyncs them on the saver's thread, "
                         "'immediate' fsyncs every file before the commit.")
    return durability


def mark_pending(tmp: Path) -> None:
    """Write the record (this boot's id, not durable) into the temp dir ``tmp``; fsync it and the directory entry."""
    write_bytes_durably(tmp / DURABILITY_FILE, json_bytes({"boot_id": boot_id(), "durable": False}))
    fsync_dir(tmp)


def pending_boot(directory: str | os.PathLike) -> str | None:
    """The boot id of a checkpoint whose durability is not confirmed yet: ``None`` if it is durable (no record: an
    immediate save's, or one that says durable), ``""`` if the record cannot be read (then no boot is trusted)."""
    path = Path(directory) / DURABILITY_FILE
    try:  # read_regular_file never blocks on a FIFO planted there
        document = parse_json(read_regular_file(path, limit=_MAX_RECORD_BYTES), source=str(path))
    except FileNotFoundError:
        return None
    except Exception:  # noqa: BLE001 - an unreadable, torn or crafted record: trust no boot
        return ""
    if not isinstance(document, dict):
        return ""
    if document.get("durable") is True:
        return None
    value = document.get("boot_id")
    return value if isinstance(value, str) else ""


def is_durable(directory: str | os.PathLike) -> bool:
    """Whether every file of the committed ``directory`` is known to be on the disk."""
    return pending_boot(directory) is None


def needs_every_byte(directory: str | os.PathLike) -> bool:
    """Whether a reader must hash every byte of ``directory`` before trusting it: its durability was never confirmed
    and it was written before this machine's last boot (or on another machine), so a crash may have torn it."""
    pending = pending_boot(directory)
    return pending is not None and (not pending or pending != boot_id())


def make_durable(target: Path, written: Iterable[str], *, group: Any = None) -> None:
    """Step 3 of a deferred save (collective over ``group``): fsync the files this rank wrote; once every rank has,
    rank 0 fsyncs the directories, records ``target`` durable and fsyncs it and its parent. Files removed or replaced
    meanwhile are skipped with a WARNING, and the record keeps saying not durable.

    Raises:
        OSError: this rank's fsync failed (its errno kept); RuntimeError: another rank's did. The record still says
        not durable.
    """
    error, changed = None, []
    try:
        for relpath in written:
            if not _fsync_file(target / relpath):
                changed.append(relpath)
    except OSError as err:
        error = err
    gathered = all_gather_json({"error": None if error is None else f"{type(error).__name__}: {error}",
                                "changed": changed}, group=group)
    if error is not None:
        raise error
    failed = [entry["error"] for entry in gathered if entry["error"] is not None]
    if failed:
        raise RuntimeError(f"making {target} durable failed on another rank: {failed[0]}")
    changed = [relpath for entry in gathered for relpath in entry["changed"]]
    outcome = None
    if changed:
        logger.warning("%s changed before its files were fsynced (%s removed or replaced); it is left as it is and "
                       "does not count as durable.", target, ", ".join(changed[:3]))
    elif rank_and_world_size()[0] == 0:
        try:
            fsync_tree(target)
            _record_durable(target)
            fsync_dir(target.parent)
        except FileNotFoundError:
            logger.warning("%s was removed before its files were fsynced.", target)
        except OSError as err:
            error, outcome = err, f"{type(err).__name__}: {err}"
    outcome = broadcast_json(outcome, group=group)  # every rank raises alike
    if error is not None:
        raise error
    if outcome is not None:
        raise RuntimeError(f"making {target} durable failed on rank 0: {outcome}")
    logger.debug("%s is durable", target)


def _record_durable(target: Path) -> None:
    """Replace ``target``'s record with one that says durable: staged under an owned name beside ``target``, renamed
    over the record, the directory fsynced. The record is never removed, so a copy made meanwhile never misses it."""
    if not (target / DURABILITY_FILE).exists():
        raise FileNotFoundError(errno.ENOENT, "no durability record", str(target / DURABILITY_FILE))
    staged = target.parent / member_name(TMP_PREFIX, f"{target.name}{DURABILITY_FILE}")
    write_bytes_durably(staged, json_bytes({"boot_id": boot_id(), "durable": True}))
    try:
        os.replace(staged, target / DURABILITY_FILE)
    except BaseException:
        staged.unlink(missing_ok=True)
        raise
    fsync_dir(target)


def _fsync_file(path: Path) -> bool:
    """fsync the regular file ``path``; ``False`` if it is gone or is something else now (never blocks on a FIFO)."""
    try:
        with open_regular(path, buffering=0) as f:
            os.fsync(f.fileno())
    except (FileNotFoundError, NotADirectoryError, CorruptCheckpointError):
        return False
    return True
