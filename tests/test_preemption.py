"""The preemption protocol with a notice (hf_resumable/preemption.py), and both front doors using it.

* The rule and the protocol, with a fake clock: what each step boundary decides, from the measured step and save
  times and the time left (no timing-dependent asserts: the clock is the test's).
* Real processes sent a real SIGTERM (tests/trainer_scripts/train_tiny.py and examples/custom_loop.py signal
  themselves at a chosen step): a notice long enough for the job to end (exit 0, the notice checkpoint committed,
  final weights equal to the uninterrupted run's), and one that runs out (a checkpoint at a later step than the
  signal's, exit 143, the same command resumes bit-exact). The notice that runs out is made certain by the step
  time: every step after the signal sleeps longer than the whole notice.
* Two ranks (gloo), one signalled, each with its own clock: every boundary ends with the same action on both.
"""

from __future__ import annotations

import json
import math
import os
import signal
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

from hf_resumable import preemption
from hf_resumable.integrations._core import ResumeOptions
from hf_resumable.preemption import (
    PREEMPTION_EXIT_CODE,
    PreemptionAction,
    PreemptionHandler,
    PreemptionProtocol,
    check_notice,
    fits_another_step,
)

from helpers.accelerate_runs import reference_run as accelerate_reference  # noqa: F401 - one reference run

CPU = torch.device("cpu")
TRAIN, SAVE_AND_TRAIN, SAVE_AND_EXIT, EXIT = (PreemptionAction.TRAIN, PreemptionAction.SAVE_AND_TRAIN,
                                              PreemptionAction.SAVE_AND_EXIT, PreemptionAction.EXIT)


class Clock:
    """A clock the test moves."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _signal(handler: PreemptionHandler, at: float) -> None:
    """A real SIGTERM into ``handler``, timed on the test's clock."""
    with handler:
        os.kill(os.getpid(), signal.SIGTERM)
    assert handler.requested
    handler.received_at = at


# ------------------------------------------------------------------------------------------------ the rule (pure)


def test_the_rule_needs_room_for_a_step_a_save_and_the_margin():
    # notice 30 s: margin max(1 s, 3 s) = 3 s; 1.5 x (0.5 + 3) = 5.25 s -> 8.25 s needed
    assert fits_another_step(time_left_s=8.25, step_s=0.5, save_s=3.0, notice_s=30.0)
    assert not fits_another_step(time_left_s=8.2, step_s=0.5, save_s=3.0, notice_s=30.0)
    # a short notice: the margin is 1 s
    assert fits_another_step(time_left_s=2.5, step_s=0.5, save_s=0.5, notice_s=5.0)
    assert not fits_another_step(time_left_s=2.4, step_s=0.5, save_s=0.5, notice_s=5.0)
    assert not fits_another_step(time_left_s=-1.0, step_s=0.0, save_s=0.0, notice_s=5.0)


@pytest.mark.parametrize("bad", [0, -3.0, math.inf, math.nan, True, "30"])
def test_a_notice_must_be_a_positive_number_of_seconds(bad):
    with pytest.raises(ValueError, match="preemption_notice must be a positive number of seconds"):
        check_notice(bad)
    with pytest.raises(ValueError, match="preemption_notice"):
        ResumeOptions(preemption_notice=bad)
    assert check_notice(None) is None and check_notice(30) == 30.0
    assert ResumeOptions().preemption_notice is None and ResumeOptions(preemption_notice=5).preemption_notice == 5.0


# ------------------------------------------------------------------------------------------ the protocol, one rank


def test_without_a_notice_the_signals_step_is_saved_and_the_process_exits():
    clock, handler = Clock(), PreemptionHandler()
    protocol = PreemptionProtocol(handler, clock=clock)
    assert protocol.at_step_boundary(device=CPU, step=1) is TRAIN
    _signal(handler, clock.now)
    assert protocol.at_step_boundary(device=CPU, step=2) is SAVE_AND_EXIT
    assert protocol.signalled


