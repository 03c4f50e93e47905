"""The resume fallback of both front doors: a corrupt newest checkpoint costs one interval, never a crash loop.

A resume without a path loads the checkpoint discovery chose (:func:`find_agreed_checkpoint`: the newest that
verifies on every rank) inside :func:`agreed_load`; when it fails its hashes while it is loaded, on any rank,
:func:`resume_newest` moves it aside (kept for inspection) and loads the one before, and :func:`refuse_fresh_start`
turns "committed checkpoints, none usable" into an error instead of a fresh start (docs/checkpoints.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import os
import re
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

from ..checkpoint import (
    VerifyReport,
    find_latest_verified,
    list_checkpoints,
    verify_checkpoint,
    wait_for_pending_saves,
)
from ..checkpoint.discovery import set_aside_checkpoint
from ..constants import MANIFEST_FILE
from ..distributed import agreed_reads, all_gather_json, rank_and_world_size
from ..errors import CorruptCheckpointError, CorruptOnAnotherRankError

logger = logging.getLogger(__name__)

__all__ = ["FailedResume", "ResumeLoadError", "agreed_load", "find_agreed_checkpoint", "no_checkpoint_resumes",
           "refuse_fresh_start", "resume_newest"]

T = TypeVar("T")


class ResumeLoadError(CorruptCheckpointError):
    """A resume's load of ``path`` failed its hashes on at least one rank (``reason``: the first failing rank's
    error); raised on every rank alike (see :func:`agreed_load`)."""

    def __init__(self, message: str, *, path: str, reason: str) -> None:
        super().__init__(message)
        self.path = path
        self.reason = reason
        # whether the front door can load the previous checkpoint into the same objects (else: a restart does)
        self.retry = True


@dataclasses.dataclass(frozen=True)
class FailedResume:
    """A checkpoint a resume could not use, and why (``moved_to``: where it was set aside, if it was)."""

    path: str
    reason: str
    moved_to: str | None = None


@contextlib.contextmanager
def agreed_load(path: str | os.PathLike) -> Iterator[None]:
    """Run a resume's load of ``path`` so that every rank learns whether it failed its hashes on any rank.

    Collective (every rank enters it with the same checkpoint). A rank can find a corrupt byte in a file only it
    reads (its pieces, its share of a shared read, its node's copy); the others would train on, or wait in their
    next collective. Every rank reports after its load, so either all go on or all raise.

    Raises:
        ResumeLoadError: on every rank, when the load raised `CorruptCheckpointError` on any (chained from it on
            that rank) and no other error on any.
        ReadFailedOnAnotherRankError: on the other ranks, when a rank's load raised any other error (which
            propagates as it is on that rank): every rank stops, none falls back (see
            :func:`~hf_resumable.distributed.agreed_reads`).
    """
    world_size = rank_and_world_size()[1]
    try:
        with agreed_reads(os.fspath(path)):
            yield
    except CorruptOnAnotherRankError as err:
        rank, reason, failure = err.rank, err.report, err
    except CorruptCheckpointError as err:
        rank, reason, failure = rank_and_world_size()[0], f"{type(err).__name__}: {err}", err
    else:
        return
    reason = reason if world_size == 1 else f"rank {rank}: {reason}"
    raise ResumeLoadError(f"{path} failed while it was loaded ({reason})", path=os.fspath(path),
                          reason=reason) from failure


def find_agreed_checkpoint(root: str | os.PathLike, *, pattern: re.Pattern[str],
                           below: int | None = None) -> VerifyReport | None:
    """The newest checkpoint under ``root`` (older than step ``below``) that verifies on every rank, or None.

    Collective: every rank verifies (``find_latest_verified``: quick, its own small files kept for its open) and
    the ranks agree on one step; a rank that verified a newer one than another looks again below it, so no rank
    resumes from a different checkpoint (node-local copies may differ).
    """
    while True:
        report = find_latest_verified(root, pattern=pattern, below=below)
        steps = all_gather_json(None if report is None else _step_of(report.path, pattern))
        if len(set(steps)) == 1:
            return report
        below = max(step for step in steps if step is not None)


def resume_newest(root: str | os.PathLike, load: Callable[[VerifyReport], T], *, pattern: re.Pattern[str],
                  owner: str, first: VerifyReport | None) -> T | None:
    """Load ``first`` (the checkpoint discovery chose), falling back to older ones while a load fails its hashes.

    Collective. ``load`` raises :class:`ResumeLoadError` (from :func:`agreed_load`) when the checkpoint failed its
    hashes while it was read, on any rank, and must leave no trace of that attempt once it has loaded another one.
    Each checkpoint that failed, while loaded or in discovery's verification (a committed one newer than ``first``),
    is moved aside (kept for inspection, never picked again) with a WARNING naming it and the one used instead.

    Returns:
        what ``load`` returned, or `None` when there is no checkpoint at all (a fresh start).

    Raises:
        CorruptCheckpointError: no checkpoint under ``root`` both verifies and loads (each one tried, and why), or
            ``load`` cannot fill its objects again (``retry`` false: the checkpoint was moved aside, and the next
            start resumes from the previous one).
    """
    failed: list[FailedResume] = []
    report = first
    if report is not None:
        _set_aside_unverified(root, pattern=pattern, instead=report.path)
    while report is not None:
        if failed:
            gc.collect()  # the failed attempt's wrappers (a DDP reducer's hooks) go before the next makes its own
        try:
            return load(report)
        except ResumeLoadError as err:
            failure = FailedResume(report.path, err.reason, _set_aside([Path(report.path)])[0])
            failed.append(failure)
            report = find_agreed_checkpoint(root, pattern=pattern, below=_step_of(failure.path, pattern))
            instead = "nothing (no older checkpoint verifies)" if report is None else report.path
            if rank_and_world_size()[0] == 0:
                logger.warning("%s failed its hashes while it was loaded (%s); it is kept for inspection%s. Resuming "
                               "from %s instead: the steps since then are trained again.", failure.path,
                               failure.reason, f" as {failure.moved_to}" if failure.moved_to else "", instead)
            if not err.retry and report is not None:
                raise CorruptCheckpointError(
                    f"{err} {owner} cannot load another checkpoint into the objects it has prepared for this engine; "
                    f"the corrupt checkpoint was set aside, so starting the run again resumes from {report.path}."
                ) from err
    refuse_fresh_start(root, pattern=pattern, owner=owner, failed=failed)
    return None


def refuse_fresh_start(root: str | os.PathLike, *, pattern: re.Pattern[str], owner: str,
                       failed: Sequence[FailedResume] = ()) -> None:
    """A resume that found no usable checkpoint starts fresh only where there was none to use.

    Directories without a manifest are interrupted saves: a fresh start. A committed checkpoint that does not verify,
    or failed while it was loaded, is not (starting over would later replace it). Collective: every rank raises if
    any rank found one.

    Raises:
        CorruptCheckpointError: ``failed`` is not empty, or a committed checkpoint under ``root`` does not verify.
    """
    tried = list(failed)
    for _, path in reversed(list_checkpoints(root, pattern=pattern)):
        if (path / MANIFEST_FILE).exists() and str(path) not in {f.path for f in failed}:
            report = verify_checkpoint(path, full=False)
            tried.append(FailedResume(str(path), "; ".join(f"{f}: {why}" for f, why in report.problems)))
    everywhere = all_gather_json([dataclasses.astuple(failure) for failure in tried])
    tried = list(dict.fromkeys(FailedResume(*failure) for each in everywhere for failure in each))
    if tried:
        raise no_checkpoint_resumes(root, tried, owner=owner)


def no_checkpoint_resumes(root: str | os.PathLike, tried: Sequence[FailedResume], *,
                          owner: str) -> CorruptCheckpointError:
    """The error for a resume that found committed checkpoints but none it could use (pure: each one, why, the fix)."""
    lines = "\n".join(f"  {f.path}: {f.reason}" + (f" (moved to {f.moved_to})" if f.moved_to else "") for f in tried)
    return CorruptCheckpointError(
        f"{owner} found no checkpoint under {os.fspath(root)} that verifies and loads; nothing was trained. Tried:\n"
        f"{lines}\nRestore a good copy (a Hub or object-store mirror) and resume from its explicit path, or move "
        "these directories out of the run directory to start the run from scratch.")


def _set_aside_unverified(root: str | os.PathLike, *, pattern: re.Pattern[str], instead: str) -> None:
    """Committed checkpoints newer than ``instead`` failed discovery's verification on some rank (each skipped with
    a WARNING naming its files): move them aside too, or the run's save of their step would replace them."""
    step = _step_of(instead, pattern)
    # verified again here: one committed since discovery looked (this process's own background save) is kept
    newer = {path: verify_checkpoint(path, full=False) for number, path in list_checkpoints(root, pattern=pattern)
             if number > step and (path / MANIFEST_FILE).exists()}
    failed = {path: "; ".join(f"{file}: {why}" for file, why in report.problems)
              for path, report in newer.items() if not report.ok}
    for (path, reason), moved in zip(failed.items(), _set_aside(list(failed))):
        if moved is not None:
            logger.warning("%s does not verify (%s); it is kept for inspection as %s. Resuming from %s instead: the "
                           "steps since then are trained again.", path, reason, moved, instead)


def _set_aside(paths: Sequence[Path]) -> list[str | None]:
    """Move checkpoints aside, once per copy: the lowest rank that holds each distinct directory moves it (ranks that
    share a file system share one; node-local copies are each moved). Collective; where each one went (``None``:
    it could not be moved, and stays under its name; this run does not pick it again)."""
    rank = rank_and_world_size()[0]
    wait_for_pending_saves()  # this process's own deferred fsyncs of a checkpoint finish before it moves
    held = all_gather_json([os.path.realpath(path) for path in paths])
    lower = {real for copies in held[:rank] for real in copies}
    moved: dict[str, str] = {}
    for path, real in zip(paths, held[rank]):
        if real in lower:
            continue
        try:
            moved[real] = str(set_aside_checkpoint(path))
        except OSError as err:
            logger.warning("%s could not be moved aside (%s); it stays under its name.", path, err)
    everywhere = {real: where for each in all_gather_json(moved) for real, where in each.items()}
    return [everywhere.get(real) for real in held[rank]]


def _step_of(path: str | os.PathLike, pattern: re.Pattern[str]) -> int:
    return int(pattern.match(Path(path).name).group(1))
