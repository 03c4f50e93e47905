"""DeepSpeed ZeRO-1/2/3 state in hf_resumable checkpoints: every rank writes its own partitions, no pickle.

Each rank's partitions of the flat fp32 master weights and their optimizer state are pieces of one flat tensor per
param group (ZeRO-3: per sub-group), each with its partition map, so the piece engine writes, reads and reshards them
as it does FSDP2 pieces (docs/multi-gpu.md, "DeepSpeed ZeRO-1/2/3"; docs/format.md). Nothing here imports deepspeed:
the ZeRO optimizer is recognised by its attributes.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ..checkpoint.background import equal_bytes
from ..checkpoint.pieces import (
    ENGINE_CLASS_PREFIX,
    MAP_FLAT,
    MAP_STRIDED,
    MASTER_KEY,
    PARTITION_KEY,
    PartitionMap,
    held_partition,
    partition_piece,
)
from ..distributed import all_gather_json
from ..errors import IncompleteCheckpointError, UnsupportedEngineError
from ._core import patched
from ._engines import refuse_engine

logger = logging.getLogger(__name__)

__all__ = ["ZeroOptimizerState", "Zero3OptimizerState", "register_step_hook", "checkpoint_optimizer",
           "zero_optimizer", "torch_optimizer", "EXTRA_DEEPSPEED", "saved_engine_state", "capture_engine_state",
           "restore_engine_state", "deepspeed_engine", "deepspeed_resume_by_us"]

# A param group's flat partition, named as a parameter would be. The data-parallel size is part of the name: the
# partitions' layout depends on it (an elastic load cuts them again from their recorded maps).
GROUP_NAME = "zero{world_size}.group{index}"
SUBGROUP_NAME = "zero{world_size}.subgroup{index}"  # ZeRO-3: a sub-group's flat partition, named the same way
EXTRA_DEEPSPEED = "deepspeed_engine"  # extra-state key: the engine's counters and loss scaler (capture_engine_state)
ENGINE_COUNTERS = ("global_steps", "global_samples", "micro_steps", "skipped_steps")  # DeepSpeedEngine's
_SCALER_TYPES = (bool, int, float)  # the loss scaler's fields saved as JSON (scale, iteration, hysteresis ...)


def is_zero_optimizer(optimizer: Any) -> bool:
    """Whether ``optimizer`` is DeepSpeed's ZeRO-1/2 optimizer (flat fp32 partitions over a torch optimizer)."""
    return hasattr(optimizer, "single_partition_of_fp32_groups") and hasattr(optimizer, "real_dp_process_group")


def is_zero3_optimizer(optimizer: Any) -> bool:
    """Whether ``optimizer`` is DeepSpeed's ZeRO-3 optimizer (flat fp32 partitions per sub-group)."""
    return hasattr(optimizer, "fp32_partitioned_groups_flat") and hasattr(optimizer, "sub_group_to_group_id")


def _wrapped(optimizer: Any) -> Iterator[Any]:
    """``optimizer`` and every optimizer it wraps, outermost first (accelerate's wrapper, ZeRO's, torch's)."""
    while optimizer is not None:
        yield optimizer
        optimizer = getattr(optimizer, "optimizer", None)


def zero_optimizer(optimizer: Any) -> Any:
    """The ZeRO-1/2/3 optimizer inside ``optimizer`` (accelerate's wrapper, or itself), or ``None``."""
    return next((inner for inner in _wrapped(optimizer) if is_zero_optimizer(inner) or is_zero3_optimizer(inner)),
                None)


def torch_optimizer(optimizer: Any) -> Any:
    """The torch optimizer that steps: the one inside accelerate's wrapper, or inside ZeRO's (over its partitions)."""
    zero = zero_optimizer(optimizer)
    if zero is not None:
        return zero.optimizer
    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


def checkpoint_optimizer(optimizer: Any) -> Any:
    """What a checkpoint saves for ``optimizer``: a :class:`ZeroOptimizerState` for ZeRO-1/2, a
    :class:`Zero3OptimizerState` for ZeRO-3, the torch optimizer otherwise.

    Raises:
        UnsupportedEngineError: ZeRO with the optimizer or parameters offloaded, or another DeepSpeed optimizer
            (before any training step).
    """
    zero = zero_optimizer(optimizer)
    if zero is not None:
        return Zero3OptimizerState(zero) if is_zero3_optimizer(zero) else ZeroOptimizerState(zero)
    # Another optimizer of DeepSpeed's own (BF16_Optimizer for ZeRO-1 in bf16, FP16_Optimizer...): state not saved.
    other = next((inner for inner in _wrapped(optimizer) if type(inner).__module__.startswith("deepspeed.")), None)
    if other is not None:
        raise _unsupported(f"DeepSpeed (with its {type(other).__name__})")
    return torch_optimizer(optimizer)


