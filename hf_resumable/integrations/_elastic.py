"""Elastic world size (``elastic=True`` of both front doors), the rule both share: a restart on another number of
processes keeps the checkpoint's global batch by changing the gradient accumulation (:func:`plan_elastic_resume`,
pure), and the model's randomness is keyed by the global micro-batch (:func:`seed_model_rng`). docs/trainer.md,
"Elastic", and docs/accelerate.md, "Another number of processes", describe the rest.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from ..errors import ConfigDriftError
from ..format.rng import derive_seed

logger = logging.getLogger(__name__)

__all__ = ["ELASTIC_SETTINGS", "ElasticPlan", "ElasticWorldSizeError", "plan_elastic_resume", "seed_model_rng",
           "working_world_sizes"]

# Run settings that an elastic resume may change together (the global batch they make is kept).
ELASTIC_SETTINGS = ("world_size", "gradient_accumulation_steps")
# Domain-separation tag of the model's per-chunk seed.
_TAG_MODEL = "elastic-model"


class ElasticWorldSizeError(ConfigDriftError, ValueError):
    """``elastic=True``: the checkpoint's global batch cannot be kept at this world size (it does not divide)."""


@dataclasses.dataclass(frozen=True)
class ElasticPlan:
    """How a run continues at another world size: the global and per-device batches kept, the world size and the
    micro-batches per optimizer step before (``saved_*``) and now."""

    global_batch: int
    per_device_batch: int
    saved_world_size: int
    world_size: int
    saved_accumulation: int
    gradient_accumulation_steps: int

    def describe(self) -> str:
        """The one log line of the change (old -> new)."""
        return (f"world size {self.saved_world_size} -> {self.world_size}: gradient_accumulation_steps "
                f"{self.saved_accumulation} -> {self.gradient_accumulation_steps} (per-device batch "
                f"{self.per_device_batch}, global batch {self.global_batch} kept)")


def working_world_sizes(global_batch: int, per_device_batch: int) -> list[int]:
    """The world sizes at which ``global_batch`` is kept with ``per_device_batch`` per micro-batch (pure).

    Example:

    ```python
    >>> working_world_sizes(16, 2)
    [1, 2, 4, 8]
    ```
    """
    if per_device_batch < 1 or global_batch % per_device_batch:
        return []
    micro_batches = global_batch // per_device_batch
    return [size for size in range(1, micro_batches + 1) if micro_batches % size == 0]


def plan_elastic_resume(*, saved_world_size: int, saved_accumulation: int, per_device_batch: int,
                        world_size: int, checkpoint: str = "the checkpoint") -> ElasticPlan:
    """The gradient accumulation that keeps the checkpoint's global batch (``per_device_batch x saved_accumulation x
    saved_world_size``, the per-device batch unchanged) at ``world_size`` (pure).

    Raises:
        ElasticWorldSizeError: ``per_device_batch * world_size`` does not divide the global batch (the message lists
            the world sizes that do).

    Example:

    ```python
    >>> plan = plan_elastic_resume(saved_world_size=2, saved_accumulation=2, per_device_batch=4, world_size=1)
    >>> plan.global_batch, plan.gradient_accumulation_steps
    (16, 4)
    >>> plan_elastic_resume(saved_world_size=2, saved_accumulation=2, per_device_batch=4, world_size=3)
    Traceback (most recent call last):
    ...
    hf_resumable.integrations._elastic.ElasticWorldSizeError: Cannot resume at world size 3 ...
    ```
    """
    global_batch = per_device_batch * saved_accumulation * saved_world_size
    if global_batch % (per_device_batch * world_size):
        raise ElasticWorldSizeError(
            f"Cannot resume at world size {world_size} with elastic=True: {checkpoint} trains a global batch of "
            f"{global_batch} samples (per-device batch {per_device_batch} x gradient_accumulation_steps "
            f"{saved_accumulation} x world size {saved_world_size}), which {world_size} processes of "
            f"{per_device_batch} cannot split evenly. Nothing was trained. Launch with one of the world sizes "
            f"{working_world_sizes(global_batch, per_device_batch)}.")
    return ElasticPlan(global_batch=global_batch, per_device_batch=per_device_batch,
                       saved_world_size=saved_world_size, world_size=world_size,
                       saved_accumulation=saved_accumulation,
                       gradient_accumulation_steps=global_batch // (per_device_batch * world_size))


def seed_model_rng(seed: int, *, epoch: int, chunk: int) -> None:
    """Seed torch's CPU and CUDA generators for the micro-batch that trains on chunk ``chunk`` of ``epoch``.

    A chunk (``per_device_batch`` consecutive positions of the epoch's global order) is the same batch at any world
    size, so dropout draws the same mask for it whichever rank trains on it.
    """
    torch.manual_seed(derive_seed(seed, _TAG_MODEL, epoch, chunk))
