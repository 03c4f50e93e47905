"""Convert a stock ``transformers.Trainer`` checkpoint into the hf_resumable format, and reshard checkpoints.

> [!WARNING]
> A stock Trainer checkpoint stores optimizer, scheduler, scaler and RNG state with pickle. They are read with
> ``torch.load(weights_only=True)`` only, after a WARNING; convert only checkpoints you trust. The converted
> checkpoint contains no pickle.

The index-keyed optimizer state is stored by parameter name over the groups ``Trainer.create_optimizer`` builds (the
Trainer's weight-decay rule, copied here and checked against the Trainer's own in ``tests/test_conversions.py``);
the Trainer is never imported. See docs/trainer.md#switching-from-the-stock-trainer.

Example:

```python
>>> from hf_resumable.conversions.stock import convert_trainer_checkpoint, reshard_checkpoint
>>> convert_trainer_checkpoint("out/checkpoint-500", "converted/checkpoint-500")  # doctest: +SKIP
>>> reshard_checkpoint("converted/checkpoint-500", max_shard_size="200MB", output="resharded/checkpoint-500")
... # doctest: +SKIP
```
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..checkpoint import CheckpointInfo, open_checkpoint, save_checkpoint
from ..constants import (
    ADAPTER_WEIGHTS_FILE,
    CONFIG_FILE,
    DEFAULT_MAX_SHARD_SIZE,
    GENERATION_CONFIG_FILE,
    MANIFEST_FILE,
    MODEL_INDEX_FILE,
    PICKLE_SUFFIXES,
    RNG_DIR,
    RNG_FILE_PATTERN,
    SINGLE_MODEL_FILE,
    STOCK_OPTIMIZER_FILE,
    STOCK_RNG_FILE,
    STOCK_RNG_FILE_GLOB,
    STOCK_SCALER_FILE,
    STOCK_SCHEDULER_FILE,
    TRAINER_STATE_FILE,
)
from ..errors import (
    CheckpointExistsError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
)
from ..format.rng import RngState, save_rng_state
from ..format.sharding import parse_size
from ._pickle import load_torch_pickle

logger = logging.getLogger(__name__)

__all__ = ["PICKLE_WARNING", "OPTIMIZERS", "TrainerCheckpointFiles", "convert_trainer_checkpoint",
           "reshard_checkpoint"]

PICKLE_WARNING = ("Reading pickle files (optimizer.pt, scheduler.pt, scaler.pt, rng_state*.pth) of a stock Trainer "
                  "checkpoint with torch.load(weights_only=True). Only convert checkpoints you trust.")
# Optimizer classes the converter can rebuild, by command-line name.
OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "adamw": torch.optim.AdamW,
    "adam": torch.optim.Adam,
    "sgd": torch.optim.SGD,
    "adagrad": torch.optim.Adagrad,
    "rmsprop": torch.optim.RMSprop,
}
# Files of a stock checkpoint that the conversion consumes (everything else small is copied as is).
_STOCK_WEIGHTS = (SINGLE_MODEL_FILE, MODEL_INDEX_FILE)
_ADAPTER_WEIGHTS = ADAPTER_WEIGHTS_FILE  # a PEFT model's checkpoint (converted only with model=)
_REGENERATED = (CONFIG_FILE, GENERATION_CONFIG_FILE)
# Parameter names the Trainer excludes from weight decay (transformers 5: ``Trainer.get_decay_parameter_names``),
# matched against the lower-cased name. Parameters inside an ``nn.LayerNorm`` are excluded too.
_NO_DECAY_NAME = re.compile(r"bias|layernorm|rmsnorm|(?:^|\.)norm(?:$|\.)|_norm(?:$|\.)")


@dataclass(frozen=True)
class TrainerCheckpointFiles:
    """The files found in a stock Trainer checkpoint directory."""

    directory: Path
    optimizer: Path | None
    scheduler: Path | None
    scaler: Path | None
    rng: dict[int, Path]
    trainer_state: dict[str, Any]
    copied: list[Path]

    @property
    def has_pickles(self) -> bool:
        """Whether converting reads any pickle file."""
        return any((self.optimizer, self.scheduler, self.scaler, self.rng))

    @classmethod
    def scan(cls, directory: Path, *, need_config: bool = True) -> TrainerCheckpointFiles:
        """Find the files; raise if there is no config (when ``need_config``) or no safetensors weights."""
        if not directory.is_dir():
            raise CheckpointNotFoundError(f"{directory}: no such directory.")
        if need_config and not (directory / CONFIG_FILE).is_file():
            raise CheckpointNotFoundError(f"{directory}: no {CONFIG_FILE}; this is not a transformers checkpoint.")
        weights = _STOCK_WEIGHTS if need_config else _STOCK_WEIGHTS + (_ADAPTER_WEIGHTS,)
        if not any((directory / name).is_file() for name in weights):
            raise CheckpointNotFoundError(f"{directory}: no {SINGLE_MODEL_FILE} or {MODEL_INDEX_FILE}; only "
                                          "safetensors weights are converted (save with save_safetensors=True).")
        if (directory / MANIFEST_FILE).exists():
            raise CheckpointExistsError(f"{directory} is already an hf_resumable checkpoint; nothing to convert.")

        def optional(name: str) -> Path | None:
            return directory / name if (directory / name).is_file() else None

        rng = {0: directory / STOCK_RNG_FILE} if (directory / STOCK_RNG_FILE).is_file() else {}
        for path in directory.glob(STOCK_RNG_FILE_GLOB):
            rng[int(path.stem.rsplit("_", 1)[1])] = path
        state = json.loads((directory / TRAINER_STATE_FILE).read_text()) if optional(TRAINER_STATE_FILE) else {}
        copied = [p for p in sorted(directory.iterdir()) if p.is_file() and not p.name.endswith(PICKLE_SUFFIXES)
                  and p.name not in _REGENERATED and p.name != _ADAPTER_WEIGHTS
                  and not (p.name.startswith("model") and ".safetensors" in p.name)]
        return cls(directory, optional(STOCK_OPTIMIZER_FILE), optional(STOCK_SCHEDULER_FILE),
                   optional(STOCK_SCALER_FILE), rng, state, copied)


class _StateHolder:
    """Carries a loaded ``state_dict`` into ``save_checkpoint`` without rebuilding the original object."""

    def __init__(self, state: dict[str, Any]) -> None:
        self._state = state

    def state_dict(self) -> dict[str, Any]:
        return self._state


def _build_model(directory: Path) -> torch.nn.Module:
    from transformers import AutoModel, AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(directory)
    except ValueError:  # not a causal LM architecture: fall back to the base model class
        return AutoModel.from_pretrained(directory)


def _infer_optimizer(saved: Mapping[str, Any]) -> str:
    keys = {k for per_param in saved.get("state", {}).values() for k in per_param}
    group = (saved.get("param_groups") or [{}])[0]
    if "exp_avg" in keys or "exp_avg_sq" in keys:
        return "adam" if group.get("decoupled_weight_decay") is False else "adamw"
    for key, name in (("momentum_buffer", "sgd"), ("sum", "adagrad"), ("square_avg", "rmsprop")):
        if key in keys:
            return name
    return "adamw"


def _optimizer_class(saved: Mapping[str, Any], name: str | None) -> Callable[..., torch.optim.Optimizer]:
    """The class of ``OPTIMIZERS`` called ``name``, else the one ``saved``'s state points to.

    Raises:
        ValueError: an unknown ``name``.
    """
    name = (name or _infer_optimizer(saved)).lower()
    if name not in OPTIMIZERS:
        raise ValueError(f"Unknown optimizer {name!r}; choose one of {sorted(OPTIMIZERS)}.")
    return OPTIMIZERS[name]


def _decay_parameter_names(model: torch.nn.Module) -> set[str]:
    """The names ``Trainer.get_decay_parameter_names`` gives: every parameter not inside an ``nn.LayerNorm`` (below
    ``model`` itself) and whose lower-cased name does not match ``_NO_DECAY_NAME``; children in
    ``named_children()`` order, as the Trainer walks them (a module registered twice counts under its first name)."""
    names = [name for name, _ in model.named_parameters(recurse=False, remove_duplicate=False)]
    for child_name, child in model.named_children():
        if not isinstance(child, torch.nn.LayerNorm):
            names += [f"{child_name}.{name}" for name in _decay_parameter_names(child)]
    return {name for name in names if not _NO_DECAY_NAME.search(name.lower())}


def _trainer_param_groups(model: torch.nn.Module, saved: dict[str, Any]) -> list[list[torch.nn.Parameter]]:
    """Parameters per group in the order ``Trainer.create_optimizer`` used, checked against the saved sizes."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decay = _decay_parameter_names(model)
    trainer_groups = [[p for n, p in named if n in decay], [p for n, p in named if n not in decay]]
    sizes = [len(g["params"]) for g in saved["param_groups"]]
    if sizes == [len(g) for g in trainer_groups]:
        return trainer_groups
    if sizes == [len(named)]:
        return [[p for _, p in named]]
    raise CheckpointMismatchError(
        f"optimizer.pt has param groups of sizes {sizes}, but the model gives {[len(g) for g in trainer_groups]} "
        "(Trainer's decay/no-decay split) or [{len(named)}] (one group); the optimizer was not built by the stock "
        "Trainer from this model, so its state cannot be mapped to parameter names."
    )


