"""Capture and restore every random number generator a training step touches, without pickle.

An :class:`RngState` (python, numpy, torch CPU, every CUDA device) is stored as a safetensors file of byte tensors,
its small scalar parts in the header metadata. :func:`seeded_rng` reseeds the global generators from a position and
puts them back afterwards, so data randomness is a pure function of where the run is.

Example:

```python
>>> import random
>>> from hf_resumable.format.rng import capture_rng_state, restore_rng_state
>>> state = capture_rng_state()
>>> a = random.random()
>>> restore_rng_state(state)
>>> a == random.random()
True

```
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from ..errors import CorruptCheckpointError, InexactResumeError
from .safetensors_io import FileRecord, read_header, read_safetensors, write_safetensors

logger = logging.getLogger(__name__)

__all__ = ["RngState", "capture_rng_state", "restore_rng_state", "check_rng_state", "check_cuda_device_count",
           "cuda_device_mismatch", "visible_cuda_devices", "save_rng_state", "load_rng_state", "decode_rng_state",
           "derive_seed", "seeded_rng"]

_KEY_TORCH = "torch_cpu"
_KEY_NUMPY = "numpy_keys"
_CUDA_PREFIX = "cuda/"
_META_PYTHON = "python"
_META_NUMPY = "numpy"
_META_DEVICES = "cuda_device_count"
_MT_WORDS = 624  # words of an MT19937 state (python's and numpy's generators)


@dataclass
class RngState:
    """The state of python ``random``, numpy's global generator, torch CPU and every CUDA device."""

    python: tuple  # ``random.getstate()``
    numpy: tuple  # ``np.random.get_state()`` (legacy MT19937 tuple)
    torch_cpu: torch.Tensor  # ``torch.get_rng_state()`` (uint8)
    cuda: list[torch.Tensor] = field(default_factory=list)  # ``torch.cuda.get_rng_state_all()`` ([] without CUDA)

    def __post_init__(self) -> None:
        if self.torch_cpu.dtype != torch.uint8:
            raise ValueError(f"torch_cpu RNG state must be uint8, got {self.torch_cpu.dtype}.")

    def equals(self, other: "RngState") -> bool:
        """Exact equality of every generator's state."""
        return (
            self.python == other.python
            and self.numpy[0] == other.numpy[0]
            and np.array_equal(self.numpy[1], other.numpy[1])
            and tuple(self.numpy[2:]) == tuple(other.numpy[2:])
            and torch.equal(self.torch_cpu, other.torch_cpu)
            and len(self.cuda) == len(other.cuda)
            and all(torch.equal(a, b) for a, b in zip(self.cuda, other.cuda))
        )


