"""Parameters partitioned flat across ranks (DeepSpeed ZeRO-3's ``ds_tensor``) as DTensor pieces of the sharded format.

Under ZeRO-3 a parameter's ``data`` is empty (or, for a small "persistent" parameter, a gathered copy) and each rank
holds ``ds_tensor``: its partition of the flattened parameter, ``ceil(numel / world)`` elements (the last ones
padding). That is exactly the piece a ``DTensor`` of global shape ``(numel,)`` sharded on dim 0 over the parameter's
process group holds (``torch.chunk`` sizes), so a sharded checkpoint stores every rank's partition of every weight
under the parameter's own name, with the same writer, layout, hashes and verification as FSDP2 pieces, and loads it
back into the partitions at the same world size. The global shape recorded is the flattened one: the partitions are
of the flat parameter.

Nothing here imports deepspeed: partitioned parameters are recognised by their attributes (``ds_tensor``,
``ds_numel``, ``ds_process_group``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from ._sharded import group_mesh

logger = logging.getLogger(__name__)

__all__ = ["is_partitioned", "partitioned_state", "partitioned_views", "load_partitioned_state"]


def _is_partitioned_parameter(value: Any) -> bool:
    return getattr(value, "ds_tensor", None) is not None and hasattr(value, "ds_numel")


def is_partitioned(model: torch.nn.Module | None) -> bool:
    """Whether ``model``'s parameters are partitioned by DeepSpeed ZeRO-3 (``ds_tensor``)."""
    return model is not None and any(_is_partitioned_parameter(p) for p in model.parameters())


def _held(parameter: Any) -> torch.Tensor:
    """The valid part of this rank's partition (padding cut off): what ``torch.chunk`` gives this rank."""
    size = parameter.ds_tensor.numel()
    rank = torch.distributed.get_rank(parameter.ds_process_group)
    return parameter.ds_tensor.detach().view(-1).narrow(0, 0, max(0, min(size, parameter.ds_numel - rank * size)))


def _piece(parameter: Any) -> torch.Tensor:
    from torch.distributed.tensor import DTensor, Shard

    local = _held(parameter)
    mesh = group_mesh(parameter.ds_process_group, local.device.type)
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=(int(parameter.ds_numel),),
                              stride=(1,))


def partitioned_state(model: torch.nn.Module, state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` (FQN-keyed, as ``get_model_state_dict`` gives it) with every partitioned parameter replaced by its
    piece: a DTensor of the flattened parameter over its process group, whose local tensor is the partition itself
    (tied names get the same piece, so the writer stores it once)."""
    parameters = dict(model.state_dict(keep_vars=True))
    pieces: dict[int, torch.Tensor] = {}
    result = {}
    for name, value in state.items():
        parameter = parameters.get(name)
        if _is_partitioned_parameter(parameter):
            if id(parameter) not in pieces:
                pieces[id(parameter)] = _piece(parameter)
            value = pieces[id(parameter)]
        result[name] = value
    return result


def partitioned_views(model: torch.nn.Module) -> dict[str, list[int]]:
    """``{name: shape}`` of every partitioned parameter (tied names included): the layout records it next to the
    flattened global shape (``"view"``), so a consolidation, or a load into a model that is not partitioned, gives
    each weight its own shape back."""
    return {name: [int(x) for x in parameter.ds_shape] for name, parameter in model.state_dict(keep_vars=True).items()
            if _is_partitioned_parameter(parameter) and hasattr(parameter, "ds_shape")}


def load_partitioned_state(model: torch.nn.Module, filled: Mapping[str, Any]) -> dict[str, Any]:
    """Copy the pieces of ``filled`` (from :func:`partitioned_state` templates) into the partitions; return the
    entries that are not partitioned (buffers) for the caller to load.

    Parameters ZeRO-3 keeps gathered (``ds_persist``, or gathered at the time) are released and gathered again from
    the loaded partitions, as DeepSpeed does after loading its own checkpoints: a collective over their group.
    """
    parameters = dict(model.state_dict(keep_vars=True))
    rest, gathered = {}, {}
    for name, value in filled.items():
        parameter = parameters.get(name)
        if not _is_partitioned_parameter(parameter):
            rest[name] = value
            continue
        local = value.to_local() if hasattr(value, "to_local") else value
        with torch.no_grad():
            _held(parameter).copy_(local.view(-1))
        if parameter.numel():  # gathered: its full data is refreshed from the partitions below
            gathered[id(parameter)] = parameter
    if gathered:
        held = list(gathered.values())
        held[0].partition(held)
        held[0].all_gather(held)
        logger.debug("Gathered %d persistent ZeRO-3 parameters again from the loaded partitions.", len(held))
    return rest
