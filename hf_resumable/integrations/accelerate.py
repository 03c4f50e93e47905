"""``ResumableAccelerator``: accelerate's ``Accelerator`` with crash-safe checkpoints and bit-exact resume.

A drop-in: ``from hf_resumable import ResumableAccelerator as Accelerator`` in a working accelerate script
changes nothing else. accelerate's own checkpointing tests pass with that one-line change
(``tests/upstream/run_accelerate_upstream.py``). What it changes compared to ``accelerate.Accelerator``
(whose ``save_state`` pickles optimizer, scheduler and RNG, deletes old checkpoints before writing the new one,
swallows RNG load failures and leaves mid-epoch resume to the user):

* ``save_state()`` writes the hf_resumable format (sharded safetensors, no pickle, manifest last, atomic
  commit) where accelerate would: ``output_dir``, or ``checkpoint_<iteration>`` with
  ``ProjectConfiguration(automatic_checkpoint_naming=True)`` (``total_limit`` retention only *after* the
  commit, and only of hf_resumable checkpoints), or, without either, ``checkpoint-<global_step>``.
  ``load_state()`` with no argument resumes from the newest checkpoint that *verifies* and restores every
  counter, so the next save does not collide. Any number of models, optimizers, schedulers and registered
  objects; accelerate's save/load pre-hooks run where accelerate runs them (see
  :mod:`~hf_resumable.integrations._accelerate_objects` and :mod:`~hf_resumable.integrations._accelerate_paths`).
* :attr:`ResumableAccelerator.global_step` counts real optimizer steps (a step hook on every prepared
  optimizer), however the loop is written; a save never returns without writing unless a fingerprint proves
  the checkpoint holds exactly the current state (:mod:`~hf_resumable.integrations._accelerate_state`).
* ``prepare(DataLoader(...))`` returns accelerate's own loader class, rebuilt so that its position, order and
  per-batch randomness resume exactly (:mod:`~hf_resumable.integrations._accelerate_data`). Training loaders
  built with :func:`hf_resumable.data.build_map_dataloader` or :func:`~hf_resumable.data.build_stream_dataloader`
  (or :meth:`ResumableAccelerator.prepare_resumable_dataloader`, map-style or streaming) are prepared without
  accelerate's re-sharding.
  Either way positions are saved per rank and restored without fetching, collating or moving a single
  skipped batch.
* RNG of every rank is saved and restored after everything else; a missing or mismatched piece raises
  :class:`~hf_resumable.errors.InexactResumeError` (never a log line at INFO).
* Resuming with another world size, accumulation setting or data layout raises
  :class:`~hf_resumable.errors.ConfigDriftError` unless ``allow_inexact_resume=True``.
* SIGTERM only sets a flag; :meth:`ResumableAccelerator.checkpoint_if_preempted` (called once per
  optimizer step) saves and exits with :data:`~hf_resumable.preemption.PREEMPTION_EXIT_CODE` (with
  ``preemption_notice``: saves, trains on while the notice leaves time, then saves and exits).
* Token-exact gradient accumulation: :meth:`ResumableAccelerator.accumulation_windows` prefetches each
  window and counts its items across micro-batches *and* ranks; ``backward(loss_sum,
  num_items_in_batch=window.num_items)`` then makes the accumulated gradient the full-batch token mean,
  short last window of an epoch included (accelerate divides every micro-batch by the configured number
  of steps: a mean of means, and wrong for a short window).
* Engines (:mod:`~hf_resumable.integrations._engines`): DDP, FSDP2 and FSDP1 (every rank writes its own
  pieces) and DeepSpeed ZeRO-1/2/3 (every rank writes its partitions of the weights, the fp32 master weights and
  optimizer state, :mod:`~hf_resumable.integrations._deepspeed`); ZeRO-Offload, FSDP1 hybrid sharding and
  Megatron-LM are refused with :class:`~hf_resumable.errors.UnsupportedEngineError` when the accelerator is
  built (DeepSpeed's other optimizers when prepared), before any training step.

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
import inspect
import logging
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping
from itertools import islice
from pathlib import Path
from typing import Any

import accelerate
import torch
from accelerate import Accelerator
from accelerate.data_loader import DataLoaderDispatcher, DataLoaderShard, DataLoaderStateMixin
from accelerate.scheduler import AcceleratedScheduler
from accelerate.state import GradientState
from accelerate.utils import DistributedType

from .. import trace
from ..checkpoint import (
    LoadedCheckpoint,
    OpenedCheckpoint,
    VerifyReport,
    apply_retention,
    list_checkpoints,
    open_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from ..checkpoint._model_files import has_model_weights
from ..checkpoint._writer import save_refusal, stock_accelerate_files
from ..checkpoint.api import background_saver
from ..constants import CHECKPOINT_DIR_RE, CHECKPOINT_PREFIX, MANIFEST_FILE, OPTIMIZER_INDEX_FILE
from ..data import (
    DATA_KIND,
    ResumableDataLoader,
    SeededIterableDataset,
    build_map_dataloader,
    build_stream_dataloader,
    split_stream_for_rank,
)
from ..data._position import LoaderPosition
from ..distributed import all_gather_json, broadcast_json
from ..errors import (
    CheckpointExistsError,
    ConfigDriftError,
    IncompleteCheckpointError,
    InexactResumeError,
    UnsupportedEngineError,
)
from ..format.rng import restore_rng_state
from ..locations import is_remote, open_uploader, resolve_resume_path
from ..preemption import PreemptionAction, PreemptionHandler, PreemptionProtocol, exit_after_preemption
from ._accelerate_data import (
    ResumableDataLoaderDispatcher,
    ResumableDataLoaderShard,
    StatefulLoaderPosition,
    plan_loader,
    rebuild_prepared_loader,
)
from ._accelerate_elastic import (
    KEY_ELASTIC,
    KEY_SCHEDULER_RATE,
    KeptRateScheduler,
    convert_position,
    elastic_changes,
)
from ._accelerate_loop import (
    AccumulationWindow,
    ElasticBatch,
    HandOuts,
    ResumablePreparedLoader,
    ResumablePreparedStream,
    ResumedLoaders,
)
from ._accelerate_objects import (
    KIND_MODULE,
    SLOT_CORE,
    SLOT_EXTRA,
    Layout,
    encode_optimizer,
    load_optimizer,
    parameter_keys,
    plan_layout,
    require_slots,
)
from ._accelerate_paths import (
    AUTOMATIC_CHECKPOINT_RE,
    CheckpointIterationExistsError,
    CheckpointPathNotFoundError,
    HookFileConflictError,
    automatic_name,
    collect_hook_files,
    hook_file_conflicts,
    next_iteration,
)
from ._accelerate_state import StepCounts, StepHook, state_fingerprint
from ._core import (
    DEFAULT,
    AfterCommit,
    ResumeOptions,
    changed_settings,
    check_drift,
    check_upstream,
    inexact,
    notice_save_in_flight,
)
from ._deepspeed import (
    EXTRA_DEEPSPEED,
    capture_engine_state,
    checkpoint_optimizer,
    deepspeed_engine,
    register_step_hook,
    restore_engine_state,
    saved_engine_state,
    zero_optimizer,
)
from ._elastic import plan_elastic_resume
from ._engines import check_accelerate_options, check_accelerate_state, checkpoint_model, holds_dtensors
from ._fallback import agreed_load, find_agreed_checkpoint, resume_newest
from ._parallelism import KEY_PARALLELISM, accelerate_tp_ready, check_runnable, layout_of

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

# training_state keys (the progress cursor).
PROGRESS_GLOBAL_STEP = "global_step"  # completed optimizer steps (accumulation windows)
PROGRESS_MICRO_STEP = "accelerate_micro_step"  # Accelerator.step, accelerate's own micro-step counter
PROGRESS_OPTIMIZER_STEPS = "optimizer_steps"  # real steps of each prepared optimizer, in preparation order
PROGRESS_ITERATION = "project_iteration"  # ProjectConfiguration.iteration of an automatic checkpoint_<iteration>
# extra keys.
EXTRA_RUN = "accelerate_run"  # the settings a bit-exact resume depends on (see _run_settings)
EXTRA_LAYOUT = "accelerate_layout"  # where each model/optimizer/scheduler went (Layout.to_json)
EXTRA_CUSTOM_OBJECTS = "custom_objects"  # state_dict() of objects passed to register_for_checkpointing
EXTRA_MODELS = "models"  # weights of saved models 1, 2, ... (model 0 is the checkpoint's model)
EXTRA_OPTIMIZERS = "optimizers"  # per optimizer: its name-keyed state, or None when it is the checkpoint's own
EXTRA_SCHEDULERS = "schedulers"  # state_dict() of schedulers 1, 2, ... (scheduler 0 is the checkpoint's own)
# Where save_state() writes (see ResumableAccelerator.save_state).
_NAMING_AUTOMATIC = "automatic"  # ProjectConfiguration(automatic_checkpoint_naming=True): checkpoint_<iteration>
_NAMING_EXPLICIT = "explicit"  # save_state(output_dir)
_NAMING_STEPS = "steps"  # save_state(): checkpoint-<global_step>
DEFAULT_KEEP_LAST = 2  # checkpoint-<step> checkpoints kept when neither keep_last nor total_limit is given
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
            (Kubernetes' ``terminationGracePeriodSeconds``, SLURM's ``--signal=TERM@<seconds>``). With it,
            :meth:`checkpoint_if_preempted` saves the step the signal lands in (in the background with
            ``save_async``) and returns `False` while another step and a final save fit in the time left (see
            :mod:`hf_resumable.preemption`); then it saves and exits as without a notice. A loop that ends first ends
            normally. Without it (the default) the signal's step is saved and the process exits at once.
        push_checkpoints_to (`str`, *optional*): upload each committed checkpoint in the background (queued,
            never skipped, retried) to the Hub (``"user/repo"``, ``"hf://user/repo[@branch][/path]"``) or an
            fsspec store (``"s3://bucket/run"``); retention never deletes a checkpoint whose upload is pending.
        storage_options (`dict`, *optional*): fsspec options for ``s3://`` pushes and ``load_state`` URLs.
        standalone_checkpoints (`bool`, *optional*, defaults to `False`): store the first model's frozen parameters
            (a PEFT base, a frozen embedding) in every checkpoint too; by default they are recorded, not stored, and
            checked against the model by ``load_state`` (see :func:`hf_resumable.save_checkpoint`).
        elastic (`bool`, *optional*, defaults to `False`): ``load_state`` may continue a run saved by another
            number of processes: the checkpoint's global batch (per-device batch x ``gradient_accumulation_steps``
            x world size) is kept by changing ``gradient_accumulation_steps`` (logged once, old -> new; a world size
            that does not divide it raises ``ElasticWorldSizeError`` listing those that do), loaders from
            :meth:`prepare_resumable_dataloader` (map-style or a ``datasets`` stream) give every optimizer step the
            same samples at any world size (the epoch's last, shorter step too, a rank without samples in it
            training a padding micro-batch of weight zero; a stream is read whole by every process, which keeps its
            chunks of each step), batches and the dropout masks of micro-batches are keyed by the global
            micro-batch, not the rank (through :meth:`accumulation_windows` or a loop over the loader itself), and
            prepared schedulers keep the first launch's stepping rate. With ``backward(loss_sum,
            num_items_in_batch=window.num_items)`` (or a mean loss per micro-batch) losses and weights match the
            uninterrupted run up to float rounding (see docs/accelerate.md).

    These options are validated when the accelerator is built and kept in ``resume_options`` (a frozen
    ``ResumeOptions``, shared with ``ResumableTrainer``).

    Engines: a single process, DDP, FSDP2 and FSDP1 (``FullyShardedDataParallelPlugin``, either
    ``state_dict_type``: every rank saves and loads its own pieces with
    :func:`~hf_resumable.checkpoint.save_checkpoint`, same ``save_state``/``load_state`` contract)
    and DeepSpeed ZeRO-1/2/3 without offload (every rank saves and loads its ZeRO partitions the same way, at the
    same world size).

    Raises:
        UnsupportedEngineError: when built for DeepSpeed ZeRO-Offload (deepspeed is not imported for the
            refusal), Megatron-LM or FSDP1 hybrid sharding, whose state these checkpoints would not hold (see
            :mod:`._engines`);
            ``prepare`` of another DeepSpeed optimizer (``BF16_Optimizer``), or, under FSDP2 or ZeRO, of a second
            model or optimizer. All before any training step.

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
        self._hand_outs = HandOuts()  # elastic: the batch a prepared loader handed out last (backward's weight)
        # Loaders whose position is saved, in preparation order (ResumablePreparedLoader, ResumableDataLoaderShard...).
        self._resumable_loaders: list[LoaderPosition] = []
        self._resume_watch = ResumedLoaders()  # catches a script that skips again what load_state's loaders skipped
        self._preemption = PreemptionHandler().install() if handle_preemption else None
        self._preemption_protocol = PreemptionProtocol(self._preemption, notice=preemption_notice)
        self._notice_checkpoint: Path | None = None  # the checkpoint saved when the preemption notice began
        self._stopped_by_preemption = False  # checkpoint_if_preempted saved and stopped (or exited)
        self._scheduler_rate = self.num_processes  # elastic: scheduler steps per optimizer step (first launch's)
        self._uploader = (open_uploader(push_checkpoints_to, storage_options=storage_options)
                          if push_checkpoints_to is not None and self.is_main_process else None)

    @property
    def keep_last(self) -> int | None:
        """Committed checkpoints kept after each automatic save (``None``: all); see the class arguments."""
        return self._keep()

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
        prepared = self._keep_scheduler_rate(super().prepare(*args, device_placement=device_placement))
        self._checkpoint_optimizers()  # refuses DeepSpeed's other optimizers, before any step
        self._attach_step_hooks()
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

    def _attach_step_hooks(self) -> None:
        for optimizer in self._optimizers:
            if getattr(optimizer, "_hf_resumable_step_hook", None) is None:
                hook = StepHook(self._step_counts)
                register_step_hook(optimizer, hook)  # under ZeRO: the one over its partitions, once per step
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

        Randomness in the collator and the data set is seeded by the batch's position (see
        :mod:`hf_resumable.data`), so it is identical with any ``num_workers`` and after a resume.

        A ``torch.utils.data.IterableDataset`` (a ``datasets`` stream, ``load_dataset(..., streaming=True)``) gets
        the ``ResumableTrainer``'s stream loader (:func:`~hf_resumable.data.build_stream_dataloader`, ``shuffle``
        is the stream's own): split by rank (``split_dataset_by_node``), or with ``elastic=True`` read whole by
        every process, step ``k`` being stream examples ``[k * G, (k + 1) * G)`` (``G`` the global batch) at any
        world size, each example pulled under a seed of its place in the stream (``num_workers=0`` only).
        Its position is the ``StatefulDataLoader`` state (``torchdata`` needed).

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
        global_batch = batch_size * self.gradient_accumulation_steps * world_size
        elastic = self.resume_options.elastic
        if isinstance(dataset, torch.utils.data.IterableDataset):
            source = dataset if elastic else split_stream_for_rank(dataset, rank=rank, world_size=world_size)
            loader = build_stream_dataloader(source, collate_fn=collate_fn, batch_size=batch_size, seed=seed,
                                             drop_last=drop_last, rank=rank,
                                             world_size=world_size, num_workers=num_workers,
                                             persistent_workers=persistent_workers,
                                             multiprocessing_context=multiprocessing_context,
                                             global_batch=global_batch if elastic else None)
            return self.prepare(loader)
        loader = build_map_dataloader(dataset, collate_fn=collate_fn, batch_size=batch_size, seed=seed,
                                      shuffle=shuffle, drop_last=drop_last, rank=rank,
                                      world_size=world_size, num_workers=num_workers,
                                      persistent_workers=persistent_workers,
                                      multiprocessing_context=multiprocessing_context,
                                      global_batch=global_batch if self.resume_options.elastic else None)
        return self.prepare(loader)

    def _data_rank(self) -> tuple[int, int]:
        """This process's data-parallel rank and the number of them: the process index and count, or, under a
        ``ParallelismConfig``, the coordinate over its data dimensions (the ranks of one tensor/context-parallel
        group read the same batches, :class:`~hf_resumable.integrations._parallelism.ParallelLayout`)."""
        layout = layout_of(self.parallelism_config)
        if layout is None or layout.world_size != self.num_processes:
            return self.process_index, self.num_processes
        return layout.data_rank(self.process_index), layout.data_world

    def prepare_data_loader(self, data_loader: torch.utils.data.DataLoader, device_placement: bool | None = None,
                            slice_fn_for_dispatch: Any = None) -> Any:
        """accelerate's ``prepare_data_loader``, returning a loader that resumes exactly.

        * A plain ``DataLoader`` (or torchdata ``StatefulDataLoader``) over a map-style data set is prepared by
          accelerate as usual (sharding, ``even_batches``, ``dispatch_batches``, device placement,
          ``use_stateful_dataloader``), then rebuilt as a :class:`ResumableDataLoaderShard` (or
          :class:`ResumableDataLoaderDispatcher`): the same class for ``isinstance``, the same batches per
          process, plus a saved position (``load_state`` continues mid-epoch without fetching the skipped
          batches), an order derived from ``(seed, epoch)`` and per-batch randomness keyed by position (see
          :mod:`hf_resumable.integrations._accelerate_data`).
        * A :class:`~hf_resumable.data.ResumableDataLoader` or a loader of
          :func:`~hf_resumable.data.build_stream_dataloader` (from :meth:`prepare_resumable_dataloader`) is
          wrapped without re-sharding.
        * Any other loader (e.g. over an ``IterableDataset``) gets accelerate's treatment, and a WARNING says
          that its position is not saved.

        Raises:
            ValueError: if a :class:`ResumableDataLoader` (or a stream loader of the elastic layout) was built for
                another rank or world size.
        """
        if isinstance(data_loader, ResumableDataLoader) or isinstance(getattr(data_loader, "dataset", None),
                                                                      SeededIterableDataset):
            return self._prepare_resumable_loader(data_loader, device_placement)
        if getattr(data_loader, "_is_accelerate_prepared", False) or any(data_loader is loader
                                                                         for loader in self._resumable_loaders):
            return super().prepare_data_loader(data_loader, device_placement=device_placement,
                                               slice_fn_for_dispatch=slice_fn_for_dispatch)
        plan = plan_loader(data_loader)
        # Drawn on every process (the same generator stream as without hf_resumable), process 0's value is used.
        seed = broadcast_json(int(torch.empty((), dtype=torch.int64).random_().item())) if plan.resumable else None
        prepared = super().prepare_data_loader(data_loader, device_placement=device_placement,
                                               slice_fn_for_dispatch=slice_fn_for_dispatch)
        rank, world_size = self._data_rank()
        rebuilt = (rebuild_prepared_loader(prepared, seed=seed, process_index=rank,
                                           num_processes=world_size) if plan.resumable else prepared)
        if rebuilt is prepared and getattr(prepared, "use_stateful_dataloader", False):
            logger.warning("%s is prepared by accelerate only (%s); its torchdata StatefulDataLoader state is saved "
                           "and restored as stock accelerate does, so it resumes mid-epoch, but randomness inside "
                           "its pipeline is not keyed by position.", type(data_loader).__name__, plan.note)
            self._resumable_loaders.append(StatefulLoaderPosition(prepared))
            return prepared
        if rebuilt is prepared:
            logger.warning("%s is prepared by accelerate only: its position is not saved and a resumed run restarts "
                           "it from its beginning (%s).", type(data_loader).__name__,
                           plan.note or f"accelerate returned a {type(prepared).__name__}")
            return prepared
        self._dataloaders = [rebuilt if loader is prepared else loader for loader in self._dataloaders]
        self._resumable_loaders.append(rebuilt)
        if plan.note is not None:
            logger.warning("%s: %s.", type(data_loader).__name__, plan.note)
        return rebuilt

    def _prepare_resumable_loader(self, data_loader: Any, device_placement: bool | None) -> Any:
        """Wrap a loader of :func:`~hf_resumable.data.build_map_dataloader` or
        :func:`~hf_resumable.data.build_stream_dataloader` (no re-sharding)."""
        stream = not isinstance(data_loader, ResumableDataLoader)
        layout = data_loader.dataset if stream else data_loader.batch_sampler
        # a stream outside the elastic layout was split by rank beforehand: its world size is not its own
        rank, ranks = self._data_rank()
        world_size = ranks if stream and layout.global_batch is None else layout.world_size
        if (layout.rank, world_size) != (rank, ranks):
            raise ValueError(
                f"The {type(data_loader).__name__} was built for rank {layout.rank} of {layout.world_size}, but this "
                f"process is data-parallel rank {rank} of {ranks}. Build it with the data-parallel rank and world "
                "size (accelerator.process_index and accelerator.num_processes without a ParallelismConfig), or use "
                "prepare_resumable_dataloader().")
        place = self.device_placement if device_placement is None else device_placement
        wrapper = ResumablePreparedStream if stream else ResumablePreparedLoader
        elastic = self.resume_options.elastic and layout.global_batch is not None
        prepared = wrapper(data_loader, gradient_state=self.gradient_state, device=self.device if place else None,
                           hand_outs=self._hand_outs if elastic else None)
        self._resumable_loaders.append(prepared)
        return prepared

    def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Any:
        """accelerate's ``skip_first_batches``, aware of positions restored by ``load_state``.

        For a loader prepared here, the loader itself is returned, positioned: after ``load_state`` restored
        it at batch ``n`` of its epoch, ``skip_first_batches(loader, n)`` (what accelerate's checkpointing
        examples compute from the checkpoint name) continues there, never skipping twice; on a loader without
        a restored position the next pass starts at ``num_batches`` (as accelerate's skipping loader does,
        without fetching the skipped batches), and later passes are whole epochs. The same call again in a later
        epoch of a resumed run (scripts that skip in every epoch after a resume) skips nothing there, with a WARNING:
        the batches it names were skipped in the epoch the run resumed in (see
        :class:`~hf_resumable.integrations._accelerate_loop.ResumedLoaders`).

        Raises:
            ValueError: ``num_batches`` differs from the position ``load_state`` restored (the script's count
                and the checkpoint disagree), or the loader is being iterated.
        """
        if self._resume_watch.is_repeated_skip(dataloader, num_batches):
            self._resume_watch.warn_repeated_skip(dataloader, num_batches)
            return dataloader
        if isinstance(dataloader, (ResumablePreparedLoader, ResumablePreparedStream)):
            if num_batches != dataloader.consumed:
                raise ValueError("load_state() already restored this loader's position (epoch "
                                 f"{dataloader.epoch}, batch {dataloader.consumed}); do not skip batches yourself.")
            return dataloader
        if isinstance(dataloader, (ResumableDataLoaderShard, ResumableDataLoaderDispatcher)):
            if dataloader.is_iterating:
                raise ValueError("skip_first_batches() was called on a loader that is being iterated.")
            restored = dataloader.restored_batches
            if restored and num_batches != restored:
                raise ValueError(f"load_state() restored this loader at batch {restored} of epoch "
                                 f"{dataloader.iteration}, but skip_first_batches() was asked to skip {num_batches}: "
                                 "the script's step count and the checkpoint disagree. Skip exactly the restored "
                                 "number (or do not skip: the loader already continues there).")
            if not restored:
                dataloader.skip(num_batches)
            return dataloader
        return super().skip_first_batches(dataloader, num_batches)

    def prepare_scheduler(self, scheduler: Any) -> Any:
        """accelerate's ``prepare_scheduler``; with ``elastic=True`` the scheduler keeps the first launch's number of
        steps per optimizer step (:class:`~._accelerate_elastic.KeptRateScheduler`)."""
        return self._keep_scheduler_rate(super().prepare_scheduler(scheduler))

    def _keep_scheduler_rate(self, prepared: Any) -> Any:
        """``prepared`` (one object or a tuple) with, under ``elastic=True``, every scheduler accelerate prepared
        (``prepare_scheduler``, or ``prepare`` under DeepSpeed with a torch scheduler) made a
        :class:`~._accelerate_elastic.KeptRateScheduler`."""
        if not self.resume_options.elastic:
            return prepared
        kept = {id(item): KeptRateScheduler(item, rate=self._scheduler_rate) for item in self._schedulers
                if type(item) is AcceleratedScheduler}  # not DeepSpeed's own schedules (its engine steps them)
        self._schedulers = [kept.get(id(item), item) for item in self._schedulers]
        if isinstance(prepared, tuple):
            return tuple(kept.get(id(item), item) for item in prepared)
        return kept.get(id(prepared), prepared)

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
        elastic = getattr(dataloader, "hand_outs", None) is not None  # a prepared loader of the elastic layout
        while True:
            if elastic:
                batches, handed = self._elastic_window(dataloader, iterator)
            else:
                batches, handed = list(islice(iterator, self.gradient_accumulation_steps)), None
            if not batches:
                return
            counted = batches if handed is None else [b for b, h in zip(batches, handed) if not h.is_padding]
            num_items = self._count_window_items(counted, count_items) if count_items is not None else None
            self._window = AccumulationWindow(batches, num_items, elastic=handed)
            try:
                yield self._window
            finally:
                self._window = None

    def _elastic_window(self, loader: ResumablePreparedLoader | ResumablePreparedStream,
                        iterator: Iterator[Any]) -> tuple[list[Any], list[ElasticBatch]]:
        """A window's batches and, per batch, how the loader handed it out (its model randomness key and weight)."""
        batches, handed = [], []
        for batch in islice(iterator, self.gradient_accumulation_steps):
            batches.append(batch)
            handed.append(loader.last_batch)  # read right after the loader handed it out
        return batches, handed

    def _count_window_items(self, batches: list[Any], count_items: Callable[[Any], int | torch.Tensor]) -> int:
        local = sum(int(count_items(batch)) for batch in batches)
        if self.num_processes == 1:
            return local
        total = self.reduce(torch.tensor([local], dtype=torch.int64, device=self.device), reduction="sum")
        return int(total.item())

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
          :meth:`accumulation_windows`), ``loss`` must be the **sum** of the per-item losses of this
          micro-batch (``reduction="sum"``); it is scaled by ``num_processes / num_items_in_batch``, so
          the accumulated, process-averaged gradient is the gradient of the full window's mean.
        * Without it, inside an :class:`AccumulationWindow`, the mean loss is divided by the window's
          actual length (accelerate divides by ``gradient_accumulation_steps``, also for a short last window).
        * ``elastic=True``, a micro-batch of a loader from :meth:`prepare_resumable_dataloader`: a padding
          micro-batch's loss is scaled to zero and, in the epoch's last, shorter step, a mean loss weighs the
          micro-batch's share of the step's samples. The micro-batch is the window's current one inside an
          :class:`AccumulationWindow`; otherwise (a loop that iterates the loader itself) the batch an elastic
          loader handed out last: of several elastic loaders, the one that handed out a batch most recently, while
          its pass is under way.
        * Otherwise it behaves as ``accelerate.Accelerator.backward``.

        Under DeepSpeed, whose engine divides the loss by its gradient accumulation itself, ``num_items_in_batch``
        scales ``loss`` by ``num_processes * gradient_accumulation_steps / num_items_in_batch`` before the engine's
        backward, which comes to the same gradient.

        The first backward after ``load_state`` checks that the loop trains what it draws from the restored loaders
        (:class:`~hf_resumable.integrations._accelerate_loop.ResumedLoaders`).

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
        batch, micro_batches = self._trained_micro_batch()
        if num_items_in_batch is not None:
            count = int(num_items_in_batch)
            if count <= 0:
                raise ValueError(f"num_items_in_batch must be > 0, got {count} (a window without any item).")
            return loss * (0.0 if batch is not None and batch.is_padding else self.num_processes / count)
        scale = None if batch is None else batch.loss_scale(num_processes=self.num_processes,
                                                            micro_batches=micro_batches)
        return loss / micro_batches if scale is None else loss * scale

    def _trained_micro_batch(self) -> tuple[ElasticBatch | None, int]:
        """The elastic batch being trained on (``None``: not the elastic layout) and the micro-batches per rank of
        its step: the active window's, else the batch an elastic loader handed out last (a loop iterating the loader
        itself) in a step of ``gradient_accumulation_steps`` (its last micro-batch syncs: see
        :class:`ResumablePreparedLoader`)."""
        if self._window is not None:
            slot = self._window.slot
            return self._window.current(), self.gradient_accumulation_steps if slot is None else slot[1]
        return self._hand_outs.batch, self.gradient_accumulation_steps

    # ---------------------------------------------------------------- save

    def register_save_state_pre_hook(self, hook: Callable[..., None]) -> Any:
        """accelerate's hook: ``hook(models, weights, output_dir)`` runs in :meth:`save_state` before any saving.

        Exactly as in accelerate, ``models`` is the list of prepared models, ``weights`` their state dicts (a hook
        may remove entries, e.g. to save LoRA adapters itself, or replace them), and ``output_dir`` a directory
        to write files into. Here that directory is a private staging directory: whatever the hook writes is
        committed with the checkpoint, hashed in its manifest, and appears at the same relative path inside
        the committed checkpoint directory (where the ``load_state`` pre-hook finds it). Only the main process's
        files are kept (as with a shared directory; guard writes with ``accelerator.is_main_process``).

        Returns:
            `torch.utils.hooks.RemovableHandle`
        """
        return super().register_save_state_pre_hook(hook)

    def register_load_state_pre_hook(self, hook: Callable[..., None]) -> Any:
        """accelerate's hook: ``hook(models, input_dir)`` runs in :meth:`load_state` before anything is loaded.

        ``models`` is a new list of the prepared models: a model the hook removes from it is not loaded (the
        hook loaded it), exactly as in accelerate. ``input_dir`` is the committed checkpoint directory.

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
        self._warn_save_options(safe_serialization, save_model_func_kwargs)
        if not self.sync_gradients:
            raise InexactResumeError(
                f"save_state() was called inside an accumulation window (micro-step {self.step} of "
                f"{self.gradient_accumulation_steps}); checkpoints land on optimizer-step boundaries only. "
                "Call it after the window's optimizer step.")
        # the previous save has committed (its retention and upload done): it may be this step
        self._commits.settle(removals=False)
        mode, target = self._save_target(output_dir)
        # Only checkpoint-<step> saves can meet a checkpoint of this very state (the other namings always write).
        fingerprint = self._fingerprint(target) if mode == _NAMING_STEPS else None
        # every rank's own state unchanged (its pieces, its RNG), and the checkpoint intact
        unchanged = all(all_gather_json(fingerprint is not None and self._committed.get(target) == fingerprint))
        on_disk = self.is_main_process and unchanged and verify_checkpoint(target, full=False).ok
        if broadcast_json(on_disk):
            if self.is_main_process:
                logger.info("%s already holds exactly the current state (step %d); not writing it again.", target,
                            self.global_step)
            return target
        self._check_target(mode, target)
        if target.resolve() in self._pending_uploads():
            self._uploader.wait()  # never replace a checkpoint while it is being uploaded
        blocking = not self.resume_options.save_async if blocking is None else blocking
        # Retention runs right after save_state, as accelerate's total_limit does (upstream's tests count the
        # entries): it may then delete the previous checkpoint, so this one's files are fsynced before its commit.
        durability = "immediate" if self._retains(mode) else "deferred"
        save_checkpoint(target, **self._capture(), step=self.global_step, overwrite=mode != _NAMING_AUTOMATIC,
             blocking=blocking, standalone=self.resume_options.standalone_checkpoints, durability=durability)
        if fingerprint is not None:
            self._committed = {target: fingerprint}  # steps only grow: only the newest can be met again
        if mode == _NAMING_AUTOMATIC:
            self.project_configuration.iteration += 1
        self._commits.attach(None if blocking else background_saver().future, lambda: self._after_commit(mode, target))
        if self._uploader is not None:
            self._commits.settle()  # uploads start as soon as the save returns (only committed checkpoints upload)
        if self.is_main_process:
            logger.info("Saved state at step %d to %s", self.global_step, target)
        return target

    def _warn_save_options(self, safe_serialization: bool, options: Mapping[str, Any]) -> None:
        if not safe_serialization and not self._warned.get("safe_serialization"):
            self._warned["safe_serialization"] = True
            logger.warning("save_state(safe_serialization=False) asks for pickle files; hf_resumable never writes "
                           "pickle, so the checkpoint is written as safetensors and JSON anyway.")
        if options and not self._warned.get("save_options"):
            self._warned["save_options"] = True
            logger.warning("save_state(%s): these options configure DeepSpeed's own save_checkpoint, which "
                           "ResumableAccelerator does not use; ignored.", ", ".join(sorted(options)))

    def _save_target(self, output_dir: str | os.PathLike | None) -> tuple[str, Path]:
        if self.project_configuration.automatic_checkpoint_naming:
            return _NAMING_AUTOMATIC, self.checkpoint_dir / automatic_name(self.save_iteration)
        if output_dir is not None:
            return _NAMING_EXPLICIT, Path(output_dir)
        return _NAMING_STEPS, self.checkpoint_dir / f"{CHECKPOINT_PREFIX}{self.global_step}"

    def _check_target(self, mode: str, target: Path) -> None:
        """Refuse a target on every process alike (the main process looks), before any collective of the save."""
        automatic = mode == _NAMING_AUTOMATIC  # accelerate never replaces a checkpoint_<iteration>
        reason = broadcast_json(save_refusal(target, overwrite=not automatic) if self.is_main_process else None)
        if reason is not None and automatic:
            raise CheckpointIterationExistsError(
                f"Checkpoint directory {target} ({self.save_iteration}) already exists. Set "
                "accelerator.project_configuration.iteration to the iteration to continue with, or resume with "
                "load_state(), which continues after the newest checkpoint_<i>.")
        if reason is not None:
            raise CheckpointExistsError(reason)

    def _keep(self) -> int | None:
        """Checkpoints kept after a commit: ``keep_last`` if given, else ``total_limit``, else the naming's default."""
        if self.resume_options.keep_last is not DEFAULT:
            return self.resume_options.keep_last
        if self.project_configuration.total_limit is not None:
            return self.project_configuration.total_limit
        return None if self.project_configuration.automatic_checkpoint_naming else DEFAULT_KEEP_LAST

    def _retains(self, mode: str) -> bool:
        """Whether a save of this naming ``mode`` is followed by retention."""
        return mode != _NAMING_EXPLICIT and self._keep() is not None

    def _pending_uploads(self) -> set[Path]:
        """Local checkpoints whose upload is not confirmed yet (resolved paths)."""
        return {Path(path).resolve() for path in self._uploader.pending()} if self._uploader is not None else set()

    def _after_commit(self, mode: str, target: Path) -> None:
        """What follows a commit: the upload, then retention of the automatic namings (never before the commit)."""
        if self._uploader is not None:
            self._uploader.submit(target)
        keep = self._keep()
        if not self._retains(mode) or not self.is_main_process:
            return
        pattern = AUTOMATIC_CHECKPOINT_RE if mode == _NAMING_AUTOMATIC else CHECKPOINT_DIR_RE
        # In the foreground, as accelerate's own total_limit: upstream's tests count the entries of the directory.
        apply_retention(self.checkpoint_dir, keep_last=keep, pattern=pattern, protect=self._pending_uploads())

    def _weights(self) -> list[Any]:
        """accelerate's ``weights`` list for the save hooks: each prepared model's state dict (not unwrapped)."""
        return [self.get_state_dict(model, unwrap=False) for model in self._models]

    def _capture(self) -> dict[str, Any]:
        """Everything :func:`save_checkpoint` takes, after running the ``save_state`` pre-hooks."""
        originals = self._weights() if self._save_model_state_pre_hook else [None] * len(self._models)
        weights = list(originals)
        hook_files = self._run_save_hooks(weights)
        unwrapped = [checkpoint_model(model, self.unwrap_model(model)) for model in self._models]  # FSDP1: its root
        optimizers = self._checkpoint_optimizers()
        if not self._save_model_state_pre_hook:
            weights = originals = list(unwrapped)  # no hook could have changed them
        layout = plan_layout(weights=weights, originals=originals, models=unwrapped, optimizers=optimizers,
                             schedulers=len(self._schedulers), custom_objects=len(self._custom_objects),
                             hook_files=list(hook_files), hooks_registered=bool(self._save_model_state_pre_hook))
        model_slot = bool(layout.models)
        conflicts = hook_file_conflicts(hook_files, model_slot=model_slot,
                                        optimizer_slot=SLOT_CORE in layout.optimizers)
        if conflicts:
            raise HookFileConflictError(f"save_state pre-hook(s) wrote {conflicts}, which the hf_resumable checkpoint "
                                        "writes itself; write them under another name or in a subdirectory.")

        def slot_state(index: int) -> Any:
            if layout.models[index] == KIND_MODULE:  # model ``index``'s own weights, unchanged by the hooks
                return unwrapped[index] if index == 0 else unwrapped[index].state_dict()
            return weights[index]  # a state dict a hook put there, saved (and loaded) as accelerate would

        engine = self._deepspeed_engine()
        extra = {EXTRA_RUN: self._run_settings(), EXTRA_LAYOUT: layout.to_json(),
                 **({EXTRA_DEEPSPEED: capture_engine_state(engine, optimizers[:1])} if engine is not None else {}),
                 EXTRA_CUSTOM_OBJECTS: [obj.state_dict() for obj in self._custom_objects],
                 EXTRA_MODELS: [slot_state(i) for i in range(1, len(layout.models))],
                 EXTRA_OPTIMIZERS: [None if slot == SLOT_CORE else
                                    encode_optimizer(opt, parameter_keys(unwrapped, opt))
                                    for slot, opt in zip(layout.optimizers, optimizers)],
                 EXTRA_SCHEDULERS: [scheduler.state_dict() for scheduler in self._schedulers[1:]]}
        return {
            "model": slot_state(0) if model_slot else None,
            "optimizer": optimizers[0] if layout.optimizers[:1] == [SLOT_CORE] else None,
            "scheduler": getattr(self._schedulers[0], "scheduler", self._schedulers[0]) if self._schedulers else None,
            "scaler": self.scaler,
            "training_state": {PROGRESS_GLOBAL_STEP: self.global_step, PROGRESS_MICRO_STEP: self.step,
                               PROGRESS_OPTIMIZER_STEPS: self._optimizer_step_counts(),
                               **({PROGRESS_ITERATION: self.save_iteration}
                                  if self.project_configuration.automatic_checkpoint_naming else {})},
            "extra": extra,
            "extra_files": hook_files,
            "data_state": {DATA_LOADERS: [loader.position() for loader in self._resumable_loaders]},
        }

    def _run_save_hooks(self, weights: list[Any]) -> dict[str, bytes]:
        """Run the ``save_state`` pre-hooks with a staging directory; return the files they wrote (main process)."""
        if not self._save_model_state_pre_hook:
            return {}
        with tempfile.TemporaryDirectory(prefix="hf_resumable-save-hooks-") as staging:
            for hook in self._save_model_state_pre_hook.values():
                hook(self._models, weights, staging)
            files = collect_hook_files(Path(staging))
        if files and not self.is_main_process:
            logger.warning("save_state pre-hooks wrote %s on process %d; only the main process's files are saved.",
                           sorted(files)[:5], self.process_index)
        return files if self.is_main_process else {}

    def _fingerprint(self, target: Path) -> str:
        """Digest of everything :meth:`save_state` writes (see :func:`state_fingerprint`)."""
        small = {"target": str(target), "global_step": self.global_step, "micro_step": self.step,
                 "optimizer_steps": self._optimizer_step_counts(),
                 "schedulers": [scheduler.state_dict() for scheduler in self._schedulers],
                 "scaler": self.scaler.state_dict() if self.scaler is not None else None,
                 "custom_objects": [obj.state_dict() for obj in self._custom_objects],
                 "loaders": [loader.position() for loader in self._resumable_loaders],
                 "hooks": [id(hook) for hook in self._save_model_state_pre_hook.values()]}
        engine = self._deepspeed_engine()
        small["engine"] = capture_engine_state(engine, []) if engine is not None else None
        optimizers = self._checkpoint_optimizers()
        return state_fingerprint(models=self._models, optimizers=optimizers, small_state=small)

    def _run_settings(self) -> dict[str, Any]:
        settings = {"world_size": self.num_processes, "gradient_accumulation_steps": self.gradient_accumulation_steps,
                    "loaders": [loader.settings() for loader in self._resumable_loaders],
                    KEY_ELASTIC: self.resume_options.elastic}
        layout = layout_of(self.parallelism_config)
        if layout is not None:  # another N-D layout on resume is drift, named by both layouts
            settings[KEY_PARALLELISM] = layout.describe()
        if self.resume_options.elastic:
            settings[KEY_SCHEDULER_RATE] = self._scheduler_rate
        return settings

    # ---------------------------------------------------------------- load

    def load_state(self, input_dir: str | os.PathLike | None = None, load_kwargs: dict | None = None,
                   **load_model_func_kwargs: Any) -> LoadedCheckpoint | None:
        """Resume from ``input_dir``, or from the newest checkpoint that *verifies*.

        Collective: call it on every process, after ``prepare``. Runs the ``load_state`` pre-hooks, then
        restores models, optimizers, schedulers, scaler, counters (:attr:`global_step`, accelerate's ``step``,
        ``ProjectConfiguration.iteration``), the loaders' epoch and position, registered objects, and (last) this
        process's RNG.

        Without ``input_dir``: the newest valid ``checkpoint_<i>`` (automatic naming) or ``checkpoint-<step>``
        under :attr:`checkpoint_dir`; partial or corrupt ones are skipped with a WARNING. One that fails its
        hashes while it is loaded, on any process, is moved aside (``corrupt-<name>``, kept) and the one before it
        loaded into the same objects, on every process alike. ``input_dir`` may also be
        ``hf://user/repo[@rev][/path]`` or an fsspec URL (downloaded and hash-checked first).

        After a resume with automatic naming, ``ProjectConfiguration.iteration`` continues after the loaded and
        every existing ``checkpoint_<i>``, so the next save never collides (accelerate leaves that to the user).

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
        strict = self._load_options(load_kwargs, load_model_func_kwargs)
        if input_dir is None:  # the newest that verifies; one that fails while it is loaded: the one before it
            pattern = (AUTOMATIC_CHECKPOINT_RE if self.project_configuration.automatic_checkpoint_naming
                       else CHECKPOINT_DIR_RE)
            first = find_agreed_checkpoint(self.checkpoint_dir, pattern=pattern)
            loaded = resume_newest(self.checkpoint_dir, lambda report: self._load_from(Path(report.path), strict,
                                                                                      verified=report),
                                   pattern=pattern, owner="ResumableAccelerator", first=first)
            if loaded is None and self.is_main_process:
                logger.info("No valid checkpoint under %s; starting from scratch.", self.checkpoint_dir)
            return loaded
        return self._load_from(self._resolve_checkpoint(input_dir), strict)

    def _load_from(self, path: Path, strict: bool, verified: VerifyReport | None = None) -> LoadedCheckpoint:
        """``load_state`` of one checkpoint; a failed hash on any process raises ``ResumeLoadError`` on all."""
        with agreed_load(path):
            return self._fill_from(path, strict, verified)

    def _fill_from(self, path: Path, strict: bool, verified: VerifyReport | None) -> LoadedCheckpoint:
        # 1. Verify and decode once; compare the saved settings with ours before any object is touched.
        opened = self._open_checkpoint(path, verified)
        kept = self._plan_elastic(path, opened) if self.resume_options.elastic else False
        self._check_drift(path, opened.manifest.world_size, opened.extra.get(EXTRA_RUN), elastic_kept=kept)
        layout = self._layout_of(opened)
        # 2. accelerate's load hooks: a model they remove from the list is not loaded here.
        models = list(self._models)
        for hook in self._load_model_state_pre_hook.values():
            hook(models, str(path))
        require_slots(layout, models_to_fill=len(models), optimizers=len(self._optimizers),
                      schedulers=len(self._schedulers), where=str(path))
        engine = self._deepspeed_engine()
        engine_state = saved_engine_state(opened.extra, where=path) if engine is not None else None
        # 3. Fill the objects (RNG excluded: it goes last).
        core_model, core_optimizer = self._core_load_targets(layout, models)
        scheduler = getattr(self._schedulers[0], "scheduler", self._schedulers[0]) if self._schedulers else None
        # FSDP2 / ZeRO: every rank reads the slices of the pieces it holds
        loaded = opened.load_into(model=core_model, optimizer=core_optimizer, scheduler=scheduler, scaler=self.scaler,
                                  strict=strict)
        self._restore_extra_objects(path, layout, loaded.extra, models, strict=strict)
        if engine is not None:
            restore_engine_state(engine, [core_optimizer], engine_state)
        # 4. Counters and data positions, 5. registered objects, 6. RNG.
        self._restore_counters(path, loaded, elastic_kept=kept)
        self._restore_loaders(path, loaded.data_state, loaded.manifest.world_size)
        self._restore_custom_objects(path, loaded.extra.get(EXTRA_CUSTOM_OBJECTS) or [])
        self._restore_rng(path, loaded)  # last: restoring anything else may draw random numbers
        if self.is_main_process:
            logger.info("Resumed from %s at step %d", path, self.global_step)
        return loaded

    def _load_options(self, load_kwargs: dict | None, options: dict[str, Any]) -> bool:
        options = dict(options)
        map_location = options.pop("map_location", None)
        if map_location not in (None, "cpu", "on_device"):
            raise TypeError("Unsupported optimizer map location passed, please choose one of `None`, `'cpu'`, or "
                            f"`'on_device'` (got {map_location!r}).")
        strict = bool(options.pop("strict", True))
        options.pop("device", None)  # safetensors' load_model option: tensors go where the parameters are
        if options:
            raise TypeError(f"load_state() got unsupported options {sorted(options)}; ResumableAccelerator accepts "
                            "strict= and map_location= (and load_kwargs, ignored).")
        if load_kwargs and not self._warned.get("load_kwargs"):
            self._warned["load_kwargs"] = True
            logger.warning("load_state(load_kwargs=%s): these are torch.load options; hf_resumable never unpickles, "
                           "so they are ignored.", sorted(load_kwargs))
        return strict

    def _open_checkpoint(self, path: Path, verified: VerifyReport | None = None) -> OpenedCheckpoint:
        """The one place the resume path reads a checkpoint: verified and decoded once, no live object touched."""
        return open_checkpoint(path, verified=verified, allow_inexact_resume=self.resume_options.allow_inexact_resume,
                               counters=(PROGRESS_MICRO_STEP, PROGRESS_ITERATION),
                               reshard=self.resume_options.elastic)

    def _layout_of(self, peek: LoadedCheckpoint) -> Layout:
        record = peek.extra.get(EXTRA_LAYOUT)
        if record is not None:
            return Layout.from_json(record)
        files = peek.manifest.files
        return Layout.legacy(has_model=has_model_weights(files), has_optimizer=OPTIMIZER_INDEX_FILE in files,
                             has_scheduler=bool(self._schedulers),
                             custom_objects=len(peek.extra.get(EXTRA_CUSTOM_OBJECTS) or []))

    def _core_load_targets(self, layout: Layout, models: list[Any]) -> tuple[Any, Any]:
        """What the checkpoint's own model and optimizer slots are loaded into."""
        model = None
        if layout.models and models:
            model = checkpoint_model(models[0], self.unwrap_model(models[0])) if layout.models[0] == KIND_MODULE \
                else models[0]
        optimizer = None
        if layout.optimizers[:1] == [SLOT_CORE] and self._optimizers:
            optimizer = self._checkpoint_optimizers()[0]
            if model is None:
                # The optimizer's state is keyed by model 0's parameter names, so model 0 is loaded with it.
                logger.warning("A load_state pre-hook removed model 0, but optimizer 0's saved state is keyed by its "
                               "parameter names: model 0's weights are loaded from the checkpoint as well.")
                model = checkpoint_model(self._models[0], self.unwrap_model(self._models[0]))
        return model, optimizer

    def _restore_extra_objects(self, path: Path, layout: Layout, extra: Mapping[str, Any], models: list[Any], *,
                               strict: bool) -> None:
        saved_models = extra.get(EXTRA_MODELS) or []
        for index, model in enumerate(models[1:], start=1):
            target = self.unwrap_model(model) if layout.models[index] == KIND_MODULE else model
            target.load_state_dict(saved_models[index - 1], strict=strict)
        unwrapped = [self.unwrap_model(model) for model in self._models]
        saved_optimizers = extra.get(EXTRA_OPTIMIZERS) or []
        for index, (slot, optimizer) in enumerate(zip(layout.optimizers, self._optimizers)):
            if slot == SLOT_EXTRA:
                inner = getattr(optimizer, "optimizer", optimizer)
                load_optimizer(inner, parameter_keys(unwrapped, inner), saved_optimizers[index],
                               where=f"{path} (optimizer {index})")
        for scheduler, state in zip(self._schedulers[1:], extra.get(EXTRA_SCHEDULERS) or []):
            scheduler.load_state_dict(state)

    def _restore_counters(self, path: Path, loaded: LoadedCheckpoint, *, elastic_kept: bool = False) -> None:
        progress = loaded.training_state
        self.global_step = int(progress.get(PROGRESS_GLOBAL_STEP, loaded.step or 0))
        # A checkpoint is on an optimizer-step boundary: accelerate's micro-step count (it syncs where the count is a
        # multiple of the accumulation) is a multiple of the saved accumulation, not of the one an elastic resume
        # changed it to, so it starts over there (a loop iterating the loader in accumulate() steps on time).
        self.step = 0 if elastic_kept else int(progress.get(PROGRESS_MICRO_STEP, 0))
        self._set_optimizer_step_counts(progress.get(PROGRESS_OPTIMIZER_STEPS)
                                        or [self.global_step] * len(self._optimizers))
        if self.project_configuration.automatic_checkpoint_naming:
            saved = progress.get(PROGRESS_ITERATION)
            match = AUTOMATIC_CHECKPOINT_RE.match(path.name)
            loaded_iteration = saved if saved is not None else (int(match.group(1)) if match else None)
            existing = broadcast_json([number for number, _ in list_checkpoints(
                self.checkpoint_dir, pattern=AUTOMATIC_CHECKPOINT_RE)] if self.is_main_process else None)
            self.project_configuration.iteration = next_iteration(self.save_iteration, loaded=loaded_iteration,
                                                                  existing=existing)

    def _resolve_checkpoint(self, input_dir: str | os.PathLike) -> Path:
        """The checkpoint an explicit ``load_state(input_dir)`` loads (without one: :func:`resume_newest`)."""
        if is_remote(input_dir):  # hf://user/repo[@rev][/path] or s3://bucket/run[/checkpoint-N]
            return resolve_resume_path(input_dir, cache_dir=self.checkpoint_dir / ".remote-resume",
                                       storage_options=self.resume_options.storage_options)
        path = Path(os.path.expanduser(os.fspath(input_dir)))
        # The main process looks; every process raises the same error (none is left waiting in a collective).
        problem = broadcast_json(self._describe_missing(path) if self.is_main_process else None)
        if problem is not None:
            kind, message = problem
            raise (CheckpointPathNotFoundError if kind == "missing" else IncompleteCheckpointError)(message)
        return path

    def _describe_missing(self, path: Path) -> tuple[str, str] | None:
        """``(kind, message)`` if ``path`` cannot be loaded (looks at the disk), else ``None``; kind is ``"missing"``
        or ``"foreign"`` (a stock accelerate checkpoint is named as such)."""
        if not path.exists():
            root = self.checkpoint_dir if self._has_root() else "it"
            return "missing", (f"{path} does not exist. Check the path, or call load_state() without an argument to "
                               f"resume from the newest valid checkpoint under {root}.")
        if not path.is_dir():
            return "missing", f"{path} is a file, not a checkpoint directory."
        stock = stock_accelerate_files(path)
        if stock and not (path / MANIFEST_FILE).exists():
            return "foreign", (
                f"{path} was written by stock accelerate ({', '.join(stock[:4])}): its optimizer, scheduler, RNG and "
                "registered-object states are pickle files, which hf_resumable never loads (unpickling runs code). "
                "Resume it once with accelerate's own Accelerator and save it with ResumableAccelerator, or start "
                "from its model weights.")
        return None

    def _has_root(self) -> bool:
        return self.resume_options.checkpoint_dir is not None or self.project_dir is not None

    def _inexact(self, message: str, error: type[InexactResumeError] = InexactResumeError) -> None:
        inexact(message, allow=self.resume_options.allow_inexact_resume, owner="ResumableAccelerator", error=error)

    def _plan_elastic(self, path: Path, opened: OpenedCheckpoint) -> bool:
        """``elastic=True``: keep the first launch's scheduler rate; at another world size, keep the checkpoint's
        global batch (gradient accumulation and the loaders' epoch cut). Whether the world size changed.

        Raises:
            ElasticWorldSizeError: the global batch does not divide at this world size.
            ConfigDriftError: a loader that is not from ``prepare_resumable_dataloader`` (its order is per rank;
                a plain ``DataLoader`` over a stream included).
        """
        saved = opened.extra.get(EXTRA_RUN) or {}
        saved_world_size = opened.manifest.world_size
        self._scheduler_rate = int(saved.get(KEY_SCHEDULER_RATE, saved_world_size))
        for scheduler in self._schedulers:
            if isinstance(scheduler, KeptRateScheduler):
                scheduler.rate = self._scheduler_rate
        if saved_world_size == self.num_processes or not saved.get(KEY_ELASTIC):
            return False  # same size, or a checkpoint of another layout (the drift check names it)
        loaders = [loader for loader in self._resumable_loaders
                   if isinstance(loader, (ResumablePreparedLoader, ResumablePreparedStream))]
        if not loaders or len(loaders) != len(self._resumable_loaders):
            raise ConfigDriftError(f"{path} was saved by {saved_world_size} process(es), this run has "
                                   f"{self.num_processes}: elastic=True keeps the sample order only for loaders from "
                                   "prepare_resumable_dataloader(). Build the training loader with it.")
        plan = plan_elastic_resume(saved_world_size=saved_world_size,
                                   saved_accumulation=int(saved["gradient_accumulation_steps"]),
                                   per_device_batch=loaders[0].batch_size, world_size=self.num_processes,
                                   checkpoint=str(path))
        self.gradient_accumulation_steps = plan.gradient_accumulation_steps
        if getattr(self, "deepspeed_engine_wrapped", None) is not None:  # the engine divides the loss by its own
            self.deepspeed_engine_wrapped.engine.set_train_batch_size(plan.global_batch)
        for loader in loaders:
            loader.set_global_batch(plan.global_batch)
        if self.is_main_process:
            logger.info("Elastic resume of %s: %s.", path, plan.describe())
        return True

    def _check_drift(self, path: Path, saved_world_size: int, saved: Mapping[str, Any] | None, *,
                     elastic_kept: bool = False) -> None:
        saved = {**(saved or {}), "world_size": saved_world_size}  # the manifest's count is authoritative
        saved.setdefault(KEY_ELASTIC, False)
        changed = changed_settings(saved, self._run_settings())
        if self.resume_options.elastic:
            changed = elastic_changes(changed, kept=elastic_kept)
        check_drift(changed, checkpoint=str(path),
                    allow=self.resume_options.allow_inexact_resume, option="allow_inexact_resume",
                    owner="ResumableAccelerator")

    def _restore_loaders(self, path: Path, data_state: Mapping[str, Any] | None, saved_world_size: int) -> None:
        if not self._resumable_loaders:
            return
        records = (data_state or {}).get(DATA_LOADERS)
        if self.resume_options.elastic and saved_world_size != self.num_processes:
            # the elastic layout's position is global: rank 0's record, converted (a new rank has none of its own)
            records = broadcast_json(records if self.is_main_process else None)
            # (a stream's record counts the examples read over all ranks: its loader converts it when loaded)
            records = [record if record.get(DATA_KIND) == "stream" else
                       convert_position(record, saved_world_size=saved_world_size, world_size=self.num_processes,
                                        num_batches=len(loader))
                       for record, loader in zip(records or [], self._resumable_loaders)] or None
        if records is None or len(records) != len(self._resumable_loaders):
            self._inexact(f"{path} has no position for the {len(self._resumable_loaders)} prepared loader(s) of rank "
                          f"{self.process_index}")
            return
        for index, (loader, record) in enumerate(zip(self._resumable_loaders, records)):
            if record.get("saved") is False:
                self._inexact(f"{path} has no position for loader {index} of rank {self.process_index} (it could not "
                              "be saved; see the WARNING of that save)")
                continue
            fits = loader.fits(record)
            if not fits:
                self._inexact(f"{path}: the saved position {dict(record)} of loader {index} does not fit it "
                              f"({loader.settings()} on rank {self.process_index}; the data set, its kind, batch "
                              "size, drop_last or world size changed); its epoch restarts", ConfigDriftError)
            loader.load_position(record, restart_epoch=not fits)
        self._resume_watch.record(self._resumable_loaders)

    def _restore_custom_objects(self, path: Path, states: list[Any]) -> None:
        if len(states) != len(self._custom_objects):
            self._inexact(f"{path} holds {len(states)} registered custom object(s), {len(self._custom_objects)} are "
                          "registered now")
            return
        for obj, state in zip(self._custom_objects, states):
            obj.load_state_dict(state)

    def _restore_rng(self, path: Path, loaded: LoadedCheckpoint) -> None:
        if self.resume_options.elastic and loaded.manifest.world_size != self.num_processes:
            # accumulation_windows keys the model's randomness per micro-batch; a new rank starts from its seed
            if loaded.rng_state is not None:
                restore_rng_state(loaded.rng_state, allow_device_mismatch=True)
            return
        if loaded.rng_state is None:
            self._inexact(f"{path} has no RNG state for rank {self.process_index}")
            return
        restore_rng_state(loaded.rng_state, allow_device_mismatch=self.resume_options.allow_inexact_resume)

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

        Unlike accelerate's ``end_training`` the process group is *not* destroyed here: with gloo,
        destroying it while a DDP-wrapped model still references it can deadlock later, when the model is
        released (``~Reducer`` -> ``~ProcessGroupGloo`` waits on a mutex forever; seen under ``torchrun``
        on 2 CPU processes). The group is released with the model, or at interpreter exit.
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
