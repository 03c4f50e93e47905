"""Copy tensors into host staging buffers as fast as this machine's memory allows.

An async save stalls training only for this copy, so it is the one hot loop of the async path. The bytes are
split into 4 MiB pieces (a pure plan, :func:`plan_chunks`) that the calling thread and helper threads (kept
waiting between saves: starting a thread on a loaded machine can take tens of milliseconds) claim one at a time,
and each piece is copied with the GIL released by ``hf_resumable._fastcopy`` (non-temporal stores: a staging
buffer is read back only much later, so caching it is pure cost), or by the C library's ``memmove`` where the
extension was not built. The non-temporal copy streams one region at a time: interleaving several pages per step
was much slower (docs/benchmarks.md). Anything that is not a plain contiguous CPU tensor of the same dtype and
shape goes through ``copy_``; CUDA sources are copied ``non_blocking`` into pinned buffers and synchronized once.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from ..format._bytes import tensor_bytes
from ..format._libc import libc_function
from ._threads import defer_to_running_threads

try:
    from .._fastcopy import copy as _nt_copy
except ImportError:  # built without a C compiler: memmove (GIL released by ctypes) is the fallback
    _nt_copy = None


# The byte copier used for staging, and its name (benchmarks print it).
copy_bytes = _nt_copy or ctypes.memmove
COPY_KIND = "non-temporal" if _nt_copy is not None else "memmove"

# Below this many bytes one thread copies everything (thread start-up would cost more than it saves).
PARALLEL_MIN_BYTES = 8 << 20
# Piece boundaries fall on cache lines.
ALIGN = 64
# The unit of work a copy thread claims (about a millisecond of copying).
CHUNK_BYTES = 4 << 20


def staging_threads() -> int:
    """Threads used for the staging copy: the CPUs this process may run on, at most 8.

    Also under torchrun, where the local ranks stage at the same moment: they copy different amounts (under DDP only
    rank 0 copies anything; FSDP2 shards can be uneven), and oversubscribed threads of a memory-bound copy let the
    scheduler give an idle rank's cores to the ones still copying, where one thread per rank's share would leave
    them idle. The copy is bound by memory bandwidth, which the threads share either way.
    """
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - non-Linux
        cpus = os.cpu_count() or 1
    return max(1, min(8, cpus))


class Piece(NamedTuple):
    """Copy ``length`` bytes at byte ``offset`` of tensor pair ``index`` (a tuple: an async save plans hundreds per
    call, on the training loop's time)."""

    index: int
    offset: int
    length: int


def plan_chunks(sizes: Sequence[int], *, chunk: int = CHUNK_BYTES, align: int = ALIGN) -> list[Piece]:
    """Split tensors of ``sizes`` bytes into pieces of at most ``chunk`` bytes, in order: the units the copy threads
    claim one at a time (so no thread ever waits for a share another thread has not started).

    Every byte is covered exactly once, pieces never cross a tensor, and cuts inside a tensor fall on multiples of
    ``chunk`` (rounded up to ``align``) of that tensor.

    Example:

    ```python
    >>> plan_chunks([100, 0, 28], chunk=64, align=4)
    [Piece(index=0, offset=0, length=64), Piece(index=0, offset=64, length=36), Piece(index=2, offset=0, length=28)]
    ```
    """
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    step = -(-chunk // align) * align
    return [Piece(index, offset, min(step, size - offset))
            for index, size in enumerate(sizes) for offset in range(0, size, step)]


class _Job:
    """One staging copy: its pieces, claimed one at a time by up to ``workers`` threads (the caller among them), and
    ``tasks`` (copies that are not plain bytes, e.g. ``copy_``), each claimed by one thread before any piece."""

    def __init__(self, pieces: list[Piece], addresses: list[tuple[int, int, int]], copier, workers: int,
                 tasks: Sequence[Callable[[], None]] = ()) -> None:
        self._pieces, self._addresses, self._copier = pieces, addresses, copier
        self._tasks = list(tasks)
        self._lock = threading.Lock()
        self._next = 0
        self._active = 0
        self._slots = workers
        self._errors: list[BaseException] = []
        self._done = threading.Event()
        if not pieces and not self._tasks:
            self._done.set()

    @property
    def wants_workers(self) -> bool:
        """Whether a thread calling :meth:`work` now would find a slot and something to claim."""
        with self._lock:
            return bool(self._slots) and not self._errors and (self._next < len(self._pieces) or bool(self._tasks))

    def _claim(self) -> Callable[[], None] | Piece | None:
        with self._lock:
            if self._errors:
                return None
            if self._tasks:
                return self._tasks.pop()
            if self._next >= len(self._pieces):
                return None
            self._next += 1
            return self._pieces[self._next - 1]

    def work(self) -> None:
        """Copy pieces until none is left (a no-op once every slot is taken or the job is over)."""
        with self._lock:
            if not self._slots or self._done.is_set():
                return
            self._slots -= 1
            self._active += 1
        try:
            while (claimed := self._claim()) is not None:
                try:  # both copiers (and torch's copy_) release the GIL for the call: pieces copy in parallel
                    if isinstance(claimed, Piece):
                        dst, src, _ = self._addresses[claimed.index]
                        self._copier(dst + claimed.offset, src + claimed.offset, claimed.length)
                    else:
                        claimed()
                except BaseException as err:  # noqa: BLE001 - raised by wait() on the caller's thread
                    with self._lock:
                        self._errors.append(err)
        finally:
            with self._lock:
                self._active -= 1
                if not self._active:
                    self._done.set()

    def wait(self) -> None:
        """Return once every claimed piece is copied (the caller's own :meth:`work` has claimed the rest)."""
        self._done.wait()
        if self._errors:
            raise self._errors[0]


class _Crew:
    """The staging copy's helper threads: started once per process and kept waiting for the next copy.

    Starting a thread blocks the starter until the new thread runs, which on a loaded machine takes tens of
    milliseconds, all of it on the training loop's time; a waiting helper is woken instead, and the caller copies
    meanwhile (a helper that is slow to wake finds nothing left to claim). Several jobs may be open at once (a
    background copy and a comparison); each helper takes the oldest that wants a thread.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._jobs: list[_Job] = []
        self._threads: list[threading.Thread] = []
        self._pid = os.getpid()

    def post(self, job: _Job, helpers: int) -> None:
        """Hand ``job`` to ``helpers`` helper threads (started on first use, by the calling thread: they inherit its
        CPU priority) and return at once."""
        with self._cond:
            if self._pid != os.getpid():  # a forked child: the helpers stayed in the parent
                self._threads, self._jobs, self._pid = [], [], os.getpid()
            while len(self._threads) < helpers:
                thread = threading.Thread(target=self._serve, name="hf_resumable-stage", daemon=True)
                thread.start()
                self._threads.append(thread)
            self._jobs.append(job)
            self._cond.notify_all()

    def run(self, job: _Job, helpers: int) -> None:
        """Copy ``job`` on the calling thread and up to ``helpers`` helper threads; return when it is done."""
        self.post(job, helpers)
        try:
            job.work()
            job.wait()
        finally:
            self.retire(job)

    def retire(self, job: _Job) -> None:
        with self._cond:
            if job in self._jobs:
                self._jobs.remove(job)

    def _next_job(self) -> _Job | None:
        return next((job for job in self._jobs if job.wants_workers), None)

    def _serve(self) -> None:
        defer_to_running_threads()  # woken as an async save's call returns: never preempt the training thread then
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._next_job() is not None)
                job = self._next_job()
            if job is not None:
                job.work()
                if not job.wants_workers:
                    self.retire(job)


_CREW = _Crew()


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


def _raw_copies(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
                other: Callable[[torch.Tensor, torch.Tensor], None]) -> list[tuple[int, int, int]]:
    """``(dst address, src address, bytes)`` of every pair a raw byte copy may serve; ``other(dst, src)`` is called
    for the rest (CUDA sources, other dtypes or layouts), with ``src`` detached (no autograd record of the copy)."""
    fast: list[tuple[int, int, int]] = []
    for dst, src in pairs:
        if _memmove_ok(dst, src):
            nbytes = src.nbytes
            if nbytes:
                fast.append((dst.data_ptr(), src.data_ptr(), nbytes))
        else:
            other(dst, src.detach())
    return fast


def _workers(workers: int | None) -> int:
    workers = staging_threads() if workers is None else workers
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    return workers


def copy_into(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], *, workers: int | None = None,
              copier=None) -> None:
    """Copy every ``src`` into its ``dst`` (``(dst, src)`` pairs), bit for bit, and return when all bytes landed.

    ``copier(dst_address, src_address, nbytes)`` copies raw bytes (default :data:`copy_bytes`).
    """
    copier = copier or copy_bytes
    cuda_devices: set[torch.device] = set()

    def copy_now(dst: torch.Tensor, src: torch.Tensor) -> None:
        if src.is_cuda:
            dst.copy_(src, non_blocking=dst.is_pinned())
            cuda_devices.add(src.device)
        else:
            dst.copy_(src)

    fast = _raw_copies(pairs, copy_now)
    total = sum(n for _, _, n in fast)
    workers = _workers(workers)
    job = _Job(plan_chunks([n for _, _, n in fast]), fast, copier, workers)
    if total < PARALLEL_MIN_BYTES or workers == 1:
        job.work()  # one thread: waking helpers would cost more than it saves
        job.wait()
    else:
        _CREW.run(job, workers - 1)
    for device in cuda_devices:
        torch.cuda.synchronize(device)


class BackgroundCopy:
    """A staging copy running on the helper threads (:func:`start_copy`): :meth:`join` takes part and returns once
    every byte landed (raising the copy's error); :meth:`assist` takes part without waiting (a no-op once every piece
    is claimed). Both may be called from any thread, any number of times."""

    def __init__(self, job: _Job, events: list[Any]) -> None:
        self._job, self._events = job, events

    def assist(self) -> None:
        self._job.work()

    def join(self) -> None:
        try:
            self._job.work()
            self._job.wait()
        finally:
            _CREW.retire(self._job)
        for event in self._events:  # CUDA sources: the copies enqueued on a side stream
            event.synchronize()


def start_copy(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], *, workers: int | None = None,
               copier=None) -> BackgroundCopy:
    """Start copying every ``src`` into its ``dst`` on the helper threads and return at once (the helpers are
    woken, never started here after the first use). The caller must not change a source until
    :meth:`BackgroundCopy.join` returned (an async save holds the optimizer's next step, see :mod:`._step_gate`).

    CUDA sources are copied on a side stream that first waits for the current one (enqueued here, which does not
    wait for the device), into pinned buffers; ``join`` waits for them.
    """
    copier = copier or copy_bytes
    tasks: list[Callable[[], None]] = []
    events: list[Any] = []

    def copy_later(dst: torch.Tensor, src: torch.Tensor) -> None:
        if src.is_cuda:
            events.append(_copy_on_side_stream(dst, src))
        else:
            tasks.append(lambda: dst.copy_(src))

    fast = _raw_copies(pairs, copy_later)
    workers = _workers(workers)
    job = _Job(plan_chunks([n for _, _, n in fast]), fast, copier, workers, tasks)
    _CREW.post(job, workers)
    return BackgroundCopy(job, events)


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


class _Differs(Exception):
    """Raised by the comparing "copier" of :func:`equal_bytes` at the first difference: it ends the job."""


def equal_bytes(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], *, workers: int | None = None) -> bool:
    """Whether every ``(a, b)`` pair holds the same bytes. Plain contiguous CPU tensors of one dtype and shape are
    compared at memory speed by the staging copy's threads (the C library's ``memcmp``, GIL released), stopping at
    the first difference; any other pair (another device or layout) with ``torch.equal`` on its bytes.
    """
    fast: list[tuple[int, int, int]] = []
    for a, b in pairs:
        a, b = a.detach(), b.detach()
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if _memmove_ok(a, b):
            if a.numel():
                fast.append((a.data_ptr(), b.data_ptr(), a.numel() * a.element_size()))
        elif not torch.equal(tensor_bytes(a), tensor_bytes(b)):
            return False
    compare = libc_function("memcmp", (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t))
    if compare is None:  # no C library here: compare the rest with torch too
        return all(torch.equal(tensor_bytes(a.detach()), tensor_bytes(b.detach())) for a, b in pairs)

    def differ(first: int, second: int, nbytes: int) -> None:
        if compare(first, second, nbytes):
            raise _Differs

    workers = staging_threads() if workers is None else workers
    job = _Job(plan_chunks([n for _, _, n in fast]), fast, differ, workers)
    try:
        if sum(n for _, _, n in fast) < PARALLEL_MIN_BYTES or workers == 1:
            job.work()
            job.wait()
        else:
            _CREW.run(job, workers - 1)
    except _Differs:
        return False
    return True

