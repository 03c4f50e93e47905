"""Map safetensors shards once and hand out block views of them, whose pages are read in and dropped per use."""

from __future__ import annotations

import logging
import mmap
import os
import threading
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import CorruptCheckpointError
from ..format._libc import linux_madvise
from ..format.safetensors_io import SafetensorsHeader, read_header

logger = logging.getLogger(__name__)

__all__ = ["MappedBlock", "ShardMaps"]

# madvise(2) advice: read a mapping's pages in and map them (Linux >= 5.14); drop them from this process's page
# table (a private mapping we never wrote to: the pages stay in the page cache, RSS no longer counts them).
_MADV_POPULATE_READ = 22
_MADV_DONTNEED = 4
_MADV_WILLNEED = 3  # for a file mapping: start reading the whole range at once (large requests, not page faults)

# madvise, looked up once (a lookup per call costs more than the call on a warm page cache); None off Linux.
_MADVISE = linux_madvise()


@dataclass(frozen=True)
class MappedBlock:
    """Tensors that are views of one shard's mapping, and the page-aligned range of the file that holds them."""

    tensors: dict[str, torch.Tensor]  # contiguous CPU tensors backed by the file
    start: int  # first address of the range (page-aligned)
    length: int  # bytes of the range

    def populate(self) -> None:
        """Read the range's pages in now, so using the tensors does not fault (ctypes releases the GIL: the
        read-ahead thread does this while the forward pass computes)."""
        madvise = _MADVISE
        if madvise is not None:
            madvise(self.start, self.length, _MADV_WILLNEED)
        if madvise is not None and madvise(self.start, self.length, _MADV_POPULATE_READ) == 0:
            return
        self.touch()  # older kernel: fault every page in by reading it

    def touch(self) -> None:
        """Read one byte of every page through the mapping (torch releases the GIL)."""
        for tensor in self.tensors.values():
            if tensor.nbytes:
                tensor.reshape(-1).view(torch.uint8)[:: mmap.PAGESIZE].sum()

    def hint(self) -> None:
        """Ask the kernel to start reading the range in the background (it returns at once), so the disk keeps
        busy while the block before this one is populated and runs."""
        madvise = _MADVISE
        if madvise is not None:
            madvise(self.start, self.length, _MADV_WILLNEED)

    def evict(self) -> None:
        """Unmap the range's pages from this process (they stay in the page cache; the mapping stays valid and
        faults them back in on the next use), so RSS holds only the blocks in flight."""
        madvise = _MADVISE
        if madvise is not None:
            madvise(self.start, self.length, _MADV_DONTNEED)


class ShardMaps:
    """One private mapping per shard file, made on first use, with its header parsed once.

    Views handed out by :meth:`view` stay valid until the last of them is dropped (each holds a reference to its
    mapping). A mapping takes no memory by itself: RSS counts only the pages populated and not yet evicted.

    Example:

    ```python
    >>> maps = ShardMaps()  # doctest: +SKIP
    >>> block = maps.view("out/model.safetensors", ["model.layers.0.mlp.up_proj.weight"], shapes)  # doctest: +SKIP
    >>> block.populate()  # pages read in; use block.tensors  # doctest: +SKIP
    >>> block.evict()  # pages dropped from this process, still in the page cache  # doctest: +SKIP
    ```
    """

    def __init__(self) -> None:
        self._maps: dict[Path, tuple[mmap.mmap, SafetensorsHeader]] = {}
        self._lock = threading.Lock()

    def _open(self, path: Path) -> tuple[mmap.mmap, SafetensorsHeader]:
        with self._lock:
            if path not in self._maps:
                header = read_header(path)
                fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                try:
                    if os.fstat(fd).st_size < header.file_size:
                        raise CorruptCheckpointError(f"{path}: the file is shorter than its header says; it is "
                                                     "truncated. Re-download or re-save it.")
                    # Private and writable so torch.frombuffer accepts it; nothing writes to it.
                    mapping = mmap.mmap(fd, 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
                finally:
                    os.close(fd)  # the mapping keeps the file
                self._maps[path] = (mapping, header)
            return self._maps[path]

    def view(self, path: str | os.PathLike, names: Collection[str],
             shapes: dict[str, tuple[torch.Size, torch.dtype]]) -> MappedBlock:
        """Views of the tensors ``names`` of the shard ``path``, each of the ``(shape, dtype)`` that ``shapes`` gives
        it (no data is read).

        Raises:
            CorruptCheckpointError: if a tensor is missing, has another shape or dtype, or the file is truncated.
        """
        mapping, header = self._open(Path(path))
        out: dict[str, torch.Tensor] = {}
        for name in names:
            info = header.tensors.get(name)
            if info is None or (info.shape, info.torch_dtype) != (tuple(shapes[name][0]), shapes[name][1]):
                raise CorruptCheckpointError(f"{path}: tensor {name!r} is missing or has another shape or dtype "
                                             "than its header promised; the file changed under us. Re-download it.")
            offset = header.data_offset + info.start
            raw = torch.frombuffer(mapping, dtype=torch.uint8, count=info.nbytes, offset=offset)
            out[name] = raw.view(info.torch_dtype).view(info.shape)
        pointers = [(t.data_ptr(), t.data_ptr() + t.nbytes) for t in out.values() if t.nbytes]
        if not pointers:
            return MappedBlock(out, 0, 0)
        start = min(p[0] for p in pointers) // mmap.PAGESIZE * mmap.PAGESIZE
        return MappedBlock(out, start, max(p[1] for p in pointers) - start)

    def clear(self) -> None:
        """Forget the mappings (each is unmapped once no view of it is left)."""
        with self._lock:
            self._maps.clear()
