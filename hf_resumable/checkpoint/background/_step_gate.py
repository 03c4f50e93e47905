"""Hold an optimizer's next step while a background save copies the tensors that step writes (parameters and
optimizer state), so that forward and backward overlap the copy: one mechanism for every engine
(docs/checkpoints.md#what-a-background-save-holds). A step that does not go through a torch optimizer cannot be
held: such saves stage every tensor before they return (:func:`gated_optimizer` answers ``None``).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

logger = logging.getLogger(__name__)

__all__ = ["StepGate", "gated_optimizer", "step_gate", "step_storages", "memory_key"]


class StepGate:
    """The gate one torch optimizer's steps pass: open unless a save holds it (holds are counted).

    While closed, a step first runs the holders' ``assist`` callables (the training thread joins the copy it waits
    for), then waits for every hold to be released.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holds = 0
        self._assists: list[Callable[[], None]] = []
        self._open = threading.Event()
        self._open.set()
        self.blocked = 0  # steps that found the gate closed (tests, benchmarks)
        self.waited = 0.0  # seconds they waited in all

    def hold(self, assist: Callable[[], None] | None = None) -> Callable[[], None]:
        """Close the gate until the returned function is called (idempotent; the gate opens once every hold is
        released). ``assist``: work a waiting step may do itself to get through sooner (it must be safe to call
        from the training thread, at any time, any number of times)."""
        with self._lock:
            self._holds += 1
            self._open.clear()
            if assist is not None:
                self._assists.append(assist)
        released = False

        def release() -> None:
            nonlocal released
            with self._lock:
                if released:
                    return
                released = True
                self._holds -= 1
                if assist is not None:
                    self._assists.remove(assist)
                if not self._holds:
                    self._open.set()

        return release

    @property
    def is_open(self) -> bool:
        return self._open.is_set()

    def wait(self) -> None:
        """Return once the gate is open (at once if it is)."""
        if self._open.is_set():
            return
        began = time.perf_counter()
        with self._lock:
            assists = list(self._assists)
        for assist in assists:
            assist()
        self._open.wait()
        self.blocked += 1
        self.waited += time.perf_counter() - began


# torch optimizer -> its gate; the pre-hook is registered once and never removed (a hook removed while the training
# thread runs the hooks would break its iteration over them)
_GATES: weakref.WeakKeyDictionary[torch.optim.Optimizer, StepGate] = weakref.WeakKeyDictionary()
_NOT_GATED: set[str] = set()  # optimizer types already logged as not gated


def gated_optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    """The torch optimizer whose steps a save of ``optimizer`` holds: the optimizer itself, or the one an engine's
    checkpoint view steps (its ``gated_optimizer``, e.g. ZeRO's base optimizer); ``None`` where there is no hook to
    hold (logged once per type at DEBUG: those saves copy every tensor before they return)."""
    if optimizer is None:
        return None
    inner = getattr(optimizer, "gated_optimizer", optimizer)
    if isinstance(inner, torch.optim.Optimizer) and hasattr(inner, "register_step_pre_hook"):
        return inner
    kind = type(optimizer).__qualname__
    if kind not in _NOT_GATED:
        _NOT_GATED.add(kind)
        logger.debug("%s steps through no torch optimizer: background saves of it copy every tensor before they "
                     "return.", kind)
    return None


def step_gate(optimizer: torch.optim.Optimizer) -> StepGate:
    """The gate ``optimizer``'s steps wait at (its step pre-hook registered on first use)."""
    gate = _GATES.get(optimizer)
    if gate is None:
        gate = _GATES[optimizer] = StepGate()

        def wait(*args: Any) -> None:  # a pre-hook returns None (or new arguments)
            gate.wait()

        optimizer.register_step_pre_hook(wait)
    return gate


def memory_key(tensor: torch.Tensor) -> tuple[torch.device, int] | None:
    """The identity of the memory ``tensor`` views, whatever part of it and however (a DTensor: its local piece's),
    or ``None`` without one. Coarser than :func:`._model.storage_key`, which tells tied views of one memory apart."""
    tensor = getattr(tensor, "_local_tensor", tensor)
    device = tensor.device
    if device.type == "meta" or not tensor.numel():
        return None
    try:
        return device, tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a tensor subclass without storage
        return None


def _optimizer_tensors(optimizer: Any) -> Iterator[torch.Tensor]:
    custom = getattr(optimizer, "step_tensors", None)
    if custom is not None:
        yield from custom()
        return
    for group in optimizer.param_groups:
        yield from group["params"]
    for state in optimizer.state.values():
        yield from (value for value in state.values() if torch.is_tensor(value))


def step_storages(optimizer: Any) -> set[tuple[torch.device, int]]:
    """The memory ``optimizer``'s step writes and nothing else between two steps writes: its parameters and its
    state (an engine's checkpoint view names its own, ``step_tensors()``). A tensor viewing other memory (a buffer,
    a scheduler's tensor learning rate, a copy a state-dict walk made) is copied when the save is called."""
    return {key for key in map(memory_key, _optimizer_tensors(optimizer)) if key is not None}


def split_by_storage(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]], storages: set[tuple[torch.device, int]]
                     ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[tuple[torch.Tensor, torch.Tensor]]]:
    """``(dst, src)`` pairs split into those to copy now and those whose source only the held step writes."""
    now, later = [], []
    for pair in pairs:
        (later if storages and memory_key(pair[1]) in storages else now).append(pair)
    return now, later
