"""Switch in from transformers' distributed checkpoint: ``save_pretrained(dir, distributed_checkpoint=True)``.

Every rank's box of each tensor is planned from the safetensors headers (:func:`plan_hf_storage_pieces`, pure:
offsets checked, global shapes derived, the boxes checked to tile each tensor once); the optimizer that
``save_optimizer_distributed`` wrote is read by :func:`~hf_resumable.conversions.dcp.read_dcp_optimizer`. The result
is a per-rank checkpoint that loads at any world size. The source records no step, scheduler, RNG or data position,
so a resume from it is not bit-exact, see
docs/multi-gpu.md#transformers-distributedconfig-tensor-parallel-and-fsdp2-checkpoints.

Example:

```python
>>> from hf_resumable.conversions.hf_storage import convert_transformers_distributed_checkpoint
>>> convert_transformers_distributed_checkpoint("tp-run/saved", "ours/checkpoint-300")  # doctest: +SKIP
```
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..checkpoint import CheckpointInfo
from ..checkpoint.pieces import Box, capture_payload, intersect_boxes
from ..checkpoint.state import PARAM_SHAPED_STATE
from ..constants import (
    FROZEN_RECORD_FILE,
    LAYOUT_FILE,
    MANIFEST_FILE,
    OPTIMIZER_STATE_PREFIX,
    PICKLE_SUFFIXES,
    STATE_TENSORS_FILE,
    STOCK_DCP_DATA_SUFFIX,
    STOCK_DCP_HF_OFFSETS_KEY,
    STOCK_DCP_HF_OPTIMIZER_DIR,
    STOCK_DCP_HF_SHARD_RE,
    STOCK_DCP_HF_SHARDING_INFO_KEY,
    STOCK_DCP_METADATA_FILE,
    TRAINING_STATE_FILE,
)
from ..errors import CheckpointExistsError, CheckpointMismatchError, CheckpointNotFoundError, CorruptCheckpointError
from ..format.safetensors_io import SafetensorsHeader, read_header, read_safetensors
from ._commit import commit_for_ranks
from ._layout import RankPiece, add_layout
from ._pickle import load_dcp_metadata
from .dcp import _optimizer_steps, plan_dcp_pieces, read_dcp_optimizer
from .deepspeed import NOT_BIT_EXACT_WARNING

logger = logging.getLogger(__name__)

__all__ = ["HF_STORAGE_PICKLE_WARNING", "HfStoragePiece", "TransformersDcpFiles", "plan_hf_storage_pieces",
           "is_transformers_distributed_checkpoint", "convert_transformers_distributed_checkpoint"]

HF_STORAGE_PICKLE_WARNING = (
    "Reading a transformers distributed checkpoint: its safetensors pieces with hf_resumable's validating reader, "
    "its optimizer's .metadata pickle with a restricted unpickler (DCP's metadata classes only) and its records with "
    "torch.load(weights_only=True). Only convert checkpoints you trust.")
CONVERTED_FROM = "transformers distributed checkpoint"
# Files of the source never copied: the checkpoint writes its own (a stale or hostile copy would shadow them).
_WRITTEN_HERE = frozenset({TRAINING_STATE_FILE, STATE_TENSORS_FILE, LAYOUT_FILE, FROZEN_RECORD_FILE})
_WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json")  # whole weights beside the pieces: never copied


@dataclass(frozen=True)
class HfStoragePiece:
    """One rank's box of one tensor, stored whole in one of that rank's safetensors files."""

    name: str  # the tensor's name (the model's state dict key)
    rank: int  # the rank that wrote it (the file's ``shard-<rank + 1>``)
    file: str  # the safetensors file's path
    box: Box  # its box of the global tensor


@dataclass(frozen=True)
class TransformersDcpFiles:
    """The files of a ``save_pretrained(distributed_checkpoint=True)`` directory."""

    directory: Path  # the model directory
    shards: dict[int, list[Path]]  # rank -> its safetensors files
    optimizer: Path | None  # the optimizer's DCP directory
    # the other plain files, carried over as they are (``config.json``, ``generation_config.json``, tokenizer files);
    # never weights or files the checkpoint writes itself
    copied: list[Path]

    @classmethod
    def scan(cls, directory: Path, *, optimizer_dir: Path | None = None) -> TransformersDcpFiles:
        """Find the files; the optimizer in ``optimizer_dir``, else beside the shards or in ``optimizer/``.

        Raises:
            CheckpointNotFoundError: no ``shard-*-model-*.safetensors``, or ``optimizer_dir`` without ``.metadata``.
            CheckpointExistsError: ``directory`` is already an hf_resumable checkpoint.
        """
        if not directory.is_dir():
            raise CheckpointNotFoundError(f"{directory}: no such directory.")
        if (directory / MANIFEST_FILE).exists():
            raise CheckpointExistsError(f"{directory} is already an hf_resumable checkpoint; nothing to convert.")
        shards: dict[int, list[Path]] = {}
        for path in sorted(directory.iterdir()):
            if (match := STOCK_DCP_HF_SHARD_RE.match(path.name)) and int(match.group(1)) > 0:
                shards.setdefault(int(match.group(1)) - 1, []).append(path)
        if not shards:
            raise CheckpointNotFoundError(f"{directory}: no shard-<rank>-model-<k>-of-<n>.safetensors; not a "
                                          "save_pretrained(..., distributed_checkpoint=True) directory.")
        optimizer = _find_optimizer(directory, optimizer_dir)
        consumed = {p for paths in shards.values() for p in paths}
        plain = [p for p in sorted(directory.iterdir()) if p.is_file() and not p.is_symlink() and p not in consumed
                 and not p.name.startswith(".") and not p.name.endswith((*PICKLE_SUFFIXES, STOCK_DCP_DATA_SUFFIX))]
        left = [p.name for p in plain if _is_ours(p.name)]
        if left:
            logger.warning("%s: not carried over: %s (weights or state files the converted checkpoint writes itself).",
                           directory, ", ".join(left))
        return cls(directory, shards, optimizer, [p for p in plain if not _is_ours(p.name)])


def _is_ours(name: str) -> bool:
    """Whether ``name`` is a file the converted checkpoint writes itself, or whole weights beside the pieces."""
    return name in _WRITTEN_HERE or name.endswith(_WEIGHT_SUFFIXES)


def _find_optimizer(directory: Path, optimizer_dir: Path | None) -> Path | None:
    if optimizer_dir is not None:
        if not (optimizer_dir / STOCK_DCP_METADATA_FILE).is_file():
            raise CheckpointNotFoundError(f"{optimizer_dir}: no {STOCK_DCP_METADATA_FILE}; not a directory written by "
                                          "save_optimizer_distributed (torch.distributed.checkpoint).")
        return optimizer_dir
    for candidate in (directory, directory / STOCK_DCP_HF_OPTIMIZER_DIR):
        if (candidate / STOCK_DCP_METADATA_FILE).is_file():
            return candidate
    return None


def is_transformers_distributed_checkpoint(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` holds ``save_pretrained(distributed_checkpoint=True)``'s per-rank safetensors files."""
    path = Path(directory)
    return path.is_dir() and any(STOCK_DCP_HF_SHARD_RE.match(p.name) for p in path.iterdir())


