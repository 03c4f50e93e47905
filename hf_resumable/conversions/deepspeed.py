"""Switch in from DeepSpeed: a stock ``transformers.Trainer`` + ``deepspeed=`` (ZeRO-1/2) checkpoint into ours.

:func:`convert_deepspeed_checkpoint` writes the per-rank checkpoint ``ResumableTrainer`` (or ``ResumableAccelerator``)
writes at the same data-parallel size: each rank's partitions as its pieces of one flat tensor per param group
(:func:`plan_zero_boxes` and :func:`plan_zero_maps`, pure), the weights, the engine's counters, the scheduler and RNG.
The ``.pt`` pickles are read with ``torch.load(weights_only=True)``, DeepSpeed's objects as inert stand-ins; deepspeed
is never imported. The first resume after the switch is NOT bit-exact:
docs/multi-gpu.md#switching-in-from-stock-deepspeed-or-accelerate-fsdp-checkpoints-and-exporting.

Example:

```python
>>> from hf_resumable.conversions.deepspeed import convert_deepspeed_checkpoint
>>> convert_deepspeed_checkpoint("stock/checkpoint-300", "ours/checkpoint-300")  # doctest: +SKIP
>>> # then: ResumableTrainer(model, TrainingArguments("ours", deepspeed=ds_config), ...).train(
>>> #     resume_from_checkpoint="ours/checkpoint-300")  at the same number of ranks
```
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..checkpoint import CheckpointInfo
from ..checkpoint.pieces import MAP_FLAT, PARTITION_KEY, Box, PartitionMap, capture_payload, flatten_optimizer_state
from ..constants import (
    CONFIG_FILE,
    GENERATION_CONFIG_FILE,
    OPTIMIZER_STATE_PREFIX,
    STOCK_DEEPSPEED_LATEST_FILE,
    STOCK_DEEPSPEED_MODEL_FILE,
    STOCK_DEEPSPEED_OPTIM_RE,
    STOCK_DEEPSPEED_TAG_RE,
)
from ..errors import CheckpointNotFoundError, CorruptCheckpointError, UnsupportedEngineError
from ._commit import commit_for_ranks
from ._layout import RankPiece, add_layout
from ._pickle import DEEPSPEED_GLOBALS, load_torch_pickle
from .stock import TrainerCheckpointFiles, _optimizer_class, _progress, _rng_files, _StateHolder

logger = logging.getLogger(__name__)

__all__ = ["DeepSpeedCheckpointFiles", "is_deepspeed_checkpoint", "plan_zero_boxes", "plan_zero_maps",
           "convert_deepspeed_checkpoint", "NOT_BIT_EXACT_WARNING"]

# The names ResumableTrainer / ResumableAccelerator give DeepSpeed state (integrations/_deepspeed.py, a layer above
# this one: mirrored here, checked equal in tests/test_convert_engines.py).
MASTER_KEY = "fp32"  # the fp32 master-weight partition, next to the base optimizer's own state keys
GROUP_NAME = "zero{world_size}.group{index}"  # a param group's flat partition, named as a parameter would be
EXTRA_DEEPSPEED = "deepspeed_engine"  # extra-state key: the engine's counters and loss scaler
PARAM_ALIGNMENT_PADDINGS = "param_alignment_paddings"  # DeepSpeed's key: per group, the padding after each parameter
DEEPSPEED_PICKLE_WARNING = (
    "Reading the pickle files of a stock DeepSpeed checkpoint (global_step*/*.pt, rng_state*.pth, scheduler.pt) with "
    "torch.load(weights_only=True) (DeepSpeed's loss scaler, stage enum and fragment addresses as inert stand-ins; "
    "deepspeed is not imported). Only convert checkpoints you trust.")
NOT_BIT_EXACT_WARNING = (
    "%s was written by the stock %s: the first resume from its conversion is NOT bit-exact. The stock checkpoint "
    "does not record the data order of its sampler, the data loader's and dropout's random streams at that point as "
    "hf_resumable does, nor the logging accumulators; the resumed run continues from step %s with the same weights, "
    "optimizer state and scheduler (and RNG where the stock run saved it), in hf_resumable's data order. Every "
    "checkpoint the resumed run writes resumes bit for bit.")
# Files of the stock checkpoint never copied: DeepSpeed's tag file and its (executable) recovery scripts.
_NOT_COPIED_SUFFIXES = (".py",)


@dataclass(frozen=True)
class DeepSpeedCheckpointFiles:
    """The DeepSpeed part of a stock Trainer checkpoint: the tag directory and its files."""

    directory: Path  # the Trainer's ``checkpoint-<step>``
    tag: Path  # ``global_step<N>`` inside it
    model_states: Path  # ``mp_rank_00_model_states.pt``
    optim_states: dict[int, Path]  # data-parallel rank -> its optimizer partition file

    @classmethod
    def scan(cls, directory: Path) -> DeepSpeedCheckpointFiles:
        """Find the tag (``latest``, else the only ``global_step*``) and its files.

        Raises:
            CheckpointNotFoundError: no DeepSpeed tag or files.
            UnsupportedEngineError: model-parallel (``mp_rank_01``) or ZeRO-3 files.
        """
        tag = _tag_directory(directory)
        model_states = tag / STOCK_DEEPSPEED_MODEL_FILE
        if not model_states.is_file():
            raise CheckpointNotFoundError(f"{tag}: no {STOCK_DEEPSPEED_MODEL_FILE}; this is not a DeepSpeed "
                                          "ZeRO-1/2 checkpoint.")
        optim: dict[int, Path] = {}
        for path in sorted(tag.iterdir()):
            match = STOCK_DEEPSPEED_OPTIM_RE.match(path.name)
            if match is None:
                if path.name.endswith("_model_states.pt") and path.name != STOCK_DEEPSPEED_MODEL_FILE:
                    raise _unsupported(tag, f"{path.name} (ZeRO-3 or model parallelism)")
                continue
            if match.group(2) != "00":
                raise _unsupported(tag, f"{path.name} (model/tensor parallelism)")
            optim[int(match.group(1))] = path
        if not optim or sorted(optim) != list(range(len(optim))):
            raise CheckpointNotFoundError(f"{tag}: optimizer partitions of ranks {sorted(optim)}; expected one "
                                          "*zero_pp_rank_<r>_mp_rank_00_optim_states.pt per rank 0..N-1.")
        return cls(directory, tag, model_states, optim)


def _unsupported(where: Path, what: str) -> UnsupportedEngineError:
    return UnsupportedEngineError(f"{where}: {what} is not supported; hf_resumable converts DeepSpeed ZeRO-1/2 "
                                  "checkpoints without model or pipeline parallelism.")


def _tag_directory(directory: Path) -> Path:
    latest = directory / STOCK_DEEPSPEED_LATEST_FILE
    if latest.is_file():
        name = latest.read_text(errors="replace").strip()
        if STOCK_DEEPSPEED_TAG_RE.match(name) is None:  # never a path: a tag is global_step<N>
            raise CorruptCheckpointError(f"{latest} names {name[:80]!r}, not a global_step<N> tag.")
        return directory / name
    tags = [p for p in directory.iterdir() if p.is_dir() and STOCK_DEEPSPEED_TAG_RE.match(p.name)]
    if len(tags) != 1:
        raise CheckpointNotFoundError(f"{directory}: no {STOCK_DEEPSPEED_LATEST_FILE} file and "
                                      f"{len(tags)} global_step<N> directories; not a DeepSpeed checkpoint.")
    return tags[0]


def is_deepspeed_checkpoint(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` holds a DeepSpeed tag (``latest`` or a ``global_step<N>/`` with model states)."""
    path = Path(directory)
    if not path.is_dir():
        return False
    if (path / STOCK_DEEPSPEED_LATEST_FILE).is_file():
        return True
    return any(p.is_dir() and STOCK_DEEPSPEED_TAG_RE.match(p.name) and (p / STOCK_DEEPSPEED_MODEL_FILE).is_file()
               for p in path.iterdir())


