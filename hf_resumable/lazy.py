"""Lazy access to sharded safetensors weights: a read-only state dict, shard-by-shard loading, layer streaming.

Three tools, all index first (``model.safetensors.index.json`` or a single ``model.safetensors``):

- :class:`LazyStateDict`: a ``Mapping[str, torch.Tensor]`` whose names, shapes and dtypes come from the safetensors
  headers; a tensor is read (``safetensors.safe_open``, mmap) when it is accessed, and for a Hub repo only the shards
  actually touched are downloaded.
- :func:`load_lazily`: fill a model (also one built on the meta device) shard by shard, reading each tensor straight
  into the parameter's memory, so at most one shard's worth of pages is in flight beyond the model's own weights.
  Strictness is decided **once**, against all shards, before anything is read.
- :class:`StreamingModel` / :func:`stream_forward`: run a model that lives on the meta device, loading each
  transformer block's weights just before it runs and releasing them right after.

Example:

```python
>>> from accelerate import init_empty_weights  # doctest: +SKIP
>>> with init_empty_weights():  # doctest: +SKIP
...     model = AutoModelForCausalLM.from_config(config)
>>> missing, unexpected = load_lazily(model, "me/tiny-llama")  # doctest: +SKIP
```
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from ._jsonio import parse_json
from .checkpoint._frozen import base_not_stored
from .checkpoint._model import KeyMatch, Mismatch, find_aliases, match_keys, mismatch_message
from .constants import MODEL_INDEX_FILE, TIED_KEY
from .errors import (
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    HubFormatError,
    IncompleteCheckpointError,
)
from .hub import SINGLE_MODEL_FILE, HubSnapshot, read_index_file
from .safetensors_io import STR_TO_DTYPE, read_header, read_safetensors
from .sharding import ShardIndex

logger = logging.getLogger(__name__)

__all__ = ["TensorMeta", "LazyStateDict", "LoadPlan", "plan_load", "load_lazily", "StreamingModel", "stream_forward"]


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
        """Local path of ``filename``, downloading it first for a Hub repo."""
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


def _metas_from_header(path: Path, filename: str) -> dict[str, TensorMeta]:
    header = read_header(path)
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
        metas = {n: TensorMeta(n, info.torch_dtype, info.shape, path.name) for n, info in header.tensors.items()}
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
        metas.update({n: m for n, m in _metas_from_header(shard, filename).items()
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
@dataclass(frozen=True)
class LoadPlan:
    """What to read for a model, decided once across all shards before any data is read.

    Args:
        sources (`dict[str, list[str]]`): checkpoint name -> model keys it fills.
        missing (`list[str]`): model keys nothing fills (tied copies of loaded tensors excluded).
        unexpected (`list[str]`): checkpoint names (and recorded aliases) the model has no key for.
        mismatched (`list[str]`): ``"key: checkpoint shape vs model shape"`` entries.
        match (`KeyMatch`, *optional*): the key match these come from (the checkpoint loader's own matcher).
    """

    sources: dict[str, list[str]]
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)
    match: KeyMatch | None = field(default=None, repr=False, compare=False)

    def describe(self, source: str, *, strict: bool = True) -> str:
        """The one "does not fit" message (:func:`hf_resumable.checkpoint._model.mismatch_message`)."""
        match = self.match or KeyMatch(self.sources, self.missing, self.unexpected,
                                       [Mismatch(line.partition(": ")[0], reason=line.partition(": ")[2])
                                        for line in self.mismatched])
        return mismatch_message(match, source=source, what="model", strict=strict)


def _model_tensors(model: nn.Module, prefix: str = "") -> dict[str, torch.Tensor]:
    """Persistent parameters and buffers by state-dict key (tied names included)."""
    return {k: v for k, v in model.state_dict(keep_vars=True).items() if k.startswith(prefix)}


def plan_load(model: nn.Module, weights: LazyStateDict, *, keys: list[str] | None = None) -> LoadPlan:
    """Match model keys to stored tensors using headers only: sources, missing, unexpected and shape mismatches.

    The same matcher as a checkpoint load (:func:`hf_resumable.checkpoint._model.match_keys`), on shapes only:
    a stored dtype is cast into the model's, as ``from_pretrained`` does. A model key counts as filled when it is
    stored, when the index records it as an alias of a stored tensor, or when the model ties it to a stored key
    (:func:`hf_resumable.checkpoint._model.find_aliases`: one parameter under two names, e.g. on the meta device).

    Example:

    ```python
    >>> plan = plan_load(model, LazyStateDict.from_pretrained("out"))  # doctest: +SKIP
    >>> plan.missing, plan.unexpected  # doctest: +SKIP
    ([], [])
    ```
    """
    tensors = _model_tensors(model)
    wanted = list(tensors) if keys is None else keys
    stored = {name: (meta.dtype, meta.shape) for name, meta in weights._metas.items()}
    match = match_keys({key: (tensors[key].dtype, tuple(tensors[key].shape)) for key in wanted}, stored,
                       tied=weights.aliases, shared=find_aliases(tensors), compare_dtype=False,
                       report_unexpected=keys is None)
    return LoadPlan(match.sources, match.missing, match.unexpected, [m.describe("model") for m in match.mismatched],
                    match=match)


# --------------------------------------------------------------------------------------------------- loading
def _owner(model: nn.Module, key: str) -> tuple[nn.Module, str]:
    module_path, _, attr = key.rpartition(".")
    return model.get_submodule(module_path) if module_path else model, attr


Allocator = Callable[[torch.Size, torch.dtype], torch.Tensor]


def _empty(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="cpu")


def _materialize(model: nn.Module, key: str, allocate: Allocator = _empty) -> torch.Tensor:
    """The CPU tensor behind ``key``; a meta tensor is replaced by memory from ``allocate`` first.

    Parameters are swapped in place (``torch.utils.swap_tensors``) so every module sharing them stays tied.
    """
    module, attr = _owner(model, key)
    current = getattr(module, attr)
    if not current.is_meta:
        return current
    fresh = allocate(current.shape, current.dtype)
    if isinstance(current, nn.Parameter):
        torch.utils.swap_tensors(current, nn.Parameter(fresh, requires_grad=current.requires_grad))
        return current
    setattr(module, attr, fresh)
    return fresh


def _read_shard(model: nn.Module, weights: LazyStateDict, filename: str, names: list[str],
                sources: Mapping[str, list[str]], allocate: Allocator = _empty) -> None:
    """Read ``names`` of one shard straight into the model's tensors (``readinto``, no intermediate copy)."""
    path = weights.shard_path(filename)
    header = read_header(path)
    into: dict[str, torch.Tensor] = {}
    for name in names:
        keys = sources[name]
        into[name] = _materialize(model, keys[0], allocate)
        info = header.tensors.get(name)
        if info is None or info.shape != tuple(into[name].shape):
            raise CorruptCheckpointError(f"{path}: tensor {name!r} is missing or has another shape than its header "
                                         "promised; the file changed under us. Re-download it.")
    read_safetensors(path, header=header, names=names, into=into)
    with torch.no_grad():
        for name in names:
            for extra in sources[name][1:]:
                target = _materialize(model, extra, allocate)
                if target is not into[name]:
                    target.copy_(into[name])


def _tie(model: nn.Module) -> None:
    tie = getattr(model, "tie_weights", None)
    if callable(tie):
        tie()


def _meta_leftovers(model: nn.Module) -> list[str]:
    names = [n for n, p in model.named_parameters(remove_duplicate=False) if p.is_meta]
    return names + [n for n, b in model.named_buffers(remove_duplicate=False) if b.is_meta]


def _as_weights(path_or_repo_id: str | os.PathLike | LazyStateDict, revision: str | None,
                token: str | None) -> LazyStateDict:
    if isinstance(path_or_repo_id, LazyStateDict):
        return path_or_repo_id
    return LazyStateDict.from_pretrained(path_or_repo_id, revision=revision, token=token)


def load_lazily(
    model: nn.Module,
    path_or_repo_id: str | os.PathLike | LazyStateDict,
    *,
    strict: bool = True,
    revision: str | None = None,
    token: str | None = None,
) -> tuple[list[str], list[str]]:
    """Fill ``model`` from sharded safetensors, one shard at a time, with strictness checked once for all shards.

    1. Read the index and headers only, and match every model key (tied weights and recorded aliases count as
       filled). Any shape mismatch, and with ``strict=True`` any missing or unexpected key, raises one error that
       lists them all, before a single tensor is read.
    2. Per shard: download it if needed, then read its tensors straight into the parameters (meta parameters get
       CPU memory first, swapped in place so tied modules stay tied). Only that shard is in flight.
    3. Re-tie weights (``model.tie_weights()`` when the model has it).

    Args:
        model (`torch.nn.Module`): the model; may live on the meta device (build it with
            ``accelerate.init_empty_weights()`` so non-persistent buffers stay real).
        path_or_repo_id (`str`, `os.PathLike` or [`LazyStateDict`]): local directory/file or Hub repo id.
        strict (`bool`, *optional*, defaults to `True`): fail on missing or unexpected keys.
        revision (`str`, *optional*): Hub revision.
        token (`str`, *optional*): Hub token.

    Returns:
        `tuple[list[str], list[str]]`: ``(missing_keys, unexpected_keys)``.

    Raises:
        CheckpointMismatchError: on shape mismatches, or missing/unexpected keys with ``strict=True``, or when a
            non-persistent buffer is left on the meta device.

    Example:

    ```python
    >>> with init_empty_weights():  # doctest: +SKIP
    ...     model = LlamaForCausalLM(config)
    >>> load_lazily(model, "out/checkpoint-120")  # doctest: +SKIP
    ([], [])
    ```
    """
    weights = _as_weights(path_or_repo_id, revision, token)
    _tie(model)
    plan = plan_load(model, weights)
    plan.match.check(strict=strict, source=weights.source)
    # Each shard is read with an implicit strict=False: strictness was decided above, across all shards at once.
    for filename, names in weights.group_by_file(list(plan.sources)).items():
        _read_shard(model, weights, filename, names, plan.sources)
        weights.release(filename)
    _tie(model)
    _check_no_meta(model, set(plan.missing), weights.source)
    return plan.missing, plan.unexpected


def _check_no_meta(model: nn.Module, allowed: set[str], source: str) -> None:
    leftovers = [n for n in _meta_leftovers(model) if n not in allowed]
    if leftovers:
        raise CheckpointMismatchError(
            f"After loading {source}, {leftovers[:10]} are still on the meta device (not stored in the checkpoint). "
            "Build the model with accelerate.init_empty_weights() (buffers stay real) or initialize them first."
        )
    if allowed & set(_meta_leftovers(model)):
        logger.warning("missing keys left on the meta device: %s", sorted(allowed)[:10])


# --------------------------------------------------------------------------------------------------- layer streaming
def _find_blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The ``nn.ModuleList`` holding most parameters: the transformer blocks."""
    best: tuple[int, str, nn.ModuleList] | None = None
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            count = sum(p.numel() for p in module.parameters())
            if best is None or count > best[0]:
                best = (count, name, module)
    if best is None:
        raise ValueError(f"{type(model).__name__} has no nn.ModuleList of blocks to stream; pass blocks= explicitly.")
    return best[1], best[2]


class _BufferPool:
    """Reuses released block tensors for the next block: blocks share shapes, so after the first block no new
    memory is allocated (no allocator churn, no first-touch page faults)."""

    def __init__(self) -> None:
        self.free: dict[tuple[tuple[int, ...], torch.dtype], list[torch.Tensor]] = {}

    def allocate(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        stack = self.free.get((tuple(shape), dtype))
        return stack.pop() if stack else _empty(shape, dtype)

    def release(self, module: nn.Module) -> None:
        """Put a block's parameters back on the meta device, keeping their memory for the next block."""
        with torch.no_grad():
            for sub in module.modules():
                for attr, param in list(sub._parameters.items()):
                    if param is not None and not param.is_meta:
                        self.free.setdefault((tuple(param.shape), param.dtype), []).append(param.data)
                        setattr(sub, attr, nn.Parameter(param.to("meta"), requires_grad=param.requires_grad))

    def clear(self) -> None:
        self.free.clear()


class StreamingModel(contextlib.AbstractContextManager):
    """Run a meta-device model by loading each block's weights just before it runs and releasing them after.

    On enter, every weight outside the blocks (embeddings, final norm, head) is loaded and the key match is checked
    once for the whole model (``strict`` as in :func:`load_lazily`); each block then gets a forward pre-hook that
    reads its tensors from the shards and a forward hook that puts them back on the meta device. Peak memory is the
    non-block weights plus one block. Outputs equal those of the fully loaded model. ``generate`` works too (every
    decoding step streams every block again).

    Args:
        model (`torch.nn.Module`): the model on the meta device (``accelerate.init_empty_weights()``).
        path_or_repo_id (`str`, `os.PathLike` or [`LazyStateDict`]): where the weights are.
        blocks (`str`, *optional*): dotted name of the ``nn.ModuleList`` of blocks (default: the largest one).
        strict (`bool`, *optional*, defaults to `True`): fail on missing or unexpected keys.
        revision (`str`, *optional*): Hub revision.
        token (`str`, *optional*): Hub token.

    Example:

    ```python
    >>> with init_empty_weights():  # doctest: +SKIP
    ...     model = LlamaForCausalLM(config)
    >>> with StreamingModel(model, "me/tiny-llama") as streamed, torch.no_grad():  # doctest: +SKIP
    ...     logits = streamed(input_ids).logits
    ```
    """

    def __init__(self, model: nn.Module, path_or_repo_id: str | os.PathLike | LazyStateDict, *,
                 blocks: str | None = None, strict: bool = True, revision: str | None = None,
                 token: str | None = None) -> None:
        self.model = model
        self.weights = _as_weights(path_or_repo_id, revision, token)
        if blocks is None:
            self.blocks_name, self.blocks = _find_blocks(model)
        else:
            self.blocks_name, self.blocks = blocks, model.get_submodule(blocks)
        self.strict = strict
        self.plan: LoadPlan | None = None
        self._handles: list[Any] = []
        self._pool = _BufferPool()

    def _block_prefix(self, index: int) -> str:
        return f"{self.blocks_name}.{index}."

    def __enter__(self) -> nn.Module:
        _tie(self.model)
        self.plan = plan_load(self.model, self.weights)
        self.plan.match.check(strict=self.strict, source=self.weights.source)
        block_prefix = f"{self.blocks_name}."
        outside = [n for n, keys in self.plan.sources.items() if not keys[0].startswith(block_prefix)]
        self._load(outside)
        _tie(self.model)
        for index, block in enumerate(self.blocks):
            self._handles.append(block.register_forward_pre_hook(self._pre_hook(index)))
            self._handles.append(block.register_forward_hook(lambda module, args, output: self._pool.release(module)))
        return self.model

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for block in self.blocks:
            self._pool.release(block)
        self._pool.clear()
        self.weights.release()

    def _load(self, names: list[str]) -> None:
        for filename, group in self.weights.group_by_file(names).items():
            _read_shard(self.model, self.weights, filename, group, self.plan.sources, self._pool.allocate)

    def _pre_hook(self, index: int) -> Callable[..., None]:
        prefix = self._block_prefix(index)

        def hook(module: nn.Module, args: tuple) -> None:
            self._load([n for n, keys in self.plan.sources.items() if keys[0].startswith(prefix)])

        return hook


def stream_forward(model: nn.Module, path_or_repo_id: str | os.PathLike | LazyStateDict, input_ids: torch.Tensor,
                   *, attention_mask: torch.Tensor | None = None, revision: str | None = None,
                   token: str | None = None) -> Any:
    """One forward pass of a meta-device model with its blocks streamed from the shards (see :class:`StreamingModel`).

    Args:
        model (`torch.nn.Module`): the model on the meta device (``accelerate.init_empty_weights()``).
        path_or_repo_id (`str`, `os.PathLike` or [`LazyStateDict`]): where the weights are.
        input_ids (`torch.Tensor`): token ids, shape ``(batch, sequence)``.
        attention_mask (`torch.Tensor`, *optional*): passed to the model.
        revision (`str`, *optional*): Hub revision.
        token (`str`, *optional*): Hub token.

    Returns:
        The model's output (e.g. ``CausalLMOutputWithPast``), computed under ``torch.no_grad()``.

    Raises:
        CheckpointMismatchError: if the weights do not fit the model (checked once, before any block runs).

    Example:

    ```python
    >>> out = stream_forward(meta_model, "out/model", torch.tensor([[1, 2, 3]]))  # doctest: +SKIP
    >>> out.logits.shape  # doctest: +SKIP
    torch.Size([1, 3, 128])
    ```
    """
    with StreamingModel(model, path_or_repo_id, revision=revision, token=token) as streamed, torch.no_grad():
        return streamed(input_ids, attention_mask=attention_mask)