def _offsets(header: SafetensorsHeader) -> dict[str, tuple[int, ...]]:
    """Each tensor's offset in its global tensor, from the header's ``DCP_SHARDING_INFO`` (validated)."""
    raw = header.metadata.get(STOCK_DCP_HF_SHARDING_INFO_KEY)
    try:
        info = json.loads(raw) if raw is not None else None
    except ValueError:
        info = None
    if not isinstance(info, dict):
        raise CorruptCheckpointError(f"{header.path}: no readable {STOCK_DCP_HF_SHARDING_INFO_KEY} in its header "
                                     "metadata; not written by HuggingFaceStorageWriter(save_distributed=True).")
    if set(info) != set(header.tensors):
        raise CorruptCheckpointError(f"{header.path}: {STOCK_DCP_HF_SHARDING_INFO_KEY} describes "
                                     f"{sorted(set(info) ^ set(header.tensors))[:5]}, which the file does not hold "
                                     "(or the reverse).")
    offsets = {}
    for name, entry in info.items():
        offset = entry.get(STOCK_DCP_HF_OFFSETS_KEY) if isinstance(entry, dict) else None
        ndim = len(header.tensors[name].shape)
        if (not isinstance(offset, list) or len(offset) != ndim
                or not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**62 for x in offset)):
            raise CorruptCheckpointError(f"{header.path}: the offset of {name!r} is {offset!r:.80}, not {ndim} "
                                         "non-negative integer(s).")
        offsets[name] = tuple(offset)
    return offsets


