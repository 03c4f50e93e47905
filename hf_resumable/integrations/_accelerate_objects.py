"""Which prepared object of a ``ResumableAccelerator`` goes where in a checkpoint, in accelerate's index order. PURE.

Position 0 of each kind uses the checkpoint's own slots when it can; every other object goes into its ``extra``
state. Optimizer state is keyed by parameter name where the parameter belongs to a prepared model
(``model/<name>``, ``model_1/<name>``) and by position otherwise (``<unnamed>/<i>``). The plan's JSON record is
saved with the checkpoint, and loading follows the record, not today's objects.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..checkpoint import ShardedOptimizerState
from ..errors import CheckpointMismatchError, IncompleteCheckpointError

__all__ = [
    "SLOT_CORE",
    "SLOT_EXTRA",
    "KIND_MODULE",
    "KIND_STATE_DICT",
    "Layout",
    "plan_layout",
    "model_stem",
    "parameter_keys",
    "encode_optimizer",
    "load_optimizer",
    "require_slots",
]

SLOT_CORE = "core"  # the checkpoint's own model / optimizer / scheduler slot
SLOT_EXTRA = "extra"  # inside ``extra`` (EXTRA_MODELS / EXTRA_OPTIMIZERS / EXTRA_SCHEDULERS)
KIND_MODULE = "module"  # the unwrapped prepared model's own state dict
KIND_STATE_DICT = "state_dict"  # a state dict a save_state pre-hook put into ``weights`` (loaded as accelerate does)
UNNAMED = "<unnamed>"


def model_stem(index: int) -> str:
    """accelerate's name for model ``index``: ``model``, ``model_1``, ``model_2``, ..."""
    return "model" if index == 0 else f"model_{index}"


@dataclass
class Layout:
    """Where each saved object lives: per weights slot (accelerate's ``weights`` after the pre-hooks) its kind, per
    optimizer its slot, the numbers of schedulers and registered objects, and the files the pre-hooks wrote."""

    models: list[str] = field(default_factory=list)
    optimizers: list[str] = field(default_factory=list)
    schedulers: int = 0
    custom_objects: int = 0
    hook_files: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if any(kind not in (KIND_MODULE, KIND_STATE_DICT) for kind in self.models):
            raise ValueError(f"Unknown model slot kinds in {self.models}.")
        if any(slot not in (SLOT_CORE, SLOT_EXTRA) for slot in self.optimizers):
            raise ValueError(f"Unknown optimizer slots in {self.optimizers}.")
        if self.optimizers[1:].count(SLOT_CORE):
            raise ValueError("Only optimizer 0 can use the checkpoint's optimizer slot.")

    def to_json(self) -> dict[str, Any]:
        return {"models": list(self.models), "optimizers": list(self.optimizers), "schedulers": self.schedulers,
                "custom_objects": self.custom_objects, "hook_files": list(self.hook_files)}

    @classmethod
    def from_json(cls, record: Mapping[str, Any]) -> "Layout":
        return cls(models=list(record.get("models", [])), optimizers=list(record.get("optimizers", [])),
                   schedulers=int(record.get("schedulers", 0)), custom_objects=int(record.get("custom_objects", 0)),
                   hook_files=list(record.get("hook_files", [])))

    @classmethod
    def legacy(cls, *, has_model: bool, has_optimizer: bool, has_scheduler: bool, custom_objects: int) -> "Layout":
        """The layout of checkpoints written before layouts were recorded (one of each, in the core slots)."""
        return cls(models=[KIND_MODULE] if has_model else [], optimizers=[SLOT_CORE] if has_optimizer else [],
                   schedulers=int(has_scheduler), custom_objects=custom_objects)


def parameter_keys(models: Sequence[torch.nn.Module], optimizer: torch.optim.Optimizer) -> list[str]:
    """The key of every parameter of ``optimizer`` (in ``state_dict`` order): ``<model stem>/<name>`` when it
    belongs to one of the (unwrapped) ``models``, ``<unnamed>/<position>`` otherwise."""
    names: dict[int, str] = {}
    for index, model in enumerate(models):
        for name, param in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(param), f"{model_stem(index)}/{name}")
    keys = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            keys.append(names.get(id(param), f"{UNNAMED}/{len(keys)}"))
    return keys


