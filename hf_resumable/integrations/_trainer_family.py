"""The ``Trainer`` family: ``make_resumable(SFTTrainer)`` and the trainer attributes a checkpoint carries.

A subclass of ``transformers.Trainer`` (TRL's ``SFTTrainer``, ``DPOTrainer``, ``GRPOTrainer``,
``Seq2SeqTrainer``, a user's own) becomes resumable by putting ``ResumableTrainer`` *under* it in the
method resolution order::

    Resumable<Name>  ->  <Name> (and its bases)  ->  ResumableTrainer  ->  transformers.Trainer

so the subclass keeps its own preprocessing, ``compute_loss``, ``log``, model card and ``_save_checkpoint``
extras, and each ``super()`` call it makes reaches ``ResumableTrainer`` instead of the stock code. Options
of ``ResumableTrainer`` (``allow_config_drift=``...) are accepted by the new class's constructor and set
aside before the subclass's own constructor runs, which therefore never sees them.

Such trainers keep counters of their own outside ``TrainerState`` (TRL's ``_total_train_tokens`` behind
the logged ``num_tokens``, the per-step metrics it averages at each log in ``_metrics``, GRPO's
micro-step counter ``_step``). The attributes named by ``resumable_state_attributes`` are saved in every
checkpoint (``training_state.json``, no pickle) and put back before the first resumed step, so every
logged metric matches the uninterrupted run. :func:`encode_attribute` and :func:`restore_attribute` do
the conversion, keeping the container types (``defaultdict``, ``deque``) the trainer created.

Example:

```python
>>> from collections import defaultdict
>>> metrics = {"train": defaultdict(list)}
>>> restore_attribute(metrics, {"train": {"num_tokens": [51.0]}})["train"]["entropy"]
[]
```
"""

from __future__ import annotations

import collections
from collections.abc import Mapping
from typing import Any

__all__ = ["DEFAULT_STATE_ATTRIBUTES", "RESUMABLE_OPTIONS", "encode_attribute", "restore_attribute"]

# Trainer attributes saved when present: TRL's counters and pending metrics, GRPO/RLOO's micro-step counter.
DEFAULT_STATE_ATTRIBUTES = ("_metrics", "_total_train_tokens", "_step")
# ResumableTrainer's own constructor options (set aside before a subclass's constructor runs).
RESUMABLE_OPTIONS = ("allow_config_drift", "allow_inexact_resume", "exit_on_preemption", "checkpoint_verify",
                     "push_checkpoints_to", "storage_options", "restore_callback_states", "resume_hyperparameters",
                     "standalone_checkpoints", "save_async", "elastic", "mean_time_between_failures",
                     "preemption_notice")


def encode_attribute(value: Any) -> Any:
    """A plain copy of a trainer attribute for ``encode_state`` (``defaultdict`` -> dict, ``deque`` -> list)."""
    if isinstance(value, Mapping):
        return {key: encode_attribute(item) for key, item in value.items()}
    if isinstance(value, (list, tuple, collections.deque)):
        return [encode_attribute(item) for item in value]
    return value


def restore_attribute(current: Any, saved: Any) -> Any:
    """``saved`` in the shape of ``current``: its dict (``defaultdict`` factory kept) or deque (``maxlen`` kept) is
    refilled in place and returned; any other value is replaced by ``saved``."""
    if isinstance(current, dict) and isinstance(saved, Mapping):
        factory = current.default_factory if isinstance(current, collections.defaultdict) else None
        previous = dict(current)
        current.clear()
        for key, item in saved.items():
            template = previous.get(key, factory() if factory is not None else None)
            current[key] = restore_attribute(template, item)
        return current
    if isinstance(current, collections.deque) and isinstance(saved, list):
        current.clear()
        current.extend(saved)
        return current
    if isinstance(current, tuple) and isinstance(saved, list):
        return tuple(saved)
    return saved
