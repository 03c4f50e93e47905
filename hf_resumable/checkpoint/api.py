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

from .._urls import is_remote
from ..constants import DEFAULT_MAX_SHARD_SIZE, LAYOUT_FILE, MANIFEST_FILE
from ..distributed import is_distributed, rank_and_world_size
from ..format.rng import RngState
from ._reader import LoadedCheckpoint, OpenedCheckpoint, _Reader, read_on_load
from .background.async_save import BACKGROUND_SAVER, AsyncSaver
from .commit._durability import check_durability
from .commit._fs import wait_for_removals
from .commit._writer import check_target, save_payload
from .commit.manifest import Manifest
from .discovery import apply_retention
from .pieces._payload import capture_payload, capture_pretrained
from .pieces._pieces import capture_pieces, consolidate_pieces, saves_pieces
from .verify import VerifyReport, verify_checkpoint

logger = logging.getLogger(__name__)

__all__ = ["CheckpointInfo", "consolidate_checkpoint", "load_checkpoint", "open_checkpoint", "read_on_load",
           "save_checkpoint", "wait_for_pending_saves"]

_ASYNC = BACKGROUND_SAVER
atexit.register(lambda: _ASYNC.wait())


@dataclass(frozen=True)
class CheckpointInfo:
    """Where a save went. For ``blocking=False`` the checkpoint is committed only after
    :func:`wait_for_pending_saves` (or the next save/load) returns.

    Args:
        path (`Path`): the checkpoint directory.
        step (`int`, *optional*): the step recorded in the manifest.
        manifest (`Manifest`, *optional*): the committed manifest (None while an async save is in flight).
    """

    path: Path
    step: int | None
    manifest: Manifest | None = None


def require_local(location: Any, function: str) -> None:
    """Refuse a remote location in the checkpoint core (which reads and writes local directories only).

    Raises:
        ValueError: for ``hf://`` and object-store URLs, naming the front function that takes them.
    """
    if is_remote(location):
        raise ValueError(f"hf_resumable.checkpoint.{function} takes local directories; {os.fspath(location)!r} is "
                         f"remote. Use hf_resumable.{function} (or hf_resumable.locations.{function}), which "
                         "downloads and verifies it first.")


def background_saver() -> AsyncSaver:
    """The process's one background saver (at most one save in flight; loads and exit wait for it)."""
    return _ASYNC


