"""Write a :class:`Payload` into a temp dir, then commit: manifest last, fsync, atomic rename.

Rank 0 creates an owned temp sibling ``.tmp-checkpoint-N.<owner>.<nonce>`` (see ``_owner.py``) and
tells every rank its name; every rank writes its own files there; rank 0 gathers the file records (as
JSON, never pickle), writes the manifest only after every rank reported its files durable, and
renames. A rank killed mid-save therefore leaves no manifest, and the previous checkpoint stays the
latest valid one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import stat
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import trace
from ..constants import MANIFEST_FILE
from ..distributed import (
    all_gather_json,
    barrier,
    broadcast_json,
    checkpoint_group,
    is_distributed,
    rank_and_world_size,
)
from ..errors import CheckpointExistsError, HfResumableError
from ..format._jsonio import json_bytes
from ..format.rng import save_rng_state
from ..format.safetensors_io import FileRecord, write_safetensors
from ..progress import progress_bar
from ._fs import DirIdentity, commit_dir, create_temp_dir, discard, write_bytes_durably
from ._payload import SHARDS_KEY, IndexSpec, Payload, TensorFile
from ._pins import release_pin
from ._replicas import part_of_rank, replica_signature, replicas_split
from ._staging import copy_into
from ._threads import run_in_threads
from .manifest import Manifest, read_manifest, records_from_json, records_to_json

logger = logging.getLogger(__name__)

# Tensor files written concurrently by one rank.
WRITE_THREADS = 2


def check_target(target: Path, *, overwrite: bool) -> DirIdentity | None:
    """Whether a save may go to ``target``: the directory it will replace, or ``None`` if ``target`` is free.

    Only an empty directory or a committed hf_resumable checkpoint is ever replaced (and only with
    ``overwrite``): hf_resumable never deletes what it did not write.

    Raises:
        CheckpointExistsError: ``target`` exists and may not be replaced (the message says why and what to do).
    """
    try:
        info = os.lstat(target)
    except FileNotFoundError:
        return None
    if not stat.S_ISDIR(info.st_mode):
        kind = "a symbolic link" if stat.S_ISLNK(info.st_mode) else "a file"
        raise CheckpointExistsError(f"{target} exists and is {kind}, not a checkpoint directory; hf_resumable does "
                                    "not replace it. Remove it, or save under another name.")
    manifest = _manifest_or_none(target)
    if not overwrite:
        kind = "a committed checkpoint" if manifest is not None else "a directory"
        raise CheckpointExistsError(
            f"{target} already exists and is {kind}; pass overwrite=True to replace it atomically, or save under "
            "another step."
        )
    if manifest is None and _has_entries(target):
        raise CheckpointExistsError(
            f"{target} holds files that hf_resumable did not write (no valid {MANIFEST_FILE}), e.g. a checkpoint "
            "of the stock Trainer or of another tool; hf_resumable never replaces those. Move them away or save "
            "under another name (a stock Trainer checkpoint can be converted with `hf-resumable convert`)."
        )
    if manifest is not None and (added := _unlisted_entries(target, manifest)):
        raise CheckpointExistsError(
            f"{target} is a committed checkpoint, but files were added to it that hf_resumable did not write "
            f"({', '.join(added[:5])}{', ...' if len(added) > 5 else ''}); replacing it would delete them. Move "
            "them out of the checkpoint, or save under another name."
        )
    return (info.st_dev, info.st_ino)


def _manifest_or_none(directory: Path) -> Manifest | None:
    try:
        return read_manifest(directory)
    except (HfResumableError, OSError):
        return None


def _unlisted_entries(directory: Path, manifest: Manifest) -> list[str]:
    """Files (and empty directories) under ``directory`` that ``manifest`` does not list: somebody else's."""
    listed = set(manifest.files) | {MANIFEST_FILE}
    parents = {str(Path(name).parent) for name in listed}
    extra = []
    for root, dirs, files in os.walk(directory):
        relroot = os.path.relpath(root, directory)
        for name in files:
            relpath = name if relroot == "." else f"{relroot}/{name}"
            if relpath not in listed:
                extra.append(relpath)
        for name in dirs:
            relpath = name if relroot == "." else f"{relroot}/{name}"
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
    ...     write_file_durably(tmp / "manifest.json", manifest.to_json())

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



def _has_entries(directory: Path) -> bool:
    with os.scandir(directory) as entries:
        return next(entries, None) is not None


