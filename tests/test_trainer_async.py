"""ResumableTrainer(save_async=True): checkpoints written in the background end the run exactly as blocking ones.

* one process: an async run ends bit-identical to a blocking run (weights, optimizer state, every logged value),
  every checkpoint was still in flight when ``on_save`` ran, and the checkpoints it kept (``save_total_limit`` with
  a protected best checkpoint) are the same directories with the same files, byte for byte;
* torchrun, 2 processes (gloo): rank 1 SIGKILLed right after the save of step 4 was staged (the job dies with
  checkpoint-4 in flight or just committed); the same command resumes and ends bit-identical, on every rank, to the
  uninterrupted 2-process run with blocking saves;
* a background save that fails (ENOSPC while writing checkpoint-k) raises AsyncSaveError at the next save, or at
  the end of ``train`` for the last one; nothing of checkpoint-k is left and the previous checkpoint is the newest;
* the default (``save_async=None``): background saves under torch.distributed unless a callback overrides
  ``on_save`` (it may read the checkpoint), blocking in one process; ``save_async=False`` opts out.

Each run is a separate process (tests/trainer_scripts/train_tiny.py, tiny GPT-2, 6 steps).
"""

from __future__ import annotations

import functools
import json
import re
import signal
from pathlib import Path
from unittest.mock import patch

import pytest
from transformers import TrainerCallback

from hf_resumable.checkpoint import find_latest_checkpoint, list_checkpoints, read_manifest, verify_checkpoint
from hf_resumable.constants import TRAINER_STATE_FILE
from hf_resumable.integrations.trainer import ResumableTrainer
from hf_resumable.preemption import PREEMPTION_EXIT_CODE

from helpers.distributed_launch import run_torchrun
from helpers.trainer_runs import OPTIONS as TORCHRUN_OPTIONS
from helpers.trainer_runs import (  # noqa: F401
    RANK_SUFFIXES,
    SCRIPT,
    _assert_every_rank_identical,
    _env,
    _run,
    _start,
    _wait,
    assert_identical,
    reference,
)
from helpers.trainers import _checkpoints, _evaluate_with, regression_trainer

# 44 samples, batch 4, GA 1: evaluation every save (every 2 steps), load_best_model_at_end, save_total_limit=2
# (retention keeps the newest two and the best one).
ONE_PROCESS = ["--model", "gpt2", "--data", "lm", "--max-steps", "6", "--save-steps", "2", "--save-total-limit", "2",
               "--eval"]
# Wall-clock fields of logged evaluations (the only run-dependent values in a TrainerState besides paths).
_TIMING = ("_runtime", "_samples_per_second", "_steps_per_second")


def _result(run: Path, suffix: str = "") -> dict:
    return json.loads((run / f"result{suffix}.json").read_text())


def _untimed(entry: dict) -> dict:
    return {k: v for k, v in entry.items() if not k.endswith(_TIMING)}


def _trainer_state(checkpoint: Path) -> dict:
    """trainer_state.json without wall-clock fields, with this run's directory replaced by ``RUN``."""
    text = (checkpoint / TRAINER_STATE_FILE).read_text().replace(str(checkpoint.parent), "RUN")
    state = json.loads(text)
    state["log_history"] = [_untimed(entry) for entry in state["log_history"]]
    return state


@pytest.mark.slow
def test_async_run_ends_and_checkpoints_exactly_as_a_blocking_run(tmp_path: Path) -> None:
    blocking, background = tmp_path / "blocking", tmp_path / "async"
    runs = [(_start(blocking, ONE_PROCESS), blocking),
            (_start(background, ONE_PROCESS + ["--save-async"]), background)]
    for process, output in runs:
        _wait(process, output, 0)
    assert_identical(blocking, background)
    assert _result(blocking)["saves_in_flight_at_on_save"] == []
    assert _result(background)["saves_in_flight_at_on_save"] == [2, 4, 6]  # really written in the background
    kept = [path.name for _, path in list_checkpoints(blocking)]
    assert kept == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]  # 2 is the best (protected), 4 and 6 the newest
    assert [path.name for _, path in list_checkpoints(background)] == kept
    assert sorted(p.name for p in background.iterdir() if p.is_dir()) == kept  # no temp dir, nothing else
    for name in kept:
        ours, theirs = read_manifest(background / name), read_manifest(blocking / name)
        assert not verify_checkpoint(background / name, full=True).problems
        assert sorted(ours.files) == sorted(theirs.files)
        assert (ours.step, ours.world_size) == (theirs.step, theirs.world_size)
        assert _untimed(ours.metrics) == _untimed(theirs.metrics)  # the manifest records the evaluation's timing
        # trainer_state.json legitimately differs: the stock TrainerState records the wall-clock time of each
        # evaluation and best_model_checkpoint as an absolute path; it is compared without those below.
        different = [f for f in ours.files
                     if f != TRAINER_STATE_FILE and ours.files[f].xxh3_128 != theirs.files[f].xxh3_128]
        assert not different, f"{name}: {different} differ from the blocking run's"
        state = _trainer_state(background / name)
        assert state == _trainer_state(blocking / name)
        assert state["global_step"] == ours.step  # the state of that step, captured when it was staged
        assert state["best_model_checkpoint"] == "RUN/checkpoint-2"


