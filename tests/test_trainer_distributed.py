"""ResumableTrainer under the real ``torchrun`` with 2 processes (gloo, CPU, DDP).

Every rank saves its own RNG and data position in each (collective) checkpoint; a job SIGKILLed as a
whole and restarted with the same command, and a job where ONE rank receives SIGTERM (both ranks agree
on the step to save, save it, and exit 143), end bit-identical to the uninterrupted 2-process run on
every rank. Resuming a 2-process checkpoint with 1 process is refused (ConfigDriftError) unless
``allow_config_drift``.
"""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import pytest

from hf_resumable.checkpoint import find_latest_checkpoint, read_manifest
from hf_resumable.preemption import PREEMPTION_EXIT_CODE

from helpers.trainer_runs import (
    OPTIONS,
    _assert_every_rank_identical,
    _resumed_from,
    _run,
    reference,  # noqa: F401 - a module fixture
    torchrun,
)

pytestmark = pytest.mark.distributed


def _assert_per_rank_state(checkpoint: Path) -> None:
    assert read_manifest(checkpoint).world_size == 2
    files = {p.relative_to(checkpoint).as_posix() for p in checkpoint.rglob("*") if p.is_file()}
    assert {"rng/rank-00000.safetensors", "rng/rank-00001.safetensors", "data/rank-00000.json",
            "data/rank-00001.json"} <= files


@pytest.mark.extended  # test_trainer_async SIGKILLs a rank mid-save under torchrun (the default, background saves)
def test_whole_job_sigkilled_then_restarted_is_bit_identical(reference: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    killed = torchrun(run, kill_job_after_save=3)  # rank 0 SIGKILLs the agent and both workers
    assert killed.returncode == -signal.SIGKILL, killed.stdout[-5000:]
    assert not (run / "result.json").exists()
    latest = find_latest_checkpoint(run)
    assert latest is not None and latest.name == "checkpoint-3"
    _assert_per_rank_state(latest)
    resumed = torchrun(run)  # the same command
    assert resumed.returncode == 0, resumed.stdout[-5000:]
    _assert_every_rank_identical(reference, run, "checkpoint-3")


def test_sigterm_to_one_rank_saves_the_same_step_on_both(reference: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    # Rank 1 alone gets SIGTERM at the start of step 4; the flag is all-reduced at the end of step 4.
    preempted = torchrun(run, sigterm_at=3, signal_rank=1)
    assert preempted.returncode != 0 and f"exitcode: {PREEMPTION_EXIT_CODE}" in preempted.stdout, \
        preempted.stdout[-5000:]
    exits = [json.loads((run / f"exit-rank{rank}.json").read_text()) for rank in (0, 1)]
    assert exits == [{"code": PREEMPTION_EXIT_CODE, "global_step": 4}] * 2
    assert "another rank received a preemption signal; saving step 4" in preempted.stdout
    latest = find_latest_checkpoint(run)
    assert latest is not None and latest.name == "checkpoint-4"
    _assert_per_rank_state(latest)
    resumed = torchrun(run)
    assert resumed.returncode == 0, resumed.stdout[-5000:]
    _assert_every_rank_identical(reference, run, "checkpoint-4")


@pytest.mark.extended  # world-size drift is also refused in-process (test_open_checkpoint)
def test_resuming_with_another_world_size_is_refused_unless_allowed(reference: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(reference / "checkpoint-3", run / "checkpoint-3")
    _run(run, OPTIONS, expected=1)  # one process: world_size 2 -> 1
    log = (tmp_path / "run.log").read_text()
    assert "ConfigDriftError" in log and "world_size: 2 -> 1" in log, log[-3000:]
    assert not (run / "checkpoint-4").exists()
    _run(run, OPTIONS + ["--allow-config-drift"])
    assert _resumed_from(run).endswith("checkpoint-3")
