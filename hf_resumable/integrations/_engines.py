"""Which distributed engines ``ResumableAccelerator`` and ``ResumableTrainer`` checkpoint, decided before step 1.

Supported: a single process, DDP, FSDP2, FSDP1 (FULL_SHARD / SHARD_GRAD_OP, any ``state_dict_type``) and DeepSpeed
ZeRO-1/2/3 without offload; the others are refused with :class:`UnsupportedEngineError` when the accelerator is built
or ``train()`` starts (docs/multi-gpu.md, "What does not work yet"). Pure over the options, the environment and
accelerate's state: nothing is imported that the engine itself needs.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..errors import UnsupportedEngineError

__all__ = ["check_accelerate_options", "check_accelerate_state", "check_trainer_engine", "holds_dtensors",
           "is_fsdp1", "checkpoint_model", "refuse_engine", "DEEPSPEED_STAGES"]

# What to use instead, per front door.
_ACCELERATE_FIX = ("Use DeepSpeed ZeRO-1/2/3 without offload, FSDP2 (FullyShardedDataParallelPlugin(fsdp_version=2)), "
                   "FSDP1 with FULL_SHARD or SHARD_GRAD_OP, or DDP with ResumableAccelerator, or the stock "
                   "accelerate.Accelerator for this run")
_TRAINER_FIX = ("Use DeepSpeed ZeRO-1/2/3 without offload, FSDP2 (TrainingArguments(fsdp=True, fsdp_config="
                "{'version': 2})), FSDP1 with FULL_SHARD or SHARD_GRAD_OP, or DDP with ResumableTrainer, or the stock "
                "transformers.Trainer for this run")
# Why each engine is refused (the checkpoint would not hold the run's full state, or could not be written).
_WHY = {
    "DeepSpeed ZeRO-Offload": "the optimizer offloaded to the CPU or NVMe (DeepSpeedCPUAdam) has not been tested",
    "DeepSpeed": "DeepSpeed's other optimizers (BF16_Optimizer, FP16_Optimizer) and ZeRO stages other than 1, 2 "
                 "and 3 keep their own state; hf_resumable saves the ZeRO-1/2/3 optimizers' partitions only",
    "FSDP1": "a hybrid sharding strategy replicates FSDP1's shards over groups of ranks, whose identical pieces "
             "hf_resumable does not store once (FULL_SHARD and SHARD_GRAD_OP are supported)",
    "Megatron-LM": "Megatron-LM wraps the model and optimizer in its own parallel objects",
    "XLA FSDP": "XLA FSDP wraps the model and optimizer in its own sharded objects",
}
DEEPSPEED_STAGES = (1, 2, 3)  # ZeRO stages whose state hf_resumable saves
_OFFLOAD_KEYS = ("offload_optimizer", "offload_param")


def refuse_engine(engine: str, *, front_door: str, fix: str) -> UnsupportedEngineError:
    """The error refusing ``engine`` (a name starting with one of the families of ``_WHY``), before step 1."""
    family = next(name for name in _WHY if engine.startswith(name))
    return UnsupportedEngineError(
        f"{front_door} cannot checkpoint {engine} runs exactly: {_WHY[family]}. Nothing was trained. {fix}.")


def _is_true(environ: Mapping[str, str], name: str) -> bool:
    return environ.get(name, "false").strip().lower() in ("1", "true", "yes")


def _zero_section(config: Any) -> Mapping[str, Any]:
    """The ``zero_optimization`` section of a DeepSpeed config (a dict, a JSON file path or a ``DeepSpeedPlugin``)."""
    config = getattr(config, "deepspeed_config", config)
    if isinstance(config, (str, os.PathLike)) and Path(config).is_file():
        try:
            config = json.loads(Path(config).read_text())
        except (OSError, ValueError):
            return {}
    section = config.get("zero_optimization") if isinstance(config, Mapping) else None
    return section if isinstance(section, Mapping) else {}


def _zero_stage(config: Any, environ: Mapping[str, str]) -> int | None:
    """The ZeRO stage of a DeepSpeed config, or of accelerate's environment (``ACCELERATE_DEEPSPEED_ZERO_STAGE``,
    accelerate's default 2) for a plugin built from it, if it says."""
    stage = getattr(config, "zero_stage", None)
    if stage is None:
        stage = _zero_section(config).get("stage")
    if stage is None and config is None:
        stage = environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2")
    try:
        return int(stage)
    except (TypeError, ValueError):
        return None


def _offloads(config: Any, environ: Mapping[str, str]) -> bool:
    section = _zero_section(config)
    devices = [section[key].get("device") for key in _OFFLOAD_KEYS if isinstance(section.get(key), Mapping)]
    if config is None:
        devices += [environ.get("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE"),
                    environ.get("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE")]
    return any(device in ("cpu", "nvme") for device in devices)


def _refused_deepspeed(config: Any, environ: Mapping[str, str] | None = None) -> str | None:
    """The DeepSpeed set-up ``config`` runs, if hf_resumable refuses it (an unknown stage is decided later, from the
    built state)."""
    environ = os.environ if environ is None else environ
    stage = _zero_stage(config, environ)
    if stage is not None and stage not in DEEPSPEED_STAGES:
        return f"DeepSpeed ZeRO-{stage}"
    if _offloads(config, environ):
        return "DeepSpeed ZeRO-Offload"
    return None


