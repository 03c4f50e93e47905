"""How often to checkpoint: the interval that minimises the expected time lost to failures (Young/Daly). PURE.

A save costs the run ``C`` seconds, failures come every ``M`` seconds on average; ``C`` is what the training loop
loses to one save (docs/trainer.md, "A save interval that fits the failure rate").
"""

from __future__ import annotations

import dataclasses
import logging
import math

logger = logging.getLogger(__name__)

__all__ = ["SaveIntervalPlan", "expected_loss_fraction", "has_drifted", "plan_save_interval"]


@dataclasses.dataclass(frozen=True)
class SaveIntervalPlan:
    """The interval chosen, in optimizer ``steps`` (``seconds`` of training), the measurements it was chosen from,
    and the expected share of wall time lost at it (:func:`expected_loss_fraction`)."""

    steps: int
    seconds: float
    save_cost_s: float
    step_time_s: float
    mean_time_between_failures_s: float
    expected_loss_fraction: float

    def describe(self) -> str:
        """One line for the log: the interval and what it was chosen from."""
        return (f"every {self.steps} steps ({self.seconds:.1f} s): a save costs {self.save_cost_s:.2f} s, a step "
                f"{self.step_time_s:.3f} s, failures every {self.mean_time_between_failures_s:.0f} s on average; "
                f"expected loss {100 * self.expected_loss_fraction:.1f} % of the wall time")


def _check_positive(**values: float) -> None:
    for name, value in values.items():
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a positive, finite number of seconds, got {value!r}.")


def daly_interval_s(save_cost_s: float, mean_time_between_failures_s: float) -> float:
    """Daly's optimum interval in seconds of work between checkpoints, for a save cost ``C`` and a mean time between
    failures ``M``: ``sqrt(2 C M) * (1 + sqrt(C / 2M) / 3 + C / 18M) - C`` (Young's ``sqrt(2 C M)`` to first
    order), or ``M`` when a save costs at least ``2 M``."""
    _check_positive(save_cost_s=save_cost_s, mean_time_between_failures_s=mean_time_between_failures_s)
    cost, mtbf = save_cost_s, mean_time_between_failures_s
    if cost >= 2 * mtbf:
        return mtbf
    return math.sqrt(2 * cost * mtbf) * (1 + math.sqrt(cost / (2 * mtbf)) / 3 + cost / (18 * mtbf)) - cost


def expected_loss_fraction(interval_s: float, *, save_cost_s: float, mean_time_between_failures_s: float,
                           restart_s: float = 0.0) -> float:
    """The first-order share of wall time lost at an interval ``T``: ``C / T`` for the saves plus ``(T / 2 + R) / M``
    for the work redone and the restart (``restart_s``, ``R``) after each failure."""
    _check_positive(interval_s=interval_s, save_cost_s=save_cost_s,
                    mean_time_between_failures_s=mean_time_between_failures_s)
    return save_cost_s / interval_s + (interval_s / 2 + restart_s) / mean_time_between_failures_s


def plan_save_interval(*, save_cost_s: float, step_time_s: float, mean_time_between_failures_s: float,
                       min_steps: int = 1, max_steps: int | None = None) -> SaveIntervalPlan:
    """The save interval, in optimizer steps, that minimises the expected time lost (Young/Daly).

    Args:
        save_cost_s (`float`): seconds one save costs the training loop (blocking: the save; background: the stall
            plus the slowdown while it is written).
        step_time_s (`float`): seconds per optimizer step without a save.
        mean_time_between_failures_s (`float`): the expected time between failures (preemptions, crashes).
        min_steps (`int`, *optional*, defaults to `1`): the fewest steps between saves (a background save must
            have committed before the next one).
        max_steps (`int`, *optional*): the most steps between saves.

    Returns:
        `SaveIntervalPlan`: the interval and the measurements it came from.

    Raises:
        ValueError: a time that is not a positive finite number, or ``min_steps``/``max_steps`` below 1 or crossed.

    Example:

    ```python
    >>> plan_save_interval(save_cost_s=0.1, step_time_s=1.0, mean_time_between_failures_s=60.0).steps
    3
    >>> plan = plan_save_interval(save_cost_s=2.0, step_time_s=0.5, mean_time_between_failures_s=3600.0)
    >>> plan.steps, round(plan.seconds)
    (237, 118)
    ```
    """
    _check_positive(save_cost_s=save_cost_s, step_time_s=step_time_s,
                    mean_time_between_failures_s=mean_time_between_failures_s)
    if min_steps < 1 or (max_steps is not None and max_steps < min_steps):
        raise ValueError(f"need 1 <= min_steps <= max_steps, got min_steps={min_steps}, max_steps={max_steps}.")
    steps = max(min_steps, round(daly_interval_s(save_cost_s, mean_time_between_failures_s) / step_time_s))
    if max_steps is not None:
        steps = min(steps, max_steps)
    seconds = steps * step_time_s
    loss = expected_loss_fraction(seconds, save_cost_s=save_cost_s,
                                  mean_time_between_failures_s=mean_time_between_failures_s)
    return SaveIntervalPlan(steps=steps, seconds=seconds, save_cost_s=save_cost_s, step_time_s=step_time_s,
                            mean_time_between_failures_s=mean_time_between_failures_s,
                            expected_loss_fraction=loss)


def has_drifted(plan: SaveIntervalPlan, *, save_cost_s: float, step_time_s: float, factor: float = 1.5) -> bool:
    """Whether new measurements differ enough from the plan's to decide again: the save cost or the step time
    changed by more than ``factor`` either way.

    Example:

    ```python
    >>> plan = plan_save_interval(save_cost_s=1.0, step_time_s=0.5, mean_time_between_failures_s=600.0)
    >>> has_drifted(plan, save_cost_s=1.2, step_time_s=0.5), has_drifted(plan, save_cost_s=3.0, step_time_s=0.5)
    (False, True)
    ```
    """
    def off(new: float, old: float) -> bool:
        return max(new, old) > factor * min(new, old)

    return off(save_cost_s, plan.save_cost_s) or off(step_time_s, plan.step_time_s)