@pytest.mark.slow
@pytest.mark.parametrize("limit", [1, 2])
def test_async_retention_and_best_checkpoint_match_blocking_saves(tmp_path: Path, limit: int) -> None:
    """In process: save_total_limit with a best checkpoint (step 2 of 6), as with blocking saves; with limit 1 the
    end of training deletes every checkpoint but the best one (after the last background save committed)."""
    outcomes = []
    for save_async in (False, True):
        output = tmp_path / f"async-{save_async}"
        trainer = regression_trainer(output, eval_strategy="steps", eval_steps=1, save_steps=1, max_steps=6,
                                     metric_for_best_model="accuracy", greater_is_better=True,
                                     save_total_limit=limit, load_best_model_at_end=True,
                                     trainer_class=functools.partial(ResumableTrainer, save_async=save_async))
        with patch.object(trainer, "_evaluate", side_effect=_evaluate_with([0.8, 0.9, 0.7, 0.6, 0.5, 0.4])):
            trainer.train()
        assert not trainer._commits.pending
        outcomes.append((_checkpoints(output), Path(trainer.state.best_model_checkpoint).name,
                         trainer.model.a.item(), trainer.model.b.item()))
        assert sorted(p.name for p in output.iterdir() if p.name.startswith(".tmp")) == []
    assert outcomes[1] == outcomes[0]
    assert outcomes[0][:2] == ([2] if limit == 1 else [2, 5, 6], "checkpoint-2")


def _torchrun_async(output: Path, **kill: int):
    return run_torchrun(SCRIPT, ["--output-dir", str(output), *TORCHRUN_OPTIONS, "--save-async"], env=_env(**kill),
                        timeout=240)


@pytest.mark.distributed
@pytest.mark.slow
def test_torchrun_async_run_with_a_rank_sigkilled_mid_save_resumes_bit_identical(reference: Path,
                                                                                  tmp_path: Path) -> None:
    run = tmp_path / "run"
    # rank 1 dies in on_save of step 4: checkpoint-3 has committed (the save of step 4 waited for it) and
    # checkpoint-4 was just handed to the background writers of both ranks
    killed = _torchrun_async(run, kill_after_save=4, signal_rank=1)
    # torchrun reports rank 1's SIGKILL in its failure summary ("exitcode  : -9"), whichever rank failed first
    assert killed.returncode != 0 and re.search(rf"exitcode\s*:\s*-{int(signal.SIGKILL)}\b", killed.stdout), \
        killed.stdout[-5000:]
    assert not (run / "result.json").exists()
    latest = find_latest_checkpoint(run)
    assert latest is not None and latest.name in ("checkpoint-3", "checkpoint-4"), latest
    checkpoints = sorted(p.name for p in run.iterdir() if p.is_dir() and p.name.startswith("checkpoint-"))
    assert checkpoints == [f"checkpoint-{step}" for step in range(1, int(latest.name.split("-")[1]) + 1)]
    for name in checkpoints:  # every checkpoint directory is a committed, complete 2-rank checkpoint
        assert read_manifest(run / name).world_size == 2
        assert not verify_checkpoint(run / name, full=True).problems
    resumed = _torchrun_async(run)  # the same command
    assert resumed.returncode == 0, resumed.stdout[-5000:]
    _assert_every_rank_identical(reference, run, latest.name)
    for suffix in RANK_SUFFIXES:  # the resumed run's own saves went to the background on every rank
        assert _result(run, suffix)["saves_in_flight_at_on_save"] == list(range(int(latest.name.split("-")[1]) + 1,
                                                                                7))