def plan_hf_storage_pieces(headers: Mapping[int, Sequence[SafetensorsHeader]], *, source: str
                           ) -> tuple[dict[str, tuple[str, tuple[int, ...]]], list[HfStoragePiece]]:
    """Every tensor's dtype and global shape, and every rank's pieces; pure over the files' validated headers.

    The global shape of a tensor is the end of its furthest piece in each dimension (the file format records no
    more); its pieces must then cover it exactly once, and a rank holds at most one piece of it.

    Args:
        headers (`Mapping[int, Sequence[SafetensorsHeader]]`): rank -> the headers of its files.
        source (`str`): the directory, named in errors.

    Returns:
        `tuple`: ``{name: (safetensors dtype, global shape)}`` and the pieces, rank by rank.

    Raises:
        CorruptCheckpointError: a header without valid offsets; pieces of one tensor with different dtypes or
            dimensions, two pieces of a tensor on one rank, or pieces that overlap or leave a gap.

    Example:

    ```python
    >>> from hf_resumable.format.safetensors_io import SafetensorsHeader, TensorInfo
    >>> def header(path, offset):
    ...     info = {"w": TensorInfo("w", "F32", (2, 3), 0, 24)}
    ...     meta = {"DCP_SHARDING_INFO": '{"w": {"saved_offsets": [%d, 0]}}' % offset}
    ...     return SafetensorsHeader(path, info, meta, 0, 0)
    >>> tensors, pieces = plan_hf_storage_pieces({0: [header("a", 0)], 1: [header("b", 2)]}, source="x")
    >>> tensors, [(p.rank, p.box.offset) for p in pieces]
    ({'w': ('F32', (4, 3))}, [(0, (0, 0)), (1, (2, 0))])
    ```
    """
    pieces: list[HfStoragePiece] = []
    dtypes: dict[str, str] = {}
    for rank in sorted(headers):
        for header in headers[rank]:
            for name, offset in _offsets(header).items():
                info = header.tensors[name]
                if dtypes.setdefault(name, info.dtype) != info.dtype:
                    raise CorruptCheckpointError(f"{header.path}: {name!r} is {info.dtype} here and "
                                                 f"{dtypes[name]} in another rank's file.")
                pieces.append(HfStoragePiece(name, rank, header.path, Box(offset, tuple(info.shape))))
    by_name: dict[str, list[HfStoragePiece]] = {}
    for piece in pieces:
        by_name.setdefault(piece.name, []).append(piece)
    tensors = {name: (dtypes[name], _global_shape(name, found, source=source)) for name, found in by_name.items()}
    for name, found in by_name.items():
        _check_tiling(name, found, tensors[name][1], source=source)
    return tensors, pieces


def _global_shape(name: str, pieces: Sequence[HfStoragePiece], *, source: str) -> tuple[int, ...]:
    if len({len(p.box.shape) for p in pieces}) != 1:
        raise CorruptCheckpointError(f"{source}: the pieces of {name!r} have different numbers of dimensions "
                                     f"({', '.join(sorted({p.file for p in pieces}))}).")
    return tuple(max(p.box.offset[d] + p.box.shape[d] for p in pieces) for d in range(len(pieces[0].box.shape)))


