"""Map tensors of a safetensors shard into memory without copying them, their pages read in on the calling thread."""

from __future__ import annotations

import logging
import mmap
import os
from collections.abc import Collection

import torch

from ..checkpoint._parallel_read import _libc
from ..errors import CorruptCheckpointError
from ..format.safetensors_io import read_header

logger = logging.getLogger(__name__)

__all__ = ["map_tensors"]

# madvise(2) advice that reads a mapping's pages in and maps them (Linux >= 5.14).
_MADV_POPULATE_READ = 22


def _populate(tensor: torch.Tensor) -> None:
    """Read the pages behind ``tensor`` in now (ctypes and torch release the GIL, so the caller's thread does it
    while other threads compute)."""
    libc = _libc()
    start = tensor.data_ptr() // mmap.PAGESIZE * mmap.PAGESIZE
    length = tensor.data_ptr() + tensor.nbytes - start
    if libc is not None and libc.madvise(start, length, _MADV_POPULATE_READ) == 0:
        return
    flat = tensor.reshape(-1).view(torch.uint8)  # older kernel: touch one byte per page
    flat[:: mmap.PAGESIZE].sum()


def map_tensors(path: str | os.PathLike, names: Collection[str],
                shapes: dict[str, tuple[torch.Size, torch.dtype]]) -> dict[str, torch.Tensor]:
    """The tensors ``names`` of the safetensors file ``path``, as views of a private mapping of the bytes holding them.

    Nothing is copied: the tensors are the file's pages in the OS page cache (a private, copy-on-write mapping, so
    writing to them never changes the file). The range is first announced to the kernel (``POSIX_FADV_WILLNEED``:
    large read-ahead requests for a cold file), then populated, so using the tensors afterwards does not fault.
    The mapping lives as long as any of the tensors does, and is unmapped with the last one.

    Args:
        path (`str` or `os.PathLike`): the shard.
        names (`Collection[str]`): tensors to map.
        shapes (`dict[str, tuple[torch.Size, torch.dtype]]`): the shape and dtype each must have.

    Returns:
        `dict[str, torch.Tensor]`: contiguous CPU tensors backed by the file.

    Raises:
        CorruptCheckpointError: if a tensor is missing, has another shape or dtype, or lies past the end of the file.

    Example:

    ```python
    >>> tensors = map_tensors("out/model.safetensors", ["lm_head.weight"], shapes)  # doctest: +SKIP
    ```
    """
    header = read_header(path)
    infos = []
    for name in names:
        info = header.tensors.get(name)
        if info is None or (info.shape, info.torch_dtype) != (tuple(shapes[name][0]), shapes[name][1]):
            raise CorruptCheckpointError(f"{path}: tensor {name!r} is missing or has another shape or dtype than "
                                         "its header promised; the file changed under us. Re-download it.")
        infos.append(info)
    begin = header.data_offset + min(info.start for info in infos)
    end = header.data_offset + max(info.end for info in infos)
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size < end:
            raise CorruptCheckpointError(f"{path}: the file ends before byte {end}, inside its data; it is truncated. "
                                         "Re-download or re-save it.")
        base = begin // mmap.ALLOCATIONGRANULARITY * mmap.ALLOCATIONGRANULARITY
        os.posix_fadvise(f.fileno(), base, end - base, os.POSIX_FADV_WILLNEED)
        mapping = mmap.mmap(f.fileno(), end - base, flags=mmap.MAP_PRIVATE,
                            prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=base)
    out: dict[str, torch.Tensor] = {}
    for info in infos:
        raw = torch.frombuffer(mapping, dtype=torch.uint8, count=info.nbytes,
                               offset=header.data_offset + info.start - base)
        out[info.name] = raw.view(info.torch_dtype).view(info.shape)
    for tensor in out.values():
        _populate(tensor)
    return out