def _rebuild_optimizer(model: torch.nn.Module, path: Path, optimizer_name: str | None) -> torch.optim.Optimizer:
    saved = load_torch_pickle(path)
    groups = _trainer_param_groups(model, saved)
    optimizer = _optimizer_class(saved, optimizer_name)([{"params": g} for g in groups])
    optimizer.load_state_dict(saved)  # also restores every group's hyper-parameters (lr, betas, weight decay...)
    logger.info("Rebuilt %s over %d parameter group(s) from %s", type(optimizer).__name__, len(groups), path)
    return optimizer


def _rng_state(document: dict[str, Any]) -> RngState:
    cuda = document.get("cuda")
    if isinstance(cuda, torch.Tensor):
        cuda = [cuda]
    return RngState(python=tuple(document["python"]), numpy=tuple(document["numpy"]), torch_cpu=document["cpu"],
                    cuda=list(cuda or []))


def _rng_bytes(state: RngState) -> bytes:
    """The bytes of ``rng/rank-<r>.safetensors`` for ``state`` (another rank's RNG, written by this process)."""
    with tempfile.TemporaryDirectory() as tmp:
        save_rng_state(Path(tmp) / "rng.safetensors", state, fsync=False)
        return (Path(tmp) / "rng.safetensors").read_bytes()


