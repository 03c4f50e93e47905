"""The checkpoint package's shared vocabulary, at the bottom of ``checkpoint/`` (it imports nothing from it): what a
rank writes (:class:`Payload` of :class:`TensorFile` and :class:`IndexSpec`) and where a piece of a tensor sits
(:class:`Box`, :func:`intersect_boxes`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import CorruptCheckpointError
from ..format.rng import RngState

__all__ = ["Box", "IndexSpec", "Payload", "TensorFile", "intersect_boxes"]


@dataclass
class TensorFile:
    """One safetensors file to write."""

    relpath: str
    tensors: list[tuple[str, torch.Tensor]]
    metadata: dict[str, str] | None = None


@dataclass
class IndexSpec:
    """An index file to write after its shards, with their hashes in the metadata."""

    relpath: str
    weight_map: dict[str, str]
    metadata: dict[str, Any]


@dataclass
class Payload:
    """Everything one rank writes for one checkpoint."""

    tensor_files: list[TensorFile] = field(default_factory=list)
    blobs: dict[str, bytes] = field(default_factory=dict)
    indexes: list[IndexSpec] = field(default_factory=list)
    rng: RngState | None = None
    rng_relpath: str | None = None
    # Tensor files every rank holds the same bytes of (a DDP replica's model and optimizer): split across the ranks
    # that hold them (see ``_replicas.py``).
    replicated: set[str] = field(default_factory=set)


@dataclass(frozen=True)
class Box:
    """A box of a global tensor: ``offset`` and ``shape`` per dimension (both empty for a 0-d tensor)."""

    offset: tuple[int, ...]
    shape: tuple[int, ...]

    @classmethod
    def whole(cls, shape: tuple[int, ...]) -> "Box":
        """All of a tensor of ``shape``."""
        return cls((0,) * len(shape), tuple(int(n) for n in shape))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def slices(self, origin: "Box") -> tuple[slice, ...]:
        """This box as slices of a tensor holding ``origin`` (a box that contains it)."""
        return tuple(slice(o - p, o - p + n) for o, p, n in zip(self.offset, origin.offset, self.shape))

    def to_json(self) -> dict[str, list[int]]:
        return {"offset": list(self.offset), "shape": list(self.shape)}

    @classmethod
    def from_json(cls, document: Mapping[str, Any], *, source: str) -> "Box":
        try:
            offset, shape = tuple(int(x) for x in document["offset"]), tuple(int(x) for x in document["shape"])
        except (KeyError, TypeError, ValueError) as err:
            raise CorruptCheckpointError(f"{source}: malformed piece entry {document!r} ({err}).") from None
        if len(offset) != len(shape) or any(x < 0 for x in offset + shape):
            raise CorruptCheckpointError(f"{source}: malformed piece entry {document!r}.")
        return cls(offset, shape)


def intersect_boxes(a: Box, b: Box) -> Box | None:
    """The box both ``a`` and ``b`` cover, or ``None`` if they do not overlap.

    Example:

    ```python
    >>> intersect_boxes(Box((0, 0), (4, 3)), Box((2, 0), (4, 3)))
    Box(offset=(2, 0), shape=(2, 3))
    >>> intersect_boxes(Box((0,), (2,)), Box((2,), (2,))) is None
    True
    ```
    """
    if len(a.offset) != len(b.offset):
        raise ValueError(f"Boxes of different rank: {a} and {b}.")
    lows = [max(x, y) for x, y in zip(a.offset, b.offset)]
    highs = [min(x + m, y + n) for x, m, y, n in zip(a.offset, a.shape, b.offset, b.shape)]
    if any(hi <= lo for lo, hi in zip(lows, highs)):
        return None
    return Box(tuple(lows), tuple(hi - lo for lo, hi in zip(lows, highs)))