def test_with_a_notice_it_checkpoints_trains_on_and_stops_when_a_step_and_a_save_no_longer_fit():
    clock, handler = Clock(), PreemptionHandler()
    protocol = PreemptionProtocol(handler, notice=10.0, clock=clock)
    actions = []
    for step in range(1, 3):  # steps of 1 s
        clock.now += 1.0
        actions.append(protocol.at_step_boundary(device=CPU, step=step))
    _signal(handler, clock.now + 0.5)  # during step 3
    clock.now += 1.0
    actions.append(protocol.at_step_boundary(device=CPU, step=3))
    assert actions == [TRAIN, TRAIN, SAVE_AND_TRAIN] and protocol.saved_step == 3
    started = clock.now
    clock.now += 0.5  # a blocking notice save of 0.5 s
    protocol.notice_saved(started=started, future=None)
    # From now on the rule needs 1.5 x (1 s step + 0.5 s save) + 1 s = 3.25 s; the signal came at 102.5, the notice
    # ends at 112.5. The save's 0.5 s is not counted as step time.
    step, decided = 3, []
    while not decided or decided[-1] is TRAIN:
        step, clock.now = step + 1, clock.now + 1.0
        decided.append(protocol.at_step_boundary(device=CPU, step=step))
        assert protocol.estimates(clock.now) == (1.0, 0.5)
    # 7.5 s left after step 4 ... 3.5 s after step 8, 2.5 s after step 9: stop there
    assert decided == [TRAIN] * 5 + [SAVE_AND_EXIT] and step == 9


def test_a_background_notice_save_counts_three_times_its_elapsed_time_until_it_commits():
    clock, handler = Clock(), PreemptionHandler()
    protocol = PreemptionProtocol(handler, notice=30.0, clock=clock)
    clock.now += 1.0
    assert protocol.at_step_boundary(device=CPU, step=1) is TRAIN
    _signal(handler, clock.now)
    clock.now += 1.0
    assert protocol.at_step_boundary(device=CPU, step=2) is SAVE_AND_TRAIN
    write: Future = Future()
    started = clock.now
    clock.now += 0.1  # staging
    protocol.notice_saved(started=started, future=write)
    clock.now += 2.0
    assert protocol.estimates(clock.now) == (1.0, pytest.approx(3 * 2.1))
    write.set_result(None)  # committed now, 2.1 s after the save call
    assert protocol.estimates(clock.now) == (1.0, pytest.approx(2.1))
    # 26 s left: 1.5 x (2.0 s, the last step being the longest + 2.1 s) + 3 s fits
    assert protocol.at_step_boundary(device=CPU, step=3) is TRAIN


def test_the_epoch_end_call_at_the_same_step_measures_nothing_and_keeps_the_notice_checkpoint():
    clock, handler = Clock(), PreemptionHandler()
    protocol = PreemptionProtocol(handler, notice=0.5, clock=clock)
    clock.now += 1.0
    protocol.at_step_boundary(device=CPU, step=1)
    _signal(handler, clock.now)
    clock.now += 1.0
    assert protocol.at_step_boundary(device=CPU, step=2) is SAVE_AND_TRAIN
    protocol.notice_saved(started=clock.now, future=None)
    clock.now += 5.0  # the notice is over, but this is the same step (Trainer's call after on_epoch_end)
    assert protocol.at_step_boundary(device=CPU, step=2) is TRAIN
    clock.now += 1.0
    assert protocol.at_step_boundary(device=CPU, step=3) is SAVE_AND_EXIT


def test_told_by_another_rank_it_times_the_notice_from_then(monkeypatch, caplog):
    """A rank without the signal learns of it from the all-reduce; if another rank says stop at the notice step
    itself, the notice checkpoint is that step's: exit without saving again."""
    clock = Clock()
    protocol = PreemptionProtocol(PreemptionHandler(), notice=10.0, clock=clock)
    others = iter([preemption._IN_NOTICE, preemption._STOP])
    monkeypatch.setattr(preemption, "_all_reduce_max", lambda value, device: max(value, next(others)))
    with caplog.at_level("WARNING", logger="hf_resumable.preemption"):
        assert protocol.at_step_boundary(device=CPU, step=4) is SAVE_AND_TRAIN
    assert protocol.signalled_at == clock.now and "another rank received a preemption signal" in caplog.text
    assert protocol.at_step_boundary(device=CPU, step=4) is EXIT


def test_reset_forgets_the_signal():
    clock, handler = Clock(), PreemptionHandler()
    protocol = PreemptionProtocol(handler, notice=10.0, clock=clock)
    _signal(handler, clock.now)
    assert protocol.at_step_boundary(device=CPU, step=1) is SAVE_AND_TRAIN
    protocol.reset()
    assert not handler.requested and handler.received_at is None and not protocol.signalled
    assert protocol.at_step_boundary(device=CPU, step=2) is TRAIN


