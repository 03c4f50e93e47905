"""Public entry points: ``save_checkpoint``, ``open_checkpoint`` and ``load_checkpoint``."""

from __future__ import annotations

import atexit
import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..constants import DEFAULT_MAX_SHARD_SIZE, LAYOUT_FILE, MANIFEST_FILE
from ..distributed import is_distributed, rank_and_world_size
from ..errors import IncompleteCheckpointError
from ..format.rng import RngState
from ._reader import LoadedCheckpoint, OpenedCheckpoint, read_on_load
from .background.async_save import BACKGROUND_SAVER, AsyncSaver
from .commit._durability import check_durability
from .commit._fs import wait_for_removals
from .commit._writer import check_target, save_payload
from .commit.manifest import Manifest
from .discovery import apply_retention, require_local
from .pieces._payload import capture_payload, capture_pretrained
from .pieces._pieces import capture_pieces, saves_pieces
from .pieces._reshard import write_whole
from .verify import VerifyReport, verify_checkpoint

logger = logging.getLogger(__name__)

__all__ = ["CheckpointInfo", "consolidate_checkpoint", "load_checkpoint", "open_checkpoint", "read_on_load",
           "save_checkpoint", "wait_for_pending_saves"]

_ASYNC = BACKGROUND_SAVER
atexit.register(lambda: _ASYNC.wait())


@dataclass(frozen=True)
class CheckpointInfo:
    """Where a save went. With ``blocking=False`` it is committed once :func:`wait_for_pending_saves` (or the next
    save or load) returns.

    Args:
        path (`Path`): the checkpoint directory.
        step (`int`, *optional*): the step recorded in the manifest.
        manifest (`Manifest`, *optional*): the committed manifest (None while an async save is in flight).
    """

    path: Path
    step: int | None
    manifest: Manifest | None = None


def background_saver() -> AsyncSaver:
    """The process's one background saver (at most one save in flight; loads and exit wait for it)."""
    return _ASYNC


def saves_async(save_async: bool | None) -> bool:
    """An integration's ``save_async`` option: ``None`` (the default) is on under torch.distributed and off in a
    single process (docs/benchmarks.md); ``True``/``False`` decide."""
    return is_distributed() if save_async is None else bool(save_async)


def wait_for_pending_saves() -> None:
    """Block until the in-flight async save has committed (or a blocking save's deferred fsyncs are done), and the
    checkpoints retention removed in the background are deleted from disk.

    Raises:
        AsyncSaveError: if that save failed (the previous checkpoint is untouched), or the fsyncs did (the checkpoint
            is committed but never counts as durable).
    """
    try:
        _ASYNC.wait()
    finally:
        wait_for_removals()


