"""``ResumableAccelerator(..., elastic=True)``: a run SIGKILLed and relaunched on another number of processes is the
same run as the uninterrupted one.

tests/scripts/elastic_accelerate_worker.py (accelerate's token-exact loop, a scheduler prepared by accelerate, a
checkpoint every step) is launched with ``torchrun --nproc-per-node 2``, killed, relaunched with plain ``python``
(gradient accumulation 2 -> 4, the scheduler still stepped twice per optimizer step), killed, and relaunched with 2
processes. Compared with the uninterrupted 2-process run as in tests/test_elastic_trainer.py (samples per optimizer
step, losses, weights; dropout on), and the learning rate of every step. The same with accelerate's FSDP2 plugin and
with DeepSpeed ZeRO-2 (gloo ranks on CPU through tests/engine_fixtures.py; every launch through torchrun): the
checkpoint's per-rank pieces are resharded for the new world size. And with a shuffled ``datasets`` stream (a random
``.map`` crop) given to ``prepare_resumable_dataloader``: the Trainer's stream loader, read whole by every rank (and,
in process, such a stream resumed mid-pass and into its next pass, with and without ``elastic=True``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_elastic_trainer import assert_same_run, launch, logged_losses, steps_of_rank

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


def launch_engine(output: Path, engine: str, *, nproc: int, max_steps: int, kill_after: int | None = None) -> None:
    launch(output, nproc=nproc, max_steps=max_steps, kill_after=kill_after, expect_kill=kill_after is not None,
           worker=WORKER, extra=("--engine", engine), torchrun=True)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("engine, distributed_type", [
    ("fsdp", "FSDP"),
    # DeepSpeed ZeRO-2: the engine's own gradient accumulation (it divides the loss by it) follows the new one, and
    # the torch scheduler accelerate prepares keeps the first launch's rate
    pytest.param("deepspeed", "DEEPSPEED", marks=pytest.mark.extended),
    pytest.param("zero1", "DEEPSPEED", marks=pytest.mark.extended),
    pytest.param("zero3", "DEEPSPEED", marks=pytest.mark.extended),  # parameters partitioned too
])
def test_an_engine_on_two_processes_then_one_is_the_uninterrupted_run(tmp_path: Path, engine: str,
                                                                      distributed_type: str) -> None:
    reference = tmp_path / "reference"
    launch_engine(reference, engine, nproc=2, max_steps=3)
    run = tmp_path / "run"
    launch_engine(run, engine, nproc=2, max_steps=3, kill_after=1)
    launch_engine(run, engine, nproc=1, max_steps=3)  # gradient accumulation 2 -> 4
    result = json.loads((run / "result.json").read_text())
    assert result["distributed_type"] == f"DistributedType.{distributed_type}"
    assert result["gradient_accumulation_steps"] == 4
    assert steps_of_rank(run, 1) == [1]
    assert_same_run(reference, run, steps=3)
    assert learning_rates(run) == learning_rates(reference)


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp2_on_two_processes_then_one_then_two_is_the_uninterrupted_run(tmp_path: Path) -> None:
    reference = tmp_path / "reference"
    launch_engine(reference, "fsdp", nproc=2, max_steps=4)
    run = tmp_path / "run"
    launch_engine(run, "fsdp", nproc=2, max_steps=4, kill_after=1)
    launch_engine(run, "fsdp", nproc=1, max_steps=4, kill_after=3)
    launch_engine(run, "fsdp", nproc=2, max_steps=4)
    assert json.loads((run / "result.json").read_text())["resumed_from"].endswith("checkpoint-3")
    assert steps_of_rank(run, 1) == [1, 4]
    assert_same_run(reference, run, steps=4)
    assert learning_rates(run) == learning_rates(reference)


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.distributed
def test_a_stream_on_two_processes_then_one_is_the_uninterrupted_run(tmp_path: Path) -> None:
    """Step k is stream examples [8k, 8k + 8) at any world size: 2 processes (accumulation 2) are killed after step 1,
    one process (accumulation 4) continues from rank 0's position (examples read over all ranks). The same stream in
    a plain ``DataLoader`` (accelerate's per-rank loader) is refused at the new world size before a step is trained."""
    reference = tmp_path / "reference"
    launch(reference, nproc=2, max_steps=3, worker=WORKER, extra=("--stream",))
    run = tmp_path / "run"
    launch(run, nproc=2, max_steps=3, kill_after=1, expect_kill=True, worker=WORKER, extra=("--stream",))
    refused = launch(run, nproc=1, max_steps=3, expect_fail=True, worker=WORKER, extra=("--stream", "--plain-loader"))
    assert "ConfigDriftError" in refused and "prepare_resumable_dataloader()" in refused
    assert sorted(logged_losses(run)) == [1]
    launch(run, nproc=1, max_steps=3, worker=WORKER, extra=("--stream",))
    assert json.loads((run / "result.json").read_text())["gradient_accumulation_steps"] == 4
    assert steps_of_rank(run, 1) == [1]  # the world size really changed
    assert_same_run(reference, run, steps=3)
    assert learning_rates(run) == learning_rates(reference)


@pytest.fixture
def _fresh_accelerate_state():
    from accelerate.state import AcceleratorState, GradientState

    def reset() -> None:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()

    reset()
    yield reset
    reset()


def _stream_run(checkpoints: Path, *, elastic: bool, windows: int, save_at: int | None = None) -> list[list[int]]:
    """``windows`` accumulation windows (2 micro-batches of 2) over a shuffled, randomly cropped 12-example stream
    (3 windows per pass) after ``load_state``; the collated indices of each micro-batch."""
    from elastic_data import crop_stream

    from hf_resumable import ResumableAccelerator

    accelerator = ResumableAccelerator(gradient_accumulation_steps=2, checkpoint_dir=checkpoints, cpu=True,
                                       elastic=elastic)
    loader = accelerator.prepare_resumable_dataloader(crop_stream(12), collate_fn=lambda rows: rows, batch_size=2,
                                                      seed=5)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.load_state()
    batches: list[list[int]] = []
    while len(batches) < 2 * windows:
        for window in accelerator.accumulation_windows(loader):
            for rows in window:
                with accelerator.accumulate(model):
                    batches.append([(row["index"], len(row["input_ids"])) for row in rows])
                    accelerator.backward(model(torch.ones(1, 1)).sum())
                    optimizer.step()
                    optimizer.zero_grad()
            if accelerator.global_step == save_at:
                accelerator.save_state()
            if len(batches) == 2 * windows:
                break
    return batches


@pytest.mark.slow
@pytest.mark.parametrize("elastic", [False, True])
@pytest.mark.parametrize("save_at", [2, 3])  # 3: the end of the pass (which the stream learns only at its next read)
def test_a_stream_resumes_mid_pass_and_into_the_next_pass(tmp_path: Path, elastic: bool, save_at: int, monkeypatch,
                                                          _fresh_accelerate_state) -> None:
    """In process: a ``datasets`` stream from ``prepare_resumable_dataloader`` saved after window ``save_at`` of its
    first pass continues with the uninterrupted run's micro-batches (indices and random crops), through the second
    pass."""
    monkeypatch.syspath_prepend(str(WORKER.parent))
    reference = _stream_run(tmp_path / "reference", elastic=elastic, windows=6)
    passes = [[index for batch in reference[half:half + 6] for index, _ in batch] for half in (0, 6)]
    assert sorted(passes[0]) == sorted(passes[1]) == list(range(12)) and passes[0] != passes[1]  # reshuffled
    head = _stream_run(tmp_path / "run", elastic=elastic, windows=save_at, save_at=save_at)
    _fresh_accelerate_state()
    tail = _stream_run(tmp_path / "run", elastic=elastic, windows=6 - save_at)
    assert head + tail == reference