def _check_tiling(name: str, pieces: Sequence[HfStoragePiece], shape: tuple[int, ...], *, source: str) -> None:
    """The pieces of ``name`` cover its ``shape`` exactly once, each rank holding at most one."""
    ranks = [p.rank for p in pieces]
    if len(set(ranks)) != len(ranks):
        twice = sorted({p.file for p in pieces if ranks.count(p.rank) > 1})
        raise CorruptCheckpointError(f"{source}: {name!r} has two pieces on one rank ({', '.join(twice)}).")
    solid = [p for p in pieces if p.box.numel]
    overlap = next(((a, b) for i, a in enumerate(solid) for b in solid[i + 1:] if intersect_boxes(a.box, b.box)),
                   None)
    if overlap is not None:
        raise CorruptCheckpointError(f"{source}: pieces of {name!r} overlap ({overlap[0].file} at "
                                     f"{list(overlap[0].box.offset)}, {overlap[1].file} at "
                                     f"{list(overlap[1].box.offset)}).")
    if sum(p.box.numel for p in solid) != math.prod(shape):
        raise CorruptCheckpointError(f"{source}: the pieces of {name!r} leave part of its {list(shape)} elements "
                                     f"uncovered ({', '.join(sorted({p.file for p in pieces}))}); a rank's file is "
                                     "missing or was not written by this save.")


def _model_pieces(files: TransformersDcpFiles, world_size: int
                  ) -> tuple[list[list[RankPiece]], dict[str, tuple[int, ...]]]:
    headers = {rank: [read_header(path) for path in paths] for rank, paths in files.shards.items()}
    tensors, planned = plan_hf_storage_pieces(headers, source=str(files.directory))
    read: dict[str, dict[str, Any]] = {}
    for rank, rank_headers in headers.items():
        for header in rank_headers:
            read[header.path] = read_safetensors(header.path, header=header)
    pieces: list[list[RankPiece]] = [[] for _ in range(world_size)]
    for piece in planned:
        pieces[piece.rank].append((piece.name, read[piece.file][piece.name], piece.box, tensors[piece.name][1]))
    return pieces, {name: shape for name, (_, shape) in tensors.items()}


def _check_optimizer_fits(pieces: Sequence[Sequence[RankPiece]], document: Mapping[str, Any],
                          shapes: Mapping[str, tuple[int, ...]], *, source: Path) -> None:
    """The optimizer's parameters are the model's, and its moments have their parameters' shapes."""
    wrong = [name for group in document["param_groups"] for name in group["params"] if name not in shapes]
    for rank in pieces:
        for stored, _, _, shape in rank:
            fqn, _, key = stored[len(OPTIMIZER_STATE_PREFIX):].rpartition("/")
            if fqn not in shapes or (key in PARAM_SHAPED_STATE and shape != shapes[fqn]):
                wrong.append(stored)
    if wrong:
        raise CheckpointMismatchError(f"{source}: optimizer state that does not fit the model's weights "
                                      f"({sorted(set(wrong))[:5]}); pass the optimizer directory saved with this "
                                      "model (--optimizer-dir).")


def _world_size(files: TransformersDcpFiles, optimizer_metadata: Any) -> int:
    ranks = set(files.shards)
    if optimizer_metadata is not None:
        path = files.optimizer / STOCK_DCP_METADATA_FILE
        ranks |= {chunk.rank for chunk in plan_dcp_pieces(optimizer_metadata, source=str(path))[1]}
    return max(ranks) + 1


