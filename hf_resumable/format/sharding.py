"""Pure planning of sharded safetensors files, and parsing of their index files.

Nothing here touches a file or a tensor: sizes come in as integers, plans and indexes come out as
dataclasses and dicts. The IO lives in :mod:`hf_resumable.format.safetensors_io` and
:mod:`hf_resumable.checkpoint`.

Example:

```python
>>> from hf_resumable.format.sharding import plan_shards
>>> plan = plan_shards({"a": 600, "b": 600, "c": 100}, max_shard_size=1000)
>>> plan.filename_to_names
{'model-00001-of-00002.safetensors': ('a',), 'model-00002-of-00002.safetensors': ('b', 'c')}
```
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..constants import MODEL_FILE_PATTERN
from ..errors import UnsafeIndexError

__all__ = ["ShardPlan", "ShardIndex", "parse_size", "plan_shards", "build_index", "parse_index"]

# Longest relative file name accepted in an index or manifest (each component is also limited to 255 bytes).
MAX_NAME_LENGTH = 1024
# Most shard files one index may name (the largest public models use a few hundred): every shard costs a
# request or an open, so a crafted index must not turn into ten thousand of them.
MAX_INDEX_SHARDS = 4096
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(size: int | str) -> int:
    """Turn ``"5GB"`` (decimal, like huggingface_hub), ``"2GiB"`` (binary) or an int into bytes.

    Raises:
        ValueError: if the size cannot be parsed or is not positive.

    Example:

    ```python
    >>> parse_size("5MB"), parse_size("1KiB"), parse_size(7)
    (5000000, 1024, 7)
    ```
    """
    if isinstance(size, bool):
        raise ValueError(f"max_shard_size must be an int or a string like '2GB', got {size!r}")
    if isinstance(size, int):
        value = size
    else:
        match = _SIZE_RE.match(str(size))
        unit = match.group(2).upper() if match else None
        if unit is not None and unit.endswith("I"):
            unit += "B"
        if match is None or unit not in _UNITS:
            raise ValueError(f"Cannot parse size {size!r}: use an int of bytes or a string like '500MB' or '2GiB'.")
        value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"Size must be positive, got {size!r}.")
    return value


@dataclass(frozen=True)
class ShardPlan:
    """Which tensor goes into which file."""

    filename_to_names: dict[str, tuple[str, ...]]  # file name -> tensor names, in write order
    name_to_filename: dict[str, str]  # tensor name -> file name
    total_size: int  # sum of the planned tensor sizes in bytes

    def __post_init__(self) -> None:
        for filename, names in self.filename_to_names.items():
            for name in names:
                if self.name_to_filename.get(name) != filename:
                    raise ValueError(f"ShardPlan is inconsistent for tensor {name!r} in {filename!r}.")

    @property
    def filenames(self) -> list[str]:
        """The shard file names in order."""
        return list(self.filename_to_names)


def plan_shards(
    sizes: Mapping[str, int],
    *,
    max_shard_size: int | str,
    filename_pattern: str = MODEL_FILE_PATTERN,
    single_filename: str | None = None,
) -> ShardPlan:
    """Split tensors into shards of at most ``max_shard_size`` bytes, greedily, in key order.

    A tensor bigger than ``max_shard_size`` gets a shard of its own. Shards are named
    ``<prefix>-0000k-of-0000N<ext>`` (even a single one), unless ``single_filename`` is given and
    everything fits in one shard: that one file is then named ``single_filename`` (what
    ``save_pretrained`` writes, ``model.safetensors``).

    Args:
        sizes (`Mapping[str, int]`): tensor name -> size in bytes, in the order to write them.
        max_shard_size (`int` or `str`): the limit, e.g. ``"2GB"``.
        filename_pattern (`str`, *optional*, defaults to `"model{suffix}.safetensors"`):
            must contain ``{suffix}``.
        single_filename (`str`, *optional*): the name of the only file when there is one shard.

    Returns:
        `ShardPlan`

    Raises:
        ValueError: if ``filename_pattern`` lacks ``{suffix}`` or a size is negative.
    """
    if "{suffix}" not in filename_pattern:
        raise ValueError(f"filename_pattern must contain '{{suffix}}', got {filename_pattern!r}.")
    limit = parse_size(max_shard_size)
    groups: list[list[str]] = []
    current: list[str] = []
    current_size = 0
    total = 0
    for name, size in sizes.items():
        if size < 0:
            raise ValueError(f"Tensor {name!r} has a negative size {size}.")
        total += size
        if current and current_size + size > limit:
            groups.append(current)
            current, current_size = [], 0
        current.append(name)
        current_size += size
    if current or not groups:
        groups.append(current)
    count = len(groups)
    filename_to_names = {
        filename_pattern.format(suffix=f"-{i + 1:05d}-of-{count:05d}"): tuple(group) for i, group in enumerate(groups)
    }
    if count == 1 and single_filename is not None:
        filename_to_names = {single_filename: tuple(groups[0])}
    name_to_filename = {name: filename for filename, names in filename_to_names.items() for name in names}
    return ShardPlan(filename_to_names=filename_to_names, name_to_filename=name_to_filename, total_size=total)


def build_index(plan: ShardPlan, *, metadata: Mapping[str, object] | None = None) -> dict:
    """The ``*.safetensors.index.json`` document for ``plan`` (HF layout, extra metadata allowed).

    Example:

    ```python
    >>> build_index(plan_shards({"w": 4}, max_shard_size=10))
    {'metadata': {'total_size': 4}, 'weight_map': {'w': 'model-00001-of-00001.safetensors'}}
    ```
    """
    meta: dict[str, object] = {"total_size": plan.total_size}
    if metadata:
        meta.update(metadata)
    return {"metadata": meta, "weight_map": dict(sorted(plan.name_to_filename.items()))}


@dataclass(frozen=True)
class ShardIndex:
    """A validated index: tensor name -> shard file (relative, no traversal)."""

    weight_map: dict[str, str]  # tensor name -> shard file name
    metadata: dict = field(default_factory=dict)  # the index's metadata (unknown keys preserved)
    source: str = "<index>"  # where the index came from, for error messages

    @property
    def filenames(self) -> list[str]:
        """Shard files in first-appearance order."""
        return list(dict.fromkeys(self.weight_map.values()))

    def names_in(self, filename: str) -> list[str]:
        """Tensor names stored in ``filename``."""
        return [name for name, file in self.weight_map.items() if file == filename]

    def group_by_file(self, names: list[str] | None = None) -> dict[str, list[str]]:
        """Group ``names`` (default: all) by the shard that holds them, in shard order."""
        wanted = self.weight_map if names is None else {n: self.weight_map[n] for n in names}
        grouped: dict[str, list[str]] = {}
        for name, file in wanted.items():
            grouped.setdefault(file, []).append(name)
        order = {f: i for i, f in enumerate(self.filenames)}
        return dict(sorted(grouped.items(), key=lambda item: order[item[0]]))


def check_relative_name(name: str, *, source: str, suffix: str | None = ".safetensors") -> str:
    """Reject absolute paths, ``..`` components, backslashes, control characters, oversized names and
    (optionally) a wrong extension.

    Raises:
        UnsafeIndexError: naming ``source`` and the offending entry.
    """
    if not isinstance(name, str) or not name:
        raise UnsafeIndexError(f"{source}: file name {name!r:.100} is not a non-empty string.")
    too_long = any(len(part.encode("utf-8", "surrogatepass")) > 255 for part in name.split("/"))
    if len(name) > MAX_NAME_LENGTH or too_long:
        raise UnsafeIndexError(f"{source}: file name {name[:60]!r}... is longer than the filesystem allows "
                               f"({len(name)} characters); the index is corrupt or crafted.")
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        raise UnsafeIndexError(f"{source}: file name {name!r:.100} contains a control character (e.g. NUL); "
                               "the index is corrupt or crafted.")
    normalized = posixpath.normpath(name)
    if (
        name.startswith(("/", "\\"))
        or "\\" in name
        or re.match(r"^[A-Za-z]:", name)
        or normalized.startswith("..")
        or ".." in name.split("/")
        or normalized != name
    ):
        raise UnsafeIndexError(
            f"{source}: refusing file name {name!r}: it points outside the checkpoint directory. "
            "The index may be malicious or corrupt; re-create it from a trusted save."
        )
    if suffix is not None and not name.endswith(suffix):
        raise UnsafeIndexError(f"{source}: file name {name!r} does not end with {suffix!r}.")
    return name


def parse_index(document: object, *, source: str = "<index>") -> ShardIndex:
    """Validate a parsed ``*.safetensors.index.json`` document.

    Raises:
        UnsafeIndexError: if the structure is wrong, a shard name escapes the directory or does not
            end with ``.safetensors``.
    """
    if not isinstance(document, dict) or not isinstance(document.get("weight_map"), dict):
        raise UnsafeIndexError(f"{source}: not a safetensors index (expected a JSON object with a 'weight_map').")
    metadata = document.get("metadata", {})
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict):
        raise UnsafeIndexError(f"{source}: 'metadata' must be a JSON object.")
    shards = set(document["weight_map"].values()) if all(
        isinstance(f, str) for f in document["weight_map"].values()) else set()
    if len(shards) > MAX_INDEX_SHARDS:
        raise UnsafeIndexError(f"{source}: the index names {len(shards)} shard files, more than the "
                               f"{MAX_INDEX_SHARDS} hf_resumable accepts; it is corrupt or crafted.")
    weight_map: dict[str, str] = {}
    for name, filename in document["weight_map"].items():
        if not isinstance(name, str):
            raise UnsafeIndexError(f"{source}: tensor name {name!r} is not a string.")
        weight_map[name] = check_relative_name(filename, source=source)
    return ShardIndex(weight_map=weight_map, metadata=metadata, source=source)