def capture_rng_state() -> RngState:
    """Snapshot python, numpy, torch CPU and all CUDA generators (copies, safe to keep)."""
    cuda = [s.clone() for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else []
    return RngState(random.getstate(), np.random.get_state(), torch.get_rng_state().clone(), cuda)


def visible_cuda_devices() -> int:
    """The number of CUDA devices this process sees (0 without CUDA): the generators :func:`capture_rng_state`
    captures and :func:`restore_rng_state` restores."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def cuda_device_mismatch(saved: int, visible: int) -> str | None:
    """Why an RNG state of ``saved`` CUDA generators cannot be restored exactly where ``visible`` devices are seen,
    or `None` when the counts match (a pure check: it reads no device).

    Each CUDA device has its own generator, saved in device order; with another count, dropout and any other
    draw on a device would not continue the saved streams.

    Example:

    ```python
    >>> cuda_device_mismatch(2, 2) is None
    True
    >>> cuda_device_mismatch(1, 0)
    'RNG state was saved with 1 CUDA device(s) but 0 are visible now'
    ```
    """
    if saved == visible:
        return None
    return f"RNG state was saved with {saved} CUDA device(s) but {visible} are visible now"


def check_cuda_device_count(state: RngState, *, visible: int | None = None, source: str = "<rng state>") -> None:
    """Refuse to restore ``state`` where another number of CUDA devices is ``visible`` (default: those seen now),
    before anything is changed; ``source`` (a path) is named in the message.

    Raises:
        InexactResumeError: if ``state`` holds another number of CUDA generators than ``visible``.
    """
    visible = visible_cuda_devices() if visible is None else visible
    problem = cuda_device_mismatch(len(state.cuda), visible)
    if problem is not None:
        raise InexactResumeError(
            f"{source}: {problem}, so the run would not continue exactly. Make the same devices visible "
            "(CUDA_VISIBLE_DEVICES) as when the checkpoint was saved, or pass allow_inexact_resume=True to continue "
            "anyway.")


def restore_rng_state(state: RngState, *, allow_device_mismatch: bool = False) -> None:
    """Put every generator back to ``state``.

    The CUDA device count is checked first: a refused state changes no generator.

    Raises:
        InexactResumeError: if the number of CUDA devices differs from the saved one (the run would
            not continue exactly), unless ``allow_device_mismatch=True``, which restores the CPU generators and
            logs a WARNING.
    """
    devices = visible_cuda_devices()
    if not allow_device_mismatch:
        check_cuda_device_count(state, visible=devices)
    random.setstate(state.python)
    np.random.set_state(state.numpy)
    torch.set_rng_state(state.torch_cpu)
    problem = cuda_device_mismatch(len(state.cuda), devices)
    if problem is not None:
        logger.warning("%s; CUDA generators are not restored, the run will not continue exactly.", problem)
        return
    if devices:
        torch.cuda.set_rng_state_all(state.cuda)


def check_rng_state(state: RngState, *, source: str = "<rng state>") -> None:
    """Refuse a state that the generators would reject, before any generator (or anything else) is changed.

    Each part is tried on a private generator of its kind (``random.Random``, ``numpy.random.RandomState``,
    ``torch.Generator``), so the check is exactly the generators' own and the global streams are untouched.
    CUDA states are checked for their dtype and, when CUDA is visible, their size.

    Raises:
        CorruptCheckpointError: naming ``source`` and the generator whose state is invalid.
    """
    _check_ranges(state, source)
    checks = (("python", lambda: random.Random().setstate(state.python)),
              ("numpy", lambda: np.random.RandomState().set_state(state.numpy)),
              ("torch_cpu", lambda: torch.Generator().set_state(state.torch_cpu)))
    for part, check in checks:
        try:
            check()
        except (TypeError, ValueError, RuntimeError, OverflowError, IndexError) as err:
            raise CorruptCheckpointError(
                f"{source}: the {part} RNG state is invalid ({type(err).__name__}: {err}); expected a state that "
                f"{part} generators accept. Resume from an earlier checkpoint, or pass allow_inexact_resume=True "
                "with restore_rng=False to continue without it.") from None
    size = torch.cuda.get_rng_state(0).numel() if torch.cuda.is_available() and torch.cuda.device_count() else None
    for i, cuda in enumerate(state.cuda):
        if cuda.dtype != torch.uint8 or cuda.dim() != 1 or (size is not None and cuda.numel() != size):
            raise CorruptCheckpointError(
                f"{source}: the RNG state of CUDA device {i} is a {cuda.dtype} tensor of shape {list(cuda.shape)}; "
                f"expected uint8 of shape [{size if size is not None else 'n'}]. Resume from an earlier checkpoint.")


def _check_ranges(state: RngState, source: str) -> None:
    """What the generators accept but would silently change: out-of-range words and positions."""
    words = _MT_WORDS
    problem = None
    try:
        version, internal, gauss = state.python
        if version != 3 or not isinstance(internal, tuple) or len(internal) != words + 1:
            problem = f"python: expected (3, <{words + 1} ints>, gauss)"
        elif not all(type(x) is int and 0 <= x < 2**32 for x in internal[:words]) or not (
                type(internal[words]) is int and 0 <= internal[words] <= words):
            problem = f"python: expected {words} 32-bit words and a position in 0..{words}"
        elif gauss is not None and type(gauss) is not float:
            problem = "python: expected a float or None as the cached gauss value"
        kind, keys, pos, has_gauss, cached = state.numpy
        if problem is None and not (type(pos) is int and 0 <= pos <= words and has_gauss in (0, 1)
                                    and type(cached) is float and len(keys) == words):
            problem = f"numpy: expected {words} keys, a position in 0..{words}, has_gauss 0 or 1 and a float"
    except (TypeError, ValueError):
        problem = "expected python (version, internal, gauss) and numpy (kind, keys, pos, has_gauss, cached) tuples"
    if problem is not None:
        raise CorruptCheckpointError(f"{source}: invalid RNG state ({problem}). Resume from an earlier checkpoint, or "
                                     "pass allow_inexact_resume=True with restore_rng=False to continue without it.")


def _python_to_json(state: tuple) -> str:
    version, internal, gauss = state
    return json.dumps([version, list(internal), gauss])


def _python_from_json(text: str) -> tuple:
    version, internal, gauss = json.loads(text)
    return (version, tuple(internal), gauss)


def save_rng_state(path: str | os.PathLike, state: RngState | None = None, *, fsync: bool = True) -> FileRecord:
    """Write ``state`` (default: the current one) as a safetensors file of byte tensors."""
    state = state or capture_rng_state()
    kind, keys, pos, has_gauss, cached = state.numpy
    tensors = [(_KEY_TORCH, state.torch_cpu), (_KEY_NUMPY, torch.from_numpy(np.asarray(keys, dtype=np.uint32)
                                                                            .view(np.int32).copy()))]
    tensors += [(f"{_CUDA_PREFIX}{i}", s) for i, s in enumerate(state.cuda)]
    metadata = {
        "format": "pt",
        _META_PYTHON: _python_to_json(state.python),
        _META_NUMPY: json.dumps([kind, int(pos), int(has_gauss), float(cached)]),
        _META_DEVICES: str(len(state.cuda)),
    }
    return write_safetensors(path, tensors, metadata=metadata, fsync=fsync)


def load_rng_state(path: str | os.PathLike, *, expected: FileRecord | None = None) -> RngState:
    """Read an :class:`RngState` written by :func:`save_rng_state`.

    Raises:
        CorruptCheckpointError: if the file is not such a file (bad header, missing parts, hash) or holds a
            state that a generator would reject (checked with :func:`check_rng_state`).
    """
    path = os.fspath(path)
    header = read_header(path)
    return decode_rng_state(header.metadata, read_safetensors(path, header=header, expected=expected), source=path)


def decode_rng_state(meta: Mapping[str, str], tensors: Mapping[str, torch.Tensor], *, source: str) -> RngState:
    """The :class:`RngState` that a file written by :func:`save_rng_state` holds: its header's metadata and its
    tensors, already read (and hash-checked) by the caller.

    Raises:
        CorruptCheckpointError: as :func:`load_rng_state`.
    """
    path = source
    try:
        devices = int(meta[_META_DEVICES])
        kind, pos, has_gauss, cached = json.loads(meta[_META_NUMPY])
        keys = tensors[_KEY_NUMPY].numpy().view(np.uint32).copy()
        numpy_state = (kind, keys, int(pos), int(has_gauss), float(cached))
        cuda = [tensors[f"{_CUDA_PREFIX}{i}"] for i in range(devices)]
        state = RngState(_python_from_json(meta[_META_PYTHON]), numpy_state, tensors[_KEY_TORCH], cuda)
    except (KeyError, ValueError, TypeError, AttributeError, OverflowError, RecursionError) as err:
        raise CorruptCheckpointError(
            f"{path}: not an hf_resumable RNG state file ({err.__class__.__name__}: {err}). "
            "Resume from an earlier checkpoint, or pass allow_inexact_resume=True to continue without it."
        ) from None
    check_rng_state(state, source=path)
    return state


def derive_seed(*parts: int | str) -> int:
    """A 32-bit seed that is a pure function of ``parts`` (stable across processes and platforms).

    Example:

    ```python
    >>> derive_seed(42, 0, 17) == derive_seed(42, 0, 17) != derive_seed(42, 0, 18)
    True

    ```
    """
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0xFFFFFFFF


@contextlib.contextmanager
def seeded_rng(seed: int, *, restore: bool = True) -> Iterator[None]:
    """Run the body with python, numpy and torch CPU generators seeded from ``seed``, then restore them.

    The caller's streams (e.g. the one dropout draws from) are left exactly as they were, so data
    randomness and model randomness never interleave. ``restore=False`` skips saving and restoring
    (e.g. inside a DataLoader worker, whose streams nothing else uses).
    """
    saved = (random.getstate(), np.random.get_state(), torch.default_generator.get_state()) if restore else None
    random.seed(seed)
    np.random.seed(seed)
    # Only the CPU generator: torch.manual_seed also walks every accelerator (far slower), and data code
    # runs on the CPU.
    torch.default_generator.manual_seed(seed)
    try:
        yield
    finally:
        if saved is not None:
            random.setstate(saved[0])
            np.random.set_state(saved[1])
            torch.default_generator.set_state(saved[2])
