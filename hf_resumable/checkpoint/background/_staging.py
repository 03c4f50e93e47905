"""Copy tensors into host staging buffers, bit for bit: now (:func:`copy_into`), or claimed tensor by tensor by
whoever helps while the caller trains on (:func:`start_copy`). Plain contiguous CPU tensors are copied by the C
library's ``memmove`` (GIL released); anything else by ``copy_``, CUDA sources ``non_blocking`` into pinned buffers."""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ...format._bytes import tensor_bytes
from ...format._libc import libc_function

# The byte copier of the staging copy: ``copy_bytes(dst_address, src_address, nbytes)``.
copy_bytes = ctypes.memmove


def _memmove_ok(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether ``dst`` and ``src`` are the same bytes in the same order: plain contiguous CPU tensors of one dtype and
    shape (checked per tensor at every async save, on the training loop's time: the cheapest tests first)."""
    return (
        src.is_cpu and dst.is_cpu
        and src.dtype == dst.dtype
        and src.layout == torch.strided and dst.layout == torch.strided
        and src.is_contiguous() and dst.is_contiguous()
        and src.shape == dst.shape
        and not src.is_conj() and not src.is_neg()
        and not src.is_quantized
    )


def _copies(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], copier: Callable[[int, int, int], Any]
            ) -> list[Callable[[], Any]]:
    """One call per pair: a raw byte copy where it serves, else ``dst.copy_(src)`` with ``src`` detached (no autograd
    record of the copy)."""
    calls: list[Callable[[], Any]] = []
    for dst, src in pairs:
        if _memmove_ok(dst, src):
            if src.nbytes:
                calls.append(lambda d=dst.data_ptr(), s=src.data_ptr(), n=src.nbytes: copier(d, s, n))
        else:
            calls.append(lambda d=dst, s=src.detach(): d.copy_(s))
    return calls


def copy_into(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], *, copier=None) -> None:
    """Copy every ``src`` into its ``dst`` (``(dst, src)`` pairs), bit for bit, and return when all bytes landed
    (:func:`start_copy`, joined at once). ``copier(dst_address, src_address, nbytes)`` copies raw bytes (default
    :data:`copy_bytes`).
    """
    start_copy(pairs, copier=copier).join()


class BackgroundCopy:
    """A staging copy claimed one tensor at a time by the threads that call :meth:`assist` (take part) or :meth:`join`
    (take part, then wait for every byte and raise the copy's error): an async save's thread, and the training thread
    once its held optimizer step is due. Both may be called from any thread, any number of times."""

    def __init__(self, calls: list[Callable[[], Any]], events: list[Any]) -> None:
        self._calls, self._events = calls, events
        self._next = self._active = 0
        self._errors: list[BaseException] = []
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)

    def _claim(self) -> Callable[[], Any] | None:
        with self._lock:
            if self._errors or self._next >= len(self._calls):
                return None
            self._next += 1
            return self._calls[self._next - 1]

    def assist(self) -> None:
        """Copy tensors until none is left to claim."""
        with self._lock:
            self._active += 1
        try:
            while (call := self._claim()) is not None:
                try:  # memmove and torch's copy_ release the GIL for the call
                    call()
                except BaseException as err:  # noqa: BLE001 - raised by join()
                    with self._lock:
                        self._errors.append(err)
        finally:
            with self._lock:
                self._active -= 1
                self._idle.notify_all()

    def join(self) -> None:
        """Take part, then wait until every claimed tensor is copied; raise the first error."""
        self.assist()
        with self._lock:
            self._idle.wait_for(lambda: not self._active)
        if self._errors:
            raise self._errors[0]
        for event in self._events:  # CUDA sources: the copies enqueued on a side stream
            event.synchronize()


def start_copy(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], *, copier=None) -> BackgroundCopy:
    """Plan copying every ``src`` into its ``dst`` and return at once: the copy runs in the threads that then call
    :meth:`BackgroundCopy.assist` or :meth:`BackgroundCopy.join`, and no source may change until ``join`` returned.
    CUDA sources are enqueued now on a side stream that first waits for the current one."""
    events = [_copy_on_side_stream(dst, src.detach()) for dst, src in pairs if src.is_cuda]  # enqueued now
    calls = _copies([(dst, src) for dst, src in pairs if not src.is_cuda], copier or copy_bytes)
    return BackgroundCopy(calls, events)


_SIDE_STREAMS: dict[torch.device, Any] = {}


def _copy_on_side_stream(dst: torch.Tensor, src: torch.Tensor) -> Any:
    """Enqueue ``dst.copy_(src)`` on the device's staging stream after the work already queued; its event."""
    stream = _SIDE_STREAMS.get(src.device)
    if stream is None:
        stream = _SIDE_STREAMS[src.device] = torch.cuda.Stream(src.device)
    stream.wait_stream(torch.cuda.current_stream(src.device))
    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=dst.is_pinned())
        src.record_stream(stream)  # the caching allocator keeps its memory until the copy ran
    event = torch.cuda.Event()
    event.record(stream)
    return event


def equal_bytes(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    """Whether every ``(a, b)`` pair holds the same bytes. Plain contiguous CPU tensors of one dtype and shape are
    compared by the C library's ``memcmp`` (GIL released), stopping at the first difference; any other pair (another
    device or layout) with ``torch.equal`` on its bytes.
    """
    compare = libc_function("memcmp", (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t))
    for a, b in pairs:
        a, b = a.detach(), b.detach()
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if compare is not None and _memmove_ok(a, b):
            if a.numel() and compare(a.data_ptr(), b.data_ptr(), a.numel() * a.element_size()):
                return False
        elif not torch.equal(tensor_bytes(a), tensor_bytes(b)):
            return False
    return True
