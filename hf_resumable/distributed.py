"""Small, pickle-free collectives over ``torch.distributed`` (works with gloo on CPU).

``all_gather_object`` and ``broadcast_object_list`` pickle their payloads; checkpoint coordination
only ever needs JSON, so it is sent as UTF-8 bytes in uint8 tensors instead.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

__all__ = ["is_distributed", "rank_and_world_size", "barrier", "all_gather_json", "broadcast_json", "checkpoint_group"]


def is_distributed() -> bool:
    """True when a default process group with more than one rank is initialized."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank_and_world_size() -> tuple[int, int]:
    """``(rank, world_size)``, ``(0, 1)`` outside torch.distributed."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def barrier(group: dist.ProcessGroup | None = None) -> None:
    """``dist.barrier()`` when distributed, else nothing."""
    if is_distributed():
        dist.barrier(group=group)


def _device(group: dist.ProcessGroup | None) -> torch.device:
    backend = dist.get_backend(group)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_json(value: Any, *, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's ``value`` (JSON-able), in rank order, on every rank (of ``group``, default: the world)."""
    if not is_distributed():
        return [value]
    device = _device(group)
    payload = torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8).to(device)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, torch.tensor([payload.numel()], dtype=torch.int64, device=device), group=group)
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: payload.numel()] = payload
    gathered = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in sizes]
    dist.all_gather(gathered, padded, group=group)
    return [json.loads(bytes(g[: int(s.item())].cpu().tolist()).decode()) for g, s in zip(gathered, sizes)]


def broadcast_json(value: Any, *, src: int = 0, group: dist.ProcessGroup | None = None) -> Any:
    """``value`` from rank ``src`` (JSON-able), on every rank."""
    if not is_distributed():
        return value
    return all_gather_json(value if dist.get_rank() == src else None, group=group)[src]


_side: dict[int, dist.ProcessGroup] = {}


def checkpoint_group() -> dist.ProcessGroup | None:
    """A gloo process group of all ranks that only checkpoint commits use (``None`` outside torch.distributed).

    Background saves gather their file records and agree on the commit over it, so their collectives never
    interleave with the training loop's on the default group. Created on first use, which is collective
    (every rank calls it at the same point: a save); re-created after the default group is.
    """
    if not is_distributed():
        return None
    key = id(dist.distributed_c10d._get_default_group())
    if key not in _side:
        _side.clear()
        _side[key] = dist.new_group(backend="gloo")
    return _side[key]
