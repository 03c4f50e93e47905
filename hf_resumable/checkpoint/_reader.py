"""Open a committed checkpoint once (decode and check everything that does not depend on a live object), then fill
live objects from it: :class:`OpenedCheckpoint`, in the numbered steps of docs/architecture.md ("Loading"). Nothing
is written into a live object before every check has passed.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .. import trace
from ..constants import (
    DATA_STATE_DIR,
    DATA_STATE_FILE_PATTERN,
    FROZEN_RECORD_FILE,
    LAYOUT_FILE,
    MAX_JSON_SIZE,
    MODEL_INDEX_FILE,
    OPTIMIZER_INDEX_FILE,
    RNG_DIR,
    RNG_FILE_PATTERN,
    STATE_KEY_EXTRA,
    STATE_KEY_PROGRESS,
    STATE_KEY_SCALER,
    STATE_KEY_SCHEDULER,
    STATE_TENSORS_FILE,
    TRAINABLE_INDEX_FILE,
    TRAINING_STATE_FILE,
)
from ..errors import (
    CheckpointMismatchError,
    ConfigDriftError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    InexactResumeError,
)
from ..format._jsonio import parse_json
from ..format._safefile import member_path, open_regular, read_regular_file
from ..format.rng import RngState, cuda_device_mismatch, decode_rng_state, restore_rng_state, visible_cuda_devices
from ..format.safetensors_io import record_of
from ..format.sharding import ShardIndex, parse_index
from ..format.slice_reader import VerifiedFile
from ..format.state_codec import decode_state
from .commit._parallel_read import FileRead, read_files
from .commit.manifest import Manifest
from .pieces._frozen import TrainablePart
from .pieces._pieces import engine_pieces, load_pieces_into
from .state._model import TIED_KEY, check_tied
from .state._model_files import model_index
from .state._validate import check_counters, check_data_position, check_like_live, check_training_state
from .verify import VerifyReport

logger = logging.getLogger(__name__)

__all__ = ["LoadedCheckpoint", "OpenedCheckpoint", "read_on_load"]

# Progress-cursor counters every open checks (non-negative ints when present); callers name more.
DEFAULT_COUNTERS = ("global_step",)


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


# Files an open and a load read besides this rank's data position and RNG state (safetensors files at the top
# level: weights, optimizer state, training-state tensors).
_READ_ON_LOAD = frozenset({TRAINING_STATE_FILE, MODEL_INDEX_FILE, TRAINABLE_INDEX_FILE, OPTIMIZER_INDEX_FILE,
                           FROZEN_RECORD_FILE, LAYOUT_FILE})


def read_on_load(rank: int) -> Callable[[str], bool]:
    """Which files of a checkpoint opening and loading it on ``rank`` reads: the ``keep`` of a verification whose
    report is handed to :func:`~hf_resumable.checkpoint.open_checkpoint` (``verified=``).

    Example:

    ```python
    >>> keep = read_on_load(1)
    >>> [keep(f) for f in ("training_state.json", "rng/rank-00001.safetensors", "rng/rank-00000.safetensors")]
    [True, True, False]

    ```
    """
    own = {f"{DATA_STATE_DIR}/{DATA_STATE_FILE_PATTERN.format(rank=rank)}",
           f"{RNG_DIR}/{RNG_FILE_PATTERN.format(rank=rank)}"}
    return lambda relpath: relpath in own or relpath in _READ_ON_LOAD or (
        "/" not in relpath and relpath.endswith(".safetensors"))


class _Reader:
    """Reads files of one verified checkpoint: the bytes its verification kept, else from disk (refused if no longer
    the file verification checked; each file's hash checked while it is read with ``hash_on_read``)."""

    def __init__(self, path: Path, report: VerifyReport, *, hash_on_read: bool) -> None:
        self.path = path
        self.report = report
        self.manifest = report.manifest
        self.hash_on_read = hash_on_read

    def file_read(self, relpath: str, into: Mapping[str, torch.Tensor] | None = None) -> FileRead:
        """How to read the safetensors file ``relpath``: from the verified bytes, or from disk (its hash checked while
        it streams with ``hash_on_read``)."""
        path, header = member_path(self.path, relpath), self.report.headers[relpath]
        data = self.report.verified_bytes(relpath)
        if data is not None:
            return FileRead(path, header, None, into or {}, data=data)
        expected = self.manifest.files[relpath] if self.hash_on_read else None
        return FileRead(path, header, expected, into or {}, check=self._unchanged(relpath))

    def verified_file(self, relpath: str) -> VerifiedFile:
        """The safetensors file ``relpath`` opened for slice reads, every byte a read uses checked against its manifest
        record (nothing with ``verify="none"``). Close it (or use it as a context manager)."""
        if relpath not in self.report.headers:
            raise CorruptCheckpointError(f"{self.path / relpath}: not a safetensors file this checkpoint lists.")
        record = self.manifest.files[relpath] if self.hash_on_read or self.report.full else None
        return VerifiedFile(member_path(self.path, relpath), self.report.headers[relpath], record,
                            hashed=self.report.full, check=self._unchanged(relpath))

    def _unchanged(self, relpath: str) -> Callable[[Any], None] | None:
        """The check that refuses ``relpath`` once it is no longer the file verification checked, if recorded."""
        if relpath not in self.report.identities:
            return None
        return lambda now: self.report.check_unchanged(relpath, now)

    def raw(self, relpath: str, *, limit: int = MAX_JSON_SIZE) -> bytes:
        """The bytes of a small file of the checkpoint: those its verification kept, else read (bounded) and, with
        ``hash_on_read``, hash-checked."""
        if relpath not in self.manifest.files:
            raise IncompleteCheckpointError(f"{self.path}: {relpath} is not part of this checkpoint.")
        data = self.report.verified_bytes(relpath)
        if data is not None:
            return data
        self.report.check_unchanged(relpath)
        raw = read_regular_file(member_path(self.path, relpath), limit=limit)
        record = self.manifest.files[relpath]
        if self.hash_on_read and (problem := record.mismatch(record_of(raw, **record.hashes()))):
            raise CorruptCheckpointError(f"{self.path / relpath}: {problem} (modified or corrupted after the save).")
        return raw

    def json(self, relpath: str) -> Any:
        """A JSON file of the checkpoint (:meth:`raw`), parsed with bounded depth."""
        return parse_json(self.raw(relpath), source=str(self.path / relpath))

    def release(self) -> None:
        """Drop the verified bytes kept for this open (a later read goes to disk, hash-checked)."""
        self.report.contents.clear()

    def index(self, relpath: str) -> ShardIndex:
        """An index of the checkpoint (its files against the manifest and their headers: checked by verification)."""
        return parse_index(self.json(relpath), source=str(self.path / relpath))

    def tensors(self, relpath: str) -> dict[str, torch.Tensor]:
        if relpath not in self.report.headers:
            raise CorruptCheckpointError(f"{self.path / relpath}: not a safetensors file.")
        return read_files([self.file_read(relpath)])

    def peek(self, files: Mapping[str, str]) -> dict[str, torch.Tensor]:
        """Small tensors (name -> the file that holds it) read by offset, NOT hash-checked (the full read checks them
        again), to check values such as optimizer step counts before anything is applied."""
        out = {}
        for name, filename in files.items():
            header = self.report.headers[filename]
            info = header.tensors[name]
            start = header.data_offset + info.start
            if (kept := self.report.contents.get(filename)) is not None:
                raw = kept[start : start + info.nbytes]  # checked to be unchanged when the full read takes them
            else:
                with open_regular(member_path(self.path, filename), buffering=0) as f:
                    raw = os.pread(f.fileno(), info.nbytes, start)
            if len(raw) != info.nbytes:
                raise CorruptCheckpointError(f"{self.path / filename}: file ends inside tensor {name!r}.")
            out[name] = torch.frombuffer(bytearray(raw), dtype=info.torch_dtype).reshape(info.shape)
        return out


@dataclass(eq=False)
class OpenedCheckpoint(LoadedCheckpoint):
    """A verified, decoded and checked checkpoint, ready to fill live objects (see :func:`open_checkpoint`).

    Args (besides :class:`LoadedCheckpoint`'s):
        rank (`int`) / world_size (`int`): the process that opened it.
        allow_inexact_resume (`bool`): the default of :meth:`load_into` and :meth:`restore_rng`.
        reshard (`bool`): weights and optimizer are cut to this world size on load (the caller keeps its data
            position across world sizes, or the checkpoint holds pieces), so a world-size change only affects the
            per-rank RNG streams.
    """

    rank: int = 0
    world_size: int = 1
    allow_inexact_resume: bool = False
    reshard: bool = False
    _reader: _Reader | None = field(default=None, repr=False)
    _document: dict[str, Any] = field(default_factory=dict, repr=False)
    _objects: dict[str, Any] = field(default_factory=dict, repr=False)  # decoded scheduler / scaler state
    _model_index: ShardIndex | None = field(default=None, repr=False)
    _tied: dict[str, str] = field(default_factory=dict, repr=False)
    _trainable: TrainablePart | None = field(default=None, repr=False)  # a checkpoint that references its base

    # ------------------------------------------------------------------ open

    @classmethod
    def open(cls, path: Path, report: VerifyReport, *, verify: str, rank: int, world_size: int,
             allow_inexact_resume: bool, counters: Iterable[str] = (), reshard: bool = False) -> "OpenedCheckpoint":
        """Decode and check everything that does not depend on a live object: steps 2-5 of opening (step 1,
        verification, is :func:`~hf_resumable.checkpoint.open_checkpoint`'s; ``report`` verified ``path``)."""
        reader = _Reader(path, report, hash_on_read=verify == "quick")
        manifest = report.manifest
        state_source = str(path / TRAINING_STATE_FILE)
        # 2. The structure of training_state.json (the manifest's fields were checked as it was read), its tensors:
        #    the structure is checked before decoding so that a malformed document fails with its field named.
        document = check_training_state(reader.json(TRAINING_STATE_FILE), source=state_source)
        tensors = reader.tensors(STATE_TENSORS_FILE) if STATE_TENSORS_FILE in manifest.files else {}
        # 3. Decode once: progress, extra, scheduler and scaler state (every codec marker checked); load_into and
        #    the integrations use these decoded objects, nobody reads training_state.json again.
        decode = lambda key: decode_state(document.get(key) or {}, tensors, source=state_source, path=key)  # noqa: E731
        opened = cls(path=path, manifest=manifest, training_state=decode(STATE_KEY_PROGRESS),
                     extra=decode(STATE_KEY_EXTRA), rank=rank, world_size=world_size,
                     allow_inexact_resume=allow_inexact_resume, reshard=reshard, _reader=reader, _document=document)
        for key in (STATE_KEY_SCHEDULER, STATE_KEY_SCALER):
            if document.get(key) is not None:
                opened._objects[key] = decode(key)
        check_counters(opened.training_state, (*DEFAULT_COUNTERS, *counters), source=state_source)
        # 4. This rank's data position and RNG state. The RNG state is tried on private generators: a state the
        #    real generators would refuse (or silently change) fails here, before any live object is touched.
        data_rel = f"{DATA_STATE_DIR}/{DATA_STATE_FILE_PATTERN.format(rank=rank)}"
        if data_rel in manifest.files:
            opened.data_state = decode_state(reader.json(data_rel), {}, source=str(path / data_rel))
            check_data_position(opened.data_state, source=str(path / data_rel))
        rng_rel = f"{RNG_DIR}/{RNG_FILE_PATTERN.format(rank=rank)}"
        if rng_rel in manifest.files:
            rng_tensors = reader.tensors(rng_rel)  # refused if it is not a safetensors file the checkpoint lists
            opened.rng_state = decode_rng_state(report.headers[rng_rel].metadata, rng_tensors,
                                                source=str(path / rng_rel))
        # 5. The model index and its tied-weight record (an alias must not be stored itself and must point at a
        #    stored tensor, else a load would overwrite one tensor with another); or the trainable part's index,
        #    with the frozen base's record.
        index = model_index(manifest.files, report.headers, read_index=reader.index, source=str(path))
        if index is not None:
            opened._model_index = index
            opened._tied = check_tied(index.metadata.get(TIED_KEY) or {}, index.weight_map, source=index.source)
        elif (trainable := TrainablePart.open(reader, path)) is not None:
            opened._trainable, opened._model_index, opened._tied = trainable, trainable.index, trainable.tied
        return opened

    # ------------------------------------------------------------------ policy

    @staticmethod
    def _inexact(message: str, fix: str, error: type[InexactResumeError], allow: bool) -> None:
        if not allow:
            raise error(f"{message}. {fix}")
        logger.warning("%s; continuing because allow_inexact_resume=True (NOT bit-exact).", message)

    def check_exact(self, *, weights: bool, rng: bool, allow_inexact_resume: bool | None = None) -> None:
        """The world-size / RNG inexactness policy, applied before anything is loaded.

        A regular checkpoint holds per-rank data positions and RNG streams, so loading weights to resume
        (or the RNG) at another world size is refused; a resharded load only refuses the RNG.

        Raises:
            ConfigDriftError: another world size (regular checkpoints), unless ``allow_inexact_resume``.
            InexactResumeError: another world size (resharded, with ``rng``), this rank's RNG state missing,
                or another number of CUDA devices, unless ``allow_inexact_resume``.
        """
        allow = self.allow_inexact_resume if allow_inexact_resume is None else allow_inexact_resume
        saved, now = self.manifest.world_size, self.world_size
        if saved != now and not self.reshard and (weights or rng):
            self._inexact(f"{self.path} was written by {saved} process(es) and is loaded by {now}: per-rank RNG and "
                          "data positions do not carry over, so the run would not continue exactly",
                          "Resume with the same world size, save with layout='pieces' to reshard on load, or "
                          "pass allow_inexact_resume=True.", ConfigDriftError, allow)
        if not rng:
            return
        if saved != now and self.reshard:
            self._inexact(f"{self.path} was saved by {saved} rank(s) and is loaded by {now}: weights, optimizer state "
                          "and an ElasticSampler position carry over exactly, but per-rank RNG streams (dropout) do "
                          "not", "Pass allow_inexact_resume=True (or restore_rng=False) to continue.",
                          InexactResumeError, allow)
        if self.rng_state is None:
            if self.reshard and saved != now:
                logger.warning("%s has no RNG state for rank %d; the run will not continue exactly.", self.path,
                               self.rank)
                return
            self._inexact(f"{self.path} has no RNG state for rank {self.rank} "
                          f"({RNG_DIR}/{RNG_FILE_PATTERN.format(rank=self.rank)}); the run will not continue exactly",
                          "Pass allow_inexact_resume=True to continue anyway.", InexactResumeError, allow)
            return
        problem = cuda_device_mismatch(len(self.rng_state.cuda), visible_cuda_devices())
        if problem is not None:
            self._inexact(f"{self.path}: {problem}", "Make the same CUDA devices visible (CUDA_VISIBLE_DEVICES) as "
                          "when it was saved, or pass allow_inexact_resume=True to continue anyway.",
                          InexactResumeError, allow)

    def restore_rng(self, *, allow_inexact_resume: bool | None = None) -> None:
        """Restore this rank's RNG state (python, numpy, torch CPU, CUDA). Call it last: restoring anything
        else may draw random numbers.

        Raises:
            InexactResumeError / ConfigDriftError: see :meth:`check_exact`.
        """
        self.check_exact(weights=False, rng=True, allow_inexact_resume=allow_inexact_resume)
        if self.rng_state is not None:
            restore_rng_state(self.rng_state, allow_device_mismatch=True)

    # ------------------------------------------------------------------ fill

    def load_into(
        self,
        *,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        scaler: Any = None,
        strict: bool = True,
        restore_rng: bool = False,
        allow_inexact_resume: bool | None = None,
    ) -> "OpenedCheckpoint":
        """Fill the given objects; every check runs before the first byte is written into any of them.

        Any layout into any model, plain or split by an engine (FSDP1/2, DTensor, ZeRO), at any world size: the model
        and optimizer are read by :func:`~.pieces._pieces.load_pieces_into` (a regular checkpoint's files are whole
        pieces; each rank reads the slices it holds).

        Args:
            model, optimizer, scheduler, scaler (*optional*): objects to fill (``None`` skips a part).
            strict (`bool`, *optional*, defaults to `True`): missing/unexpected model keys are errors.
            restore_rng (`bool`, *optional*, defaults to `False`): also restore this rank's RNG, last.
            allow_inexact_resume (`bool`, *optional*): overrides the value given to :func:`open_checkpoint`.

        Returns:
            `OpenedCheckpoint`: ``self``.

        Raises:
            IncompleteCheckpointError: a requested part was not saved.
            CheckpointMismatchError: an object does not fit (every offending key listed); nothing was changed.
            CorruptCheckpointError: inconsistent state, or a file that changed since the checkpoint was verified
                (nothing was changed: every file is checked against its verified identity before a byte is read),
                or a hash mismatch found while reading a file larger than the quick-verification limit (then the
                model's parameters, and optimizer state that existed before the call, may hold part of the new
                bytes; the optimizer's new state, scheduler, scaler and RNG are unchanged). ``verify="full"``
                checks every hash before anything is read into an object.
            ConfigDriftError / InexactResumeError: see :meth:`check_exact`.
        """
        # 1. Policy (world size and RNG), then scheduler and scaler state against the live objects' state_dict()
        #    keys and kinds: a refusal costs nothing.
        self.check_exact(weights=model is not None, rng=restore_rng, allow_inexact_resume=allow_inexact_resume)
        objects = [(obj, self._object_state(name, key, obj)) for name, obj, key in
                   (("scheduler", scheduler, STATE_KEY_SCHEDULER), ("scaler", scaler, STATE_KEY_SCALER))
                   if obj is not None]
        # 2. Model and optimizer: planned and checked, read (every byte checked), applied.
        if model is not None or optimizer is not None:
            load_pieces_into(self, model=model, optimizer=optimizer, strict=strict)
        # 3. Scheduler, scaler; the RNG last: applying anything else may draw random numbers.
        for obj, state in objects:
            obj.load_state_dict(state)
        if restore_rng and self.rng_state is not None:
            restore_rng_state(self.rng_state, allow_device_mismatch=True)  # the device count was checked in step 1
        logger.info("Loaded %s (step %s, saved by %d rank(s), loaded by %d)", self.path, self.step,
                    self.manifest.world_size, self.world_size)
        # hf-resumable check: the step counter continues from here (an engine's optimizer state is split, not digested)
        trace.on_load(self.step, None if engine_pieces(model, optimizer) else optimizer)
        return self

    def _object_state(self, name: str, key: str, obj: Any) -> Any:
        if key not in self._objects:
            raise IncompleteCheckpointError(f"{self.path}: no {name} state was saved; pass {name}=None to load.")
        state = self._objects[key]
        if callable(getattr(obj, "state_dict", None)):
            check_like_live(state, obj.state_dict(), source=str(self.path / TRAINING_STATE_FILE), what=name)
        elif not isinstance(state, Mapping):
            raise CheckpointMismatchError(f"{self.path}: the saved {name} state is not an object.")
        return state
