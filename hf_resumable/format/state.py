"""What a run was started with, recorded in every checkpoint.

A bit-exact resume is only possible when the resumed run slices the data exactly as the interrupted one
did. :class:`RunConfig` records the settings that decide that (gradient accumulation, per-device batch
size, world size, seeds, the training data set); :meth:`RunConfig.diff` names every field that changed, for the
integrations' one drift check (``integrations._core.check_drift``).

Example:

```python
>>> from hf_resumable.format.state import RunConfig
>>> saved = RunConfig(gradient_accumulation_steps=4, per_device_train_batch_size=8, world_size=1, seed=42,
...                   data_seed=None, dataset_length=1000, dataset_fingerprint="abc")
>>> saved.diff(saved)  # nothing changed
{}
>>> saved.diff(RunConfig.from_dict({**saved.to_dict(), "seed": 7}))
{'seed': (42, 7)}
```
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["RunConfig"]


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """The settings that decide which samples each optimizer step sees, and with which randomness.

    Args:
        gradient_accumulation_steps (`int`): micro-batches per optimizer step.
        per_device_train_batch_size (`int`): samples per micro-batch on each rank.
        world_size (`int`): number of data-parallel processes.
        seed (`int`): ``TrainingArguments.seed``.
        data_seed (`int`, *optional*): ``TrainingArguments.data_seed``.
        dataset_length (`int`, *optional*): length of the training data set (``None`` when streaming).
        dataset_fingerprint (`str`): see :func:`hf_resumable.data.dataset_fingerprint`.
        train_sampling_strategy (`str`, *optional*): ``"random"``, ``"sequential"`` or ``"group_by_length"``.
        dataloader_drop_last (`bool`, *optional*): whether the last incomplete batch of an epoch is dropped.

    The two optional fields are ``None`` in checkpoints written before they were recorded; ``None`` is not
    compared (see :meth:`diff`).
    """

    gradient_accumulation_steps: int
    per_device_train_batch_size: int
    world_size: int
    seed: int
    data_seed: int | None
    dataset_length: int | None
    dataset_fingerprint: str
    train_sampling_strategy: str | None = None
    dataloader_drop_last: bool | None = None

    def __post_init__(self) -> None:
        for name in ("gradient_accumulation_steps", "per_device_train_batch_size", "world_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"RunConfig.{name} must be a positive int, got {value!r}.")

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (stored in the checkpoint's ``extra``)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "RunConfig":
        """Inverse of :meth:`to_dict`; unknown keys (from a newer writer) are ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{key: value for key, value in data.items() if key in names})

    def diff(self, other: "RunConfig") -> dict[str, tuple[Any, Any]]:
        """``{field: (self's value, other's value)}`` for every field that differs (an optional field that either
        side did not record is not compared)."""
        optional = {"train_sampling_strategy", "dataloader_drop_last"}
        return {
            f.name: (getattr(self, f.name), getattr(other, f.name))
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
            and not (f.name in optional and None in (getattr(self, f.name), getattr(other, f.name)))
        }