def save_checkpoint(
    directory: str | os.PathLike,
    *,
    model: torch.nn.Module | Mapping[str, torch.Tensor] | None,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    scaler: Any = None,
    step: int | None = None,
    training_state: Mapping[str, Any] | None = None,
    extra: Mapping[str, Any] | None = None,
    extra_files: Mapping[str, bytes | str] | None = None,
    data_state: Mapping[str, Any] | None = None,
    rng: bool | RngState = True,
    metrics: Mapping[str, float] | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    blocking: bool = True,
    overwrite: bool = False,
    processing_class: Any = None,
    keep_last: int | None = None,
    best_metric: str | None = None,
    greater_is_better: bool = False,
    standalone: bool = False,
    durability: str = "deferred",
    layout: str = "auto",
) -> CheckpointInfo:
    """Save a crash-safe, pickle-free training checkpoint of a plain, DDP, FSDP1/FSDP2, DeepSpeed ZeRO or DTensor
    model to ``directory``, committed atomically (docs/checkpoints.md#guarantees). Under torch.distributed every rank
    calls it; where an engine splits the model or optimizer, every rank writes the pieces it holds, which load at any
    world size (docs/multi-gpu.md). Frozen parameters are recorded, not stored, unless ``standalone`` (docs/peft.md).

    Args:
        directory (`str` or `os.PathLike`): the checkpoint directory, e.g. ``out/checkpoint-120``.
        model (`torch.nn.Module` or state dict): the weights to save (``None`` to save none).
        optimizer (`torch.optim.Optimizer`, *optional*): saved keyed by parameter name.
        scheduler (*optional*): an LR scheduler (anything with ``state_dict``/``load_state_dict``).
        scaler (*optional*): a ``torch.amp.GradScaler``.
        step (`int`, *optional*): the global step, recorded in the manifest.
        training_state (`Mapping`, *optional*): the progress cursor (JSON-able values and tensors).
        extra (`Mapping`, *optional*): more state (JSON-able values and tensors).
        extra_files (`Mapping[str, bytes | str]`, *optional*): more files (relative path -> content).
        data_state (`Mapping`, *optional*): this rank's data-loader position.
        rng (`bool` or `RngState`, *optional*, defaults to `True`): capture this rank's RNG now, or
            store the given state.
        metrics (`Mapping[str, float]`, *optional*): recorded in the manifest, for ``best_metric`` retention.
        max_shard_size (`int` or `str`, *optional*, defaults to `"2GB"`): size limit of each HF weight file.
        blocking (`bool`, *optional*, defaults to `True`): with `False`, return once the state is staged and write
            on a background thread; the next save, any load and ``wait_for_pending_saves`` wait for it and raise its
            error (docs/checkpoints.md#what-a-background-save-holds).
        overwrite (`bool`, *optional*, defaults to `False`): replace an existing checkpoint atomically.
        processing_class (*optional*): a tokenizer/processor whose ``save_pretrained`` files are included.
        keep_last (`int`, *optional*): after the commit, apply :func:`apply_retention` to the parent.
        best_metric (`str`, *optional*) / greater_is_better (`bool`): keep-best retention.
        standalone (`bool`, *optional*, defaults to `False`): store frozen parameters too, so the checkpoint needs
            no base to load (and ``from_pretrained(directory)`` loads the whole model).
        durability (`str`, *optional*, defaults to `"deferred"`): ``"deferred"`` fsyncs the files on the saver's
            thread after the commit, ``"immediate"`` (always for an overwrite) before it
            (docs/checkpoints.md#guarantees).
        layout (`str`, *optional*, defaults to `"auto"`): ``"auto"``: per-rank pieces when an engine splits the
            model or optimizer, else the HF layout; ``"pieces"``: per-rank pieces, also for plain tensors; ``"hf"``:
            an engine's weights gathered and written whole, so ``from_pretrained`` loads the directory (its
            optimizer state stays in pieces).

    Returns:
        `CheckpointInfo`

    Raises:
        CheckpointExistsError: if ``directory`` exists and ``overwrite`` is False.
        UnsupportedStateError: if some state cannot be stored without pickle (or is a ``Partial`` DTensor).
        ValueError: an unknown ``layout``, or ``layout="pieces"`` for a state dict.
        AsyncSaveError: if the previous background save (or a deferred save's fsyncs) failed.
        OSError: if writing fails (e.g. ENOSPC); the previous checkpoint is untouched.

    Example:

    ```python
    >>> from hf_resumable import save_checkpoint, load_checkpoint
    >>> save_checkpoint("out/checkpoint-10", model=model, optimizer=optimizer, step=10)  # doctest: +SKIP
    >>> load_checkpoint("out/checkpoint-10", model=model, optimizer=optimizer).step  # doctest: +SKIP
    10
    ```
    """
    target = Path(directory)
    check_durability(durability)
    pieces_layout = saves_pieces(model, optimizer, layout)
    _ASYNC.wait()
    rank, world_size = rank_and_world_size()
    if not is_distributed():  # fail before capturing anything (under torch.distributed step 1 tells every rank)
        check_target(target, overwrite=overwrite)
    # 1. Everything but the engine's pieces: whole tensors (a plain or DDP model: every rank holds them; the ranks
    #    share their writing), the scheduler, scaler, progress and per-rank state.
    whole = not pieces_layout
    payload = capture_payload(
        model=model if whole else None, optimizer=optimizer if whole else None, scheduler=scheduler, scaler=scaler,
        training_state=training_state, extra=extra, extra_files=extra_files, data_state=data_state, rng=rng,
        max_shard_size=max_shard_size, processing_class=processing_class if whole else None, rank=rank,
        is_main=rank == 0, standalone=standalone, replicas=is_distributed())
    # 2. The pieces this rank holds (and its HF weight files, gathered now, for layout="hf"); rank 0 adds the files
    #    from_pretrained needs besides the weights.
    pieces = None
    if pieces_layout:
        pieces = capture_pieces(payload, model, optimizer, rank=rank, world_size=world_size, hf_weights=layout == "hf",
                                max_shard_size=max_shard_size, standalone=standalone, stage=not blocking)
        if rank == 0:
            capture_pretrained(payload, model, processing_class)
    metrics = dict(metrics or {})

    def retention() -> None:
        if keep_last is not None and rank == 0:
            apply_retention(target.parent, keep_last=keep_last, best_metric=best_metric,
                            greater_is_better=greater_is_better)

    # 3. Commit: every rank writes its files (describing its pieces first); once every rank's files are durable,
    #    rank 0 writes the piece layout built from every rank's report, then the manifest (in the background if not
    #    blocking: only the copy of the state is on the training loop's time).
    hooks = {} if pieces is None else {"prepare": lambda: pieces.prepare(payload), "finalize": pieces.finalize}
    if not blocking:
        release = pieces.release if pieces is not None else None
        try:
            future = _ASYNC.submit(target, payload, step=step, metrics=metrics, overwrite=overwrite,
                                   on_commit=retention, optimizer=optimizer,
                                   also_stage=list(pieces.staging.values()) if pieces is not None else (), **hooks)
        except BaseException:
            if release is not None:
                release()
            raise
        if release is not None:  # ZeRO: whatever happens to the save, the optimizer's held steps go on
            future.add_done_callback(lambda _: release())
        return CheckpointInfo(path=target, step=step)
    manifest = save_blocking(target, payload, step=step, metrics=metrics, overwrite=overwrite, durability=durability,
                             after=retention, **hooks)
    return CheckpointInfo(path=target, step=step, manifest=manifest)


