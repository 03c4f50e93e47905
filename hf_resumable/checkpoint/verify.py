"""Verify a checkpoint: quick (manifest, sizes, headers, index consistency) or full (+ sha256)."""

from __future__ import annotations

import logging
import os
import stat
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
)
from ..errors import CorruptCheckpointError, HfResumableError, IncompleteCheckpointError
from ..format._jsonio import parse_json
from ..format._safefile import file_kind, member_path, read_regular_file
from ..format.safetensors_io import SafetensorsHeader, hash_file, read_header
from ..format.sharding import parse_index
from ._model_files import model_weights_file, single_file_index
from .manifest import Manifest, read_manifest

logger = logging.getLogger(__name__)

__all__ = ["VerifyReport", "verify_checkpoint", "QUICK_HASH_LIMIT"]

# Quick verification still hashes files up to this size (JSON, RNG, small shards): it costs little
# and catches flipped bytes in every file that is not a large tensor shard.
QUICK_HASH_LIMIT = 4 * 1024 * 1024


@dataclass
class VerifyReport:
    """Result of :func:`verify_checkpoint`.

    Args:
        path (`str`): the checkpoint directory.
        full (`bool`): whether hashes were checked.
        problems (`list[tuple[str, str]]`): ``(file, reason)`` for every problem found.
        manifest (`Manifest`, *optional*): the parsed manifest, when it could be read.
    """

    path: str
    full: bool
    problems: list[tuple[str, str]] = field(default_factory=list)
    manifest: Manifest | None = None
    error_types: list[type[HfResumableError]] = field(default_factory=list)
    headers: dict[str, SafetensorsHeader] = field(default_factory=dict)

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

    def raise_if_bad(self) -> None:
        """Raise the typed error that fits the first problem."""
        if self.ok:
            return
        error = self.error_types[0] if self.error_types else CorruptCheckpointError
        raise error(self.summary() + "\nUse find_latest_checkpoint() to resume from the newest valid checkpoint.")


def verify_checkpoint(directory: str | os.PathLike, *, full: bool = True,
                      raise_on_error: bool = False) -> VerifyReport:
    """Check that ``directory`` is a complete, uncorrupted checkpoint.

    Quick mode reads the manifest (and checks its own checksum), checks every listed file exists with
    the listed size, parses every safetensors header (catching truncation and bogus offsets), hashes
    every file up to ``QUICK_HASH_LIMIT`` (4 MiB) and checks that each index refers only to listed
    shards holding the tensors it names (and that a single ``model.safetensors``'s tied record parses).
    Full mode recomputes every sha256.

    Args:
        directory (`str` or `os.PathLike`): the checkpoint directory.
        full (`bool`, *optional*, defaults to `True`): also verify hashes.
        raise_on_error (`bool`, *optional*, defaults to `False`): raise instead of returning a bad report.

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
    report = VerifyReport(path=str(directory), full=full)
    try:
        report.manifest = read_manifest(directory)
    except HfResumableError as err:
        report.add(MANIFEST_FILE, str(err), type(err))
    except OSError as err:
        report.add(MANIFEST_FILE, f"cannot be read ({type(err).__name__}: {err})")
    else:
        _check_files(directory, report)
        if not report.problems:
            _check_indexes(directory, report)
            _check_layout(directory, report)
    if raise_on_error:
        report.raise_if_bad()
    if not report.ok:
        logger.debug("%s", report.summary())
    return report


def _check_files(directory: Path, report: VerifyReport) -> None:
    for relpath, record in report.manifest.files.items():
        try:
            _check_file(directory, relpath, record, report)
        except HfResumableError as err:
            report.add(relpath, str(err), type(err))
        except OSError as err:  # unreadable (permissions, I/O error): this checkpoint cannot be used
            report.add(relpath, f"cannot be read ({type(err).__name__}: {err.strerror or err})")


def _check_file(directory: Path, relpath: str, record, report: VerifyReport) -> None:
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
    if relpath.endswith(".safetensors"):
        report.headers[relpath] = read_header(path)
    if report.full or record.size <= QUICK_HASH_LIMIT:
        problem = record.mismatch(hash_file(path))
        if problem is not None:
            report.add(relpath, f"{problem} (the file was modified or corrupted after the save)")


def _read_json(directory: Path, relpath: str) -> object:
    """A JSON file of the checkpoint, read safely (regular file, inside the directory, bounded)."""
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
            index = parse_index(_read_json(directory, index_name), source=index_name)
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


def _check_layout(directory: Path, report: VerifyReport) -> None:
    """Sharded (per-rank) checkpoints: every piece the layout describes is stored as described."""
    from ._sharded_load import Section, check_pieces_stored, parse_layout

    if LAYOUT_FILE not in report.manifest.files:
        return
    try:
        layout = parse_layout(_read_json(directory, LAYOUT_FILE), source=LAYOUT_FILE)
        for key in ("model", "optimizer"):
            if layout.get(key) is not None:
                check_pieces_stored(Section.from_json(layout[key], source=LAYOUT_FILE), report.headers,
                                    source=LAYOUT_FILE)
    except HfResumableError as err:
        report.add(LAYOUT_FILE, str(err), type(err))
    except (ValueError, TypeError, KeyError, AttributeError, OSError) as err:
        report.add(LAYOUT_FILE, f"invalid layout: {type(err).__name__}: {err}")
