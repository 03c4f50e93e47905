"""Copy tensors into host staging buffers as fast as this machine's memory allows.

An async save stalls training only for this copy, so it is the one hot loop of the async path.
The bytes are split into one contiguous stretch per thread (a pure plan, :func:`plan_stretches`)
and each stretch is copied with the GIL released by ``hf_resumable._fastcopy`` (non-temporal
stores: a staging buffer is read back only much later, so caching it is pure cost), or by the C
library's ``memmove`` where the extension was not built. Measured on a 2-core AMD EPYC VM (shared, loaded)
for 175 MB in 17.5 MB tensors on one thread: ``memmove`` 48-91 ms, the non-temporal copy 38-66 ms (an earlier
version that interleaved four pages per step: 160-250 ms).
Anything that is not a plain contiguous CPU tensor of the same dtype and shape goes through
``copy_``; CUDA sources are copied ``non_blocking`` into pinned buffers and synchronized once.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ._threads import run_in_threads

try:
    from .._fastcopy import copy as _nt_copy
except ImportError:  # built without a C compiler: memmove (GIL released by ctypes) is the fallback
    _nt_copy = None


# The byte copier used for staging, and its name (benchmarks print it).
copy_bytes = _nt_copy or ctypes.memmove
COPY_KIND = "non-temporal" if _nt_copy is not None else "memmove"

# Below this many bytes one thread copies everything (thread start-up would cost more than it saves).
PARALLEL_MIN_BYTES = 8 << 20
# Stretch boundaries fall on cache lines.
ALIGN = 64


def staging_threads() -> int:
    """Threads used for the staging copy: the CPUs this process may run on, at most 8.

    Also under torchrun, where the local ranks stage at the same moment: they copy different amounts (under DDP only
    rank 0 copies anything; FSDP2 shards can be uneven), and oversubscribed threads of a memory-bound copy let the
    scheduler give an idle rank's cores to the ones still copying, where one thread per rank's share would leave
    them idle. The copy is bound by memory bandwidth, which the threads share either way.
    """
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - non-Linux
        cpus = os.cpu_count() or 1
    return max(1, min(8, cpus))


@dataclass(frozen=True)
class Piece:
    """Copy ``length`` bytes at byte ``offset`` of tensor pair ``index``."""

    index: int
    offset: int
    length: int


def plan_stretches(sizes: Sequence[int], workers: int, *, align: int = ALIGN) -> list[list[Piece]]:
    """Split the concatenation of ``sizes`` bytes into at most ``workers`` stretches of about equal length.

    Every byte is covered exactly once, pieces never cross a tensor, and cuts inside a tensor fall on
    ``align`` bytes of that tensor (so a stretch may run up to ``align - 1`` bytes long).

    Example:

    ```python
    >>> first, second = plan_stretches([100, 28], 2, align=4)
    >>> first
    [Piece(index=0, offset=0, length=64)]
    >>> second
    [Piece(index=0, offset=64, length=36), Piece(index=1, offset=0, length=28)]
    ```
    """
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    total = sum(sizes)
    target = -(-total // workers) if total else 0
    target = -(-target // align) * align
    stretches: list[list[Piece]] = []
    current: list[Piece] = []
    room = target
    for index, size in enumerate(sizes):
        offset = 0
        while offset < size:
            end = offset + min(size - offset, room)
            if end < size:  # a cut inside the tensor: on an aligned offset
                end = min(size, -(-end // align) * align)
            current.append(Piece(index, offset, end - offset))
            room -= end - offset
            offset = end
            if room <= 0:
                stretches.append(current)
                current, room = [], target
    if current:
        stretches.append(current)
    return stretches


def _memmove_ok(dst: torch.Tensor, src: torch.Tensor) -> bool:
    return (
        src.device.type == "cpu" and dst.device.type == "cpu"
        and src.layout == torch.strided and dst.layout == torch.strided
        and src.dtype == dst.dtype and src.shape == dst.shape
        and src.is_contiguous() and dst.is_contiguous()
        and not src.is_conj() and not src.is_neg()
        and not src.is_quantized
    )


def copy_into(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], *, workers: int | None = None,
              copier=None) -> None:
    """Copy every ``src`` into its ``dst`` (``(dst, src)`` pairs), bit for bit, and return when all bytes landed.

    ``copier(dst_address, src_address, nbytes)`` copies raw bytes (default :data:`copy_bytes`).
    """
    copier = copier or copy_bytes
    fast: list[tuple[int, int, int]] = []  # (dst address, src address, bytes)
    cuda_devices: set[torch.device] = set()
    for dst, src in pairs:
        src = src.detach()
        if _memmove_ok(dst, src):
            nbytes = src.numel() * src.element_size()
            if nbytes:
                fast.append((dst.data_ptr(), src.data_ptr(), nbytes))
        elif src.is_cuda:
            dst.copy_(src, non_blocking=dst.is_pinned())
            cuda_devices.add(src.device)
        else:
            dst.copy_(src)
    total = sum(n for _, _, n in fast)
    workers = staging_threads() if workers is None else workers
    if total < PARALLEL_MIN_BYTES:
        workers = 1
    stretches = plan_stretches([n for _, _, n in fast], workers)

    def run(stretch: list[Piece]) -> None:
        for piece in stretch:
            dst_addr, src_addr, _ = fast[piece.index]
            # Both copiers release the GIL for the duration of the call, so stretches copy in parallel.
            copier(dst_addr + piece.offset, src_addr + piece.offset, piece.length)

    run_in_threads(run, stretches, workers=len(stretches))
    for device in cuda_devices:
        torch.cuda.synchronize(device)
