"""FSDP1's ``ShardedTensor`` state as pieces: its local shard is the piece a DTensor sharded on dim 0 over the same
group holds, so a save re-wraps it (no copy) and a load copies the pieces back into the templates FSDP1's load reads.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, MutableMapping
from typing import Any

import torch

from ...errors import UnsupportedStateError
from ._dtensor import group_mesh, local_box

logger = logging.getLogger(__name__)

__all__ = ["is_sharded_tensor", "as_dtensors", "into_sharded_tensors", "optimizer_as_dtensors",
           "optimizer_into_sharded_tensors"]


def is_sharded_tensor(value: Any) -> bool:
    """Whether ``value`` is a ``torch.distributed._shard`` ``ShardedTensor`` (FSDP1's sharded state dict)."""
    if type(value).__name__ != "ShardedTensor":  # cheap test first: most entries are plain tensors or DTensors
        return False
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    return isinstance(value, ShardedTensor)


def _piece(name: str, value: Any, device: torch.device) -> torch.Tensor:
    """The local shard of ``value`` as a DTensor sharded on dim 0 over its process group (the local tensor itself).

    Raises:
        UnsupportedStateError: a sharding that is not one chunk of dim 0 per rank over every rank.
    """
    from torch.distributed.tensor import DTensor, Shard

    group = value._process_group
    shards = value.local_shards()
    shape = tuple(value.size())
    if torch.distributed.get_world_size(group) != torch.distributed.get_world_size() or len(shards) > 1:
        raise UnsupportedStateError(
            f"{name!r}: FSDP1 shards it over {torch.distributed.get_world_size(group)} of "
            f"{torch.distributed.get_world_size()} ranks ({len(shards)} local shard(s)); hf_resumable stores FSDP1 "
            "pieces sharded over every rank only (FULL_SHARD or SHARD_GRAD_OP, not a hybrid sharding strategy).")
    if shards:
        local = shards[0].tensor
    else:
        local = torch.empty((0, *shape[1:]), dtype=value.dtype, device=device)
    stride = torch.empty(shape, device="meta").stride()
    piece = DTensor.from_local(local, group_mesh(group, local.device.type), [Shard(0)], run_check=False, shape=shape,
                               stride=stride)
    if shards and tuple(shards[0].metadata.shard_offsets) != local_box(piece).offset:
        raise UnsupportedStateError(
            f"{name!r}: FSDP1's shard at offset {list(shards[0].metadata.shard_offsets)} is not the chunk of dim 0 "
            f"this rank holds in a DTensor sharding ({list(local_box(piece).offset)}); it cannot be stored.")
    return piece


def as_dtensors(state: Mapping[str, Any], *, device: torch.device,
                originals: MutableMapping[str, Any] | None = None) -> dict[str, Any]:
    """``state`` with every ``ShardedTensor`` replaced by its DTensor piece (:func:`_piece`); other entries as they
    are. ``originals``, if given, receives the replaced ``ShardedTensor`` of each name (for
    :func:`into_sharded_tensors`). ``device``: where an empty piece (a rank holding no chunk) is created."""
    result = {}
    for name, value in state.items():
        if is_sharded_tensor(value):
            if originals is not None:
                originals[name] = value
            value = _piece(name, value, device)
        result[name] = value
    return result


def into_sharded_tensors(filled: Mapping[str, Any], originals: Mapping[str, Any]) -> dict[str, Any]:
    """``filled`` with each name of ``originals`` replaced by its ``ShardedTensor``, whose local shard now holds the
    loaded piece (copied in): what FSDP1's load reads."""
    result = dict(filled)
    for name, sharded in originals.items():
        if name not in result:
            continue
        value = result[name]
        local = value.to_local() if hasattr(value, "to_local") else value
        shards = sharded.local_shards()
        if shards:
            with torch.no_grad():
                shards[0].tensor.copy_(local)
        result[name] = sharded
    return result


def optimizer_as_dtensors(state: Mapping[str, Any], *, device: torch.device,
                          originals: MutableMapping[str, Any] | None = None) -> dict[str, Any]:
    """:func:`as_dtensors` of every parameter's entry of an FQN-keyed optimizer state dict (``originals``, if
    given, receives ``{fqn: {key: ShardedTensor}}``)."""
    converted = {}
    for fqn, fields in state["state"].items():
        mine: dict[str, Any] = {}
        converted[fqn] = as_dtensors(fields, device=device, originals=mine)
        if mine and originals is not None:
            originals[fqn] = mine
    return {**state, "state": converted}


def optimizer_into_sharded_tensors(state: Mapping[str, Any], originals: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`into_sharded_tensors` of every parameter's entry of an optimizer state dict."""
    restored = {fqn: into_sharded_tensors(fields, originals.get(fqn, {})) for fqn, fields in state["state"].items()}
    return {**state, "state": restored}
