"""Read many safetensors files at once, several threads per file, each file's hash checked in byte order.

A resume reads a model and an optimizer state twice its size. One thread per file puts the page faults
of the new memory (a fresh process's optimizer state) on one core while the model's thread finishes
early; file after file leaves the CPU idle while the model is read and the disk waiting while the
state's pages are faulted in. Here every file is cut into chunks, all files' chunks are interleaved
(:func:`interleave`) and a pool of threads reads them with ``pread`` straight into the destination
tensors' bytes, while each file's checksum is fed in order by whichever thread completes its next
chunk. ``pread``, ``xxh3`` and ``sha256`` release the GIL.

Planning (:func:`plan_reads`) is pure: which byte range of which file lands in which tensor. Tensors
that cannot receive bytes in place (another device, dtype or layout) are read into CPU staging buffers
and copied into their destination only after EVERY file's hash has matched.

How many reads are in flight (:func:`read_streams`) depends on the disk. On a disk that reports itself solid
state (NVMe and SATA SSDs: ``/sys/dev/block/<dev>/queue/rotational`` is 0), and where there is no such flag
(tmpfs, network and FUSE filesystems), ``READ_WORKERS`` streams read all files' chunks interleaved: an NVMe
drive needs many requests in flight to reach its bandwidth, and one buffered stream only has the kernel's
read-ahead window in flight, so this never measures and never reads with fewer. A disk that reports itself
rotational is either a hard disk (where concurrent reads at several offsets seek, and one stream is fastest)
or a virtual disk that does not say what is behind it (virtio-blk reports 1 whatever backs it; the one this
project is measured on read 1 GiB at 0.76x the speed of one stream with four, when nothing else used it, and
faster with four while other jobs read from the same host). So there the files are read front to back, one
after the other, and the number of streams is measured on the first bytes read (:func:`_probe`: 16 MiB at
one stream and 32 MiB at ``READ_WORKERS``, twice each), and the faster is kept for the rest: at most 64 MiB
(6 % of a 1 GiB load) are read the slower way. A read of fewer
than 256 MiB from such a disk uses one stream. ``HF_RESUMABLE_READ_STREAMS=<n>`` (or ``read_files(workers=n)``)
fixes the number. Either way the pages of new destinations are faulted in ahead of the reads on one more
thread. Several streams hash in the reading threads (xxh3 at about 10 GiB/s per core); files read front to
back are hashed on a thread of their own, so the one thread reading does nothing but read.

Bytes that are not in the page cache are read with ``O_DIRECT`` (:class:`_Direct`): the disk (or a virtual disk's
host) writes them into an aligned buffer of the reading thread, and they are copied from there into the
destination; a buffered read would first allocate and fill a page-cache page for every 4 KiB, then copy it, and on
this project's VM that allocation, not the disk, was most of a cold load's time (a buffered cold read of 1 GiB took
0.88-2.6 s, the same read with ``O_DIRECT`` 0.64-0.81 s). Pages already cached (a checkpoint just written, or read
before) are read buffered, as memory. Filesystems without ``O_DIRECT`` (tmpfs, some FUSE and network ones) are read
buffered. ``HF_RESUMABLE_DIRECT_READS=0`` never reads direct, ``=1`` reads every byte direct where the filesystem
allows it, cached or not.

A file may also come from memory (:attr:`FileRead.data`: bytes a verification already hashed and kept), and a
file that verification hashed but did not keep is checked to be the very file it hashed before it is read
(:attr:`FileRead.check`).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import hashlib
import logging
import math
import mmap
import os
import sys
import threading
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
import xxhash

from ..errors import CorruptCheckpointError
from ..format._safefile import open_regular
from ..format.safetensors_io import FileRecord, SafetensorsHeader, TensorInfo
from ._threads import run_in_threads

logger = logging.getLogger(__name__)

__all__ = ["FileRead", "Chunk", "plan_reads", "interleave", "read_files", "read_streams",
           "direct_reads", "empty_aligned", "READ_WORKERS", "CHUNK_BYTES", "READ_STREAMS_ENV", "DIRECT_READS_ENV"]

# Threads reading at once on a solid-state (or unknown) disk (all files share them); more than the cores, so the
# disk queue stays deep while some threads fault in fresh pages or hash.
READ_WORKERS = 4
# Largest byte range one thread reads at a time.
CHUNK_BYTES = 8 * 1024 * 1024
# New destinations smaller than this in all are faulted in by the readers themselves (no prefault thread).
PREFAULT_MIN_BYTES = 1024 * 1024
# Environment variable that sets the number of read streams (an integer >= 1), whatever the disk.
READ_STREAMS_ENV = "HF_RESUMABLE_READ_STREAMS"
# Environment variable: "0" never reads with O_DIRECT, "1" reads every byte with it (where the filesystem allows),
# unset or "auto" reads with it the pages that are not in the page cache.
DIRECT_READS_ENV = "HF_RESUMABLE_DIRECT_READS"
# O_DIRECT offsets, lengths and buffer addresses are multiples of this (every common disk's logical block divides it).
DIRECT_ALIGN = 4096


@dataclass
class FileRead:
    """One file to read: its verified header, the record to check it against (``None``: no check), the
    destination tensors by name (any subset; the rest are returned as new tensors), and which of those
    destinations are newly allocated (``new``: their pages are faulted in ahead of the reads).

    ``data``: the whole file, already hashed by a verification (its bytes are copied from there; nothing is read
    from disk or hashed again). ``check``: called with the ``fstat`` of the descriptor before a byte is read (a
    file that a full verification hashed must still be that file).
    """

    path: Path
    header: SafetensorsHeader
    expected: FileRecord | None = None
    into: Mapping[str, torch.Tensor] = field(default_factory=dict)
    new: Collection[str] = ()
    data: bytes | None = None
    check: Callable[[os.stat_result], None] | None = None

    def __post_init__(self) -> None:
        if self.data is not None and self.expected is not None:
            raise ValueError(f"{self.path}: verified bytes (data) are not hash-checked again; pass expected=None.")


@dataclass
class Chunk:
    """``len(view)`` bytes at ``offset`` of file ``file`` (its ``index``-th chunk), landing in ``view``, whose
    memory is ``new`` (never touched yet) or not."""

    file: int
    index: int
    offset: int
    view: memoryview
    new: bool = False
    address: int = 0


def _in_place(target: torch.Tensor | None, info: TensorInfo) -> bool:
    return (target is not None and target.device.type == "cpu" and target.dtype == info.torch_dtype
            and tuple(target.shape) == info.shape and target.is_contiguous()
            and not isinstance(target, torch.nn.parameter.UninitializedTensorMixin))


def _byte_view(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().reshape(-1)
    if flat.numel() == 0:
        return memoryview(bytearray(0))
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


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

        def add(offset: int, view: memoryview, *, new: bool = False, address: int = 0) -> None:
            # Cut at file offsets that are multiples of chunk_bytes: every chunk but a tensor's first and last is
            # then aligned for O_DIRECT (when chunk_bytes is a multiple of DIRECT_ALIGN).
            start = 0
            while start < len(view):
                end = min(len(view), (offset + start) // chunk_bytes * chunk_bytes + chunk_bytes - offset)
                chunks.append(Chunk(number, len(chunks), offset + start, view[start:end], new,
                                    address and address + start))
                start = end

        if read.expected is not None:
            add(0, memoryview(bytearray(header.data_offset)))
        for info in sorted(header.tensors.values(), key=lambda t: t.start):
            target = read.into.get(info.name)
            if _in_place(target, info):
                buffer, new = target, info.name in read.new
            else:
                buffer, new = empty_aligned(info.shape, info.torch_dtype, header.data_offset + info.start), True
                if target is not None:
                    staged.append((buffer, target))
                else:
                    fresh[info.name] = buffer
            add(header.data_offset + info.start, _byte_view(buffer), new=new, address=buffer.data_ptr())
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
        expected = read.expected
        self.digest = None if expected is None else (
            xxhash.xxh3_128() if expected.xxh3_128 is not None else hashlib.sha256())
        self.file = None
        self.direct: _Direct | None = None

    def close(self) -> None:
        if self.direct is not None:
            self.direct.close()
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
            self.digest.update(chunk.view)

    def problem(self) -> str | None:
        if self.digest is None:
            return None
        expected = self.read.expected
        if self.next != len(self.chunks):
            return "not every byte was checked"
        actual = self.digest.hexdigest()
        if expected.xxh3_128 is not None:
            return None if actual == expected.xxh3_128 else (
                f"xxh3-128 is {actual}, the manifest says {expected.xxh3_128}")
        return None if actual == expected.sha256 else f"sha256 is {actual}, the manifest says {expected.sha256}"


def interleave(files: list[list[Chunk]]) -> list[Chunk]:
    """All files' chunks in one queue, each file advancing at the same relative pace.

    A resume reads the model into memory that exists (disk-bound) and the optimizer state into new memory
    (bound by page faults, i.e. CPU). File after file would leave the CPU idle during the first and the
    disk waiting during the second; interleaved, both work at once. Within a file chunks stay in order,
    so its checksum is fed as soon as possible.

    Example:

    ```python
    >>> a = [Chunk(0, i, i * 10, memoryview(bytes(10))) for i in range(4)]
    >>> b = [Chunk(1, i, i * 20, memoryview(bytes(20))) for i in range(2)]
    >>> [(c.file, c.index) for c in interleave([a, b])]
    [(0, 0), (1, 0), (0, 1), (0, 2), (1, 1), (0, 3)]

    ```
    """
    keyed = []
    for chunks in files:
        size, done = max(1, sum(len(c.view) for c in chunks)), 0
        for chunk in chunks:
            keyed.append((done / size, chunk.file, chunk.index, chunk))
            done += len(chunk.view)
    return [item[3] for item in sorted(keyed, key=lambda item: item[:3])]


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL | None:
    """libc through ctypes (which releases the GIL during each call), with the signatures used here; ``None``
    off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long)
        libc.mmap.restype = ctypes.c_void_p
        libc.munmap.argtypes, libc.munmap.restype = (ctypes.c_void_p, ctypes.c_size_t), ctypes.c_int
        libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
        libc.mincore.restype = ctypes.c_int
        libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        libc.madvise.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    return libc


