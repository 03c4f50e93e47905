"""Background saves: stage the tensors into reusable host buffers, write and commit on a thread, return a future.

:meth:`AsyncSaver.submit` returns a :class:`concurrent.futures.Future` of the committed manifest, to which the
integrations attach what follows a commit (``integrations._core.AfterCommit``). At most one save is in flight: the
next save, any load and interpreter exit wait for it (:meth:`AsyncSaver.wait` raises ``AsyncSaveError`` for a failed
one). The commit protocol itself is :mod:`._writer`'s.

The write runs at a lower CPU priority than the training loop (:data:`WRITER_NICE_INCREMENT`, Linux): its hashing
and page-cache copies take the cores the training threads leave idle instead of slowing every step, and get the
normal priority back as soon as the training loop waits for them, or when the caller says the write is late
(:meth:`AsyncSaver.expedite`: the next save is due).
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from ..distributed import checkpoint_group, rank_and_world_size
from ..errors import AsyncSaveError
from ._payload import Payload, TensorFile
from ._replicas import part_of_rank, replica_signature
from ._staging import copy_into
from ._threads import lower_thread_priority, restore_thread_priorities
from ._writer import SaveStart, begin_save, finish_save
from .manifest import Manifest

__all__ = ["AsyncSaver", "BACKGROUND_SAVER", "WRITER_NICE_INCREMENT"]

# Nice steps by which a background write runs below the training thread (Linux, per thread; 0 turns it off). At
# +10 the CPU scheduler gives the training thread about 7-9x the writer's share of a core they both want, so a step
# is barely slower while a save is written, and the writer still gets every idle core.
WRITER_NICE_INCREMENT = 10


class _SaveJob:
    """One async save on the saver's thread: step 1, then (once the training thread has staged) steps 2-5."""

    def __init__(self, target: Path, payload: Payload, *, overwrite: bool, group: Any, step, metrics, on_commit,
                 prepare, finalize, signature: str | None = None) -> None:
        self.target, self._payload, self._overwrite, self._group = target, payload, overwrite, group
        self._signature = signature
        self._step, self._metrics, self._on_commit = step, metrics, on_commit
        self._prepare, self._finalize = prepare, finalize
        self.pid = os.getpid()  # a forked child does not own its parent's save (nor the thread writing it)
        self._started = threading.Event()  # step 1 is over (start_error says how)
        self._staged = threading.Event()  # the training thread's copy is over (staging_error says how)
        self.future: Future[Manifest] = Future()
        self.start: SaveStart | None = None
        self.start_error: BaseException | None = None
        self.staging_error: BaseException | None = None
        self.error: BaseException | None = None  # raised at the next wait
        self.priority: tuple[int, int] | None = None  # the writer's lowered nice value (lower_thread_priority)
        self.expedited = False  # AsyncSaver.expedite: the write runs at the training loop's priority

    def run(self) -> None:
        manifest = None
        self.priority = lower_thread_priority(WRITER_NICE_INCREMENT)
        if self.expedited:  # expedited before it started: set after the priority, so that either order restores
            restore_thread_priorities(self.priority)
        try:
            manifest = self._run()
        finally:
            restore_thread_priorities(self.priority)
            failure = self.start_error or self.staging_error or self.error
            if failure is not None:
                self.future.set_exception(failure)
            else:
                self.future.set_result(manifest)

    def _run(self) -> Manifest | None:
        try:
            start = self.start = begin_save(self.target, overwrite=self._overwrite, group=self._group,
                                            signature=self._signature)
        except BaseException as err:  # noqa: BLE001 - raised on the training thread by started()
            self.start_error = err
            return None
        finally:
            self._started.set()
        self._staged.wait()
        prepare, finalize, keep = self._prepare, self._finalize, True
        if self.staging_error is not None:  # raised on the training thread; every rank must learn it in step 3
            cause, finalize, keep = self.staging_error, None, False

            def prepare() -> None:
                raise RuntimeError(f"staging the tensors failed: {type(cause).__name__}: {cause}") from cause
        try:
            manifest = finish_save(start, self._payload, step=self._step, metrics=self._metrics, prepare=prepare,
                                   finalize=finalize)
            if self._on_commit is not None:
                self._on_commit()
            return manifest
        except BaseException as err:  # noqa: BLE001 - kept and raised at the next call
            if keep:
                self.error = err
            return None

    def staged(self, error: BaseException | None = None) -> None:
        """The training thread's copy is over (``error``: it failed)."""
        self.staging_error = error
        self._staged.set()

    def started(self) -> SaveStart:
        """Wait for step 1; raise its error (on every rank: rank 0 told them) if it failed."""
        self._started.wait()
        if self.start_error is not None:
            raise self.start_error
        return self.start


