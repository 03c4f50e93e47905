"""The ``Trainer`` family: ``make_resumable(SFTTrainer)`` and the trainer attributes a checkpoint carries.

``ResumableTrainer`` goes *under* the subclass in the method order (``Resumable<Name> -> <Name> -> ResumableTrainer
-> Trainer``), so the subclass's overrides stay and its ``super()`` calls reach ours; ResumableTrainer's options are
set aside before the subclass's constructor runs. Counters such trainers keep outside ``TrainerState`` (TRL's
``_total_train_tokens``, ``_metrics``, GRPO's ``_step``) are saved as JSON and restored in their container types
(docs/trainer.md, "TRL, Seq2SeqTrainer and your own Trainer subclasses").
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
    refilled in place and returned; any other value is replaced by ``saved``.

    Example:

    ```python
    >>> from collections import defaultdict
    >>> metrics = {"train": defaultdict(list)}
    >>> restore_attribute(metrics, {"train": {"num_tokens": [51.0]}})["train"]["entropy"]
    []
    ```
    """
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