def plan_zero_boxes(numels: Sequence[Sequence[int]], *, source: str) -> list[list[Box]]:
    """Each rank's box of each param group's global flat tensor, from every rank's partition sizes; pure.

    ZeRO pads every group so that its partitions have the same size on every rank; rank ``r`` holds elements
    ``[r * n, (r + 1) * n)``.

    Args:
        numels (`Sequence[Sequence[int]]`): ``numels[rank][group]``, the partition sizes.
        source (`str`): named in errors.

    Returns:
        `list[list[Box]]`: ``boxes[rank][group]``.

    Raises:
        CorruptCheckpointError: ranks with different group counts or partition sizes.

    Example:

    ```python
    >>> boxes = plan_zero_boxes([[4, 2], [4, 2]], source="x")
    >>> boxes[1]
    [Box(offset=(4,), shape=(4,)), Box(offset=(2,), shape=(2,))]
    ```
    """
    if not numels or any(list(sizes) != list(numels[0]) for sizes in numels):
        raise CorruptCheckpointError(f"{source}: the ranks' fp32 partitions have sizes {[list(s) for s in numels]}; "
                                     "ZeRO partitions of one group have the same size on every rank.")
    return [[Box((rank * n,), (n,)) for n in sizes] for rank, sizes in enumerate(numels)]


