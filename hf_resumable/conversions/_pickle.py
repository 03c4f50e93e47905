"""The only pickle reads in hf_resumable: stock checkpoints' files, each through an allow-list, never executed.

:func:`load_torch_pickle` reads a ``torch.save`` file with ``torch.load(weights_only=True)`` plus the globals the
caller names (DeepSpeed's objects as the inert stand-ins of :data:`DEEPSPEED_GLOBALS`); :func:`load_dcp_metadata`
reads DCP's ``.metadata`` with an unpickler that builds only DCP's metadata classes, ``torch.Size``, dtypes and
memory formats, and raises :class:`~hf_resumable.errors.UnsafePickleError` naming the file for anything else.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import re
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

import torch

from ..errors import CorruptCheckpointError, UnsafePickleError
from ..format._safefile import read_regular_file

logger = logging.getLogger(__name__)

__all__ = ["load_torch_pickle", "load_dcp_metadata", "DEEPSPEED_GLOBALS", "numpy_globals", "StandIn"]

# How torch's weights_only unpickler names a global it refused.
_REFUSED_GLOBAL_RE = re.compile(r"GLOBAL ([\w.]+)")
# Largest .metadata accepted (a 70B model's is a few MB).
MAX_DCP_METADATA_BYTES = 256 * 2**20


class StandIn:
    """An inert record of a pickled object of another library's class: its pickled ``__dict__``, nothing run.

    Example:

    ```python
    >>> scaler = StandIn.__new__(StandIn)
    >>> scaler.__setstate__({"cur_scale": 1.0, "dynamic": False})
    >>> vars(scaler)
    {'cur_scale': 1.0, 'dynamic': False}
    ```
    """

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (dict, slots) of a class with __slots__
            state = {**(state[0] or {}), **(state[1] or {})}
        if not isinstance(state, dict):
            raise pickle.UnpicklingError(f"unexpected state of type {type(state).__name__}")
        self.__dict__.update(state)


class _LossScaler(StandIn):
    """Stand-in for ``deepspeed.runtime.fp16.loss_scaler.LossScaler`` / ``DynamicLossScaler``."""


class _FragmentAddress(StandIn):
    """Stand-in for ``deepspeed.utils.tensor_fragment.fragment_address`` (``numel``, ``start``)."""


def _zero_stage(value: int) -> int:
    """Stand-in for ``deepspeed.runtime.zero.config.ZeroStageEnum(value)``: the stage as an int."""
    if not isinstance(value, int):
        raise pickle.UnpicklingError(f"ZeroStageEnum of {type(value).__name__}")
    return value


# DeepSpeed's globals in its ZeRO-1/2 checkpoint files, each built as an inert stand-in (never imported).
DEEPSPEED_GLOBALS: list[tuple[Any, str]] = [
    (_LossScaler, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (_LossScaler, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (_FragmentAddress, "deepspeed.utils.tensor_fragment.fragment_address"),
    (_zero_stage, "deepspeed.runtime.zero.config.ZeroStageEnum"),
]


def numpy_globals() -> list[Any]:
    """What ``weights_only=True`` must also build for the stock RNG files: numpy arrays (the numpy generator state).

    The allow-list of transformers' ``trainer_pt_utils.safe_globals``, with which the Trainer reads these files.
    """
    import numpy as np

    core = np._core if hasattr(np, "_core") else np.core  # numpy 2 renamed numpy.core
    return [core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def load_torch_pickle(path: str | os.PathLike, *, safe_globals: Iterable[Any] = ()) -> Any:
    """``torch.load(path, weights_only=True)`` onto the CPU, with numpy's array reconstruction and ``safe_globals``
    (callables, or ``(callable, "module.name")`` stand-ins) allowed.

    Raises:
        UnsafePickleError: (also a ``pickle.UnpicklingError``) the file names a global outside the allow-list.
        CorruptCheckpointError: not a readable ``torch.save`` file.
    """
    try:
        with torch.serialization.safe_globals([*numpy_globals(), *safe_globals]):
            return torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as err:
        message = " ".join(str(err).split())
        named = _REFUSED_GLOBAL_RE.search(message)
        reason = f"it names {named.group(1)}" if named else message[:300]
        raise UnsafePickleError(
            f"{path}: refused by torch.load(weights_only=True), which builds only tensors, plain containers and the "
            f"stand-ins hf_resumable names ({reason}). hf_resumable never unpickles other objects; convert only "
            "checkpoints written by transformers' Trainer, DeepSpeed or accelerate.") from err
    except (RuntimeError, EOFError) as err:  # torch's zip reader on a truncated or non-zip file
        raise CorruptCheckpointError(f"{path}: not a readable torch.save file ({' '.join(str(err).split())[:300]})"
                                     ) from err


def _layout(name: str) -> torch.layout:
    """Stand-in for ``torch.serialization._get_layout``: only the names of torch's layouts (``"torch.strided"``)."""
    layout = getattr(torch, name.removeprefix("torch."), None) if isinstance(name, str) else None
    if not isinstance(layout, torch.layout):
        raise pickle.UnpicklingError(f"unknown torch layout {name!r:.80}")
    return layout


