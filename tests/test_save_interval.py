"""The automatic save interval: the PURE Young/Daly planner (integrations/_interval.py), the callback's measurements
on a fake clock (integrations/_save_interval.py), and ``ResumableTrainer(mean_time_between_failures=...)``."""

from __future__ import annotations

import logging
import math
from types import SimpleNamespace

import pytest
import torch
from transformers import TrainingArguments

from hf_resumable import ResumableTrainer
from hf_resumable.errors import SaveIntervalError
from hf_resumable.integrations import _save_interval
from hf_resumable.integrations._interval import (
    daly_interval_s,
    expected_loss_fraction,
    has_drifted,
    plan_save_interval,
)
from hf_resumable.integrations._save_interval import AutoSaveInterval

from helpers.tiny_models import VOCAB, tiny_gpt2

# ------------------------------------------------------------------------------------------------ the pure planner


def test_daly_reduces_to_young_when_saves_are_cheap() -> None:
    young = math.sqrt(2 * 1.0 * 1e6)
    assert daly_interval_s(1.0, 1e6) == pytest.approx(young, rel=1e-3)
    assert daly_interval_s(1.0, 1e6) > young - 1.0  # Daly's correction adds a little, then subtracts C


def test_a_save_costlier_than_two_failure_intervals_saves_once_per_interval() -> None:
    assert daly_interval_s(10.0, 4.0) == 4.0


def test_the_plan_minimises_the_expected_loss() -> None:
    plan = plan_save_interval(save_cost_s=2.0, step_time_s=0.1, mean_time_between_failures_s=900.0)
    assert plan.steps == round(daly_interval_s(2.0, 900.0) / 0.1)
    at = lambda seconds: expected_loss_fraction(seconds, save_cost_s=2.0, mean_time_between_failures_s=900.0)  # noqa: E731
    assert plan.expected_loss_fraction == pytest.approx(at(plan.seconds))
    assert at(plan.seconds) < at(plan.seconds / 2) and at(plan.seconds) < at(plan.seconds * 2)


def test_min_and_max_steps_bound_the_interval() -> None:
    cheap = dict(save_cost_s=0.01, step_time_s=1.0, mean_time_between_failures_s=10.0)
    assert plan_save_interval(**cheap).steps == 1
    assert plan_save_interval(**cheap, min_steps=4).steps == 4  # a background write takes 3 steps
    assert plan_save_interval(save_cost_s=5.0, step_time_s=0.01, mean_time_between_failures_s=1e5,
                              max_steps=100).steps == 100


@pytest.mark.parametrize("field", ["save_cost_s", "step_time_s", "mean_time_between_failures_s"])
@pytest.mark.parametrize("value", [0.0, -1.0, math.inf, math.nan])
def test_times_must_be_positive_and_finite(field: str, value: float) -> None:
    values = {"save_cost_s": 1.0, "step_time_s": 1.0, "mean_time_between_failures_s": 60.0, field: value}
    with pytest.raises(ValueError, match=field):
        plan_save_interval(**values)


def test_crossed_step_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="min_steps"):
        plan_save_interval(save_cost_s=1.0, step_time_s=1.0, mean_time_between_failures_s=60.0, min_steps=5,
                           max_steps=2)


def test_drift_is_a_factor_either_way() -> None:
    plan = plan_save_interval(save_cost_s=1.0, step_time_s=0.5, mean_time_between_failures_s=600.0)
    assert not has_drifted(plan, save_cost_s=0.7, step_time_s=0.7)
    assert has_drifted(plan, save_cost_s=0.6, step_time_s=0.5)
    assert has_drifted(plan, save_cost_s=1.0, step_time_s=0.8)


# ---------------------------------------------------------------------------- the callback's measurements (fake clock)


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def _drive(callback: AutoSaveInterval, monkeypatch: pytest.MonkeyPatch, *, steps: int, step_s: float,
           stall_s: float, write_steps: int = 0, expedited: list[int] | None = None) -> list[int]:
    """Run ``steps`` optimizer steps of ``step_s`` through the callback; a save stalls the next step by ``stall_s``
    and stays in flight for ``write_steps`` steps (``expedited`` collects the steps at which the callback gave the
    write in flight the loop's priority back). Returns the steps that saved."""
    clock, in_flight = _Clock(), [0]
    state, saved, stall = SimpleNamespace(global_step=0, max_steps=steps), [], 0.0
    expedited = [] if expedited is None else expedited

    def expedite() -> bool:
        expedited.append(state.global_step)
        return in_flight[0] > 0

    monkeypatch.setattr(_save_interval, "time", clock)
    monkeypatch.setattr(_save_interval, "background_saver",
                        lambda: SimpleNamespace(writing=in_flight[0] > 0, expedite=expedite))
    callback.on_train_begin(None, state, SimpleNamespace())
    for step in range(1, steps + 1):
        clock.now += step_s + stall
        state.global_step, stall = step, 0.0
        in_flight[0] = max(0, in_flight[0] - 1)
        control = SimpleNamespace(should_save=False)
        callback.on_step_end(None, state, control)
        if control.should_save:
            saved.append(step)
            callback.on_save(None, state, control)
            stall, in_flight[0] = stall_s, write_steps
    return saved