def plan_zero_maps(param_shapes: Sequence[Mapping[str, Sequence[int]]], paddings: Sequence[Sequence[int]] | None,
                   sizes: Sequence[int], *, world_size: int, source: str) -> list[PartitionMap]:
    """Each param group's partition map (what a live ZeRO-1/2 save records, :class:`~hf_resumable.checkpoint.
    _partitioned.PartitionMap`) from the stock files; pure.

    DeepSpeed lays a group's parameters end to end in the order its ``param_shapes`` lists them (its round-robin
    order, the order ``zero_to_fp32.py`` reads them back in), each followed by its alignment padding
    (``param_alignment_paddings``, recorded by newer DeepSpeed; none before), and cuts the flat tensor in
    ``sizes[group]`` elements per rank.

    Args:
        param_shapes (`Sequence[Mapping[str, Sequence[int]]]`): per group, ``{parameter name: shape}`` in order
            (``mp_rank_00_model_states.pt``'s ``param_shapes``).
        paddings (`Sequence[Sequence[int]]`, *optional*): per group, the padding after each parameter.
        sizes (`Sequence[int]`): per group, the elements of one rank's partition.
        world_size (`int`): the data-parallel size.
        source (`str`): named in errors.

    Raises:
        CorruptCheckpointError: group counts that differ, or parameters that do not fit in the partitions.

    Example:

    ```python
    >>> maps = plan_zero_maps([{"a": [2, 2], "b": [3]}], [[2, 0]], [5], world_size=2, source="x")
    >>> maps[0].params
    (('a', 4, 0, 4), ('b', 3, 6, 3))
    ```
    """
    paddings = paddings if paddings is not None else [[0] * len(shapes) for shapes in param_shapes]
    if not (len(param_shapes) == len(sizes) == len(paddings)) or any(
            len(group) != len(shapes) for group, shapes in zip(paddings, param_shapes)):
        raise CorruptCheckpointError(
            f"{source}: {len(param_shapes)} group(s) of parameter shapes, {len(paddings)} of paddings and "
            f"{len(sizes)} fp32 partition(s) per rank; a DeepSpeed checkpoint records the same groups in each.")
    maps = []
    for index, (shapes, padding, size) in enumerate(zip(param_shapes, paddings, sizes)):
        params, offset = [], 0
        for (name, shape), pad in zip(shapes.items(), padding):
            numel = math.prod(int(x) for x in shape)
            params.append((str(name), numel, offset, numel))
            offset += numel + int(pad)
        if offset - (int(padding[-1]) if padding else 0) > world_size * size:
            raise CorruptCheckpointError(
                f"{source}: the parameters of group {index} take {offset} elements, more than its {world_size} "
                f"partitions of {size} hold.")
        maps.append(PartitionMap(MAP_FLAT, world_size, int(size), tuple(params)))
    return maps


