"""LazyStateDict: names, shapes and dtypes from the safetensors headers; a tensor is read when accessed."""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ..checkpoint.pieces import base_not_stored
from ..constants import MODEL_INDEX_FILE, SINGLE_MODEL_FILE, TIED_KEY
from ..errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    HubFormatError,
    IncompleteCheckpointError,
)
from ..format._jsonio import parse_json
from ..format.safetensors_io import STR_TO_DTYPE, SafetensorsHeader, read_header
from ..format.sharding import ShardIndex
from ..hub import HubSnapshot, read_index_file

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TensorMeta:
    """Name, dtype and shape of a stored tensor, known from its file's header."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    filename: str


# --------------------------------------------------------------------------------------------------- LazyStateDict
class LazyStateDict(Mapping[str, torch.Tensor]):
    """A read-only state dict over sharded safetensors files; tensors are read only when accessed.

    Build it with :meth:`from_pretrained`. Keys, shapes and dtypes are known without reading tensor data. Accessing
    a tensor opens its shard with ``safetensors.safe_open`` (mmap) and, for a Hub repo, downloads that shard first
    (once, verified against the index's recorded hash).

    Args:
        metas (`dict[str, TensorMeta]`): every tensor, from the headers.
        fetch (`Callable[[str], Path]`): shard file name -> local path (may download).
        source (`str`): where the weights come from, for messages.
        aliases (`dict[str, str]`, *optional*): ``{dropped_name: kept_name}`` of shared tensors stored once.
        max_open_shards (`int`, *optional*, defaults to `2`): open ``safe_open`` handles kept.

    Example:

    ```python
    >>> weights = LazyStateDict.from_pretrained("me/tiny-gpt2")  # doctest: +SKIP
    >>> weights.meta("transformer.h.0.attn.c_attn.weight").shape  # doctest: +SKIP
    (32, 96)
    >>> weights["transformer.h.0.attn.c_attn.weight"].sum()  # downloads only the shard holding it  # doctest: +SKIP
    ```
    """

    def __init__(self, metas: dict[str, TensorMeta], fetch: Callable[[str], Path], *, source: str,
                 aliases: dict[str, str] | None = None, max_open_shards: int = 2) -> None:
        if max_open_shards < 1:
            raise ValueError(f"max_open_shards must be >= 1, got {max_open_shards}.")
        self._metas = metas
        self._fetch = fetch
        self._paths: dict[str, Path] = {}
        self._fetch_lock = threading.Lock()  # the read-ahead thread and the caller may ask for a shard at once
        self._handles: OrderedDict[str, Any] = OrderedDict()
        self.source = source
        self.aliases = dict(aliases or {})
        self.max_open_shards = max_open_shards

    @classmethod
    def from_pretrained(cls, path_or_repo_id: str | os.PathLike, *, revision: str | None = None,
                        token: str | None = None) -> LazyStateDict:
        """Open a local directory / file, or a Hub repo (only the index and the headers are fetched).

        Raises:
            CheckpointNotFoundError: if there is no index and no ``model.safetensors``, or a local-looking path
                does not exist.
            BaseNotStoredError: if the directory is a checkpoint that holds only its trainable part (its frozen
                base is referenced); export a full model first (``hf-resumable export``).
            UnsafeIndexError: if the index names files outside the directory.
            IncompleteCheckpointError: if the index names a shard or tensor that does not exist.
        """
        path = Path(path_or_repo_id)
        if path.exists():
            return _open_local(path)
        if path.is_absolute() or str(path_or_repo_id).startswith(".") or str(path_or_repo_id).count("/") != 1:
            raise CheckpointNotFoundError(f"{path_or_repo_id}: no such local path, and not a 'namespace/name' Hub "
                                          "repo id either. Check the path.")
        return _open_repo(str(path_or_repo_id), revision=revision, token=token)

    # Mapping protocol ----------------------------------------------------------------------------------------------
    def __getitem__(self, name: str) -> torch.Tensor:
        meta = self._metas.get(name)
        if meta is None:
            raise KeyError(f"{name!r} is not stored in {self.source}")
        return self._handle(meta.filename).get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._metas)

    def __len__(self) -> int:
        return len(self._metas)

    def __contains__(self, name: object) -> bool:
        return name in self._metas

    def __repr__(self) -> str:
        return f"LazyStateDict({self.source!r}, {len(self)} tensors in {len(self.filenames)} files)"

    # Metadata ------------------------------------------------------------------------------------------------------
    def meta(self, name: str) -> TensorMeta:
        """Dtype, shape and file of ``name`` (no data read)."""
        return self._metas[name]

    @property
    def filenames(self) -> list[str]:
        """Shard files in first-appearance order."""
        return list(dict.fromkeys(m.filename for m in self._metas.values()))

    def group_by_file(self, names: list[str]) -> dict[str, list[str]]:
        """Group ``names`` by the shard that holds them, in shard order."""
        order = {f: i for i, f in enumerate(self.filenames)}
        grouped: dict[str, list[str]] = {}
        for name in names:
            grouped.setdefault(self._metas[name].filename, []).append(name)
        return dict(sorted(grouped.items(), key=lambda item: order[item[0]]))

    # Files ---------------------------------------------------------------------------------------------------------
    def shard_path(self, filename: str) -> Path:
        """Local path of ``filename``, downloading it first for a Hub repo (once, also when two threads ask)."""
        with self._fetch_lock:
            if filename not in self._paths:
                self._paths[filename] = self._fetch(filename)
            return self._paths[filename]

    def _handle(self, filename: str) -> Any:
        if filename in self._handles:
            self._handles.move_to_end(filename)
            return self._handles[filename]
        handle = safe_open(str(self.shard_path(filename)), framework="pt", device="cpu")
        self._handles[filename] = handle
        while len(self._handles) > self.max_open_shards:
            self._handles.popitem(last=False)
        return handle

    def release(self, filename: str | None = None) -> None:
        """Close the ``safe_open`` handle of ``filename`` (default: all), dropping its mmap."""
        for name in [filename] if filename is not None else list(self._handles):
            self._handles.pop(name, None)


def _metas(header: SafetensorsHeader, filename: str) -> dict[str, TensorMeta]:
    return {n: TensorMeta(n, info.torch_dtype, info.shape, filename) for n, info in header.tensors.items()}


def _recorded_aliases(entries: Mapping[str, Any], stored: Collection[str]) -> dict[str, str]:
    """The ``{dropped: kept}`` entries of a record that name an unstored alias of a stored tensor (others are
    ignored: lazy loading reads weights of any origin, whose metadata may hold anything)."""
    return {k: v for k, v in entries.items() if isinstance(k, str) and isinstance(v, str) and v in stored
            and k not in stored}


def _tied_record(raw: Any, stored: Collection[str]) -> dict[str, str]:
    """hf_resumable's own tied record (``TIED_KEY``): an object in an index, a JSON string in a file header."""
    if isinstance(raw, str):
        try:
            raw = parse_json(raw, source=TIED_KEY)  # bounded depth: the header is untrusted
        except CorruptCheckpointError:
            return {}
    return _recorded_aliases(raw, stored) if isinstance(raw, dict) else {}


def _check_index_against_headers(index: ShardIndex, metas: dict[str, TensorMeta]) -> None:
    missing = [n for n in index.weight_map if n not in metas]
    if missing:
        raise IncompleteCheckpointError(
            f"{index.source}: the index lists {len(missing)} tensors absent from their shards' headers, e.g. "
            f"{missing[:5]}; the checkpoint is incomplete or the index is stale. Re-save or re-push it."
        )


def _aliases(index: ShardIndex) -> dict[str, str]:
    """``{dropped: kept}`` entries huggingface_hub (and push_sharded) put in the index metadata, and the tied record
    of an hf_resumable checkpoint."""
    stored = index.weight_map
    return {**_recorded_aliases(index.metadata, stored), **_tied_record(index.metadata.get(TIED_KEY), stored)}


def _open_local(path: Path) -> LazyStateDict:
    if path.is_file():
        header = read_header(path)
        metas = _metas(header, path.name)
        return LazyStateDict(metas, lambda _: path, source=str(path),
                             aliases=_tied_record(header.metadata.get(TIED_KEY), metas))
    index_path, single = path / MODEL_INDEX_FILE, path / SINGLE_MODEL_FILE
    if not index_path.is_file():
        if not single.is_file():
            if (error := base_not_stored(path, wanted="lazy loading needs every weight")) is not None:
                raise error
            raise CheckpointNotFoundError(
                f"{path}: no {MODEL_INDEX_FILE} and no {SINGLE_MODEL_FILE}; point at a directory written by "
                "save_pretrained / push_sharded, or at a .safetensors file."
            )
        return _open_local(single)
    index = read_index_file(index_path, source=str(index_path))
    metas: dict[str, TensorMeta] = {}
    for filename in index.filenames:
        shard = path / filename
        if not shard.is_file():
            raise IncompleteCheckpointError(f"{index_path} names shard {filename!r}, which is missing from {path}.")
        metas.update({n: m for n, m in _metas(read_header(shard), filename).items()
                      if index.weight_map.get(n) == filename})
    _check_index_against_headers(index, metas)
    return LazyStateDict(metas, lambda f: path / f, source=str(path), aliases=_aliases(index))


def _open_repo(repo_id: str, *, revision: str | None, token: str | None) -> LazyStateDict:
    snapshot = HubSnapshot.resolve(repo_id, revision=revision, token=token)
    index, folder = snapshot.fetch_index()
    if index is None:
        local = _open_local(folder / SINGLE_MODEL_FILE)
        local.source = snapshot.label
        return local
    metas: dict[str, TensorMeta] = {}
    # Ranged GETs of the headers only (huggingface_hub's own parser), concurrently; no tensor data.
    for filename, header in snapshot.fetch_headers(index).items():
        for name, info in header.tensors.items():
            if index.weight_map.get(name) != filename:
                continue
            if info.dtype not in STR_TO_DTYPE:
                raise HubFormatError(f"hf://{snapshot.label}/{filename}: tensor {name!r} has dtype {info.dtype!r}, "
                                     f"which hf_resumable cannot load (known: {sorted(STR_TO_DTYPE)}).")
            metas[name] = TensorMeta(name, STR_TO_DTYPE[info.dtype], tuple(info.shape), filename)
    _check_index_against_headers(index, metas)
    return LazyStateDict(metas, lambda f: snapshot.fetch_shard(index, f), source=snapshot.label,
                         aliases=_aliases(index))


# --------------------------------------------------------------------------------------------------- load planning
