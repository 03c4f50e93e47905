"""Optimizer state <-> tensors keyed by parameter *name* (``state/<param name>/<key>``) plus JSON (param groups
listing names, scalar state), so a freshly built optimizer is matched by name, not by index.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ...constants import OPTIMIZER_GROUP_PREFIX, OPTIMIZER_STATE_PREFIX
from ...errors import CheckpointMismatchError
from ...format.state_codec import decode_state, encode_state
from ._validate import check_hyperparameters, check_step_value

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


def flatten_optimizer_state(optimizer_state: Mapping[str, Any], class_name: str
                            ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split a NAME-keyed optimizer state dict (``get_optimizer_state_dict``'s: groups list parameter names) into
    tensors named ``state/<name>/<key>`` and a JSON document ``{"class", "param_groups", "non_tensor_state"}``, as
    both layouts store them.

    Raises:
        UnsupportedStateError: if a value cannot be stored without pickle.
    """
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for name, per_param in optimizer_state["state"].items():
        for key, value in per_param.items():
            if isinstance(value, torch.Tensor):  # detach() only if needed: on a DTensor it is a dispatched op
                tensors[f"{OPTIMIZER_STATE_PREFIX}{name}/{key}"] = value.detach() if value.requires_grad else value
            else:
                scalars.setdefault(name, {})[key] = encode_state(value, tensors, prefix=f"scalar/{name}/{key}")
    groups = []
    for i, group in enumerate(optimizer_state["param_groups"]):
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
    return flatten_optimizer_state({"state": state, "param_groups": groups}, type(optimizer).__qualname__)


# Per-parameter state that torch.optim's optimizers keep in the parameter's shape (Adam/AdamW/NAdam/RAdam/Adamax,
# SGD, Adagrad, Adadelta, RMSprop, Rprop, ASGD); a saved tensor under one of these keys must have that shape.
PARAM_SHAPED_STATE = frozenset({"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "sum", "square_avg",
                                "acc_delta", "grad_avg", "exp_inf", "ax", "prev", "step_size"})
STEP_KEY = "step"


@dataclass
class OptimizerLoadPlan:
    """Everything a load needs to fill an optimizer, decided before any byte is read."""

    names: list[str]  # parameter names in state_dict index order
    # stored tensor name -> the tensor its bytes go into: the existing state tensor of the final kind (reused), or
    # one allocated in the dtype, device and layout Optimizer.load_state_dict keeps
    targets: dict[str, torch.Tensor] = field(default_factory=dict)
    steps: list[str] = field(default_factory=list)  # stored ``step`` tensors, checked before anything is applied
    new: set[str] = field(default_factory=set)  # the targets allocated here, as opposed to reused state


def check_optimizer_matches(optimizer: torch.optim.Optimizer, names: list[str], document: Mapping[str, Any], *,
                            source: str) -> None:
    """Refuse a saved optimizer state (a checked document of this optimizer's class and number of groups) that cannot
    fit ``optimizer``, before any tensor is read.

    Raises:
        CheckpointMismatchError: if the parameter names, or the parameters of a group, differ.
    """
    index_of = {name: i for i, name in enumerate(names)}
    saved_groups = document["param_groups"]
    saved_names = [n for g in saved_groups for n in g["params"]]
    problems = [f"{n}: saved in the optimizer state but not optimized now" for n in saved_names if n not in index_of]
    problems += [f"{n}: optimized now but absent from the saved state" for n in names if n not in set(saved_names)]
    if problems:
        raise CheckpointMismatchError(f"{source}: optimizer does not match the checkpoint:\n  " +
                                      "\n  ".join(problems[:50]))
    offset = 0
    for i, (group, current) in enumerate(zip(saved_groups, optimizer.param_groups)):
        if set(group["params"]) != set(names[offset : offset + len(current["params"])]):
            raise CheckpointMismatchError(f"{source}: param group {i} holds different parameters than when saved.")
        offset += len(current["params"])