def _unsupported(engine: str) -> UnsupportedEngineError:
    return refuse_engine(engine, front_door="hf_resumable",
                         fix="Use DeepSpeed ZeRO-1/2/3 without offload, FSDP2 or DDP, or the stock classes for this "
                             "run")


def _init_base_state(base: torch.optim.Optimizer) -> None:
    """Create ``base``'s state over its flat partitions (zero gradients, learning rate 0) so a load has templates to
    fill; the load overwrites all of it. Step hooks do not run, so ``global_step`` does not count it."""
    lrs = [group["lr"] for group in base.param_groups]
    hooks = base._optimizer_step_pre_hooks, base._optimizer_step_post_hooks
    base._optimizer_step_pre_hooks, base._optimizer_step_post_hooks = type(hooks[0])(), type(hooks[1])()
    try:
        for group in base.param_groups:
            group["lr"] = 0.0
            for flat in group["params"]:
                flat.grad = torch.zeros_like(flat)
        base.step()
    finally:
        base._optimizer_step_pre_hooks, base._optimizer_step_post_hooks = hooks
        for group, lr in zip(base.param_groups, lrs):
            group["lr"] = lr
            for flat in group["params"]:
                flat.grad = None


class _ZeroState:
    """What both ZeRO optimizer views share: the base torch optimizer's param groups and state, and what its steps
    write (a background save holds the base optimizer's next step until those are copied)."""

    base: torch.optim.Optimizer

    @property
    def gated_optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer whose step a background save holds."""
        return self.base

    def step_tensors(self) -> Iterator[torch.Tensor]:
        """Every tensor an engine step writes: the flat fp32 master partitions, the base optimizer's state over them,
        and the model's weights (ZeRO-3: this rank's partitions of them)."""
        yield from self._masters()
        for state in self.base.state.values():
            yield from (value for value in state.values() if torch.is_tensor(value))
        yield from self._weights()

    def _masters(self) -> Iterator[torch.Tensor]:
        raise NotImplementedError

    def _weights(self) -> Iterator[torch.Tensor]:
        raise NotImplementedError

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.base.param_groups

    @property
    def state(self) -> Any:
        return self.base.state


def _partition_entries(base: torch.optim.Optimizer, flat: torch.Tensor, group: Any,
                       partition_map: PartitionMap) -> dict[str, Any]:
    """One flat fp32 partition's checkpoint entries: the master piece, the base optimizer's state over it, and its
    partition map (JSON)."""
    entries = {MASTER_KEY: partition_piece(flat, group), PARTITION_KEY: partition_map.to_json()}
    for key, value in base.state.get(flat, {}).items():
        partitioned = torch.is_tensor(value) and value.shape == flat.shape
        entries[key] = partition_piece(value, group) if partitioned else value
    return entries


def _restore_partition(base: torch.optim.Optimizer, flat: torch.Tensor, saved: Mapping[str, Any]) -> None:
    """Put one flat partition's master piece and optimizer state (:func:`_partition_entries`) back in place."""
    entries = {key: value.to_local() if hasattr(value, "to_local") else value for key, value in saved.items()
               if key != PARTITION_KEY}
    with torch.no_grad():
        flat.copy_(entries.pop(MASTER_KEY))
    base.state[flat] = {key: value.to(flat.device) if torch.is_tensor(value) and value.shape == flat.shape
                        else value for key, value in entries.items()}


