"""``AutoSaveInterval``: the Trainer saves at the interval that fits the failure rate (Young/Daly), measured live
(docs/trainer.md, "A save interval that fits the failure rate"; the plan is :mod:`._interval`'s).

From the times of ``on_step_end``: the step time is the median of the recent steps without a save; a save's cost is
the extra time of the step that held it plus, while a background save is written, that of every step meanwhile. A
write still in flight when the next save is due gets the loop's priority back and the next save follows its commit:
its duration bounds the interval from below without being planned on.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from ..checkpoint.api import background_saver
from ..errors import SaveIntervalError
from ._interval import SaveIntervalPlan, has_drifted, plan_save_interval

logger = logging.getLogger(__name__)

__all__ = ["AutoSaveInterval", "check_save_strategy"]

_PROBE_AFTER_STEPS = 2  # clean steps measured before the probe save
_WINDOW = 32  # recent step times kept
_COSTS = 5  # recent save costs kept


def check_save_strategy(save_strategy: Any) -> None:
    """Refuse a ``save_strategy`` that the automatic interval cannot drive (it needs ``"steps"``).

    Raises:
        SaveIntervalError: ``save_strategy`` is not ``"steps"``.
    """
    if str(getattr(save_strategy, "value", save_strategy)) != "steps":
        raise SaveIntervalError(
            f"mean_time_between_failures picks when to save, which needs TrainingArguments(save_strategy='steps'), "
            f"got save_strategy={str(getattr(save_strategy, 'value', save_strategy))!r}. Set save_strategy='steps' "
            f"(save_steps is then replaced by the measured interval), or drop mean_time_between_failures.")


class AutoSaveInterval(TrainerCallback, ExportableState):
    """Save at the Young/Daly interval for ``mean_time_between_failures`` (seconds), from the measured save cost and
    step time (``ResumableTrainer(mean_time_between_failures=...)`` adds it).

    Raises:
        SaveIntervalError: ``mean_time_between_failures`` is not a positive, finite number of seconds.

    Example:

    ```python
    >>> from hf_resumable.integrations._save_interval import AutoSaveInterval
    >>> AutoSaveInterval(3600).plan is None  # decided once a save has been measured
    True
    ```
    """

    def __init__(self, mean_time_between_failures: float) -> None:
        value = mean_time_between_failures
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise SaveIntervalError(f"mean_time_between_failures must be a positive number of seconds, got {value!r}: "
                                    f"pass the expected time between preemptions, e.g. 3600.0 for one an hour.")
        self.mean_time_between_failures = float(value)
        self.plan: SaveIntervalPlan | None = None
        self.step_times: list[float] = []  # kept in checkpoints with the costs (lists: JSON)
        self.save_costs: list[float] = []
        self._last_end: float | None = None
        self._last_save: int | None = None
        self._measuring: float | None = None  # extra seconds the save being measured has cost so far
        self._expedited = False  # the write in flight was given the loop's priority back

    def state(self) -> dict:
        return {"args": {"mean_time_between_failures": self.mean_time_between_failures},
                "attributes": {"step_times": list(self.step_times), "save_costs": list(self.save_costs)}}

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._last_end, self._last_save, self._measuring = None, state.global_step, None
        self._replan()

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._last_save, self._measuring, self._expedited = state.global_step, 0.0, False

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        now, writing = time.perf_counter(), background_saver().writing
        if self._last_end is not None:
            self._measure(now - self._last_end, writing)
        self._last_end = now
        if state.global_step >= state.max_steps:
            return  # the Trainer's own end-of-training save stays
        control.should_save = self._wants_save(state.global_step, writing)

    def _measure(self, seconds: float, writing: bool) -> None:
        if self._measuring is None:
            self.step_times = (self.step_times + [seconds])[-_WINDOW:]
            return
        if self.step_times:
            self._measuring += seconds - statistics.median(self.step_times)
        if writing:
            return
        cost, self._measuring = self._measuring, None
        self.save_costs = (self.save_costs + [max(cost, 1e-3)])[-_COSTS:]
        self._replan()

    def _wants_save(self, step: int, writing: bool) -> bool:
        if writing or self._measuring is not None:
            if writing and not self._expedited and self._is_due(step):
                # the next save is due and waits for this one: it is late, at the loop's priority from now on
                self._expedited = background_saver().expedite()
                logger.debug("The save of step %s is still being written at step %s, when the next one is due: "
                             "its writer runs at the training loop's priority from now on.", self._last_save, step)
            return False  # a save now would wait for the one being written
        if self.plan is None:
            return not self.save_costs and step - (self._last_save or 0) >= _PROBE_AFTER_STEPS
        if has_drifted(self.plan, save_cost_s=self.plan.save_cost_s, step_time_s=statistics.median(self.step_times)):
            self._replan()
        return self._is_due(step)

    def _is_due(self, step: int) -> bool:
        """Whether the planned interval has passed since the last save; before the first plan (a probe being
        written), the interval planned from what the probe has cost the loop so far."""
        plan = self.plan
        if plan is None:
            if not self.step_times:
                return False
            plan = plan_save_interval(save_cost_s=max(self._measuring or 0.0, 1e-3),
                                      step_time_s=statistics.median(self.step_times),
                                      mean_time_between_failures_s=self.mean_time_between_failures)
        return step - (self._last_save or 0) >= plan.steps

    def _replan(self) -> None:
        if not (self.save_costs and self.step_times):
            return
        cost, step = statistics.median(self.save_costs), statistics.median(self.step_times)
        if self.plan is not None and not has_drifted(self.plan, save_cost_s=cost, step_time_s=step):
            return
        self.plan = plan_save_interval(save_cost_s=cost, step_time_s=step,
                                       mean_time_between_failures_s=self.mean_time_between_failures)
        logger.info("Saving checkpoints %s.", self.plan.describe())
