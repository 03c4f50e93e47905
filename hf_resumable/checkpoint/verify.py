"""Verify a checkpoint: quick (manifest, sizes, headers, training state, index consistency) or full (+ every hash).

A report records the identity of every file it checked and can keep the bytes of the small files it hashed
(``keep=``), so that ``open_checkpoint(verified=report)`` uses them and refuses any file changed since.
See docs/format.md#verification.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ..constants import (
    LAYOUT_FILE,
    MANIFEST_FILE,
    MAX_JSON_SIZE,
    MODEL_INDEX_FILE,
    OPTIMIZER_INDEX_FILE,
    SINGLE_MODEL_FILE,
    TRAINABLE_INDEX_FILE,
    TRAINING_STATE_FILE,
)
from ..errors import CorruptCheckpointError, HfResumableError, IncompleteCheckpointError
from ..format._jsonio import parse_json
from ..format._safefile import file_kind, member_path, open_regular, read_regular_file
from ..format.safetensors_io import (
    FileRecord,
    RecordChecker,
    SafetensorsHeader,
    header_from_bytes,
    read_header,
    record_of,
)
from ..format.sharding import parse_index
from .commit._durability import needs_every_byte
from .commit.manifest import Manifest, read_manifest
from .state._model_files import model_weights_file, single_file_index
from .state._validate import check_training_state

logger = logging.getLogger(__name__)

__all__ = ["VerifyReport", "FileIdentity", "verify_checkpoint", "QUICK_HASH_LIMIT", "KEEP_BUDGET"]

# Quick verification still hashes files up to this size (JSON, RNG, small shards): it costs little
# and catches flipped bytes in every file that is not a large tensor shard.
QUICK_HASH_LIMIT = 4 * 1024 * 1024
# Most bytes of verified small files one report keeps for the open that follows (``keep=``); files beyond it are
# read again by the open, and hash-checked there.
KEEP_BUDGET = 32 * 1024 * 1024
# Files verification itself reads again after hashing them (index, layout and training-state structure): always kept.
_REREAD = (MODEL_INDEX_FILE, TRAINABLE_INDEX_FILE, OPTIMIZER_INDEX_FILE, LAYOUT_FILE, TRAINING_STATE_FILE)
_HASH_CHUNK = 16 * 1024 * 1024


@dataclass(frozen=True)
class FileIdentity:
    """What ``fstat`` said about a file right after its bytes were read and hashed. A later ``stat`` that differs
    means it was replaced, written to or had its metadata changed (the ctime cannot be set from user space)."""

    device: int
    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, info: os.stat_result) -> "FileIdentity":
        return cls(info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)


@dataclass
class VerifyReport:
    """Result of :func:`verify_checkpoint`.

    Args:
        path (`str`): the checkpoint directory.
        full (`bool`): whether hashes were checked.
        problems (`list[tuple[str, str]]`): ``(file, reason)`` for every problem found.
        manifest (`Manifest`, *optional*): the parsed manifest, when it could be read.
        headers (`dict[str, SafetensorsHeader]`): the parsed header of every safetensors file.
        identities (`dict[str, FileIdentity]`): every file that was checked, and the manifest, as it was then.
        contents (`dict[str, bytes]`): the verified bytes of the small files kept for the open that follows.
    """

    path: str
    full: bool
    problems: list[tuple[str, str]] = field(default_factory=list)
    manifest: Manifest | None = None
    error_types: list[type[HfResumableError]] = field(default_factory=list)
    headers: dict[str, SafetensorsHeader] = field(default_factory=dict)
    identities: dict[str, FileIdentity] = field(default_factory=dict, repr=False)
    contents: dict[str, bytes] = field(default_factory=dict, repr=False)
    kept_bytes: int = field(default=0, repr=False)

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        if self.ok:
            return f"{self.path}: OK ({'full' if self.full else 'quick'} verification)"
        lines = [f"{self.path}: {len(self.problems)} problem(s)"] + [f"  {f}: {why}" for f, why in self.problems]
        return "\n".join(lines)

    def add(self, file: str, reason: str, error_type: type[HfResumableError] = CorruptCheckpointError) -> None:
        self.problems.append((file, reason))
        self.error_types.append(error_type)

    @contextlib.contextmanager
    def noting(self, file: str) -> Iterator[None]:
        """Add what the block raises about ``file`` as its problem: a typed error, or a file that cannot be read
        (permissions, I/O error), which makes the checkpoint unusable too."""
        try:
            yield
        except HfResumableError as err:
            self.add(file, str(err), type(err))
        except OSError as err:
            self.add(file, f"cannot be read ({type(err).__name__}: {err.strerror or err})")

    def raise_if_bad(self) -> None:
        """Raise the typed error that fits the first problem."""
        if self.ok:
            return
        error = self.error_types[0] if self.error_types else CorruptCheckpointError
        raise error(self.summary() + "\nUse find_latest_checkpoint() to resume from the newest valid checkpoint.")

    def check_unchanged(self, relpath: str, now: os.stat_result | None = None) -> None:
        """Refuse ``relpath`` if it is no longer the file this verification checked (nothing to check for a file it did
        not). ``now``: the ``fstat`` of a descriptor just opened on it (default: ``stat`` its path).

        Raises:
            CorruptCheckpointError: it was replaced, written to or had its metadata changed since.
            IncompleteCheckpointError: it is gone.
        """
        identity = self.identities.get(relpath)
        if identity is None:
            return
        path = Path(self.path) / relpath
        if now is None:
            try:
                now = os.stat(member_path(self.path, relpath))
            except FileNotFoundError:
                raise IncompleteCheckpointError(
                    f"{path}: was removed after the checkpoint was verified. Another process changed the checkpoint; "
                    "find it again (find_latest_checkpoint) and load that.") from None
        if FileIdentity.of(now) != identity:
            raise CorruptCheckpointError(
                f"{path}: changed after the checkpoint was verified (size, times or inode differ: another process "
                "wrote to it or replaced it); nothing was loaded from it. Find the checkpoint again "
                "(find_latest_checkpoint) and load that.")

    def verified_bytes(self, relpath: str) -> bytes | None:
        """The bytes this verification hashed and kept for ``relpath`` (``None``: not kept), once
        :meth:`check_unchanged` passes."""
        data = self.contents.get(relpath)
        if data is not None:
            self.check_unchanged(relpath)
        return data


def verify_checkpoint(directory: str | os.PathLike, *, full: bool = True, raise_on_error: bool = False,
                      keep: Callable[[str], bool] | None = None) -> VerifyReport:
    """Check that ``directory`` is a complete, uncorrupted checkpoint.

    Quick mode checks the manifest (and its own checksum), every listed file's presence and size, every safetensors
    header, ``training_state.json``'s structure and every index's consistency, and hashes the files up to
    ``QUICK_HASH_LIMIT`` (4 MiB). Full mode hashes every byte against every hash its record holds. A checkpoint whose
    deferred fsyncs never finished, written on another boot or machine, is always verified fully
    (docs/format.md#verification).

    Args:
        directory (`str` or `os.PathLike`): the checkpoint directory.
        full (`bool`, *optional*, defaults to `True`): also verify hashes.
        raise_on_error (`bool`, *optional*, defaults to `False`): raise instead of returning a bad report.
        keep (`Callable[[str], bool]`, *optional*): which small files' verified bytes to keep in
            ``report.contents`` (by relative path, at most ``KEEP_BUDGET`` bytes in all), for
            ``open_checkpoint(verified=report)``.

    Returns:
        `VerifyReport`: ``report.ok`` and ``report.problems`` name each bad file and why.

    Raises:
        IncompleteCheckpointError / CorruptCheckpointError: only with ``raise_on_error=True``.

    Example:

    ```python
    >>> report = verify_checkpoint("out/checkpoint-100", full=False)  # doctest: +SKIP
    >>> report.ok  # doctest: +SKIP
    True
    ```
    """
    directory = Path(directory)
    if not full and needs_every_byte(directory):
        logger.info("%s was committed before its files were fsynced, on another boot or machine than this one: a "
                    "crash may have torn it, so every byte is verified.", directory)
        full = True
    report = VerifyReport(path=str(directory), full=full)
    with report.noting(MANIFEST_FILE):
        report.manifest = read_manifest(directory)
        report.identities[MANIFEST_FILE] = FileIdentity.of(os.stat(member_path(directory, MANIFEST_FILE)))
    if not report.problems:
        for relpath, record in report.manifest.files.items():
            with report.noting(relpath):
                _check_file(directory, relpath, record, report, keep)
    if not report.problems:
        with report.noting(TRAINING_STATE_FILE):  # a matching hash proves only that the manifest was resealed with it
            check_training_state(_read_json(directory, TRAINING_STATE_FILE, report),
                                 source=str(directory / TRAINING_STATE_FILE))
        _check_indexes(directory, report)
        _check_layout(directory, report)
    if raise_on_error:
        report.raise_if_bad()
    if not report.ok:
        logger.debug("%s", report.summary())
    return report


def _check_file(directory: Path, relpath: str, record: FileRecord, report: VerifyReport,
                keep: Callable[[str], bool] | None) -> None:
    path = member_path(directory, relpath)
    try:
        info = os.stat(path)
    except FileNotFoundError:
        report.add(relpath, "missing", IncompleteCheckpointError)
        return
    if not stat.S_ISREG(info.st_mode):
        report.add(relpath, f"is {file_kind(info.st_mode)}, not a regular file")
        return
    if info.st_size != record.size:
        report.add(relpath, f"size is {info.st_size} bytes, the manifest says {record.size} (truncated?)")
        return
    data = None
    if record.size <= QUICK_HASH_LIMIT:  # read once: header and hash from the same bytes
        data, identity = _read_whole(path)
        if relpath.endswith(".safetensors"):
            report.headers[relpath] = header_from_bytes(path, data)
        actual = record_of(data, **record.hashes(every_hash=report.full))
    else:
        if relpath.endswith(".safetensors"):
            report.headers[relpath] = read_header(path)
        if not report.full:  # hash-checked while a load reads it; refused before that if it is another file by then
            report.identities[relpath] = FileIdentity.of(info)
            return
        actual, identity = _hash_file(path, record)
    problem = record.mismatch(actual)
    if problem is not None:
        report.add(relpath, f"{problem} (the file was modified or corrupted after the save)")
        return
    report.identities[relpath] = identity
    if data is not None and (relpath in _REREAD or (keep is not None and keep(relpath))) and (
            report.kept_bytes + len(data) <= KEEP_BUDGET):
        report.contents[relpath] = data
        report.kept_bytes += len(data)


def _read_whole(path: Path) -> tuple[bytes, FileIdentity]:
    """A small file's bytes and its identity right after they were read (from the same descriptor)."""
    with open_regular(path, buffering=0) as f:
        data = f.read(QUICK_HASH_LIMIT + 1)
        return data, FileIdentity.of(os.fstat(f.fileno()))


def _hash_file(path: Path, expected: FileRecord) -> tuple[FileRecord, FileIdentity]:
    """The record of a large file with every hash ``expected`` holds, and its identity right after it was read."""
    checker = RecordChecker(expected, every_hash=True, threaded=False)  # one buffer, reused: hashed inline
    view = memoryview(bytearray(_HASH_CHUNK))
    with open_regular(path, buffering=0) as f:
        while n := f.readinto(view):
            checker.feed(view[:n])
        identity = FileIdentity.of(os.fstat(f.fileno()))
    return checker.record(), identity


def _read_json(directory: Path, relpath: str, report: VerifyReport) -> object:
    """A JSON file of the checkpoint: the bytes just verified, or read safely (bounded) when not kept."""
    raw = report.contents.get(relpath)
    if raw is None:
        raw = read_regular_file(member_path(directory, relpath), limit=MAX_JSON_SIZE)
    return parse_json(raw, source=str(directory / relpath))


def _check_indexes(directory: Path, report: VerifyReport) -> None:
    files = report.manifest.files
    if model_weights_file(files) == SINGLE_MODEL_FILE and SINGLE_MODEL_FILE in report.headers:
        try:  # a model stored as one model.safetensors: its header's tied record is its index's metadata
            single_file_index(report.headers[SINGLE_MODEL_FILE], source=SINGLE_MODEL_FILE)
        except HfResumableError as err:
            report.add(SINGLE_MODEL_FILE, f"invalid header metadata: {err}", type(err))
    for index_name in (MODEL_INDEX_FILE, TRAINABLE_INDEX_FILE, OPTIMIZER_INDEX_FILE):
        if index_name not in report.manifest.files:
            continue
        try:
            index = parse_index(_read_json(directory, index_name, report), source=index_name)
        except HfResumableError as err:
            report.add(index_name, f"invalid index: {err}", type(err))
            continue
        except (ValueError, OSError) as err:
            report.add(index_name, f"invalid index: {err}")
            continue
        for filename, names in index.group_by_file().items():
            header = report.headers.get(filename)
            if header is None:
                report.add(index_name, f"refers to {filename!r}, which the manifest does not list")
                continue
            absent = sorted(set(names) - set(header.tensors))
            if absent:
                report.add(filename, f"lacks tensors the index places there: {absent[:5]}")
            if extra := sorted(set(header.tensors) - set(names)):  # a load would not know which tensor they are
                report.add(filename, f"holds tensors its index {index_name} does not place there: {extra[:5]}")


def _check_layout(directory: Path, report: VerifyReport) -> None:
    """Sharded (per-rank) checkpoints: every piece the layout describes is stored as described."""
    from .pieces._piece_reader import Section, check_pieces_stored, parse_layout

    if LAYOUT_FILE not in report.manifest.files:
        return
    try:
        layout = parse_layout(_read_json(directory, LAYOUT_FILE, report), source=LAYOUT_FILE)
        for key in ("model", "optimizer"):
            if layout.get(key) is not None:
                check_pieces_stored(Section.from_json(layout[key], source=LAYOUT_FILE), report.headers,
                                    source=LAYOUT_FILE)
    except HfResumableError as err:
        report.add(LAYOUT_FILE, str(err), type(err))
    except (ValueError, TypeError, KeyError, AttributeError, OSError) as err:
        report.add(LAYOUT_FILE, f"invalid layout: {type(err).__name__}: {err}")