@dataclass(frozen=True)
class _ZeroRank:
    """What one rank's optimizer file holds, checked."""

    stage: int
    partitions: list[torch.Tensor]
    state: Mapping[int, Mapping[str, Any]]
    param_groups: list[Mapping[str, Any]]
    loss_scaler: Any
    paddings: list[list[int]] | None = None  # per group, the alignment padding after each parameter


def _read_zero_rank(path: Path, world_size: int) -> _ZeroRank:
    saved = load_torch_pickle(path, safe_globals=DEEPSPEED_GLOBALS)
    document = saved.get("optimizer_state_dict") if isinstance(saved, dict) else None
    if not isinstance(document, dict):
        raise CorruptCheckpointError(f"{path}: no optimizer_state_dict; not a DeepSpeed optimizer partition file.")
    if "single_partition_of_fp32_groups" not in document:
        raise _unsupported(path, "this DeepSpeed optimizer (BF16_Optimizer, ZeRO-3 or offload)")
    stage = document.get("zero_stage")
    counts = document.get("partition_count")
    if stage not in (1, 2):
        raise _unsupported(path, f"ZeRO stage {stage!r}")
    if isinstance(counts, list) and any(count != world_size for count in counts):
        raise CorruptCheckpointError(f"{path}: partitioned over {counts} ranks, the checkpoint records "
                                     f"dp_world_size {world_size}.")
    base = document.get("base_optimizer_state") or {}
    paddings = document.get(PARAM_ALIGNMENT_PADDINGS)
    return _ZeroRank(int(stage), list(document["single_partition_of_fp32_groups"]), base.get("state") or {},
                     list(base.get("param_groups") or []), document.get("loss_scaler"),
                     [[int(x) for x in group] for group in paddings] if isinstance(paddings, list) else None)


def _partition_maps(model_states: Mapping[str, Any], ranks: list[_ZeroRank], *, source: str
                    ) -> list[PartitionMap] | None:
    """The partition maps of the stock partitions (:func:`plan_zero_maps`), or ``None`` when the model file records
    no ``param_shapes`` (the converted checkpoint then resumes at its own world size only)."""
    param_shapes = model_states.get("param_shapes")
    if not isinstance(param_shapes, list) or not all(isinstance(group, Mapping) for group in param_shapes):
        logger.warning("%s records no param_shapes: the converted checkpoint records no partition maps, so it resumes "
                       "at its own world size only.", source)
        return None
    return plan_zero_maps(param_shapes, ranks[0].paddings, [flat.numel() for flat in ranks[0].partitions],
                          world_size=len(ranks), source=source)


def _zero_optimizer_pieces(ranks: list[_ZeroRank], class_name: str, maps: list[PartitionMap] | None, *, source: str
                           ) -> tuple[list[list[RankPiece]], dict[str, Any]]:
    """Every rank's optimizer pieces (partitions as boxes of the global flat tensors, other tensors whole from rank
    0) and the optimizer document (with each partition's map, if ``maps``), named as
    :class:`~hf_resumable.integrations._deepspeed.ZeroOptimizerState` names them."""
    world_size = len(ranks)
    boxes = plan_zero_boxes([[p.numel() for p in rank.partitions] for rank in ranks], source=source)
    pieces_by_rank, document = [], None
    for rank, (saved, rank_boxes) in enumerate(zip(ranks, boxes)):
        state, groups, partitioned = {}, [], {}
        for index, (flat, box) in enumerate(zip(saved.partitions, rank_boxes)):
            name = GROUP_NAME.format(world_size=world_size, index=index)
            entries = {MASTER_KEY: flat, **saved.state.get(index, {})}
            if maps is not None:
                entries[PARTITION_KEY] = maps[index].to_json()
            state[name] = entries
            hyper = saved.param_groups[index] if index < len(saved.param_groups) else {}
            groups.append({**{k: v for k, v in hyper.items() if k != "params"}, "params": [name]})
            for key, value in entries.items():
                if torch.is_tensor(value) and value.shape == flat.shape:
                    partitioned[f"{OPTIMIZER_STATE_PREFIX}{name}/{key}"] = (box, world_size * flat.numel())
        tensors, rank_document = flatten_optimizer_state({"state": state, "param_groups": groups}, class_name)
        document = rank_document if document is None else document
        pieces: list[RankPiece] = []
        for tensor_name, tensor in tensors.items():
            if tensor_name in partitioned:
                box, total = partitioned[tensor_name]
                pieces.append((tensor_name, tensor, box, (total,)))
            elif rank == 0:  # the same on every rank (the step count): stored once
                pieces.append((tensor_name, tensor, Box.whole(tensor.shape), tuple(tensor.shape)))
        pieces_by_rank.append(pieces)
    return pieces_by_rank, document