def save_blocking(target: Path, payload: Any, *, step: int | None, metrics: dict[str, float], overwrite: bool,
                  durability: str, after: Any, prepare: Any = None, finalize: Any = None) -> Manifest:
    """A blocking save's commit, then ``after()`` (retention): at once, or, for a deferred save, once the saver's
    thread has fsynced its files, so retention never counts a checkpoint that is not durable yet."""
    deferred = []

    def sync_later(committed: Path, written: list[str]) -> None:
        deferred.append(_ASYNC.sync_later(committed, written, on_durable=after))

    manifest = save_payload(target, payload, step=step, metrics=metrics, overwrite=overwrite, prepare=prepare,
                            finalize=finalize, sync_later=sync_later if durability == "deferred" else None)
    if not deferred:
        after()
    return manifest


def open_checkpoint(
    directory: str | os.PathLike,
    *,
    verify: str = "quick",
    allow_inexact_resume: bool = False,
    counters: Iterable[str] = (),
    reshard: bool | None = False,
    verified: VerifyReport | None = None,
) -> OpenedCheckpoint:
    """Verify a local checkpoint once and decode everything in it that does not depend on a live object; then
    :meth:`~OpenedCheckpoint.load_into` fills a model, optimizer, scheduler and scaler (each checked against the
    checkpoint before anything is written), and :meth:`~OpenedCheckpoint.restore_rng` restores the RNG.

    Args:
        directory (`str` or `os.PathLike`): a committed checkpoint directory on the local filesystem.
        verify (`str`, *optional*, defaults to `"quick"`): ``"quick"`` (manifest, sizes, headers, hashes of
            small files, then every other file's hash while it is read), ``"full"`` (every hash now, so
            nothing is read into an object before every byte is known good) or ``"none"`` (structure only).
        allow_inexact_resume (`bool`, *optional*, defaults to `False`): the default of ``load_into`` and
            ``restore_rng``: continue with a WARNING where the run would not continue exactly (another world
            size, a missing RNG state, another CUDA device count) instead of raising.
        counters (`Iterable[str]`, *optional*): more progress-cursor keys (``"outer/inner"`` for nested ones)
            that must be non-negative ints when present (``global_step`` always is).
        reshard (`bool`, *optional*, defaults to `False`): weights and optimizer are cut to this world size and the
            caller keeps its data position across world sizes (an elastic run); a world-size change then only
            affects per-rank RNG streams. ``None``: when the checkpoint holds per-rank pieces.
        verified (`VerifyReport`, *optional*): the verification of this directory that just ran (e.g.
            :func:`~hf_resumable.checkpoint.find_latest_verified`'s), not repeated: the small files it kept are used
            from memory, and a file changed since is refused. A quick report does not stand for ``verify="full"``.

    Returns:
        `OpenedCheckpoint`: also a :class:`LoadedCheckpoint` (``step``, ``training_state``, ``extra``,
        ``data_state``, ``rng_state``).

    Raises:
        IncompleteCheckpointError / CorruptCheckpointError: the checkpoint does not verify, holds
            inconsistent state (the error names the file, the field and what was expected), or changed since
            ``verified`` was made.
        ValueError: ``verified`` is the report of another directory, or not a report.

    Example:

    ```python
    >>> from hf_resumable.checkpoint import open_checkpoint
    >>> opened = open_checkpoint("out/checkpoint-10")  # doctest: +SKIP
    >>> opened.step, opened.training_state  # doctest: +SKIP
    (10, {'global_step': 10})
    >>> opened.load_into(model=model, optimizer=optimizer, scheduler=scheduler)  # doctest: +SKIP
    >>> opened.restore_rng()  # doctest: +SKIP
    ```
    """
    if verify not in ("quick", "full", "none"):
        raise ValueError(f"verify must be 'quick', 'full' or 'none', got {verify!r}.")
    require_local(directory, "open_checkpoint")
    _ASYNC.wait()  # a background save of this process may be committing this very directory
    path = Path(directory)
    rank, world_size = rank_and_world_size()
    # 1. Verify once, or take the verification that just ran: its parsed headers and kept bytes serve every later step.
    if verified is not None and _reusable(verified, path, verify=verify):
        report = verified
    else:
        report = verify_checkpoint(path, full=verify == "full", raise_on_error=True, keep=read_on_load(rank))
    # 2-5. Decode and check what does not depend on a live object (OpenedCheckpoint.open).
    if reshard is None:
        reshard = LAYOUT_FILE in report.manifest.files
    return OpenedCheckpoint.open(path, report, verify=verify, rank=rank, world_size=world_size,
                                 allow_inexact_resume=allow_inexact_resume, counters=counters, reshard=reshard)


