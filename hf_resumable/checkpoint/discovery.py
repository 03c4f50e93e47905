"""Find the newest valid checkpoint, clean up after crashed saves, and apply retention safely."""

from __future__ import annotations

import logging
import math
import os
import re
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from .._urls import is_remote
from ..constants import CHECKPOINT_DIR_RE, PIN_PREFIX, REMOVING_PREFIX, TMP_PREFIX, TRASH_PREFIX
from ..distributed import rank_and_world_size
from ._reader import read_on_load
from .commit._durability import is_durable
from .commit._fs import claim, remove_dir, rename_noreplace
from .commit._owner import OwnerTag, owner_can_act, owner_is_alive, parse_member_name
from .commit._pins import entries_named, hold_pin, pin, unpin
from .commit.manifest import committed_manifest
from .verify import VerifyReport, verify_checkpoint

logger = logging.getLogger(__name__)

__all__ = ["list_checkpoints", "find_latest_checkpoint", "find_latest_verified", "cleanup_stale_temp_dirs",
           "apply_retention", "set_aside_checkpoint", "SET_ASIDE_PREFIX"]

# Where a checkpoint that failed its hashes during a resume is moved (``corrupt-checkpoint-8``): out of discovery's,
# retention's and the Trainer's ``checkpoint-*`` patterns, kept for inspection, never deleted by hf_resumable.
SET_ASIDE_PREFIX = "corrupt-"


def require_local(location: Any, function: str) -> None:
    """Refuse a remote location (``hf://``, object stores) with a ``ValueError`` naming the front function that takes
    it: the checkpoint core reads and writes local directories only."""
    if is_remote(location):
        raise ValueError(f"hf_resumable.checkpoint.{function} takes local directories; {os.fspath(location)!r} is "
                         f"remote. Use hf_resumable.{function} (or hf_resumable.locations.{function}), which looks "
                         "there (downloading and verifying what it reads).")


