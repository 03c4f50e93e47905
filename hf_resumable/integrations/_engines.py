"""Which distributed engines ``ResumableAccelerator`` and ``ResumableTrainer`` checkpoint, decided before step 1.

Supported: a single process, DDP (CPU or GPU), and FSDP2 (``fully_shard``: every rank saves and loads its own
DTensor pieces, see :mod:`hf_resumable.checkpoint.sharded`). Refused, with :class:`UnsupportedEngineError`, when the
accelerator is built or ``train()`` starts, never at the first save after training up to it:

* DeepSpeed (any ZeRO stage): the engine owns the optimizer (flat fp32 partitions, its own step hooks and loss
  scaling) and its state is only reachable through DeepSpeed's pickled ``save_checkpoint``. Detected from the
  plugin, ``ACCELERATE_USE_DEEPSPEED`` or ``TrainingArguments.deepspeed``, without importing deepspeed.
* FSDP1 (``FullyShardedDataParallel`` wrappers, any state-dict type): flat parameters whose state dicts need
  FSDP1's collectives in a fixed order; not wired.
* Megatron-LM and XLA FSDP: their own model and optimizer wrappers.

Everything here is pure over the options, the environment and accelerate's state: nothing is imported that the
engine itself needs.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..errors import UnsupportedEngineError

__all__ = ["check_accelerate_options", "check_accelerate_state", "check_trainer_engine", "holds_dtensors"]

# What to use instead, per front door.
_ACCELERATE_FIX = ("Use FSDP2 (FullyShardedDataParallelPlugin(fsdp_version=2)) or DDP with ResumableAccelerator, or "
                   "the stock accelerate.Accelerator for this run")
_TRAINER_FIX = ("Use FSDP2 (TrainingArguments(fsdp=True, fsdp_config={'version': 2})) or DDP with "
                "ResumableTrainer, or the stock transformers.Trainer for this run")
# Why each engine is refused (the checkpoint would not hold the run's full state, or could not be written).
_WHY = {
    "DeepSpeed": "the DeepSpeed engine owns the optimizer (flat fp32 partitions, its own loss scaling), whose state "
                 "only DeepSpeed's pickled save_checkpoint can write",
    "FSDP1": "FSDP1's flat parameters are saved and loaded only through FSDP1's own state-dict collectives, which "
             "hf_resumable does not drive",
    "Megatron-LM": "Megatron-LM wraps the model and optimizer in its own parallel objects",
    "XLA FSDP": "XLA FSDP wraps the model and optimizer in its own sharded objects",
}


def _refuse(engine: str, *, front_door: str, fix: str) -> UnsupportedEngineError:
    family = next(name for name in _WHY if engine.startswith(name))
    return UnsupportedEngineError(
        f"{front_door} cannot checkpoint {engine} runs exactly: {_WHY[family]}. Nothing was trained. {fix}.")


def _is_true(environ: Mapping[str, str], name: str) -> bool:
    return environ.get(name, "false").strip().lower() in ("1", "true", "yes")


def _zero_stage(config: Any) -> int | None:
    """The ZeRO stage of a DeepSpeed config (a dict, a JSON file path or a ``DeepSpeedPlugin``), if it says."""
    stage = getattr(config, "zero_stage", None)
    if stage is None and hasattr(config, "deepspeed_config"):
        config = config.deepspeed_config
    if isinstance(config, (str, os.PathLike)) and Path(config).is_file():
        try:
            config = json.loads(Path(config).read_text())
        except (OSError, ValueError):
            return None
    if stage is None and isinstance(config, Mapping):
        stage = (config.get("zero_optimization") or {}).get("stage")
    return stage if isinstance(stage, int) else None


def _deepspeed(config: Any) -> str:
    stage = _zero_stage(config)
    return "DeepSpeed" if stage is None else f"DeepSpeed ZeRO-{stage}"


def check_accelerate_options(options: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> None:
    """Refuse, from ``Accelerator`` options and the environment alone, engines accelerate would set up in its
    constructor (DeepSpeed, Megatron-LM): before accelerate imports them or builds its state.

    Raises:
        UnsupportedEngineError: a DeepSpeed or Megatron-LM plugin is given or enabled by the environment.
    """
    environ = os.environ if environ is None else environ
    plugin = options.get("deepspeed_plugin") or options.get("deepspeed_plugins")
    if plugin is not None or _is_true(environ, "ACCELERATE_USE_DEEPSPEED"):
        first = next(iter(plugin.values()), None) if isinstance(plugin, Mapping) else plugin
        raise _refuse(_deepspeed(first), front_door="ResumableAccelerator", fix=_ACCELERATE_FIX)
    if options.get("megatron_lm_plugin") is not None or _is_true(environ, "ACCELERATE_USE_MEGATRON_LM"):
        raise _refuse("Megatron-LM", front_door="ResumableAccelerator", fix=_ACCELERATE_FIX)


def _state_engine(state: Any) -> str | None:
    """The refused engine accelerate's state runs, or ``None`` (no engine, DDP, FSDP2)."""
    from accelerate.utils import DistributedType

    kind = getattr(state, "distributed_type", None)
    if kind == DistributedType.DEEPSPEED:
        return _deepspeed(getattr(state, "deepspeed_plugin", None))
    if kind == DistributedType.MEGATRON_LM:
        return "Megatron-LM"
    if kind == DistributedType.FSDP and getattr(getattr(state, "fsdp_plugin", None), "fsdp_version", 1) != 2:
        return "FSDP1"
    return None


def check_accelerate_state(state: Any) -> None:
    """Refuse the engine accelerate's (built) state runs, if it is one hf_resumable does not checkpoint.

    Raises:
        UnsupportedEngineError: DeepSpeed, Megatron-LM or FSDP1.
    """
    engine = _state_engine(state)
    if engine is not None:
        raise _refuse(engine, front_door="ResumableAccelerator", fix=_ACCELERATE_FIX)


def check_trainer_engine(args: Any, state: Any, *, fsdp_xla: bool = False) -> None:
    """Refuse, when ``train()`` starts, a ``Trainer`` engine hf_resumable does not checkpoint.

    Args:
        args (`TrainingArguments`): ``deepspeed`` is read as given (a dict or a JSON path); deepspeed is not imported.
        state (`AcceleratorState`): the trainer's accelerator state.
        fsdp_xla (`bool`, *optional*, defaults to `False`): the Trainer wraps the model with XLA FSDP.

    Raises:
        UnsupportedEngineError: DeepSpeed, FSDP1 or XLA FSDP.
    """
    if getattr(args, "deepspeed", None):
        raise _refuse(_deepspeed(args.deepspeed), front_door="ResumableTrainer", fix=_TRAINER_FIX)
    if fsdp_xla:
        raise _refuse("XLA FSDP", front_door="ResumableTrainer", fix=_TRAINER_FIX)
    engine = _state_engine(state)
    if engine is not None:
        raise _refuse(engine, front_door="ResumableTrainer", fix=_TRAINER_FIX)


def holds_dtensors(model: torch.nn.Module | None) -> bool:
    """Whether ``model``'s parameters are DTensors (FSDP2 ``fully_shard``, tensor parallel): its checkpoint is
    written as per-rank pieces (``save_sharded_checkpoint``) instead of whole tensors."""
    if model is None:
        return False
    from torch.distributed.tensor import DTensor

    return any(isinstance(parameter, DTensor) for parameter in model.parameters())
