"""Write a :class:`Payload` into an owned temp dir, then commit: manifest last, fsync, atomic rename. Every rank writes
its own files; rank 0 gathers their records (JSON, never pickle) and commits once every rank's files are written, so
a rank killed mid-save leaves no manifest. The steps are docs/architecture.md's "Commit protocol"."""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ... import trace
from ...constants import DURABILITY_FILE, MANIFEST_FILE, SHARDS_KEY, STOCK_ACCELERATE_FILES_RE
from ...distributed import all_gather_json, barrier, broadcast_json, is_distributed, rank_and_world_size
from ...errors import CheckpointExistsError
from ...format._jsonio import json_bytes
from ...format.rng import save_rng_state
from ...format.safetensors_io import FileRecord, write_safetensors
from ...progress import progress_bar
from .._types import IndexSpec, Payload
from ._durability import boot_id, mark_pending
from ._fs import DirIdentity, commit_dir, create_temp_dir, discard, wait_for_removals, write_bytes_durably
from ._pins import release_pin
from ._replicas import part_of_rank, replica_signature, replicas_split
from ._threads import run_in_threads
from .manifest import Manifest, committed_manifest, records_from_json, records_to_json

logger = logging.getLogger(__name__)

# Tensor files written concurrently by one rank.
WRITE_THREADS = 2


def save_refusal(target: Path, *, overwrite: bool) -> str | None:
    """The one answer to "may a save go to ``target``?": why not (looks at the disk), or ``None``.

    A missing path may always be saved to; an empty directory or a committed hf_resumable checkpoint only with
    ``overwrite``. Never a file, a link, a directory holding files hf_resumable did not write, or a committed
    checkpoint somebody added files to: hf_resumable never deletes what it did not write.
    """
    return _refusal(target, overwrite=overwrite)[0]


def check_target(target: Path, *, overwrite: bool) -> DirIdentity | None:
    """:func:`save_refusal` as a check: the directory the save will replace, or ``None`` if ``target`` is free.

    Raises:
        CheckpointExistsError: ``target`` exists and may not be replaced (the message says why and what to do).
    """
    reason, info = _refusal(target, overwrite=overwrite)
    if reason is not None:
        raise CheckpointExistsError(reason)
    return None if info is None else (info.st_dev, info.st_ino)


def _refusal(target: Path, *, overwrite: bool) -> tuple[str | None, os.stat_result | None]:
    try:
        info = os.lstat(target)
    except FileNotFoundError:
        return None, None
    except OSError as error:
        return f"{target} cannot be inspected ({error}).", None
    if not stat.S_ISDIR(info.st_mode):
        kind = "a symbolic link" if stat.S_ISLNK(info.st_mode) else "a file"
        return (f"{target} exists and is {kind}, not a checkpoint directory; hf_resumable does not replace it. Remove "
                "it, or save under another name."), info
    manifest = committed_manifest(target)
    if not overwrite:
        kind = "a committed checkpoint" if manifest is not None else "a directory"
        return (f"{target} already exists and is {kind}; pass overwrite=True to replace it atomically, or save under "
                "another step."), info
    if manifest is None and (entries := sorted(os.listdir(target))):
        stock = stock_accelerate_files(target)
        what = (f"a checkpoint of stock accelerate ({', '.join(stock[:4])})" if stock else
                f"files hf_resumable did not write ({', '.join(entries[:4])}{', ...' if len(entries) > 4 else ''})")
        return (f"{target} holds {what} and no valid {MANIFEST_FILE}, e.g. a checkpoint of the stock Trainer or of "
                "another tool; hf_resumable never replaces or mixes into those. Move them away or save under another "
                "name (a stock Trainer checkpoint can be converted with `hf-resumable convert`)."), info
    if manifest is not None and (added := _unlisted_entries(target, manifest)):
        return (f"{target} is a committed checkpoint, but files were added to it that hf_resumable did not write "
                f"({', '.join(added[:5])}{', ...' if len(added) > 5 else ''}); replacing it would delete them. Move "
                "them out of the checkpoint, or save under another name."), info
    return None, info


