"""Write a :class:`Payload` into a temp dir, then commit: manifest last, fsync, atomic rename.

Single process: a unique temp sibling ``.tmp-checkpoint-N-<id>``. Under torch.distributed every rank
writes its own files into the shared ``.tmp-checkpoint-N``; rank 0 gathers the file records (as
JSON, never pickle), writes the manifest only after every rank reported its files durable, and
renames. A rank killed mid-save therefore leaves no manifest, and the previous checkpoint stays the
latest valid one.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

import torch

from ..constants import MANIFEST_FILE
from ..distributed import all_gather_json, barrier, broadcast_json, is_distributed
from ..errors import CheckpointExistsError
from ..progress import progress_bar
from ..rng import save_rng_state
from ..safetensors_io import FileRecord, write_safetensors
from ._fs import commit_dir, create_temp_dir, temp_dir_for, write_bytes_durably
from ._payload import SHARDS_KEY, Payload
from ._staging import copy_into
from ._threads import run_in_threads
from .manifest import Manifest, records_from_json, records_to_json

logger = logging.getLogger(__name__)

# Tensor files written concurrently by one rank.
WRITE_THREADS = 2


def check_target(target: Path, *, overwrite: bool) -> None:
    """Refuse to replace an existing directory unless ``overwrite``."""
    if target.exists() and not overwrite:
        kind = "a committed checkpoint" if (target / MANIFEST_FILE).exists() else "a directory"
        raise CheckpointExistsError(
            f"{target} already exists and is {kind}; pass overwrite=True to replace it atomically, or save under "
            "another step."
        )


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
        shards = {name: {"size": records[name].size, "sha256": records[name].sha256}
                  for name in dict.fromkeys(spec.weight_map.values())}
        document = {"metadata": {**spec.metadata, SHARDS_KEY: shards}, "weight_map": spec.weight_map}
        raw = (json.dumps(document, indent=2, sort_keys=True) + "\n").encode()
        records[spec.relpath] = write_bytes_durably(tmp / spec.relpath, raw)
    for relpath, data in payload.blobs.items():
        records[relpath] = write_bytes_durably(tmp / relpath, data)
    if payload.rng is not None and payload.rng_relpath is not None:
        path = tmp / payload.rng_relpath
        path.parent.mkdir(parents=True, exist_ok=True)
        records[payload.rng_relpath] = save_rng_state(path, payload.rng)
    return records


def save_payload(target: Path, payload: Payload, *, step: int | None, metrics: dict[str, float] | None,
                 overwrite: bool) -> Manifest:
    """Write and commit ``payload`` at ``target`` (collective under torch.distributed)."""
    started = time.perf_counter()
    distributed = is_distributed()
    tmp = temp_dir_for(target, unique=not distributed)
    rank = torch.distributed.get_rank() if distributed else 0
    world_size = torch.distributed.get_world_size() if distributed else 1
    error = None
    if rank == 0:
        try:
            check_target(target, overwrite=overwrite)
            create_temp_dir(tmp)
        except Exception as err:  # noqa: BLE001 - re-raised on every rank below
            error = f"{type(err).__name__}: {err}"
    error = broadcast_json(error)
    if error is not None:
        if rank == 0:
            raise CheckpointExistsError(error) if "already exists" in error else RuntimeError(error)
        raise RuntimeError(f"rank 0 could not start the save of {target}: {error}")
    try:
        records = write_payload(tmp, payload)
        local_error = None
    except Exception as err:  # noqa: BLE001 - every rank must learn that the save failed
        records, local_error = {}, f"rank {rank}: {type(err).__name__}: {err}"
        if not distributed:
            _discard(tmp)
            raise
    gathered = all_gather_json({"records": records_to_json(records), "error": local_error})
    errors = [g["error"] for g in gathered if g["error"]]
    if errors:
        if rank == 0:
            _discard(tmp)
        barrier()
        raise OSError(f"Saving {target} failed; the previous checkpoint is untouched: " + "; ".join(errors))
    files: dict[str, FileRecord] = {}
    for entry in gathered:
        files.update(records_from_json(entry["records"]))
    manifest = Manifest(files=files, step=step, world_size=world_size, metrics=dict(metrics or {}))
    if rank == 0:
        try:
            write_bytes_durably(tmp / MANIFEST_FILE, manifest.to_json())
            commit_dir(tmp, target, overwrite=overwrite)
        except BaseException:
            _discard(tmp)
            raise
        finally:
            barrier()
    else:
        barrier()
        if not (target / MANIFEST_FILE).exists():
            raise OSError(f"rank 0 failed to commit {target}; the previous checkpoint is untouched.")
    if rank == 0:
        total = sum(r.size for r in files.values())
        logger.info("Saved %s (%d files, %.1f MB) in %.2f s", target, len(files), total / 1e6,
                    time.perf_counter() - started)
    return manifest


def _discard(tmp: Path) -> None:
    import shutil

    shutil.rmtree(tmp, ignore_errors=True)


class AsyncSaver:
    """Stage tensors into reusable host buffers, then write them on a background thread.

    Buffers are keyed by (file, tensor name) and reused while shape and dtype match, so the first
    touch of fresh memory is paid once, not at every save. At most one save is in flight: the next
    save, any load and interpreter exit wait for it, and its exception is raised there.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, str], torch.Tensor] = {}
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()

    def stage(self, payload: Payload) -> Payload:
        """Copy every tensor of ``payload`` into a staging buffer (returns a payload over the buffers)."""
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        for tensor_file in payload.tensor_files:
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

    def submit(self, target: Path, payload: Payload, *, step, metrics, overwrite, on_commit=None) -> None:
        """Wait for the previous save, stage ``payload`` and start writing it in the background."""
        self.wait()
        self.stage(payload)

        def run() -> None:
            try:
                save_payload(target, payload, step=step, metrics=metrics, overwrite=overwrite)
                if on_commit is not None:
                    on_commit()
            except BaseException as err:  # noqa: BLE001 - kept and raised at the next call
                with self._lock:
                    self._error = err

        self._thread = threading.Thread(target=run, name=f"hf_resumable-save-{target.name}", daemon=False)
        self._thread.start()

    def wait(self) -> None:
        """Block until the in-flight save (if any) is committed; raise its error if it failed."""
        from ..errors import AsyncSaveError

        thread = self._thread
        if thread is not None:
            thread.join()
            self._thread = None
        with self._lock:
            error, self._error = self._error, None
        if error is not None:
            raise AsyncSaveError(f"A background checkpoint save failed: {type(error).__name__}: {error}") from error

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()
