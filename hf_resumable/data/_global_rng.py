"""The process-wide generators (python ``random``, numpy's global ``RandomState``, torch's CPU generator) seeded
for one data operation and put back afterwards, at a cost that fits inside every training step.

:func:`~hf_resumable.data.data_rng` wraps every batch the training process fetches, so what it costs is paid on
every optimizer step. numpy's ``get_state``/``set_state`` copy the 624-word Mersenne Twister key one element at a
time, which made them the largest per-step cost of the resumable loaders. Here the
key and position are copied as the bit generator's C struct instead (``MT19937.ctypes.state_address``, two
``memmove``\\ s of 2,500 bytes). The one part of numpy's state outside that struct, legacy ``RandomState``'s cached
second Gaussian (``has_gauss``/``gauss``), is read by drawing one standard normal: the draw leaves the struct
untouched exactly when it returned the cached value. A cached value is put back with ``set_state``.

The raw copy is used only after a self-test on the first call (capture, draw, restore, compare with numpy's own
``get_state``); a numpy whose layout differs gets its public ``get_state``/``set_state`` instead, so the result is
the same either way, only slower.
"""

from __future__ import annotations

import ctypes
import logging
import random
import sys
import threading
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

__all__ = ["SeededStreams"]

_KEY_WORDS = 624  # uint32 words of the MT19937 key
_KEY_BYTES = 4 * _KEY_WORDS
_STRUCT_BYTES = _KEY_BYTES + 4  # struct { uint32_t key[624]; int pos; }


def _global_random_state() -> np.random.RandomState:
    return np.random.mtrand._rand


class _RawNumpyState:
    """numpy's global ``RandomState`` saved as its raw MT19937 struct plus the cached Gaussian (or ``None``)."""

    __slots__ = ("raw", "gauss")

    def __init__(self, raw: bytes, gauss: float | None) -> None:
        self.raw, self.gauss = raw, gauss


def _struct_address(state: np.random.RandomState) -> int:
    """Address of the MT19937 struct inside ``state``'s bit generator (fixed for the generator's lifetime)."""
    return state._bit_generator.ctypes.state_address


def _capture_raw(state: np.random.RandomState, address: int) -> _RawNumpyState:
    raw = ctypes.string_at(address, _STRUCT_BYTES)
    probe = state.standard_normal()
    # Without a cached Gaussian the draw consumes at least four words (the struct changes); with one it returns it.
    return _RawNumpyState(raw, probe if ctypes.string_at(address, _STRUCT_BYTES) == raw else None)


def _restore_raw(state: np.random.RandomState, address: int, saved: _RawNumpyState) -> None:
    if saved.gauss is None:
        state.seed(0)  # clears the cached Gaussian; the key and position are overwritten next
        ctypes.memmove(address, saved.raw, _STRUCT_BYTES)
        return
    key = np.frombuffer(saved.raw, dtype=np.uint32, count=_KEY_WORDS).tolist()
    position = int.from_bytes(saved.raw[_KEY_BYTES:_STRUCT_BYTES], sys.byteorder, signed=True)
    state.set_state({"bit_generator": "MT19937", "state": {"key": key, "pos": position}, "has_gauss": 1,
                     "gauss": saved.gauss})


def _same_state(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (np.array_equal(a["state"]["key"], b["state"]["key"]) and a["state"]["pos"] == b["state"]["pos"]
            and a["has_gauss"] == b["has_gauss"] and a["gauss"] == b["gauss"])


def _raw_copy_works(state: np.random.RandomState) -> bool:
    """Self-test of the raw copy on ``state`` (left as it was found): both branches, against ``get_state``."""
    if type(state._bit_generator).__name__ != "MT19937":
        return False
    original = state.get_state(legacy=False)
    try:
        address = _struct_address(state)
        for odd in (False, True):  # without and with a cached Gaussian
            state.seed(12345)
            if odd:
                state.standard_normal()
            expected = state.get_state(legacy=False)
            saved = _capture_raw(state, address)
            state.seed(54321)
            state.standard_normal(3)
            _restore_raw(state, address, saved)
            if not _same_state(state.get_state(legacy=False), expected):
                return False
        return True
    except (AttributeError, TypeError, ValueError) as error:
        logger.debug("numpy's raw MT19937 state is not usable (%s); using get_state/set_state.", error)
        return False
    finally:
        state.set_state(original)


class _NumpyStreams:
    """Capture/restore of numpy's global generator: the raw copy where it passed its self-test, else numpy's API."""

    def __init__(self) -> None:
        self._state: np.random.RandomState | None = None  # the global RandomState the verdict is for
        self._address: int | None = None  # its struct's address, None: use get_state/set_state
        self._lock = threading.Lock()

    def _checked(self) -> np.random.RandomState:
        state = _global_random_state()
        if state is not self._state:
            with self._lock:
                if state is not self._state:
                    self._address = _struct_address(state) if _raw_copy_works(state) else None
                    self._state = state
                    if self._address is None:
                        logger.debug("numpy %s: the per-batch random context uses get_state/set_state.",
                                     np.__version__)
        return state

    def capture(self) -> tuple[np.random.RandomState, int | None, Any]:
        state = self._checked()
        address = self._address
        return state, address, (state.get_state() if address is None else _capture_raw(state, address))

    @staticmethod
    def restore(saved: tuple[np.random.RandomState, int | None, Any]) -> None:
        state, address, value = saved
        if address is None:
            state.set_state(value)
        else:
            _restore_raw(state, address, value)


_NUMPY = _NumpyStreams()


class SeededStreams:
    """Context manager: python, numpy and torch CPU global generators seeded from ``seed``, restored on exit.

    The same streams as :func:`hf_resumable.format.rng.seeded_rng` (the same numbers are drawn inside), with a
    faster save and restore of numpy's state (see the module documentation).

    Args:
        seed (`int`): the seed of all three generators inside the block.
        restore (`bool`, *optional*, defaults to `True`): save the generators on entry and put them back on exit
            (`False` in a ``DataLoader`` worker, whose streams nothing else draws from).

    Example:

    ```python
    >>> import numpy as np
    >>> before = np.random.get_state()[1].copy()
    >>> with SeededStreams(3):
    ...     first = np.random.rand()
    >>> with SeededStreams(3):
    ...     first == np.random.rand()
    True
    >>> bool((np.random.get_state()[1] == before).all())
    True
    ```
    """

    __slots__ = ("seed", "restore", "_saved")

    def __init__(self, seed: int, *, restore: bool = True) -> None:
        self.seed, self.restore, self._saved = seed, restore, None

    def __enter__(self) -> None:
        if self.restore:
            self._saved = (random.getstate(), _NUMPY.capture(), torch.default_generator.get_state())
        random.seed(self.seed)
        np.random.seed(self.seed)
        # Only the CPU generator: torch.manual_seed also walks every accelerator (far slower), and data code
        # runs on the CPU.
        torch.default_generator.manual_seed(self.seed)

    def __exit__(self, *exc_info: Any) -> None:
        saved, self._saved = self._saved, None
        if saved is not None:
            random.setstate(saved[0])
            _NUMPY.restore(saved[1])
            torch.default_generator.set_state(saved[2])
