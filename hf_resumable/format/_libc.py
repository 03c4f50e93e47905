"""C library functions the ``os`` module lacks, looked up once through ``ctypes`` (which releases the GIL around
each call): the one place the package loads them (renameat2, madvise, memcmp).

Example:

```python
>>> import ctypes
>>> from hf_resumable.format._libc import libc_function
>>> libc_function("no_such_function_anywhere", (ctypes.c_int,)) is None
True
```
"""

from __future__ import annotations

import ctypes
import functools
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["libc_function", "linux_madvise"]


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None, use_errno=True)  # the C library the interpreter runs on
    except (OSError, TypeError):  # e.g. Windows, where CDLL needs a name
        return None


@functools.cache
def libc_function(name: str, argtypes: tuple[Any, ...], restype: Any = ctypes.c_int) -> Callable[..., Any] | None:
    """The C library's ``name`` with its signature set (``ctypes.get_errno()`` reads its errno), or ``None`` where
    the C library lacks it."""
    libc = _libc()
    try:
        function = getattr(libc, name) if libc is not None else None
    except AttributeError:
        return None
    if function is not None:
        function.argtypes, function.restype = argtypes, restype
    return function


def linux_madvise() -> Callable[..., Any] | None:
    """``madvise(addr, length, advice)``, or ``None`` elsewhere than Linux (other systems number their advice
    otherwise, so a Linux advice value must never reach them)."""
    if not sys.platform.startswith("linux"):
        return None
    return libc_function("madvise", (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int))