def index_document(spec: IndexSpec, records: Mapping[str, FileRecord]) -> dict[str, Any]:
    """The index file of ``spec`` once its shards are written (pure): its weight map and metadata, plus each
    shard's size and sha256 under ``SHARDS_KEY`` (what loads and Hub downloads check a shard against)."""
    shards = {name: {"size": records[name].size, "sha256": records[name].sha256}
              for name in dict.fromkeys(spec.weight_map.values())}
    return {"metadata": {**spec.metadata, SHARDS_KEY: shards}, "weight_map": spec.weight_map}


def write_payload(tmp: Path, payload: Payload) -> dict[str, FileRecord]:
    """Write every file of ``payload`` under ``tmp``; return their records."""
    records: dict[str, FileRecord] = {}
    total = sum(t.numel() * t.element_size() for f in payload.tensor_files for _, t in f.tensors)
    with progress_bar(total=total, desc=f"saving {tmp.name}") as bar:

        def write(tensor_file) -> tuple[str, FileRecord]:
            path = tmp / tensor_file.relpath
            path.parent.mkdir(parents=True, exist_ok=True)
            record = write_safetensors(path, tensor_file.tensors, metadata=tensor_file.metadata)
            bar.update(record.size)
            return tensor_file.relpath, record

        # Two files at a time: each file's hash runs on its own thread, so two hashes use both cores
        # while the disk is kept busy.
        records.update(run_in_threads(write, payload.tensor_files, workers=WRITE_THREADS))
    for spec in payload.indexes:
        records[spec.relpath] = write_bytes_durably(tmp / spec.relpath, json_bytes(index_document(spec, records)))
    for relpath, data in payload.blobs.items():
        records[relpath] = write_bytes_durably(tmp / relpath, data)
    if payload.rng is not None and payload.rng_relpath is not None:
        path = tmp / payload.rng_relpath
        path.parent.mkdir(parents=True, exist_ok=True)
        records[payload.rng_relpath] = save_rng_state(path, payload.rng)
    return records


@dataclass(frozen=True)
class SaveStart:
    """A save that passed step 1 on every rank: its target, the temp dir, and what it may replace."""

    target: Path
    tmp: Path
    replaces: DirIdentity | None
    group: Any = None
    split: bool = False  # every rank holds the same replicated files: each writes its share (``_replicas.py``)


def begin_save(target: Path, *, overwrite: bool, group: Any = None, signature: str | None = None) -> SaveStart:
    """Step 1 of the commit protocol (collective over ``group`` under torch.distributed).

    Rank 0 checks the target (only an empty dir or our own checkpoint may be replaced) and creates the temp
    dir under a name that carries its owner, so no cleaner can ever take it for a dead save's; every rank
    learns its name, or rank 0's error (raised on every rank, with its type). Every rank first releases its
    reader pin on the target's parent (``find_latest_checkpoint``'s), so that none is left if the save fails.
    The same exchange carries every rank's ``signature`` (``_replicas.replica_signature`` of its payload): the
    replicated files are split across the ranks only if all are the same.
    """
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
                                "signature": signature}, group=group)
    started = gathered[0]
    if started["error"] is not None:
        if failure is not None:
            raise failure
        raise _rebuild(started["error"], f"rank 0 could not start the save of {target}")
    split = replicas_split([entry["signature"] for entry in gathered])
    return SaveStart(target, target.parent / started["tmp"], replaces, group, split)


def finish_save(start: SaveStart, payload: Payload, *, step: int | None, metrics: dict[str, float] | None,
                prepare: Callable[[], Any] | None = None,
                finalize: Callable[[list[Any]], Mapping[str, bytes]] | None = None) -> Manifest:
    """Steps 2-5 of the commit protocol for a save that :func:`begin_save` started (collective over its group).

    ``prepare()``, if given, runs first in step 2 (it may add files to ``payload``); its JSON result travels with
    this rank's records, and a failure in it fails the save like a failed write. ``finalize(reports)``, if given,
    gets every rank's ``prepare`` result in rank order and returns more small files (``{relpath: bytes}``, e.g. a
    layout of every rank's files); rank 0 calls it and writes them once every rank's files are durable, before the
    manifest, and every rank learns their records in step 5.
    """
    began = time.perf_counter()
    distributed = is_distributed()
    rank, world_size = rank_and_world_size()
    target, tmp, group = start.target, start.tmp, start.group
    # 2. Every rank writes its own files there (and its share of the replicated ones): created exclusively, hashed
    #    while written, fsynced.
    report = None
    try:
        report = prepare() if prepare is not None else None
        records, local = write_payload(tmp, part_of_rank(payload, rank, world_size, split=start.split)), None
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
    # 4. Rank 0 writes the files built from every rank's report, the manifest last, then commits: fsync the tree,
    #    rename into place (no-replace, or compare-and-swap for an overwrite), fsync the parent.
    outcome, late, manifest = None, {}, None
    if rank == 0:
        try:
            if start.split:  # the indexes of shards that several ranks wrote
                for spec in payload.indexes:
                    late[spec.relpath] = write_bytes_durably(tmp / spec.relpath,
                                                             json_bytes(index_document(spec, files)))
            if finalize is not None:
                for relpath, data in finalize([entry["report"] for entry in gathered]).items():
                    late[relpath] = write_bytes_durably(tmp / relpath, data)
            manifest = Manifest(files={**files, **late}, step=step, world_size=world_size,
                                metrics=dict(metrics or {}))
            write_bytes_durably(tmp / MANIFEST_FILE, manifest.to_json())
            commit_dir(tmp, target, replaces=start.replaces)
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
        logger.info("Saved %s (%d files, %.1f MB) in %.2f s", target, len(files), total / 1e6,
                    time.perf_counter() - began)
    return manifest