def test_a_blocking_save_is_measured_then_planned(monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    callback = AutoSaveInterval(mean_time_between_failures=200.0)
    with caplog.at_level(logging.INFO, logger=_save_interval.__name__):
        saved = _drive(callback, monkeypatch, steps=60, step_s=0.5, stall_s=4.0)
    expected = plan_save_interval(save_cost_s=4.0, step_time_s=0.5, mean_time_between_failures_s=200.0)
    assert callback.plan == expected and expected.steps > 60  # ~sqrt(2 * 4 * 200) = 40 s: beyond the run
    assert saved == [2]  # the probe only
    assert f"every {expected.steps} steps" in caplog.text


def test_a_write_still_in_flight_when_the_next_save_is_due_is_expedited(monkeypatch: pytest.MonkeyPatch) -> None:
    """Failures so often that saving every step is best, and writes that take 3 steps: the interval stays the
    planned one (the write's duration is not planned on), each write is expedited once, at the first step end the
    next save is due, and the next save follows its commit."""
    callback, expedited = AutoSaveInterval(mean_time_between_failures=1.0), []
    saved = _drive(callback, monkeypatch, steps=30, step_s=1.0, stall_s=0.2, write_steps=3, expedited=expedited)
    assert callback.plan.steps == 1 and callback.plan.save_cost_s == pytest.approx(0.2)
    assert saved == list(range(2, 31, 3))  # every save waits for the previous commit
    assert expedited == [s + 1 for s in saved[:-1]]  # the probe too: its cost so far already made it due


def test_a_write_is_not_expedited_before_the_next_save_is_due(monkeypatch: pytest.MonkeyPatch) -> None:
    callback, expedited = AutoSaveInterval(mean_time_between_failures=600.0), []
    saved = _drive(callback, monkeypatch, steps=80, step_s=0.5, stall_s=0.5, write_steps=5, expedited=expedited)
    assert callback.plan.steps > 5 and expedited == []
    assert saved == list(range(2, 81, callback.plan.steps))


def test_measurements_survive_in_the_checkpoint_state() -> None:
    callback = AutoSaveInterval(mean_time_between_failures=60.0)
    callback.step_times, callback.save_costs = [0.5, 0.5], [1.0]
    state = callback.state()
    restored = AutoSaveInterval(**state["args"])
    for name, value in state["attributes"].items():  # as Trainer._load_callback_state restores it
        setattr(restored, name, value)
    restored.on_train_begin(None, SimpleNamespace(global_step=10), None)
    assert restored.plan == plan_save_interval(save_cost_s=1.0, step_time_s=0.5, mean_time_between_failures_s=60.0)


# ------------------------------------------------------------------------------------------- through ResumableTrainer


def _trainer(tmp_path, **options) -> ResumableTrainer:
    ids = torch.randint(3, VOCAB, (32, 16), generator=torch.Generator().manual_seed(0)).tolist()
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=options.pop("max_steps", 6),
                             per_device_train_batch_size=2, save_strategy=options.pop("save_strategy", "steps"),
                             save_steps=1000, report_to=[], disable_tqdm=True, use_cpu=True, logging_steps=1000)
    return ResumableTrainer(model=tiny_gpt2(), args=args, train_dataset=[{"input_ids": r, "labels": r} for r in ids],
                            **options)


def test_the_trainer_saves_at_the_planned_interval(tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    """Failures every microsecond: every step is worth a checkpoint once the probe save at step 2 has been
    measured; save_steps=1000 is replaced."""
    trainer = _trainer(tmp_path, mean_time_between_failures=1e-6)
    with caplog.at_level(logging.INFO, logger=_save_interval.__name__):
        trainer.train()
    saved = sorted(int(p.name.split("-")[1]) for p in (tmp_path / "out").glob("checkpoint-*"))
    assert saved == [2, 3, 4, 5, 6]
    callback = next(c for c in trainer.callback_handler.callbacks if isinstance(c, AutoSaveInterval))
    assert callback.plan.steps == 1 and "Saving checkpoints every 1 steps" in caplog.text


@pytest.mark.parametrize("value", [0, -5.0, math.inf, "3600", True])
def test_an_invalid_mean_time_between_failures_is_refused(tmp_path, value) -> None:
    with pytest.raises(SaveIntervalError, match="mean_time_between_failures must be a positive number"):
        _trainer(tmp_path, mean_time_between_failures=value)


def test_the_automatic_interval_needs_step_saves(tmp_path) -> None:
    with pytest.raises(SaveIntervalError, match="save_strategy='steps'"):
        _trainer(tmp_path, mean_time_between_failures=60.0, save_strategy="epoch")


def test_make_resumable_classes_take_the_option_too(tmp_path) -> None:
    from transformers import Trainer

    from hf_resumable.integrations.trainer import make_resumable

    class UsersTrainer(Trainer):  # a Trainer subclass, as TRL's are
        pass

    trainer = _trainer(tmp_path, mean_time_between_failures=60.0)
    resumable = make_resumable(UsersTrainer)(model=trainer.model, args=trainer.args,
                                             train_dataset=trainer.train_dataset, mean_time_between_failures=60.0)
    assert any(isinstance(c, AutoSaveInterval) for c in resumable.callback_handler.callbacks)
    with pytest.raises(SaveIntervalError, match="mean_time_between_failures must be a positive number"):
        make_resumable(UsersTrainer)(model=trainer.model, args=trainer.args, train_dataset=trainer.train_dataset,
                                mean_time_between_failures=-1.0)
