"""Find the newest valid checkpoint, clean up after crashed saves, and apply retention safely."""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Iterable
from pathlib import Path

from ..constants import CHECKPOINT_DIR_RE, TMP_PREFIX, TRASH_PREFIX
from ..errors import HfResumableError
from ._fs import is_stale_temp, remove_dir
from .manifest import read_manifest
from .verify import verify_checkpoint

logger = logging.getLogger(__name__)

__all__ = ["list_checkpoints", "find_latest_checkpoint", "cleanup_stale_temp_dirs", "apply_retention"]


def list_checkpoints(root: str | os.PathLike, *, pattern: re.Pattern[str] = CHECKPOINT_DIR_RE) -> list[tuple[int, Path]]:
    """``(step, path)`` of every ``checkpoint-N`` directory under ``root``, by step (not by mtime or name).

    ``pattern`` (a compiled regex whose first group is the number) selects another naming scheme, e.g.
    accelerate's ``checkpoint_<iteration>``.
    """
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
    """Remove temp and trash dirs left by saves whose process is gone. Returns what was removed."""
    root = Path(root)
    removed = []
    if not root.is_dir():
        return removed
    for entry in root.iterdir():
        if entry.is_dir() and entry.name.startswith((TMP_PREFIX, TRASH_PREFIX)) and is_stale_temp(entry):
            import shutil

            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
            logger.info("Removed %s left by an interrupted save", entry)
    return removed


def find_latest_checkpoint(
    root: str | os.PathLike, *, cleanup: bool = True, full: bool = False, storage_options: dict | None = None,
    pattern: re.Pattern[str] = CHECKPOINT_DIR_RE,
) -> Path | str | None:
    """The newest ``checkpoint-N`` under ``root`` that passes verification, or None.

    Directories without a manifest (interrupted saves) or with truncated/corrupt files are skipped
    with a WARNING naming the reason. Quick verification is the default (sizes, headers, hashes of
    files up to 4 MiB); ``full=True`` hashes every file. With ``cleanup``, stale temp dirs of dead
    writers are removed. ``root`` may be an fsspec URL (``s3://bucket/run``): the result is then the
    URL of the newest remote checkpoint whose manifest and files are all present.

    Example:

    ```python
    >>> latest = find_latest_checkpoint("out")  # doctest: +SKIP
    >>> latest.name
    'checkpoint-1200'
    ```
    """
    from ..storage import find_latest_remote_checkpoint, is_remote_url

    if is_remote_url(root):
        return find_latest_remote_checkpoint(os.fspath(root), storage_options=storage_options)
    if cleanup:
        cleanup_stale_temp_dirs(root)
    for step, path in reversed(list_checkpoints(root, pattern=pattern)):
        report = verify_checkpoint(path, full=full)
        if report.ok:
            return path
        logger.warning("Skipping %s: %s", path, "; ".join(f"{f}: {why}" for f, why in report.problems)[:500])
    return None


def apply_retention(
    root: str | os.PathLike,
    *,
    keep_last: int = 2,
    best_metric: str | None = None,
    greater_is_better: bool = False,
    protect: Iterable[str | os.PathLike] = (),
    pattern: re.Pattern[str] = CHECKPOINT_DIR_RE,
) -> list[Path]:
    """Delete old committed checkpoints, keeping the newest ``keep_last``, the best one and ``protect``.

    Call it only after the newest checkpoint has committed (the save functions do). It never deletes
    the newest valid checkpoint, never touches directories without a valid manifest (they may belong
    to a save in progress), orders by step (not mtime or string), and removes by renaming first so a
    half-deleted directory never looks like a checkpoint.

    Args:
        keep_last (`int`, *optional*, defaults to 2): newest checkpoints to keep (>= 1).
        best_metric (`str`, *optional*): keep the checkpoint with the best value of this metric
            (as passed to ``save_checkpoint(metrics=...)``).
        greater_is_better (`bool`, *optional*, defaults to `False`): direction of ``best_metric``.
        protect (`Iterable[str | os.PathLike]`, *optional*): paths never to delete (e.g. uploads in flight).
        pattern (`re.Pattern`, *optional*): directory-name regex (first group: the step), defaults to
            ``checkpoint-<N>``.

    Returns:
        `list[Path]`: the deleted checkpoints.

    Raises:
        ValueError: if ``keep_last < 1``.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 (the newest valid checkpoint is always kept), got {keep_last}.")
    committed = []
    for step, path in list_checkpoints(root, pattern=pattern):
        try:
            committed.append((step, path, read_manifest(path)))
        except HfResumableError:
            continue
    keep = {path for _, path, _ in committed[-keep_last:]}
    newest_valid = next((p for _, p, _ in reversed(committed) if verify_checkpoint(p, full=False).ok), None)
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
        remove_dir(path)
        deleted.append(path)
        logger.info("Retention removed %s", path)
    return deleted