def _final_kind(param: torch.Tensor, key: str, stored_dtype: torch.dtype, group: Mapping[str, Any]
                ) -> tuple[torch.dtype, torch.device]:
    """Dtype and device ``Optimizer.load_state_dict`` gives a state tensor (its
    ``_process_value_according_to_param_policy``): ``step`` stays as stored on the CPU unless the group is
    fused or capturable (float32 on the parameter's device); everything else moves to the parameter's device,
    cast to its dtype if it is floating point."""
    if key == STEP_KEY:
        if group.get("fused") or group.get("capturable"):
            return torch.float32, param.device
        return stored_dtype, torch.device("cpu")
    return (param.dtype if param.is_floating_point() else stored_dtype), param.device


def plan_optimizer_load(
    optimizer: torch.optim.Optimizer,
    names: list[str],
    document: Mapping[str, Any],
    stored: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
    *,
    source: str,
    in_place: bool = False,
) -> OptimizerLoadPlan:
    """Check the saved optimizer against the live one (groups, names, hyper-parameter kinds, ``step`` values, each
    stored tensor naming an optimized parameter, moments shaped like it) and allocate its state, without touching the
    optimizer. With ``in_place`` new CPU state of the stored dtype is allocated contiguous, so the read lands in it.

    Raises:
        CheckpointMismatchError: listing every problem.
        CorruptCheckpointError: for malformed encoded values.
    """
    check_optimizer_matches(optimizer, names, document, source=source)
    # the stored tensors as meta tensors (dtype and shape, no data): the documents decode before any byte is read
    meta = {name: torch.empty(shape, dtype=dtype, device="meta") for name, (dtype, shape) in stored.items()}
    problems: list[str] = []
    saved_groups = [{k: decode_state(v, meta, source=source, path=f"optimizer/param_groups/{i}/{k}")
                     for k, v in group.items() if k != "params"} for i, group in enumerate(document["param_groups"])]
    for i, (saved, live) in enumerate(zip(saved_groups, optimizer.param_groups)):
        check_hyperparameters(saved, live, path=f"param_groups/{i}", problems=problems)
    for name, fields in document.get("non_tensor_state", {}).items():
        decoded = decode_state(fields, meta, source=source, path=f"optimizer/non_tensor_state/{name}")
        if STEP_KEY in decoded and not isinstance(decoded[STEP_KEY], torch.Tensor):
            check_step_value(decoded[STEP_KEY], field=f"optimizer/non_tensor_state/{name}/step", source=source)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    group_of = {name: saved_groups[i] for i, g in enumerate(document["param_groups"]) for name in g["params"]}
    index_of = {name: i for i, name in enumerate(names)}
    plan = OptimizerLoadPlan(names=names)
    for tensor_name, (dtype, shape) in stored.items():
        if not tensor_name.startswith(OPTIMIZER_STATE_PREFIX):
            continue  # tensors inside param groups or non-tensor state, resolved by name when decoding
        name, _, key = tensor_name[len(OPTIMIZER_STATE_PREFIX):].rpartition("/")
        if name not in index_of or not key:
            problems.append(f"{tensor_name}: names no parameter of the optimizer")
            continue
        param = params[index_of[name]]
        if key in PARAM_SHAPED_STATE and (shape != tuple(param.shape) or
                                          (param.is_floating_point() and dtype != param.dtype)):
            problems.append(f"{tensor_name}: saved {dtype} {list(shape)}, the parameter is {param.dtype} "
                            f"{list(param.shape)}")
            continue
        if key == STEP_KEY and math.prod(shape) != 1:
            problems.append(f"{tensor_name}: saved {dtype} {list(shape)}, expected a single step count")
            continue
        plan.targets[tensor_name] = target = _target(optimizer, param, key, dtype, shape, group_of[name], in_place)
        if target is not optimizer.state.get(param, {}).get(key):
            plan.new.add(tensor_name)
        if key == STEP_KEY:
            plan.steps.append(tensor_name)
    if problems:
        raise CheckpointMismatchError(f"{source}: the saved optimizer state does not fit the optimizer "
                                      f"({len(problems)} problem(s)):\n  " + "\n  ".join(problems[:50])
                                      + "\nBuild the same model and optimizer (dtypes, arguments) as when saving.")
    return plan