def saves_async(save_async: bool | None) -> bool:
    """An integration's ``save_async`` option (``ResumableTrainer``'s): ``None`` (its default) is on under
    torch.distributed (torchrun with 2+ processes: every rank stages and returns, a small part of the stall of a
    blocking save, docs/benchmarks.md) and off in a single process; ``True``/``False``
    decide.

    Example:

    ```python
    >>> saves_async(None)  # one process
    False
    >>> saves_async(True)
    True
    ```
    """
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
    model to ``directory``.

    Files are written into a temporary sibling directory and renamed into place after ``manifest.json`` (every file
    with its size and xxh3-128, computed while writing) is written last. A save killed at any moment leaves the
    previous checkpoint intact and no directory that looks committed. A blocking save returns once its files are
    committed; by default (``durability="deferred"``) they are fsynced right after, on the saver's thread (see
    ``durability``). Model weights are laid out as ``save_pretrained`` lays them out: one ``model.safetensors``
    when they fit in ``max_shard_size``, else ``model.safetensors.index.json`` and ``model-0000k-of-0000N.safetensors``
    (``from_pretrained(directory)`` works either way); tied weights are stored once.

    Under torch.distributed every rank calls it (collective). Every rank passes the same model and optimizer (DDP
    replicas): their files are split across the ranks, each writing whole files of its share (rank 0 writes them
    all if the ranks' files differ in names, shapes or dtypes); the checkpoint is the same bytes as one writer's.
    When an engine splits the model or optimizer across ranks (FSDP2 / DTensor parameters, FSDP1, DeepSpeed ZeRO
    partitions or a :class:`~hf_resumable.checkpoint.pieces._pieces.ShardedOptimizerState`), every rank writes the
    pieces it holds into its own files, in parallel, and ``sharded_layout.json`` records every tensor's pieces
    (``layout="pieces"`` does so for plain tensors too: the ranks split them, whole tensors balanced by bytes). Such a
    checkpoint loads at any world size into any of these layouts (:func:`load_checkpoint`).

    Frozen parameters are identity, not state: when ``model`` has parameters with ``requires_grad=False`` (a
    PEFT/LoRA base, a frozen embedding, a quantized base), only its trainable part is stored
    (``trainable.safetensors.index.json``: trainable parameters and every buffer; a PEFT adapter's tensors once, in
    ``adapter_model.safetensors``), and ``frozen_base.json`` records what the frozen parameters are: names, dtypes,
    shapes, xxh3-128 fingerprints (computed once per process, then cached) and where the base came from. Loading
    checks the live model's frozen tensors against that record instead of reading them. Such a checkpoint is not a
    whole model: ``from_pretrained(directory)`` loads a PEFT checkpoint as the base named in its
    ``adapter_config.json`` plus the adapter (as for a stock Trainer checkpoint) and finds no weights otherwise;
    ``hf-resumable export`` turns it and its base into a full model directory. ``standalone=True`` stores every
    parameter instead.

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
        blocking (`bool`, *optional*, defaults to `True`): with `False`, tensors are staged into
            reusable host buffers and written by a background thread. The call returns once buffers and other
            state that may change before the next optimizer step are copied; ``optimizer``'s parameters and state
            are copied meanwhile, and its next step waits until they are (code that writes them in place outside
            the optimizer before that step must call ``wait_for_pending_saves`` first). Under torch.distributed
            too: every rank stages and returns, writes its files in the background, and rank 0 commits once every
            rank's files are durable (over a gloo group of its own, so the training loop's collectives are never
            interleaved). The next save, any load, ``wait_for_pending_saves`` and interpreter exit wait for it and
            raise its error.
        overwrite (`bool`, *optional*, defaults to `False`): replace an existing checkpoint atomically.
        processing_class (*optional*): a tokenizer/processor whose ``save_pretrained`` files are included.
        keep_last (`int`, *optional*): after the commit, apply :func:`apply_retention` to the parent.
        best_metric (`str`, *optional*) / greater_is_better (`bool`): keep-best retention.
        standalone (`bool`, *optional*, defaults to `False`): store frozen parameters too, so the checkpoint needs
            no base to load (and ``from_pretrained(directory)`` loads the whole model).
        durability (`str`, *optional*, defaults to `"deferred"`): when a blocking save's files are fsynced.
            ``"deferred"``: the call commits the checkpoint once its files are written (as stock savers, which
            never fsync) and fsyncs them on the saver's thread; the next save, any load, ``wait_for_pending_saves``
            and interpreter exit wait for that. A process killed meanwhile loses nothing (the kernel holds the
            bytes); after a machine crash, a reader hashes every byte of a checkpoint whose fsyncs had not
            finished, and retention never deletes the newest checkpoint whose fsyncs have. ``"immediate"``: every
            file is fsynced before the commit. An overwrite is always immediate.
        layout (`str`, *optional*, defaults to `"auto"`): how tensors are stored. ``"auto"``: per-rank pieces when an
            engine splits the model or optimizer, else the HF layout. ``"pieces"``: per-rank pieces, also for plain
            tensors. ``"hf"``: the weights whole, as ``save_pretrained`` lays them out, so ``from_pretrained`` loads
            the directory; an engine's pieces are gathered (``DTensor.full_tensor()``, one model's worth of
            communication per rank) and written round robin by the ranks, its optimizer state staying in pieces.

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
    _ASYNC.wait()  # (the removals retention started: write_payload waits for them)
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
    """A blocking save's commit (:func:`~._writer.save_payload`), then ``after()`` (retention): at once when every
    file was fsynced before the commit, else once the saver's thread has fsynced them (``durability="deferred"``,
    see ``_durability.py``), so retention never counts a checkpoint that is not durable yet."""
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
    """Verify a local checkpoint once and decode everything in it that does not depend on a live object.

    The returned object holds the training state, extras, this rank's data position and RNG state, all
    decoded and checked (codec markers, counters, data-position bounds, RNG validity, tied-weight record);
    :meth:`~OpenedCheckpoint.load_into` fills a model, optimizer, scheduler and scaler later (checking each
    against the checkpoint before writing anything), and :meth:`~OpenedCheckpoint.restore_rng` restores the
    RNG. Opening touches no live object and no generator.

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
        verified (`VerifyReport`, *optional*): the verification of this directory that just ran, e.g. the one
            :func:`~hf_resumable.checkpoint.find_latest_verified` returns: it is not repeated. The small files it
            hashed and kept are used from memory (each byte used is a byte that was hashed; none is read twice);
            every other file is hash-checked while it is read, as without it, and any file whose size, times or
            inode changed since that verification is refused. A quick report does not stand for ``verify="full"``
            (the checkpoint is then verified fully).

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
    >>> from hf_resumable.checkpoint import find_latest_verified, open_checkpoint
    >>> report = find_latest_verified("out")  # doctest: +SKIP
    >>> opened = open_checkpoint(report.path, verified=report)  # doctest: +SKIP
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
    # 1. Verify once (quick: manifest, sizes, headers, small-file hashes, index consistency; full: every hash), or take
    #    the verification that just ran. The report's parsed headers serve every later step, so no file is parsed
    #    twice, and the small files it hashed are read from its kept bytes.
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
    """Whether ``report`` stands for the verification ``open_checkpoint(path, verify=verify)`` would run.

    Raises:
        ValueError: it is not a report, or the report of another directory.
        IncompleteCheckpointError / CorruptCheckpointError: it found problems, or the manifest changed since.
    """
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
    """Load a checkpoint written by :func:`save_checkpoint` into freshly built objects, bit for bit: any layout into
    a plain, DDP, FSDP1/FSDP2, DeepSpeed ZeRO or DTensor model and its optimizer.

    :func:`open_checkpoint` followed by :meth:`OpenedCheckpoint.load_into`. Under torch.distributed a load of a
    model or optimizer reads every file on every rank. Everything is checked before
    anything is written into an object: the checkpoint verifies (``verify="quick"``: manifest, sizes,
    headers, index consistency; ``verify="full"``: every hash first), its state decodes and is consistent
    (types, counters, data position, RNG), and it fits the objects (keys, shapes and dtypes across all
    shards, optimizer groups and state shapes, scheduler/scaler keys). Every missing, unexpected or
    mismatched key is reported at once. Large files are hash-checked while they are read. The RNG is
    restored last.

    A checkpoint of per-rank pieces (or a model an engine splits) loads at any world size, into any sharding
    (2 -> 1, 1 -> 2, 4 -> 3 give the tensors of the consolidated originals): each rank reads only the slices of the
    stored pieces that overlap what it holds, every byte used checked against the hashes of the chunks it falls in.
    A world-size change then only affects per-rank RNG streams (an ``InexactResumeError`` with ``restore_rng``).

    Args:
        directory (`str` or `os.PathLike`): a committed checkpoint directory.
        model, optimizer, scheduler, scaler (*optional*): objects to fill (``None`` skips a part).
        restore_rng (`bool`, *optional*, defaults to `True`): restore this rank's RNG state.
        strict (`bool`, *optional*, defaults to `True`): missing/unexpected model keys are errors.
        verify (`str`, *optional*, defaults to `"quick"`): ``"quick"``, ``"full"`` or ``"none"``
            (``"none"`` skips hash checks while reading; structure is always checked).
        allow_inexact_resume (`bool`, *optional*, defaults to `False`): continue with a WARNING when
            this rank's RNG state is missing, or the world size changed, instead of raising.

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
    if verify not in ("quick", "full", "none"):
        raise ValueError(f"verify must be 'quick', 'full' or 'none', got {verify!r}.")
    require_local(directory, "load_checkpoint")
    _ASYNC.wait()
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
    """Turn a checkpoint of per-rank pieces into a regular one: HF safetensors weights that ``from_pretrained`` loads.

    The output holds ``model.safetensors`` (or, above ``max_shard_size``, ``model.safetensors.index.json`` with
    ``model-0000k-of-0000N.safetensors``; tied weights stored once, as transformers expects), ``config.json``, and,
    with ``include_optimizer``, the optimizer state in the regular layout, so :func:`load_checkpoint` resumes from it
    too. It is committed like any checkpoint (manifest last, atomic rename). Run it in one process (outside
    torch.distributed, or it becomes a collective); it holds one kind of state (weights, then optimizer) in memory at
    a time. Every hash is checked first: consolidation is the moment a corrupted piece would spread.

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
    _ASYNC.wait()
    path = Path(directory)
    reader = _Reader(path, verify_checkpoint(path, full=True, raise_on_error=True), hash_on_read=True)
    return consolidate_pieces(reader, output_dir, max_shard_size=max_shard_size, include_optimizer=include_optimizer,
                              overwrite=overwrite)
