"""Where a DTensor's piece sits, and which rank writes it: pure planning from placements and mesh coordinates
(no process group, no tensor), so every rank computes every other rank's answer without a collective. A
``_StridedShard`` split is refused where it leaves a rank elements that are not one box; :func:`describe_mesh` is
the one reader of a ``DeviceMesh``. See docs/multi-gpu.md#pieces-of-any-dtensor-placement-tensor-parallel-n-d-meshes.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ...errors import CheckpointMismatchError, UnsupportedStateError

logger = logging.getLogger(__name__)

__all__ = ["MeshView", "PiecePlan", "plan_piece", "check_tiling", "check_copies_agree", "describe_mesh",
           "REPORT_COPIES"]

REPORT_COPIES = "copies"  # in a rank's layout report: {name: {"offset", "sample"}} of pieces held in mesh copies


@dataclass(frozen=True)
class MeshView:
    """One rank's view of a ``DeviceMesh``, as plain integers: its shape, this rank's coordinate, how many copies
    of the mesh the job holds (a sub-mesh sliced out of a larger one has one per coordinate of the dimensions it
    leaves out; each holds the same tensors) and which copy this rank is in."""

    shape: tuple[int, ...]
    coordinate: tuple[int, ...]
    copies: int = 1
    copy: int = 0

    def __post_init__(self) -> None:
        if len(self.shape) != len(self.coordinate) or any(not 0 <= c < n for c, n in zip(self.coordinate, self.shape)):
            raise ValueError(f"coordinate {self.coordinate} is not in a mesh of shape {self.shape}.")
        if not 0 <= self.copy < self.copies:
            raise ValueError(f"copy {self.copy} is not one of {self.copies} copies.")


@dataclass(frozen=True)
class PiecePlan:
    """The box of one tensor a rank holds, how many ranks hold the same box, whether this rank writes it, and how
    many copies of the mesh hold it (more than 1: nothing says the copies are equal, so a save compares them)."""

    offset: tuple[int, ...]
    shape: tuple[int, ...]
    holders: int
    writes: bool
    copies: int = 1


@functools.lru_cache(maxsize=4096)
def _box(shape: tuple[int, ...], placements: tuple, mesh_shape: tuple[int, ...], coordinate: tuple[int, ...]
         ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    local_shape, offset = _compute_local_shape_and_global_offset(shape, mesh_shape, list(coordinate), placements)
    return tuple(int(x) for x in offset), tuple(int(x) for x in local_shape)


def check_tiling(shape: tuple[int, ...], placements: tuple, mesh_shape: tuple[int, ...], *, name: str = "tensor"
                 ) -> None:
    """Refuse a layout whose pieces are not boxes that tile the tensor (pure). Each tensor dimension is checked alone
    (over the mesh dimensions that shard it, the distinct ranges must follow each other from 0 to its size); only a
    ``_StridedShard`` split can fail.

    Raises:
        UnsupportedStateError: naming the tensor and its placements.

    Example:

    ```python
    >>> from torch.distributed.tensor import Shard
    >>> from torch.distributed.tensor.placement_types import _StridedShard
    >>> check_tiling((8,), (_StridedShard(0, split_factor=2), Shard(0)), (2, 2))  # FSDP2 over TP: boxes
    >>> check_tiling((8,), (Shard(0), _StridedShard(0, split_factor=2)), (2, 2), name="w")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    hf_resumable.errors.UnsupportedStateError: 'w': with placements ...
    ```
    """
    if any(type(p).__name__ == "_StridedShard" for p in placements):  # Shard and Replicate always tile
        _check_strided_tiling(tuple(shape), tuple(placements), tuple(mesh_shape), name)


@functools.lru_cache(maxsize=1024)
def _check_strided_tiling(shape: tuple[int, ...], placements: tuple, mesh_shape: tuple[int, ...], name: str) -> None:
    for dim, size in enumerate(shape):
        splitting = [i for i, p in enumerate(placements) if getattr(p, "dim", None) == dim and not p.is_replicate()]
        ranges = set()
        for chosen in itertools.product(*(range(mesh_shape[i]) for i in splitting)):
            coordinate = [0] * len(mesh_shape)
            for i, c in zip(splitting, chosen):
                coordinate[i] = c
            offset, local = _box(shape, placements, mesh_shape, tuple(coordinate))
            if local[dim]:
                ranges.add((offset[dim], local[dim]))
        end = 0
        for start, length in sorted(ranges):
            if start != end:
                break
            end = start + length
        if end != size or sum(length for _, length in ranges) != size:
            raise UnsupportedStateError(
                f"{name!r}: with placements {placements} on a mesh of shape {list(mesh_shape)}, a rank's elements of "
                f"dimension {dim} of the global shape {list(shape)} are not one contiguous range, which a piece file "
                "cannot describe. Save it with sizes the strided sharding splits evenly, or redistribute() it to "
                "Shard/Replicate placements.")


def plan_piece(shape: Sequence[int], placements: Sequence[Any], mesh: MeshView, *, name: str) -> PiecePlan:
    """The box of ``name`` (global ``shape``) this rank holds under ``placements`` on ``mesh``, and whether this rank
    writes it (pure: every rank computes the same writer for every box).

    The holders of a box are the ranks that differ from this one only in the mesh dimensions ``placements`` replicate
    over, in every copy of the mesh. They are numbered copy first, then by their replicated coordinates; the writer is
    the one numbered ``(crc32(name) + b) % holders``, ``b`` the index of the box among the tensor's boxes, so the
    writes of a model's replicated pieces spread over the ranks.

    Raises:
        UnsupportedStateError: for a ``Partial`` placement, or pieces that are not boxes (:func:`check_tiling`).
        ValueError: if there are not as many placements as mesh dimensions.

    Example:

    ```python
    >>> from torch.distributed.tensor import Replicate, Shard
    >>> # an RMSNorm weight: sharded over dp_shard (2), on a sub-mesh with one copy per tp coordinate (2)
    >>> [plan_piece((4,), (Shard(0),), MeshView((2,), (d,), copies=2, copy=t), name="norm.weight").writes
    ...  for d in range(2) for t in range(2)]
    [False, True, True, False]
    >>> plan_piece((4, 6), (Shard(1), Replicate()), MeshView((3, 2), (2, 1)), name="w")
    PiecePlan(offset=(0, 4), shape=(4, 2), holders=2, writes=False, copies=1)
    ```
    """
    shape, placements = tuple(int(x) for x in shape), tuple(placements)
    if len(placements) != len(mesh.shape):
        raise ValueError(f"{name!r}: {len(placements)} placement(s) for a mesh of {len(mesh.shape)} dimension(s).")
    if any(p.is_partial() for p in placements):
        raise UnsupportedStateError(
            f"{name!r}: a DTensor with placements {placements} holds a pending reduction (Partial); call "
            "redistribute() to Shard or Replicate before saving.")
    check_tiling(shape, placements, mesh.shape, name=name)
    offset, local_shape = _box(shape, placements, mesh.shape, mesh.coordinate)
    replicated = [i for i, p in enumerate(placements) if p.is_replicate()]
    sharded = [i for i in range(len(placements)) if i not in replicated]
    holders = mesh.copies * math.prod(mesh.shape[i] for i in replicated)
    number = _linear([mesh.copy, *(mesh.coordinate[i] for i in replicated)],
                     [mesh.copies, *(mesh.shape[i] for i in replicated)])
    box_index = _linear([mesh.coordinate[i] for i in sharded], [mesh.shape[i] for i in sharded])
    writer = (zlib.crc32(name.encode()) + box_index) % holders
    return PiecePlan(offset, local_shape, holders, number == writer, mesh.copies)


def _linear(coordinate: Sequence[int], sizes: Sequence[int]) -> int:
    """Row-major index of ``coordinate`` in a grid of ``sizes``."""
    index = 0
    for c, n in zip(coordinate, sizes):
        index = index * n + c
    return index


def describe_mesh(mesh: Any) -> MeshView | None:
    """This rank's :class:`MeshView` of a ``DeviceMesh``, or ``None`` if this rank is not in it. The copies of a
    sliced mesh are the rows of torch's mesh layout (``_layout.remap_to_tensor(_rank_map)``); a mesh without that
    record counts as its only copy, and the save's coverage check refuses what that misses.
    """
    import torch

    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return None
    shape = tuple(int(n) for n in mesh.shape)
    copies, copy = 1, 0
    try:
        every = mesh._layout.remap_to_tensor(mesh._rank_map).reshape(-1, math.prod(shape))
    except (AttributeError, RuntimeError, TypeError):  # no layout record: this mesh is its only copy
        every = None
    if every is not None and every.shape[0] > 1:
        mine = mesh.mesh.reshape(-1)
        rows = [i for i in range(every.shape[0]) if torch.equal(every[i], mine)]
        if rows:
            copies, copy = int(every.shape[0]), rows[0]
    return MeshView(shape, tuple(int(c) for c in coordinate), copies, copy)


def check_copies_agree(reports: list[Mapping[str, Any]], *, source: str) -> None:
    """Refuse a save in which the copies of one piece differ (pure), e.g. replicas whose gradients were never
    averaged, of which a checkpoint could keep only one.

    Raises:
        CheckpointMismatchError: naming the tensors (the save commits nothing).

    Example:

    ```python
    >>> check_copies_agree([{"copies": {"w": {"offset": [0], "sample": "a"}}},  # doctest: +ELLIPSIS
    ...                     {"copies": {"w": {"offset": [0], "sample": "b"}}}], source="x")
    Traceback (most recent call last):
    ...
    hf_resumable.errors.CheckpointMismatchError: x: the copies of 1 tensor(s) held by several ranks differ (['w'])...
    ```
    """
    seen: dict[tuple[str, tuple[int, ...]], str] = {}
    wrong = set()
    for report in reports:
        for name, entry in (report.get(REPORT_COPIES) or {}).items():
            if seen.setdefault((name, tuple(entry["offset"])), entry["sample"]) != entry["sample"]:
                wrong.add(name)
    if wrong:
        raise CheckpointMismatchError(
            f"{source}: the copies of {len(wrong)} tensor(s) held by several ranks differ ({sorted(wrong)[:5]}), so "
            "no one of them is the model. Nothing was committed. The ranks that hold them (the same DTensor piece "
            "on copies of a sub-mesh, e.g. the tensor-parallel groups of different data-parallel ranks) must stay "
            "in sync: average their gradients (FSDP2 or DDP over the data-parallel dimensions).")