def check_accelerate_options(options: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> None:
    """Refuse, from ``Accelerator`` options and the environment alone, engines accelerate would set up in its
    constructor (DeepSpeed ZeRO-3 or ZeRO-Offload, Megatron-LM): before accelerate imports them or builds its state.

    Raises:
        UnsupportedEngineError: DeepSpeed ZeRO-3 or ZeRO-Offload, or Megatron-LM, given or enabled by the
            environment.
    """
    environ = os.environ if environ is None else environ
    plugin = options.get("deepspeed_plugin") or options.get("deepspeed_plugins")
    if plugin is not None or _is_true(environ, "ACCELERATE_USE_DEEPSPEED"):
        plugins = list(plugin.values()) if isinstance(plugin, Mapping) else [plugin]
        refused = [engine for engine in map(lambda p: _refused_deepspeed(p, environ), plugins) if engine]
        if refused:
            raise refuse_engine(refused[0], front_door="ResumableAccelerator", fix=_ACCELERATE_FIX)
    if options.get("megatron_lm_plugin") is not None or _is_true(environ, "ACCELERATE_USE_MEGATRON_LM"):
        raise refuse_engine("Megatron-LM", front_door="ResumableAccelerator", fix=_ACCELERATE_FIX)


def _fsdp1_engine(plugin: Any) -> str | None:
    """The FSDP1 set-up ``plugin`` runs, if hf_resumable refuses it: a hybrid sharding strategy (its replica groups
    would each write the same pieces). Any ``state_dict_type`` is accepted: checkpoints always read FSDP1's sharded
    state dict, whatever accelerate uses for its own saves."""
    strategy = str(getattr(plugin, "sharding_strategy", None) or "")
    return f"FSDP1 {strategy.rpartition('.')[2]}" if "HYBRID" in strategy else None


def _state_engine(state: Any) -> str | None:
    """The refused engine accelerate's state runs, or ``None`` (no engine, DDP, FSDP2, FSDP1 sharded)."""
    from accelerate.utils import DistributedType

    kind = getattr(state, "distributed_type", None)
    if kind == DistributedType.DEEPSPEED:
        plugin = getattr(state, "deepspeed_plugin", None)
        return _refused_deepspeed(plugin) or (None if _zero_stage(plugin, {}) in DEEPSPEED_STAGES else "DeepSpeed")
    if kind == DistributedType.MEGATRON_LM:
        return "Megatron-LM"
    plugin = getattr(state, "fsdp_plugin", None)
    if kind == DistributedType.FSDP and getattr(plugin, "fsdp_version", 1) != 2:
        return _fsdp1_engine(plugin)
    return None


def check_accelerate_state(state: Any) -> None:
    """Refuse the engine accelerate's (built) state runs, if it is one hf_resumable does not checkpoint.

    Raises:
        UnsupportedEngineError: DeepSpeed ZeRO-3 (or a stage it cannot tell) or ZeRO-Offload, Megatron-LM or FSDP1.
    """
    engine = _state_engine(state)
    if engine is not None:
        raise refuse_engine(engine, front_door="ResumableAccelerator", fix=_ACCELERATE_FIX)


def check_trainer_engine(args: Any, state: Any, *, fsdp_xla: bool = False) -> None:
    """Refuse, when ``train()`` starts, a ``Trainer`` engine hf_resumable does not checkpoint (``args.deepspeed`` is
    read as given, without importing deepspeed; ``fsdp_xla``: the Trainer wraps the model with XLA FSDP).

    Raises:
        UnsupportedEngineError: DeepSpeed ZeRO-3 or ZeRO-Offload, FSDP1 or XLA FSDP.
    """
    if getattr(args, "deepspeed", None) and (engine := _refused_deepspeed(args.deepspeed, {})) is not None:
        raise refuse_engine(engine, front_door="ResumableTrainer", fix=_TRAINER_FIX)
    if fsdp_xla:
        raise refuse_engine("XLA FSDP", front_door="ResumableTrainer", fix=_TRAINER_FIX)
    engine = _state_engine(state)
    if engine is not None:
        raise refuse_engine(engine, front_door="ResumableTrainer", fix=_TRAINER_FIX)


def holds_dtensors(model: torch.nn.Module | None) -> bool:
    """Whether ``model``'s checkpoint is written as per-rank pieces instead of whole tensors: its parameters are
    DTensors (FSDP2 ``fully_shard``, tensor parallel), or it is (or holds) FSDP1 wrappers, whose state dict is kept as
    pieces."""
    if model is None:
        return False
    from torch.distributed.tensor import DTensor

    return is_fsdp1(model) or any(isinstance(parameter, DTensor) for parameter in model.parameters())


def is_fsdp1(model: Any) -> bool:
    """Whether ``model`` is, or holds, an FSDP1 ``FullyShardedDataParallel`` wrapper."""
    if not isinstance(model, torch.nn.Module):
        return False
    from torch.distributed.fsdp import FullyShardedDataParallel

    return any(isinstance(module, FullyShardedDataParallel) for module in model.modules())


def checkpoint_model(prepared: Any, unwrapped: Any) -> Any:
    """The module a checkpoint saves and loads: FSDP1's root wrapper itself (its sharded state dict is a collective
    driven from the root, and names the weights as the unwrapped model does), else the unwrapped model."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    return prepared if isinstance(prepared, FullyShardedDataParallel) else unwrapped
