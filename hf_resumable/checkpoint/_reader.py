"""Load a committed checkpoint into live objects (model, optimizer, scheduler, scaler, RNG)."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..constants import (
    DATA_STATE_DIR,
    DATA_STATE_FILE_PATTERN,
    MODEL_INDEX_FILE,
    OPTIMIZER_INDEX_FILE,
    RNG_DIR,
    RNG_FILE_PATTERN,
    STATE_KEY_EXTRA,
    STATE_KEY_OPTIMIZER,
    STATE_KEY_PROGRESS,
    STATE_KEY_SCALER,
    STATE_KEY_SCHEDULER,
    TRAINING_STATE_FILE,
)
from ..errors import CheckpointMismatchError, CorruptCheckpointError, IncompleteCheckpointError
from ..rng import RngState, load_rng_state
from ..safetensors_io import FileRecord, read_safetensors, record_of
from ..sharding import ShardIndex, parse_index
from ..state_codec import decode_state
from ._model import TIED_KEY, check_model_fits, retie
from ._optimizer import check_optimizer_matches, existing_state_targets, optimizer_from_tensors, parameter_names
from ._payload import STATE_TENSORS_FILE
from ._threads import run_in_threads
from .manifest import Manifest
from .verify import VerifyReport

logger = logging.getLogger(__name__)


@dataclass
class LoadedCheckpoint:
    """What :func:`load_checkpoint` read besides the objects it filled in.

    Args:
        path (`Path`): the checkpoint directory.
        manifest (`Manifest`): its manifest.
        training_state (`dict`): the progress cursor passed to ``save_checkpoint(training_state=...)``.
        extra (`dict`): the ``extra`` state.
        data_state (`dict`, *optional*): this rank's data position.
        rng_state (`RngState`, *optional*): this rank's RNG state (already restored if asked).
    """

    path: Path
    manifest: Manifest
    training_state: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    data_state: dict[str, Any] | None = None
    rng_state: RngState | None = None

    @property
    def step(self) -> int | None:
        return self.manifest.step


class _Reader:
    """Reads files of one verified checkpoint, checking each file's hash while reading it."""

    def __init__(self, path: Path, report: VerifyReport, *, hash_on_read: bool) -> None:
        self.path = path
        self.report = report
        self.manifest = report.manifest
        self.hash_on_read = hash_on_read

    def expected(self, relpath: str) -> FileRecord | None:
        """The manifest record to check ``relpath`` against while reading it (``None``: not checked)."""
        return self.manifest.files[relpath] if self.hash_on_read else None

    def json(self, relpath: str) -> Any:
        if relpath not in self.manifest.files:
            raise IncompleteCheckpointError(f"{self.path}: {relpath} is not part of this checkpoint.")
        raw = (self.path / relpath).read_bytes()
        if self.hash_on_read and (problem := self.manifest.files[relpath].mismatch(record_of(raw))):
            raise CorruptCheckpointError(f"{self.path / relpath}: {problem} (modified or corrupted after the save).")
        try:
            return json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise CorruptCheckpointError(f"{self.path / relpath}: invalid JSON ({err}).") from None

    def index(self, relpath: str) -> ShardIndex:
        return parse_index(self.json(relpath), source=str(self.path / relpath))

    def tensors(self, relpath: str, *, into: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        return read_safetensors(self.path / relpath, header=self.report.headers.get(relpath), into=into,
                                expected=self.expected(relpath))

    def stored(self, index: ShardIndex) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """dtype and shape of every tensor ``index`` names, from the headers verification already read."""
        stored = {}
        for filename in index.filenames:
            tensors = self.report.headers[filename].tensors
            stored.update({n: (tensors[n].torch_dtype, tensors[n].shape) for n in index.names_in(filename)})
        return stored

    def sharded(self, index: ShardIndex, *, into: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        for filename in index.filenames:
            if filename not in self.manifest.files:
                raise IncompleteCheckpointError(f"{self.path}: index names {filename}, which the manifest lacks.")
        out: dict[str, torch.Tensor] = {}
        # Two files at a time: each file's hash runs on its own thread, so both cores hash while reading.
        for part in run_in_threads(lambda f: self.tensors(f, into=into), index.filenames, workers=2):
            out.update(part)
        return out


def load_model_weights(reader: _Reader, model: torch.nn.Module, *, strict: bool) -> None:
    """Fill ``model`` shard by shard, reading straight into its parameters where possible."""
    index = reader.index(MODEL_INDEX_FILE)
    tied = index.metadata.get(TIED_KEY) or {}
    targets = check_model_fits(model, reader.stored(index), tied, strict=strict, source=str(reader.path))
    leftovers = reader.sharded(index, into=targets)
    if leftovers and strict:
        raise CheckpointMismatchError(f"{reader.path}: unexpected tensors {sorted(leftovers)[:10]}")
    retie(model.state_dict(keep_vars=True), tied)


def optimizer_index(reader: _Reader, document: Mapping[str, Any] | None) -> ShardIndex:
    if OPTIMIZER_INDEX_FILE not in reader.manifest.files or not document:
        raise IncompleteCheckpointError(
            f"{reader.path}: the checkpoint has no optimizer state; load without optimizer= or save with it.")
    return reader.index(OPTIMIZER_INDEX_FILE)


def load_all(reader: _Reader, *, model, optimizer, scheduler, scaler, restore_rng: bool, strict: bool,
             rank: int) -> LoadedCheckpoint:
    """Load every requested part, RNG last (restoring anything else may draw random numbers)."""
    state = reader.json(TRAINING_STATE_FILE)
    state_tensors = reader.tensors(STATE_TENSORS_FILE) if STATE_TENSORS_FILE in reader.manifest.files else {}
    source = str(reader.path / TRAINING_STATE_FILE)
    document = state.get(STATE_KEY_OPTIMIZER)
    # The optimizer's tensors are read while the model loads (two IO streams, hashes on both cores).
    into: dict[str, torch.Tensor] = {}
    if optimizer is not None:
        index = optimizer_index(reader, document)
        names = parameter_names(model, optimizer)
        # Refuse a mismatched optimizer before its existing state is overwritten in place (existing state
        # tensors of the stored dtype and shape are filled directly, as model weights are).
        check_optimizer_matches(optimizer, names, document, source=source)
        into = existing_state_targets(optimizer, names, reader.stored(index)) if optimizer.state else {}
    jobs = [lambda: {**into, **reader.sharded(index, into=into)} if optimizer is not None else None,
            lambda: load_model_weights(reader, model, strict=strict) if model is not None else None]
    optimizer_tensors, _ = run_in_threads(lambda job: job(), jobs, workers=2)
    if optimizer is not None:
        optimizer_from_tensors(optimizer, names, optimizer_tensors, document, source=source)
    for name, obj, key in (("scheduler", scheduler, STATE_KEY_SCHEDULER), ("scaler", scaler, STATE_KEY_SCALER)):
        if obj is None:
            continue
        if state.get(key) is None:
            raise IncompleteCheckpointError(f"{reader.path}: no {name} state was saved; pass {name}=None to load.")
        obj.load_state_dict(decode_state(state[key], state_tensors, source=source))
    loaded = LoadedCheckpoint(
        path=reader.path,
        manifest=reader.manifest,
        training_state=decode_state(state.get(STATE_KEY_PROGRESS) or {}, state_tensors, source=source),
        extra=decode_state(state.get(STATE_KEY_EXTRA) or {}, state_tensors, source=source),
    )
    data_rel = f"{DATA_STATE_DIR}/{DATA_STATE_FILE_PATTERN.format(rank=rank)}"
    if data_rel in reader.manifest.files:
        loaded.data_state = decode_state(reader.json(data_rel), {}, source=data_rel)
    rng_rel = f"{RNG_DIR}/{RNG_FILE_PATTERN.format(rank=rank)}"
    if rng_rel in reader.manifest.files:
        loaded.rng_state = load_rng_state(reader.path / rng_rel, expected=reader.expected(rng_rel))
    return loaded