def _reusable(report: VerifyReport, path: Path, *, verify: str) -> bool:
    """Whether ``report`` stands for the verification ``open_checkpoint(path, verify=verify)`` would run. Raises
    ``ValueError`` for what is not a report of ``path``, and the report's own error if it found problems or the
    manifest changed since."""
    if not isinstance(report, VerifyReport):
        raise ValueError(f"verified= takes the VerifyReport of a verification of {path} (find_latest_verified or "
                         f"verify_checkpoint), got {type(report).__name__}.")
    if os.path.abspath(report.path) != os.path.abspath(path):
        raise ValueError(f"verified= is the report of {report.path}, not of {path}; pass the report of the "
                         "directory you open.")
    report.raise_if_bad()
    if verify == "full" and not report.full:
        return False
    report.check_unchanged(MANIFEST_FILE)
    return True


def load_checkpoint(
    directory: str | os.PathLike,
    *,
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    scaler: Any = None,
    restore_rng: bool = True,
    strict: bool = True,
    verify: str = "quick",
    allow_inexact_resume: bool = False,
) -> LoadedCheckpoint:
    """Load a checkpoint written by :func:`save_checkpoint` into freshly built objects, bit for bit, at any world size:
    :func:`open_checkpoint` followed by :meth:`OpenedCheckpoint.load_into` (everything checked before anything is
    written into an object, the RNG restored last; docs/format.md#verification, docs/multi-gpu.md).

    Args:
        directory (`str` or `os.PathLike`): a committed checkpoint directory.
        model, optimizer, scheduler, scaler (*optional*): objects to fill (``None`` skips a part).
        restore_rng (`bool`, *optional*, defaults to `True`): restore this rank's RNG state.
        strict (`bool`, *optional*, defaults to `True`): missing/unexpected model keys are errors.
        verify (`str`, *optional*, defaults to `"quick"`): as in :func:`open_checkpoint`.
        allow_inexact_resume (`bool`, *optional*, defaults to `False`): as in :func:`open_checkpoint`.

    Returns:
        `LoadedCheckpoint`: training state, extra state, data position and RNG state (the
        :class:`OpenedCheckpoint` the load went through).

    Raises:
        IncompleteCheckpointError: no manifest, or a requested part was not saved.
        CorruptCheckpointError: truncated/corrupt file, inconsistent state, or a hash mismatch (found while
            reading a large file with ``verify="quick"``: see :meth:`OpenedCheckpoint.load_into` for what
            may then have been filled).
        CheckpointMismatchError: the model/optimizer/scheduler/scaler does not fit (all offending keys listed).
        BaseMismatchError: the checkpoint references its frozen base and the model's frozen parameters differ from
            it (a ``CheckpointMismatchError``; nothing was changed).
        InexactResumeError: the RNG state for this rank is missing and ``allow_inexact_resume`` is False.
        ConfigDriftError: the checkpoint was written by a different number of processes (unless
            ``allow_inexact_resume``).
    """
    require_local(directory, "load_checkpoint")
    opened = open_checkpoint(directory, verify=verify, allow_inexact_resume=allow_inexact_resume, reshard=None)
    return opened.load_into(model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler, strict=strict,
                            restore_rng=restore_rng)


