"""``ResumableAccelerator(..., elastic=True)``: what a restart at another world size changes on the accelerate side
(docs/accelerate.md, "Another number of processes"). Everything counts data-parallel ranks, not processes. The
accelerator picks its mode once (:func:`world_size_mode`); every step that differs is a method of that object.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from accelerate.scheduler import AcceleratedScheduler

from ..data import DATA_KIND, DATA_NUM_BATCHES, DATA_STEP, split_stream_for_rank
from ..distributed import broadcast_json
from ..errors import ConfigDriftError, InexactResumeError, UnsupportedEngineError
from ._accelerate_loop import (
    AccumulationWindow,
    ElasticBatch,
    HandOuts,
    ResumablePreparedLoader,
    ResumablePreparedStream,
)
from ._elastic import ELASTIC_SETTINGS, plan_elastic_resume
from ._parallelism import KEY_PARALLELISM, layout_of, parse_layout

if TYPE_CHECKING:
    from .accelerate import ResumableAccelerator

logger = logging.getLogger(__name__)

__all__ = ["KEY_ELASTIC", "KEY_SCHEDULER_RATE", "DataWorld", "ElasticWorldSize", "FixedWorldSize",
           "KeptRateScheduler", "check_reshardable", "convert_position", "current_data_world", "elastic_changes",
           "plan_elastic_load", "saved_data_world", "world_size_mode"]

# Keys of the run settings (``EXTRA_RUN``) an elastic run records.
KEY_ELASTIC = "elastic"  # bool: written with elastic=True (the elastic sample layout)
KEY_SCHEDULER_RATE = "scheduler_steps_per_optimizer_step"  # int: scheduler steps per optimizer step (first launch)
_LOADER_DERIVED = (DATA_NUM_BATCHES,)  # loader settings that follow from the world size


class KeptRateScheduler(AcceleratedScheduler):
    """accelerate's ``AcceleratedScheduler`` of ``prepared``, stepping the wrapped scheduler ``rate`` times per
    optimizer step (the run's first launch's rate) instead of ``num_processes`` times."""

    def __init__(self, prepared: AcceleratedScheduler, *, rate: int) -> None:
        super().__init__(prepared.scheduler, prepared.optimizers, step_with_optimizer=prepared.step_with_optimizer,
                         split_batches=prepared.split_batches)
        self.rate = rate

    def step(self, *args: Any, **kwargs: Any) -> None:
        optimizer_stepped = self.gradient_state.sync_gradients and not any(
            opt.step_was_skipped for opt in self.optimizers)
        if not self.step_with_optimizer or self.split_batches or not optimizer_stepped:
            super().step(*args, **kwargs)  # accelerate's own bookkeeping (no learning-rate step, or one per step)
            return
        total = getattr(self.scheduler, "total_steps", None)
        for _ in range(self.rate):
            if total is None or self.scheduler._step_count <= total:  # accelerate's OneCycleLR guard
                self.scheduler.step(*args, **kwargs)


@dataclass(frozen=True)
class DataWorld:
    """Where a run's batches go: its processes, its data-parallel ranks and its ``ParallelismConfig`` layout
    (:meth:`ParallelLayout.describe`; ``None`` without one)."""

    processes: int
    data_ranks: int
    layout: str | None = None


def saved_data_world(saved: Mapping[str, Any], saved_world_size: int) -> DataWorld:
    """The :class:`DataWorld` of a checkpoint, from its run settings (``EXTRA_RUN``) and its manifest's world size
    (pure).

    Example:

    ```python
    >>> saved_data_world({"parallelism": "dp_replicate=2 x tp=2"}, 4)
    DataWorld(processes=4, data_ranks=2, layout='dp_replicate=2 x tp=2')
    ```
    """
    text = saved.get(KEY_PARALLELISM)
    if text is None:
        return DataWorld(processes=saved_world_size, data_ranks=saved_world_size)
    layout = parse_layout(text)
    data_ranks = layout.data_world if layout.world_size == saved_world_size else saved_world_size
    return DataWorld(processes=saved_world_size, data_ranks=data_ranks, layout=text)


def current_data_world(accelerator: ResumableAccelerator) -> DataWorld:
    """The :class:`DataWorld` of the accelerator's run."""
    layout = layout_of(accelerator.parallelism_config)
    return DataWorld(processes=accelerator.num_processes, data_ranks=accelerator._data_rank()[1],
                     layout=None if layout is None else layout.describe())


