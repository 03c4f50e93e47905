"""Encode Python state objects (``state_dict()`` results) as JSON plus a side table of tensors.

``torch.save`` stores these with pickle, which executes code on load. Here every value must be one of
a closed set of types; anything else is refused at save time with the path of the offending value.

Encoding rules (the decoder inverts them exactly):

- ``None``, ``bool``, ``int``, ``float`` (including ``nan``/``inf``) and ``str`` are stored as is;
- ``list`` stays a list; ``tuple`` becomes ``{"__tuple__": [...]}``;
- a ``dict`` whose keys are all strings (and none is a marker) stays an object; other dicts become
  ``{"__dict__": [[key, value], ...]}`` (so integer keys survive);
- a ``torch.Tensor`` becomes ``{"__tensor__": name}`` and is added to the side table;
- ``torch.dtype`` becomes ``{"__dtype__": "float32"}``; numpy scalars become Python scalars.

Example:

```python
>>> import torch
>>> tensors = {}
>>> doc = encode_state({"betas": (0.9, 0.99), 3: torch.ones(2)}, tensors, prefix="opt")
>>> decode_state(doc, tensors) == {"betas": (0.9, 0.99), 3: tensors["opt/3"]}
True
```
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from .errors import CorruptCheckpointError, UnsupportedStateError

__all__ = ["encode_state", "decode_state"]

_TUPLE = "__tuple__"
_DICT = "__dict__"
_TENSOR = "__tensor__"
_DTYPE = "__dtype__"
_MARKERS = {_TUPLE, _DICT, _TENSOR, _DTYPE}


def encode_state(value: Any, tensors: dict[str, torch.Tensor], *, prefix: str) -> Any:
    """Encode ``value`` as JSON-able data; tensors go to ``tensors`` under names starting with ``prefix``.

    Raises:
        UnsupportedStateError: naming the path (e.g. ``scheduler/lr_lambdas/0``) of a value that
            cannot be stored without pickle.
    """
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, torch.Tensor):
        tensors[prefix] = value
        return {_TENSOR: prefix}
    if isinstance(value, torch.dtype):
        return {_DTYPE: str(value).removeprefix("torch.")}
    if isinstance(value, tuple):
        return {_TUPLE: [encode_state(v, tensors, prefix=f"{prefix}/{i}") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [encode_state(v, tensors, prefix=f"{prefix}/{i}") for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        if all(isinstance(k, str) for k in value) and not _MARKERS.intersection(value):
            return {k: encode_state(v, tensors, prefix=f"{prefix}/{k}") for k, v in value.items()}
        return {_DICT: [[encode_state(k, tensors, prefix=f"{prefix}/key{i}"), encode_state(v, tensors,
                                                                                          prefix=f"{prefix}/{k}")]
                        for i, (k, v) in enumerate(value.items())]}
    raise UnsupportedStateError(
        f"Cannot store {prefix!r} of type {type(value).__qualname__} without pickle. Supported: None, bool, int, "
        "float, str, list, tuple, dict, torch.Tensor, torch.dtype. Convert it in your state_dict() "
        "(e.g. replace a lambda with a picklable-free description) or leave it out of the checkpoint."
    )


def decode_state(value: Any, tensors: Mapping[str, torch.Tensor], *, source: str = "<state>") -> Any:
    """Invert :func:`encode_state`.

    Raises:
        CorruptCheckpointError: if a referenced tensor is missing or a marker is malformed.
    """
    if isinstance(value, list):
        return [decode_state(v, tensors, source=source) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1:
        ((key, inner),) = value.items()
        if key == _TUPLE:
            return tuple(decode_state(v, tensors, source=source) for v in inner)
        if key == _DICT:
            return {_hashable(decode_state(k, tensors, source=source)): decode_state(v, tensors, source=source)
                    for k, v in inner}
        if key == _TENSOR:
            if inner not in tensors:
                raise CorruptCheckpointError(f"{source}: tensor {inner!r} is referenced but not stored.")
            return tensors[inner]
        if key == _DTYPE:
            dtype = getattr(torch, str(inner), None)
            if not isinstance(dtype, torch.dtype):
                raise CorruptCheckpointError(f"{source}: unknown dtype {inner!r}.")
            return dtype
    return {k: decode_state(v, tensors, source=source) for k, v in value.items()}


def _hashable(key: Any) -> Any:
    return tuple(key) if isinstance(key, list) else key