def stock_accelerate_files(directory: Path) -> list[str]:
    """Names in ``directory`` that stock accelerate's ``save_state`` writes (looks at the disk)."""
    try:
        return sorted(name for name in os.listdir(directory) if STOCK_ACCELERATE_FILES_RE.match(name))
    except OSError:
        return []


def _unlisted_entries(directory: Path, manifest: Manifest) -> list[str]:
    """Files (and empty directories) under ``directory`` that ``manifest`` does not list: somebody else's."""
    listed = set(manifest.files) | {MANIFEST_FILE, DURABILITY_FILE}
    parents = {str(Path(name).parent) for name in listed}
    extra = []
    for root, dirs, files in os.walk(directory):
        relroot = os.path.relpath(root, directory)
        prefix = "" if relroot == "." else f"{relroot}/"  # relative paths as the manifest lists them
        extra += [prefix + name for name in files if prefix + name not in listed]
        for name in dirs:
            relpath = prefix + name
            if relpath not in parents and not any(p.startswith(relpath + "/") for p in parents):
                extra.append(relpath + "/")
    return sorted(extra)


@contextlib.contextmanager
def committed_directory(target: str | os.PathLike, *, overwrite: bool = False) -> Iterator[Path]:
    """The commit primitive for other writers (a verified download, a conversion): a fresh temporary directory
    next to ``target`` that becomes ``target`` atomically when the block completes, and is deleted if it raises.

    The same rules as a save: only an empty directory or a committed hf_resumable checkpoint is replaced (with
    ``overwrite``); the caller writes ``manifest.json`` last. Single process only.

    Raises:
        CheckpointExistsError: ``target`` exists and may not be replaced, or appeared meanwhile.

    Example:

    ```python
    >>> with committed_directory("pulled/checkpoint-7") as tmp:  # doctest: +SKIP
    ...     fetch_every_file_into(tmp)
    ...     write_bytes_durably(tmp / "manifest.json", manifest.to_json())

    ```
    """
    target = Path(target)
    replaces = check_target(target, overwrite=overwrite)
    tmp = create_temp_dir(target)
    try:
        yield tmp
        commit_dir(tmp, target, replaces=replaces)
    except BaseException:
        discard(tmp)
        raise


def index_document(spec: IndexSpec, records: Mapping[str, FileRecord]) -> dict[str, Any]:
    """The index file of ``spec`` once its shards are written (pure), each shard's whole-file record under
    ``SHARDS_KEY`` in its metadata (what Hub downloads check a shard against)."""
    shards = records_to_json({name: records[name].whole() for name in dict.fromkeys(spec.weight_map.values())})
    return {"metadata": {**spec.metadata, SHARDS_KEY: shards}, "weight_map": spec.weight_map}


def write_payload(tmp: Path, payload: Payload, *, fsync: bool = True) -> dict[str, FileRecord]:
    """Write every file of ``payload`` under ``tmp`` (each fsynced, unless ``fsync=False``); return their records.
    This process's background removals finish first, so the disk never holds more than the kept checkpoints and this
    one."""
    wait_for_removals()
    records: dict[str, FileRecord] = {}
    total = sum(t.numel() * t.element_size() for f in payload.tensor_files for _, t in f.tensors)
    with progress_bar(total=total, desc=f"saving {tmp.name}") as bar:

        def write(tensor_file) -> tuple[str, FileRecord]:
            path = tmp / tensor_file.relpath
            path.parent.mkdir(parents=True, exist_ok=True)
            record = write_safetensors(path, tensor_file.tensors, metadata=tensor_file.metadata, fsync=fsync)
            bar.update(record.size)
            return tensor_file.relpath, record

        # Two files at a time: each hashes on its own thread while the disk is kept busy.
        records.update(run_in_threads(write, payload.tensor_files, workers=WRITE_THREADS))
    for spec in payload.indexes:  # those naming another rank's shards are written by rank 0 after the gather
        if set(spec.weight_map.values()) <= records.keys():
            records[spec.relpath] = write_bytes_durably(tmp / spec.relpath, json_bytes(index_document(spec, records)),
                                                        fsync=fsync)
    for relpath, data in payload.blobs.items():
        records[relpath] = write_bytes_durably(tmp / relpath, data, fsync=fsync)
    if payload.rng is not None and payload.rng_relpath is not None:
        path = tmp / payload.rng_relpath
        path.parent.mkdir(parents=True, exist_ok=True)
        records[payload.rng_relpath] = save_rng_state(path, payload.rng, fsync=fsync)
    return records


