"""Replicas share the save: what every rank holds alike is split across the ranks by a PURE plan, once step 1 of
the commit protocol agreed that they hold the same files (docs/architecture.md, "Commit protocol").
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import replace

from ..._tuning import tuning_options
from .._types import Payload

__all__ = ["plan_replica_writers", "replica_signature", "replicas_split", "part_of_rank", "split_replicas"]


def plan_replica_writers(sizes: Mapping[str, int], world_size: int, *, split: bool = True) -> dict[str, int]:
    """Which rank writes each item that every rank holds alike (a whole file or a whole tensor), balanced by bytes
    (pure): the largest item first, each to the rank with the fewest bytes so far (ties: the lower rank; equal sizes:
    by name). An item the plan leaves out is rank 0's; ``split=False`` leaves out every item.

    Raises:
        `ValueError`: ``world_size`` is below 1.

    Example:

    ```python
    >>> plan_replica_writers({"model.safetensors": 4, "optimizer-00001-of-00002.safetensors": 5,
    ...                       "optimizer-00002-of-00002.safetensors": 3}, 2)
    {'optimizer-00001-of-00002.safetensors': 0, 'model.safetensors': 1, 'optimizer-00002-of-00002.safetensors': 1}
    >>> plan_replica_writers({"model.safetensors": 4}, 2, split=False)
    {}
    ```
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}.")
    if not split:
        return {}
    loads = [0] * world_size
    writers: dict[str, int] = {}
    for relpath in sorted(sizes, key=lambda name: (-sizes[name], name)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        writers[relpath] = rank
        loads[rank] += sizes[relpath]
    return writers


def split_replicas() -> bool:
    """Whether this process may split what the ranks hold alike (``HF_RESUMABLE_SPLIT_REPLICAS`` is not ``0``)."""
    return tuning_options().split_replicas


def replica_signature(payload: Payload) -> str | None:
    """What must be the same on every rank for the replicated files to be split (a digest of their names, metadata and
    tensors' names, dtypes and shapes), or ``None`` where this rank does not take part."""
    if not payload.replicated or not split_replicas():
        return None
    described = [[f.relpath, f.metadata, [[name, str(t.dtype), list(t.shape)] for name, t in f.tensors]]
                 for f in payload.tensor_files if f.relpath in payload.replicated]
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()


def replicas_split(signatures: list[str | None]) -> bool:
    """Whether a save is split: more than one rank, and every rank sent the same signature."""
    return len(signatures) > 1 and signatures[0] is not None and all(s == signatures[0] for s in signatures)


def part_of_rank(payload: Payload, rank: int, world_size: int, *, split: bool) -> Payload:
    """The part of ``payload`` this rank writes: its own files, plus the replicated files the plan gives it (``split``)
    or, unsplit, all of them on rank 0. Rank 0 keeps the indexes: the writer writes one as soon as every shard it names
    has a record here, else after the gather (``_writer.write_payload``, ``finish_save``)."""
    if not payload.replicated:
        return payload
    sizes = {f.relpath: sum(t.numel() * t.element_size() for _, t in f.tensors) for f in payload.tensor_files
             if f.relpath in payload.replicated}
    writers = plan_replica_writers(sizes, world_size, split=split)
    keep = [f for f in payload.tensor_files
            if f.relpath not in payload.replicated or writers.get(f.relpath, 0) == rank]
    return replace(payload, tensor_files=keep, indexes=payload.indexes if rank == 0 else [])
