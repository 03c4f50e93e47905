"""Where :class:`~hf_resumable.integrations.accelerate.ResumableAccelerator` saves and what it refuses to touch:
accelerate's automatic ``checkpoint_<iteration>`` naming, the files ``save_state`` pre-hooks write, and the typed
errors of these decisions (whether a target directory may be replaced is ``checkpoint.commit._writer.save_refusal``).
``save_state``'s target (:func:`save_target`, :func:`check_target`) and what follows its commit (:func:`after_commit`:
the upload, then retention) are functions of the accelerator.

Planning functions are pure; the few that look at the disk say so.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from ..checkpoint import apply_retention
from ..checkpoint.commit import save_refusal
from ..constants import (
    AUTOMATIC_CHECKPOINT_RE,
    CHECKPOINT_DIR_RE,
    CHECKPOINT_PREFIX,
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
from ..distributed import broadcast_json
from ..errors import CheckpointExistsError, CheckpointNotFoundError, HfResumableError
from ._core import DEFAULT

if TYPE_CHECKING:
    from .accelerate import ResumableAccelerator

__all__ = [
    "AUTOMATIC_CHECKPOINT_RE",
    "CheckpointPathNotFoundError",
    "CheckpointIterationExistsError",
    "HookFileConflictError",
    "automatic_name",
    "next_iteration",
    "collect_hook_files",
    "hook_file_conflicts",
    "DEFAULT_KEEP_LAST",
    "NAMING_AUTOMATIC",
    "NAMING_EXPLICIT",
    "NAMING_STEPS",
    "after_commit",
    "check_target",
    "keep_count",
    "pending_uploads",
    "retains",
    "save_target",
]

# Where save_state() writes (see ResumableAccelerator.save_state).
NAMING_AUTOMATIC = "automatic"  # ProjectConfiguration(automatic_checkpoint_naming=True): checkpoint_<iteration>
NAMING_EXPLICIT = "explicit"  # save_state(output_dir)
NAMING_STEPS = "steps"  # save_state(): checkpoint-<global_step>
DEFAULT_KEEP_LAST = 2  # checkpoint-<step> checkpoints kept when neither keep_last nor total_limit is given


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


def save_target(accelerator: ResumableAccelerator, output_dir: str | os.PathLike | None) -> tuple[str, Path]:
    """``(naming, directory)`` of a ``save_state(output_dir)``: accelerate's automatic ``checkpoint_<iteration>``,
    ``output_dir``, or ``checkpoint-<global_step>`` under ``checkpoint_dir``."""
    if accelerator.project_configuration.automatic_checkpoint_naming:
        return NAMING_AUTOMATIC, accelerator.checkpoint_dir / automatic_name(accelerator.save_iteration)
    if output_dir is not None:
        return NAMING_EXPLICIT, Path(output_dir)
    return NAMING_STEPS, accelerator.checkpoint_dir / f"{CHECKPOINT_PREFIX}{accelerator.global_step}"


def check_target(accelerator: ResumableAccelerator, mode: str, target: Path) -> None:
    """Refuse a target on every process alike (the main process looks), before any collective of the save."""
    automatic = mode == NAMING_AUTOMATIC  # accelerate never replaces a checkpoint_<iteration>
    reason = broadcast_json(save_refusal(target, overwrite=not automatic) if accelerator.is_main_process else None)
    if reason is not None and automatic:
        raise CheckpointIterationExistsError(
            f"Checkpoint directory {target} ({accelerator.save_iteration}) already exists. Set "
            "accelerator.project_configuration.iteration to the iteration to continue with, or resume with "
            "load_state(), which continues after the newest checkpoint_<i>.")
    if reason is not None:
        raise CheckpointExistsError(reason)


def keep_count(accelerator: ResumableAccelerator) -> int | None:
    """Checkpoints kept after a commit: ``keep_last`` if given, else ``total_limit``, else the naming's default."""
    if accelerator.resume_options.keep_last is not DEFAULT:
        return accelerator.resume_options.keep_last
    if accelerator.project_configuration.total_limit is not None:
        return accelerator.project_configuration.total_limit
    return None if accelerator.project_configuration.automatic_checkpoint_naming else DEFAULT_KEEP_LAST


def retains(accelerator: ResumableAccelerator, mode: str) -> bool:
    """Whether a save of this naming ``mode`` is followed by retention."""
    return mode != NAMING_EXPLICIT and keep_count(accelerator) is not None


def pending_uploads(accelerator: ResumableAccelerator) -> set[Path]:
    """Local checkpoints whose upload is not confirmed yet (resolved paths)."""
    uploader = accelerator._uploader
    return {Path(path).resolve() for path in uploader.pending()} if uploader is not None else set()


def after_commit(accelerator: ResumableAccelerator, mode: str, target: Path) -> None:
    """What follows a commit: the upload, then retention of the automatic namings (never before the commit)."""
    if accelerator._uploader is not None:
        accelerator._uploader.submit(target)
    keep = keep_count(accelerator)
    if not retains(accelerator, mode) or not accelerator.is_main_process:
        return
    pattern = AUTOMATIC_CHECKPOINT_RE if mode == NAMING_AUTOMATIC else CHECKPOINT_DIR_RE
    # In the foreground, as accelerate's own total_limit: upstream's tests count the entries of the directory.
    apply_retention(accelerator.checkpoint_dir, keep_last=keep, pattern=pattern, protect=pending_uploads(accelerator))
