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
from typing import Any

from accelerate.scheduler import AcceleratedScheduler

from ..data import DATA_NUM_BATCHES, DATA_STEP
from ..errors import InexactResumeError
from ._elastic import ELASTIC_SETTINGS

logger = logging.getLogger(__name__)

__all__ = ["KEY_ELASTIC", "KEY_SCHEDULER_RATE", "KeptRateScheduler", "convert_position", "elastic_changes"]

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
