"""``ResumableAccelerator(..., elastic=True)``: what a restart at another world size changes on the accelerate side
(the rule itself, :func:`~hf_resumable.integrations._elastic.plan_elastic_resume`, is shared with the Trainer).

* **Schedule.** accelerate steps a prepared scheduler ``num_processes`` times per optimizer step (its batches grow
  with the number of processes). A run resumed on another number of processes would step it at another rate and
  leave the uninterrupted run's schedule; :class:`KeptRateScheduler` steps it at the rate of the run's first
  launch, recorded in every checkpoint (``scheduler_steps_per_optimizer_step``).
* **Settings.** The run settings compared at resume drop what an elastic resume changes on purpose (world size,
  gradient accumulation, batches per epoch) once the global batch is kept (:func:`elastic_changes`).
* **Position.** A loader's position is the number of its rank's batches consumed in the epoch; in the elastic layout
  that is ``chunks / world_size``, so it converts exactly at an optimizer-step boundary (:func:`convert_position`).

Example:

```python
>>> convert_position({"kind": "map", "epoch": 1, "step": 4, "num_batches": 6}, saved_world_size=2, world_size=1,
...                  num_batches=12)
{'kind': 'map', 'epoch': 1, 'step': 8, 'num_batches': 12}
```
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from accelerate.scheduler import AcceleratedScheduler

from ..data import DATA_NUM_BATCHES, DATA_STEP
from ..errors import ConfigDriftError, InexactResumeError
from ._accelerate_loop import ResumablePreparedLoader, ResumablePreparedStream
from ._elastic import ELASTIC_SETTINGS, plan_elastic_resume

if TYPE_CHECKING:
    from .accelerate import ResumableAccelerator

logger = logging.getLogger(__name__)

__all__ = ["KEY_ELASTIC", "KEY_SCHEDULER_RATE", "KeptRateScheduler", "convert_position", "elastic_changes",
           "plan_elastic_load"]

# Keys of the run settings (``EXTRA_RUN``) an elastic run records.
KEY_ELASTIC = "elastic"  # bool: written with elastic=True (the elastic sample layout)
KEY_SCHEDULER_RATE = "scheduler_steps_per_optimizer_step"  # int: scheduler steps per optimizer step (first launch)
_LOADER_DERIVED = (DATA_NUM_BATCHES,)  # loader settings that follow from the world size


class KeptRateScheduler(AcceleratedScheduler):
    """accelerate's ``AcceleratedScheduler``, stepping the wrapped scheduler ``rate`` times per optimizer step (the
    rate of the run's first launch) instead of ``num_processes`` times.

    Args:
        prepared (`AcceleratedScheduler`): what accelerate's ``prepare_scheduler`` returned.
        rate (`int`): scheduler steps per optimizer step.
    """

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


def elastic_changes(changed: Mapping[str, tuple[Any, Any]], *, kept: bool) -> dict[str, tuple[Any, Any]]:
    """``changed`` (``{name: (saved, now)}``) less what an elastic resume changes on purpose: the scheduler rate
    (the saved one is kept), the loaders' batches per epoch, and, when the global batch is ``kept``, the world size
    and gradient accumulation (pure)."""
    drop = {KEY_SCHEDULER_RATE, *(ELASTIC_SETTINGS if kept else ())}
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
    epoch has ``num_batches`` batches (pure): ``step`` batches of each of ``saved_world_size`` ranks are
    ``step * saved_world_size`` chunks.

    Raises:
        InexactResumeError: the position is not on a boundary of the new layout (not an optimizer-step boundary).
    """
    chunks = int(record[DATA_STEP]) * saved_world_size
    if chunks % world_size:
        raise InexactResumeError(f"The saved data position ({chunks} batches of the epoch) is not a multiple of the "
                                 f"world size {world_size}; resume from a checkpoint on an optimizer-step boundary.")
    return {**record, DATA_STEP: chunks // world_size, DATA_NUM_BATCHES: num_batches}


def plan_elastic_load(accelerator: ResumableAccelerator, path: Path, saved: Mapping[str, Any],
                      saved_world_size: int) -> bool:
    """``elastic=True``: keep the first launch's scheduler rate; at another world size, keep the checkpoint's
    global batch (gradient accumulation and the loaders' epoch cut). Whether the world size changed.

    Args:
        accelerator (`ResumableAccelerator`): the accelerator ``load_state`` fills.
        path (`Path`): the checkpoint, named in messages.
        saved (`Mapping`): the checkpoint's run settings (``EXTRA_RUN``).
        saved_world_size (`int`): the checkpoint's world size (its manifest's).

    Raises:
        ElasticWorldSizeError: the global batch does not divide at this world size.
        ConfigDriftError: a loader that is not from ``prepare_resumable_dataloader`` (its order is per rank;
            a plain ``DataLoader`` over a stream included).
    """
    accelerator._scheduler_rate = int(saved.get(KEY_SCHEDULER_RATE, saved_world_size))
    for scheduler in accelerator._schedulers:
        if isinstance(scheduler, KeptRateScheduler):
            scheduler.rate = accelerator._scheduler_rate
    if saved_world_size == accelerator.num_processes or not saved.get(KEY_ELASTIC):
        return False  # same size, or a checkpoint of another layout (the drift check names it)
    loaders = [loader for loader in accelerator._resumable_loaders
               if isinstance(loader, (ResumablePreparedLoader, ResumablePreparedStream))]
    if not loaders or len(loaders) != len(accelerator._resumable_loaders):
        raise ConfigDriftError(f"{path} was saved by {saved_world_size} process(es), this run has "
                               f"{accelerator.num_processes}: elastic=True keeps the sample order only for loaders "
                               "from prepare_resumable_dataloader(). Build the training loader with it.")
    plan = plan_elastic_resume(saved_world_size=saved_world_size,
                               saved_accumulation=int(saved["gradient_accumulation_steps"]),
                               per_device_batch=loaders[0].batch_size, world_size=accelerator.num_processes,
                               checkpoint=str(path))
    accelerator.gradient_accumulation_steps = plan.gradient_accumulation_steps
    if getattr(accelerator, "deepspeed_engine_wrapped", None) is not None:  # the engine divides the loss by its own
        accelerator.deepspeed_engine_wrapped.engine.set_train_batch_size(plan.global_batch)
    for loader in loaders:
        loader.set_global_batch(plan.global_batch)
    if accelerator.is_main_process:
        logger.info("Elastic resume of %s: %s.", path, plan.describe())
    return True
