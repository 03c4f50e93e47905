"""Chunk hashes: every byte a load uses is checked against a hash recorded at save time, read once.

:class:`ChunkHasher` computes the xxh3-64 of every ``chunk_size``-byte chunk in the writer's own hashing loop; a
slice reader (:class:`~hf_resumable.format.slice_reader.VerifiedFile`) extends its byte range to the chunks it covers
and checks them. A record without chunk hashes (format versions 1 and 2) is checked by hashing the whole file once,
before its first byte is used. Why ``CHUNK_HASH_SIZE`` is 1 MiB: docs/format.md#file-records-and-hashes.
"""

from __future__ import annotations

import logging

import xxhash

logger = logging.getLogger(__name__)

__all__ = ["CHUNK_HASH_SIZE", "CHUNK_DIGEST_CHARS", "ChunkHasher", "chunk_span"]

# Bytes per hashed chunk of the files a writer records (the choice: docs/format.md#file-records-and-hashes).
CHUNK_HASH_SIZE = 1024 * 1024
# Hex digits of one chunk's xxh3-64 in a record's ``chunk_xxh3_64`` string.
CHUNK_DIGEST_CHARS = 16


class ChunkHasher:
    """The xxh3-64 of every ``chunk_size``-byte chunk of bytes fed in order (the last chunk may be shorter).

    Example:

    ```python
    >>> hasher = ChunkHasher(4)
    >>> hasher.feed(b"abcdef"); hasher.feed(b"gh"); hasher.feed(b"i")
    >>> digests = hasher.hexdigests()
    >>> len(digests) == 3 * CHUNK_DIGEST_CHARS
    True

    ```
    """

    def __init__(self, chunk_size: int = CHUNK_HASH_SIZE) -> None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        self.chunk_size = chunk_size
        self._state = xxhash.xxh3_64()
        self._filled = 0
        self._digests: list[str] = []

    def boundary(self) -> int:
        """Bytes left before the current chunk is complete (feed at most this much for cache-friendly hashing)."""
        return self.chunk_size - self._filled

    def feed(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B") if not isinstance(data, memoryview) else data
        while len(view):
            take = min(len(view), self.boundary())
            self._state.update(view[:take])
            self._filled += take
            view = view[take:]
            if self._filled == self.chunk_size:
                self._digests.append(self._state.hexdigest())
                self._state.reset()
                self._filled = 0

    def hexdigests(self) -> str:
        """Every chunk's digest, 16 hex digits each, concatenated in file order (a partial last chunk included)."""
        tail = [self._state.hexdigest()] if self._filled else []
        return "".join(self._digests + tail)


def chunk_span(start: int, end: int, *, chunk_size: int, size: int) -> tuple[int, int]:
    """The byte range ``[start, end)`` of a ``size``-byte file extended to the boundaries of the chunks it covers.

    Example:
        >>> chunk_span(5, 9, chunk_size=4, size=10)
        (4, 10)
    """
    if not 0 <= start <= end <= size:
        raise ValueError(f"byte range [{start}, {end}) is outside a file of {size} bytes")
    if start == end:
        return start, end
    return start // chunk_size * chunk_size, min(size, -(-end // chunk_size) * chunk_size)