def _dcp_allowed() -> dict[tuple[str, str], Any]:
    """``(module, name) -> object`` of every global a DCP ``.metadata`` may name."""
    from torch.distributed.checkpoint import metadata as dcp

    allowed: dict[tuple[str, str], Any] = {}
    for name in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                 "TensorProperties", "MetadataIndex", "StorageMeta"):
        if hasattr(dcp, name):
            allowed[(dcp.__name__, name)] = getattr(dcp, name)
    from torch.distributed.checkpoint import filesystem

    allowed[(filesystem.__name__, "_StorageInfo")] = filesystem._StorageInfo
    if hasattr(dcp, "_MEM_FORMAT_ENCODING"):  # an Enum: REDUCE(value) looks a member up
        allowed[(dcp.__name__, "_MEM_FORMAT_ENCODING")] = dcp._MEM_FORMAT_ENCODING
    allowed[("torch.serialization", "_get_layout")] = _layout
    # StorageMeta.checkpoint_id: built as a pure path (no filesystem access)
    allowed[("pathlib", "PosixPath")] = allowed[("pathlib", "Path")] = PurePosixPath
    allowed[("pathlib", "WindowsPath")] = PureWindowsPath
    allowed[("torch", "Size")] = torch.Size
    allowed[("collections", "OrderedDict")] = OrderedDict
    for value in vars(torch).values():
        if isinstance(value, (torch.dtype, torch.memory_format, torch.layout)):
            allowed[("torch", str(value).rpartition(".")[2])] = value
    return allowed


class _DcpUnpickler(pickle.Unpickler):
    """Builds only the allow-listed DCP metadata classes and torch values; refuses every other global."""

    def __init__(self, file: io.BufferedIOBase, allowed: dict[tuple[str, str], Any]) -> None:
        super().__init__(file)
        self._allowed = allowed

    def find_class(self, module: str, name: str) -> Any:
        found = self._allowed.get((module, name))
        if found is None:
            raise pickle.UnpicklingError(f"global {module}.{name} is not a torch.distributed.checkpoint metadata "
                                         "class")
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent ids are not part of a DCP .metadata")


def load_dcp_metadata(path: str | os.PathLike) -> Any:
    """Read ``torch.distributed.checkpoint``'s pickled ``.metadata`` without executing code from it.

    Only DCP's metadata dataclasses (``Metadata``, ``TensorStorageMetadata``, ``ChunkStorageMetadata``,
    ``TensorProperties``, ``BytesStorageMetadata``, ``MetadataIndex``, ``_StorageInfo``, ``StorageMeta``),
    ``torch.Size``, dtypes, layouts (by name) and memory formats, and pure paths (``StorageMeta.checkpoint_id``) are
    built; anything else is refused.

    Args:
        path (`str` or `os.PathLike`): the ``.metadata`` file.

    Returns:
        `torch.distributed.checkpoint.metadata.Metadata`

    Raises:
        UnsafePickleError: the pickle names any other global (e.g. ``os.system``), naming the file.
        CorruptCheckpointError: the file is not a readable pickle of a ``Metadata``, or is too large.
    """
    path = Path(path)
    data = read_regular_file(path, limit=MAX_DCP_METADATA_BYTES)  # never waits on a FIFO; bounded
    allowed = _dcp_allowed()
    try:
        metadata = _DcpUnpickler(io.BytesIO(data), allowed).load()
    except pickle.UnpicklingError as err:
        raise UnsafePickleError(f"{path}: refused ({err}). hf_resumable reads a torch.distributed.checkpoint "
                                ".metadata with an unpickler that builds only DCP's metadata classes and torch "
                                "dtypes/sizes; this file is not one written by torch.distributed.checkpoint (or was "
                                "tampered with). Convert only checkpoints you trust.") from err
    except (EOFError, TypeError, ValueError, AttributeError, IndexError, KeyError) as err:
        raise CorruptCheckpointError(f"{path}: not a readable DCP .metadata ({type(err).__name__}: {err}).") from err
    if type(metadata) is not allowed[("torch.distributed.checkpoint.metadata", "Metadata")]:
        raise CorruptCheckpointError(f"{path}: holds a {type(metadata).__name__}, not a DCP Metadata.")
    return metadata