def _split_rng(states: Mapping[int, RngState]) -> tuple[RngState | bool, dict[str, bytes]]:
    """Rank 0's RNG (for ``rng=``, ``False`` without one) and every other rank's RNG file as bytes (for
    ``extra_files``)."""
    others = {f"{RNG_DIR}/{RNG_FILE_PATTERN.format(rank=rank)}": _rng_bytes(state)
              for rank, state in sorted(states.items()) if rank != 0}
    return states.get(0, False), others


def _rng_files(files: TrainerCheckpointFiles) -> tuple[RngState | bool, dict[str, bytes]]:
    """:func:`_split_rng` of the stock checkpoint's per-rank RNG files."""
    states = {rank: _rng_state(load_torch_pickle(path)) for rank, path in files.rng.items()}
    if 0 not in states:
        logger.warning("%s has no rng_state.pth; the converted checkpoint has no RNG state and resuming from it "
                       "will need allow_inexact_resume=True.", files.directory)
    return _split_rng(states)


def _progress(trainer_state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    progress = {k: trainer_state[k] for k in ("global_step", "epoch", "num_input_tokens_seen")
                if trainer_state.get(k) is not None}
    extra = {"converted_from": "transformers.Trainer", "trainer_state": trainer_state}
    if trainer_state.get("train_batch_size") is not None:
        extra["train_batch_size"] = trainer_state["train_batch_size"]
    return progress, extra


def convert_trainer_checkpoint(
    source: str | os.PathLike,
    output: str | os.PathLike,
    *,
    optimizer: str | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    overwrite: bool = False,
    model: torch.nn.Module | None = None,
) -> CheckpointInfo:
    """Convert a stock ``transformers.Trainer`` checkpoint directory into an hf_resumable checkpoint.

    1. Scan ``source`` (config, safetensors weights, ``optimizer.pt``, ``scheduler.pt``, ``scaler.pt``,
       ``rng_state*.pth``, ``trainer_state.json``, tokenizer files).
    2. Build the model with ``from_pretrained(source)`` (weights exactly as saved), unless ``model`` is given.
    3. Log a WARNING, then read the pickles with ``torch.load(weights_only=True)``.
    4. Rebuild the optimizer over the Trainer's parameter groups and load its state.
    5. ``save_checkpoint`` everything, pickle-free, with the step and epoch of ``trainer_state.json``.

    Args:
        source (`str` or `os.PathLike`): the stock checkpoint, e.g. ``out/checkpoint-500``.
        output (`str` or `os.PathLike`): the new checkpoint directory.
        optimizer (`str`, *optional*): one of ``OPTIMIZERS`` (default: inferred from the state, else AdamW).
        max_shard_size (`int` or `str`, *optional*, defaults to `"2GB"`): shard size of the new checkpoint.
        overwrite (`bool`, *optional*, defaults to `False`): replace an existing ``output`` atomically.
        model (`torch.nn.Module`, *optional*): a model that already holds the checkpoint's weights (e.g. loaded by
            ``Trainer._load_from_checkpoint``), used instead of ``from_pretrained(source)``; this converts any
            model class and PEFT adapter checkpoints (no ``config.json``). The optimizer state is mapped onto its
            trainable parameters.

    Returns:
        [`CheckpointInfo`]

    Raises:
        CheckpointNotFoundError: if ``source`` is not a transformers checkpoint with safetensors weights.
        CheckpointExistsError: if ``source`` is already converted, or ``output`` exists without ``overwrite``.
        CheckpointMismatchError: if the optimizer state does not fit the model's parameter groups.
        ValueError: for an unknown ``optimizer`` name or a bad ``max_shard_size``.
        UnsafePickleError: (also a ``pickle.UnpicklingError``) if a pickle holds anything ``weights_only=True``
            refuses; CorruptCheckpointError if it is not a readable ``torch.save`` file.

    Example:

    ```python
    >>> info = convert_trainer_checkpoint("out/checkpoint-500", "converted/checkpoint-500")  # doctest: +SKIP
    >>> load_checkpoint(info.path, model=model, optimizer=optimizer, scheduler=scheduler).step  # doctest: +SKIP
    500
    ```
    """
    files = TrainerCheckpointFiles.scan(Path(source), need_config=model is None)
    parse_size(max_shard_size)
    if model is None:
        model = _build_model(files.directory)
    if files.has_pickles:
        logger.warning("%s", PICKLE_WARNING)
    opt = _rebuild_optimizer(model, files.optimizer, optimizer) if files.optimizer else None
    scheduler = _StateHolder(load_torch_pickle(files.scheduler)) if files.scheduler else None
    scaler = _StateHolder(load_torch_pickle(files.scaler)) if files.scaler else None
    rng, rng_files = _rng_files(files)
    progress, extra = _progress(files.trainer_state)
    extra_files = {path.name: path.read_bytes() for path in files.copied}
    extra_files.update(rng_files)
    return save_checkpoint(output, model=model, optimizer=opt, scheduler=scheduler, scaler=scaler,
                           step=progress.get("global_step"), training_state=progress, extra=extra,
                           extra_files=extra_files, rng=rng, max_shard_size=max_shard_size, overwrite=overwrite)


def reshard_checkpoint(
    directory: str | os.PathLike,
    *,
    max_shard_size: int | str,
    output: str | os.PathLike | None = None,
) -> Path:
    """Rewrite the model and optimizer shards of a checkpoint with a new ``max_shard_size``.

    Every tensor keeps its name, dtype and bytes; every other file (training state, RNG, data
    positions, config, tokenizer) is carried over unchanged; a new manifest is written last. Weights that fit in
    one shard of the new size come out as one ``model.safetensors`` (no index), as every save writes them; a
    checkpoint of per-rank pieces saved by one process comes out in that regular layout too. Without
    ``output`` the checkpoint is replaced atomically in place (the old one stays valid until the new
    one is committed).

    Args:
        directory (`str` or `os.PathLike`): a committed checkpoint (verified in full first).
        max_shard_size (`int` or `str`): the new shard size limit, e.g. ``"500MB"``.
        output (`str` or `os.PathLike`, *optional*): write the result here instead of in place.

    Returns:
        `Path`: the resharded checkpoint.

    Raises:
        IncompleteCheckpointError / CorruptCheckpointError: if the checkpoint does not verify.
        CheckpointExistsError: if ``output`` exists.
        ValueError: if ``max_shard_size`` cannot be parsed, or the checkpoint was written by several ranks.
        BaseNotStoredError: a checkpoint of pieces that records its frozen base instead of storing it.

    Example:

    ```python
    >>> reshard_checkpoint("out/checkpoint-100", max_shard_size="50MB")  # doctest: +SKIP
    PosixPath('out/checkpoint-100')
    ```
    """
    from ..checkpoint.pieces import write_whole

    source = Path(directory)
    parse_size(max_shard_size)
    opened = open_checkpoint(source, verify="full")
    if opened.manifest.world_size != 1:
        raise ValueError(f"{source} was written by {opened.manifest.world_size} ranks: write it whole first "
                         "with hf_resumable.checkpoint.consolidate_checkpoint, then reshard that copy.")
    target = Path(output) if output is not None else source
    write_whole(opened, target, max_shard_size=max_shard_size, include_optimizer=True,
                overwrite=target.resolve() == source.resolve())
    return target
