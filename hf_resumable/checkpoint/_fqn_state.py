"""FQN-keyed state dicts of a (sharded) model and its optimizer, as torch.distributed.checkpoint returns them.

``get_model_state_dict`` / ``get_optimizer_state_dict`` (torch.distributed.checkpoint.state_dict) key the state by
parameter FQN whatever wraps the model (FSDP, DDP, ``torch.compile``, activation checkpointing). Most of their cost is
the name translation: every parameter's path is walked (``_get_fqns``) at every call, on the training loop's time.
The translation depends only on the module tree and the optimizer's parameter list, so it is learned once and reused
while both are provably the same:

* the model: ``model.state_dict()`` (what torch's function reads too), reused as is when torch's answer for this
  very tree was the same keys over the same tensors (no wrapper renames anything: FSDP2, plain modules);
* the optimizer: ``optimizer.state_dict()`` with its parameter indices renamed to the FQNs torch gave them, while
  the optimizer lists the same parameter objects and the model names them the same way.

The proof is checked at every call (the module tree's names and classes, the state-dict keys, the parameters'
identities): a change of structure (a wrapper, a new submodule, a new param group, another optimizer) falls back to
torch's functions, whose answer is checked against the fast one and learned again. Anything torch answers
differently (FSDP1's flat parameters, DDP or compile prefixes) is never cached.

Example:

```python
>>> weights = model_state_dict(model)  # doctest: +SKIP
>>> optimizer_state = optimizer_state_dict(model, optimizer)  # doctest: +SKIP
```
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)

__all__ = ["model_state_dict", "optimizer_state_dict"]


def _options() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions()


def _tree(model: torch.nn.Module) -> tuple:
    """The module tree's names and classes: what torch's FQN translation depends on (besides the names)."""
    return tuple((name, type(module)) for name, module in model.named_modules(remove_duplicate=False))


def _kind(value: Any) -> type:
    """The type of a state-dict entry, a plain ``nn.Parameter`` counted as the tensor it wraps (``keep_vars=True``
    gives the parameter, a detached entry the tensor)."""
    return torch.Tensor if type(value) is torch.nn.Parameter else type(value)


def _same_tensor(a: Any, b: Any) -> bool:
    """Whether two state-dict entries view the same bytes the same way (DTensors: the same local piece, placed the
    same way). Empty tensors hold no bytes: the same kind and shape is the same; meta tensors are never proven."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or _kind(a) is not _kind(b):
        return a is b
    from torch.distributed.tensor import DTensor

    if isinstance(a, DTensor):
        if a.device_mesh != b.device_mesh or a.placements != b.placements or a.shape != b.shape:
            return False
        a, b = a._local_tensor, b._local_tensor
    if a.device.type == "meta" or a.device != b.device or a.dtype != b.dtype or a.shape != b.shape:
        return False
    if not a.numel():
        return True
    return (a.stride() == b.stride() and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
            and a.storage_offset() == b.storage_offset())


@dataclass(frozen=True)
class _ModelProof:
    """torch's answer for this tree was ``model.state_dict()`` itself, with these keys."""

    tree: tuple
    keys: tuple[str, ...]


# model -> proof; weak, so a model's entry goes with it.
_MODELS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def model_state_dict(model: torch.nn.Module, *, keep_vars: bool = False) -> dict[str, Any]:
    """``get_model_state_dict(model)`` (FQN keys; DTensor pieces under FSDP2), without its per-call name walk when
    the model's tree and keys are those of a call whose answer was ``model.state_dict()`` unchanged.

    ``keep_vars``: on that fast path, the parameters and buffers themselves (``state_dict(keep_vars=True)``), not
    detached copies: a save reads their bytes and never computes with them, and detaching a DTensor goes through
    its dispatcher, at every save. Loads fill the
    entries in place, so they take detached ones."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    tree = _tree(model)
    proof = _MODELS.get(model)
    raw = model.state_dict(keep_vars=keep_vars)
    if proof is not None and proof.tree == tree and proof.keys == tuple(raw):
        return raw
    state = get_model_state_dict(model, options=_options())
    if list(state) == list(raw) and all(_same_tensor(state[k], raw[k]) for k in state):
        _MODELS[model] = _ModelProof(tree, tuple(raw))
    else:
        _MODELS.pop(model, None)
        logger.debug("model state dict: torch renames keys for this model; not cached")
    return state


@dataclass(frozen=True)
class _OptimizerProof:
    """torch renamed ``optimizer.state_dict()``'s parameter indices to these FQNs (index order) for this model."""

    model: weakref.ref
    tree: tuple
    parameters: tuple[tuple[str, int], ...]  # the model's (name, id) of every parameter
    listed: tuple[int, ...]  # id of every parameter the optimizer lists, in index order
    fqns: tuple[str, ...]


_OPTIMIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _listed(optimizer: torch.optim.Optimizer) -> tuple[int, ...]:
    return tuple(id(p) for group in optimizer.param_groups for p in group["params"])


def _renamed(raw: Mapping[str, Any], fqns: tuple[str, ...]) -> dict[str, Any] | None:
    """``optimizer.state_dict()`` with its indices replaced by ``fqns`` (None when an index is out of range)."""
    try:
        state = {fqns[index]: fields for index, fields in raw["state"].items()}
        groups = [{**group, "params": [fqns[index] for index in group["params"]]} for group in raw["param_groups"]]
    except (IndexError, TypeError):
        return None
    return {"state": state, "param_groups": groups}


def _learn(raw: Mapping[str, Any], state: Mapping[str, Any]) -> tuple[str, ...] | None:
    """The FQN of each index of ``raw`` if ``state`` (torch's answer) is exactly ``raw`` renamed, else None."""
    if len(raw["param_groups"]) != len(state["param_groups"]):
        return None
    fqns: list[str] = []
    for mine, theirs in zip(raw["param_groups"], state["param_groups"]):
        if len(mine["params"]) != len(theirs["params"]) or mine["params"] != list(range(len(fqns), len(fqns) +
                                                                                     len(mine["params"]))):
            return None
        fqns += [str(name) for name in theirs["params"]]
    renamed = _renamed(raw, tuple(fqns))
    if renamed is None or len(set(fqns)) != len(fqns) or list(renamed["state"]) != list(state["state"]):
        return None
    for fqn, fields in renamed["state"].items():
        other = state["state"][fqn]
        if list(fields) != list(other) or any(fields[k] is not other[k] for k in fields):
            return None
    for mine, theirs in zip(renamed["param_groups"], state["param_groups"]):
        if list(mine) != list(theirs) or any(mine[k] is not theirs[k] for k in mine if k != "params"):
            return None
    return tuple(fqns)


def optimizer_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``get_optimizer_state_dict(model, optimizer)`` (state and groups keyed by parameter FQN), without its
    per-call name walk while the optimizer lists the same parameters, which the model names the same way, as in a
    call whose answer was ``optimizer.state_dict()`` renamed.

    Like torch's function, it initializes the state of an optimizer that has not stepped yet (the caller drops it).
    """
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    tree = _tree(model)
    parameters = tuple((name, id(p)) for name, p in model.named_parameters(remove_duplicate=False))
    listed = _listed(optimizer)
    proof = _OPTIMIZERS.get(optimizer)
    if (proof is not None and optimizer.state and proof.model() is model and proof.tree == tree
            and proof.parameters == parameters and proof.listed == listed):
        renamed = _renamed(optimizer.state_dict(), proof.fqns)
        if renamed is not None:
            return renamed
    state = get_optimizer_state_dict(model, optimizer, options=_options())
    fqns = _learn(optimizer.state_dict(), state) if optimizer.state else None
    if fqns is not None:
        _OPTIMIZERS[optimizer] = _OptimizerProof(weakref.ref(model), tree, parameters, listed, fqns)
    else:
        _OPTIMIZERS.pop(optimizer, None)
    return state
