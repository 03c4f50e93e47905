"""Optimization hyperparameters changed between a checkpoint and the run that resumes it.

A resumed ``Trainer`` silently takes the learning rate, weight decay and Adam betas/epsilon from the checkpoint
(the optimizer and scheduler restore them) and the schedule, ``max_grad_norm`` and label smoothing from the
arguments. Every change is reported, old -> new with the one in effect (they do not change which samples a step
trains on, so they are not drift); ``resume_hyperparameters="arguments"`` applies the new ones.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["RESUME_HYPERPARAMETERS", "HyperparameterChange", "hyperparameter_snapshot", "hyperparameter_changes",
           "report_hyperparameter_changes", "apply_new_hyperparameters"]

# Accepted values of ResumableTrainer(resume_hyperparameters=...).
RESUME_HYPERPARAMETERS = ("checkpoint", "arguments")
# Restored from the optimizer's param groups / the scheduler's base learning rates: the checkpoint's value wins
# unless resume_hyperparameters="arguments".
_OPTIMIZER_FIELDS = ("learning_rate", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon")
# Read from the arguments by the resumed run (the schedule is rebuilt from them; the rest is read every step).
_SCHEDULE = ("the schedule is rebuilt from the arguments at the checkpoint's step; with "
             "resume_hyperparameters='checkpoint' the first resumed step still uses the learning rate stored in the "
             "optimizer")
_ARGUMENT_FIELDS = {
    "lr_scheduler_type": _SCHEDULE,
    "lr_scheduler_kwargs": _SCHEDULE,
    "warmup_steps": _SCHEDULE,
    "max_steps": f"the run ends at the new total; {_SCHEDULE}",
    "max_grad_norm": "read from the arguments at every step",
    "label_smoothing_factor": "read from the arguments at every step",
    "neftune_noise_alpha": "read from the arguments at every step",
}
_FIELDS = _OPTIMIZER_FIELDS + tuple(_ARGUMENT_FIELDS)


@dataclass(frozen=True)
class HyperparameterChange:
    """One setting whose value differs between the checkpoint and the resumed run."""

    name: str
    old: Any
    new: Any

    @property
    def restored_from_checkpoint(self) -> bool:
        """Whether a resumed run keeps the checkpoint's value (unless ``resume_hyperparameters="arguments"``)."""
        return self.name in _OPTIMIZER_FIELDS

    def describe(self, mode: str) -> str:
        """``"name: old -> new (which is in effect, and how to get the other)"``."""
        head = f"{self.name}: {self.old!r} -> {self.new!r}"
        if not self.restored_from_checkpoint:
            return f"{head} ({self.new!r} is in effect: {_ARGUMENT_FIELDS[self.name]})"
        if mode == "arguments":
            return f"{head} ({self.new!r} is in effect: written into the restored optimizer and scheduler)"
        return (f"{head} ({self.old!r} is in effect: restored from the checkpoint's optimizer and scheduler state; "
                "pass resume_hyperparameters='arguments' to ResumableTrainer to train with the new value)")


def _plain(value: Any) -> Any:
    value = getattr(value, "value", value)  # SchedulerType / OptimizerNames enums
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def hyperparameter_snapshot(args: Any, *, max_steps: int) -> dict[str, Any]:
    """The settings recorded in every checkpoint (JSON-able); ``max_steps`` is the run's effective total."""
    snapshot = {name: _plain(getattr(args, name, None)) for name in _FIELDS}
    snapshot["max_steps"] = int(max_steps)
    return snapshot


def hyperparameter_changes(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[HyperparameterChange]:
    """Every recorded setting whose value differs (settings a checkpoint did not record are not compared).

    Example:

    ```python
    >>> saved = {"learning_rate": 1e-3, "max_grad_norm": 1.0}
    >>> [change.describe("checkpoint") for change in hyperparameter_changes(saved, {**saved, "max_grad_norm": 0.5})]
    ['max_grad_norm: 1.0 -> 0.5 (0.5 is in effect: read from the arguments at every step)']
    ```
    """
    return [HyperparameterChange(name, saved[name], current.get(name)) for name in _FIELDS
            if name in saved and saved[name] != current.get(name)]


def report_hyperparameter_changes(changes: list[HyperparameterChange], *, checkpoint: str, mode: str) -> None:
    """One WARNING naming every change, which value is in effect, and how to apply the other."""
    if not changes:
        return
    logger.warning("Resuming %s with changed hyperparameters: %s. The run no longer continues the interrupted one "
                   "exactly.", checkpoint, "; ".join(change.describe(mode) for change in changes))


def apply_new_hyperparameters(optimizer: Any, scheduler: Any, changes: list[HyperparameterChange], *,
                              decay_groups: list[bool] | None = None) -> None:
    """Write the new learning rate, weight decay, Adam betas and epsilon into a restored optimizer and scheduler.

    The learning rate is rescaled by ``new / old`` in the scheduler's base learning rates (groups with their own
    learning rates keep their ratios), and the current learning rate of every group is recomputed from the
    rebuilt schedule at the checkpoint's step (``LambdaLR`` schedules), so the first resumed step already trains
    with the new schedule. A weight decay is replaced in the groups flagged by ``decay_groups`` (the Trainer's
    decay group; default: the groups that hold the old value), a beta or epsilon where the group holds the old one.
    """
    by_name = {change.name: change for change in changes}
    lr = by_name.get("learning_rate")
    ratio = lr.new / lr.old if lr is not None and lr.old else 1.0
    for group in optimizer.param_groups:
        group["lr"] = group["lr"] * ratio
        if "initial_lr" in group:
            group["initial_lr"] = group["initial_lr"] * ratio
    if scheduler is not None and hasattr(scheduler, "base_lrs"):
        scheduler.base_lrs = [base * ratio for base in scheduler.base_lrs]
        lambdas = getattr(scheduler, "lr_lambdas", None)
        if lambdas is not None and len(lambdas) == len(optimizer.param_groups):
            for group, base, schedule in zip(optimizer.param_groups, scheduler.base_lrs, lambdas):
                group["lr"] = base * schedule(scheduler.last_epoch)
        if hasattr(scheduler, "_last_lr"):
            scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
    decay = by_name.get("weight_decay")
    for index, group in enumerate(optimizer.param_groups):
        if decay is not None:
            flagged = decay_groups[index] if decay_groups is not None else group.get("weight_decay") == decay.old
            if flagged:
                group["weight_decay"] = decay.new
        eps = by_name.get("adam_epsilon")
        if eps is not None and group.get("eps") == eps.old:
            group["eps"] = eps.new
        betas = group.get("betas")
        if isinstance(betas, (tuple, list)) and len(betas) == 2:
            new = list(betas)
            for position, name in enumerate(("adam_beta1", "adam_beta2")):
                change = by_name.get(name)
                if change is not None and betas[position] == change.old:
                    new[position] = change.new
            group["betas"] = type(betas)(new)