def save_payload(target: Path, payload: Payload, *, step: int | None, metrics: dict[str, float] | None,
                 overwrite: bool, prepare: Callable[[], Any] | None = None,
                 finalize: Callable[[list[Any]], Mapping[str, bytes]] | None = None) -> Manifest:
    """Write and commit ``payload`` at ``target`` (collective under torch.distributed), blocking.

    The steps are those of docs/architecture.md, "Commit protocol" (``prepare`` and ``finalize``: see
    :func:`finish_save`). Errors keep their type (an ``OSError`` keeps its errno) on the rank where they happened;
    the other ranks raise the same kind.
    """
    start = begin_save(target, overwrite=overwrite, signature=replica_signature(payload))
    return finish_save(start, payload, step=step, metrics=metrics, prepare=prepare, finalize=finalize)


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


class _SaveJob:
    """One async save on the saver's thread: step 1, then (once the training thread has staged) steps 2-5."""

    def __init__(self, target: Path, payload: Payload, *, overwrite: bool, group: Any, step, metrics, on_commit,
                 prepare, finalize, signature: str | None = None) -> None:
        self.target, self._payload, self._overwrite, self._group = target, payload, overwrite, group
        self._signature = signature
        self._step, self._metrics, self._on_commit = step, metrics, on_commit
        self._prepare, self._finalize = prepare, finalize
        self.pid = os.getpid()  # a forked child does not own its parent's save (nor the thread writing it)
        self._started = threading.Event()  # step 1 is over (start_error says how)
        self._staged = threading.Event()  # the training thread's copy is over (staging_error says how)
        self.done = threading.Event()
        self.start: SaveStart | None = None
        self.start_error: BaseException | None = None
        self.staging_error: BaseException | None = None
        self.error: BaseException | None = None  # raised at the next wait

    def run(self) -> None:
        try:
            self._run()
        finally:
            self.done.set()

    def _run(self) -> None:
        try:
            start = self.start = begin_save(self.target, overwrite=self._overwrite, group=self._group,
                                            signature=self._signature)
        except BaseException as err:  # noqa: BLE001 - raised on the training thread by started()
            self.start_error = err
            return
        finally:
            self._started.set()
        self._staged.wait()
        prepare, finalize, keep = self._prepare, self._finalize, True
        if self.staging_error is not None:  # raised on the training thread; every rank must learn it in step 3
            cause, finalize, keep = self.staging_error, None, False

            def prepare() -> None:
                raise RuntimeError(f"staging the tensors failed: {type(cause).__name__}: {cause}") from cause
        try:
            finish_save(start, self._payload, step=self._step, metrics=self._metrics, prepare=prepare,
                        finalize=finalize)
            if self._on_commit is not None:
                self._on_commit()
        except BaseException as err:  # noqa: BLE001 - kept and raised at the next call
            if keep:
                self.error = err

    def staged(self, error: BaseException | None = None) -> None:
        """The training thread's copy is over (``error``: it failed)."""
        self.staging_error = error
        self._staged.set()

    def started(self) -> SaveStart:
        """Wait for step 1; raise its error (on every rank: rank 0 told them) if it failed."""
        self._started.wait()
        if self.start_error is not None:
            raise self.start_error
        return self.start


