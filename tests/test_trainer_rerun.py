"""Re-running a finished run, or restarting one killed after its last checkpoint, trains nothing more.

``max_steps`` (or a fractional ``num_train_epochs``) that is not a multiple of the steps per epoch used to
send the restart into a new ``_run_epoch`` pass that trained step ``max_steps + 1``. Now the restart
returns the same ``TrainOutput``, ends bit-identical to the uninterrupted run, and a re-run of a finished
run writes nothing at all. A checkpoint written by the last step of an epoch, before that epoch's
end-of-epoch logging (``logging_strategy="epoch"``), is followed on restart by exactly that logging.

Each run is a separate process (tests/trainer_scripts/train_tiny.py), killed with SIGKILL.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.trainer_runs import KILLED, _load, _resumed_from, _run, assert_identical, snapshot

# 44 samples, batch 4: 11 batches per epoch.
CONFIGS = {
    # GA 1: 11 steps per epoch, max_steps 5 (not a multiple): the final checkpoint is mid-epoch.
    "max_steps_mid_epoch": ["--model", "gpt2", "--data", "lm", "--max-steps", "5"],
    # GA 2: 6 steps per epoch; 1.5 epochs -> max_steps 9; the loss is logged at every epoch end only, so the
    # checkpoints of steps 6 and 9 precede an epoch-end log entry.
    "epochs_log_per_epoch": ["--model", "gpt2", "--data", "lm", "--ga", "2", "--epochs", "1.5",
                             "--logging-strategy", "epoch"],
}


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("rerun-references")
    for name, options in CONFIGS.items():
        _run(root / name, options)
    return {name: root / name for name in CONFIGS}


@pytest.mark.slow
@pytest.mark.parametrize("config, kills", [pytest.param("max_steps_mid_epoch", [5], marks=pytest.mark.extended),
                                           ("epochs_log_per_epoch", [6, 9])],
                         ids=["max-steps-mid-epoch", "fractional-epochs-epoch-end-logging"])
def test_restart_after_the_last_checkpoint_trains_nothing_more(references: dict[str, Path], tmp_path: Path,
                                                               config: str, kills: list[int]) -> None:
    run = tmp_path / "run"
    for step in kills:
        _run(run, CONFIGS[config], expected=KILLED, kill_after_save=step)
    _run(run, CONFIGS[config])
    assert _resumed_from(run).endswith(f"checkpoint-{kills[-1]}")
    assert_identical(references[config], run)
    last = kills[-1]
    assert not (run / f"checkpoint-{last + 1}").exists()
    if config == "epochs_log_per_epoch":  # one loss entry per epoch end: steps 6 and 9
        losses = [entry["step"] for entry in _load(run)[0]["log_history"] if "loss" in entry]
        assert losses == [6, 9]


@pytest.mark.slow
@pytest.mark.parametrize("config", ["max_steps_mid_epoch",
                                    pytest.param("epochs_log_per_epoch", marks=pytest.mark.extended)],
                         ids=["max-steps-mid-epoch", "fractional-epochs"])
def test_rerunning_a_finished_run_is_a_no_op(references: dict[str, Path], tmp_path: Path, config: str) -> None:
    import shutil

    run = tmp_path / "run"
    shutil.copytree(references[config], run)
    before = snapshot(run)
    _run(run, CONFIGS[config])  # the same command again
    assert snapshot(run) == before, "a re-run of a finished run wrote something"
    assert _resumed_from(run) is not None
    assert_identical(references[config], run)  # same TrainOutput, weights, optimizer state, log history