def _target(optimizer: torch.optim.Optimizer, param: torch.Tensor, key: str, dtype: torch.dtype,
            shape: tuple[int, ...], group: Mapping[str, Any], in_place: bool) -> torch.Tensor:
    """The existing state tensor of the final kind (filled in place), else a new one in that kind and the parameter's
    layout (contiguous when it is a CPU tensor read in place)."""
    final_dtype, device = _final_kind(param, key, dtype, group)
    existing = optimizer.state.get(param, {}).get(key)
    if (isinstance(existing, torch.Tensor) and existing.dtype == final_dtype and tuple(existing.shape) == shape
            and existing.device == device):
        return existing
    if (in_place and device.type == "cpu" and final_dtype == dtype and key != STEP_KEY
            and (tuple(param.shape) != shape or param.is_contiguous())):
        return torch.empty(shape, dtype=final_dtype)
    if tuple(param.shape) == shape and param.device == device and key != STEP_KEY:
        return torch.empty_like(param, dtype=final_dtype, memory_format=torch.preserve_format)
    return torch.empty(shape, dtype=final_dtype, device=device)


def decode_optimizer_state(tensors: Mapping[str, torch.Tensor], document: Mapping[str, Any],
                           current_groups: list[Mapping[str, Any]], *, source: str) -> dict[str, Any]:
    """The NAME-keyed optimizer state dict of the read ``tensors`` and the saved ``document``: each group with the
    saved hyper-parameters and its parameters listed as ``current_groups`` (as many, checked before) lists them.

    Raises:
        CheckpointMismatchError: a param group holds different parameters than when saved.
    """
    state: dict[str, dict[str, Any]] = {}
    for key, value in tensors.items():
        if key.startswith(OPTIMIZER_STATE_PREFIX):
            name, _, entry = key[len(OPTIMIZER_STATE_PREFIX):].rpartition("/")
            state.setdefault(name, {})[entry] = value
    for name, fields in document.get("non_tensor_state", {}).items():
        for entry, value in fields.items():
            state.setdefault(name, {})[entry] = decode_state(value, tensors, source=source,
                                                             path=f"optimizer/non_tensor_state/{name}/{entry}")
    groups = []
    for i, (group, current) in enumerate(zip(document["param_groups"], current_groups)):
        if set(group["params"]) != set(current["params"]):
            raise CheckpointMismatchError(f"{source}: param group {i} holds different parameters than when saved.")
        decoded = {k: decode_state(v, tensors, source=source) for k, v in group.items() if k != "params"}
        groups.append({**decoded, "params": list(current["params"])})
    return {"state": state, "param_groups": groups}


def load_by_position(optimizer: torch.optim.Optimizer, state: Mapping[str, Any]) -> None:
    """Install a NAME-keyed state dict through the optimizer's own ``load_state_dict`` (hooks and subclass logic run
    as upstream): its parameters by position, as it lists them; the tensors are final, so it keeps them."""
    position = {name: i for i, name in enumerate(name for group in state["param_groups"] for name in group["params"])}
    optimizer.load_state_dict({
        "state": {position[name]: fields for name, fields in state["state"].items()},
        "param_groups": [{**group, "params": [position[name] for name in group["params"]]}
                         for group in state["param_groups"]]})


def apply_optimizer_state(optimizer: torch.optim.Optimizer, plan: OptimizerLoadPlan,
                          tensors: Mapping[str, torch.Tensor], document: Mapping[str, Any], *, source: str) -> None:
    """Install the planned state from the read ``tensors`` (every tensor the document references)."""
    groups, offset = [], 0
    for current in optimizer.param_groups:
        groups.append({"params": plan.names[offset : offset + len(current["params"])]})
        offset += len(current["params"])
    load_by_position(optimizer, decode_optimizer_state(tensors, document, groups, source=source))
