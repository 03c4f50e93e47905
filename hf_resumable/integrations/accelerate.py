"""``ResumableAccelerator``: accelerate's ``Accelerator`` with crash-safe checkpoints and bit-exact resume.

What it changes compared to ``accelerate.Accelerator`` (whose ``save_state`` pickles optimizer and scheduler,
deletes old checkpoints before writing the new one, swallows RNG load failures and leaves mid-epoch
resume to the user):

* ``save_state()`` writes the hf_resumable format (sharded safetensors, no pickle, manifest last, atomic
  commit) into ``checkpoint-<global_step>`` directories, and applies retention only *after* the commit.
  ``load_state()`` with no argument resumes from the newest checkpoint that *verifies*, and restores the
  step counter, so the next save does not collide.
* Training loaders built with :func:`hf_resumable.data.build_map_dataloader` (or
  :meth:`ResumableAccelerator.prepare_resumable_dataloader`) are prepared without accelerate's
  re-sharding; their epoch and position are saved per rank and restored without fetching, collating or
  moving a single skipped batch.
* RNG of every rank is saved and restored after everything else; a missing or mismatched piece raises
  :class:`~hf_resumable.errors.InexactResumeError` (never a log line at INFO).
* Resuming with another world size, accumulation setting or data layout raises
  :class:`~hf_resumable.errors.ConfigDriftError` unless ``allow_inexact_resume=True``.
* SIGTERM only sets a flag; :meth:`ResumableAccelerator.checkpoint_if_preempted` (called once per
  optimizer step) saves and exits with :data:`~hf_resumable.preemption.PREEMPTION_EXIT_CODE`.
* Token-exact gradient accumulation: :meth:`ResumableAccelerator.accumulation_windows` prefetches each
  window and counts its items across micro-batches *and* ranks; ``backward(loss_sum,
  num_items_in_batch=window.num_items)`` then makes the accumulated gradient the full-batch token mean,
  short last window of an epoch included (accelerate divides every micro-batch by the configured number
  of steps: a mean of means, and wrong for a short window).

Checkpoints land only on optimizer-step boundaries: ``save_state()`` inside an accumulation window raises.

Example:

```python
>>> from hf_resumable.integrations.accelerate import ResumableAccelerator
>>> accelerator = ResumableAccelerator(gradient_accumulation_steps=4, checkpoint_dir="out")  # doctest: +SKIP
>>> loader = accelerator.prepare_resumable_dataloader(data, collate_fn=collate, batch_size=8, seed=0)  # doctest: +SKIP
>>> model, optimizer = accelerator.prepare(model, optimizer)  # doctest: +SKIP
>>> accelerator.load_state()  # latest valid checkpoint, or None on a fresh start  # doctest: +SKIP
>>> for epoch in range(loader.epoch, num_epochs):  # doctest: +SKIP
...     for window in accelerator.accumulation_windows(loader, count_items=count_tokens):
...         for batch in window:
...             with accelerator.accumulate(model):
...                 accelerator.backward(loss_sum(model, batch), num_items_in_batch=window.num_items)
...                 optimizer.step()
...                 optimizer.zero_grad()
...         if accelerator.global_step % 100 == 0:
...             accelerator.save_state()
...         accelerator.checkpoint_if_preempted()
```
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from itertools import islice
from pathlib import Path
from typing import Any

import accelerate
import torch
from accelerate import Accelerator
from accelerate.data_loader import DataLoaderStateMixin
from accelerate.state import GradientState
from accelerate.utils import DistributedType
from packaging import version

from ..checkpoint import (
    LoadedCheckpoint,
    apply_retention,
    find_latest_checkpoint,
    load_checkpoint,
    read_manifest,
    save_checkpoint,
    verify_checkpoint,
    wait_for_pending_saves,
)
from ..constants import CHECKPOINT_PREFIX
from ..data import ResumableDataLoader, build_map_dataloader
from ..distributed import broadcast_json
from ..errors import ConfigDriftError, HfResumableError, InexactResumeError, UnsupportedStateError
from ..preemption import PREEMPTION_EXIT_CODE, PreemptionHandler
from ..remote import is_remote, open_uploader, resolve_resume_path
from ..rng import restore_rng_state
from ._accelerate_loop import AccumulationWindow, ResumablePreparedLoader
from ._accelerate_state import StepCounts, StepHook, state_fingerprint

logger = logging.getLogger(__name__)

__all__ = [
    "AccumulationWindow",
    "ResumableAccelerator",
    "ResumablePreparedLoader",
    "check_accelerate_internals",
]

# Versions whose internals this module was written against (checked at import time).
SUPPORTED_ACCELERATE = (version.parse("1.10"), version.parse("2.0"))
# Private accelerate names this module relies on; a test fails loudly when one disappears.
_INTERNALS: dict[Any, tuple[str, ...]] = {
    Accelerator: ("_do_sync", "unwrap_model", "reduce", "accumulate", "backward", "prepare_data_loader"),
    DataLoaderStateMixin: ("begin", "end", "reset"),
    GradientState: ("_add_dataloader", "_remove_dataloader", "_set_sync_gradients", "end_of_dataloader"),
}
# Attributes set in Accelerator.__init__ (checked on the instance).
_INSTANCE_INTERNALS = ("_models", "_optimizers", "_schedulers", "_custom_objects", "gradient_state", "scaler", "step")

# training_state keys (the progress cursor).
PROGRESS_GLOBAL_STEP = "global_step"  # completed optimizer steps (accumulation windows)
PROGRESS_MICRO_STEP = "accelerate_micro_step"  # Accelerator.step, accelerate's own micro-step counter
PROGRESS_OPTIMIZER_STEPS = "optimizer_steps"  # real steps of each prepared optimizer, in preparation order
# extra keys.
EXTRA_RUN = "accelerate_run"  # the settings a bit-exact resume depends on (see _run_settings)
EXTRA_CUSTOM_OBJECTS = "custom_objects"  # state_dict() of objects passed to register_for_checkpointing
# data_state key: the positions of the prepared resumable loaders, in preparation order.
DATA_LOADERS = "loaders"


def check_accelerate_internals(accelerator: Accelerator | None = None) -> list[str]:
    """Names of accelerate internals this module needs that the installed accelerate lacks (empty = fine).

    Args:
        accelerator (`Accelerator`, *optional*): also check the attributes ``Accelerator.__init__`` sets.

    Example:

    ```python
    >>> check_accelerate_internals()
    []
    ```
    """
    missing = [f"{owner.__name__}.{name}" for owner, names in _INTERNALS.items() for name in names
               if not hasattr(owner, name)]
    if accelerator is not None:
        missing += [f"Accelerator.{name}" for name in _INSTANCE_INTERNALS if not hasattr(accelerator, name)]
    return missing


def _check_version() -> None:
    installed = version.parse(accelerate.__version__)
    low, high = SUPPORTED_ACCELERATE
    if not low <= installed < high:
        logger.warning("hf_resumable's accelerate integration was written for accelerate >=%s,<%s; found %s. "
                       "Run tests/test_accelerate_integration.py before trusting resumes.", low, high, installed)


_check_version()


class ResumableAccelerator(Accelerator):
    """``accelerate.Accelerator`` whose ``save_state``/``load_state`` are crash-safe and resume bit for bit.

    Args:
        *args, **kwargs: forwarded to ``accelerate.Accelerator`` (e.g. ``gradient_accumulation_steps``,
            ``mixed_precision``, ``project_dir``).
        checkpoint_dir (`str` or `os.PathLike`, *optional*): where ``checkpoint-<step>`` directories go;
            defaults to ``<project_dir>/checkpoints``.
        keep_last (`int`, *optional*, defaults to 2): checkpoints kept after each commit (``None``: all).
        save_async (`bool`, *optional*, defaults to `False`): ``save_state`` stages tensors and writes in the
            background (single process only; under torch.distributed saves stay synchronous).
        allow_inexact_resume (`bool`, *optional*, defaults to `False`): resume despite a missing RNG/data
            state or a changed world size / accumulation / data layout, with a WARNING.
        handle_preemption (`bool`, *optional*, defaults to `True`): install the SIGTERM flag handler.
        exit_on_preemption (`bool`, *optional*, defaults to `True`): :meth:`checkpoint_if_preempted` raises
            ``SystemExit(PREEMPTION_EXIT_CODE)`` after saving; with `False` it returns `True` instead.
        push_checkpoints_to (`str`, *optional*): upload each committed checkpoint in the background (queued,
            never skipped, retried) to the Hub (``"user/repo"``, ``"hf://user/repo[@branch][/path]"``) or an
            fsspec store (``"s3://bucket/run"``); retention never deletes a checkpoint whose upload is pending.
        storage_options (`dict`, *optional*): fsspec options for ``s3://`` pushes and ``load_state`` URLs.

    Example:

    ```python
    >>> accelerator = ResumableAccelerator(gradient_accumulation_steps=2, checkpoint_dir="out")  # doctest: +SKIP
    >>> accelerator.load_state()  # doctest: +SKIP
    >>> accelerator.global_step  # doctest: +SKIP
    120
    ```
    """

    def __init__(self, *args: Any, checkpoint_dir: str | os.PathLike | None = None, keep_last: int | None = 2,
                 save_async: bool = False, allow_inexact_resume: bool = False, handle_preemption: bool = True,
                 exit_on_preemption: bool = True, push_checkpoints_to: str | None = None,
                 storage_options: dict | None = None, **kwargs: Any) -> None:
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}.")
        super().__init__(*args, **kwargs)
        missing = check_accelerate_internals(self)
        if missing:
            raise HfResumableError(
                f"The installed accelerate {accelerate.__version__} lacks {missing}, which ResumableAccelerator "
                "needs. Install an accelerate version in the supported range "
                f"(>={SUPPORTED_ACCELERATE[0]},<{SUPPORTED_ACCELERATE[1]}).")
        self._checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.keep_last = keep_last
        self.save_async = save_async
        self.allow_inexact_resume = allow_inexact_resume
        self.exit_on_preemption = exit_on_preemption
        self._step_counts = StepCounts()
        self._committed: dict[Path, str] = {}  # checkpoint this accelerator committed -> fingerprint of its state
        self._window_slot: tuple[int, int] | None = None
        self._resumable_loaders: list[ResumablePreparedLoader] = []
        self._preemption = PreemptionHandler().install() if handle_preemption else None
        self.storage_options = storage_options
        self._uploader = (open_uploader(push_checkpoints_to, storage_options=storage_options)
                          if push_checkpoints_to is not None and self.is_main_process else None)

    @property
    def global_step(self) -> int:
        """Completed optimizer steps (of the most-stepped prepared optimizer; accumulation windows if none).

        Counted by a step hook on every prepared optimizer, however the loop is written: micro-steps inside
        an accumulation window and steps a ``GradScaler`` skipped on overflow do not count.
        """
        return self._step_counts.global_step

    @global_step.setter
    def global_step(self, value: int) -> None:
        self._step_counts.global_step = int(value)

    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        """accelerate's ``prepare``; additionally counts the real steps of every prepared optimizer."""
        prepared = super().prepare(*args, device_placement=device_placement)
        self._attach_step_hooks()
        return prepared

    def _attach_step_hooks(self) -> None:
        for optimizer in self._optimizers:
            if getattr(optimizer, "_hf_resumable_step_hook", None) is None:
                hook = StepHook(self._step_counts)
                inner = getattr(optimizer, "optimizer", optimizer)
                inner.register_step_post_hook(hook)
                optimizer._hf_resumable_step_hook = hook

    def _optimizer_step_counts(self) -> list[int]:
        self._attach_step_hooks()
        return [optimizer._hf_resumable_step_hook.count for optimizer in self._optimizers]

    def _set_optimizer_step_counts(self, counts: list[int]) -> None:
        self._attach_step_hooks()
        for optimizer, count in zip(self._optimizers, counts):
            optimizer._hf_resumable_step_hook.count = int(count)

    def wait_for_uploads(self, timeout: float | None = None) -> None:
        """Block until every checkpoint queued for ``push_checkpoints_to`` is confirmed; raise the first failure."""
        if self._uploader is not None:
            self._uploader.wait(timeout=timeout)

    # ---------------------------------------------------------------- locations

    @property
    def checkpoint_dir(self) -> Path:
        """Directory holding the ``checkpoint-<step>`` directories.

        Raises:
            ValueError: if neither ``checkpoint_dir`` nor ``project_dir`` was given.
        """
        if self._checkpoint_dir is not None:
            return self._checkpoint_dir
        if self.project_dir is not None:
            return Path(self.project_dir) / "checkpoints"
        raise ValueError("ResumableAccelerator needs checkpoint_dir= (or project_dir=) to save or find checkpoints.")

    # ---------------------------------------------------------------- data

    def prepare_resumable_dataloader(self, dataset: Any, *, collate_fn: Callable[[list], Any], batch_size: int,
                                     seed: int, shuffle: bool = True, drop_last: bool = False,
                                     num_workers: int = 0, persistent_workers: bool = False,
                                     multiprocessing_context: Any = None) -> ResumablePreparedLoader:
        """Build (with this process's rank and world size) and prepare a resumable training loader.

        Randomness in the collator and the data set is seeded by the batch's position (see
        :mod:`hf_resumable.data`), so it is identical with any ``num_workers`` and after a resume.

        Example:

        ```python
        >>> loader = accelerator.prepare_resumable_dataloader(  # doctest: +SKIP
        ...     data, collate_fn=collate, batch_size=8, seed=0)
        ```
        """
        loader = build_map_dataloader(dataset, collate_fn=collate_fn, batch_size=batch_size, seed=seed,
                                      shuffle=shuffle, drop_last=drop_last, rank=self.process_index,
                                      world_size=self.num_processes, num_workers=num_workers,
                                      persistent_workers=persistent_workers,
                                      multiprocessing_context=multiprocessing_context)
        return self.prepare(loader)

    def prepare_data_loader(self, data_loader: torch.utils.data.DataLoader, device_placement: bool | None = None,
                            slice_fn_for_dispatch: Any = None) -> Any:
        """Resumable loaders are wrapped without re-sharding; other loaders get accelerate's treatment.

        Raises:
            ValueError: if a :class:`ResumableDataLoader` was built for another rank or world size.
        """
        if not isinstance(data_loader, ResumableDataLoader):
            logger.warning("%s is not an hf_resumable loader: its position is not saved, a resumed run restarts "
                           "it from its beginning. Build training loaders with prepare_resumable_dataloader().",
                           type(data_loader).__name__)
            return super().prepare_data_loader(data_loader, device_placement=device_placement,
                                               slice_fn_for_dispatch=slice_fn_for_dispatch)
        sampler = data_loader.batch_sampler
        if (sampler.rank, sampler.world_size) != (self.process_index, self.num_processes):
            raise ValueError(
                f"The ResumableDataLoader was built for rank {sampler.rank} of {sampler.world_size}, but this process "
                f"is rank {self.process_index} of {self.num_processes}. Build it with rank=accelerator.process_index "
                "and world_size=accelerator.num_processes, or use prepare_resumable_dataloader().")
        place = self.device_placement if device_placement is None else device_placement
        prepared = ResumablePreparedLoader(data_loader, gradient_state=self.gradient_state,
                                           device=self.device if place else None)
        self._resumable_loaders.append(prepared)
        return prepared

    def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Any:
        """accelerate's ``skip_first_batches``, refused for resumable loaders (``load_state`` already positioned them).

        Raises:
            ValueError: for a :class:`ResumablePreparedLoader` (skipping again would skip twice).
        """
        if isinstance(dataloader, ResumablePreparedLoader):
            raise ValueError("load_state() already restored this loader's position (epoch "
                             f"{dataloader.epoch}, batch {dataloader.consumed}); do not skip batches yourself.")
        return super().skip_first_batches(dataloader, num_batches)

    # ---------------------------------------------------------------- gradient accumulation

    def accumulation_windows(self, dataloader: Any, *,
                             count_items: Callable[[Any], int | torch.Tensor] | None = None
                             ) -> Iterator[AccumulationWindow]:
        """Group the loader's batches into accumulation windows; count each window's items on all ranks.

        Each window holds ``gradient_accumulation_steps`` micro-batches, except the last one of an epoch,
        which holds what is left. With ``count_items`` (e.g. ``lambda b: (b["labels"][:, 1:] != -100).sum()``)
        ``window.num_items`` is the item count of the whole window summed over its micro-batches and over
        all processes (one all-reduce per window), ready for ``backward(..., num_items_in_batch=...)``.

        Every process must iterate the same number of windows (true for resumable loaders: each rank has
        the same number of batches per epoch).

        Example:

        ```python
        >>> for window in accelerator.accumulation_windows(loader, count_items=count_tokens):  # doctest: +SKIP
        ...     for batch in window:
        ...         with accelerator.accumulate(model):
        ...             accelerator.backward(loss_sum(model, batch), num_items_in_batch=window.num_items)
        ...             optimizer.step()
        ...             optimizer.zero_grad()
        ```
        """
        iterator = iter(dataloader)
        while True:
            batches = list(islice(iterator, self.gradient_accumulation_steps))
            if not batches:
                return
            num_items = self._count_window_items(batches, count_items) if count_items is not None else None
            yield AccumulationWindow(self, batches, num_items)

    def _count_window_items(self, batches: list[Any], count_items: Callable[[Any], int | torch.Tensor]) -> int:
        local = sum(int(count_items(batch)) for batch in batches)
        if self.num_processes == 1:
            return local
        total = self.reduce(torch.tensor([local], dtype=torch.int64, device=self.device), reduction="sum")
        return int(total.item())

    def _do_sync(self) -> None:
        # Inside an AccumulationWindow the window decides: sync on its last micro-batch, whatever its length.
        if self._window_slot is None:
            super()._do_sync()
            return
        index, size = self._window_slot
        self.step = 0 if index == size - 1 else index + 1
        self.gradient_state._set_sync_gradients(index == size - 1)

    @contextlib.contextmanager
    def accumulate(self, *models: torch.nn.Module) -> Iterator[None]:
        """accelerate's ``accumulate``; without a prepared optimizer, counts completed windows in :attr:`global_step`."""
        with super().accumulate(*models):
            yield
        if self.sync_gradients and not self._optimizers:
            self.global_step += 1

    def backward(self, loss: torch.Tensor, *, num_items_in_batch: int | torch.Tensor | None = None,
                 **kwargs: Any) -> None:
        """Scale ``loss`` for accumulation, then backpropagate (through the GradScaler if there is one).

        * With ``num_items_in_batch`` (the window's item count on all processes, from
          :meth:`accumulation_windows`), ``loss`` must be the **sum** of the per-item losses of this
          micro-batch (``reduction="sum"``); it is scaled by ``num_processes / num_items_in_batch``, so
          the accumulated, process-averaged gradient is the gradient of the full window's mean.
        * Without it, inside an :class:`AccumulationWindow`, the mean loss is divided by the window's
          actual length (accelerate divides by ``gradient_accumulation_steps``, also for a short last window).
        * Otherwise it behaves as ``accelerate.Accelerator.backward``.

        Raises:
            ValueError: if ``num_items_in_batch`` is not positive.
            NotImplementedError: with ``num_items_in_batch`` under DeepSpeed or Megatron-LM (their engines
                scale the loss themselves).
        """
        engine_scaled = self.distributed_type in (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM)
        if engine_scaled or "learning_rate" in kwargs:
            if num_items_in_batch is not None:
                raise NotImplementedError(f"num_items_in_batch is not supported with {self.distributed_type}; "
                                          "scale the loss yourself and call backward(loss).")
            super().backward(loss, **kwargs)
            return
        loss = self._scale_loss(loss, num_items_in_batch)
        if self.scaler is not None:
            self.scaler.scale(loss).backward(**kwargs)
        else:
            loss.backward(**kwargs)

    def _scale_loss(self, loss: torch.Tensor, num_items_in_batch: int | torch.Tensor | None) -> torch.Tensor:
        if num_items_in_batch is not None:
            count = int(num_items_in_batch)
            if count <= 0:
                raise ValueError(f"num_items_in_batch must be > 0, got {count} (a window without any item).")
            return loss * (self.num_processes / count)
        if self._window_slot is not None:
            return loss / self._window_slot[1]
        return loss / self.gradient_accumulation_steps

    # ---------------------------------------------------------------- save

    def save_state(self, output_dir: str | os.PathLike | None = None, *, blocking: bool | None = None,
                   **_unused: Any) -> Path:
        """Save model, optimizer, scheduler, scaler, step counters, loader positions and every rank's RNG.

        Collective: call it on every process. The default directory is
        ``<checkpoint_dir>/checkpoint-<global_step>``; saving a step that is already committed there is a
        no-op (e.g. a preemption save right after a periodic one). Retention (``keep_last``) runs after
        the commit.

        Args:
            output_dir (`str` or `os.PathLike`, *optional*): an explicit checkpoint directory.
            blocking (`bool`, *optional*): overrides ``save_async`` for this call.

        Returns:
            `Path`: the checkpoint directory (committed, unless the save is asynchronous).

        Raises:
            InexactResumeError: if called inside an accumulation window (gradients of the window would be lost).
            UnsupportedStateError: with more than one prepared model, optimizer or scheduler.
            CheckpointExistsError / OSError / AsyncSaveError: see :func:`hf_resumable.save_checkpoint`.

        Example:

        ```python
        >>> accelerator.save_state()  # doctest: +SKIP
        PosixPath('out/checkpoint-120')
        ```
        """
        if _unused:
            raise TypeError(f"ResumableAccelerator.save_state does not take {sorted(_unused)} (accelerate options of "
                            "its pickle-based format).")
        if not self.sync_gradients:
            raise InexactResumeError(
                f"save_state() was called inside an accumulation window (micro-step {self.step} of "
                f"{self.gradient_accumulation_steps}); checkpoints land on optimizer-step boundaries only. "
                "Call it after the window's optimizer step.")
        automatic = output_dir is None
        target = Path(output_dir) if not automatic else self.checkpoint_dir / f"{CHECKPOINT_PREFIX}{self.global_step}"
        wait_for_pending_saves()  # save_checkpoint would wait anyway; the previous save may be this very step
        fingerprint = self._fingerprint(target)
        if automatic and broadcast_json(self.is_main_process and self._already_on_disk(target, fingerprint)):
            if self.is_main_process:
                logger.info("%s already holds exactly the current state (step %d); not writing it again.", target,
                            self.global_step)
            return target
        model, optimizer, scheduler = self._single_objects()
        save_checkpoint(
            target, model=model, optimizer=optimizer, scheduler=scheduler, scaler=self.scaler,
            step=self.global_step, overwrite=automatic,
            training_state={PROGRESS_GLOBAL_STEP: self.global_step, PROGRESS_MICRO_STEP: self.step,
                            PROGRESS_OPTIMIZER_STEPS: self._optimizer_step_counts()},
            extra={EXTRA_RUN: self._run_settings(),
                   EXTRA_CUSTOM_OBJECTS: [obj.state_dict() for obj in self._custom_objects]},
            data_state={DATA_LOADERS: [loader.position() for loader in self._resumable_loaders]},
            keep_last=self.keep_last if automatic and self._uploader is None else None,
            blocking=not self.save_async if blocking is None else blocking,
        )
        if self._uploader is not None:
            wait_for_pending_saves()  # only committed checkpoints are uploaded
            self._uploader.submit(target)
            if automatic and self.keep_last is not None:
                apply_retention(self.checkpoint_dir, keep_last=self.keep_last, protect=self._uploader.pending())
        self._committed[target] = fingerprint
        if self.is_main_process:
            logger.info("Saved state at step %d to %s", self.global_step, target)
        return target

    def _fingerprint(self, target: Path) -> str:
        """Digest of everything :meth:`save_state` writes (see :func:`state_fingerprint`)."""
        small = {"target": str(target), "global_step": self.global_step, "micro_step": self.step,
                 "optimizer_steps": self._optimizer_step_counts(),
                 "schedulers": [scheduler.state_dict() for scheduler in self._schedulers],
                 "scaler": self.scaler.state_dict() if self.scaler is not None else None,
                 "custom_objects": [obj.state_dict() for obj in self._custom_objects],
                 "loaders": [loader.position() for loader in self._resumable_loaders]}
        return state_fingerprint(models=self._models, optimizers=[getattr(o, "optimizer", o) for o in self._optimizers],
                                 small_state=small)

    def _already_on_disk(self, target: Path, fingerprint: str) -> bool:
        """Whether this accelerator committed ``target`` from exactly the current state, and it is still intact."""
        return self._committed.get(target) == fingerprint and verify_checkpoint(target, full=False).ok

    def _single_objects(self) -> tuple[torch.nn.Module | None, torch.optim.Optimizer | None, Any]:
        counts = {"models": len(self._models), "optimizers": len(self._optimizers),
                  "schedulers": len(self._schedulers)}
        if any(count > 1 for count in counts.values()):
            raise UnsupportedStateError(
                f"ResumableAccelerator saves one model, optimizer and scheduler; {counts} were prepared. Prepare "
                "one of each (combine parameter groups into one optimizer).")
        model = self.unwrap_model(self._models[0]) if self._models else None
        optimizer = self._optimizers[0].optimizer if self._optimizers else None
        scheduler = self._schedulers[0].scheduler if self._schedulers else None
        return model, optimizer, scheduler

    def _run_settings(self) -> dict[str, Any]:
        return {"world_size": self.num_processes, "gradient_accumulation_steps": self.gradient_accumulation_steps,
                "loaders": [loader.settings() for loader in self._resumable_loaders]}

    # ---------------------------------------------------------------- load

    def load_state(self, input_dir: str | os.PathLike | None = None, **_unused: Any) -> LoadedCheckpoint | None:
        """Resume from ``input_dir``, or from the newest checkpoint under :attr:`checkpoint_dir` that verifies.

        Collective: call it on every process, after ``prepare``. Restores model, optimizer, scheduler,
        scaler, :attr:`global_step`, the loaders' epoch and position, registered custom objects, then
        (last) this rank's RNG.

        Returns:
            `LoadedCheckpoint` or `None`: `None` when ``input_dir`` is omitted and no valid checkpoint exists.

        Raises:
            ConfigDriftError: the world size, accumulation steps or data layout differ from the saved run
                (unless ``allow_inexact_resume``).
            InexactResumeError: this rank's RNG or data position is missing (unless ``allow_inexact_resume``).
            CheckpointNotFoundError / IncompleteCheckpointError / CorruptCheckpointError /
            CheckpointMismatchError: see :func:`hf_resumable.load_checkpoint`.
        """
        if _unused:
            raise TypeError(f"ResumableAccelerator.load_state does not take {sorted(_unused)}.")
        path = self._resolve_checkpoint(input_dir)
        if path is None:
            if self.is_main_process:
                logger.info("No valid checkpoint under %s; starting from scratch.", self.checkpoint_dir)
            return None
        # 1. Compare the saved settings with ours before any object is touched.
        peek = load_checkpoint(path, restore_rng=False, allow_inexact_resume=True)
        self._check_drift(path, read_manifest(path).world_size, peek.extra.get(EXTRA_RUN))
        # 2. Fill the objects (RNG excluded: it goes last, step 5).
        model, optimizer, scheduler = self._single_objects()
        loaded = load_checkpoint(path, model=model, optimizer=optimizer, scheduler=scheduler, scaler=self.scaler,
                                 restore_rng=False, allow_inexact_resume=self.allow_inexact_resume)
        # 3. Counters and data positions, 4. registered objects, 5. RNG.
        self.global_step = int(loaded.training_state.get(PROGRESS_GLOBAL_STEP, loaded.step or 0))
        self._set_optimizer_step_counts(loaded.training_state.get(PROGRESS_OPTIMIZER_STEPS)
                                        or [self.global_step] * len(self._optimizers))
        self.step = int(loaded.training_state.get(PROGRESS_MICRO_STEP, 0))
        self._restore_loaders(path, loaded.data_state)
        self._restore_custom_objects(path, loaded.extra.get(EXTRA_CUSTOM_OBJECTS) or [])
        self._restore_rng(path, loaded)  # last: restoring anything else may draw random numbers
        if self.is_main_process:
            logger.info("Resumed from %s at step %d", path, self.global_step)
        return loaded

    def _resolve_checkpoint(self, input_dir: str | os.PathLike | None) -> Path | None:
        if is_remote(input_dir):  # hf://user/repo[@rev][/path] or s3://bucket/run[/checkpoint-N]
            return resolve_resume_path(input_dir, cache_dir=self.checkpoint_dir / ".remote-resume",
                                       storage_options=self.storage_options)
        if input_dir is not None:
            return Path(input_dir)
        # One process looks (and cleans up stale temp dirs); all use its answer.
        found = find_latest_checkpoint(self.checkpoint_dir) if self.is_main_process else None
        found = broadcast_json(str(found) if found is not None else None)
        return Path(found) if found is not None else None

    def _inexact(self, message: str, error: type[InexactResumeError] = InexactResumeError) -> None:
        if not self.allow_inexact_resume:
            raise error(f"{message}. Pass allow_inexact_resume=True to ResumableAccelerator to continue anyway.")
        logger.warning("%s; continuing because allow_inexact_resume=True. The run will NOT continue bit for bit.",
                       message)

    def _check_drift(self, path: Path, saved_world_size: int, saved: Mapping[str, Any] | None) -> None:
        current = self._run_settings()
        saved = {**(saved or {}), "world_size": saved_world_size}  # the manifest's count is authoritative
        changed = {key: (saved[key], current[key]) for key in saved if key in current and saved[key] != current[key]}
        if changed:
            details = ", ".join(f"{key}: {old!r} -> {new!r}" for key, (old, new) in changed.items())
            self._inexact(f"Resuming {path} with a different configuration ({details})", ConfigDriftError)

    def _restore_loaders(self, path: Path, data_state: Mapping[str, Any] | None) -> None:
        if not self._resumable_loaders:
            return
        records = (data_state or {}).get(DATA_LOADERS)
        if records is None or len(records) != len(self._resumable_loaders):
            self._inexact(f"{path} has no position for the {len(self._resumable_loaders)} prepared loader(s) of rank "
                          f"{self.process_index}")
            return
        for index, (loader, record) in enumerate(zip(self._resumable_loaders, records)):
            fits = loader.fits(record)
            if not fits:
                self._inexact(f"{path}: the saved position {dict(record)} of loader {index} does not fit it "
                              f"({len(loader)} batches per epoch on rank {self.process_index}; the data set, batch "
                              "size, drop_last or world size changed); its epoch restarts", ConfigDriftError)
            loader.load_position(record, restart_epoch=not fits)

    def _restore_custom_objects(self, path: Path, states: list[Any]) -> None:
        if len(states) != len(self._custom_objects):
            self._inexact(f"{path} holds {len(states)} registered custom object(s), {len(self._custom_objects)} are "
                          "registered now")
            return
        for obj, state in zip(self._custom_objects, states):
            obj.load_state_dict(state)

    def _restore_rng(self, path: Path, loaded: LoadedCheckpoint) -> None:
        if loaded.rng_state is None:
            self._inexact(f"{path} has no RNG state for rank {self.process_index}")
            return
        restore_rng_state(loaded.rng_state, allow_device_mismatch=self.allow_inexact_resume)

    # ---------------------------------------------------------------- preemption

    @property
    def preemption_requested(self) -> bool:
        """Whether *this* process received SIGTERM (not synchronised; see :meth:`checkpoint_if_preempted`)."""
        return self._preemption is not None and self._preemption.requested

    def checkpoint_if_preempted(self) -> bool:
        """If any process received SIGTERM: save, wait for the commit, then exit with ``PREEMPTION_EXIT_CODE``.

        Call it on every process once per optimizer step, after the step (the flag is combined across
        processes with one all-reduce, so all ranks save the same step). With ``exit_on_preemption=False``
        it returns `True` after saving instead of raising ``SystemExit``.

        Returns:
            `bool`: `False` when no preemption was requested.

        Raises:
            SystemExit: with code :data:`~hf_resumable.preemption.PREEMPTION_EXIT_CODE` (143) after the save.
        """
        requested = self.preemption_requested
        if self.num_processes > 1:
            flag = torch.tensor([int(requested)], dtype=torch.int64, device=self.device)
            requested = bool(self.reduce(flag, reduction="sum").item())
        if not requested:
            return False
        path = self.save_state(blocking=True)
        wait_for_pending_saves()
        logger.warning("Preempted: checkpoint %s (step %d) committed; exiting with %d.", path, self.global_step,
                       PREEMPTION_EXIT_CODE)
        if self.exit_on_preemption:
            raise SystemExit(PREEMPTION_EXIT_CODE)
        return True

    def end_training(self) -> None:
        """Wait for an in-flight asynchronous save, uninstall the SIGTERM handler, finish trackers, meet at a barrier.

        Unlike accelerate's ``end_training`` the process group is *not* destroyed here: with gloo,
        destroying it while a DDP-wrapped model still references it can deadlock later, when the model is
        released (``~Reducer`` -> ``~ProcessGroupGloo`` waits on a mutex forever; seen under ``torchrun``
        on 2 CPU processes). The group is released with the model, or at interpreter exit.
        """
        wait_for_pending_saves()
        if self._preemption is not None:
            self._preemption.uninstall()
        for tracker in self.trackers:
            tracker.finish()
        self.wait_for_everyone()
