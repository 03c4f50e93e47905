"""Where :class:`~hf_resumable.integrations.accelerate.ResumableAccelerator` saves and what it refuses to touch:
accelerate's automatic ``checkpoint_<iteration>`` naming, the files ``save_state`` pre-hooks write, and the typed
errors of these decisions (whether a target directory may be replaced is ``checkpoint._writer.save_refusal``).

Planning functions are pure; the few that look at the disk say so.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from pathlib import Path

from ..constants import (
    AUTOMATIC_CHECKPOINT_RE,
    CONFIG_FILE,
    DATA_STATE_DIR,
    FROZEN_RECORD_FILE,
    GENERATION_CONFIG_FILE,
    MANIFEST_FILE,
    MODEL_FILES_RE,
    MODEL_INDEX_FILE,
    OPTIMIZER_FILES_RE,
    OPTIMIZER_INDEX_FILE,
    RNG_DIR,
    STATE_TENSORS_FILE,
    TMP_PREFIX,
    TRAINABLE_FILES_RE,
    TRAINABLE_INDEX_FILE,
    TRAINING_STATE_FILE,
    TRASH_PREFIX,
)
from ..errors import CheckpointExistsError, CheckpointNotFoundError, HfResumableError

__all__ = [
    "AUTOMATIC_CHECKPOINT_RE",
    "CheckpointPathNotFoundError",
    "CheckpointIterationExistsError",
    "HookFileConflictError",
    "automatic_name",
    "next_iteration",
    "collect_hook_files",
    "hook_file_conflicts",
]


class CheckpointPathNotFoundError(CheckpointNotFoundError, ValueError):
    """``load_state(path)`` of a path that does not exist (also a ``ValueError``, which accelerate raises)."""


class CheckpointIterationExistsError(CheckpointExistsError, ValueError):
    """accelerate's automatic ``checkpoint_<iteration>`` already exists (also the ``ValueError`` accelerate raises)."""


class HookFileConflictError(HfResumableError, ValueError):
    """A ``save_state`` pre-hook wrote a file whose name the hf_resumable checkpoint format uses itself."""


def automatic_name(iteration: int) -> str:
    """accelerate's automatic checkpoint directory name."""
    if iteration < 0:
        raise ValueError(f"ProjectConfiguration.iteration must be >= 0, got {iteration}.")
    return f"checkpoint_{iteration}"


def next_iteration(current: int, *, loaded: int | None, existing: Iterable[int]) -> int:
    """The iteration the next automatic save uses after a resume: never one that exists already.

    accelerate leaves ``ProjectConfiguration.iteration`` to the user (a resumed script must set it, or its next
    save collides). Here it becomes the largest of the configured value, the loaded checkpoint's iteration + 1
    and every existing ``checkpoint_<i>`` + 1 (a corrupt newer one included).

    Example:

    ```python
    >>> next_iteration(0, loaded=3, existing=[0, 1, 2, 3, 4])
    5
    ```
    """
    candidates = [current, *(i + 1 for i in existing)]
    if loaded is not None:
        candidates.append(loaded + 1)
    return max(candidates)


def collect_hook_files(staging: Path) -> dict[str, bytes]:
    """Every regular file under ``staging`` (relative POSIX path -> bytes), for ``save_checkpoint(extra_files=...)``.

    Raises:
        HookFileConflictError: for a symbolic link or another non-regular entry (its content is not defined).
    """
    files: dict[str, bytes] = {}
    for root, dirs, names in os.walk(staging):
        for name in sorted(dirs + names):
            path = Path(root) / name
            info = os.lstat(path)
            if stat.S_ISDIR(info.st_mode):
                continue
            relpath = path.relative_to(staging).as_posix()
            if not stat.S_ISREG(info.st_mode):
                raise HookFileConflictError(f"A save_state pre-hook created {relpath!r}, which is not a regular file "
                                            "(e.g. a symbolic link); write regular files only.")
            files[relpath] = path.read_bytes()
    return files


def hook_file_conflicts(relpaths: Iterable[str], *, model_slot: bool, optimizer_slot: bool) -> list[str]:
    """Hook files whose names the checkpoint writes itself (pure)."""
    conflicts = []
    for relpath in relpaths:
        top = relpath.split("/", 1)[0]
        reserved = (
            relpath in (MANIFEST_FILE, TRAINING_STATE_FILE, STATE_TENSORS_FILE)
            or top in (RNG_DIR, DATA_STATE_DIR) or top.startswith((TMP_PREFIX, TRASH_PREFIX))
            or (model_slot and (relpath in (MODEL_INDEX_FILE, TRAINABLE_INDEX_FILE, FROZEN_RECORD_FILE)
                                or MODEL_FILES_RE.fullmatch(relpath) is not None
                                or TRAINABLE_FILES_RE.fullmatch(relpath) is not None
                                or relpath in (CONFIG_FILE, GENERATION_CONFIG_FILE)))
            or (optimizer_slot and (relpath == OPTIMIZER_INDEX_FILE
                                    or OPTIMIZER_FILES_RE.fullmatch(relpath) is not None))
        )
        if reserved:
            conflicts.append(relpath)
    return conflicts
