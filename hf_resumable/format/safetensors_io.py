"""Reading and writing single safetensors files, with the checksum computed while the bytes move.

The files are standard safetensors, readable by ``safetensors.safe_open`` and ``transformers``. We write them
ourselves so that the xxh3-128 (and the chunk hashes) are computed on the bytes as they are written, with no
read-back pass, and loads can ``readinto`` the destination's own memory with the checksum checked on the fly.
:class:`RecordChecker` is the one place bytes are checked against a :class:`FileRecord`. Headers are validated before
any data is trusted (:class:`~hf_resumable.errors.CorruptCheckpointError` naming the file). Record versions and
hashes: docs/format.md#file-records-and-hashes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import queue
import re
import struct
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
import xxhash

from ..constants import MAX_HEADER_SIZE, SAFETENSORS_METADATA
from ..errors import CorruptCheckpointError
from ._jsonio import parse_json, require_field
from ._safefile import open_regular
from .chunks import CHUNK_DIGEST_CHARS, CHUNK_HASH_SIZE, ChunkHasher

logger = logging.getLogger(__name__)

__all__ = [
    "DTYPE_TO_STR",
    "STR_TO_DTYPE",
    "TensorInfo",
    "SafetensorsHeader",
    "FileRecord",
    "read_header",
    "header_from_bytes",
    "write_safetensors",
    "read_safetensors",
    "hash_file",
    "check_file",
    "record_of",
    "RecordChecker",
    "byte_view",
]

_SHA256 = re.compile(r"[0-9a-f]{64}")
_XXH3 = re.compile(r"[0-9a-f]{32}")
_CHUNK_DIGESTS = re.compile(r"[0-9a-f]*")
# Most dimensions a stored tensor may have (torch allows 64).
MAX_TENSOR_DIMS = 64
CHUNK_SIZE = 16 * 1024 * 1024

DTYPE_TO_STR: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.complex64: "C64",
}
for _name, _st in (("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64"), ("float8_e4m3fn", "F8_E4M3"),
                   ("float8_e5m2", "F8_E5M2")):
    if hasattr(torch, _name):
        DTYPE_TO_STR[getattr(torch, _name)] = _st
STR_TO_DTYPE: dict[str, torch.dtype] = {v: k for k, v in DTYPE_TO_STR.items()}


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives inside a safetensors file (offsets relative to the data section)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return STR_TO_DTYPE[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class SafetensorsHeader:
    """A parsed, validated safetensors header."""

    path: str
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]
    data_offset: int
    file_size: int


@dataclass(frozen=True)
class FileRecord:
    """Size and checksum(s) of a file as it was written (the manifest's entry).

    Args:
        size (`int`): bytes.
        sha256 (`str`, *optional*): hex sha256; only in records written before format version 2 (which always
            had one), and what such records are checked by when they have no ``xxh3_128``.
        xxh3_128 (`str`, *optional*): hex xxh3-128; every record written since it was introduced has one.
        chunk_size (`int`, *optional*): bytes per hashed chunk (format version 3, safetensors files).
        chunks (`str`, *optional*): the xxh3-64 of every ``chunk_size``-byte chunk of the file, 16 hex digits each,
            concatenated in file order (:mod:`~hf_resumable.format.chunks`); given with ``chunk_size``.

    Raises:
        ValueError: if the record has neither hash, or chunk hashes that do not cover the file.
    """

    size: int
    sha256: str | None = None
    xxh3_128: str | None = None
    chunk_size: int | None = None
    chunks: str | None = None

    def __post_init__(self) -> None:
        if self.sha256 is None and self.xxh3_128 is None:
            raise ValueError("a file record needs an xxh3_128 or a sha256 (it has neither)")
        if (self.chunk_size is None) != (self.chunks is None):
            raise ValueError("a file record's chunk_size and chunk hashes come together")
        if self.chunks is not None and len(self.chunks) != CHUNK_DIGEST_CHARS * -(-self.size // self.chunk_size):
            raise ValueError(f"{len(self.chunks) // CHUNK_DIGEST_CHARS} chunk hash(es) do not cover {self.size} bytes "
                             f"in chunks of {self.chunk_size}")

    def chunk_digest(self, index: int) -> str:
        """The recorded xxh3-64 (hex) of chunk ``index``."""
        return self.chunks[index * CHUNK_DIGEST_CHARS : (index + 1) * CHUNK_DIGEST_CHARS]

    def whole(self) -> "FileRecord":
        """This record without its chunk hashes (what an index's ``hf_resumable_shards`` holds)."""
        return FileRecord(self.size, self.sha256, self.xxh3_128)

    def hashes(self, *, every_hash: bool = False) -> dict[str, bool]:
        """Which hashes a check against this record computes, as keyword arguments of :func:`record_of` /
        :func:`hash_file`: the xxh3-128 when the record has one, else its sha256; with ``every_hash`` (full
        verification) each hash it has."""
        fast = self.xxh3_128 is not None
        return {"xxh3_128": fast, "sha256": self.sha256 is not None and (every_hash or not fast)}

    def mismatch(self, actual: "FileRecord", *, recorded_by: str = "the manifest") -> str | None:
        """Why ``actual`` (a record of the same file computed now) disagrees with this one, or ``None``.

        Every hash both records hold is compared; records with no hash in common disagree (nothing was checked).
        ``recorded_by`` names where this record comes from, in the message.
        """
        if actual.size != self.size:
            return f"size is {actual.size} bytes, {recorded_by} says {self.size}"
        compared = False
        for name, label in (("xxh3_128", "xxh3-128"), ("sha256", "sha256")):
            ours, theirs = getattr(self, name), getattr(actual, name)
            if ours is None or theirs is None:
                continue
            if ours != theirs:
                return f"{label} is {theirs}, {recorded_by} says {ours}"
            compared = True
        return None if compared else f"no hash in common with the record of {recorded_by} was computed"

    def to_json(self) -> dict[str, int | str]:
        """``{"size", "xxh3_128"}`` (plus ``"chunk_size"`` and ``"chunk_xxh3_64"`` for a safetensors file, and
        ``"sha256"`` for a record carried over from an older manifest)."""
        document: dict[str, int | str] = {"size": self.size}
        for name in ("xxh3_128", "sha256"):
            if getattr(self, name) is not None:
                document[name] = getattr(self, name)
        if self.chunks is not None:
            document["chunk_size"], document["chunk_xxh3_64"] = self.chunk_size, self.chunks
        return document

    @classmethod
    def from_json(cls, document: object, *, source: str, where: str) -> "FileRecord":
        """Parse an untrusted record (of a manifest, or of an index's ``hf_resumable_shards``).

        Raises:
            CorruptCheckpointError: naming ``source`` and the field (``where`` + ``.size`` / ``.xxh3_128`` /
                ``.sha256``) that is malformed, or that the record has neither hash.
        """
        require_field(isinstance(document, dict), source, where, document, "an object with size and xxh3_128")
        size, sha256, fast = document.get("size"), document.get("sha256"), document.get("xxh3_128")
        require_field(_is_index(size), source, f"{where}.size", size, "an integer >= 0")
        require_field(sha256 is None or (isinstance(sha256, str) and _SHA256.fullmatch(sha256) is not None), source,
                      f"{where}.sha256", sha256, "64 lowercase hex digits")
        require_field(fast is None or (isinstance(fast, str) and _XXH3.fullmatch(fast) is not None), source,
                      f"{where}.xxh3_128", fast, "32 lowercase hex digits")
        require_field(fast is not None or sha256 is not None, source, f"{where}.xxh3_128", fast,
                      "32 lowercase hex digits (a file record needs its xxh3_128, or a sha256 in one written before "
                      "format version 2)")
        chunk_size, chunks = document.get("chunk_size"), document.get("chunk_xxh3_64")
        require_field(chunk_size is None or (_is_index(chunk_size) and chunk_size > 0), source, f"{where}.chunk_size",
                      chunk_size, "an integer >= 1")
        count = None if not isinstance(chunk_size, int) else -(-size // chunk_size)
        require_field((chunks is None and chunk_size is None) or (
            isinstance(chunks, str) and count is not None and len(chunks) == CHUNK_DIGEST_CHARS * count
            and _CHUNK_DIGESTS.fullmatch(chunks) is not None), source, f"{where}.chunk_xxh3_64", chunks,
            f"{CHUNK_DIGEST_CHARS} lowercase hex digits per chunk_size bytes of the file, with chunk_size")
        return cls(size, sha256, fast, chunk_size, chunks)


def fast_checksum() -> "xxhash.xxh3_128":
    """A fresh xxh3-128 state (``update`` releases the GIL)."""
    return xxhash.xxh3_128()


def record_of(data: bytes | memoryview, *, xxh3_128: bool = True, sha256: bool = False) -> FileRecord:
    """The record of an in-memory file: its size and xxh3-128 (what new records hold), or the hashes asked for
    (``record_of(data, **expected.hashes())`` to check ``data`` against ``expected``)."""
    checker = _Digests(xxh3_128=xxh3_128, sha256=sha256, threaded=False)
    checker.feed(data)
    return checker.record()


def _corrupt(path: str, why: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{path}: {why}. The file is truncated, corrupt or not a safetensors file. A resume without a path "
        "(resume_from_checkpoint=True, load_state()) falls back to the checkpoint before it; otherwise load an "
        "earlier checkpoint or re-create it."
    )


def _itemsize(dtype: str) -> float:
    if dtype == "BOOL":
        return 1
    return torch.empty((), dtype=STR_TO_DTYPE[dtype]).element_size()


def parse_header_bytes(path: str, raw: bytes, file_size: int) -> SafetensorsHeader:
    """Validate the JSON header ``raw`` of a file of ``file_size`` bytes (no IO)."""
    try:
        document = parse_json(raw, source=f"{path} (header)")
    except CorruptCheckpointError as err:
        raise _corrupt(path, f"header is not valid JSON ({err})") from None
    if not isinstance(document, dict):
        raise _corrupt(path, "header is not a JSON object")
    metadata = document.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise _corrupt(path, "__metadata__ must map strings to strings")
    data_offset = 8 + len(raw)
    data_size = file_size - data_offset
    tensors: dict[str, TensorInfo] = {}
    for name, entry in document.items():
        try:
            dtype, shape, (start, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
            ok = isinstance(dtype, str) and dtype in STR_TO_DTYPE and len(shape) <= MAX_TENSOR_DIMS
            ok = ok and all(_is_index(d) for d in shape) and _is_index(start) and _is_index(end) and start <= end
            # torch sizes are int64: the product of the non-zero dimensions must fit, even for an empty tensor.
            ok = ok and math.prod(d for d in shape if d) < 2**63
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise _corrupt(path, f"header entry for tensor {name!r} is malformed: {entry!r:.200}")
        expected = math.prod(shape) * _itemsize(dtype)
        if end - start != expected:
            raise _corrupt(path, f"tensor {name!r} claims {end - start} bytes but shape {list(shape)} needs "
                                 f"{expected}")
        tensors[name] = TensorInfo(name, dtype, shape, start, end)
    cursor = 0
    for info in sorted(tensors.values(), key=lambda t: (t.start, t.end)):
        if info.start != cursor:
            raise _corrupt(path, f"tensor {info.name!r} starts at {info.start}, expected {cursor} (gap or overlap)")
        cursor = info.end
    if cursor != data_size:
        raise _corrupt(path, f"header describes {cursor} data bytes but the file holds {data_size}")
    return SafetensorsHeader(path, tensors, dict(metadata), data_offset, file_size)


def _is_index(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63


def read_header(path: str | os.PathLike) -> SafetensorsHeader:
    """Read and validate the header of the safetensors file at ``path``.

    Raises:
        CorruptCheckpointError: if the file is too short, the header is oversized or malformed, the
            header's offsets do not match the file size (truncation), or it is not a regular file.
        FileNotFoundError: if there is no such file.
    """
    path = os.fspath(path)
    with open_regular(path) as f:
        file_size = os.fstat(f.fileno()).st_size
        length = _header_length(path, f.read(8), file_size)
        raw = f.read(length)
    return parse_header_bytes(path, raw, file_size)


def _header_length(path: str, prefix: bytes, file_size: int) -> int:
    """The header length the 8-byte ``prefix`` of a ``file_size``-byte file announces, checked against the file."""
    if len(prefix) < 8:
        raise _corrupt(path, f"file has {file_size} bytes, fewer than the 8-byte header length")
    (length,) = struct.unpack("<Q", prefix[:8])
    if length > MAX_HEADER_SIZE:
        raise _corrupt(path, f"header length {length} exceeds the {MAX_HEADER_SIZE}-byte limit")
    if 8 + length > file_size:
        raise _corrupt(path, f"header claims {length} bytes but the file has only {file_size}")
    return length


def header_from_bytes(path: str | os.PathLike, data: bytes | memoryview) -> SafetensorsHeader:
    """The validated header of a whole safetensors file held in memory (``data``), as :func:`read_header`."""
    path = os.fspath(path)
    length = _header_length(path, bytes(data[:8]), len(data))
    return parse_header_bytes(path, bytes(data[8 : 8 + length]), len(data))


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A zero-copy, writable byte view of a contiguous CPU tensor (empty for an empty tensor)."""
    return memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy()).cast("B")


def _cpu_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.to("cpu")
    return tensor.contiguous()


def layout_tensors(tensors: Sequence[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """Data-section order: widest dtypes first (so every tensor stays aligned), then by name."""
    return sorted(tensors, key=lambda item: (-item[1].element_size(), item[0]))


def build_header(
    tensors: Sequence[tuple[str, torch.Tensor]], metadata: Mapping[str, str] | None = None
) -> bytes:
    """Header bytes (length prefix + space-padded JSON) for tensors already in layout order."""
    header: dict[str, object] = {"__metadata__": dict(metadata or SAFETENSORS_METADATA)}
    offset = 0
    for name, tensor in tensors:
        if tensor.dtype not in DTYPE_TO_STR:
            raise TypeError(f"Tensor {name!r} has dtype {tensor.dtype}, which safetensors cannot store.")
        nbytes = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": DTYPE_TO_STR[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


class _Sha256Thread:
    """sha256 of chunks on a helper thread, in order, while the caller does IO on (or xxh3s) them.

    A plain thread and queue rather than an executor: checks may run while the interpreter shuts
    down (atexit waits for an async save), when executors refuse new work.
    """

    def __init__(self) -> None:
        self.digest = hashlib.sha256()
        self.queue: queue.Queue = queue.Queue(maxsize=8)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="hf_resumable-hash", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (chunk := self.queue.get()) is not None:
            try:
                self.digest.update(chunk)
            except BaseException as err:  # noqa: BLE001 - surfaced by hexdigest()
                self.error = err

    def update(self, chunk: memoryview) -> None:
        self.queue.put(chunk)

    def close(self) -> None:
        if self.thread.is_alive():
            self.queue.put(None)
            self.thread.join()

    def hexdigest(self) -> str:
        self.close()
        if self.error is not None:
            raise self.error
        return self.digest.hexdigest()


class _Digests:
    """The xxh3-128 (inline) and/or sha256 (inline, or on a helper thread with ``threaded``) of bytes fed in
    order, and their size."""

    def __init__(self, *, xxh3_128: bool, sha256: bool, threaded: bool, chunk_size: int | None = None) -> None:
        if not (xxh3_128 or sha256):
            raise ValueError("compute at least one hash")
        self.size = 0
        self.fast = fast_checksum() if xxh3_128 else None
        self.slow = None if not sha256 else _Sha256Thread() if threaded else hashlib.sha256()
        self.chunked = ChunkHasher(chunk_size) if chunk_size is not None else None

    def feed(self, chunk: bytes | memoryview) -> None:
        self.size += len(chunk)
        if self.slow is not None:
            self.slow.update(chunk)
        if self.chunked is None:
            if self.fast is not None:
                self.fast.update(chunk)
            return
        view = memoryview(chunk).cast("B")
        while len(view):  # both hashes over one hashed chunk at a time, while it is in the CPU's cache
            piece, view = view[: self.chunked.boundary()], view[self.chunked.boundary() :]
            if self.fast is not None:
                self.fast.update(piece)
            self.chunked.feed(piece)

    def close(self) -> None:
        """Stop the helper thread, if any (idempotent; :meth:`record` needs no close first)."""
        if isinstance(self.slow, _Sha256Thread):
            self.slow.close()

    def record(self) -> FileRecord:
        chunked = self.chunked
        return FileRecord(size=self.size, sha256=None if self.slow is None else self.slow.hexdigest(),
                          xxh3_128=None if self.fast is None else self.fast.hexdigest(),
                          chunk_size=None if chunked is None else chunked.chunk_size,
                          chunks=None if chunked is None else chunked.hexdigests())


class RecordChecker(_Digests):
    """Checks a file's bytes against its record while they stream past: the record's xxh3-128 inline when it has
    one (cheap enough to keep loads disk-bound), else its sha256 on a helper thread; with ``every_hash`` (full
    verification) each hash the record has.

    With ``threaded`` (the default) a sha256 runs on a helper thread, which reads each chunk after :meth:`feed`
    returns: the caller must not reuse a chunk's memory (a load reads into each destination tensor once). Call
    :meth:`close` when giving up early.

    Example:

    ```python
    >>> expected = record_of(b"abc")
    >>> checker = RecordChecker(expected)
    >>> checker.feed(b"ab"); checker.feed(b"c")
    >>> checker.problem() is None
    True

    ```
    """

    def __init__(self, expected: FileRecord, *, every_hash: bool = False, threaded: bool = True) -> None:
        super().__init__(**expected.hashes(every_hash=every_hash), threaded=threaded)
        self.expected = expected

    def problem(self) -> str | None:
        """Why the bytes fed disagree with the record (size or hash), or ``None``."""
        return self.expected.mismatch(self.record())


def _write_all(fd: int, chunk: memoryview) -> None:
    while chunk:
        written = os.write(fd, chunk)
        chunk = chunk[written:]


def write_safetensors(
    path: str | os.PathLike,
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    metadata: Mapping[str, str] | None = None,
    fsync: bool = True,
) -> FileRecord:
    """Write ``tensors`` to a new safetensors file at ``path`` and return its size, xxh3-128 and chunk hashes.

    The file is created exclusively (an existing file is an error, never overwritten). The checksum is
    computed in the writing thread on the very bytes being written: xxh3-128 is cheap next to the write, and a
    helper thread for it gained nothing on a disk and lost under CPU load (docs/benchmarks.md).

    Raises:
        FileExistsError: if ``path`` exists.
        OSError: on write failures (e.g. ENOSPC); the partial file is removed.
    """
    path = os.fspath(path)
    ordered = layout_tensors([(name, _cpu_contiguous(t)) for name, t in tensors])
    header = build_header(ordered, metadata)
    digests = _Digests(xxh3_128=True, sha256=False, threaded=False, chunk_size=CHUNK_HASH_SIZE)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        for chunk in _chunks([memoryview(header)] + [byte_view(t) for _, t in ordered]):
            _write_all(fd, chunk)
            digests.feed(chunk)
        if fsync:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        _unlink_quietly(path)
        raise
    os.close(fd)
    return digests.record()


def _chunks(views: Iterable[memoryview]) -> Iterable[memoryview]:
    for view in views:
        for start in range(0, len(view), CHUNK_SIZE):
            yield view[start : start + CHUNK_SIZE]


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _can_read_into(target: torch.Tensor | None, info: TensorInfo) -> bool:
    return (
        target is not None
        and target.device.type == "cpu"
        and target.dtype == info.torch_dtype
        and tuple(target.shape) == info.shape
        and target.is_contiguous()
    )


def read_safetensors(
    path: str | os.PathLike,
    *,
    header: SafetensorsHeader | None = None,
    names: Iterable[str] | None = None,
    into: Mapping[str, torch.Tensor] | None = None,
    expected: FileRecord | None = None,
) -> dict[str, torch.Tensor]:
    """Read tensors from ``path`` sequentially, optionally straight into existing tensors.

    Args:
        header (`SafetensorsHeader`, *optional*): a header already read (saves one read).
        names (`Iterable[str]`, *optional*): only these tensors (default all). Ignored when
            ``expected`` is given, which needs every byte.
        into (`Mapping[str, torch.Tensor]`, *optional*): destination tensors. A destination on CPU
            with the same dtype and shape that is contiguous is filled in place with ``readinto``
            (no extra copy); any other destination gets a ``copy_``.
        expected (`FileRecord`, *optional*): check the whole file against this record while reading
            (its xxh3-128 inline, or its sha256 on a helper thread for records without one).

    Returns:
        `dict[str, torch.Tensor]`: the tensors read that were not written ``into`` a destination.

    Raises:
        CorruptCheckpointError: on a bad header, a short read, or a hash mismatch.
    """
    path = os.fspath(path)
    header = header or read_header(path)
    wanted = set(header.tensors) if names is None else set(names)
    missing = wanted - set(header.tensors)
    if missing:
        raise _corrupt(path, f"missing tensors {sorted(missing)[:10]}")
    pipeline = RecordChecker(expected) if expected is not None else None
    out: dict[str, torch.Tensor] = {}
    into = into or {}
    try:
        with open_regular(path, buffering=0) as f:
            if pipeline is not None:
                prefix = f.read(header.data_offset)
                pipeline.feed(memoryview(prefix))
            for info in sorted(header.tensors.values(), key=lambda t: t.start):
                if info.name not in wanted and pipeline is None:
                    continue
                target = into.get(info.name)
                buffer = target if _can_read_into(target, info) else torch.empty(info.shape, dtype=info.torch_dtype)
                f.seek(header.data_offset + info.start)
                _read_exact(f, byte_view(buffer), path, info, pipeline)
                if info.name not in wanted:
                    continue
                if target is not None and buffer is not target:
                    with torch.no_grad():
                        target.copy_(buffer)
                elif target is None:
                    out[info.name] = buffer
    finally:
        if pipeline is not None:
            pipeline.close()
    if pipeline is not None and (problem := pipeline.problem()) is not None:
        raise _corrupt(path, problem)
    return out


def _read_exact(f, view: memoryview, path: str, info: TensorInfo, pipeline: RecordChecker | None) -> None:
    for chunk in _chunks([view]):
        got = 0
        while got < len(chunk):
            n = f.readinto(chunk[got:])
            if not n:
                raise _corrupt(path, f"file ends inside tensor {info.name!r}")
            got += n
        if pipeline is not None:
            pipeline.feed(chunk)


def hash_file(path: str | os.PathLike, *, xxh3_128: bool = True, sha256: bool = False) -> FileRecord:
    """Size and xxh3-128 of a file (what new records hold), or the hashes asked for, read in chunks.

    ``hash_file(path, **expected.hashes())`` computes what a check against ``expected`` needs; a sha256 wanted for
    its own sake (a Hub LFS oid) is ``hash_file(path, xxh3_128=False, sha256=True).sha256``.
    """
    return _feed_file(path, _Digests(xxh3_128=xxh3_128, sha256=sha256, threaded=False)).record()


def check_file(path: str | os.PathLike, expected: FileRecord, *, recorded_by: str = "the manifest") -> str | None:
    """Why the file at ``path`` disagrees with ``expected`` (its size, or the hash a :class:`RecordChecker` checks),
    or ``None``. ``recorded_by`` names where ``expected`` comes from, in the message."""
    checker = _feed_file(path, RecordChecker(expected, threaded=False))
    return expected.mismatch(checker.record(), recorded_by=recorded_by)


def _feed_file(path: str | os.PathLike, digests: _Digests) -> _Digests:
    view = memoryview(bytearray(CHUNK_SIZE))  # reused: the digests must hash inline
    with open_regular(path, buffering=0) as f:
        while n := f.readinto(view):
            digests.feed(view[:n])
    return digests