# --------------------------------------------------------------------------------- ResumableTrainer, in process


def test_trainer_in_process_rides_out_a_long_notice(tmp_path: Path):
    """SIGTERM at step 2 of 5 with an hour's notice: the notice checkpoint, then the run ends normally."""
    from transformers import TrainerCallback

    from helpers.trainers import _trainer

    class SendSigterm(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 1:
                os.kill(os.getpid(), signal.SIGTERM)

    trainer = _trainer(tmp_path, max_steps=5, preemption_notice=3600.0, callbacks=[SendSigterm()])
    trainer.args.save_steps = 100
    output = trainer.train()
    assert not trainer.preempted and output.global_step == 5
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-5"]


@pytest.mark.parametrize("save_async", [False, True], ids=["blocking", "background"])
def test_trainer_in_process_with_a_notice_shorter_than_a_step_saves_one_step_later(tmp_path: Path, save_async):
    """SIGTERM during step 2 of 5, a 1 ms notice: checkpoint-2 (the notice checkpoint), step 3, then checkpoint-3 and
    the stop (``exit_on_preemption=False``: ``train`` returns)."""
    from transformers import TrainerCallback

    from helpers.trainers import _trainer

    class SendSigterm(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 1:
                os.kill(os.getpid(), signal.SIGTERM)

    trainer = _trainer(tmp_path, max_steps=5, preemption_notice=0.001, exit_on_preemption=False,
                       save_async=save_async, callbacks=[SendSigterm()])
    trainer.args.save_steps = 100
    output = trainer.train()
    assert trainer.preempted and output.global_step == 3
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]
    assert all((tmp_path / name / "manifest.json").is_file() for name in ("checkpoint-2", "checkpoint-3"))


# ------------------------------------------------------------------------------ real processes, real SIGTERM


def _trainer_runs():
    from helpers import trainer_runs as grid

    return grid


NOTICE_CONFIG = ["--model", "gpt2", "--data", "lm", "--ga", "1", "--epochs", "1", "--save-steps", "100"]


@pytest.fixture(scope="module")
def notice_reference(tmp_path_factory) -> Path:
    grid = _trainer_runs()
    output = tmp_path_factory.mktemp("notice-reference") / "run"
    grid._run(output, NOTICE_CONFIG)
    return output


@pytest.mark.slow
def test_trainer_process_that_finishes_within_the_notice_exits_0_with_the_uninterrupted_weights(notice_reference,
                                                                                               tmp_path):
    grid = _trainer_runs()
    run = tmp_path / "run"
    # SIGTERM at the start of step 4 of 11; an hour's notice: checkpoint-4, then the job ends normally.
    grid._run(run, NOTICE_CONFIG + ["--preemption-notice", "3600"], expected=0, sigterm_at=3)
    assert (run / "checkpoint-4" / "manifest.json").is_file()  # the notice checkpoint (saves every 100 steps)
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-11", "checkpoint-4"]
    assert "reached its end (step 11) within the 3600 s notice" in (tmp_path / "run.log").read_text()
    grid.assert_identical(notice_reference, run)


@pytest.mark.slow
# the blocking notice save is also run in process (test_trainer_in_process_with_a_notice_shorter_than_a_step_...)
@pytest.mark.parametrize("save_async", [pytest.param(False, marks=pytest.mark.extended), True],
                         ids=["blocking", "background"])
def test_trainer_process_whose_notice_runs_out_saves_a_later_step_exits_143_and_resumes_exactly(
        notice_reference, tmp_path, save_async):
    grid = _trainer_runs()
    run = tmp_path / "run"
    options = NOTICE_CONFIG + ["--save-async"] * save_async
    # SIGTERM at the start of step 4; a 2 s notice and steps of more than 2 s from then on: checkpoint-4 (the notice
    # checkpoint), step 5 trained, then no room for another step: checkpoint-5, exit 143.
    grid._run(run, options + ["--preemption-notice", "2"], expected=PREEMPTION_EXIT_CODE, sigterm_at=3,
              slow_after_sigterm=2.5)
    assert (run / "checkpoint-4" / "manifest.json").is_file() and (run / "checkpoint-5" / "manifest.json").is_file()
    assert not (run / "checkpoint-6").exists()
    assert json.loads((run / "exit-rank0.json").read_text()) == {"code": PREEMPTION_EXIT_CODE, "global_step": 5}
    grid._run(run, options + ["--preemption-notice", "2"])  # the same command
    assert grid._resumed_from(run).endswith("checkpoint-5")
    grid.assert_identical(notice_reference, run)


@pytest.mark.distributed
# make test checks the ranks' agreement on the notice in process (test_told_by_another_rank_...)
# and the two-rank SIGTERM protocol without a notice (test_trainer_distributed); this torchrun run is in make test-all.
@pytest.mark.extended
def test_two_ranks_one_signalled_train_on_then_stop_at_the_same_step_and_resume_exactly(tmp_path):
    """torchrun, 2 ranks: rank 1 alone gets SIGTERM at the start of step 4, and a 2 s notice that steps of 2.5 s
    from then on make certain to run out: both ranks checkpoint step 4 (in the background, the default under
    torchrun), train step 5, agree that no other step fits, save step 5 and exit 143 (rank 0 timing the notice
    from the boundary where it learnt of it)."""
    from helpers import trainer_runs as two

    reference = two.torchrun(tmp_path / "reference")
    assert reference.returncode == 0, reference.stdout[-5000:]
    run, grid = tmp_path / "run", _trainer_runs()
    options = ["--output-dir", str(run), *two.OPTIONS, "--preemption-notice", "2"]
    signals = grid._env(sigterm_at=3, signal_rank=1, slow_after_sigterm=2.5)
    preempted = two.run_torchrun(two.SCRIPT, options, env=signals, timeout=180)
    assert f"exitcode: {PREEMPTION_EXIT_CODE}" in preempted.stdout, preempted.stdout[-5000:]
    exits = [json.loads((run / f"exit-rank{rank}.json").read_text()) for rank in (0, 1)]
    assert exits == [{"code": PREEMPTION_EXIT_CODE, "global_step": 5}] * 2
    assert "another rank received a preemption signal; saving step 4 on every rank and training on" in preempted.stdout
    resumed = two.run_torchrun(two.SCRIPT, options, env=grid._env(), timeout=180)  # the same command
    assert resumed.returncode == 0, resumed.stdout[-5000:]
    two._assert_every_rank_identical(tmp_path / "reference", run, "checkpoint-5")


# ------------------------------------------------------------------------- ResumableAccelerator, real processes


@pytest.mark.slow
def test_accelerate_loop_that_ends_within_the_notice_exits_0_with_the_uninterrupted_run(accelerate_reference,
                                                                                       tmp_path):
    from helpers.accelerate_runs import assert_same_run, run_example

    done = run_example(tmp_path, num_workers=0, extra=("--preemption-notice", "3600"),
                       env={"HF_RESUMABLE_EXAMPLE_TERM_AFTER_STEP": "5"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"Saved {tmp_path / 'checkpoints' / 'checkpoint-5'} (" in done.stderr  # committed: the notice checkpoint
    assert "training loop ended (step 8) within the 3600 s notice" in done.stderr and "Preempted" not in done.stderr
    assert_same_run(tmp_path, accelerate_reference)


@pytest.mark.slow
def test_accelerate_notice_that_runs_out_saves_a_later_step_exits_143_and_resumes_exactly(accelerate_reference,
                                                                                         tmp_path):
    """A notice shorter than any step: checkpoint-5 in the background when the signal is seen after step 5, step 6
    trained, then no room for another: checkpoint-6, exit 143."""
    from helpers.accelerate_runs import assert_same_run, read_losses, run_example

    options = ("--save-async", "--preemption-notice", "0.001")
    interrupted = run_example(tmp_path, num_workers=0, extra=options,
                              env={"HF_RESUMABLE_EXAMPLE_TERM_AFTER_STEP": "5"})
    assert interrupted.returncode == PREEMPTION_EXIT_CODE, interrupted.stderr[-3000:]
    assert f"Saved {tmp_path / 'checkpoints' / 'checkpoint-5'} (" in interrupted.stderr
    assert "Preempted (signal 15): checkpoint at step 6 committed" in interrupted.stderr
    assert max(step for step, _ in read_losses(tmp_path)) == 6
    resumed = run_example(tmp_path, num_workers=0, extra=options)  # the same command
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"Resumed from {tmp_path / 'checkpoints' / 'checkpoint-6'}" in resumed.stderr
    assert_same_run(tmp_path, accelerate_reference)
