"""Switch in from accelerate + FSDP: a stock ``Accelerator.save_state`` of an FSDP ``SHARDED_STATE_DICT`` run.

The DCP ``.metadata`` is read with the restricted unpickler of :mod:`~hf_resumable.conversions._pickle`, each chunk
becomes the piece of the rank that wrote it (:func:`plan_dcp_pieces`, pure), and the result is the per-rank
checkpoint ``ResumableAccelerator`` with FSDP2 writes. The first resume after the switch is NOT bit-exact and needs
``allow_inexact_resume=True``, see
docs/multi-gpu.md#switching-in-from-stock-deepspeed-or-accelerate-fsdp-checkpoints-and-exporting.

Example:

```python
>>> from hf_resumable.conversions.dcp import convert_accelerate_fsdp_checkpoint
>>> convert_accelerate_fsdp_checkpoint("stock/checkpoint_3", "ours/checkpoint-300")  # doctest: +SKIP
```
"""

from __future__ import annotations

import io
import logging
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..checkpoint import CheckpointInfo
from ..checkpoint.pieces import Box, capture_payload, flatten_optimizer_state
from ..constants import (
    OPTIMIZER_STATE_PREFIX,
    STOCK_ACCELERATE_FSDP_MODEL_DIR_RE,
    STOCK_ACCELERATE_FSDP_OPTIMIZER_DIR_RE,
    STOCK_DCP_DATA_SUFFIX,
    STOCK_DCP_METADATA_FILE,
)
from ..errors import CheckpointNotFoundError, CorruptCheckpointError, UnsupportedStateError
from ..format._safefile import open_regular
from ..format.rng import RngState
from ._commit import commit_for_ranks
from ._layout import RankPiece, add_layout
from ._pickle import load_dcp_metadata, load_torch_pickle
from .deepspeed import NOT_BIT_EXACT_WARNING
from .stock import _optimizer_class, _split_rng, _StateHolder

logger = logging.getLogger(__name__)

__all__ = ["DcpChunk", "AccelerateFsdpFiles", "plan_dcp_pieces", "plan_flat_param_groups", "read_dcp_optimizer",
           "is_accelerate_fsdp_checkpoint", "convert_accelerate_fsdp_checkpoint"]

DCP_PICKLE_WARNING = (
    "Reading a stock accelerate FSDP checkpoint: its .metadata pickles with a restricted unpickler (DCP's metadata "
    "classes only), its tensor records, scheduler.bin and random_states_*.pkl with torch.load(weights_only=True). "
    "Only convert checkpoints you trust.")
_DATA_FILE_RE = re.compile(r"^__(\d+)_(\d+)" + re.escape(STOCK_DCP_DATA_SUFFIX) + "$")
_GROUP_PARAMS_RE = re.compile(r"^\d+\.params$")  # optimizer.param_groups.<i>.params: groups listed by index
_RANDOM_STATES_RE = re.compile(r"^random_states_(\d+)\.pkl$")
_SCHEDULER_FILE = "scheduler.bin"
MODEL_PREFIX = "model."  # accelerate saves {"model": state_dict}
OPTIMIZER_STATE_KEY = "optimizer.state."
OPTIMIZER_GROUPS_KEY = "optimizer.param_groups."
# accelerate's layout record and progress keys, as ResumableAccelerator writes them (integrations/accelerate.py)
_EXTRA_LAYOUT = {"accelerate_layout": {"custom_objects": 0, "hook_files": [], "models": ["module"],
                                       "optimizers": ["core"], "schedulers": 1},
                 "custom_objects": [], "models": [], "optimizers": [None], "schedulers": []}


@dataclass(frozen=True)
class DcpChunk:
    """One stored chunk: which flattened key, its box, and where its ``torch.save`` record lies."""

    key: str  # the DCP key (``model.transformer.wte.weight``)
    box: Box  # the chunk's box of the global tensor
    file: str  # the ``.distcp`` file name (a plain name; its rank is in it)
    rank: int  # the rank that wrote it
    offset: int  # where the record starts in ``file``
    length: int  # and its bytes