@functools.lru_cache(maxsize=1)
def _madvise() -> Callable[[int, int], int] | None:
    """``madvise(address, length, MADV_POPULATE_WRITE)`` through libc (Linux >= 5.14), or ``None``."""
    libc = _libc()
    if libc is None:
        return None
    return lambda address, length: libc.madvise(address, length, _MADV_POPULATE_WRITE)


_MADV_POPULATE_WRITE = 23
_PAGE = 4096


def _prefault(queue: list[Chunk], stop: threading.Event) -> None:
    """Fault in the pages of new destinations, in reading order, ahead of the readers.

    The first touch of new memory is a page fault per 4 KiB page (a costly one in a VM); inside ``pread``
    it would come after the data arrived, here it overlaps the disk's work. Pages a reader reaches first
    simply fault there. Stops quietly if the kernel does not support ``MADV_POPULATE_WRITE``.
    """
    populate = _madvise()
    if populate is None:
        return
    for chunk in queue:
        if stop.is_set():
            return
        if not chunk.new:
            continue
        start = -(-chunk.address // _PAGE) * _PAGE
        end = (chunk.address + len(chunk.view)) // _PAGE * _PAGE
        if end > start and populate(start, end - start) != 0:
            logger.debug("madvise(MADV_POPULATE_WRITE) failed (errno %d); no prefaulting.", ctypes.get_errno())
            return


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


def direct_reads() -> str:
    """The ``HF_RESUMABLE_DIRECT_READS`` mode: ``"auto"`` (default: pages not in the page cache are read with
    ``O_DIRECT``), ``"never"`` (``0``) or ``"always"`` (``1``).

    Raises:
        ValueError: the variable is set to anything else.
    """
    value = os.environ.get(DIRECT_READS_ENV, "").strip().lower()
    modes = {"": "auto", "auto": "auto", "0": "never", "1": "always"}
    if value not in modes:
        raise ValueError(f"{DIRECT_READS_ENV}={value!r}: expected 0 (never read with O_DIRECT), 1 (always, where the "
                         "filesystem allows it) or auto.")
    return modes[value] if hasattr(os, "O_DIRECT") else "never"


def _resident(fd: int, size: int) -> bytes | None:
    """Which pages of the file behind ``fd`` are in the page cache (``mincore``: one byte per page, bit 0 set when
    resident); ``None`` if that cannot be asked. Maps the file without touching it, so nothing is read."""
    libc = _libc()
    if libc is None or size <= 0:
        return None
    address = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
    if address is None or address == ctypes.c_void_p(-1).value:
        return None
    try:
        pages = -(-size // _PAGE)
        vector = (ctypes.c_ubyte * pages)()
        if libc.mincore(address, size, vector) != 0:
            return None
        return bytes(vector)
    finally:
        libc.munmap(address, size)


class _Direct:
    """A file opened a second time with ``O_DIRECT``, and which of its pages were cached when it was opened.

    :meth:`read` reads a chunk through an aligned buffer of the calling thread, unless all its pages are cached;
    it returns ``False`` when the chunk should be read buffered (cached, or the filesystem refused ``O_DIRECT``:
    then this file is read buffered from there on).
    """

    def __init__(self, path: Path, fd: int, size: int, always: bool) -> None:
        self.path, self.fd = path, fd
        self.cached = None if always else _resident(fd, size)
        self.usable = True

    @classmethod
    def open(cls, path: Path, buffered_fd: int, mode: str) -> _Direct | None:
        if mode == "never":
            return None
        try:
            # O_NONBLOCK: never wait on a FIFO put in its place (the identity check below then refuses it).
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        except OSError as err:  # EINVAL: the filesystem has no O_DIRECT
            logger.debug("%s: no O_DIRECT (%s); reading it buffered.", path, err)
            return None
        opened, verified = os.fstat(fd), os.fstat(buffered_fd)
        if (opened.st_dev, opened.st_ino) != (verified.st_dev, verified.st_ino):  # replaced: read the one verified
            os.close(fd)
            return None
        return cls(path, fd, verified.st_size, mode == "always")

    def close(self) -> None:
        os.close(self.fd)

    def wanted(self, offset: int, length: int) -> bool:
        if not self.usable:
            return False
        if self.cached is None:
            return True
        first, last = offset // _PAGE, (offset + length - 1) // _PAGE + 1
        return self.cached.find(b"\0", first, last) != -1 or len(self.cached) < last

    def read(self, chunk: Chunk, bounce: _Bounce) -> bool:
        """Read ``chunk`` with ``O_DIRECT``: straight into its destination where the destination's address and the
        file offset are aligned alike (the aligned whole blocks of it), through ``bounce`` otherwise."""
        length, offset = len(chunk.view), chunk.offset
        if length == 0 or not self.wanted(offset, length):
            return False
        if chunk.address and (chunk.address - offset) % DIRECT_ALIGN == 0:
            first = -(-offset // DIRECT_ALIGN) * DIRECT_ALIGN
            last = (offset + length) // DIRECT_ALIGN * DIRECT_ALIGN
            if last > first:
                if not self._read(chunk.view[first - offset : last - offset], first, last - first):
                    return False
                for begin, end in ((offset, first), (last, offset + length)):
                    if end > begin and not self._through(bounce, chunk, begin, end):
                        return False  # pragma: no cover - the filesystem took the aligned read, then refused one
                return True
        return self._through(bounce, chunk, offset, offset + length)

    def _through(self, bounce: _Bounce, chunk: Chunk, begin: int, end: int) -> bool:
        """Bytes ``[begin, end)`` of the file, read aligned into ``bounce`` and copied into ``chunk``."""
        start = begin // DIRECT_ALIGN * DIRECT_ALIGN
        need = end - start
        span = -(-need // DIRECT_ALIGN) * DIRECT_ALIGN
        buffer = bounce.get(span)
        if not self._read(buffer[:span], start, need):
            return False
        skip, into = begin - start, begin - chunk.offset
        if chunk.address:
            ctypes.memmove(chunk.address + into, bounce.address + skip, end - begin)  # releases the GIL
        else:
            chunk.view[into : into + end - begin] = buffer[skip : skip + end - begin]
        return True

    def _read(self, view: memoryview, start: int, need: int) -> bool:
        """At least ``need`` bytes from ``start`` (aligned) into ``view`` (aligned; whole blocks); ``False``: the
        filesystem refused ``O_DIRECT`` (nothing read; this file is read buffered from now on)."""
        got = 0
        while got < need:
            try:
                n = os.preadv(self.fd, [view[got:]], start + got)
            except OSError as err:
                if err.errno != errno.EINVAL or got:
                    raise
                logger.debug("%s: O_DIRECT read refused (%s); reading it buffered.", self.path, err)
                self.usable = False
                return False
            if n <= 0 or (n % DIRECT_ALIGN and got + n < need):
                raise _truncated(self.path, start + got + max(n, 0))
            got += n
        return True


def empty_aligned(shape: tuple[int, ...], dtype: torch.dtype, file_offset: int) -> torch.Tensor:
    """A new contiguous CPU tensor whose address is aligned like ``file_offset`` (modulo ``DIRECT_ALIGN``), so that
    ``O_DIRECT`` reads the bytes stored there straight into it, with no copy (a view into a buffer
    ``DIRECT_ALIGN`` bytes larger). Small tensors, and offsets no tensor of ``dtype`` can be aligned to, get a
    plain ``torch.empty``.

    Example:

    ```python
    >>> t = empty_aligned((1024, 1024), torch.float32, file_offset=4096 * 3 + 136)
    >>> (t.data_ptr() % 4096, t.shape, t.is_contiguous())
    (136, torch.Size([1024, 1024]), True)

    ```
    """
    size = dtype.itemsize
    nbytes = math.prod(shape) * size
    if nbytes < 16 * DIRECT_ALIGN:
        return torch.empty(shape, dtype=dtype)
    raw = torch.empty(nbytes + DIRECT_ALIGN, dtype=torch.uint8)
    shift = (file_offset - raw.data_ptr()) % DIRECT_ALIGN
    if shift % size:
        return torch.empty(shape, dtype=dtype)
    return raw[shift : shift + nbytes].view(dtype).view(shape)


class _Bounce(threading.local):
    """One page-aligned buffer per reading thread for ``O_DIRECT`` reads, grown on demand, freed with the load."""

    def __init__(self, size: int = 0) -> None:
        self.size = size  # allocated at once, so that a thread's first (small) chunk does not decide it
        self.memory: mmap.mmap | None = None
        self.view: memoryview | None = None
        self.address = 0

    def get(self, size: int) -> memoryview:
        if self.memory is None or len(self.memory) < size:
            self.release()
            self.memory = mmap.mmap(-1, max(size, self.size))
            self.address = ctypes.addressof(ctypes.c_char.from_buffer(self.memory))
            self.view = memoryview(self.memory)
        return self.view

    def release(self) -> None:
        if self.view is not None:
            self.view.release()
        self.memory = self.view = None


def read_streams() -> int:
    """Reads kept in flight: ``HF_RESUMABLE_READ_STREAMS`` when set, else ``READ_WORKERS``.

    Raises:
        ValueError: ``HF_RESUMABLE_READ_STREAMS`` is not an integer >= 1.
    """
    override = os.environ.get(READ_STREAMS_ENV, "").strip()
    if not override:
        return READ_WORKERS
    if not override.isdigit() or int(override) < 1:
        raise ValueError(f"{READ_STREAMS_ENV}={override!r}: expected the number of read streams, an integer >= 1.")
    return int(override)


def read_files(reads: list[FileRead], *, workers: int | None = None, chunk_bytes: int = CHUNK_BYTES
               ) -> dict[str, torch.Tensor]:
    """Read every tensor of every file; fill destinations; return the tensors that had none.

    Destinations that are plain contiguous CPU tensors of the stored dtype and shape receive the bytes
    directly (before the file's hash is known); every other destination is copied from a staging buffer
    after all hashes matched. ``workers``: reads in flight (default :func:`read_streams`), all files' chunks
    interleaved.

    Raises:
        CorruptCheckpointError: a hash mismatch or a short file, naming the file (after every thread stopped), or a
            file that changed since it was verified (``FileRead.check``; before any byte of it is read).
        OSError: if a file cannot be read.
    """
    streams = read_streams() if workers is None else workers
    files, fresh, staged = plan_reads(reads, chunk_bytes=chunk_bytes)
    states = [_FileState(read, chunks) for read, chunks in zip(reads, files)]
    queue = interleave(files)
    bounce = _Bounce(-(-chunk_bytes // DIRECT_ALIGN) * DIRECT_ALIGN + 2 * DIRECT_ALIGN)

    def read_chunk(chunk: Chunk) -> None:
        state = states[chunk.file]
        if state.read.data is not None:
            _copy_into(state.read.data, chunk, state.read.path)
        elif state.direct is None or not state.direct.read(chunk, bounce):
            _pread_into(state.file.fileno(), chunk, state.read.path)
        state.completed(chunk.index)

    stop = threading.Event()
    prefault = threading.Thread(target=_prefault, args=(queue, stop), name="hf_resumable-prefault", daemon=True)
    try:
        _open_files(states, direct_reads())
        if sum(len(chunk.view) for chunk in queue if chunk.new) >= PREFAULT_MIN_BYTES:
            prefault.start()
        run_in_threads(read_chunk, queue, workers=max(1, streams))
    finally:
        stop.set()
        if prefault.ident is not None:
            prefault.join()
        for state in states:
            state.close()
        bounce.release()
    for state in states:
        if (problem := state.problem()) is not None:
            raise CorruptCheckpointError(
                f"{state.read.path}: {problem}. The file is corrupt or was modified after the save; load an earlier "
                "checkpoint (find_latest_checkpoint skips this one) or re-create it.")
    with torch.no_grad():
        for buffer, target in staged:
            target.copy_(buffer)
    return fresh


def _open_files(states: list[_FileState], direct: str) -> None:
    """Open every file read from disk (and its ``O_DIRECT`` twin), checking it first where it has a check."""
    for state in states:
        if state.read.data is None:
            state.file = open_regular(state.read.path, buffering=0)
            if state.read.check is not None:
                state.read.check(os.fstat(state.file.fileno()))
            state.direct = _Direct.open(state.read.path, state.file.fileno(), direct)