def _equal_cast(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    """Whether every ``(weight elements, master elements)`` pair holds the same bits once the masters are cast to the
    weight's dtype."""
    same = [(held, master) for held, master in pairs if held.dtype == master.dtype]
    if not equal_bytes(same):
        return False
    return all(equal_bytes([(held, master.to(held.dtype))]) for held, master in pairs if held.dtype != master.dtype)


class ZeroOptimizerState(_ZeroState):
    """A ZeRO-1/2 optimizer ``zero`` as the piece engine sees it: one pseudo-parameter per param group, whose state
    is this rank's partitions.

    Raises:
        UnsupportedEngineError: the optimizer is offloaded to the CPU (DeepSpeedCPUAdam, not tested).
    """

    def __init__(self, zero: Any) -> None:
        if getattr(zero, "cpu_offload", False):
            raise _unsupported("DeepSpeed ZeRO-Offload")
        self.zero = zero
        self.base: torch.optim.Optimizer = zero.optimizer
        stage = 2 if getattr(zero, "partition_gradients", False) else 1
        self.checkpoint_class = f"{ENGINE_CLASS_PREFIX}{stage}/{type(self.base).__qualname__}"

    def _partitions(self) -> Iterator[tuple[str, torch.Tensor, Any]]:
        for index, group in enumerate(self.base.param_groups):
            (flat,) = group["params"]  # ZeRO puts one flat fp32 partition in each group
            dp_group = self.zero.real_dp_process_group[index]
            world_size = torch.distributed.get_world_size(dp_group)
            yield GROUP_NAME.format(world_size=world_size, index=index), flat, dp_group

    def _map(self, index: int, flat: torch.Tensor, world_size: int) -> PartitionMap:
        """Param group ``index``'s parameters in its flat tensor (in DeepSpeed's order, at DeepSpeed's offsets:
        parameters may be aligned, and reordered round robin), cut in ``flat.numel()`` elements per rank."""
        params = self.zero.round_robin_bit16_groups[index]
        offsets = getattr(self.zero, "round_robin_bit16_offsets", None)
        offsets = offsets[index] if offsets else list(itertools.accumulate((p.numel() for p in params), initial=0))
        names = self.zero.param_names
        return PartitionMap(MAP_FLAT, world_size, flat.numel(),
                            tuple((names[p], p.numel(), offset, p.numel()) for p, offset in zip(params, offsets)))

    def master_names(self) -> dict[int, str]:
        """``{id(parameter): its name}`` of every parameter whose fp32 master weights the param groups hold."""
        names = self.zero.param_names
        return {id(param): names[param] for group in self.zero.round_robin_bit16_groups for param in group}

    def _masters(self) -> Iterator[torch.Tensor]:
        return (flat for _, flat, _ in self._partitions())

    def _weights(self) -> Iterator[torch.Tensor]:
        return (param for group in self.zero.round_robin_bit16_groups for param in group)

    def masters_give_weights(self, *, group: Any = None) -> bool:
        """Whether every rank's fp32 master partition, cast to the weights' dtype, equals the elements of the weights
        it covers, bit for bit: then the masters give the weights, which are not stored (docs/format.md). A weight
        written outside the optimizer breaks it, so it is checked at every save; a collective over ``group``."""
        try:
            pairs = []
            for index, (_, flat, dp_group) in enumerate(self._partitions()):
                params = {self.zero.param_names[p]: p for p in self.zero.round_robin_bit16_groups[index]}
                partition_map = self._map(index, flat, torch.distributed.get_world_size(dp_group))
                for segment in partition_map.segments(torch.distributed.get_rank(dp_group)):
                    weight = params[segment.fqn].detach().reshape(-1).narrow(0, segment.start, segment.length)
                    pairs.append((weight, flat.detach().narrow(0, segment.offset, segment.length)))
            same = _equal_cast(pairs)
        except (RuntimeError, KeyError, ValueError) as err:  # every rank must still answer: the weights are stored
            logger.warning("Could not compare the ZeRO weights with their master weights (%s: %s); they are stored.",
                           type(err).__name__, err)
            same = False
        return all(all_gather_json(same, group=group))

    def sharded_state_dict(self) -> dict[str, Any]:
        """``{"state": {group name: {key: piece or value}}, "param_groups": [...]}``, names for parameters."""
        state, groups = {}, []
        for index, ((name, flat, group), param_group) in enumerate(zip(self._partitions(), self.base.param_groups)):
            partition_map = self._map(index, flat, torch.distributed.get_world_size(group))
            state[name] = _partition_entries(self.base, flat, group, partition_map)
            groups.append({**{k: v for k, v in param_group.items() if k != "params"}, "params": [name]})
        return {"state": state, "param_groups": groups}

    def init_state(self) -> None:
        """Create the base optimizer's state for a load to fill (:func:`_init_base_state`)."""
        if not self.base.state:
            _init_base_state(self.base)

    def load_sharded_state_dict(self, state: Mapping[str, Any]) -> None:
        """Put the master partitions, the base optimizer's state and the hyper-parameters in place."""
        for (name, flat, _), param_group, saved in zip(self._partitions(), self.base.param_groups,
                                                       state["param_groups"]):
            _restore_partition(self.base, flat, state["state"][name])
            param_group.update({k: v for k, v in saved.items() if k != "params"})
        if hasattr(self.zero, "_lazy_init_hp_params_optimizer_state"):
            # DeepSpeed links each parameter's fragments to the optimizer state once (for safe_get_full_* and its
            # universal checkpoints): link them to the state just loaded
            self.zero._hp_optimizer_states_linked = False
            self.zero._lazy_init_hp_params_optimizer_state()


class Zero3OptimizerState(_ZeroState):
    """A ZeRO-3 optimizer ``zero`` as the piece engine sees it: one pseudo-parameter per sub-group, whose state is
    this rank's partition of the sub-group's flat fp32 master weights and the base optimizer's state over it.

    ZeRO-3 lists a sub-group's flat partition in its param group only while it steps it; the param groups saved
    list the sub-groups that belong to each. The model's own partitions (``ds_tensor``) are saved with the model.

    Raises:
        UnsupportedEngineError: the optimizer or the parameters are offloaded (ZeRO-Offload, not tested).
    """

    def __init__(self, zero: Any) -> None:
        if getattr(zero, "offload_optimizer", False) or getattr(zero, "offload_param", False):
            raise _unsupported("DeepSpeed ZeRO-Offload")
        self.zero = zero
        self.base: torch.optim.Optimizer = zero.optimizer
        self.checkpoint_class = f"{ENGINE_CLASS_PREFIX}3/{type(self.base).__qualname__}"

    def _partitions(self) -> Iterator[tuple[str, torch.Tensor, Any, int]]:
        """``(name, flat fp32 partition, its process group, its param group)`` per sub-group."""
        zero = self.zero
        for index, flat in enumerate(zero.fp32_partitioned_groups_flat):
            group = (zero._get_sub_group_process_group(index) if hasattr(zero, "_get_sub_group_process_group")
                     else zero.dp_process_group)
            world_size = torch.distributed.get_world_size(group)
            yield (SUBGROUP_NAME.format(world_size=world_size, index=index), flat, group,
                   zero.sub_group_to_group_id[index])

    def _map(self, index: int, flat: torch.Tensor, group: Any) -> PartitionMap:
        """Sub-group ``index``'s parameters: each rank holds its chunk of each (``ds_tensor``), end to end."""
        names, offset, params = self.zero.param_names, 0, []
        for param in self.zero.fp16_groups[index]:
            chunk = int(param.ds_tensor.ds_numel if hasattr(param.ds_tensor, "ds_numel") else param.ds_tensor.numel())
            params.append((names[param], int(param.ds_numel), offset, chunk))
            offset += chunk
        return PartitionMap(MAP_STRIDED, torch.distributed.get_world_size(group), flat.numel(), tuple(params))

    def master_names(self) -> dict[int, str]:
        """``{id(parameter): its name}`` of every parameter whose fp32 master weights the sub-groups hold."""
        names = self.zero.param_names
        return {id(param): names[param] for group in self.zero.fp16_groups for param in group}

    def _masters(self) -> Iterator[torch.Tensor]:
        return iter(self.zero.fp32_partitioned_groups_flat)

    def _weights(self) -> Iterator[torch.Tensor]:
        return (param.ds_tensor for group in self.zero.fp16_groups for param in group)

    def masters_give_weights(self, *, group: Any = None) -> bool:
        """Whether this rank's partition of every parameter (``ds_tensor``) equals its fp32 master partition cast to
        the parameter's dtype, bit for bit: then the masters give this rank's partitions, which are not stored. A
        parameter written outside the optimizer (``GatheredParameters(modifier_rank=...)``) breaks it, so it is
        checked at every save. No collective (``group`` is unused): another rank's differing partitions are
        stored."""
        pairs = []
        for index, flat in enumerate(self.zero.fp32_partitioned_groups_flat):
            offset = 0
            for param in self.zero.fp16_groups[index]:
                held = held_partition(param)
                pairs.append((held, flat.detach().narrow(0, offset, held.numel())))
                offset += int(param.ds_tensor.ds_numel if hasattr(param.ds_tensor, "ds_numel")
                              else param.ds_tensor.numel())
        return _equal_cast(pairs)

    def sharded_state_dict(self) -> dict[str, Any]:
        """``{"state": {sub-group name: {key: piece or value}}, "param_groups": [...]}``, names for parameters."""
        state: dict[str, Any] = {}
        listed: list[list[str]] = [[] for _ in self.base.param_groups]
        for index, (name, flat, group, group_id) in enumerate(self._partitions()):
            state[name] = _partition_entries(self.base, flat, group, self._map(index, flat, group))
            listed[group_id].append(name)
        groups = [{**{k: v for k, v in param_group.items() if k != "params"}, "params": names}
                  for param_group, names in zip(self.base.param_groups, listed)]
        return {"state": state, "param_groups": groups}

    @contextlib.contextmanager
    def _listed(self) -> Iterator[None]:
        """The flat partitions listed in their param groups (as ZeRO-3 does around a step or its own save)."""
        self.zero._set_fp32_optimizer_param_groups()
        try:
            yield
        finally:
            self.zero._clear_fp32_optimizer_param_groups()

    def init_state(self) -> None:
        """Create the base optimizer's state for a load to fill, the flat partitions listed in their groups."""
        if self.base.state:
            return
        with self._listed():
            _init_base_state(self.base)

    def load_sharded_state_dict(self, state: Mapping[str, Any]) -> None:
        """Put the master partitions, the base optimizer's state and the hyper-parameters in place (the model's
        partitions are loaded with the model)."""
        for name, flat, _, _ in self._partitions():
            _restore_partition(self.base, flat, state["state"][name])
        for param_group, saved in zip(self.base.param_groups, state["param_groups"]):
            param_group.update({k: v for k, v in saved.items() if k != "params"})


def register_step_hook(optimizer: Any, hook: Any) -> Any:
    """Register ``hook`` as a step post-hook of the torch optimizer that steps (:func:`torch_optimizer`), called
    once per optimizer step: ZeRO-3 steps its base optimizer once per sub-group, and the hook runs after the last.

    Returns:
        `RemovableHandle`: the handle of the registration.
    """
    zero = zero_optimizer(optimizer)
    if zero is None or not is_zero3_optimizer(zero):
        return torch_optimizer(optimizer).register_step_post_hook(hook)

    def after_last_sub_group(base: Any, args: Any, kwargs: Any) -> None:
        last = zero.fp32_partitioned_groups_flat[-1]
        group = base.param_groups[zero.sub_group_to_group_id[len(zero.fp32_partitioned_groups_flat) - 1]]
        if any(param is last for param in group["params"]):
            hook(base, args, kwargs)

    return zero.optimizer.register_step_post_hook(after_last_sub_group)


def deepspeed_engine(model: Any) -> Any:
    """The ``DeepSpeedEngine`` a prepared model is (or ``None``)."""
    return model if all(hasattr(model, name) for name in ENGINE_COUNTERS) else None


def _loss_scaler(optimizers: list[Any]) -> Any:
    """The loss scaler of the ZeRO optimizer among ``optimizers`` (what a checkpoint saves of them), if any."""
    zero = next((optimizer.zero for optimizer in optimizers
                 if isinstance(optimizer, (ZeroOptimizerState, Zero3OptimizerState))), None)
    return getattr(zero, "loss_scaler", None)


def capture_engine_state(engine: Any, optimizers: list[Any]) -> dict[str, Any]:
    """The engine's step counters and the loss scaler of its ZeRO optimizer (among ``optimizers``), as JSON."""
    state: dict[str, Any] = {name: int(getattr(engine, name)) for name in ENGINE_COUNTERS}
    scaler = _loss_scaler(optimizers)
    if scaler is not None:
        state["loss_scaler"] = {k: v for k, v in vars(scaler).items() if type(v) in _SCALER_TYPES}
    return state


def saved_engine_state(extra: Mapping[str, Any], *, where: Any) -> Mapping[str, Any]:
    """The engine state a checkpoint's extra state holds, checked before anything is loaded.

    Raises:
        IncompleteCheckpointError: the checkpoint was not written by a DeepSpeed run (no engine state).
    """
    state = extra.get(EXTRA_DEEPSPEED)
    if not isinstance(state, Mapping) or any(not isinstance(state.get(name), int) for name in ENGINE_COUNTERS):
        raise IncompleteCheckpointError(f"{where} holds no DeepSpeed engine state: it was not saved by a DeepSpeed "
                                        "run. Resume it without DeepSpeed, or start this run from scratch.")
    return state


def restore_engine_state(engine: Any, optimizers: list[Any], state: Mapping[str, Any]) -> None:
    """Put back what :func:`capture_engine_state` saved (:func:`saved_engine_state`)."""
    for name in ENGINE_COUNTERS:
        setattr(engine, name, int(state[name]))
    scaler = _loss_scaler(optimizers)
    for key, value in (state.get("loss_scaler") or {}).items():
        if scaler is not None and hasattr(scaler, key):
            setattr(scaler, key, value)


def deepspeed_resume_by_us() -> contextlib.AbstractContextManager[None]:
    """Inside ``Trainer.train``: the Trainer's ``deepspeed_load_checkpoint`` (DeepSpeed's pickled folders) does
    nothing; ``ResumableTrainer`` loads the ZeRO state from its own checkpoint."""
    import transformers.trainer as trainer_module

    def load_nothing(*args: Any, **kwargs: Any) -> None:
        logger.debug("DeepSpeed's own checkpoint loading skipped: hf_resumable loads the ZeRO state.")

    return patched(trainer_module, "deepspeed_load_checkpoint", load_nothing)