def _model_pieces(module: Mapping[str, torch.Tensor], tied: Mapping[str, str], world_size: int
                  ) -> list[list[RankPiece]]:
    """The weights whole, written by rank 0 (every ZeRO-1/2 rank holds them all), aliases left out."""
    rank0 = [(name, tensor, Box.whole(tensor.shape), tuple(tensor.shape)) for name, tensor in module.items()
             if name not in tied]
    return [rank0] + [[] for _ in range(world_size - 1)]


def _engine_state(model_states: Mapping[str, Any], scaler: Any) -> dict[str, Any]:
    """What :func:`~hf_resumable.integrations._deepspeed.capture_engine_state` records, from the stock files."""
    config = model_states.get("ds_config") or {}
    accumulation = config.get("gradient_accumulation_steps", 1)
    accumulation = accumulation if isinstance(accumulation, int) and accumulation > 0 else 1
    steps = int(model_states.get("global_steps") or 0)
    state: dict[str, Any] = {"global_steps": steps, "global_samples": int(model_states.get("global_samples") or 0),
                             "micro_steps": steps * accumulation,  # at an optimizer-step boundary
                             "skipped_steps": int(model_states.get("skipped_steps") or 0)}
    if scaler is not None:
        state["loss_scaler"] = {k: v for k, v in vars(scaler).items() if type(v) in (bool, int, float)}
    return state


def _optimizer_class_name(ranks: list[_ZeroRank], optimizer: str | None) -> str:
    """The class a live run records: ``DeepSpeedZero<stage>/<torch optimizer>`` (the stock files do not name it)."""
    torch_class = _optimizer_class({"state": ranks[0].state, "param_groups": ranks[0].param_groups}, optimizer)
    return f"DeepSpeedZero{ranks[0].stage}/{torch_class.__qualname__}"


def _scheduler_state(files: TrainerCheckpointFiles, model_states: Mapping[str, Any]) -> _StateHolder | None:
    if files.scheduler is not None:
        return _StateHolder(load_torch_pickle(files.scheduler))
    saved = model_states.get("lr_scheduler")  # the scheduler DeepSpeed stepped (DeepSpeedSchedulerWrapper)
    return _StateHolder(saved) if isinstance(saved, dict) else None


def _copied_files(files: TrainerCheckpointFiles) -> dict[str, bytes]:
    """Config, tokenizer and ``trainer_state.json`` as they are; never DeepSpeed's scripts or tag file."""
    keep = [path for path in files.copied
            if path.name != STOCK_DEEPSPEED_LATEST_FILE and not path.name.endswith(_NOT_COPIED_SUFFIXES)]
    copied = {path.name: path.read_bytes() for path in keep}
    for name in (CONFIG_FILE, GENERATION_CONFIG_FILE):
        if (files.directory / name).is_file():
            copied[name] = (files.directory / name).read_bytes()
    return copied


