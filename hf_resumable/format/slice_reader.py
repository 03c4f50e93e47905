"""Read slices of a checkpoint's safetensors files with every byte used checked against the file's record.

:class:`VerifiedFile` is the one slice reader of checkpoint loads (the piece reader of sharded checkpoints, loads
at any world size): each read is extended to the boundaries of the hashed chunks it covers and every chunk is
checked as it is read (:mod:`~hf_resumable.format.chunks`); a record without chunk hashes (format versions 1 and
2) makes it hash the whole file once, with :class:`~hf_resumable.format.safetensors_io.RecordChecker`, before the
first byte is used.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable

import torch
import xxhash

from ..errors import CorruptCheckpointError
from ._safefile import open_regular
from .chunks import chunk_span
from .safetensors_io import FileRecord, RecordChecker, SafetensorsHeader, byte_view

logger = logging.getLogger(__name__)

__all__ = ["VerifiedFile"]

# Bytes read at a time when a record without chunk hashes makes a reader hash a whole file first.
_WHOLE_FILE_READ = 16 * 1024 * 1024


class VerifiedFile:
    """An open safetensors file whose tensors, and slices of them, are read with every byte used checked.

    ``header`` is the file's verified header and ``record`` its manifest record. With chunk hashes in the record,
    each read covers whole chunks and checks each of them as it is read. Without (format versions 1 and 2), the whole
    file is hashed once, before the first byte of it is used, unless ``hashed`` says a full verification already did.
    Without a record (``verify="none"``), nothing is checked. ``check`` is called with the descriptor's ``fstat``
    before a byte is read (it must still be the file a verification checked).

    Raises:
        CorruptCheckpointError: from the reads, naming the file and the byte range whose chunk disagrees.
    """

    def __init__(self, path: str | os.PathLike, header: SafetensorsHeader, record: FileRecord | None, *,
                 hashed: bool = False, check: Callable[[os.stat_result], None] | None = None) -> None:
        self.path = os.fspath(path)
        self.header = header
        self.record = record
        self._file = open_regular(self.path, buffering=0)
        try:
            if check is not None:
                check(os.fstat(self._file.fileno()))
        except BaseException:
            self._file.close()
            raise
        self._whole_checked = record is None or hashed or record.chunks is not None

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> "VerifiedFile":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def read_slice(self, name: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """Elements ``index`` (one ``slice`` per dimension, steps of 1; ``None``: all) of stored tensor ``name``, as
        a new tensor."""
        info = self.header.tensors[name]
        index = index if index is not None else tuple(slice(0, n) for n in info.shape)
        out = torch.empty([s.stop - s.start for s in index], dtype=info.torch_dtype)
        self.read_slice_into(name, index, out)
        return out

    def read_slice_into(self, name: str, index: tuple[slice, ...], into: torch.Tensor) -> None:
        """Fill ``into`` (a CPU tensor of the slice's shape and the stored dtype) with elements ``index`` of stored
        tensor ``name``: the bytes land in ``into`` itself where both are contiguous (and are hashed there, so the
        bytes checked are the bytes used), else they are read into a buffer and copied.

        > [!WARNING]
        > When a chunk does not match, ``into`` may already hold bytes of it: pass memory nothing else uses yet (the
        > piece reader reads into the new tensor it returns).

        Raises:
            CorruptCheckpointError: a chunk the slice covers does not match its hash, or the file is truncated.
            ValueError: ``into`` is not of the slice's shape and the stored dtype.
        """
        info = self.header.tensors[name]
        sizes = [s.stop - s.start for s in index]
        if list(into.shape) != sizes or into.dtype != info.torch_dtype:
            raise ValueError(f"{self.path}: {name!r}{list(index)} is {sizes} {info.torch_dtype}, not "
                             f"{list(into.shape)} {into.dtype}")
        if math.prod(sizes) == 0:
            return
        strides = [math.prod(info.shape[axis + 1 :]) for axis in range(len(info.shape))]
        first = sum(s.start * stride for s, stride in zip(index, strides))
        last = sum((s.stop - 1) * stride for s, stride in zip(index, strides))
        itemsize = into.element_size()
        start = self.header.data_offset + info.start + first * itemsize
        end = self.header.data_offset + info.start + (last + 1) * itemsize
        if last + 1 - first == math.prod(sizes) and into.is_contiguous() and into.device.type == "cpu":
            self.read_range_into(start, end, byte_view(into))
            return
        buffer = torch.empty(end - start, dtype=torch.uint8)
        self.read_range_into(start, end, byte_view(buffer))
        with torch.no_grad():
            into.copy_(buffer.view(info.torch_dtype).as_strided(sizes, strides))

    def read_range_into(self, start: int, end: int, view: memoryview) -> None:
        """Read bytes ``[start, end)`` of the file into ``view``, every one of them checked (see the class
        docstring): the parts of the first and last chunk outside the range are read into small buffers of their
        own, and each chunk is hashed over its parts."""
        if not self._whole_checked:
            self._check_whole()
        record = self.record
        if record is None or record.chunks is None:
            self._pread(start, view)
            return
        low, high = chunk_span(start, end, chunk_size=record.chunk_size, size=record.size)
        parts = [(low, memoryview(bytearray(start - low))), (start, view), (end, memoryview(bytearray(high - end)))]
        for offset, part in parts:
            self._pread(offset, part)
        for chunk in range(low // record.chunk_size, -(-high // record.chunk_size)):
            begin, stop = chunk * record.chunk_size, min(high, (chunk + 1) * record.chunk_size)
            digest = xxhash.xxh3_64()
            for offset, part in parts:
                lo, hi = max(begin, offset), min(stop, offset + len(part))
                if lo < hi:
                    digest.update(part[lo - offset : hi - offset])
            if digest.hexdigest() != record.chunk_digest(chunk):
                raise self._corrupt(f"bytes {begin}..{stop} (chunk {chunk}) do not match their xxh3-64 in the "
                                    "manifest")

    def _pread(self, offset: int, view: memoryview) -> None:
        while view:
            n = os.preadv(self._file.fileno(), [view], offset)
            if n <= 0:
                raise self._corrupt(f"the file ends at byte {offset}, inside its data (truncated)")
            view, offset = view[n:], offset + n

    def _check_whole(self) -> None:
        """A record without chunk hashes: hash the whole file, from this descriptor, before using a byte of it."""
        logger.debug("%s: its record has no chunk hashes (format version < 3); hashing it whole before reading "
                     "slices of it.", self.path)
        checker = RecordChecker(self.record, threaded=False)
        buffer = memoryview(bytearray(_WHOLE_FILE_READ))
        offset = 0
        while n := os.preadv(self._file.fileno(), [buffer], offset):
            checker.feed(buffer[:n])
            offset += n
        if (problem := checker.problem()) is not None:
            raise self._corrupt(problem)
        self._whole_checked = True

    def _corrupt(self, why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"{self.path}: {why}. The file is corrupt or was modified after the save; nothing was loaded from it. "
            "A resume without a path (resume_from_checkpoint=True, load_state()) falls back to the checkpoint before "
            "it; otherwise load an earlier checkpoint or re-create it.")
