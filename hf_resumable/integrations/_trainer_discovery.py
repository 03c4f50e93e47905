"""Which checkpoint ``ResumableTrainer.train(resume_from_checkpoint=...)`` continues from, and which directories of
``output_dir`` the run must leave alone. PURE over directory listings.

A ``checkpoint-<step>`` is **ours** (a manifest), **stock** (the stock ``Trainer``'s files: resumed, converted, not
bit-exact; docs/trainer.md, "Switching from the stock Trainer") or **foreign** (anything else not empty).
hf_resumable never overwrites a stock or foreign directory, so a run that would save over one is refused when
``train`` starts (:func:`colliding_checkpoints`).
"""

from __future__ import annotations

import enum
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from ..checkpoint import list_checkpoints
from ..constants import (
    ADAPTER_WEIGHTS_FILE,
    MANIFEST_FILE,
    MODEL_INDEX_FILE,
    SINGLE_MODEL_FILE,
    STOCK_PICKLED_ADAPTER_FILE,
    STOCK_PICKLED_WEIGHTS_FILE,
    STOCK_PICKLED_WEIGHTS_INDEX_FILE,
    TRAINER_STATE_FILE,
    TRAINING_STATE_FILE,
)
from ..errors import CheckpointExistsError, CheckpointNotFoundError

logger = logging.getLogger(__name__)

__all__ = ["CheckpointKind", "CheckpointDir", "ResumeCheckpointNotFoundError", "classify_checkpoint_dir",
           "is_stock_trainer_checkpoint", "newest_stock_checkpoint", "colliding_checkpoints",
           "collision_error", "not_a_checkpoint_error", "CONVERTED_DIR"]

# Hidden directory of output_dir where stock checkpoints are converted before they are loaded.
CONVERTED_DIR = ".hf-resumable-converted"
_STOCK_STATE = TRAINER_STATE_FILE
_STOCK_WEIGHTS = (SINGLE_MODEL_FILE, MODEL_INDEX_FILE, ADAPTER_WEIGHTS_FILE, STOCK_PICKLED_WEIGHTS_FILE,
                  STOCK_PICKLED_WEIGHTS_INDEX_FILE, STOCK_PICKLED_ADAPTER_FILE)
CONVERT_HINT = "hf-resumable convert"


class ResumeCheckpointNotFoundError(CheckpointNotFoundError, ValueError):
    """``resume_from_checkpoint`` names something that is not a checkpoint ResumableTrainer can resume.

    Also a ``ValueError`` (what ``transformers.Trainer`` raises there) and a ``FileNotFoundError``.
    """


class CheckpointKind(enum.Enum):
    """Who wrote a ``checkpoint-<step>`` directory."""

    OURS = "hf_resumable"
    STOCK = "transformers.Trainer"
    FOREIGN = "another tool"


@dataclass(frozen=True)
class CheckpointDir:
    """A ``checkpoint-<step>`` directory of ``output_dir`` and who wrote it."""

    step: int
    path: Path
    kind: CheckpointKind


def is_stock_trainer_checkpoint(path: Path) -> bool:
    """Whether ``path`` looks like a checkpoint the stock ``transformers.Trainer`` wrote (and nothing of ours)."""
    if (path / MANIFEST_FILE).exists() or (path / TRAINING_STATE_FILE).exists():
        return False
    return (path / _STOCK_STATE).is_file() and any((path / name).is_file() for name in _STOCK_WEIGHTS)


def classify_checkpoint_dir(path: Path) -> CheckpointKind | None:
    """The kind of ``path``; ``None`` when it does not exist or is an empty directory (nothing to protect).

    Example:

    ```python
    >>> classify_checkpoint_dir(Path("does-not-exist")) is None
    True
    ```
    """
    try:
        if not path.is_dir() or not any(path.iterdir()):
            return None
    except OSError:
        return CheckpointKind.FOREIGN
    if (path / MANIFEST_FILE).exists():
        return CheckpointKind.OURS
    return CheckpointKind.STOCK if is_stock_trainer_checkpoint(path) else CheckpointKind.FOREIGN


def _directories(output_dir: str | os.PathLike) -> list[CheckpointDir]:
    found = []
    for step, path in list_checkpoints(output_dir):
        kind = classify_checkpoint_dir(path)
        if kind is not None:
            found.append(CheckpointDir(step, path, kind))
    return found


def newest_stock_checkpoint(output_dir: str | os.PathLike) -> CheckpointDir | None:
    """The stock ``transformers.Trainer`` checkpoint with the highest step under ``output_dir``, if any."""
    stock = [entry for entry in _directories(output_dir) if entry.kind is CheckpointKind.STOCK]
    return stock[-1] if stock else None


def colliding_checkpoints(output_dir: str | os.PathLike, *, after_step: int, up_to_step: int) -> list[CheckpointDir]:
    """Stock or foreign directories named ``checkpoint-<s>`` with ``after_step < s <= up_to_step``.

    A run from ``after_step`` to ``up_to_step`` may save at any of those steps (a preemption saves the step
    it is at), and hf_resumable never replaces a directory it did not write.
    """
    return [entry for entry in _directories(output_dir)
            if entry.kind is not CheckpointKind.OURS and after_step < entry.step <= up_to_step]


def collision_error(output_dir: str | os.PathLike, collisions: list[CheckpointDir], *, after_step: int,
                    up_to_step: int) -> CheckpointExistsError:
    """The error for a run that would save over directories it did not write, with every way out."""
    names = ", ".join(f"{entry.path.name} ({entry.kind.value})" for entry in collisions[:5])
    more = f" and {len(collisions) - 5} more" if len(collisions) > 5 else ""
    stock = [entry for entry in collisions if entry.kind is CheckpointKind.STOCK]
    fixes = []
    if stock:
        fixes.append(f"resume from {stock[-1].path.name} with train(resume_from_checkpoint=True) (a stock Trainer "
                     "checkpoint is converted on the fly; that resume is not bit-exact), or convert it once with "
                     f"`{CONVERT_HINT} {stock[-1].path}`")
    fixes += ["move these directories out of output_dir", "or set another output_dir"]
    return CheckpointExistsError(
        f"output_dir={os.fspath(output_dir)!r} holds {names}{more}, not written by hf_resumable. This run saves "
        f"checkpoints between step {after_step + 1} and step {up_to_step}, and ResumableTrainer never overwrites "
        "or deletes a directory it did not write, so the save would fail. Nothing was trained. Fix: "
        + "; ".join(fixes) + ".")


def not_a_checkpoint_error(path: Path, output_dir: str | os.PathLike) -> ResumeCheckpointNotFoundError:
    """The error for ``resume_from_checkpoint=path`` when ``path`` is missing or not a resumable checkpoint."""
    if not path.exists():
        reason = "no such directory"
    elif not path.is_dir():
        reason = "not a directory"
    else:
        reason = (f"no {MANIFEST_FILE} (not an hf_resumable checkpoint) and not a transformers.Trainer checkpoint "
                  f"({_STOCK_STATE} plus model weights). If another tool wrote it, convert it with "
                  f"`{CONVERT_HINT} {path}` first")
    return ResumeCheckpointNotFoundError(
        f"Can't find a valid checkpoint at {os.fspath(path)!r}: {reason}. Pass a checkpoint directory, or True to "
        f"resume from the newest checkpoint under output_dir={os.fspath(output_dir)!r}.")