def list_checkpoints(root: str | os.PathLike, *,
                     pattern: re.Pattern[str] = CHECKPOINT_DIR_RE) -> list[tuple[int, Path]]:
    """``(step, path)`` of every ``checkpoint-N`` directory under ``root``, by step (not by mtime or name);
    ``pattern`` (first group: the number) selects another naming scheme, e.g. accelerate's
    ``checkpoint_<iteration>``."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = pattern.match(entry.name)
        if match and entry.is_dir():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def cleanup_stale_temp_dirs(root: str | os.PathLike) -> list[Path]:
    """Remove what saves, removals and readers of dead processes left next to the checkpoints; return what was removed.

    Only owned names whose owner is provably dead (or being killed) are touched, each first renamed to a name this
    process owns; an overwrite interrupted between its two renames is undone (docs/architecture.md, "Concurrency").
    """
    root = Path(root)
    removed: list[Path] = []
    for entry in entries_named(root, (TMP_PREFIX, TRASH_PREFIX, PIN_PREFIX, REMOVING_PREFIX)):
        owned = parse_member_name(entry.name)
        if owned is None or _owner_holds(owned.prefix, owned.owner):
            continue
        if owned.prefix in (PIN_PREFIX, REMOVING_PREFIX):
            unpin(entry)
        elif owned.prefix == TRASH_PREFIX and not owned.mark and _restore(entry, root / owned.target):
            continue
        else:
            _delete_claimed(claim(entry, owned.target), removed, entry)
    return removed


def _owner_holds(prefix: str, owner: OwnerTag) -> bool:
    """Whether an entry of ``owner`` must be left alone. A process being killed (``SIGKILL`` pending) runs none of its
    own code again, but its removal announcement is kept until it is dead: a rename it is inside may still move a
    checkpoint."""
    return owner_is_alive(owner) if prefix == REMOVING_PREFIX else owner_can_act(owner)


def _delete_claimed(claimed: Path | None, removed: list[Path], entry: Path) -> None:
    if claimed is None:
        return  # another cleaner took it
    if claimed.is_dir() and not claimed.is_symlink():
        shutil.rmtree(claimed, ignore_errors=True)
    else:  # a file: a deferred save's durability record staged beside its checkpoint (_durability.py)
        claimed.unlink(missing_ok=True)
    removed.append(entry)
    logger.info("Removed %s, left by a process that is gone", entry)


def _restore(trash: Path, target: Path) -> bool:
    """Put back a checkpoint whose removal (or overwrite) was interrupted, if its name is still free."""
    if os.path.lexists(target) or committed_manifest(trash) is None:
        return False
    try:
        rename_noreplace(trash, target)
    except OSError:
        return False
    logger.warning("Restored %s from %s (an overwrite of it was interrupted)", target, trash.name)
    return True


def find_latest_checkpoint(
    root: str | os.PathLike, *, cleanup: bool = True, full: bool = False, pattern: re.Pattern[str] = CHECKPOINT_DIR_RE,
) -> Path | None:
    """The newest ``checkpoint-N`` under the local ``root`` that passes verification, or None.

    Candidates that fail (interrupted, truncated, corrupt, hostile or unreadable) are skipped with a WARNING naming the
    reason. ``full=True`` hashes every file instead of those up to 4 MiB; ``cleanup`` first runs
    :func:`cleanup_stale_temp_dirs`. The checkpoint returned is pinned for this process (until its next call on the
    same ``root``, its next save into ``root``, its exit, or ``PIN_TTL``), so a concurrent writer's retention does not
    remove it. For ``s3://`` and ``hf://`` roots use :func:`hf_resumable.find_latest_checkpoint`.

    Example:

    ```python
    >>> latest = find_latest_checkpoint("out")  # doctest: +SKIP
    >>> latest.name  # doctest: +SKIP
    'checkpoint-1200'
    ```
    """
    report = find_latest_verified(root, cleanup=cleanup, full=full, pattern=pattern)
    return None if report is None else Path(report.path)


def find_latest_verified(
    root: str | os.PathLike, *, cleanup: bool = True, full: bool = False,
    pattern: re.Pattern[str] = CHECKPOINT_DIR_RE, below: int | None = None,
) -> VerifyReport | None:
    """:func:`find_latest_checkpoint`, returning the verification of the checkpoint it found (or None).

    ``open_checkpoint(report.path, verified=report)`` then neither verifies the checkpoint again nor reads the small
    files it kept a second time. ``below`` (a step) looks only at older checkpoints: the resume fallback's next
    candidate.

    Example:

    ```python
    >>> from hf_resumable.checkpoint import find_latest_verified, open_checkpoint
    >>> report = find_latest_verified("out")  # doctest: +SKIP
    >>> opened = open_checkpoint(report.path, verified=report)  # doctest: +SKIP
    ```
    """
    require_local(root, "find_latest_checkpoint")
    if cleanup:
        cleanup_stale_temp_dirs(root)
    key = os.path.abspath(root)  # the key of this process's pin on root (see _pins.release_pin)
    keep = read_on_load(rank_and_world_size()[0])
    for step, path in reversed(list_checkpoints(root, pattern=pattern)):
        if below is not None and step >= below:
            continue
        pin_path = pin(path)
        if pin_path is None:
            continue  # removed by retention meanwhile
        report, problems = _verify(path, full=full, keep=keep)
        if not problems:
            hold_pin(key, pin_path)
            return report
        unpin(pin_path)
        logger.warning("Skipping %s: %s", path, problems[:500])
    hold_pin(key, None)
    return None


def set_aside_checkpoint(path: str | os.PathLike) -> Path:
    """Move a checkpoint that failed its hashes out of every checkpoint pattern, kept for inspection:
    ``checkpoint-8`` -> ``corrupt-checkpoint-8`` beside it (``corrupt-checkpoint-8.2``... when taken), never
    replacing anything.

    Returns:
        `Path`: where it is now.

    Raises:
        OSError: it could not be renamed (a read-only file system, say).
    """
    path = Path(path)
    for attempt in range(1, 1000):
        target = path.with_name(f"{SET_ASIDE_PREFIX}{path.name}" + ("" if attempt == 1 else f".{attempt}"))
        try:
            rename_noreplace(path, target)
        except FileExistsError:
            continue
        return target
    raise FileExistsError(f"{path}: no free {SET_ASIDE_PREFIX}{path.name}.<n> name to move it to.")


def _verify(path: Path, *, full: bool, keep: Callable[[str], bool]) -> tuple[VerifyReport | None, str]:
    """The verification of ``path`` and why it is not a valid checkpoint ('' if it is); never raises."""
    try:
        report = verify_checkpoint(path, full=full, keep=keep)
    except Exception as err:  # noqa: BLE001 - one bad candidate must never stop the fallback
        return None, f"could not be verified ({type(err).__name__}: {err})"
    return report, "; ".join(f"{f}: {why}" for f, why in report.problems)


def apply_retention(
    root: str | os.PathLike,
    *,
    keep_last: int = 2,
    best_metric: str | None = None,
    greater_is_better: bool = False,
    protect: Iterable[str | os.PathLike] = (),
    pattern: re.Pattern[str] = CHECKPOINT_DIR_RE,
    background: bool = False,
) -> list[Path]:
    """Delete old committed checkpoints, keeping the newest ``keep_last``, the best one and ``protect``.

    Call it only after the newest checkpoint has committed (the save functions do). It orders by step, never touches a
    directory without a valid manifest, and never deletes the newest durable valid checkpoint or what a live reader
    has pinned (docs/checkpoints.md#guarantees).

    Args:
        keep_last (`int`, *optional*, defaults to 2): newest checkpoints to keep (>= 1).
        best_metric (`str`, *optional*): keep the checkpoint with the best value of this metric
            (as passed to ``save_checkpoint(metrics=...)``).
        greater_is_better (`bool`, *optional*, defaults to `False`): direction of ``best_metric``.
        protect (`Iterable[str | os.PathLike]`, *optional*): paths never to delete (e.g. uploads in flight).
        pattern (`re.Pattern`, *optional*): directory-name regex (first group: the step), defaults to
            ``checkpoint-<N>``.
        background (`bool`, *optional*, defaults to `False`): return once each removed checkpoint is renamed out of
            the way and delete its files on a helper thread, which ``wait_for_pending_saves()`` and interpreter exit
            wait for.

    Returns:
        `list[Path]`: the deleted checkpoints.

    Raises:
        ValueError: if ``keep_last < 1``.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 (the newest valid checkpoint is always kept), got {keep_last}.")
    from .background.async_save import BACKGROUND_SAVER  # below this module in the import order

    BACKGROUND_SAVER.wait_until_durable()  # this process's newest checkpoint counts once its fsyncs are done
    committed = [(step, path, manifest) for step, path in list_checkpoints(root, pattern=pattern)
                 if (manifest := committed_manifest(path)) is not None]
    keep = {path for _, path, _ in committed[-keep_last:]}
    # the newest valid checkpoint whose files are known to be on the disk: a deferred save's is not until its fsyncs
    # are done (_durability.py), and a crash before that may tear it
    newest_valid = next((p for _, p, _ in reversed(committed)
                         if is_durable(p) and verify_checkpoint(p, full=False).ok), None)
    if newest_valid is not None:
        keep.add(newest_valid)
    if best_metric is not None:
        scored = [(m.metrics[best_metric], p) for _, p, m in committed
                  if isinstance(m.metrics.get(best_metric), (int, float)) and not math.isnan(m.metrics[best_metric])]
        if scored:
            keep.add((max if greater_is_better else min)(scored, key=lambda item: item[0])[1])
    keep |= {Path(p).resolve() for p in protect}
    deleted = []
    for _, path, _ in committed:
        if path in keep or path.resolve() in keep:
            continue
        if remove_dir(path, background=background):
            deleted.append(path)
            logger.info("Retention removed %s", path)
    return deleted