@pytest.mark.slow
@pytest.mark.parametrize("failing, raised_at", [
    (3, "the next save"),
    pytest.param(6, "the end of train", marks=pytest.mark.extended),
])
def test_a_failed_background_save_raises_and_leaves_the_previous_checkpoint_newest(tmp_path: Path, failing: int,
                                                                                    raised_at: str) -> None:
    run = tmp_path / "run"
    _run(run, ["--model", "gpt2", "--data", "lm", "--max-steps", "6", "--save-async"], expected=1,
         fail_save=failing)
    log = (tmp_path / "run.log").read_text()
    assert "AsyncSaveError" in log and f"The background save of {run / f'checkpoint-{failing}'} failed" in log, \
        log[-3000:]
    assert "No space left on device" in log
    assert not (run / "result.json").exists()  # train() raised
    # nothing after the previous checkpoint: not the failed one, not a later one, no temp dir
    assert sorted(p.name for p in run.iterdir()) == [f"checkpoint-{step}" for step in range(1, failing)]
    latest = find_latest_checkpoint(run)
    assert latest is not None and latest.name == f"checkpoint-{failing - 1}"
    assert not verify_checkpoint(latest, full=True).problems
    if raised_at == "the next save":  # raised before the step-4 save captured anything
        assert "in _save_checkpoint" in log
    else:
        assert "in _finalize_training" in log


@pytest.mark.slow
@pytest.mark.extended  # the preemption save is blocking either way; covered for blocking saves in make test
def test_sigterm_with_save_async_commits_the_save_then_exits_and_resumes_bit_identical(tmp_path: Path) -> None:
    # a make_resumable() subclass (save_async goes through its constructor), against a blocking reference
    options = ["--model", "gpt2", "--data", "lm", "--max-steps", "6", "--weighted-sampler"]
    reference_run, run = tmp_path / "reference", tmp_path / "run"
    uninterrupted = _start(reference_run, options)
    _run(run, options + ["--save-async"], expected=PREEMPTION_EXIT_CODE, sigterm_at=3)  # SIGTERM during step 4
    assert json.loads((run / "exit-rank0.json").read_text()) == {"code": PREEMPTION_EXIT_CODE, "global_step": 4}
    latest = find_latest_checkpoint(run)
    assert latest is not None and latest.name == "checkpoint-4"  # committed before the exit
    assert not verify_checkpoint(latest, full=True).problems
    _run(run, options + ["--save-async"])
    _wait(uninterrupted, reference_run, 0)
    assert_identical(reference_run, run)
    assert _result(run)["resumed_from"].endswith("checkpoint-4")
    assert _result(run)["saves_in_flight_at_on_save"] == [5, 6]


class _ReadsCheckpoints(TrainerCallback):
    """A tracker-style callback: on_save may look at the checkpoint (as WandbCallback and MLflowCallback can)."""

    def on_save(self, args, state, control, **kwargs):
        return control


@pytest.mark.parametrize(("save_async", "distributed", "callbacks", "expected"), [
    (None, False, (), False),  # the default, one process: blocking
    (None, True, (), True),  # the default under torch.distributed: in the background
    (None, True, (_ReadsCheckpoints(),), False),  # ... unless a callback's on_save may read the checkpoint
    (True, True, (_ReadsCheckpoints(),), True),
    (False, True, (), False),  # save_async=False opts out
    (True, False, (), True),
])
def test_save_async_defaults_to_background_saves_under_torchrun(tmp_path: Path, monkeypatch, caplog, save_async,
                                                                distributed, callbacks, expected) -> None:
    from hf_resumable.integrations import trainer as trainer_module

    monkeypatch.setattr(trainer_module, "saves_async", lambda option: distributed if option is None else option)
    trainer = regression_trainer(tmp_path, callbacks=callbacks,
                                 trainer_class=functools.partial(ResumableTrainer, save_async=save_async))
    assert trainer.resume_options.save_async is save_async
    with caplog.at_level("INFO", logger="hf_resumable.integrations.trainer"):
        assert trainer._saves_in_background() is expected
    assert ("_ReadsCheckpoints override on_save" in caplog.text) == (save_async is None and distributed
                                                                     and bool(callbacks))


def test_the_default_resolves_against_the_real_process_group_state() -> None:
    from hf_resumable.checkpoint.api import saves_async

    assert saves_async(None) is False  # no process group in this process
    assert saves_async(True) is True and saves_async(False) is False
