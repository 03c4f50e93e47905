"""The manifest: the last file written, listing every other file with its size and hashes. A directory is a
committed checkpoint if and only if it holds a manifest that parses, checks and lists ``training_state.json``
(docs/format.md#file-records-and-hashes).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..._version import __version__
from ...constants import FORMAT_NAME, FORMAT_VERSION, MANIFEST_FILE, MAX_JSON_SIZE, TRAINING_STATE_FILE
from ...errors import (
    CorruptCheckpointError,
    FormatVersionError,
    HfResumableError,
    IncompleteCheckpointError,
    UnsafeIndexError,
)
from ...format._jsonio import json_bytes, parse_json, require_field
from ...format._safefile import member_path, read_regular_file
from ...format.safetensors_io import FileRecord
from ...format.sharding import check_relative_name

__all__ = ["Manifest", "read_manifest", "committed_manifest"]

# Largest world size a manifest may claim (bounds per-rank loops over a crafted value).
MAX_WORLD_SIZE = 1 << 20


@functools.cache
def _installed_versions() -> dict[str, str]:
    """Versions of the libraries that shape the bytes of a checkpoint, looked up once per process (each lookup parses
    a package's metadata)."""
    from importlib.metadata import PackageNotFoundError, version

    versions = {"hf_resumable": __version__, "python": platform.python_version()}
    for package in ("torch", "transformers", "safetensors", "accelerate", "huggingface_hub", "datasets"):
        try:
            versions[package] = version(package)
        except PackageNotFoundError:
            continue
    return versions


@dataclass(frozen=True)
class Manifest:
    """Parsed ``manifest.json``.

    Args:
        files (`dict[str, FileRecord]`): relative path -> size and xxh3-128 (and sha256, in older manifests).
        step (`int`, *optional*): the global step the checkpoint was taken at.
        world_size (`int`): number of ranks that wrote it.
        metrics (`dict[str, float]`): metrics recorded at save time (keep-best retention).
        versions (`dict[str, str]`): library versions.
        created (`float`): UNIX time of the commit.
        format_version (`int`): layout version.
    """

    files: dict[str, FileRecord]
    step: int | None = None
    world_size: int = 1
    metrics: dict[str, float] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=lambda: dict(_installed_versions()))
    created: float = field(default_factory=time.time)
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}.")
        if MANIFEST_FILE in self.files:
            raise ValueError("The manifest cannot list itself.")
        if TRAINING_STATE_FILE not in self.files:  # every save writes it: a manifest without it lists no checkpoint
            raise ValueError(f"it lists {len(self.files)} file(s) and no {TRAINING_STATE_FILE}, which every "
                             "checkpoint holds: the manifest was emptied or forged; resume from another checkpoint")
        for name in self.files:
            check_relative_name(name, source=MANIFEST_FILE, suffix=None)

    def to_json(self) -> bytes:
        document = {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "step": self.step,
            "world_size": self.world_size,
            "created": self.created,
            "metrics": self.metrics,
            "versions": self.versions,
            "files": {k: v.to_json() for k, v in sorted(self.files.items())},
        }
        document["checksum"] = _checksum(document)
        return json_bytes(document)

    @classmethod
    def from_json(cls, raw: bytes, *, source: str) -> "Manifest":
        """Parse and validate a manifest: bounded JSON, our format, its checksum, and every field's type.

        Raises:
            CorruptCheckpointError / FormatVersionError / UnsafeIndexError: naming ``source`` and the field.
        """
        document = parse_json(raw, source=source)
        if not isinstance(document, dict) or document.get("format") != FORMAT_NAME:
            raise CorruptCheckpointError(f"{source}: not an hf_resumable manifest (format field is missing or wrong).")
        if document.pop("checksum", None) != _checksum(document):
            raise CorruptCheckpointError(f"{source}: manifest checksum mismatch (the manifest was modified or "
                                         "corrupted after the save).")
        version = document.get("format_version")
        if not _is_int(version) or version > FORMAT_VERSION or version < 1:
            raise FormatVersionError(
                f"{source}: checkpoint format version {version!r}; this hf_resumable ({__version__}) reads versions "
                f"1..{FORMAT_VERSION}. Upgrade hf_resumable to load it."
            )
        files = document.get("files")
        if not isinstance(files, dict):
            raise CorruptCheckpointError(f"{source}: 'files' must be a JSON object of file records.")
        step, world_size = document.get("step"), document.get("world_size", 1)
        created, metrics = document.get("created", 0.0), document.get("metrics") or {}
        versions = document.get("versions") or {}
        require_field(step is None or (_is_int(step) and step >= 0), source, "step", step, "null or an integer >= 0")
        require_field(_is_int(world_size) and 1 <= world_size <= MAX_WORLD_SIZE, source, "world_size", world_size,
                      f"an integer in 1..{MAX_WORLD_SIZE}")
        require_field(_is_number(created), source, "created", created, "a number")
        numbers = isinstance(metrics, dict) and all(isinstance(k, str) and _is_number(v) for k, v in metrics.items())
        require_field(numbers, source, "metrics", metrics, "an object of numbers")
        require_field(isinstance(versions, dict) and all(isinstance(v, str) for v in versions.values()), source,
                      "versions", versions, "an object of strings")
        records = {name: _record_from_json(record, source=source, name=name) for name, record in files.items()}
        try:
            return cls(files=records, step=step, world_size=world_size, metrics=dict(metrics),
                       versions=dict(versions), created=float(created), format_version=version)
        except UnsafeIndexError:
            raise
        except ValueError as err:
            raise CorruptCheckpointError(f"{source}: manifest is malformed ({err}).") from None