@dataclass(frozen=True)
class SaveStart:
    """A save that passed step 1 on every rank: its target, the temp dir, and what it may replace."""

    target: Path
    tmp: Path
    replaces: DirIdentity | None
    group: Any = None
    split: bool = False  # every rank holds the same replicated files: each writes its share (``_replicas.py``)
    # a new target, and every rank has a boot id: the fsyncs may follow the commit (``_durability.py``)
    deferrable: bool = False


def begin_save(target: Path, *, overwrite: bool, group: Any = None, signature: str | None = None) -> SaveStart:
    """Step 1 of the commit protocol (collective over ``group``): rank 0 checks the target and creates the owned temp
    dir; every rank learns its name or rank 0's error (raised on every rank). Every rank first releases its reader pin
    on the target's parent, so none outlives a failed save. Every rank's ``signature``
    (``_replicas.replica_signature``) travels along: the replicated files are split only if all are the same."""
    distributed = is_distributed()
    rank, _ = rank_and_world_size()
    release_pin(target.parent)  # the checkpoint this process found there is loaded by now; never outlive a failure
    replaces, tmp, failure = None, None, None
    if rank == 0:
        try:
            replaces = check_target(target, overwrite=overwrite)
            tmp = create_temp_dir(target)
        except Exception as err:
            if not distributed:
                raise
            failure = err
    gathered = all_gather_json({"tmp": None if tmp is None else tmp.name, "error": _describe(failure),
                                "signature": signature, "fresh": replaces is None,
                                "boot": boot_id() is not None}, group=group)
    started = gathered[0]
    if started["error"] is not None:
        if failure is not None:
            raise failure
        raise _rebuild(started["error"], f"rank 0 could not start the save of {target}")
    split = replicas_split([entry["signature"] for entry in gathered])
    deferrable = started["fresh"] and all(entry["boot"] for entry in gathered)
    return SaveStart(target, target.parent / started["tmp"], replaces, group, split, deferrable)


