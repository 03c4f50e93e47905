"""The manifest: the last file written, listing every other file with its size, sha256 and xxh3-128.

A directory is a committed checkpoint if and only if it holds a manifest that parses, has our
format name and a version we can read, and whose files are all present with the listed sizes.
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import __version__
from ..constants import FORMAT_NAME, FORMAT_VERSION, MANIFEST_FILE, MAX_JSON_SIZE
from ..errors import CorruptCheckpointError, FormatVersionError, IncompleteCheckpointError, UnsafeIndexError
from ..safetensors_io import FileRecord
from ..sharding import check_relative_name

__all__ = ["Manifest", "read_manifest", "library_versions"]


def library_versions() -> dict[str, str]:
    """Versions of the libraries that shape the bytes of a checkpoint."""
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
        files (`dict[str, FileRecord]`): relative path -> size, sha256 and xxh3-128.
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
    versions: dict[str, str] = field(default_factory=library_versions)
    created: float = field(default_factory=time.time)
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}.")
        if MANIFEST_FILE in self.files:
            raise ValueError("The manifest cannot list itself.")
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
            "files": {k: _record_to_json(v) for k, v in sorted(self.files.items())},
        }
        document["checksum"] = _checksum(document)
        return (json.dumps(document, indent=2, sort_keys=True) + "\n").encode()

    @classmethod
    def from_json(cls, raw: bytes, *, source: str) -> "Manifest":
        try:
            document = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise CorruptCheckpointError(f"{source}: manifest is not valid JSON ({err}).") from None
        if not isinstance(document, dict) or document.get("format") != FORMAT_NAME:
            raise CorruptCheckpointError(f"{source}: not an hf_resumable manifest (format field is missing or wrong).")
        if document.pop("checksum", None) != _checksum(document):
            raise CorruptCheckpointError(f"{source}: manifest checksum mismatch (the manifest was modified or "
                                         "corrupted after the save).")
        version = document.get("format_version")
        if not isinstance(version, int) or version > FORMAT_VERSION or version < 1:
            raise FormatVersionError(
                f"{source}: checkpoint format version {version!r}; this hf_resumable ({__version__}) reads versions "
                f"1..{FORMAT_VERSION}. Upgrade hf_resumable to load it."
            )
        try:
            files = {str(k): _record_from_json(v) for k, v in document["files"].items()}
            return cls(files=files, step=document.get("step"), world_size=int(document.get("world_size", 1)),
                       metrics=dict(document.get("metrics") or {}), versions=dict(document.get("versions") or {}),
                       created=float(document.get("created", 0.0)), format_version=version)
        except UnsafeIndexError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise CorruptCheckpointError(f"{source}: manifest is malformed ({err.__class__.__name__}: {err}).") from None


def _checksum(document: Mapping[str, Any]) -> str:
    """sha256 of the manifest's canonical JSON without its own checksum field."""
    import hashlib

    canonical = json.dumps({k: v for k, v in document.items() if k != "checksum"}, sort_keys=True,
                           separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def read_manifest(directory: str | os.PathLike) -> Manifest:
    """Read and validate ``directory/manifest.json``.

    Raises:
        IncompleteCheckpointError: if there is no manifest (the save never committed).
        CorruptCheckpointError / FormatVersionError / UnsafeIndexError: if it is unreadable, foreign,
            too new, or lists paths outside the directory.
    """
    path = Path(directory) / MANIFEST_FILE
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise IncompleteCheckpointError(
            f"{directory}: no {MANIFEST_FILE}; this directory is not a committed checkpoint (a save was interrupted "
            "or it was written by another tool). Use find_latest_checkpoint() to pick a valid one."
        ) from None
    if size > MAX_JSON_SIZE:
        raise CorruptCheckpointError(f"{path}: manifest of {size} bytes exceeds the {MAX_JSON_SIZE}-byte limit.")
    return Manifest.from_json(path.read_bytes(), source=str(path))


def _record_to_json(record: FileRecord) -> dict[str, Any]:
    document: dict[str, Any] = {"size": record.size, "sha256": record.sha256}
    if record.xxh3_128 is not None:
        document["xxh3_128"] = record.xxh3_128
    return document


def _record_from_json(document: Mapping[str, Any]) -> FileRecord:
    fast = document.get("xxh3_128")
    return FileRecord(int(document["size"]), str(document["sha256"]), None if fast is None else str(fast))


def records_to_json(records: Mapping[str, FileRecord]) -> dict[str, Any]:
    """JSON form of file records (for gathering across ranks)."""
    return {k: _record_to_json(v) for k, v in records.items()}


def records_from_json(document: Mapping[str, Any]) -> dict[str, FileRecord]:
    """Inverse of :func:`records_to_json`."""
    return {k: _record_from_json(v) for k, v in document.items()}
