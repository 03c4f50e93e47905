"""Background saves: stage the tensors into reusable host buffers, write and commit on a thread, return a future.

At most one save is in flight: the next save, any load and interpreter exit wait for it and raise its error. What
the call copies, what the held optimizer step waits for, and the thread's lowered CPU priority:
docs/architecture.md, "Async saves", and docs/performance.md.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from ..._tuning import (
    WRITER_NICE_INCREMENT,
    Lowering,
    defer_to_running_threads,
    lower_thread_priority,
    restore_thread_priorities,
    tuning_options,
)
from ...distributed import checkpoint_group, is_distributed, rank_and_world_size
from ...errors import AsyncSaveError
from .._types import Payload, TensorFile
from ..commit._durability import make_durable
from ..commit._replicas import part_of_rank, replica_signature
from ..commit._threads import SerialThread
from ..commit._writer import begin_save, finish_save
from ..commit.manifest import Manifest
from ._staging import BackgroundCopy, copy_into, start_copy
from ._step_gate import gated_optimizer, split_by_storage, step_gate, step_storages

__all__ = ["AsyncSaver", "BACKGROUND_SAVER"]


class _Staging:
    """One save's staging copy after its call returned: ``background``, what the held optimizer step writes (the
    saver's thread copies it first, the training thread helps at the held step), and ``rest``, the replicated files
    rank 0 writes should step 1 find the ranks' replicas differ. ``release`` opens the optimizer's step."""

    def __init__(self, background: BackgroundCopy | None = None,
                 rest: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
                 release: Callable[[], None] | None = None, failed: BaseException | None = None) -> None:
        self.background, self.rest, self.release, self.failed = background, list(rest), release, failed

    def copy_background(self) -> None:
        """Copy ``background`` now (before the saver's thread lowers its priority: the held step waits for it);
        an error is kept for :meth:`finish`."""
        background, self.background = self.background, None
        if background is None or self.failed is not None:
            return
        try:
            background.join()
        except BaseException as err:  # noqa: BLE001 - fails the save on every rank (step 3)
            self.failed = err

    def finish(self, *, split: bool | None) -> BaseException | None:
        """Complete the copy (``split``: step 1's answer; ``None``: step 1 failed) and open the held step whatever
        happens; return the copy's error."""
        try:
            if self.failed is not None:
                return self.failed
            if self.background is not None:
                self.background.join()
            if split is False and self.rest:
                copy_into(self.rest)
        except BaseException as err:  # noqa: BLE001 - fails the save on every rank (step 3)
            return err
        finally:
            if self.release is not None:
                self.release()
        return None


@contextlib.contextmanager
def _at_writer_priority(job: "_SaveJob | _SyncJob") -> Iterator[None]:
    """Run a job of the saver's thread at :data:`WRITER_NICE_INCREMENT` below the training loop, unless it was
    expedited (:meth:`AsyncSaver.expedite`); the thread's priority is restored afterwards."""
    job.priority = lower_thread_priority(WRITER_NICE_INCREMENT)
    if job.expedited:  # expedited before it started: set after the priority, so that either order restores
        restore_thread_priorities(job.priority)
    try:
        yield
    finally:
        restore_thread_priorities(job.priority)


class _SaveJob:
    """One async save on the saver's thread: step 1 while the tensors are copied, then steps 2-5."""

    def __init__(self, target: Path, payload: Payload, *, overwrite: bool, group: Any, step, metrics, on_commit,
                 prepare, finalize, signature: str | None = None) -> None:
        self.target, self._payload, self._overwrite, self._group = target, payload, overwrite, group
        self._signature = signature
        self._step, self._metrics, self._on_commit = step, metrics, on_commit
        self._prepare, self._finalize = prepare, finalize
        self.pid = os.getpid()  # a forked child does not own its parent's save (nor the thread writing it)
        self.staging = _Staging()
        self.future: Future[Manifest] = Future()
        self.error: BaseException | None = None  # raised at the next wait
        self.raised: BaseException | None = None  # already raised by the call (a failed copy): not raised again
        self.priority: Lowering | None = None  # the writer's lowered priority (lower_thread_priority)
        self.expedited = False  # AsyncSaver.expedite: the write runs at the training loop's priority

    def failure(self, error: BaseException) -> AsyncSaveError:
        return AsyncSaveError(
            f"The background save of {self.target} failed ({type(error).__name__}: {error}); nothing was "
            f"committed there and the previous checkpoint is untouched (still the newest). {_fix(error)}")

    def run(self) -> None:
        manifest = None
        try:
            self.staging.copy_background()
            with _at_writer_priority(self):
                manifest = self._run()
        finally:
            if self.error is not None:
                self.future.set_exception(self.error)
            else:
                self.future.set_result(manifest)

    def _run(self) -> Manifest | None:
        try:
            start = begin_save(self.target, overwrite=self._overwrite, group=self._group, signature=self._signature)
        except BaseException as err:  # noqa: BLE001 - raised at the next wait (on every rank: rank 0 told them)
            self.error = err
            self.staging.finish(split=None)
            return None
        prepare, finalize = self._prepare, self._finalize
        cause = self.staging.finish(split=start.split)
        if cause is not None:  # every rank must learn it in step 3: nothing is committed

            def prepare() -> None:
                raise RuntimeError(f"staging the tensors failed: {type(cause).__name__}: {cause}") from cause

            finalize = None
        try:
            manifest = finish_save(start, self._payload, step=self._step, metrics=self._metrics, prepare=prepare,
                                   finalize=finalize)
            if self._on_commit is not None:
                self._on_commit()
            return manifest
        except BaseException as err:  # noqa: BLE001 - kept and raised at the next call
            self.error = cause or err
            return None


class _SyncJob:
    """The fsyncs of a blocking save with deferred durability, on the saver's thread after its commit
    (:func:`._durability.make_durable`; ``on_durable`` follows, e.g. retention)."""

    def __init__(self, target: Path, written: list[str], *, group: Any,
                 on_durable: Callable[[], None] | None) -> None:
        self.target, self._written, self._group, self._on_durable = target, written, group, on_durable
        self.pid = os.getpid()
        self.future: Future[Manifest] = Future()
        self.raised: BaseException | None = None
        self.priority: Lowering | None = None
        self.expedited = False

    def run(self) -> None:
        try:
            with _at_writer_priority(self):
                make_durable(self.target, self._written, group=self._group)
                if self._on_durable is not None:
                    self._on_durable()
        except BaseException as err:  # noqa: BLE001 - raised at the next wait
            self.future.set_exception(err)
        else:
            self.future.set_result(None)

    def failure(self, error: BaseException) -> AsyncSaveError:
        return AsyncSaveError(
            f"{self.target} was committed, but making its files durable failed ({type(error).__name__}: {error}). It "
            "is not counted as durable: retention keeps the checkpoint before it, and after a machine crash a reader "
            f"verifies every byte of it. {_fix(error)}")


def _fix(error: BaseException) -> str:
    """What to do about a background job's ``error``: storage's (an ``OSError``), or, in a distributed job, most often
    a peer that died or lost its connection."""
    if isinstance(error, OSError):
        return "Fix the cause (the disk, free space, permissions) and save again."
    if is_distributed():
        return ("If another rank died or lost its connection (a collective's error names the peer), restart the job: "
                "it resumes from the newest valid checkpoint. Otherwise fix the cause and save again.")
    return "Fix the cause and save again, or resume from the previous checkpoint."


class AsyncSaver:
    """Stage tensors into reusable host buffers, then write them on a background thread. Buffers are keyed by (file,
    tensor name) and reused while shape and dtype match, so fresh memory is touched once, not at every save."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, str], torch.Tensor] = {}
        self._job: _SaveJob | _SyncJob | None = None
        self._last: Future[Manifest] | None = None
        # One thread for every save (one started per save would block the training loop until it runs). Before it
        # waits, it defers to running threads (woken as the save's call returns, it must not preempt the training
        # thread), and again before a job (HF_RESUMABLE_WRITER_PRIORITY may have changed meanwhile).
        self._worker = SerialThread("hf_resumable-save", on_wake=defer_to_running_threads)

    def _buffer_pairs(self, files: Sequence[TensorFile]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(buffer, tensor)`` of every tensor of ``files``, whose tensors become the buffers (not copied yet)."""
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        for tensor_file in files:
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
        return pairs

    def submit(self, target: Path, payload: Payload, *, step, metrics, overwrite, on_commit=None,
               also_stage: Sequence[TensorFile] = (), prepare=None, finalize=None, optimizer: Any = None
               ) -> Future[Manifest]:
        """Wait for the previous save, stage ``payload`` (and ``also_stage``) and start writing it in the background.

        Collective under torch.distributed. It returns once it has copied what ``optimizer``'s next step does not
        write; the saver's thread copies the rest while that step waits, then commits (``prepare`` and ``finalize``:
        :func:`~hf_resumable.checkpoint.commit._writer.finish_save`) and runs ``on_commit`` (docs/architecture.md,
        "Async saves"). A failure anywhere commits nothing and is raised at the next wait on every rank.

        Returns:
            `concurrent.futures.Future`: done once the save has committed (its result is the manifest) or failed.

        Raises:
            ValueError: a switch of docs/performance.md holds a value it does not take (nothing was started).
        """
        tuning_options()  # a switch with a value it does not take is refused here, before anything starts
        self.wait()
        group = checkpoint_group()  # created on first use: a collective of the training thread
        signature = replica_signature(payload)
        job = _SaveJob(target, payload, overwrite=overwrite, group=group, step=step, metrics=metrics,
                       on_commit=on_commit, prepare=prepare, finalize=finalize, signature=signature)
        # 1. The files this rank writes: its share of the replicated ones as planned, while step 1 settles whether
        #    the ranks split them (they do unless their payloads differ); unsplit, rank 0 writes the rest too.
        rank, world_size = rank_and_world_size()
        planned = part_of_rank(payload, rank, world_size, split=signature is not None).tensor_files
        names = {f.relpath for f in planned}
        rest = [f for f in part_of_rank(payload, rank, world_size, split=False).tensor_files
                if f.relpath not in names]
        pairs, rest_pairs = self._buffer_pairs([*planned, *also_stage]), self._buffer_pairs(rest)
        # 2. Copy now what the next forward may change (buffers) or the optimizer's step does not hold; start the
        #    copy of what only that step writes (the saver's thread runs it), and hold the step until it is done.
        held = gated_optimizer(optimizer)
        storages = step_storages(optimizer) if held is not None else set()
        now, later = split_by_storage(pairs, storages)
        rest_now, rest_later = split_by_storage(rest_pairs, storages)
        try:
            copy_into([*now, *rest_now])
            if later or rest_later:
                background = start_copy(later) if later else None
                release = step_gate(held).hold(assist=None if background is None else background.assist)
                job.staging = _Staging(background, rest_later, release)
        except BaseException as err:
            # raised here; the background part still runs, so that every rank learns of it and nothing commits
            job.staging, job.raised = _Staging(failed=err), err
            raise
        finally:
            self._job, self._last = job, job.future
            self._worker.submit(job.run)
        return job.future

    @property
    def future(self) -> Future[Manifest] | None:
        """The future of the last save submitted (done or not; ``None`` before the first)."""
        return self._last

    @property
    def in_flight(self) -> bool:
        """Whether a job of this process is not done yet: a background save, or a blocking save's deferred fsyncs."""
        job = self._job
        return job is not None and job.pid == os.getpid() and not job.future.done()

    @property
    def writing(self) -> bool:
        """Whether a background save of this process has not committed yet (a deferred save's fsyncs do not count:
        its checkpoint is committed)."""
        return isinstance(self._job, _SaveJob) and self.in_flight

    def expedite(self) -> bool:
        """Give the in-flight write the training loop's CPU priority back, without waiting for it: a caller whose next
        save is due while this one is still being written. Raising a priority again needs ``CAP_SYS_NICE`` or an
        ``RLIMIT_NICE`` that allows it; without either, the write keeps its lower priority.

        Returns:
            `bool`: whether a write of this process was in flight (and so was given its priority back).
        """
        job = self._job
        if job is None or job.pid != os.getpid() or job.future.done():
            return False
        job.expedited = True
        restore_thread_priorities(job.priority)
        return True

    def sync_later(self, target: Path, written: list[str], *, on_durable: Callable[[], None] | None = None
                   ) -> Future[None]:
        """Fsync the files ``written`` (relative to the committed ``target``) of a deferred blocking save on the
        saver's thread, then ``on_durable``; collective. The next save, any load, :meth:`wait` and interpreter exit
        wait for it.

        Returns:
            `concurrent.futures.Future`: done once every rank's files are durable (or failed).
        """
        tuning_options()  # refused here, not on the saver's thread
        self.wait()
        job = _SyncJob(target, written, group=checkpoint_group(), on_durable=on_durable)
        self._job, self._last = job, job.future
        self._worker.submit(job.run)
        return job.future

    def wait_until_durable(self) -> None:
        """Wait for the fsyncs of a blocking save with deferred durability still running (not for a background save
        in flight), unless called from the saver's own thread (retention after a commit or after the fsyncs)."""
        job = self._job
        if isinstance(job, _SyncJob) and job.pid == os.getpid() and not self._worker.is_current():
            self.wait()

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
        if error is not None and error is not job.raised:
            raise job.failure(error) from error


# The process's one background saver (``api.background_saver``); retention (``discovery``, below ``api``) waits for it.
BACKGROUND_SAVER = AsyncSaver()