class _Worker:
    """One daemon thread, started on first use, that runs submitted jobs in order.

    A thread started per save would block the starter until it runs, tens of milliseconds on a loaded machine, on
    the training loop's time. Daemon: interpreter exit waits for the in-flight save through ``atexit`` (see
    :mod:`.api`), not for an idle thread; a forked child starts its own.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._jobs: queue.SimpleQueue | None = None
        self._thread: threading.Thread | None = None
        self._pid: int | None = None

    def submit(self, job: Callable[[], None]) -> None:
        if self._thread is None or self._pid != os.getpid() or not self._thread.is_alive():
            self._jobs, self._pid = queue.SimpleQueue(), os.getpid()
            self._thread = threading.Thread(target=self._serve, args=(self._jobs,), name=self._name, daemon=True)
            self._thread.start()
        self._jobs.put(job)

    @staticmethod
    def _serve(jobs: queue.SimpleQueue) -> None:
        while True:
            jobs.get()()  # a job keeps its own errors


class AsyncSaver:
    """Stage tensors into reusable host buffers, then write them on a background thread.

    Buffers are keyed by (file, tensor name) and reused while shape and dtype match, so the first
    touch of fresh memory is paid once, not at every save. At most one save is in flight: the next
    save, any load and interpreter exit wait for it, and its exception is raised there.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, str], torch.Tensor] = {}
        self._job: _SaveJob | None = None
        self._worker = _Worker("hf_resumable-save")

    def stage(self, payload: Payload, also: Sequence[TensorFile] = ()) -> Payload:
        """Copy every tensor of ``payload`` (and of the files ``also``) into staging buffers, in one parallel copy;
        the files then hold the buffers (returns ``payload``)."""
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        for tensor_file in [*payload.tensor_files, *also]:
            staged = []
            for name, tensor in tensor_file.tensors:
                key = (tensor_file.relpath, name)
                buffer = self._buffers.get(key)
                if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
                    buffer = torch.empty(tensor.shape, dtype=tensor.dtype,
                                         pin_memory=torch.cuda.is_available() and tensor.is_cuda)
                    self._buffers[key] = buffer
                pairs.append((buffer, tensor))
                staged.append((name, buffer))
            tensor_file.tensors = staged
        copy_into(pairs)
        return payload

    def submit(self, target: Path, payload: Payload, *, step, metrics, overwrite, on_commit=None,
               also_stage: Sequence[TensorFile] = (), prepare=None, finalize=None) -> None:
        """Wait for the previous save, stage ``payload`` (and ``also_stage``) and start writing it in the background.

        Under torch.distributed every rank calls it. Step 1 (rank 0 checks the target and creates the temp dir) runs
        on the saver's thread while this one copies the tensors, and is over when this returns, so a refused target
        raises now on every rank; steps 2-5 (``prepare`` and ``finalize`` too, see :func:`finish_save`) follow on
        that thread. Its collectives use the save's own gloo group (``distributed.checkpoint_group``), never the
        training loop's. If the copy fails on this rank after step 1, the background part still runs, so that every
        rank learns of the failure and nothing is committed; the error is raised here.
        """
        self.wait()
        group = checkpoint_group()  # created on first use: a collective of the training thread
        signature = replica_signature(payload)
        job = _SaveJob(target, payload, overwrite=overwrite, group=group, step=step, metrics=metrics,
                       on_commit=on_commit, prepare=prepare, finalize=finalize, signature=signature)
        self._job = job
        self._worker.submit(job.run)
        rank, world_size = rank_and_world_size()
        try:
            # Only the files this rank writes: its share of the replicated ones as planned, while step 1 settles
            # whether the ranks split them (they do unless their payloads differ); then whatever that adds.
            staged = self._stage_part(part_of_rank(payload, rank, world_size, split=signature is not None), also_stage)
            start = job.started()  # a refused target raises here (the job is over: it waits for no staging)
            self._stage_part(part_of_rank(payload, rank, world_size, split=start.split), (), skip=staged)
        except BaseException as err:
            job.staged(err)
            raise
        job.staged()

    def _stage_part(self, part: Payload, also: Sequence[TensorFile], *, skip: set[str] = frozenset()) -> set[str]:
        """:meth:`stage` the files of ``part`` not in ``skip``; the relpaths of ``part``'s files."""
        self.stage(Payload(tensor_files=[f for f in part.tensor_files if f.relpath not in skip]), also)
        return {f.relpath for f in part.tensor_files}

    @property
    def in_flight(self) -> bool:
        job = self._job
        return job is not None and job.pid == os.getpid() and not job.done.is_set()

    def wait(self) -> None:
        """Block until the in-flight save (if any) is committed; raise its error if it failed."""
        from ..errors import AsyncSaveError

        job, self._job = self._job, None
        if job is None or job.pid != os.getpid():  # nothing in flight, or the parent's save (this is a forked child)
            return
        job.done.wait()
        if job.error is not None:
            raise AsyncSaveError(f"A background checkpoint save failed: {type(job.error).__name__}: {job.error}"
                                 ) from job.error


# The process's one background saver (``api.background_saver``), defined here so that a load below ``api`` (the shared
# reads, whose collectives use the save's group) can wait for it.
BACKGROUND_SAVER = AsyncSaver()