def _checksum(document: Mapping[str, Any]) -> str:
    """sha256 of the manifest's canonical JSON without its own checksum field."""
    canonical = json.dumps({k: v for k, v in document.items() if k != "checksum"}, sort_keys=True,
                           separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def read_manifest(directory: str | os.PathLike) -> Manifest:
    """Read and validate ``directory/manifest.json``.

    Raises:
        IncompleteCheckpointError: if there is no manifest (the save never committed).
        CorruptCheckpointError / FormatVersionError / UnsafeIndexError: if it is unreadable, not a regular
            file, foreign, too new, or lists paths outside the directory.
    """
    path = Path(directory) / MANIFEST_FILE
    try:
        raw = read_regular_file(member_path(directory, MANIFEST_FILE), limit=MAX_JSON_SIZE)
    except FileNotFoundError:
        raise IncompleteCheckpointError(
            f"{directory}: no {MANIFEST_FILE}; this directory is not a committed checkpoint (a save was interrupted "
            "or it was written by another tool). Use find_latest_checkpoint() to pick a valid one."
        ) from None
    except NotADirectoryError:
        raise CorruptCheckpointError(f"{directory}: is not a directory.") from None
    except PermissionError as err:
        raise CorruptCheckpointError(f"{path}: cannot be read ({err.strerror}).") from None
    return Manifest.from_json(raw, source=str(path))


def committed_manifest(directory: str | os.PathLike) -> Manifest | None:
    """The manifest of ``directory`` if it is a checkpoint hf_resumable committed (a valid manifest), else ``None``."""
    try:
        return read_manifest(directory)
    except (HfResumableError, OSError):
        return None


def _record_from_json(document: Any, *, source: str, name: str) -> FileRecord:
    return FileRecord.from_json(document, source=source, where=f"files[{name[:100]!r}]")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def records_to_json(records: Mapping[str, FileRecord]) -> dict[str, Any]:
    """JSON form of file records (for gathering across ranks)."""
    return {k: v.to_json() for k, v in records.items()}


def records_from_json(document: Mapping[str, Any]) -> dict[str, FileRecord]:
    """Inverse of :func:`records_to_json`."""
    return {k: _record_from_json(v, source="<records>", name=k) for k, v in document.items()}