def plan_dcp_pieces(metadata: Any, *, source: str) -> tuple[dict[str, tuple[torch.dtype, tuple[int, ...]]],
                                                              list[DcpChunk], dict[str, Any]]:
    """Every tensor key's dtype and global shape, every chunk (its rank, file and bytes), and the byte-record keys;
    pure over a DCP ``Metadata``.

    Raises:
        CorruptCheckpointError: a chunk without storage, a file name that is not ``__<rank>_<i>.distcp``, or
            negative offsets.
        UnsupportedStateError: transformed (e.g. compressed) records.
    """
    storage = {(index.fqn, tuple(index.offset) if index.offset is not None else None): info
               for index, info in metadata.storage_data.items()}
    tensors, chunks, byte_keys = {}, [], {}
    for key, entry in metadata.state_dict_metadata.items():
        if not hasattr(entry, "chunks"):  # BytesStorageMetadata: a torch.save'd object
            byte_keys[key] = storage.get((key, None)) or next(
                (info for (fqn, _), info in storage.items() if fqn == key), None)
            if byte_keys[key] is None:
                raise CorruptCheckpointError(f"{source}: no storage for {key!r}.")
            continue
        tensors[key] = (entry.properties.dtype, tuple(int(x) for x in entry.size))
        for chunk in entry.chunks:
            info = storage.get((key, tuple(chunk.offsets)))
            if info is None:
                raise CorruptCheckpointError(f"{source}: no storage for {key!r} at {list(chunk.offsets)}.")
            chunks.append(_chunk(key, chunk, info, source=source))
    return tensors, chunks, byte_keys


def _chunk(key: str, chunk: Any, info: Any, *, source: str) -> DcpChunk:
    match = _DATA_FILE_RE.match(str(info.relative_path))
    if match is None:  # never a path: the records live next to .metadata
        raise CorruptCheckpointError(f"{source}: {key!r} is stored in {str(info.relative_path)[:80]!r}, not a "
                                     f"__<rank>_<i>{STOCK_DCP_DATA_SUFFIX} file of the checkpoint.")
    if getattr(info, "transform_descriptors", None):
        raise UnsupportedStateError(f"{source}: {key!r} is stored transformed ({info.transform_descriptors}); only "
                                    "plain FileSystemWriter records are converted.")
    if info.offset < 0 or info.length < 0:
        raise CorruptCheckpointError(f"{source}: {key!r} has a negative offset or length.")
    box = Box(tuple(int(x) for x in chunk.offsets), tuple(int(x) for x in chunk.sizes))
    return DcpChunk(key, box, info.relative_path, int(match.group(1)), int(info.offset), int(info.length))


def _read_record(directory: Path, file: str, offset: int, length: int) -> Any:
    path = directory / file
    with open_regular(path) as handle:  # a FIFO or device in place of a record is refused, never waited on
        handle.seek(offset)
        data = handle.read(length)
    if len(data) != length:
        raise CorruptCheckpointError(f"{path}: truncated ({offset + len(data)} bytes, the metadata says "
                                     f"{offset + length}).")
    buffer = io.BytesIO(data)
    buffer.name = f"{path}@{offset}"  # named in errors
    return load_torch_pickle(buffer)


def _read_chunk(directory: Path, chunk: DcpChunk, dtype: torch.dtype) -> torch.Tensor:
    tensor = _read_record(directory, chunk.file, chunk.offset, chunk.length)
    if not torch.is_tensor(tensor) or tuple(tensor.shape) != chunk.box.shape or tensor.dtype != dtype:
        raise CorruptCheckpointError(f"{directory / chunk.file}: the record of {chunk.key!r} at {chunk.offset} is "
                                     f"not a {dtype} tensor of shape {list(chunk.box.shape)}.")
    return tensor.contiguous()


