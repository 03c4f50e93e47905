"""Private generators reachable from a collator or data set, found once and reseeded per batch from its position."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import random
import types
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from ..format.rng import derive_seed
from ._position import _TAG_GENERATOR

logger = logging.getLogger(__name__)


_GENERATOR_TYPES = (torch.Generator, np.random.Generator, np.random.RandomState, random.Random)
_LEAF_TYPES = (str, bytes, int, float, complex, bool, type(None), torch.Tensor, np.ndarray, np.generic,
               torch.nn.Module, type, types.ModuleType, types.BuiltinFunctionType, torch.dtype, torch.device)
_SKIPPED_PACKAGES = ("tokenizers", "datasets", "torch", "numpy", "pyarrow", "pandas")
_MAX_DEPTH = 4
_MAX_ITEMS = 64


def _reseed(generator: Any, seed: int) -> None:
    if isinstance(generator, torch.Generator):
        generator.manual_seed(seed)
    elif isinstance(generator, np.random.Generator):
        generator.bit_generator.state = type(generator.bit_generator)(seed).state
    else:  # numpy's RandomState, random.Random
        generator.seed(seed)


def _is_lazy_collator(obj: Any) -> bool:
    """transformers' collators with ``seed=`` create ``self.generator`` on their first call (and per process)."""
    return (isinstance(getattr(obj, "seed", None), int) and hasattr(obj, "generator")
            and callable(getattr(obj, "get_generator", None)))


def _children(obj: Any) -> Iterator[tuple[tuple[str, Any], Any]]:
    """``((kind, key), child)`` for everything a generator may hide behind."""
    if isinstance(obj, functools.partial):
        yield ("attr", "func"), obj.func
        for index, value in enumerate(obj.args):
            yield ("arg", index), value
        for key, value in obj.keywords.items():
            yield ("kwarg", key), value
        return
    if isinstance(obj, types.MethodType):
        yield ("attr", "__self__"), obj.__self__
        yield ("attr", "__func__"), obj.__func__
        return
    if isinstance(obj, types.FunctionType):
        for index, cell in enumerate(obj.__closure__ or ()):
            with contextlib.suppress(ValueError):  # an empty cell
                yield ("cell", index), cell.cell_contents
        return
    if isinstance(obj, (list, tuple)):
        if len(obj) <= _MAX_ITEMS:
            yield from ((("item", index), value) for index, value in enumerate(obj))
        return
    if isinstance(obj, dict):
        if len(obj) <= _MAX_ITEMS:
            yield from ((("item", key), value) for key, value in obj.items() if isinstance(key, (str, int)))
        return
    if type(obj).__module__.split(".")[0] in _SKIPPED_PACKAGES or hasattr(obj, "convert_tokens_to_ids"):
        return  # tokenizers, data sets, arrays: large, and hold no private generator of the user's
    attributes = getattr(obj, "__dict__", None)
    if isinstance(attributes, dict) and len(attributes) <= _MAX_ITEMS:
        yield from ((("attr", key), value) for key, value in attributes.items() if not key.startswith("__"))


def _resolve(root: Any, path: tuple[tuple[str, Any], ...]) -> Any:
    obj = root
    for kind, key in path:
        if kind == "attr":
            obj = getattr(obj, key)
        elif kind == "arg":
            obj = obj.args[key]
        elif kind == "kwarg":
            obj = obj.keywords[key]
        elif kind == "cell":
            obj = obj.__closure__[key].cell_contents
        else:
            obj = obj[key]
    return obj


class GeneratorSlots:
    """The private random generators reachable from an object, found once and reseeded before every batch.

    ``root`` is searched (what is covered: docs/trainer.md#what-else-it-does); each generator found is remembered
    by its path from ``root``, so a copy of ``root`` in a ``DataLoader`` worker is reseeded the same way.

    Args:
        root: a collator, a data set, a transform function (``None``: nothing to reseed).

    Example:

    ```python
    >>> import numpy as np
    >>> class Noise:
    ...     def __init__(self):
    ...         self.rng = np.random.default_rng(0)
    ...     def __call__(self, items):
    ...         return [self.rng.integers(100) for _ in items]
    >>> noise = Noise()
    >>> slots = GeneratorSlots(noise)
    >>> slots.paths
    ['rng']
    >>> slots.reseed(noise, seed=7); first = noise([0, 0])
    >>> slots.reseed(noise, seed=7); first == noise([0, 0])
    True
    ```
    """

    def __init__(self, root: Any) -> None:
        self._slots: list[tuple[tuple[tuple[str, Any], ...], bool]] = []  # (path, lazily created by a collator)
        if root is not None:
            self._search(root, (), set())

    def _search(self, obj: Any, path: tuple, seen: set[int]) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, _GENERATOR_TYPES):
            self._slots.append((path, False))
            return
        if len(path) >= _MAX_DEPTH or isinstance(obj, _LEAF_TYPES):
            return
        lazy = _is_lazy_collator(obj)
        if lazy:
            self._slots.append((path, True))
        for step, child in _children(obj):
            if lazy and step == ("attr", "generator"):
                continue
            self._search(child, path + (step,), seen)

    @property
    def paths(self) -> list[str]:
        """Readable paths of the generators found (``"inner.generator"``, ``"rng"``...)."""
        return [".".join([str(key) for _, key in path] + (["generator"] if lazy else []))
                for path, lazy in self._slots]

    def __bool__(self) -> bool:
        return bool(self._slots)

    def reseed(self, root: Any, *, seed: int) -> None:
        """Reseed every generator under ``root`` from ``seed`` and its path (and its owner's ``seed``)."""
        for path, lazy in self._slots:
            try:
                obj = _resolve(root, path)
            except (AttributeError, IndexError, KeyError, TypeError, ValueError):
                continue  # the object changed shape since it was searched
            name = "/".join(str(key) for _, key in path)
            if lazy:
                if not isinstance(obj.generator, _GENERATOR_TYPES):
                    obj.generator = obj.get_generator(obj.seed)
                if hasattr(obj, "_generator_pid"):  # else the collator re-creates it from its seed in a worker
                    obj._generator_pid = os.getpid()
                _reseed(obj.generator, derive_seed(seed, _TAG_GENERATOR, name, "generator", obj.seed))
            else:
                _reseed(obj, derive_seed(seed, _TAG_GENERATOR, name))


def _dataset_generator_root(dataset: Any) -> Any:
    """What to search for private generators in a data set: a torch data set itself, or a ``datasets`` transform."""
    if type(dataset).__module__.split(".")[0] == "datasets":
        return (getattr(dataset, "_format_kwargs", None) or {}).get("transform")
    return dataset
