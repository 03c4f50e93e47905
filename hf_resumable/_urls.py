"""The one URL predicate: is a checkpoint location local, on the Hub, or in an object store?

Example:

```python
>>> location_kind("out/checkpoint-5"), location_kind("hf://me/run"), location_kind("s3://bucket/run")
('local', 'hub', 'object_store')
>>> is_remote("file:///tmp/run"), is_remote(True)
(False, False)

```
"""

from __future__ import annotations

import os
from typing import Any, Literal

__all__ = ["location_kind", "is_remote", "is_object_store_url"]

# fsspec protocols that are the local filesystem.
_LOCAL_PROTOCOLS = frozenset({"file", "local"})


def location_kind(value: str | os.PathLike) -> Literal["local", "hub", "object_store"]:
    """``"hub"`` for ``hf://...``, ``"object_store"`` for non-local fsspec URLs (``s3://``, ``gs://``, ...), else
    ``"local"``."""
    text = os.fspath(value)
    if text.startswith("hf://"):
        return "hub"
    if "://" in text and text.split("://", 1)[0] not in _LOCAL_PROTOCOLS:
        return "object_store"
    return "local"


def is_remote(value: Any) -> bool:
    """True for ``hf://...`` and object-store URLs; False for local paths and for non-paths (``True``, ``None``)."""
    return isinstance(value, (str, os.PathLike)) and location_kind(value) != "local"


def is_object_store_url(value: Any) -> bool:
    """True for ``s3://...``, ``gs://...`` and other non-local fsspec URLs (``hf://`` is the Hub's own tier)."""
    return isinstance(value, (str, os.PathLike)) and location_kind(value) == "object_store"
