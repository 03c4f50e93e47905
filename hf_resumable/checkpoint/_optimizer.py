"""Optimizer state <-> tensors keyed by parameter *name* plus JSON (param groups, scalar state).

``optimizer.state_dict()`` keys state by parameter index, which silently breaks when parameters are
reordered. Here each tensor is stored as ``state/<param name>/<key>`` and each group's ``params`` as a
list of names, so a freshly built optimizer is matched by name.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from ..constants import OPTIMIZER_GROUP_PREFIX, OPTIMIZER_STATE_PREFIX
from ..errors import CheckpointMismatchError
from ..state_codec import decode_state, encode_state

logger = logging.getLogger(__name__)


def parameter_names(model: torch.nn.Module | None, optimizer: torch.optim.Optimizer) -> list[str]:
    """Names of the optimizer's parameters in ``state_dict`` index order.

    Raises:
        CheckpointMismatchError: if a parameter of the optimizer is not part of ``model``.
    """
    by_id: dict[int, str] = {}
    if model is not None:
        for name, param in model.named_parameters(remove_duplicate=False):
            by_id.setdefault(id(param), name)
    names, orphans = [], 0
    for group in optimizer.param_groups:
        for param in group["params"]:
            name = by_id.get(id(param))
            if name is None:
                orphans += 1
                name = f"<unnamed>/{len(names)}"
            names.append(name)
    if orphans and model is not None:
        raise CheckpointMismatchError(
            f"{orphans} optimizer parameter(s) do not belong to the model passed to save/load_checkpoint; "
            "pass the model that owns every optimized parameter."
        )
    return names


def encode_named_optimizer_state(
    state: Mapping[str, Mapping[str, Any]], param_groups: list[Mapping[str, Any]], class_name: str
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split a NAME-keyed optimizer state (groups list parameter names) into named tensors and a JSON document.

    Tensors are named ``state/<param name>/<key>``; non-tensor values and param groups go into the document
    (``{"class", "param_groups", "non_tensor_state"}``). Shared by regular and sharded (FSDP2) checkpoints,
    so one layout serves both.

    Raises:
        UnsupportedStateError: if a value cannot be stored without pickle.
    """
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for name, per_param in state.items():
        for key, value in per_param.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{OPTIMIZER_STATE_PREFIX}{name}/{key}"] = value.detach()
            else:
                scalars.setdefault(name, {})[key] = encode_state(value, tensors, prefix=f"scalar/{name}/{key}")
    groups = []
    for i, group in enumerate(param_groups):
        encoded = {k: encode_state(v, tensors, prefix=f"{OPTIMIZER_GROUP_PREFIX}{i}/{k}")
                   for k, v in group.items() if k != "params"}
        encoded["params"] = [str(name) for name in group["params"]]
        groups.append(encoded)
    return tensors, {"class": class_name, "param_groups": groups, "non_tensor_state": scalars}


def optimizer_to_tensors(
    optimizer: torch.optim.Optimizer, names: list[str]
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split ``optimizer.state_dict()`` into named tensors and a JSON document."""
    state_dict = optimizer.state_dict()
    state = {names[index]: fields for index, fields in state_dict["state"].items()}
    groups = [{**group, "params": [names[index] for index in group["params"]]} for group in state_dict["param_groups"]]
    return encode_named_optimizer_state(state, groups, type(optimizer).__qualname__)


def existing_state_targets(
    optimizer: torch.optim.Optimizer, names: list[str], stored: Mapping[str, tuple[torch.dtype, tuple[int, ...]]]
) -> dict[str, torch.Tensor]:
    """The optimizer's current state tensors that a load can overwrite in place, by stored tensor name.

    Only tensors whose stored dtype and shape match exactly are returned; everything else is read into
    fresh memory. Loading into an optimizer that already holds state (a reload, a rollback) then skips
    allocating and first-touching that memory, as model weights do.
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    targets: dict[str, torch.Tensor] = {}
    for name, param in zip(names, params):
        for key, value in optimizer.state.get(param, {}).items():
            stored_name = f"{OPTIMIZER_STATE_PREFIX}{name}/{key}"
            if (isinstance(value, torch.Tensor) and stored_name in stored
                    and stored[stored_name] == (value.dtype, tuple(value.shape))):
                targets[stored_name] = value
    return targets


def check_optimizer_matches(optimizer: torch.optim.Optimizer, names: list[str], document: Mapping[str, Any], *,
                            source: str) -> None:
    """Refuse a saved optimizer state that cannot fit ``optimizer`` (checked before any tensor is read).

    Raises:
        CheckpointMismatchError: if the optimizer class, group structure or parameter names differ.
    """
    saved_class = document.get("class")
    if saved_class != type(optimizer).__qualname__:
        raise CheckpointMismatchError(f"{source}: optimizer was {saved_class}, now {type(optimizer).__qualname__}; "
                                      "build the same optimizer class to resume.")
    index_of = {name: i for i, name in enumerate(names)}
    saved_groups = document["param_groups"]
    problems = []
    if len(saved_groups) != len(optimizer.param_groups):
        problems.append(f"{len(saved_groups)} param group(s) saved, optimizer has {len(optimizer.param_groups)}")
    saved_names = [n for g in saved_groups for n in g["params"]]
    problems += [f"{n}: saved in the optimizer state but not optimized now" for n in saved_names if n not in index_of]
    problems += [f"{n}: optimized now but absent from the saved state" for n in names if n not in set(saved_names)]
    if problems:
        raise CheckpointMismatchError(f"{source}: optimizer does not match the checkpoint:\n  " +
                                      "\n  ".join(problems[:50]))
    offset = 0
    for i, (group, current) in enumerate(zip(saved_groups, optimizer.param_groups)):
        if set(group["params"]) != set(names[offset : offset + len(current["params"])]):
            raise CheckpointMismatchError(f"{source}: param group {i} holds different parameters than when saved.")
        offset += len(current["params"])


def optimizer_from_tensors(
    optimizer: torch.optim.Optimizer,
    names: list[str],
    tensors: Mapping[str, torch.Tensor],
    document: Mapping[str, Any],
    *,
    source: str,
) -> None:
    """Load state produced by :func:`optimizer_to_tensors` into ``optimizer``, matched by name.

    The caller has run :func:`check_optimizer_matches` on ``document`` first (before reading any tensor,
    since a load may fill the optimizer's existing state in place).
    """
    index_of = {name: i for i, name in enumerate(names)}
    saved_groups = document["param_groups"]
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        if key.startswith(OPTIMIZER_STATE_PREFIX):
            name, _, field = key[len(OPTIMIZER_STATE_PREFIX):].rpartition("/")
            state.setdefault(index_of[name], {})[field] = value
    for name, fields in document.get("non_tensor_state", {}).items():
        for field, value in fields.items():
            state.setdefault(index_of[name], {})[field] = decode_state(value, tensors, source=source)
    groups, offset = [], 0
    for group, current in zip(saved_groups, optimizer.param_groups):
        current_names = names[offset : offset + len(current["params"])]
        decoded = {k: decode_state(v, tensors, source=source) for k, v in group.items() if k != "params"}
        # torch pairs saved and current params by position, so list them in the current order.
        decoded["params"] = list(range(offset, offset + len(current_names)))
        groups.append(decoded)
        offset += len(current_names)
    optimizer.load_state_dict({"state": state, "param_groups": groups})