def finish_save(start: SaveStart, payload: Payload, *, step: int | None, metrics: dict[str, float] | None,
                prepare: Callable[[], Any] | None = None,
                finalize: Callable[[list[Any]], Mapping[str, bytes]] | None = None,
                sync_later: Callable[[Path, list[str]], None] | None = None) -> Manifest:
    """Steps 2-5 of the commit protocol for a save that :func:`begin_save` started (collective over its group).

    ``prepare()`` runs first in step 2 (it may add files to ``payload``; its JSON result travels with this rank's
    records). ``finalize(reports)`` gets every rank's ``prepare`` result in rank order and returns more small files,
    which rank 0 writes before the manifest. ``sync_later(target, written)`` makes a save deferred where
    ``start.deferrable``: nothing is fsynced before the commit, rank 0 writes the durability record before the rename,
    and every rank hands the files it wrote to ``sync_later`` (``_durability.py``).
    """
    began = time.perf_counter()
    distributed = is_distributed()
    rank, world_size = rank_and_world_size()
    target, tmp, group = start.target, start.tmp, start.group
    deferred = sync_later is not None and start.deferrable
    # 2. Every rank writes its own files there (and its share of the replicated ones).
    report = None
    try:
        report = prepare() if prepare is not None else None
        part = part_of_rank(payload, rank, world_size, split=start.split)
        records, local = write_payload(tmp, part, fsync=not deferred), None
    except Exception as err:
        if not distributed:
            discard(tmp)
            raise
        records, local, report = {}, err, None
    trace.on_save(step)  # hf-resumable check: written, not committed (its "inside a save" kill point)
    # 3. The records meet on every rank as JSON (never pickle). If any rank failed, nothing is committed.
    gathered = all_gather_json({"records": records_to_json(records), "error": _describe(local), "report": report},
                               group=group)
    failed = [entry["error"] for entry in gathered if entry["error"] is not None]
    if failed:
        if rank == 0:
            discard(tmp)
        barrier(group)
        if local is not None:
            raise local
        raise _rebuild(failed[0], f"saving {target} failed on another rank; the previous checkpoint is untouched")
    files: dict[str, FileRecord] = {}
    for entry in gathered:
        files.update(records_from_json(entry["records"]))
    # 4. Rank 0 writes the files built from every rank's report, the manifest last, then commits (_fs.commit_dir).
    outcome, late, manifest = None, {}, None
    if rank == 0:
        try:
            for spec in payload.indexes:  # the indexes of shards that several ranks wrote
                if spec.relpath not in files:
                    late[spec.relpath] = write_bytes_durably(tmp / spec.relpath,
                                                             json_bytes(index_document(spec, files)),
                                                             fsync=not deferred)
            if finalize is not None:
                for relpath, data in finalize([entry["report"] for entry in gathered]).items():
                    late[relpath] = write_bytes_durably(tmp / relpath, data, fsync=not deferred)
            manifest = Manifest(files={**files, **late}, step=step, world_size=world_size,
                                metrics=dict(metrics or {}))
            write_bytes_durably(tmp / MANIFEST_FILE, manifest.to_json(), fsync=not deferred)
            if deferred:  # durable before the rename: whatever of the checkpoint reaches the disk, the record does
                mark_pending(tmp)
            commit_dir(tmp, target, replaces=start.replaces, sync=not deferred)
        except BaseException as err:
            discard(tmp)
            if not distributed or not isinstance(err, Exception):
                raise
            outcome = err
    # 5. Every rank learns whether the commit happened (and the records of rank 0's late files).
    committed = broadcast_json({"error": _describe(outcome), "late": records_to_json(late)}, group=group)
    if committed["error"] is not None:
        if outcome is not None:
            raise outcome
        raise _rebuild(committed["error"], f"rank 0 failed to commit {target}; the previous checkpoint is untouched")
    if manifest is None:  # the other ranks: the same files (rank 0's late ones included), step and metrics
        manifest = Manifest(files={**files, **records_from_json(committed["late"])}, step=step,
                            world_size=world_size, metrics=dict(metrics or {}))
    files = manifest.files
    if rank == 0:
        total = sum(r.size for r in files.values())
        logger.info("Saved %s (%d files, %.1f MB) in %.2f s%s", target, len(files), total / 1e6,
                    time.perf_counter() - began, " (fsyncs deferred)" if deferred else "")
    if deferred:
        written = list(records) + ([*late, MANIFEST_FILE] if rank == 0 else [])
        sync_later(target, written)
    return manifest


def save_payload(target: Path, payload: Payload, *, step: int | None, metrics: dict[str, float] | None,
                 overwrite: bool, prepare: Callable[[], Any] | None = None,
                 finalize: Callable[[list[Any]], Mapping[str, bytes]] | None = None,
                 sync_later: Callable[[Path, list[str]], None] | None = None) -> Manifest:
    """Write and commit ``payload`` at ``target`` (collective under torch.distributed), blocking; see
    :func:`finish_save`. Errors keep their type (an ``OSError`` its errno) on the rank where they happened; the other
    ranks raise the same kind."""
    start = begin_save(target, overwrite=overwrite, signature=replica_signature(payload))
    return finish_save(start, payload, step=step, metrics=metrics, prepare=prepare, finalize=finalize,
                       sync_later=sync_later)


def _describe(err: BaseException | None) -> dict[str, Any] | None:
    """A JSON description of an exception, to re-raise the same kind of error on other ranks."""
    if err is None:
        return None
    rank, _ = rank_and_world_size()
    return {"type": type(err).__name__, "errno": getattr(err, "errno", None) if isinstance(err, OSError) else None,
            "message": f"rank {rank}: {type(err).__name__}: {err}"}


def _rebuild(description: dict[str, Any], context: str) -> Exception:
    message = f"{context}: {description['message']}"
    if description["type"] == CheckpointExistsError.__name__:
        return CheckpointExistsError(message)
    if description["errno"] is not None:
        return OSError(description["errno"], message)
    return RuntimeError(message)