@dataclass(frozen=True)
class AccelerateFsdpFiles:
    """The files of a stock accelerate FSDP ``save_state`` directory."""

    directory: Path  # the ``save_state`` directory
    model: Path  # ``pytorch_model_fsdp_0/``
    optimizer: Path | None  # ``optimizer_0/``
    scheduler: Path | None  # ``scheduler.bin``
    random_states: dict[int, Path]  # rank -> ``random_states_<rank>.pkl``

    @classmethod
    def scan(cls, directory: Path) -> AccelerateFsdpFiles:
        """Find the files (one model and at most one optimizer: one prepared model, as ResumableAccelerator saves).

        Raises:
            CheckpointNotFoundError: no ``pytorch_model_fsdp_0/.metadata``.
            UnsupportedStateError: more than one model or optimizer.
        """
        if not directory.is_dir():
            raise CheckpointNotFoundError(f"{directory}: no such directory.")
        models = [p for p in directory.iterdir() if STOCK_ACCELERATE_FSDP_MODEL_DIR_RE.match(p.name)]
        optimizers = [p for p in directory.iterdir() if STOCK_ACCELERATE_FSDP_OPTIMIZER_DIR_RE.match(p.name)]
        if not models or not (models[0] / STOCK_DCP_METADATA_FILE).is_file():
            raise CheckpointNotFoundError(f"{directory}: no pytorch_model_fsdp_0/{STOCK_DCP_METADATA_FILE}; not an "
                                          "accelerate FSDP SHARDED_STATE_DICT checkpoint.")
        if len(models) > 1 or len(optimizers) > 1:
            raise UnsupportedStateError(f"{directory}: {len(models)} models and {len(optimizers)} optimizers; the "
                                        "conversion handles one prepared model and its optimizer.")
        randoms = {int(m.group(1)): p for p in directory.iterdir() if (m := _RANDOM_STATES_RE.match(p.name))}
        scheduler = directory / _SCHEDULER_FILE
        return cls(directory, models[0], optimizers[0] if optimizers else None,
                   scheduler if scheduler.is_file() else None, randoms)


