"""Stateful callbacks resume with their state by default.

``EarlyStoppingCallback`` keeps its patience counter in every checkpoint, but ``transformers.Trainer``
restores it only with ``restore_callback_states_from_checkpoint=True`` (default ``False``): a resumed run
then trains past the step where the uninterrupted run stopped. ``ResumableTrainer`` restores it unless
``restore_callback_states=False``. A run the callback stopped is finished: restarting it trains nothing.

Each run is a separate process (tests/trainer_scripts/train_tiny.py), killed with SIGKILL.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers.trainer_runs import KILLED, _load, _resumed_from, _run, assert_identical

# Evaluate and save every 2 steps; patience 3 with threshold 1.0: the evaluations at steps 4, 6, 8 do not count as
# improvements, so the run stops at step 8 of 22 (2 epochs of 11 steps).
OPTIONS = ["--model", "gpt2", "--data", "lm", "--eval", "--save-steps", "2", "--early-stopping", "3", "--epochs", "2"]
STOP_STEP = 8


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    output = tmp_path_factory.mktemp("early-stopping") / "reference"
    _run(output, OPTIONS)
    assert _load(output)[0]["global_step"] == STOP_STEP  # the callback, not max_steps, ended the run
    return output


def _patience_counter(checkpoint: Path) -> int:
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    return state["stateful_callbacks"]["EarlyStoppingCallback"]["attributes"]["early_stopping_patience_counter"]


@pytest.mark.slow
def test_early_stopping_counter_is_restored_on_resume(reference: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    _run(run, OPTIONS, expected=KILLED, kill_after_save=6)
    assert _patience_counter(run / "checkpoint-6") == 2
    _run(run, OPTIONS)
    assert _resumed_from(run).endswith("checkpoint-6")
    assert_identical(reference, run)


@pytest.mark.extended
def test_opting_out_resumes_with_fresh_callbacks(reference: Path, tmp_path: Path) -> None:
    """restore_callback_states=False (the stock default): the counter restarts at 0 and the run goes on longer."""
    run = tmp_path / "run"
    options = OPTIONS + ["--no-restore-callbacks"]
    _run(run, options, expected=KILLED, kill_after_save=6)
    _run(run, options)
    assert _load(run)[0]["global_step"] > STOP_STEP


@pytest.mark.slow
def test_a_run_the_callback_stopped_is_finished(reference: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    _run(run, OPTIONS, expected=KILLED, kill_after_save=STOP_STEP)  # killed after the stopping step's save
    _run(run, OPTIONS)
    assert _resumed_from(run).endswith(f"checkpoint-{STOP_STEP}")
    assert not (run / f"checkpoint-{STOP_STEP + 2}").exists()
    assert_identical(reference, run)