def convert_deepspeed_checkpoint(
    source: str | os.PathLike,
    output: str | os.PathLike,
    *,
    optimizer: str | None = None,
    overwrite: bool = False,
) -> CheckpointInfo:
    """Convert a stock Trainer + DeepSpeed ZeRO-1/2 checkpoint into an hf_resumable checkpoint for the same ranks.

    1. Scan ``source``: the Trainer's files and DeepSpeed's tag directory.
    2. Log the pickle WARNING, then read DeepSpeed's files with ``torch.load(weights_only=True)``.
    3. Plan each rank's boxes of the global flat tensors (:func:`plan_zero_boxes`) and build every rank's piece
       files, the weights (rank 0) and the layout.
    4. Add the scheduler, engine counters, loss scaler, every rank's RNG, step and epoch, config and tokenizer.
    5. Commit it as written by the data-parallel size's ranks; log that the first resume is not bit-exact.

    Args:
        source (`str` or `os.PathLike`): the stock ``checkpoint-<step>`` (with ``global_step<N>/``).
        output (`str` or `os.PathLike`): the new checkpoint directory.
        optimizer (`str`, *optional*): the torch optimizer under ZeRO, one of ``OPTIMIZERS`` (default: inferred from
            its state, AdamW for Adam moments with decoupled weight decay).
        overwrite (`bool`, *optional*, defaults to `False`): replace an existing ``output`` atomically.

    Returns:
        [`CheckpointInfo`]

    Raises:
        CheckpointNotFoundError: ``source`` is not a Trainer checkpoint with a DeepSpeed tag.
        UnsupportedEngineError: ZeRO-3, model parallelism, or a DeepSpeed optimizer other than ZeRO-1/2's.
        UnsafePickleError: a pickle names anything but tensors, containers and DeepSpeed's known records.
        CorruptCheckpointError: unreadable files, or partitions that do not fit together.
        CheckpointExistsError: ``output`` exists and ``overwrite`` is False.

    Example:

    ```python
    >>> info = convert_deepspeed_checkpoint("stock/checkpoint-300", "ours/checkpoint-300")  # doctest: +SKIP
    >>> info.step  # doctest: +SKIP
    300
    ```
    """
    # 1. Scan.
    files = TrainerCheckpointFiles.scan(Path(source))
    deepspeed = DeepSpeedCheckpointFiles.scan(files.directory)
    # 2. Read (pickles: weights_only, stand-ins for DeepSpeed's records).
    logger.warning("%s", DEEPSPEED_PICKLE_WARNING)
    model_states = load_torch_pickle(deepspeed.model_states, safe_globals=DEEPSPEED_GLOBALS)
    world_size = len(deepspeed.optim_states)
    if model_states.get("dp_world_size", world_size) != world_size:
        raise CorruptCheckpointError(f"{deepspeed.tag}: dp_world_size {model_states.get('dp_world_size')} but "
                                     f"{world_size} optimizer partition files.")
    ranks = [_read_zero_rank(deepspeed.optim_states[rank], world_size) for rank in range(world_size)]
    # 3. Every rank's pieces and the layout.
    payload_model = dict(model_states.get("module") or {})
    tied = {alias: kept for alias, kept in (model_states.get("shared_params") or {}).items() if alias != kept}
    class_name = _optimizer_class_name(ranks, optimizer)
    maps = _partition_maps(model_states, ranks, source=str(deepspeed.model_states))
    optimizer_pieces, document = _zero_optimizer_pieces(ranks, class_name, maps, source=str(deepspeed.tag))
    # 4. The shared state, every rank's RNG.
    rng, rng_files = _rng_files(files)
    progress, extra = _progress(files.trainer_state)
    extra.update({"converted_from": "transformers.Trainer+DeepSpeed",
                  EXTRA_DEEPSPEED: _engine_state(model_states, ranks[0].loss_scaler)})
    step = progress.get("global_step", model_states.get("global_steps"))
    payload = capture_payload(model=None, optimizer=None, scheduler=_scheduler_state(files, model_states),
                              scaler=None, training_state=progress, extra=extra,
                              extra_files={**_copied_files(files), **rng_files}, data_state=None, rng=rng,
                              max_shard_size="2GB", processing_class=None, rank=0, is_main=True)
    add_layout(payload, _model_pieces(payload_model, tied, world_size), optimizer_pieces,
               optimizer_document=document, tied=tied)
    # 5. Commit for world_size ranks.
    manifest = commit_for_ranks(Path(output), payload, step=step, world_size=world_size, overwrite=overwrite)
    logger.warning(NOT_BIT_EXACT_WARNING, files.directory, "transformers.Trainer with DeepSpeed", step)
    logger.info("Converted %s (DeepSpeed ZeRO-%d, %d rank(s), %s) into %s", files.directory, ranks[0].stage,
                world_size, class_name, output)
    return CheckpointInfo(path=Path(output), step=step, manifest=manifest)