def is_accelerate_fsdp_checkpoint(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` holds accelerate's FSDP sharded ``save_state`` (``pytorch_model_fsdp_0/.metadata``)."""
    return (Path(directory) / "pytorch_model_fsdp_0" / STOCK_DCP_METADATA_FILE).is_file()


def _model_pieces(files: AccelerateFsdpFiles, world_size: int) -> list[list[RankPiece]]:
    path = files.model / STOCK_DCP_METADATA_FILE
    tensors, chunks, _ = plan_dcp_pieces(load_dcp_metadata(path), source=str(path))
    pieces: list[list[RankPiece]] = [[] for _ in range(world_size)]
    for chunk in chunks:
        if not chunk.key.startswith(MODEL_PREFIX):
            raise CorruptCheckpointError(f"{path}: unexpected key {chunk.key!r} (accelerate saves model.<name>).")
        dtype, shape = tensors[chunk.key]
        name = chunk.key[len(MODEL_PREFIX):]
        pieces[_rank(chunk, world_size, path)].append((name, _read_chunk(files.model, chunk, dtype), chunk.box, shape))
    return pieces


def _rank(chunk: DcpChunk, world_size: int, path: Path) -> int:
    if chunk.rank >= world_size:
        raise CorruptCheckpointError(f"{path}: {chunk.file} was written by rank {chunk.rank}, but the checkpoint has "
                                     f"the random states of {world_size} rank(s).")
    return chunk.rank


def _split_state_key(key: str) -> tuple[str, str]:
    """``optimizer.state.<fqn>.<key>`` -> ``(fqn, key)`` (optimizer state keys hold no dots)."""
    fqn, _, name = key[len(OPTIMIZER_STATE_KEY):].rpartition(".")
    return fqn, name


def read_dcp_optimizer(directory: Path, world_size: int, optimizer: str | None, *, metadata: Any = None
                       ) -> tuple[list[list[RankPiece]], dict[str, Any], str]:
    """Every rank's pieces of a DCP optimizer directory, its JSON document and the optimizer class name.

    Reads what accelerate's FSDP ``save_state`` writes (``optimizer.param_groups.<i>.<key>``, groups listing their
    parameters) and what transformers' ``save_optimizer_distributed`` writes (``flatten_optimizer_state_dict``:
    ``optimizer.param_groups.<fqn>.<key>`` per parameter, regrouped by :func:`plan_flat_param_groups`).

    Args:
        directory (`Path`): the directory holding ``.metadata`` and the ``__<rank>_<i>.distcp`` files.
        world_size (`int`): the ranks of the checkpoint (every chunk's writer must be one of them).
        optimizer (`str`, *optional*): one of ``OPTIMIZERS`` (default: inferred from the state).
        metadata (*optional*): the ``.metadata`` already read with :func:`load_dcp_metadata`.

    Returns:
        `tuple`: per rank its ``(state/<fqn>/<key>, piece, box, global shape)``, the optimizer document, the class.

    Raises:
        UnsafePickleError, CorruptCheckpointError, UnsupportedStateError: as :func:`load_dcp_metadata` and
            :func:`plan_dcp_pieces`; a record that is not what the metadata says; keys of neither form.
        ValueError: an unknown ``optimizer``.
    """
    path = directory / STOCK_DCP_METADATA_FILE
    metadata = metadata if metadata is not None else load_dcp_metadata(path)
    tensors, chunks, byte_keys = plan_dcp_pieces(metadata, source=str(path))
    # 1. Param groups and non-tensor state (torch.save'd objects), then the state's shape for the document.
    groups: dict[int, dict[str, Any]] = {}
    per_param: dict[str, dict[str, Any]] = {}
    state: dict[str, dict[str, Any]] = {}
    # groups listing their parameters (``<i>.params``), or flattened: each parameter's hyper-parameters
    indexed = any(_GROUP_PARAMS_RE.match(key[len(OPTIMIZER_GROUPS_KEY):]) for key in byte_keys
                  if key.startswith(OPTIMIZER_GROUPS_KEY))
    for key, info in byte_keys.items():
        value = _read_record(directory, info.relative_path, info.offset, info.length)
        if key.startswith(OPTIMIZER_GROUPS_KEY):
            rest = key[len(OPTIMIZER_GROUPS_KEY):]
            if not indexed:  # <fqn>.<key>: FQNs hold dots, hyper-parameter names do not
                fqn, _, name = rest.rpartition(".")
                per_param.setdefault(fqn, {})[name] = value
                continue
            index, _, name = rest.partition(".")
            if not index.isdigit():
                raise CorruptCheckpointError(f"{path}: unexpected key {key!r} among param groups listed by index.")
            groups.setdefault(int(index), {})[name] = value
        elif key.startswith(OPTIMIZER_STATE_KEY):
            fqn, name = _split_state_key(key)
            state.setdefault(fqn, {})[name] = value
        else:
            raise CorruptCheckpointError(f"{path}: unexpected key {key!r}.")
    for key, (dtype, shape) in tensors.items():
        fqn, name = _split_state_key(key)
        state.setdefault(fqn, {})[name] = torch.empty(0, dtype=dtype)  # a placeholder: only its name is used
    param_groups = ([groups[i] for i in sorted(groups)] if groups
                    else plan_flat_param_groups(per_param, order=_key_order(metadata)))
    class_name = _optimizer_class({"state": state, "param_groups": param_groups}, optimizer).__qualname__
    _, document = flatten_optimizer_state({"state": state, "param_groups": param_groups}, class_name)
    # 2. Every chunk as its rank's piece, named as a live FSDP2 save names it.
    pieces: list[list[RankPiece]] = [[] for _ in range(world_size)]
    for chunk in chunks:
        dtype, shape = tensors[chunk.key]
        fqn, name = _split_state_key(chunk.key)
        pieces[_rank(chunk, world_size, path)].append((f"{OPTIMIZER_STATE_PREFIX}{fqn}/{name}",
                                                       _read_chunk(directory, chunk, dtype), chunk.box, shape))
    return pieces, document, class_name


def _key_order(metadata: Any) -> list[str]:
    """The DCP keys in the order the saving rank flattened its state dict (``planner_data``), then the rest."""
    planner = getattr(metadata, "planner_data", None)
    ordered = list(planner) if isinstance(planner, Mapping) else []
    return list(dict.fromkeys([*ordered, *metadata.state_dict_metadata]))


def plan_flat_param_groups(per_param: Mapping[str, Mapping[str, Any]], *, order: Sequence[str]
                           ) -> list[dict[str, Any]]:
    """Param groups from per-parameter hyper-parameters (a ``flatten_optimizer_state_dict`` save): parameters with
    equal hyper-parameters share a group; groups and their parameters come in the order their keys first appear in
    ``order`` (the flattened DCP keys), then by name. Pure.

    Two groups of the original optimizer with equal hyper-parameters become one group.

    Example:

    ```python
    >>> plan_flat_param_groups({"b": {"lr": 1.0}, "a": {"lr": 1.0}, "n": {"lr": 0.5}},
    ...                        order=["optimizer.param_groups.b.lr", "optimizer.param_groups.n.lr"])
    [{'lr': 1.0, 'params': ['b', 'a']}, {'lr': 0.5, 'params': ['n']}]
    ```
    """
    first: dict[str, int] = {}
    for position, key in enumerate(order):
        if key.startswith(OPTIMIZER_GROUPS_KEY):
            first.setdefault(key[len(OPTIMIZER_GROUPS_KEY):].rpartition(".")[0], position)
    groups: dict[str, dict[str, Any]] = {}
    for fqn in sorted(per_param, key=lambda name: (first.get(name, len(order)), name)):
        hyper = dict(per_param[fqn])
        groups.setdefault(repr(sorted(hyper.items())), {**hyper, "params": []})["params"].append(fqn)
    return list(groups.values())


def _rng_state(saved: Mapping[str, Any], path: Path) -> RngState:
    try:
        cuda = saved.get("torch_cuda_manual_seed") or []
        return RngState(python=tuple(saved["random_state"]), numpy=tuple(saved["numpy_random_seed"]),
                        torch_cpu=saved["torch_manual_seed"], cuda=list(cuda))
    except (KeyError, TypeError) as err:
        raise CorruptCheckpointError(f"{path}: not accelerate's random states ({err}).") from err


def _optimizer_steps(pieces: list[list[RankPiece]]) -> int | None:
    """The optimizer steps taken: Adam's per-parameter ``step`` (the same for every parameter)."""
    steps = {int(tensor.item()) for rank in pieces for name, tensor, _, _ in rank
             if name.endswith("/step") and tensor.numel() == 1}
    return steps.pop() if len(steps) == 1 else None


def convert_accelerate_fsdp_checkpoint(
    source: str | os.PathLike,
    output: str | os.PathLike,
    *,
    step: int | None = None,
    optimizer: str | None = None,
    overwrite: bool = False,
) -> CheckpointInfo:
    """Convert a stock accelerate FSDP ``SHARDED_STATE_DICT`` ``save_state`` into a per-rank hf_resumable checkpoint.

    1. Scan ``source``; log the pickle WARNING.
    2. Read each ``.metadata`` with the restricted unpickler, plan every chunk as its rank's piece
       (:func:`plan_dcp_pieces`), read the chunks' records (``weights_only=True``).
    3. Add the scheduler, each rank's RNG, the step; commit for the ranks that wrote it; log that the first resume is
       not bit-exact (``ResumableAccelerator(allow_inexact_resume=True)`` resumes it).

    Args:
        source (`str` or `os.PathLike`): the ``save_state`` directory.
        output (`str` or `os.PathLike`): the new checkpoint directory.
        step (`int`, *optional*): the optimizer steps taken (default: the optimizer state's ``step``).
        optimizer (`str`, *optional*): one of ``OPTIMIZERS`` (default: inferred from the state).
        overwrite (`bool`, *optional*, defaults to `False`): replace an existing ``output`` atomically.

    Returns:
        [`CheckpointInfo`]

    Raises:
        CheckpointNotFoundError: not an accelerate FSDP sharded checkpoint.
        UnsafePickleError: a ``.metadata`` names any global but DCP's metadata classes (e.g. ``os.system``), or a
            record anything but tensors and containers; the file is named.
        CorruptCheckpointError: truncated records, or chunks that do not match their metadata.
        UnsupportedStateError: several models/optimizers, or transformed (compressed) records.
        CheckpointExistsError: ``output`` exists and ``overwrite`` is False.
        ValueError: no step is known (pass ``step``), or an unknown ``optimizer``.

    Example:

    ```python
    >>> info = convert_accelerate_fsdp_checkpoint("stock/checkpoint_3", "ours/checkpoint-3")  # doctest: +SKIP
    ```
    """
    # 1. Scan.
    files = AccelerateFsdpFiles.scan(Path(source))
    logger.warning("%s", DCP_PICKLE_WARNING)
    world_size = max(files.random_states, default=-1) + 1
    if world_size < 1 or sorted(files.random_states) != list(range(world_size)):
        raise CheckpointNotFoundError(f"{files.directory}: random_states_<rank>.pkl of ranks "
                                      f"{sorted(files.random_states)}; expected one per rank 0..N-1.")
    # 2. Pieces and layout.
    model = _model_pieces(files, world_size)
    payload_optimizer, document, class_name = (read_dcp_optimizer(files.optimizer, world_size, optimizer)
                                               if files.optimizer is not None else (None, None, None))
    step = step if step is not None else _optimizer_steps(payload_optimizer or [])
    if step is None:
        raise ValueError(f"{files.directory}: stock accelerate does not record the step and the optimizer state does "
                         "not tell it; pass step= (--step).")
    # 3. Shared state, every rank's RNG, commit.
    rngs = {rank: _rng_state(load_torch_pickle(path), path) for rank, path in sorted(files.random_states.items())}
    rng, extra_files = _split_rng(rngs)
    scheduler = _StateHolder(load_torch_pickle(files.scheduler)) if files.scheduler is not None else None
    micro = int(load_torch_pickle(files.random_states[0]).get("step") or 0)
    progress = {"global_step": step, "optimizer_steps": [step], "accelerate_micro_step": micro}
    extra = {**_EXTRA_LAYOUT, "converted_from": "accelerate+FSDP"}
    payload = capture_payload(model=None, optimizer=None, scheduler=scheduler, scaler=None, training_state=progress,
                              extra=extra, extra_files=extra_files, data_state=None, rng=rng,
                              max_shard_size="2GB", processing_class=None, rank=0, is_main=True)
    add_layout(payload, model, payload_optimizer, optimizer_document=document)
    manifest = commit_for_ranks(Path(output), payload, step=step, world_size=world_size, overwrite=overwrite)
    logger.warning(NOT_BIT_EXACT_WARNING + " Resume it with ResumableAccelerator(allow_inexact_resume=True).",
                   files.directory, "accelerate.Accelerator with FSDP", step)
    logger.info("Converted %s (FSDP, %d rank(s), %s) into %s", files.directory, world_size, class_name, output)
    return CheckpointInfo(path=Path(output), step=step, manifest=manifest)