def convert_transformers_distributed_checkpoint(
    source: str | os.PathLike,
    output: str | os.PathLike,
    *,
    optimizer_dir: str | os.PathLike | None = None,
    step: int | None = None,
    optimizer: str | None = None,
    overwrite: bool = False,
) -> CheckpointInfo:
    """Convert a ``save_pretrained(distributed_checkpoint=True)`` directory and its optimizer into a per-rank
    hf_resumable checkpoint.

    1. Scan ``source``; log the pickle WARNING when an optimizer is converted.
    2. Plan every rank's pieces from the safetensors headers (:func:`plan_hf_storage_pieces`), read them; read the
       optimizer with :func:`~hf_resumable.conversions.dcp.read_dcp_optimizer` and check it fits the weights.
    3. Commit, for the ranks that wrote it, the layout, the pieces, ``config.json`` and the other plain files, and
       the step; log that a resume from it is not bit-exact.

    Args:
        source (`str` or `os.PathLike`): the ``save_pretrained(..., distributed_checkpoint=True)`` directory.
        output (`str` or `os.PathLike`): the new checkpoint directory.
        optimizer_dir (`str` or `os.PathLike`, *optional*): the directory given to ``save_optimizer_distributed``
            (default: ``source`` itself or ``source/optimizer``, if either holds a ``.metadata``; else no optimizer).
        step (`int`, *optional*): the optimizer steps taken (default: the optimizer state's ``step``).
        optimizer (`str`, *optional*): one of ``OPTIMIZERS`` (default: inferred from the state).
        overwrite (`bool`, *optional*, defaults to `False`): replace an existing checkpoint of ours at ``output``
            atomically.

    Returns:
        [`CheckpointInfo`]

    Raises:
        CheckpointNotFoundError: no per-rank safetensors files in ``source``, or no ``.metadata`` in
            ``optimizer_dir``.
        CorruptCheckpointError: a truncated or malformed safetensors file, offsets missing or out of place, pieces
            that overlap or leave a gap (the file is named); a DCP record unlike its metadata.
        UnsafePickleError: the optimizer's ``.metadata`` names any global but DCP's metadata classes, or a record
            anything but tensors and containers; the file is named.
        CheckpointMismatchError: optimizer state of parameters the model does not have, or of other shapes.
        CheckpointExistsError: ``output`` exists and ``overwrite`` is False (or it is not ours); ``source`` is
            already an hf_resumable checkpoint.
        ValueError: no step is known (pass ``step``), or an unknown ``optimizer``.

    Example:

    ```python
    >>> info = convert_transformers_distributed_checkpoint("run/saved", "ours/checkpoint-300")  # doctest: +SKIP
    >>> info.manifest.world_size  # doctest: +SKIP
    2
    ```
    """
    # 1. Scan.
    files = TransformersDcpFiles.scan(Path(source), optimizer_dir=Path(optimizer_dir) if optimizer_dir else None)
    metadata = None
    if files.optimizer is not None:
        logger.warning("%s", HF_STORAGE_PICKLE_WARNING)
        metadata = load_dcp_metadata(files.optimizer / STOCK_DCP_METADATA_FILE)
    else:
        logger.warning("%s: no optimizer directory (a .metadata beside the shards or in %s/); converting the weights "
                       "only. Pass optimizer_dir= (--optimizer-dir) for the one save_optimizer_distributed wrote.",
                       files.directory, STOCK_DCP_HF_OPTIMIZER_DIR)
    world_size = _world_size(files, metadata)
    # 2. Pieces: the weights, then the optimizer, checked against the weights.
    model, shapes = _model_pieces(files, world_size)
    optimizer_pieces, document = None, None
    if files.optimizer is not None:
        optimizer_pieces, document, _ = read_dcp_optimizer(files.optimizer, world_size, optimizer, metadata=metadata)
        _check_optimizer_fits(optimizer_pieces, document, shapes, source=files.optimizer)
    step = step if step is not None else _optimizer_steps(optimizer_pieces or [])
    if step is None:
        raise ValueError(f"{files.directory}: a distributed checkpoint does not record the step and no optimizer "
                         "state tells it; pass step= (--step).")
    # 3. Layout, plain files, commit.
    payload = capture_payload(model=None, optimizer=None, scheduler=None, scaler=None,
                              training_state={"global_step": step}, extra={"converted_from": CONVERTED_FROM},
                              extra_files={p.name: p.read_bytes() for p in files.copied}, data_state=None, rng=False,
                              max_shard_size="2GB", processing_class=None, rank=0, is_main=True)
    add_layout(payload, model, optimizer_pieces, optimizer_document=document)
    manifest = commit_for_ranks(Path(output), payload, step=step, world_size=world_size, overwrite=overwrite)
    logger.warning(NOT_BIT_EXACT_WARNING + " Load it with allow_inexact_resume=True.", files.directory,
                   "transformers' save_pretrained(distributed_checkpoint=True)", step)
    logger.info("Converted %s (%d rank(s), %d tensors) into %s", files.directory, world_size, len(shapes), output)
    return CheckpointInfo(path=Path(output), step=step, manifest=manifest)