def plan_layout(*, weights: Sequence[Any], originals: Sequence[Any], models: Sequence[torch.nn.Module],
                optimizers: Sequence[torch.optim.Optimizer], schedulers: int, custom_objects: int,
                hook_files: Sequence[str], hooks_registered: bool) -> Layout:
    """Decide where everything goes. ``weights`` is accelerate's list after the ``save_state`` pre-hooks (which may
    remove or replace entries), ``originals`` what it started with. With ``hooks_registered`` optimizer 0 stays out
    of the core slot, whose parameter names come from the model slot a hook may empty."""
    kinds = []
    for index, entry in enumerate(weights):
        kinds.append(KIND_MODULE if index < len(originals) and entry is originals[index] else KIND_STATE_DICT)
    core_optimizer = (
        bool(optimizers) and bool(kinds) and kinds[0] == KIND_MODULE and not hooks_registered
        and (isinstance(optimizers[0], ShardedOptimizerState)  # ZeRO partitions: model 0's, by construction
             or all(not key.startswith(UNNAMED) and key.startswith("model/")
                    for key in parameter_keys(models[:1], optimizers[0])))
    )
    slots = [SLOT_CORE if index == 0 and core_optimizer else SLOT_EXTRA for index in range(len(optimizers))]
    return Layout(models=kinds, optimizers=slots, schedulers=schedulers, custom_objects=custom_objects,
                  hook_files=sorted(hook_files))


def _parameters(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [param for group in optimizer.param_groups for param in group["params"]]


def encode_optimizer(optimizer: torch.optim.Optimizer, keys: Sequence[str]) -> dict[str, Any]:
    """``optimizer.state_dict()`` with parameter positions replaced by their keys; parameters of no prepared model
    (a learnable temperature) are saved too, under ``"unowned"``, since no model's weights hold them."""
    state = optimizer.state_dict()
    position_key = dict(enumerate(keys))
    return {
        "class": type(optimizer).__qualname__,
        "state": {position_key[position]: value for position, value in state["state"].items()},
        "param_groups": [{**{k: v for k, v in group.items() if k != "params"},
                          "params": [position_key[p] for p in group["params"]]} for group in state["param_groups"]],
        "unowned": {key: param.detach() for key, param in zip(keys, _parameters(optimizer))
                    if key.startswith(UNNAMED)},
    }


def load_optimizer(optimizer: torch.optim.Optimizer, keys: Sequence[str], stored: Mapping[str, Any], *,
                   where: str) -> None:
    """Fill ``optimizer`` from :func:`encode_optimizer`'s record, matching parameters by key.

    Raises:
        CheckpointMismatchError: the parameters or groups differ (all differences listed; nothing loaded).
    """
    current = {key: position for position, key in enumerate(keys)}
    groups = stored.get("param_groups") or []
    saved_keys = [key for group in groups for key in group["params"]]
    missing = sorted(set(current) - set(saved_keys))
    unexpected = sorted(set(saved_keys) - set(current))
    sizes = [len(group["params"]) for group in groups]
    current_sizes = [len(group["params"]) for group in optimizer.param_groups]
    if missing or unexpected or sizes != current_sizes:
        raise CheckpointMismatchError(
            f"{where}: the saved optimizer ({stored.get('class')}) does not fit {type(optimizer).__qualname__}: "
            f"missing {missing[:10]}, unexpected {unexpected[:10]}, group sizes {sizes} vs {current_sizes}. "
            "Prepare the same models and optimizer parameter groups as the run that saved it.")
    state_dict = {
        "state": {current[key]: value for key, value in (stored.get("state") or {}).items()},
        "param_groups": [{**{k: v for k, v in group.items() if k != "params"},
                          "params": [current[key] for key in group["params"]]} for group in groups],
    }
    unowned = stored.get("unowned") or {}
    params = _parameters(optimizer)
    wrong = [key for key, value in unowned.items() if tuple(value.shape) != tuple(params[current[key]].shape)]
    if wrong:
        raise CheckpointMismatchError(f"{where}: saved parameters {wrong[:10]} (in no model) have other shapes now.")
    optimizer.load_state_dict(state_dict)
    with torch.no_grad():
        for key, value in unowned.items():
            params[current[key]].copy_(value)


def require_slots(layout: Layout, *, models_to_fill: int, optimizers: int, schedulers: int, where: str) -> None:
    """Check that the checkpoint holds everything that is about to be loaded, before anything is touched (matched by
    position; it may hold more than is prepared now, as in accelerate).

    Raises:
        IncompleteCheckpointError: naming what is missing and why.
    """
    problems = []
    if models_to_fill > len(layout.models):
        problems.append(f"{models_to_fill} model(s) to load but {len(layout.models)} saved (a save_state pre-hook "
                        "may have removed their weights: register a load_state pre-hook that loads them)")
    if optimizers > len(layout.optimizers):
        problems.append(f"{optimizers} optimizer(s) prepared, {len(layout.optimizers)} saved")
    if schedulers > layout.schedulers:
        problems.append(f"{schedulers} scheduler(s) prepared, {layout.schedulers} saved")
    if problems:
        raise IncompleteCheckpointError(f"{where} does not fit this accelerator: {'; '.join(problems)}. Prepare the "
                                        "same objects as the run that saved it.")