def consolidate_checkpoint(
    directory: str | os.PathLike,
    output_dir: str | os.PathLike,
    *,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    include_optimizer: bool = True,
    overwrite: bool = False,
) -> Manifest:
    """Turn a checkpoint of per-rank pieces into a regular one: HF safetensors weights that ``from_pretrained`` loads,
    ``config.json`` and, with ``include_optimizer``, the optimizer state, so :func:`load_checkpoint` resumes from it
    too. Run it in one process; every hash is checked first (docs/format.md#a-checkpoint-of-per-rank-pieces).

    Args:
        directory (`str` or `os.PathLike`): a committed checkpoint of pieces (written at any world size).
        output_dir (`str` or `os.PathLike`): where to write the regular checkpoint.
        max_shard_size (`int` or `str`, *optional*, defaults to `"2GB"`): size limit of each output weight file.
        include_optimizer (`bool`, *optional*, defaults to `True`): also consolidate the optimizer state.
        overwrite (`bool`, *optional*, defaults to `False`): replace ``output_dir`` atomically.

    Returns:
        `Manifest`: the manifest of the output.

    Raises:
        IncompleteCheckpointError / CorruptCheckpointError: ``directory`` is not a valid checkpoint of pieces.
        CheckpointExistsError: if ``output_dir`` exists and ``overwrite`` is False.

    Example:

    ```python
    >>> consolidate_checkpoint("out/checkpoint-10", "export/model")  # doctest: +SKIP
    >>> AutoModelForCausalLM.from_pretrained("export/model")  # doctest: +SKIP
    ```
    """
    require_local(directory, "consolidate_checkpoint")
    opened = open_checkpoint(directory, verify="full")
    if LAYOUT_FILE not in opened.manifest.files:
        raise IncompleteCheckpointError(f"{directory} has no {LAYOUT_FILE}: it is already a regular checkpoint "
                                        "(from_pretrained and load_checkpoint read it as is).")
    return write_whole(opened, Path(output_dir), max_shard_size=max_shard_size, include_optimizer=include_optimizer,
                       overwrite=overwrite)