def check_reshardable(saved: DataWorld, now: DataWorld, *, saved_pieces: bool, pieces: bool,
                      checkpoint: str = "the checkpoint") -> None:
    """Refuse a layout change the piece engine cannot carry (pure): a checkpoint of per-rank pieces (FSDP2, tensor
    parallel) read into a run whose model holds whole tensors.

    Raises:
        UnsupportedEngineError: pieces into whole tensors (names both layouts and the fix).

    Example:

    ```python
    >>> tp2, one = DataWorld(processes=2, data_ranks=1, layout="tp=2"), DataWorld(processes=1, data_ranks=1)
    >>> check_reshardable(tp2, one, saved_pieces=True, pieces=False)
    Traceback (most recent call last):
    ...
    hf_resumable.errors.UnsupportedEngineError: the checkpoint holds per-rank pieces ...
    ```
    """
    if saved_pieces and not pieces:
        raise UnsupportedEngineError(
            f"{checkpoint} holds per-rank pieces (saved at {_describe(saved)}), and this run ({_describe(now)}) "
            "holds whole tensors: elastic=True reshards pieces only into pieces, so nothing was loaded or trained. "
            "Resume with a ParallelismConfig (tp_size, dp_shard_size) or an FSDP2 plugin (fsdp_version=2), "
            "at any number of processes.")


def _describe(world: DataWorld) -> str:
    where = f"{world.processes} process(es), {world.data_ranks} data-parallel rank(s)"
    return f"ParallelismConfig {world.layout}, {where}" if world.layout else where


def elastic_changes(changed: Mapping[str, tuple[Any, Any]], *, kept: bool) -> dict[str, tuple[Any, Any]]:
    """``changed`` (``{name: (saved, now)}``) less what an elastic resume changes on purpose: the scheduler rate,
    the loaders' batches per epoch and, with ``kept`` (the global batch kept at another layout), the world size,
    layout and gradient accumulation (pure)."""
    drop = {KEY_SCHEDULER_RATE, *((*ELASTIC_SETTINGS, KEY_PARALLELISM) if kept else ())}
    out = {name: values for name, values in changed.items() if name not in drop}
    if "loaders" in out:
        saved, now = ([{k: v for k, v in loader.items() if k not in _LOADER_DERIVED} for loader in side or []]
                      for side in out["loaders"])
        if saved == now:
            del out["loaders"]
    return out