class _Worker:
    """One daemon thread, started on first use, that runs submitted jobs in order.

    A thread started per save would block the starter until it runs, tens of milliseconds on a loaded machine, on
    the training loop's time. Daemon: interpreter exit waits for the in-flight save through ``atexit`` (see
    :mod:`.api`), not for an idle thread; a forked child starts its own.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._jobs: queue.SimpleQueue | None = None
        self._thread: threading.Thread | None = None
        self._pid: int | None = None

    def submit(self, job: Callable[[], None]) -> None:
        if self._thread is None or self._pid != os.getpid() or not self._thread.is_alive():
            self._jobs, self._pid = queue.SimpleQueue(), os.getpid()
            self._thread = threading.Thread(target=self._serve, args=(self._jobs,), name=self._name, daemon=True)
            self._thread.start()
        self._jobs.put(job)

    @staticmethod
    def _serve(jobs: queue.SimpleQueue) -> None:
        while True:
            jobs.get()()  # a job keeps its own errors


class AsyncSaver:
    """Stage tensors into reusable host buffers, then write them on a background thread.

    Buffers are keyed by (file, tensor name) and reused while shape and dtype match, so the first
    touch of fresh memory is paid once, not at every save. At most one save is in flight: the next
    save, any load and interpreter exit wait for it, and its exception is raised there.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, str], torch.Tensor] = {}
        self._job: _SaveJob | None = None
        self._last: Future[Manifest] | None = None
        self._worker = _Worker("hf_resumable-save")

    def stage(self, payload: Payload, also: Sequence[TensorFile] = ()) -> Payload:
        """Copy every tensor of ``payload`` (and of the files ``also``) into staging buffers, in one parallel copy;
        the files then hold the buffers (returns ``payload``)."""
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        for tensor_file in [*payload.tensor_files, *also]:
            staged = []
            for name, tensor in tensor_file.tensors:
                key = (tensor_file.relpath, name)
                buffer = self._buffers.get(key)
                if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
                    buffer = torch.empty(tensor.shape, dtype=tensor.dtype,
                                         pin_memory=torch.cuda.is_available() and tensor.is_cuda)
                    self._buffers[key] = buffer
                pairs.append((buffer, tensor))
                staged.append((name, buffer))
            tensor_file.tensors = staged
        copy_into(pairs)
        return payload

    def submit(self, target: Path, payload: Payload, *, step, metrics, overwrite, on_commit=None,
               also_stage: Sequence[TensorFile] = (), prepare=None, finalize=None) -> Future[Manifest]:
        """Wait for the previous save, stage ``payload`` (and ``also_stage``) and start writing it in the background.

        Under torch.distributed every rank calls it. Step 1 (rank 0 checks the target and creates the temp dir) runs
        on the saver's thread while this one copies the tensors, and is over when this returns, so a refused target
        raises now on every rank; steps 2-5 (``prepare`` and ``finalize`` too, see
        :func:`~hf_resumable.checkpoint._writer.finish_save`) follow on that thread, then ``on_commit``. Its
        collectives use the save's own gloo group (``distributed.checkpoint_group``), never the training loop's.
        If the copy fails on this rank after step 1, the background part still runs, so that every rank learns of
        the failure and nothing is committed; the error is raised here.

        Returns:
            `concurrent.futures.Future`: done once the save has committed (its result is the manifest) or failed.
        """
        self.wait()
        group = checkpoint_group()  # created on first use: a collective of the training thread
        signature = replica_signature(payload)
        job = _SaveJob(target, payload, overwrite=overwrite, group=group, step=step, metrics=metrics,
                       on_commit=on_commit, prepare=prepare, finalize=finalize, signature=signature)
        self._job, self._last = job, job.future
        self._worker.submit(job.run)
        rank, world_size = rank_and_world_size()
        try:
            # Only the files this rank writes: its share of the replicated ones as planned, while step 1 settles
            # whether the ranks split them (they do unless their payloads differ); then whatever that adds.
            staged = self._stage_part(part_of_rank(payload, rank, world_size, split=signature is not None), also_stage)
            start = job.started()  # a refused target raises here (the job is over: it waits for no staging)
            self._stage_part(part_of_rank(payload, rank, world_size, split=start.split), (), skip=staged)
        except BaseException as err:
            job.staged(err)
            raise
        job.staged()
        return job.future

    def _stage_part(self, part: Payload, also: Sequence[TensorFile], *, skip: set[str] = frozenset()) -> set[str]:
        """:meth:`stage` the files of ``part`` not in ``skip``; the relpaths of ``part``'s files."""
        self.stage(Payload(tensor_files=[f for f in part.tensor_files if f.relpath not in skip]), also)
        return {f.relpath for f in part.tensor_files}

    @property
    def future(self) -> Future[Manifest] | None:
        """The future of the last save submitted (done or not; ``None`` before the first)."""
        return self._last

    @property
    def in_flight(self) -> bool:
        job = self._job
        return job is not None and job.pid == os.getpid() and not job.future.done()

    def expedite(self) -> bool:
        """Give the in-flight write the training loop's CPU priority back, without waiting for it: a caller whose
        next save is due while this one is still being written (under CPU contention the lowered writer can take
        many steps to commit, and until it has, a preemption loses everything since the previous checkpoint).

        Raising a priority again needs ``CAP_SYS_NICE`` or an ``RLIMIT_NICE`` that allows it; without either, the
        write keeps its lower priority (see :func:`._threads.restore_thread_priorities`).

        Returns:
            `bool`: whether a write of this process was in flight (and so was given its priority back).
        """
        job = self._job
        if job is None or job.pid != os.getpid() or job.future.done():
            return False
        job.expedited = True
        restore_thread_priorities(job.priority)
        return True

    def wait(self) -> None:
        """Block until the in-flight save (if any) is committed; raise its error if it failed.

        Raises:
            AsyncSaveError: the save failed (nothing was committed; the previous checkpoint is untouched).
        """
        job, self._job = self._job, None
        if job is None or job.pid != os.getpid():  # nothing in flight, or the parent's save (this is a forked child)
            return
        if not job.future.done():  # the training loop waits for the write now: it runs at the normal priority again
            restore_thread_priorities(job.priority)
        error = job.future.exception()  # waits
        if error is not None and error is job.error:
            raise AsyncSaveError(
                f"The background save of {job.target} failed ({type(error).__name__}: {error}); nothing was "
                "committed there and the previous checkpoint is untouched (still the newest). Fix the cause (e.g. "
                "free disk space) and save again, or resume from the previous checkpoint.") from error


# The process's one background saver (``api.background_saver``); loads below ``api`` (the shared reads, whose
# collectives use the save's group) wait for it too.
BACKGROUND_SAVER = AsyncSaver()
