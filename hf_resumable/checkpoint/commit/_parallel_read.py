"""Read many safetensors files at once with a few threads straight into the destination tensors, each file's hash
fed in byte order by whichever thread completes its next chunk; staged destinations are copied only after every hash
matched (docs/architecture.md, ``_parallel_read.py``)."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..._tuning import Prefault, read_streams, view_address
from ...errors import CorruptCheckpointError
from ...format._safefile import open_regular
from ...format.safetensors_io import FileRecord, RecordChecker, SafetensorsHeader, TensorInfo, byte_view
from ._threads import run_in_threads

logger = logging.getLogger(__name__)

__all__ = ["FileRead", "Chunk", "plan_reads", "read_files", "CHUNK_BYTES"]

# Largest byte range one thread reads at a time.
CHUNK_BYTES = 8 * 1024 * 1024


@dataclass
class FileRead:
    """One file to read: its verified header, the record to check it against (``None``: no check), the destination
    tensors by name (any subset; the rest are returned as new tensors). ``data``: the whole file, already hashed by a
    verification (nothing is read or hashed again); ``check``: called with the ``fstat`` of the descriptor before a
    byte is read."""

    path: Path
    header: SafetensorsHeader
    expected: FileRecord | None = None
    into: Mapping[str, torch.Tensor] = field(default_factory=dict)
    data: bytes | None = None
    check: Callable[[os.stat_result], None] | None = None

    def __post_init__(self) -> None:
        if self.data is not None and self.expected is not None:
            raise ValueError(f"{self.path}: verified bytes (data) are not hash-checked again; pass expected=None.")


@dataclass
class Chunk:
    """``len(view)`` bytes at ``offset`` of file ``file`` (its ``index``-th chunk), landing in ``view`` (``fresh``:
    memory the read allocated, not touched yet)."""

    file: int
    index: int
    offset: int
    view: memoryview
    fresh: bool = False


def _in_place(target: torch.Tensor | None, info: TensorInfo) -> bool:
    return (target is not None and target.device.type == "cpu" and target.dtype == info.torch_dtype
            and tuple(target.shape) == info.shape and target.is_contiguous()
            and not isinstance(target, torch.nn.parameter.UninitializedTensorMixin))


def plan_reads(reads: list[FileRead], *, chunk_bytes: int = CHUNK_BYTES
               ) -> tuple[list[list[Chunk]], dict[str, torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
    """Cut every file into chunks (header bytes first when hashed, then every tensor in data order).

    Returns:
        `(chunks per file, new tensors by name, (staging buffer, destination) pairs to copy after the checks)`.
    """
    files: list[list[Chunk]] = []
    fresh: dict[str, torch.Tensor] = {}
    staged: list[tuple[torch.Tensor, torch.Tensor]] = []
    for number, read in enumerate(reads):
        header, chunks = read.header, []

        def add(offset: int, view: memoryview, fresh: bool = False) -> None:
            for start in range(0, len(view), chunk_bytes):
                chunks.append(Chunk(number, len(chunks), offset + start, view[start : start + chunk_bytes], fresh))

        if read.expected is not None:
            add(0, memoryview(bytearray(header.data_offset)))
        for info in sorted(header.tensors.values(), key=lambda t: t.start):
            target = read.into.get(info.name)
            allocated = not _in_place(target, info)
            if not allocated:
                buffer = target
            else:
                buffer = torch.empty(info.shape, dtype=info.torch_dtype)
                if target is not None:
                    staged.append((buffer, target))
                else:
                    fresh[info.name] = buffer
            add(header.data_offset + info.start, byte_view(buffer), allocated)
        files.append(chunks)
    return files, fresh, staged


class _FileState:
    """Per-file bookkeeping: its descriptor, which chunks are in, and the in-order checksum."""

    def __init__(self, read: FileRead, chunks: list[Chunk]) -> None:
        self.read = read
        self.chunks = chunks
        self.done = [False] * len(chunks)
        self.next = 0
        self.hashing = False
        self.lock = threading.Lock()
        # Fed by whichever reader thread completes the next chunk in line: hashed inline, in that thread.
        self.digest = None if read.expected is None else RecordChecker(read.expected, threaded=False)
        self.file = None

    def close(self) -> None:
        if self.file is not None:
            self.file.close()

    def completed(self, index: int) -> None:
        """Chunk ``index`` is in; feed every chunk that is now next in line (one feeder at a time)."""
        if self.digest is None:
            return
        with self.lock:
            self.done[index] = True
            if self.hashing:
                return
            self.hashing = True
        while True:
            with self.lock:
                if self.next >= len(self.chunks) or not self.done[self.next]:
                    self.hashing = False
                    return
                chunk = self.chunks[self.next]
                self.next += 1
            self.digest.feed(chunk.view)

    def problem(self) -> str | None:
        if self.digest is None:
            return None
        if self.next != len(self.chunks):
            return "not every byte was checked"
        return self.digest.problem()


def _copy_into(data: bytes, chunk: Chunk, path: Path) -> None:
    part = data[chunk.offset : chunk.offset + len(chunk.view)]
    if len(part) != len(chunk.view):
        raise CorruptCheckpointError(f"{path}: the verified bytes end at byte {len(data)}, inside its data.")
    chunk.view[:] = part


def _truncated(path: Path, end: int) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{path}: file ends at byte {end}, inside its data; the file is truncated. Load an "
                                  "earlier checkpoint (find_latest_checkpoint skips it).")


def _pread_into(fd: int, chunk: Chunk, path: Path) -> None:
    view, offset = chunk.view, chunk.offset
    while view:
        n = os.preadv(fd, [view], offset)
        if n <= 0:
            raise _truncated(path, offset)
        view, offset = view[n:], offset + n


def read_files(reads: list[FileRead], *, workers: int | None = None, chunk_bytes: int = CHUNK_BYTES
               ) -> dict[str, torch.Tensor]:
    """Read every tensor of every file into its destination (in place, or from a staging buffer once every hash
    matched); return the tensors that had none. ``workers``: reads in flight (default :func:`read_streams`).

    Raises:
        CorruptCheckpointError: a hash mismatch or a short file, naming the file (after every thread stopped), or a
            file that changed since it was verified (``FileRead.check``; before any byte of it is read).
        OSError: if a file cannot be read.
    """
    streams = read_streams() if workers is None else workers
    files, fresh, staged = plan_reads(reads, chunk_bytes=chunk_bytes)
    states = [_FileState(read, chunks) for read, chunks in zip(reads, files)]
    queue = [chunk for chunks in files for chunk in chunks]
    new = [chunk.view for chunk in queue if chunk.fresh and len(chunk.view)]

    def read_chunk(chunk: Chunk) -> None:
        Prefault.claim(chunk.view)
        state = states[chunk.file]
        if state.read.data is not None:
            _copy_into(state.read.data, chunk, state.read.path)
        else:
            _pread_into(state.file.fileno(), chunk, state.read.path)
        state.completed(chunk.index)

    try:
        _open_files(states)
        with Prefault.start([(view_address(view), len(view)) for view in new]):  # the buffers allocated above
            run_in_threads(read_chunk, queue, workers=max(1, streams))
    finally:
        for state in states:
            state.close()
    for state in states:
        if (problem := state.problem()) is not None:
            raise CorruptCheckpointError(
                f"{state.read.path}: {problem}. The file is corrupt or was modified after the save. A resume "
                "without a path (resume_from_checkpoint=True, load_state()) falls back to the checkpoint before it; "
                "otherwise load an earlier checkpoint or re-create it.")
    with torch.no_grad():
        for buffer, target in staged:
            target.copy_(buffer)
    return fresh


def _open_files(states: list[_FileState]) -> None:
    """Open every file read from disk, checking it first where it has a check."""
    for state in states:
        if state.read.data is None:
            state.file = open_regular(state.read.path, buffering=0)
            if state.read.check is not None:
                state.read.check(os.fstat(state.file.fileno()))
