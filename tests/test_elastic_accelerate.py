"""``ResumableAccelerator(..., elastic=True)``: a run SIGKILLed and relaunched on another number of processes is the
same run as the uninterrupted one.

tests/scripts/elastic_accelerate_worker.py (accelerate's token-exact loop, a scheduler prepared by accelerate, a
checkpoint every step) is launched with ``torchrun --nproc-per-node 2``, killed, relaunched with plain ``python``
(gradient accumulation 2 -> 4, the scheduler still stepped twice per optimizer step), killed, and relaunched with 2
processes. Compared with the uninterrupted 2-process run as in tests/test_elastic_trainer.py (samples per optimizer
step, losses, weights; dropout on), and the learning rate of every step.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_elastic_trainer import assert_same_run, launch, steps_of_rank

from distributed_launch import REPO_ROOT

WORKER = REPO_ROOT / "tests" / "scripts" / "elastic_accelerate_worker.py"


def learning_rates(run: Path) -> dict[int, float]:
    return {record["step"]: record["lr"] for record in map(json.loads, (run / "losses.jsonl").open())}


@pytest.mark.slow
@pytest.mark.distributed
def test_two_processes_then_one_then_two_is_the_uninterrupted_run(tmp_path: Path) -> None:
    reference = tmp_path / "reference"
    launch(reference, nproc=2, worker=WORKER)
    run = tmp_path / "run"
    launch(run, nproc=2, kill_after=1, expect_kill=True, worker=WORKER)
    launch(run, nproc=1, kill_after=3, expect_kill=True, worker=WORKER)
    launch(run, nproc=2, worker=WORKER)
    assert json.loads((run / "result.json").read_text())["resumed_from"].endswith("checkpoint-3")
    assert steps_of_rank(run, 1) == [1, 4]  # the world size really changed
    assert_same_run(reference, run, steps=4)
    assert learning_rates(run) == learning_rates(reference)  # the schedule of the uninterrupted run
