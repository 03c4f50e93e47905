"""One rank's view of a DTensor: the box it holds (:func:`local_box`), its local tensor, and whether this rank
writes that box (:func:`writes_piece`). Pure reads of the mesh and placements (cached per mesh), no collectives.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from .._types import Box
from ._placements import PiecePlan, describe_mesh, plan_piece

__all__ = ["is_dtensor", "group_mesh", "local_box", "piece_plan", "writes_piece", "local_tensor"]


@functools.cache
def _dtensor_class() -> type:
    from torch.distributed.tensor import DTensor

    return DTensor


def is_dtensor(value: Any) -> bool:
    """Whether ``value`` is a ``torch.distributed.tensor.DTensor`` (imported on first use)."""
    return isinstance(value, _dtensor_class())


@functools.lru_cache(maxsize=16)
def group_mesh(group: Any, device_type: str) -> Any:
    """A 1-D ``DeviceMesh`` over a process group (cached: engines that shard over their own groups, DeepSpeed ZeRO and
    FSDP1, show their pieces as DTensors on it, without communication)."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(group, device_type)


def local_box(tensor: torch.Tensor, *, name: str = "tensor") -> Box:
    """The box of the global tensor this rank holds: a DTensor's local piece (on any mesh, with any placements:
    :func:`~hf_resumable.checkpoint.pieces._placements.plan_piece`), or all of a plain tensor.

    Raises:
        UnsupportedStateError: for a DTensor with a ``Partial`` placement (pending reduction), or whose pieces are
            not boxes (a ``_StridedShard`` that does not split evenly).
    """
    if not is_dtensor(tensor):
        return Box.whole(tensor.shape)
    plan = piece_plan(tensor, name)
    return Box(plan.offset, plan.shape)


def _per_mesh(function: Any) -> Any:
    """Cache ``function(mesh, *rest)`` by the mesh's identity (and ``rest``). Not ``functools.lru_cache``: it would
    compare meshes with ``DeviceMesh.__eq__`` on every hit, which costs more than the computation. The cache holds
    the meshes, so their ids are not reused."""
    cache: dict[tuple, tuple[Any, Any]] = {}

    @functools.wraps(function)
    def cached(mesh: Any, *rest: Any) -> Any:
        key = (id(mesh), *rest)
        hit = cache.get(key)
        if hit is not None and hit[0] is mesh:
            return hit[1]
        if len(cache) >= 65536:
            cache.clear()
        value = function(mesh, *rest)
        cache[key] = (mesh, value)
        return value

    return cached


_view_of = _per_mesh(describe_mesh)  # once per mesh, not once per tensor


@_per_mesh
def _plan_on(mesh: Any, shape: tuple[int, ...], placements: tuple, name: str) -> PiecePlan:
    view = _view_of(mesh)
    if view is None:  # not in the mesh: holds nothing of it
        return PiecePlan((0,) * len(shape), (0,) * len(shape), 0, False)
    return plan_piece(shape, placements, view, name=name)


def piece_plan(tensor: torch.Tensor, name: str) -> PiecePlan:
    """``plan_piece`` of a DTensor, cached per mesh."""
    return _plan_on(tensor.device_mesh, tuple(tensor.shape), tuple(tensor.placements), name)


def writes_piece(name: str, tensor: torch.Tensor, rank: int, owner: int = 0) -> bool:
    """Whether this rank writes its piece of ``tensor``: of a DTensor, if ``plan_piece`` elects it among the holders
    of its box; of a plain (replicated) tensor, if it is ``owner`` (``plan_replica_writers``)."""
    if not is_dtensor(tensor):
        return rank == owner
    return piece_plan(tensor, name).writes


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The piece this rank holds, detached: a DTensor's local shard, or the plain tensor itself."""
    if not is_dtensor(tensor):
        return tensor.detach()
    # The local shard itself (what to_local() returns, without its autograd Function: this runs for every
    # tensor at every save, on the training loop's time).
    local = getattr(tensor, "_local_tensor", None)
    return (local if isinstance(local, torch.Tensor) else tensor.to_local()).detach()