def convert_position(record: Mapping[str, Any], *, saved_world_size: int, world_size: int,
                     num_batches: int) -> dict[str, Any]:
    """A map-style position of the elastic layout saved at ``saved_world_size``, for a rank at ``world_size`` whose
    epoch has ``num_batches`` batches (pure).

    Raises:
        InexactResumeError: the position is not on a boundary of the new layout (not an optimizer-step boundary).

    Example:

    ```python
    >>> convert_position({"kind": "map", "epoch": 1, "step": 4, "num_batches": 6}, saved_world_size=2, world_size=1,
    ...                  num_batches=12)
    {'kind': 'map', 'epoch': 1, 'step': 8, 'num_batches': 12}
    ```
    """
    chunks = int(record[DATA_STEP]) * saved_world_size
    if chunks % world_size:
        raise InexactResumeError(f"The saved data position ({chunks} batches of the epoch) is not a multiple of the "
                                 f"world size {world_size}; resume from a checkpoint on an optimizer-step boundary.")
    return {**record, DATA_STEP: chunks // world_size, DATA_NUM_BATCHES: num_batches}


def plan_elastic_load(accelerator: ResumableAccelerator, path: Path, saved: Mapping[str, Any],
                      saved_world_size: int, *, saved_pieces: bool) -> bool:
    """``elastic=True``: keep the first launch's scheduler rate; at another layout keep the checkpoint's global batch
    (gradient accumulation over the data-parallel ranks, and the loaders' epoch cut). Whether the layout changed.

    Raises:
        ElasticWorldSizeError: the global batch does not divide over this run's data-parallel ranks.
        ConfigDriftError: a loader that is not from ``prepare_resumable_dataloader`` (its order is per rank).
        UnsupportedEngineError: per-rank pieces into a run of whole tensors (:func:`check_reshardable`).
    """
    mode = accelerator._world_size_mode
    mode.scheduler_rate = int(saved.get(KEY_SCHEDULER_RATE, saved_world_size))
    for scheduler in accelerator._schedulers:
        if isinstance(scheduler, KeptRateScheduler):
            scheduler.rate = mode.scheduler_rate
    before, now = saved_data_world(saved, saved_world_size), current_data_world(accelerator)
    mode.resumed_from = None
    if before == now or not saved.get(KEY_ELASTIC):
        return False  # same layout, or a checkpoint of another sample layout (the drift check names it)
    check_reshardable(before, now, saved_pieces=saved_pieces, pieces=accelerator._saves_pieces(),
                      checkpoint=str(path))
    loaders = [loader for loader in accelerator._resumable_loaders
               if isinstance(loader, (ResumablePreparedLoader, ResumablePreparedStream))]
    if not loaders or len(loaders) != len(accelerator._resumable_loaders):
        raise ConfigDriftError(f"{path} was saved at {_describe(before)}, this run has {_describe(now)}: "
                               "elastic=True keeps the sample order only for loaders from "
                               "prepare_resumable_dataloader(). Build the training loader with it.")
    plan = plan_elastic_resume(saved_world_size=before.data_ranks,
                               saved_accumulation=int(saved["gradient_accumulation_steps"]),
                               per_device_batch=loaders[0].batch_size, world_size=now.data_ranks,
                               checkpoint=str(path))
    accelerator.gradient_accumulation_steps = plan.gradient_accumulation_steps
    if getattr(accelerator, "deepspeed_engine_wrapped", None) is not None:  # the engine divides the loss by its own
        accelerator.deepspeed_engine_wrapped.engine.set_train_batch_size(plan.global_batch)
    for loader in loaders:
        loader.set_global_batch(plan.global_batch)
    mode.resumed_from = before
    if accelerator.is_main_process:
        logger.info("Elastic resume of %s: %s -> %s; %s (in data-parallel ranks).", path, _describe(before),
                    _describe(now), plan.describe())
    return True


class FixedWorldSize:
    """``elastic=False``: a resume continues at the checkpoint's world size (another one is drift). Each method is a
    step that :class:`ElasticWorldSize` does differently; here it is the plain accelerate behaviour."""

    enabled = False  # recorded in the run settings (KEY_ELASTIC)

    def global_batch(self, global_batch: int) -> int | None:
        """The global batch a loader of ``prepare_resumable_dataloader`` is built for (``None``: per rank)."""
        return None

    def stream_source(self, dataset: Any, *, rank: int, world_size: int) -> Any:
        """What a stream loader of this rank reads: its split of ``dataset``."""
        return split_stream_for_rank(dataset, rank=rank, world_size=world_size)

    def hand_outs_for(self, layout: Any) -> HandOuts | None:
        """Where a prepared loader over ``layout`` (batch sampler or stream) records the batch it handed out last."""
        return None

    def keep_scheduler_rate(self, accelerator: ResumableAccelerator, prepared: Any) -> Any:
        """``prepared`` (what ``prepare``/``prepare_scheduler`` returned), its schedulers kept at their rate."""
        return prepared

    def window(self, loader: Any, iterator: Iterator[Any], size: int) -> tuple[list[Any], list[ElasticBatch] | None]:
        """The next accumulation window's batches (up to ``size``) and, per batch, how the loader handed it out."""
        return list(islice(iterator, size)), None

    def trained_micro_batch(self, window: AccumulationWindow | None,
                            accumulation: int) -> tuple[ElasticBatch | None, int]:
        """The elastic batch being trained on (``None``: not the elastic layout) and the micro-batches per rank of
        its step."""
        slot = window.slot if window is not None else None
        return None, accumulation if slot is None else slot[1]

    def scale_loss(self, loss: torch.Tensor, num_items_in_batch: int | torch.Tensor | None, *,
                   window: AccumulationWindow | None, accumulation: int, num_processes: int) -> torch.Tensor:
        """``backward``'s loss scaling: by ``num_processes / num_items_in_batch`` (a summed loss), else by the
        micro-batches of the step, weighed by the elastic batch being trained on.

        Raises:
            ValueError: ``num_items_in_batch`` is not positive.
        """
        batch, micro_batches = self.trained_micro_batch(window, accumulation)
        if num_items_in_batch is not None:
            count = int(num_items_in_batch)
            if count <= 0:
                raise ValueError(f"num_items_in_batch must be > 0, got {count} (a window without any item).")
            return loss * (0.0 if batch is not None and batch.is_padding else num_processes / count)
        scale = None if batch is None else batch.loss_scale(num_processes=num_processes,
                                                            micro_batches=micro_batches)
        return loss / micro_batches if scale is None else loss * scale

    def recorded_settings(self) -> dict[str, Any]:
        """Run settings this mode adds to the ones every checkpoint records."""
        return {}

    def plan_load(self, accelerator: ResumableAccelerator, path: Path, saved: Mapping[str, Any],
                  saved_world_size: int, *, saved_pieces: bool) -> bool:
        """Adapt the accelerator to the checkpoint before anything is loaded; whether its layout changed."""
        return False

    def drift(self, changed: Mapping[str, tuple[Any, Any]], *, kept: bool) -> dict[str, tuple[Any, Any]]:
        """The changed run settings that count as drift."""
        return dict(changed)

    def resumes_across(self) -> bool:
        """Whether the checkpoint being loaded continues at another layout (never, here: that is drift)."""
        return False

    def loader_records(self, accelerator: ResumableAccelerator, records: list[Any] | None) -> list[Any] | None:
        """This rank's saved loader positions, as its loaders load them."""
        return records


class ElasticWorldSize(FixedWorldSize):
    """``elastic=True``: a resume at another world size keeps the checkpoint's global batch, sample order, model
    randomness and learning-rate schedule (``scheduler_rate``: the first launch's scheduler steps per optimizer
    step; ``data_ranks``: this run's data-parallel ranks)."""

    enabled = True

    def __init__(self, *, scheduler_rate: int, data_ranks: int) -> None:
        self.scheduler_rate = scheduler_rate
        self.data_ranks = data_ranks
        self.hand_outs = HandOuts()  # the batch a prepared loader handed out last (backward's weight)
        self.resumed_from: DataWorld | None = None  # the checkpoint's layout, when load_state resumes another

    def scale_loss(self, loss: torch.Tensor, num_items_in_batch: int | torch.Tensor | None, *,
                   window: AccumulationWindow | None, accumulation: int, num_processes: int) -> torch.Tensor:
        # A micro-batch's share of the global batch counts data-parallel ranks (the ranks of one tensor-parallel
        # group train the same batch, and no gradient is averaged over them); a summed loss's item count is summed
        # over every process, so it keeps num_processes.
        ranks = num_processes if num_items_in_batch is not None else self.data_ranks
        return super().scale_loss(loss, num_items_in_batch, window=window, accumulation=accumulation,
                                  num_processes=ranks)

    def global_batch(self, global_batch: int) -> int | None:
        return global_batch

    def stream_source(self, dataset: Any, *, rank: int, world_size: int) -> Any:
        return dataset  # read whole by every process; step k is the same examples at any world size

    def hand_outs_for(self, layout: Any) -> HandOuts | None:
        return self.hand_outs if layout.global_batch is not None else None

    def keep_scheduler_rate(self, accelerator: ResumableAccelerator, prepared: Any) -> Any:
        """``prepared`` (one object or a tuple) with every scheduler accelerate prepared made a
        :class:`KeptRateScheduler`."""
        kept = {id(item): KeptRateScheduler(item, rate=self.scheduler_rate) for item in accelerator._schedulers
                if type(item) is AcceleratedScheduler}  # not DeepSpeed's own schedules (its engine steps them)
        accelerator._schedulers = [kept.get(id(item), item) for item in accelerator._schedulers]
        if isinstance(prepared, tuple):
            return tuple(kept.get(id(item), item) for item in prepared)
        return kept.get(id(prepared), prepared)

    def window(self, loader: Any, iterator: Iterator[Any], size: int) -> tuple[list[Any], list[ElasticBatch] | None]:
        if getattr(loader, "hand_outs", None) is None:  # not a prepared loader of the elastic layout
            return super().window(loader, iterator, size)
        batches, handed = [], []
        for batch in islice(iterator, size):
            batches.append(batch)
            handed.append(loader.last_batch)  # read right after the loader handed it out
        return batches, handed

    def trained_micro_batch(self, window: AccumulationWindow | None,
                            accumulation: int) -> tuple[ElasticBatch | None, int]:
        """The active window's batch, else (a loop over the loader itself) the batch an elastic loader handed out
        last, in a step of ``accumulation``."""
        if window is not None:
            slot = window.slot
            return window.current(), accumulation if slot is None else slot[1]
        return self.hand_outs.batch, accumulation

    def recorded_settings(self) -> dict[str, Any]:
        return {KEY_SCHEDULER_RATE: self.scheduler_rate}

    def plan_load(self, accelerator: ResumableAccelerator, path: Path, saved: Mapping[str, Any],
                  saved_world_size: int, *, saved_pieces: bool) -> bool:
        return plan_elastic_load(accelerator, path, saved, saved_world_size, saved_pieces=saved_pieces)

    def drift(self, changed: Mapping[str, tuple[Any, Any]], *, kept: bool) -> dict[str, tuple[Any, Any]]:
        return elastic_changes(changed, kept=kept)

    def resumes_across(self) -> bool:
        return self.resumed_from is not None

    def loader_records(self, accelerator: ResumableAccelerator, records: list[Any] | None) -> list[Any] | None:
        if self.resumed_from is None:
            return records
        # the elastic layout's position is global: rank 0's record, converted (a new rank has none of its own)
        records = broadcast_json(records if accelerator.is_main_process else None)
        # (a stream's record counts the examples read over all ranks: its loader converts it when loaded)
        return [record if record.get(DATA_KIND) == "stream" else
                convert_position(record, saved_world_size=self.resumed_from.data_ranks,
                                 world_size=accelerator._data_rank()[1], num_batches=len(loader))
                for record, loader in zip(records or [], accelerator._resumable_loaders)] or None


def world_size_mode(elastic: bool, *, data_ranks: int) -> FixedWorldSize:
    """The accelerator's mode for ``elastic`` (chosen once, when it is built), for ``data_ranks`` data-parallel ranks.

    Example:

    ```python
    >>> world_size_mode(True, data_ranks=2).recorded_settings()
    {'scheduler_steps_per_optimizer_step': 2}
    >>> world_size_mode(False, data_ranks=2).enabled
    False
    ```
    """
    return ElasticWorldSize(scheduler_rate=data_ranks, data_ranks=data_ranks) if elastic else FixedWorldSize()
