"""Encode Python state objects (``state_dict()`` results) as JSON plus a side table of tensors, never pickle.

Every value must be one of a closed set of types; anything else is refused at save time with the path of the
offending value. The encoding rules (the decoder inverts them exactly): docs/format.md#a-regular-checkpoint.

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

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from ..errors import CorruptCheckpointError, UnsupportedStateError
from ._jsonio import field_error

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


def decode_state(value: Any, tensors: Mapping[str, torch.Tensor], *, source: str = "<state>", path: str = "") -> Any:
    """Invert :func:`encode_state`, checking every marker (nothing is trusted from the file). ``tensors`` is the side
    table the document refers to; ``source`` (the file) and ``path`` (where ``value`` sits in it) go into errors.

    Raises:
        CorruptCheckpointError: naming the file, the path inside it and what was expected, if a marker is
            malformed (e.g. ``{"__tuple__": 5}``), a referenced tensor is missing, a dict key is not hashable,
            or the document is nested too deeply.
    """
    try:
        return _decode(value, _resolver(tensors, source), source, path)
    except RecursionError:
        raise CorruptCheckpointError(f"{source}: {path or '<root>'}: the state is nested too deeply.") from None


def _resolver(tensors: Mapping[str, torch.Tensor], source: str) -> Callable[[str, str], Any]:
    def resolve(name: str, where: str) -> torch.Tensor:
        if name not in tensors:
            raise _missing(source, where, name)
        return tensors[name]

    return resolve


def _missing(source: str, where: str, name: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{source}: {where or '<root>'}: tensor {name!r} is referenced but not stored.")


def _decode(value: Any, resolve: Callable[[str, str], Any], source: str, path: str) -> Any:
    if isinstance(value, list):
        return [_decode(v, resolve, source, f"{path}/{i}") for i, v in enumerate(value)]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if not isinstance(value, dict):
        raise field_error(source, path, value, "a JSON value")
    markers = _MARKERS.intersection(value)
    if not markers:
        return {k: _decode(v, resolve, source, f"{path}/{k}") for k, v in value.items()}
    if len(value) != 1:  # the encoder escapes dicts holding marker keys as __dict__ pairs
        raise field_error(source, path, value, f"a single-key {sorted(markers)[0]} marker")
    ((key, inner),) = value.items()
    if key == _TUPLE:
        if not isinstance(inner, list):
            raise field_error(source, path, value, '{"__tuple__": [items]}')
        return tuple(_decode(v, resolve, source, f"{path}/{i}") for i, v in enumerate(inner))
    if key == _DICT:
        return _decode_pairs(value, inner, resolve, source, path)
    if key == _TENSOR:
        if not isinstance(inner, str):
            raise field_error(source, path, value, '{"__tensor__": "<name>"}')
        return resolve(inner, path)
    # vars(), not getattr(): a name from the file must never trigger torch's lazy submodule imports.
    dtype = vars(torch).get(inner) if isinstance(inner, str) else None
    if not isinstance(dtype, torch.dtype):
        raise field_error(source, path, value, 'a torch dtype name such as {"__dtype__": "float32"}')
    return dtype


def _decode_pairs(value: Any, inner: Any, resolve: Callable[[str, str], Any], source: str, path: str) -> dict:
    if not isinstance(inner, list) or not all(isinstance(p, list) and len(p) == 2 for p in inner):
        raise field_error(source, path, value, '{"__dict__": [[key, value], ...]}')
    out = {}
    for i, (k, v) in enumerate(inner):
        key = _hashable(_decode(k, resolve, source, f"{path}/key{i}"))
        try:
            hash(key)
        except TypeError:
            raise field_error(source, f"{path}/key{i}", k,
                              "a hashable key (None, bool, number, str or tuple)") from None
        out[key] = _decode(v, resolve, source, f"{path}/{key}")
    return out


def _hashable(key: Any) -> Any:
    return tuple(key) if isinstance(key, list) else key
