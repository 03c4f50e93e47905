"""``ResumableAccelerator``: accelerate's ``Accelerator`` with crash-safe checkpoints and bit-exact resume.

A one-line drop-in (``from hf_resumable import ResumableAccelerator as Accelerator``); what it changes on purpose,
the resumable loop helpers and ``elastic=True`` are in docs/accelerate.md. The class is a thin front door: state
capture and restore, loader preparation and the elastic mode live in the ``_accelerate_*.py`` modules
(docs/architecture.md).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import accelerate
import torch
from accelerate import Accelerator
from accelerate.data_loader import DataLoaderDispatcher, DataLoaderShard, DataLoaderStateMixin
from accelerate.state import GradientState
from accelerate.utils import DistributedType

from .. import trace
from ..checkpoint import (
    LoadedCheckpoint,
    save_checkpoint,
)
from ..checkpoint.api import background_saver
from ..data import (
    ResumableDataLoader,
    SeededIterableDataset,
    build_map_dataloader,
    build_stream_dataloader,
)
from ..data._position import LoaderPosition
from ..errors import (
    InexactResumeError,
    UnsupportedEngineError,
)
from ..locations import open_uploader
from ..preemption import PreemptionAction, PreemptionHandler, PreemptionProtocol, exit_after_preemption
from ._accelerate_data import (
    ResumableDataLoaderDispatcher,
    ResumableDataLoaderShard,
    prepare_positioned_loader,
    skip_restored_batches,
)
from ._accelerate_elastic import world_size_mode
from ._accelerate_loop import (
    AccumulationWindow,
    ResumablePreparedLoader,
    ResumablePreparedStream,
    ResumedLoaders,
    accumulation_windows,
    prepare_resumable_loader,
)
from ._accelerate_paths import (
    NAMING_AUTOMATIC,
    NAMING_STEPS,
    CheckpointIterationExistsError,
    CheckpointPathNotFoundError,
    HookFileConflictError,
    after_commit,
    check_target,
    keep_count,
    pending_uploads,
    retains,
    save_target,
)
from ._accelerate_restore import load_agreed, load_newest, parse_load_options, resolve_checkpoint
from ._accelerate_state import (
    DATA_LOADERS,  # noqa: F401 - the data_state key, named here too
    StepCounts,
    accelerator_fingerprint,
    attach_step_hooks,
    capture_state,
    holds_current_state,
    warn_save_options,
)
from ._core import (
    DEFAULT,
    AfterCommit,
    ResumeOptions,
    check_upstream,
    notice_save_in_flight,
)
from ._deepspeed import (
    checkpoint_optimizer,
    deepspeed_engine,
    zero_optimizer,
)
from ._engines import check_accelerate_options, check_accelerate_state, holds_dtensors
from ._parallelism import accelerate_tp_ready, check_runnable, data_parallel_rank, layout_of

logger = logging.getLogger(__name__)

__all__ = [
    "AccumulationWindow",
    "CheckpointIterationExistsError",
    "CheckpointPathNotFoundError",
    "HookFileConflictError",
    "ResumableAccelerator",
    "ResumableDataLoaderDispatcher",
    "ResumableDataLoaderShard",
    "ResumablePreparedLoader",
    "ResumablePreparedStream",
    "check_accelerate_internals",
]

# Versions whose internals this module was written against (checked at import time, see _core.check_upstream).
TESTED_ACCELERATE = (">=1.10", "<2.0")
# Private accelerate names this module relies on; a test fails loudly when one disappears.
_INTERNALS: dict[Any, tuple[str, ...]] = {
    Accelerator: ("_do_sync", "unwrap_model", "reduce", "accumulate", "backward", "prepare_data_loader",
                  "get_state_dict", "skip_first_batches", "free_memory", "save_iteration",
                  "register_save_state_pre_hook", "register_load_state_pre_hook"),
    DataLoaderStateMixin: ("begin", "end", "reset"),
    DataLoaderShard: ("set_epoch", "_update_state_dict", "total_batch_size"),
    DataLoaderDispatcher: ("set_epoch", "_update_state_dict", "total_batch_size"),
    GradientState: ("_add_dataloader", "_remove_dataloader", "_set_sync_gradients", "end_of_dataloader"),
}
# Attributes set in Accelerator.__init__ (checked on the instance).
_INSTANCE_INTERNALS = ("_models", "_optimizers", "_schedulers", "_custom_objects", "_dataloaders", "gradient_state",
                       "scaler", "step", "project_configuration", "_save_model_state_pre_hook",
                       "_load_model_state_pre_hook")



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


check_upstream("accelerate", accelerate.__version__, TESTED_ACCELERATE, check_accelerate_internals())


class ResumableAccelerator(Accelerator):
    """``accelerate.Accelerator`` whose ``save_state``/``load_state`` are crash-safe and resume bit for bit.

    Args:
        *args, **kwargs: forwarded to ``accelerate.Accelerator`` (e.g. ``gradient_accumulation_steps``,
            ``mixed_precision``, ``project_dir``).
        checkpoint_dir (`str` or `os.PathLike`, *optional*): where automatic checkpoints go (accelerate's
            ``checkpoint_<iteration>`` with ``ProjectConfiguration(automatic_checkpoint_naming=True)``,
            ``checkpoint-<step>`` for ``save_state()`` otherwise); defaults to ``<project_dir>/checkpoints``.
        keep_last (`int`, *optional*): committed checkpoints kept after each automatic save (``None``: all).
            Defaults to ``ProjectConfiguration.total_limit``; without it, to all of them with automatic naming
            (as accelerate) and to 2 for ``checkpoint-<step>``.
        save_async (`bool`, *optional*, defaults to `False`): ``save_state`` stages tensors and writes in the
            background; under torch.distributed every rank writes its files in the background and rank 0
            commits once all are durable (coordinated on a gloo group of its own). The next save, a load and
            ``end_training`` wait; a background failure is raised at the next of them.
        allow_inexact_resume (`bool`, *optional*, defaults to `False`): resume despite a missing RNG/data
            state or a changed world size / accumulation / data layout, with a WARNING.
        handle_preemption (`bool`, *optional*, defaults to `True`): install the SIGTERM flag handler.
        exit_on_preemption (`bool`, *optional*, defaults to `True`): :meth:`checkpoint_if_preempted` raises
            ``SystemExit(PREEMPTION_EXIT_CODE)`` after saving; with `False` it returns `True` instead.
        preemption_notice (`float`, *optional*): the seconds from SIGTERM to SIGKILL that the scheduler gives
            (Kubernetes' ``terminationGracePeriodSeconds``, SLURM's ``--signal=TERM@<seconds>``): training goes on
            while another step and a final save fit (see :meth:`checkpoint_if_preempted` and
            :mod:`hf_resumable.preemption`). Without it the signal's step is saved and the process exits at once.
        push_checkpoints_to (`str`, *optional*): upload each committed checkpoint in the background (queued,
            never skipped, retried) to the Hub (``"user/repo"``, ``"hf://user/repo[@branch][/path]"``) or an
            fsspec store (``"s3://bucket/run"``); retention never deletes a checkpoint whose upload is pending.
        storage_options (`dict`, *optional*): fsspec options for ``s3://`` pushes and ``load_state`` URLs.
        standalone_checkpoints (`bool`, *optional*, defaults to `False`): store the first model's frozen parameters
            (a PEFT base, a frozen embedding) in every checkpoint too; by default they are recorded, not stored, and
            checked against the model by ``load_state`` (see :func:`hf_resumable.save_checkpoint`).
        elastic (`bool`, *optional*, defaults to `False`): ``load_state`` may continue a run saved by another
            number of processes, keeping the checkpoint's global batch by changing ``gradient_accumulation_steps``
            (a world size that does not divide it raises ``ElasticWorldSizeError`` listing those that do); see
            docs/accelerate.md, "Another number of processes".

    These options are validated when the accelerator is built and kept in ``resume_options`` (a frozen
    ``ResumeOptions``, shared with ``ResumableTrainer``).

    Raises:
        UnsupportedEngineError: when built for DeepSpeed ZeRO-Offload, Megatron-LM or FSDP1 hybrid sharding, whose
            state these checkpoints would not hold, before any training step (``prepare`` refuses more).

    Example:

    ```python
    >>> accelerator = ResumableAccelerator(gradient_accumulation_steps=2, checkpoint_dir="out")  # doctest: +SKIP
    >>> accelerator.load_state()  # doctest: +SKIP
    >>> accelerator.global_step  # doctest: +SKIP
    120
    ```
    """

    def __init__(self, *args: Any, checkpoint_dir: str | os.PathLike | None = None, keep_last: Any = DEFAULT,
                 save_async: bool = False, allow_inexact_resume: bool = False, handle_preemption: bool = True,
                 exit_on_preemption: bool = True, push_checkpoints_to: str | None = None,
                 storage_options: dict | None = None, standalone_checkpoints: bool = False, elastic: bool = False,
                 preemption_notice: float | None = None, **kwargs: Any) -> None:
        self.resume_options = ResumeOptions(
            checkpoint_dir=checkpoint_dir, keep_last=keep_last, save_async=bool(save_async),
            allow_inexact_resume=allow_inexact_resume, handle_preemption=handle_preemption,
            exit_on_preemption=exit_on_preemption, push_checkpoints_to=push_checkpoints_to,
            storage_options=storage_options, standalone_checkpoints=standalone_checkpoints, elastic=elastic,
            preemption_notice=preemption_notice)
        # Engines refused before accelerate sets them up (DeepSpeed is imported there), then from its built state.
        check_accelerate_options(inspect.signature(Accelerator.__init__).bind(self, *args, **kwargs).arguments)
        super().__init__(*args, **kwargs)
        check_accelerate_state(self.state)
        check_upstream("accelerate", accelerate.__version__, TESTED_ACCELERATE, check_accelerate_internals(self))
        self._step_counts = StepCounts()
        self._committed: dict[Path, str] = {}  # checkpoint this accelerator committed -> fingerprint of its state
        self._commits = AfterCommit()  # follow-ups (upload, retention) of saves not yet known to be committed
        self._warned: dict[str, bool] = {}  # one WARNING per ignored option
        self._window: AccumulationWindow | None = None  # the window accumulation_windows() handed out last
        # Loaders whose position is saved, in preparation order (ResumablePreparedLoader, ResumableDataLoaderShard...).
        self._resumable_loaders: list[LoaderPosition] = []
        self._resume_watch = ResumedLoaders()  # catches a script that skips again what load_state's loaders skipped
        self._preemption = PreemptionHandler().install() if handle_preemption else None
        self._preemption_protocol = PreemptionProtocol(self._preemption, notice=preemption_notice)
        self._notice_checkpoint: Path | None = None  # the checkpoint saved when the preemption notice began
        self._stopped_by_preemption = False  # checkpoint_if_preempted saved and stopped (or exited)
        # elastic or not, chosen once: every step that differs asks it
        self._world_size_mode = world_size_mode(self.resume_options.elastic, data_ranks=self._data_rank()[1])
        self._uploader = (open_uploader(push_checkpoints_to, storage_options=storage_options)
                          if push_checkpoints_to is not None and self.is_main_process else None)

    @property
    def keep_last(self) -> int | None:
        """Committed checkpoints kept after each automatic save (``None``: all); see the class arguments."""
        return keep_count(self)

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
        """accelerate's ``prepare``; additionally counts the real steps of every prepared optimizer.

        Raises:
            UnsupportedEngineError: under FSDP2 or ZeRO, a second model or optimizer; a DeepSpeed optimizer other than
                ZeRO's own; a ``ParallelismConfig`` layout that cannot train as it says
                (:func:`~hf_resumable.integrations._parallelism.check_runnable`), before any training step.
            UpstreamInternalsError: FSDP2 with tensor parallel where accelerate's preparation of it cannot run.
        """
        layout = layout_of(self.parallelism_config)
        check_runnable(layout, device_type=self.device.type, fsdp2=self.is_fsdp2,
                       tp_ready=layout is None or layout.tp == 1 or accelerate_tp_ready())
        prepared = super().prepare(*args, device_placement=device_placement)
        prepared = self._world_size_mode.keep_scheduler_rate(self, prepared)
        self._checkpoint_optimizers()  # refuses DeepSpeed's other optimizers, before any step
        attach_step_hooks(self)
        if self._saves_pieces() and (len(self._models) > 1 or len(self._optimizers) > 1):
            raise UnsupportedEngineError(
                f"ResumableAccelerator checkpoints one FSDP2 or ZeRO model and its optimizer; {len(self._models)} "
                f"models and {len(self._optimizers)} optimizers are prepared. Nothing was trained. Prepare one model "
                "and one optimizer, or use the stock accelerate.Accelerator for this run.")
        return prepared

    def _saves_pieces(self) -> bool:
        """Whether checkpoints hold per-rank pieces (FSDP2 / DTensor parameters, ZeRO partitions) instead of whole
        tensors."""
        return (any(holds_dtensors(model) for model in self._models)
                or any(zero_optimizer(optimizer) is not None for optimizer in self._optimizers))

    def _checkpoint_optimizers(self) -> list[Any]:
        """What checkpoints save of each prepared optimizer: the torch optimizer, or a ZeRO optimizer's partitions."""
        return [checkpoint_optimizer(optimizer) for optimizer in self._optimizers]

    def _deepspeed_engine(self) -> Any:
        return deepspeed_engine(self._models[0]) if self._models else None

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
        if self.resume_options.checkpoint_dir is not None:
            return self.resume_options.checkpoint_dir
        if self.project_dir is not None:
            return Path(self.project_dir) / "checkpoints"
        raise ValueError("ResumableAccelerator needs checkpoint_dir= (or project_dir=) to save or find checkpoints.")

    # ---------------------------------------------------------------- data

    def prepare_resumable_dataloader(self, dataset: Any, *, collate_fn: Callable[[list], Any], batch_size: int,
                                     seed: int, shuffle: bool = True, drop_last: bool = False,
                                     num_workers: int = 0, persistent_workers: bool = False,
                                     multiprocessing_context: Any = None
                                     ) -> ResumablePreparedLoader | ResumablePreparedStream:
        """Build (with this process's rank and world size) and prepare a resumable training loader.

        Randomness in the collator and the data set is seeded by the batch's position, so it is identical with any
        ``num_workers`` and after a resume. A ``torch.utils.data.IterableDataset`` (a ``datasets`` stream) gets the
        ``ResumableTrainer``'s stream loader (:func:`~hf_resumable.data.build_stream_dataloader`, ``torchdata``
        needed); docs/accelerate.md ("Streaming data") has its layouts.

        Raises:
            ValueError: an elastic stream with ``num_workers > 0``.
            InexactResumeError: several processes and a stream that is not a ``datasets.IterableDataset``
                (outside the elastic layout).

        Example:

        ```python
        >>> loader = accelerator.prepare_resumable_dataloader(  # doctest: +SKIP
        ...     data, collate_fn=collate, batch_size=8, seed=0)
        ```
        """
        rank, world_size = self._data_rank()
        mode = self._world_size_mode
        options = dict(collate_fn=collate_fn, batch_size=batch_size, seed=seed, drop_last=drop_last, rank=rank,
                       world_size=world_size, num_workers=num_workers, persistent_workers=persistent_workers,
                       multiprocessing_context=multiprocessing_context,
                       global_batch=mode.global_batch(batch_size * self.gradient_accumulation_steps * world_size))
        if isinstance(dataset, torch.utils.data.IterableDataset):
            source = mode.stream_source(dataset, rank=rank, world_size=world_size)
            return self.prepare(build_stream_dataloader(source, **options))
        return self.prepare(build_map_dataloader(dataset, shuffle=shuffle, **options))

    def _data_rank(self) -> tuple[int, int]:
        """This process's data-parallel rank and the number of them (under a ``ParallelismConfig``, the ranks of one
        tensor/context-parallel group read the same batches)."""
        return data_parallel_rank(layout_of(self.parallelism_config), process_index=self.process_index,
                                  world_size=self.num_processes)

    def prepare_data_loader(self, data_loader: torch.utils.data.DataLoader, device_placement: bool | None = None,
                            slice_fn_for_dispatch: Any = None) -> Any:
        """accelerate's ``prepare_data_loader``, returning a loader that resumes exactly.

        * A plain ``DataLoader`` (or ``StatefulDataLoader``) over a map-style data set is prepared by accelerate as
          usual, then rebuilt as a :class:`ResumableDataLoaderShard` (or :class:`ResumableDataLoaderDispatcher`):
          the same class and batches, plus a saved position, a ``(seed, epoch)`` order and per-batch randomness
          keyed by position.
        * A :class:`~hf_resumable.data.ResumableDataLoader` or a stream loader of
          :meth:`prepare_resumable_dataloader` is wrapped without re-sharding.
        * Any other loader gets accelerate's treatment, and a WARNING says that its position is not saved.

        Raises:
            ValueError: if a :class:`ResumableDataLoader` (or a stream loader of the elastic layout) was built for
                another rank or world size.
        """
        if isinstance(data_loader, ResumableDataLoader) or isinstance(getattr(data_loader, "dataset", None),
                                                                      SeededIterableDataset):
            return prepare_resumable_loader(self, data_loader, device_placement)
        prepare = functools.partial(super().prepare_data_loader, device_placement=device_placement,
                                    slice_fn_for_dispatch=slice_fn_for_dispatch)
        if getattr(data_loader, "_is_accelerate_prepared", False) or any(data_loader is loader
                                                                         for loader in self._resumable_loaders):
            return prepare(data_loader)
        return prepare_positioned_loader(self, data_loader, prepare)

    def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Any:
        """accelerate's ``skip_first_batches``, aware of positions restored by ``load_state``: for a loader prepared
        here, the loader itself is returned, positioned, and never skips twice (the rules:
        :func:`~hf_resumable.integrations._accelerate_data.skip_restored_batches`).

        Raises:
            ValueError: ``num_batches`` differs from the position ``load_state`` restored (the script's count
                and the checkpoint disagree), or the loader is being iterated.
        """
        return skip_restored_batches(self, dataloader, num_batches, fallback=super().skip_first_batches)

    def prepare_scheduler(self, scheduler: Any) -> Any:
        """accelerate's ``prepare_scheduler``; with ``elastic=True`` the scheduler keeps the first launch's number of
        steps per optimizer step (:class:`~._accelerate_elastic.KeptRateScheduler`)."""
        return self._world_size_mode.keep_scheduler_rate(self, super().prepare_scheduler(scheduler))

    def free_memory(self, *objects: Any) -> Any:
        """accelerate's ``free_memory``; also forgets the prepared loaders' positions."""
        self._resumable_loaders = []
        self._resume_watch.forget()
        return super().free_memory(*objects)

    # ---------------------------------------------------------------- gradient accumulation

    def accumulation_windows(self, dataloader: Any, *,
                             count_items: Callable[[Any], int | torch.Tensor] | None = None
                             ) -> Iterator[AccumulationWindow]:
        """Group the loader's batches into accumulation windows; count each window's items on all ranks.

        Each window holds ``gradient_accumulation_steps`` micro-batches, except the last one of an epoch, which
        holds what is left. With ``count_items`` (e.g. ``lambda b: (b["labels"][:, 1:] != -100).sum()``)
        ``window.num_items`` is the window's item count over all processes (one all-reduce per window), ready for
        ``backward(..., num_items_in_batch=...)``. Every process must iterate the same number of windows.

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
        yield from accumulation_windows(self, dataloader, count_items)

    def _do_sync(self) -> None:
        # Inside an AccumulationWindow the window decides: sync on its last micro-batch, whatever its length.
        slot = self._window.slot if self._window is not None else None
        if slot is None:
            super()._do_sync()
            return
        index, size = slot
        self.step = 0 if index == size - 1 else index + 1
        self.gradient_state._set_sync_gradients(index == size - 1)

    @contextlib.contextmanager
    def accumulate(self, *models: torch.nn.Module) -> Iterator[None]:
        """accelerate's ``accumulate``; without a prepared optimizer it counts windows in :attr:`global_step`."""
        with super().accumulate(*models):
            yield
        if self.sync_gradients and not self._optimizers:
            self.global_step += 1

    def backward(self, loss: torch.Tensor, *, num_items_in_batch: int | torch.Tensor | None = None,
                 **kwargs: Any) -> None:
        """Scale ``loss`` for accumulation, then backpropagate (through the GradScaler if there is one).

        * With ``num_items_in_batch`` (the window's item count on all processes, from
          :meth:`accumulation_windows`), ``loss`` must be the **sum** of this micro-batch's per-item losses; it is
          scaled by ``num_processes / num_items_in_batch``, so the accumulated gradient is that of the window's mean
          (under DeepSpeed, whose engine divides by its accumulation itself, also times that accumulation).
        * Without it, inside an :class:`AccumulationWindow`, the mean loss is divided by the window's actual length
          (accelerate divides by ``gradient_accumulation_steps``, also for a short last window).
        * ``elastic=True``: a padding micro-batch's loss is scaled to zero, and in the epoch's last, shorter step a
          mean loss weighs the micro-batch's share of the step's samples.
        * Otherwise it behaves as ``accelerate.Accelerator.backward``.

        The first backward after ``load_state`` checks that the loop trains what it draws from the restored loaders.

        Raises:
            ValueError: if ``num_items_in_batch`` is not positive.
            NotImplementedError: with ``num_items_in_batch`` under Megatron-LM (its engine scales the loss itself).
            DoubleSkipError: at the first backward after a resume, more than one accumulation window of batches was
                drawn from a loader that ``load_state`` restored mid-epoch: the script skips them again by hand.
        """
        self._resume_watch.check_first_backward(self.gradient_accumulation_steps)
        trace.on_loss(loss)  # hf-resumable check: the loss of this micro-batch
        if self.distributed_type is DistributedType.DEEPSPEED and num_items_in_batch is not None:
            engine = self.deepspeed_engine_wrapped.engine
            super().backward(self._scale_loss(loss, num_items_in_batch) * engine.gradient_accumulation_steps(),
                             **kwargs)
            return
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
        return self._world_size_mode.scale_loss(loss, num_items_in_batch, window=self._window,
                                                accumulation=self.gradient_accumulation_steps,
                                                num_processes=self.num_processes)

    # ---------------------------------------------------------------- save

    def register_save_state_pre_hook(self, hook: Callable[..., None]) -> Any:
        """accelerate's hook: ``hook(models, weights, output_dir)`` runs in :meth:`save_state` before any saving.

        The arguments are accelerate's (a hook may remove or replace entries of ``weights``). ``output_dir`` is a
        staging directory: what the hook writes there is committed with the checkpoint, hashed, at the same relative
        path, where the ``load_state`` pre-hook finds it. Only the main process's files are kept.

        Returns:
            `torch.utils.hooks.RemovableHandle`
        """
        return super().register_save_state_pre_hook(hook)

    def register_load_state_pre_hook(self, hook: Callable[..., None]) -> Any:
        """accelerate's hook: ``hook(models, input_dir)`` runs in :meth:`load_state` before anything is loaded.

        A model the hook removes from ``models`` is not loaded, as in accelerate; ``input_dir`` is the committed
        checkpoint directory.

        Returns:
            `torch.utils.hooks.RemovableHandle`
        """
        return super().register_load_state_pre_hook(hook)

    def save_state(self, output_dir: str | os.PathLike | None = None, safe_serialization: bool = True, *,
                   blocking: bool | None = None, **save_model_func_kwargs: Any) -> Path:
        """Save models, optimizers, schedulers, scaler, registered objects, counters, loader positions and RNG.

        Collective: call it on every process. Where it goes, as in accelerate:

        * With ``ProjectConfiguration(automatic_checkpoint_naming=True)``: ``<project_dir>/checkpoints/
          checkpoint_<iteration>`` (``output_dir`` is ignored, as in accelerate); ``iteration`` advances by one
          per save, and after the commit only the newest ``total_limit`` committed checkpoints are kept (all
          without ``total_limit``). An existing ``checkpoint_<iteration>`` is refused, as accelerate does.
        * With ``output_dir``: that directory. A missing or empty directory, or a checkpoint hf_resumable wrote
          there before, is replaced atomically (readers never see a half-written checkpoint); a directory
          holding files hf_resumable did not write is refused (nothing is deleted or mixed into it).
        * Neither (hf_resumable's addition): ``<checkpoint_dir>/checkpoint-<global_step>``, ``keep_last``
          retention after the commit; saving the same step again writes nothing only when the checkpoint
          provably holds the current state already (same tensors, unmodified, same RNG, counters, positions).

        Everything is written as sharded safetensors and JSON (no pickle), manifest last, committed atomically.

        Args:
            output_dir (`str` or `os.PathLike`, *optional*): the checkpoint directory.
            safe_serialization (`bool`, *optional*, defaults to `True`): accepted for accelerate compatibility;
                `False` asks for pickle, which hf_resumable never writes (safetensors are written anyway, with a
                WARNING).
            blocking (`bool`, *optional*): overrides ``save_async`` for this call.
            save_model_func_kwargs: accepted for accelerate compatibility (they configure DeepSpeed's own
                ``save_checkpoint``, which is not used here); ignored with a WARNING.

        Returns:
            `Path`: the checkpoint directory (committed, unless the save is asynchronous).

        Raises:
            InexactResumeError: if called inside an accumulation window (gradients of the window would be lost).
            CheckpointIterationExistsError: automatic naming and ``checkpoint_<iteration>`` exists (also a
                ``ValueError``, as in accelerate).
            CheckpointExistsError: ``output_dir`` holds files hf_resumable did not write (a ``FileExistsError``).
            HookFileConflictError: a pre-hook wrote a file whose name the checkpoint format uses.
            UnsupportedStateError / OSError / AsyncSaveError: see :func:`hf_resumable.save_checkpoint`.

        Example:

        ```python
        >>> accelerator.save_state()  # doctest: +SKIP
        PosixPath('out/checkpoint-120')
        ```
        """
        warn_save_options(self, safe_serialization, save_model_func_kwargs)
        if not self.sync_gradients:
            raise InexactResumeError(
                f"save_state() was called inside an accumulation window (micro-step {self.step} of "
                f"{self.gradient_accumulation_steps}); checkpoints land on optimizer-step boundaries only. "
                "Call it after the window's optimizer step.")
        # the previous save has committed (its retention and upload done): it may be this step
        self._commits.settle(removals=False)
        mode, target = save_target(self, output_dir)
        # Only checkpoint-<step> saves can meet a checkpoint of this very state (the other namings always write).
        fingerprint = accelerator_fingerprint(self, target) if mode == NAMING_STEPS else None
        if holds_current_state(self, target, fingerprint):
            return target
        check_target(self, mode, target)
        if target.resolve() in pending_uploads(self):
            self._uploader.wait()  # never replace a checkpoint while it is being uploaded
        blocking = not self.resume_options.save_async if blocking is None else blocking
        # Retention runs right after save_state, as accelerate's total_limit does (upstream's tests count the
        # entries): it may then delete the previous checkpoint, so this one's files are fsynced before its commit.
        durability = "immediate" if retains(self, mode) else "deferred"
        save_checkpoint(target, **capture_state(self), step=self.global_step, overwrite=mode != NAMING_AUTOMATIC,
             blocking=blocking, standalone=self.resume_options.standalone_checkpoints, durability=durability)
        if fingerprint is not None:
            self._committed = {target: fingerprint}  # steps only grow: only the newest can be met again
        if mode == NAMING_AUTOMATIC:
            self.project_configuration.iteration += 1
        self._commits.attach(None if blocking else background_saver().future, lambda: after_commit(self, mode, target))
        if self._uploader is not None:
            self._commits.settle()  # uploads start as soon as the save returns (only committed checkpoints upload)
        if self.is_main_process:
            logger.info("Saved state at step %d to %s", self.global_step, target)
        return target

    # ---------------------------------------------------------------- load

    def load_state(self, input_dir: str | os.PathLike | None = None, load_kwargs: dict | None = None,
                   **load_model_func_kwargs: Any) -> LoadedCheckpoint | None:
        """Resume from ``input_dir``, or from the newest checkpoint that *verifies*.

        Collective: call it on every process, after ``prepare``. Runs the ``load_state`` pre-hooks, then
        restores models, optimizers, schedulers, scaler, counters (:attr:`global_step`, accelerate's ``step``,
        ``ProjectConfiguration.iteration``), the loaders' epoch and position, registered objects, and (last) this
        process's RNG.

        Without ``input_dir``: the newest valid ``checkpoint_<i>`` (automatic naming) or ``checkpoint-<step>``
        under :attr:`checkpoint_dir`; partial or corrupt ones are skipped with a WARNING, and one that fails its
        hashes while it is loaded is moved aside (``corrupt-<name>``) and the one before it loaded. ``input_dir``
        may also be ``hf://user/repo[@rev][/path]`` or an fsspec URL. ``ProjectConfiguration.iteration`` continues
        after every existing ``checkpoint_<i>``, so the next save never collides.

        Args:
            input_dir (`str` or `os.PathLike`, *optional*): the checkpoint to load.
            load_kwargs (`dict`, *optional*): accelerate's options for ``torch.load``, which is never used here
                (no pickle); ignored with a WARNING.
            load_model_func_kwargs: ``strict`` (missing/unexpected model keys are errors, default `True`) and
                ``map_location`` (``None``, ``"cpu"`` or ``"on_device"``, as in accelerate: state is loaded
                straight to where the parameters are either way). Any other option is refused.

        Returns:
            `LoadedCheckpoint` or `None`: `None` when ``input_dir`` is omitted and no valid checkpoint exists.

        Raises:
            CheckpointPathNotFoundError: ``input_dir`` does not exist (a ``CheckpointNotFoundError`` and a
                ``ValueError``, which accelerate raises).
            IncompleteCheckpointError: not a committed hf_resumable checkpoint (e.g. written by stock accelerate),
                or it lacks an object that is prepared now.
            ConfigDriftError: the world size, accumulation steps or data layout differ from the saved run
                (unless ``allow_inexact_resume``; with ``elastic=True`` a world size that keeps the global batch is
                not a drift).
            ElasticWorldSizeError: ``elastic=True`` and this world size cannot keep the checkpoint's global batch
                (the message lists the world sizes that can), before anything is loaded.
            InexactResumeError: this process's RNG or data position is missing (unless ``allow_inexact_resume``).
            CorruptCheckpointError / CheckpointMismatchError: see :func:`hf_resumable.checkpoint.open_checkpoint`
                and ``OpenedCheckpoint.load_into`` (everything is checked before anything is filled); a corrupt
                ``input_dir`` raises on every process. Without ``input_dir``: committed checkpoints exist but none
                verifies and loads (``CorruptCheckpointError`` listing each one and why).
            TypeError: an unsupported ``map_location`` or option.
        """
        strict = parse_load_options(self, load_kwargs, load_model_func_kwargs)
        if input_dir is None:  # the newest that verifies; one that fails while it is loaded: the one before it
            return load_newest(self, strict)
        return load_agreed(self, resolve_checkpoint(self, input_dir), strict)

    # ---------------------------------------------------------------- preemption

    @property
    def preemption_requested(self) -> bool:
        """Whether *this* process received SIGTERM (not synchronised; see :meth:`checkpoint_if_preempted`)."""
        return self._preemption is not None and self._preemption.requested

    def checkpoint_if_preempted(self) -> bool:
        """If any process received SIGTERM: save, wait for the commit, then exit with ``PREEMPTION_EXIT_CODE``.

        Call it on every process once per optimizer step, after the step (the flag is combined across
        processes with one all-reduce, so all ranks save the same step). With ``exit_on_preemption=False``
        it returns `True` after saving instead of raising ``SystemExit``. With ``preemption_notice`` the first call
        after the signal saves (in the background with ``save_async``) and returns `False`, and so do the later
        ones while another step and a final save fit in the notice; then it saves and exits.

        Returns:
            `bool`: `False` when no preemption was requested, or when training goes on within the notice.

        Raises:
            SystemExit: with code :data:`~hf_resumable.preemption.PREEMPTION_EXIT_CODE` (143) after the save.
        """
        protocol = self._preemption_protocol
        action = protocol.at_step_boundary(device=self.device, step=self.global_step)
        if action is PreemptionAction.TRAIN:
            return False
        if action is PreemptionAction.SAVE_AND_TRAIN:
            started = protocol.clock()
            self._notice_checkpoint = self.save_state()
            protocol.notice_saved(started=started, future=notice_save_in_flight())
            return False
        if action.saves:
            path = self.save_state(blocking=True)
        else:  # the notice checkpoint is this step's
            self._commits.settle()
            path = self._notice_checkpoint
        self._stopped_by_preemption = True
        exit_after_preemption(self._preemption, checkpoint=str(path), step=self.global_step,
                              exit=self.resume_options.exit_on_preemption)
        return True

    def log(self, values: dict, step: int | None = None, log_kwargs: dict | None = None) -> None:
        """accelerate's ``log`` (to every tracker, on the main process); ``hf-resumable check`` compares the values."""
        trace.on_metrics(values, step)  # hf-resumable check: the metrics logged at this step
        super().log(values, step=step, log_kwargs=log_kwargs or {})

    def end_training(self) -> None:
        """Wait for an in-flight asynchronous save, uninstall the SIGTERM handler, finish trackers, meet at a barrier.

        Unlike accelerate's ``end_training`` the process group is *not* destroyed: with gloo, destroying it while a
        DDP-wrapped model still references it can deadlock when the model is released. The group is released with
        the model, or at interpreter exit.
        """
        self._commits.settle()
        protocol = self._preemption_protocol
        if protocol.signalled and protocol.notice is not None and not self._stopped_by_preemption:
            logger.warning("Preemption signal received, but the training loop ended (step %d) within the %.0f s "
                           "notice.", self.global_step, protocol.notice)
        if self._preemption is not None:
            self._preemption.uninstall()
        for tracker in self.trackers:
            tracker.finish()
        self.wait_for_everyone()
