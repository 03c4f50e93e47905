"""Progress bars for long saves, uploads and downloads, off unless a front end (the CLI) turns them on.

Library calls stay silent by default (a training loop has its own bar); ``hf-resumable`` enables bars on a
terminal unless ``--quiet`` is given.

Example:

```python
>>> from hf_resumable.progress import enable_progress_bars, progress_bar
>>> with progress_bar(total=3, desc="files") as bar:
...     for _ in range(3):
...         bar.update(1)
```
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["enable_progress_bars", "disable_progress_bars", "progress_bar"]

_STATE = {"enabled": False}
_LOCK = threading.Lock()


def enable_progress_bars() -> None:
    """Show tqdm bars for saves, uploads and downloads (the CLI does this on a terminal)."""
    _STATE["enabled"] = True


def disable_progress_bars() -> None:
    """Hide them again (the default)."""
    _STATE["enabled"] = False


class _Silent:
    def update(self, n: int = 1) -> None:
        pass


@contextlib.contextmanager
def progress_bar(*, total: int | None, desc: str, unit: str = "B") -> Iterator[Any]:
    """A thread-safe tqdm bar when enabled, else an object whose ``update`` does nothing."""
    if not _STATE["enabled"]:
        yield _Silent()
        return
    from tqdm.auto import tqdm

    bar = tqdm(total=total, desc=desc, unit=unit, unit_scale=unit == "B", unit_divisor=1024, leave=False)
    lock = _LOCK

    class _Bar:
        def update(self, n: int = 1) -> None:
            with lock:
                bar.update(n)

    try:
        yield _Bar()
    finally:
        bar.close()
