"""Open files that may have been crafted: regular files only, never blocking, never outside their directory.

A checkpoint is a directory anybody could have written. Reading ``manifest.json`` must not hang
because it is a FIFO, return garbage because it is ``/dev/zero``, or read ``~/.ssh`` because it is a
symbolic link. Every file hf_resumable reads from a checkpoint is opened through here.

Example:

```python
>>> import tempfile, pathlib
>>> d = pathlib.Path(tempfile.mkdtemp())
>>> _ = (d / "a.json").write_text("{}")
>>> read_regular_file(d / "a.json", limit=10)
b'{}'
>>> read_regular_file(d, limit=10)  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
hf_resumable.errors.CorruptCheckpointError: ...: is a directory, not a regular file.

```
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from pathlib import Path
from typing import BinaryIO

from ..errors import CorruptCheckpointError, UnsafeIndexError

__all__ = ["open_regular", "read_regular_file", "member_path", "file_kind"]


def file_kind(mode: int) -> str:
    """A human name for the file type in ``mode``."""
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return name
    return "a regular file" if stat.S_ISREG(mode) else "not a regular file"


def open_regular(path: str | os.PathLike, *, buffering: int = -1) -> BinaryIO:
    """Open ``path`` for reading if it is a regular file (following a final symlink), without ever blocking.

    Raises:
        FileNotFoundError: there is no such file.
        CorruptCheckpointError: it is a directory, FIFO, socket or device.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as err:
        if err.errno in (errno.ENXIO, errno.ELOOP, errno.ENAMETOOLONG):  # a socket; a symlink loop; a huge name
            raise CorruptCheckpointError(f"{path}: cannot be opened as a regular file ({err.strerror}).") from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise CorruptCheckpointError(f"{path}: is {file_kind(mode)}, not a regular file.")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        return os.fdopen(fd, "rb", buffering=buffering)
    except BaseException:
        os.close(fd)
        raise


def read_regular_file(path: str | os.PathLike, *, limit: int) -> bytes:
    """The bytes of the regular file ``path``, refusing files larger than ``limit``.

    Raises:
        FileNotFoundError / CorruptCheckpointError: as :func:`open_regular`, or the file is too large.
    """
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise CorruptCheckpointError(f"{path}: {size} bytes exceeds the {limit}-byte limit for this file.")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise CorruptCheckpointError(f"{path}: more than the {limit}-byte limit for this file.")
    return data


def member_path(directory: str | os.PathLike, relpath: str) -> Path:
    """``directory/relpath``, refusing a path that resolves (through symlinks) outside ``directory``.

    ``relpath`` must already be a checked relative name (``sharding.check_relative_name``).

    Raises:
        UnsafeIndexError: a symlink along the way leads outside the directory.
    """
    path = Path(directory) / relpath
    base = os.path.realpath(directory)
    real = os.path.realpath(path)
    if real != base and not real.startswith(base.rstrip(os.sep) + os.sep):
        raise UnsafeIndexError(
            f"{path}: leads outside the checkpoint directory (to {real}) through a symbolic link; refusing to read "
            "it. Copy the real file into the checkpoint instead of linking it.")
    return path
