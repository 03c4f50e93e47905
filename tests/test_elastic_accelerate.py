"""``ResumableAccelerator(..., elastic=True)``: a run SIGKILLed and relaunched on another number of processes is the
same run as the uninterrupted one.

tests/scripts/elastic_accelerate_worker.py (accelerate's token-exact loop, a scheduler prepared by accelerate, a
checkpoint every step) is launched with ``torchrun --nproc-per-node 2``, killed, relaunched with plain ``python``
(gradient accumulation 2 -> 4, the scheduler still stepped twice per optimizer step), killed, and relaunched with 2
processes. Compared with the uninterrupted 2-process run as in tests/test_elastic_trainer.py (samples per optimizer
step, losses, weights; dropout on), and the learning rate of every step. The same with accelerate's FSDP2 plugin and
with DeepSpeed ZeRO-2 (gloo ranks on CPU through tests/helpers/engine_fixtures.py; every launch through torchrun): the
checkpoint's per-rank pieces are resharded for the new world size. And with a shuffled ``datasets`` stream (a random
``.map`` crop) given to ``prepare_resumable_dataloader``: the Trainer's stream loader, read whole by every rank (and,
in process, such a stream resumed mid-pass and into its next pass, with and without ``elastic=True``).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from helpers.distributed_launch import REPO_ROOT
from helpers.elastic_runs import (
    assert_same_run,
    launch,
    logged_losses,
    samples_per_epoch,
    samples_per_step,
    steps_of_rank,
)

WORKER = REPO_ROOT / "tests" / "scripts" / "elastic_accelerate_worker.py"


def learning_rates(run: Path) -> dict[int, float]:
    return {record["step"]: record["lr"] for record in map(json.loads, (run / "losses.jsonl").open())}


@pytest.mark.slow
@pytest.mark.distributed
def test_two_processes_then_one_then_two_is_the_uninterrupted_run(tmp_path: Path) -> None:
    """26 samples, a global batch of 8: every epoch ends with a step of 2 samples (rank 1 pads at 2 processes, its
    loss weighs zero), trained here by one process and by two in the reference."""
    tail = ("--num-samples", "26")
    reference = tmp_path / "reference"
    launch(reference, nproc=2, max_steps=5, worker=WORKER, extra=tail)
    run = tmp_path / "run"
    launch(run, nproc=2, max_steps=5, kill_after=1, expect_kill=True, worker=WORKER, extra=tail)
    launch(run, nproc=1, max_steps=5, kill_after=4, expect_kill=True, worker=WORKER, extra=tail)
    launch(run, nproc=2, max_steps=5, worker=WORKER, extra=tail)
    assert json.loads((run / "result.json").read_text())["resumed_from"].endswith("checkpoint-4")
    assert steps_of_rank(run, 1) == [1, 5]  # the world size really changed
    assert_same_run(reference, run, steps=5)
    assert samples_per_epoch(run, 4)[0] == Counter(range(26))  # every sample of the epoch once, the last 2 too
    assert learning_rates(run) == learning_rates(reference)  # the schedule of the uninterrupted run


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.extended  # make test: 2 -> 1 -> 2 above (its last launch goes from 1 process to 2)
def test_one_process_then_two_is_the_uninterrupted_run(tmp_path: Path) -> None:
    """10 samples, a global batch of 4 (1 process x 2 micro-batches of 2): step 3 (2 samples) ends the epoch; at 2
    processes (accumulation 1) rank 1 pads it."""
    tail = ("--num-samples", "10")
    reference = tmp_path / "reference"
    launch(reference, nproc=1, max_steps=3, worker=WORKER, extra=tail)
    run = tmp_path / "run"
    launch(run, nproc=1, max_steps=3, kill_after=1, expect_kill=True, worker=WORKER, extra=tail)
    launch(run, nproc=2, max_steps=3, worker=WORKER, extra=tail)
    assert steps_of_rank(run, 1) == [2, 3]
    assert json.loads((run / "result.json").read_text())["gradient_accumulation_steps"] == 1
    assert_same_run(reference, run, steps=3)
    assert samples_per_epoch(run, 3) == [Counter(range(10))]
    assert learning_rates(run) == learning_rates(reference)


@pytest.mark.slow
@pytest.mark.distributed
def test_a_loop_iterating_the_loader_trains_what_the_windows_train(tmp_path: Path) -> None:
    """A loop that iterates the prepared loader itself (``for batch in loader:`` inside ``accelerator.accumulate``,
    ``backward`` of each micro-batch's mean loss) trains what ``accumulation_windows`` trains: 26 samples, so every
    epoch ends with a step of 2 samples, where at 2 processes rank 1's batch pads (its loss must weigh zero, not train
    the step's first samples twice) and rank 0's weighs the whole step; the step is taken after that one micro-batch
    (the loader's end). Equal to the window loop at 2 processes (1e-6), and killed after step 1 and continued by one
    process within the elastic tolerance, every sample of the epoch trained once."""
    options = ("--num-samples", "26", "--mean-loss")
    windows = tmp_path / "windows"
    launch(windows, nproc=2, max_steps=5, worker=WORKER, extra=options)
    direct = tmp_path / "direct"
    launch(direct, nproc=2, max_steps=5, worker=WORKER, extra=(*options, "--direct"))
    assert_same_run(windows, direct, steps=5, rtol=1e-6)
    run = tmp_path / "run"
    launch(run, nproc=2, max_steps=5, kill_after=1, expect_kill=True, worker=WORKER, extra=(*options, "--direct"))
    launch(run, nproc=1, max_steps=5, worker=WORKER, extra=(*options, "--direct"))  # accumulation 2 -> 4
    assert steps_of_rank(run, 1) == [1]
    assert_same_run(direct, run, steps=5)
    assert samples_per_epoch(run, 4)[0] == Counter(range(26))
    assert learning_rates(run) == learning_rates(direct)


def launch_engine(output: Path, engine: str, *, nproc: int, max_steps: int, kill_after: int | None = None,
                  num_samples: int = 24) -> None:
    launch(output, nproc=nproc, max_steps=max_steps, kill_after=kill_after, expect_kill=kill_after is not None,
           worker=WORKER, extra=("--engine", engine, "--num-samples", str(num_samples)), torchrun=True)


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
    # 26 samples: step 4 ends the epoch with 2 samples (at 2 processes rank 1 trains a padding micro-batch)
    reference = tmp_path / "reference"
    launch_engine(reference, engine, nproc=2, max_steps=4, num_samples=26)
    run = tmp_path / "run"
    launch_engine(run, engine, nproc=2, max_steps=4, kill_after=1, num_samples=26)
    launch_engine(run, engine, nproc=1, max_steps=4, num_samples=26)  # gradient accumulation 2 -> 4
    result = json.loads((run / "result.json").read_text())
    assert result["distributed_type"] == f"DistributedType.{distributed_type}"
    assert result["gradient_accumulation_steps"] == 4
    assert steps_of_rank(run, 1) == [1]
    assert_same_run(reference, run, steps=4)
    assert samples_per_epoch(run, 4) == [Counter(range(26))]
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
    a plain ``DataLoader`` (accelerate's per-rank loader) is refused at the new world size before a step is trained.
    A pass is 20 examples: step 3 trains its last 4, one process padding its window of 4 with 2 padding micro-batches.
    """
    stream = ("--stream", "--num-samples", "20")
    reference = tmp_path / "reference"
    launch(reference, nproc=2, max_steps=3, worker=WORKER, extra=stream)
    run = tmp_path / "run"
    launch(run, nproc=2, max_steps=3, kill_after=1, expect_kill=True, worker=WORKER, extra=stream)
    refused = launch(run, nproc=1, max_steps=3, expect_fail=True, worker=WORKER, extra=(*stream, "--plain-loader"))
    assert "ConfigDriftError" in refused and "prepare_resumable_dataloader()" in refused
    assert sorted(logged_losses(run)) == [1]
    launch(run, nproc=1, max_steps=3, worker=WORKER, extra=stream)
    assert json.loads((run / "result.json").read_text())["gradient_accumulation_steps"] == 4
    assert steps_of_rank(run, 1) == [1]  # the world size really changed
    assert_same_run(reference, run, steps=3)
    assert samples_per_epoch(run, 3) == [Counter(range(20))]
    assert learning_rates(run) == learning_rates(reference)


@pytest.mark.slow
def test_a_stream_step_is_recorded_with_the_samples_it_trains_not_those_read_ahead(tmp_path: Path) -> None:
    """One process, accumulation 2 (a global batch of 4), a pass of 10 stream examples: the steps train 4, 4 and the
    last 2 (with a padding micro-batch), every example once. The prepared stream reads one batch ahead (to mark the
    pass's last batch), so it collates the next step's first micro-batch before a step ends: the worker records what
    a step trains from its micro-batches, as the 2-process to 1-process comparison above needs."""
    launch(tmp_path, nproc=1, max_steps=3, worker=WORKER, extra=("--stream", "--num-samples", "10"))
    steps = samples_per_step(tmp_path)
    assert [sum(steps[step].values()) for step in sorted(steps)] == [4, 4, 2]
    assert sum(steps.values(), Counter()) == Counter(range(10))


@pytest.fixture
def _fresh_accelerate_state():
    from accelerate.state import AcceleratorState, GradientState

    def reset() -> None:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()

    reset()
    yield reset
    reset()


def _stream_run(checkpoints: Path, *, elastic: bool, windows: int, save_at: int | None = None,
                count: int = 12) -> list[list[tuple[int, int]]]:
    """``windows`` accumulation windows (2 micro-batches of 2; a pass of 14 examples ends with a window of one) over a
    shuffled, randomly cropped ``count``-example stream after ``load_state``; each micro-batch's examples."""
    from hf_resumable import ResumableAccelerator

    from helpers.elastic_data import crop_stream

    accelerator = ResumableAccelerator(gradient_accumulation_steps=2, checkpoint_dir=checkpoints, cpu=True,
                                       elastic=elastic)
    loader = accelerator.prepare_resumable_dataloader(crop_stream(count), collate_fn=lambda rows: rows, batch_size=2,
                                                      seed=5)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.load_state()
    batches: list[list[tuple[int, int]]] = []
    done = 0
    while done < windows:
        for window in accelerator.accumulation_windows(loader):
            for rows in window:
                with accelerator.accumulate(model):
                    if not window.is_padding:  # elastic: the pass's last window is padded to a whole one
                        batches.append([(row["index"], len(row["input_ids"])) for row in rows])
                    accelerator.backward(model(torch.ones(1, 1)).sum())
                    optimizer.step()
                    optimizer.zero_grad()
            done += 1
            if accelerator.global_step == save_at:
                accelerator.save_state()
            if done == windows:
                break
    return batches


@pytest.mark.slow
@pytest.mark.parametrize("elastic", [False, True])
# (12, 3): saved at the end of the pass (which the stream learns only at its next read); 14: right after the pass's
# shorter last step
@pytest.mark.parametrize(("count", "save_at"), [(12, 2), (12, 3), (14, 4)])
def test_a_stream_resumes_mid_pass_and_into_the_next_pass(tmp_path: Path, elastic: bool, count: int, save_at: int,
                                                          monkeypatch, _fresh_accelerate_state) -> None:
    """In process: a ``datasets`` stream from ``prepare_resumable_dataloader`` saved after window ``save_at`` of its
    first pass continues with the uninterrupted run's micro-batches (indices and random crops), through the second
    pass. Every example of a pass trains once, the 2 of the last, shorter window of a 14-example pass too (with and
    without ``elastic=True``: the same micro-batches per pass)."""
    monkeypatch.syspath_prepend(str(WORKER.parent))
    per_pass = -(-count // 4)
    reference = _stream_run(tmp_path / "reference", elastic=elastic, windows=2 * per_pass, count=count)
    half = -(-count // 2)  # micro-batches per pass
    passes = [[index for batch in reference[start:start + half] for index, _ in batch] for start in (0, half)]
    assert sorted(passes[0]) == sorted(passes[1]) == list(range(count)) and passes[0] != passes[1]  # reshuffled
    head = _stream_run(tmp_path / "run", elastic=elastic, windows=save_at, save_at=save_at, count=count)
    _fresh_accelerate_state()
    tail = _stream_run(tmp_path / "run", elastic=elastic, windows=2 * per_pass - save_at, count=count)
    assert head + tail == reference


def _linear_run(data: object, *, direct: bool, accumulation: int, epochs: int = 2
                ) -> tuple[torch.Tensor, list[list[float]]]:
    """``elastic=True``, one process, micro-batches of 2, an SGD-trained ``Linear(1, 1)`` on a mean loss, ``epochs``
    epochs through ``accumulation_windows`` or iterating the loader itself inside ``accumulate``: the final weights and
    each optimizer step's samples (padding batches left out)."""
    from hf_resumable import ResumableAccelerator

    accelerator = ResumableAccelerator(gradient_accumulation_steps=accumulation, cpu=True, handle_preemption=False,
                                       elastic=True)
    loader = accelerator.prepare_resumable_dataloader(
        data, collate_fn=lambda rows: torch.tensor([row["x"] if isinstance(row, dict) else row for row in rows]),
        batch_size=2, seed=3)
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = accelerator.prepare(model, optimizer)
    steps: list[list[float]] = [[]]

    def train(batch: torch.Tensor, padding: bool) -> None:
        with accelerator.accumulate(model):
            accelerator.backward(((model(batch[:, None]) - 2 * batch[:, None]) ** 2).mean())
            optimizer.step()
            optimizer.zero_grad()
        steps[-1] += [] if padding else batch.tolist()
        if accelerator.sync_gradients:
            steps.append([])

    for _ in range(epochs):
        if direct:
            for batch in loader:
                train(batch, loader.is_padding)
        else:
            for window in accelerator.accumulation_windows(loader):
                for batch in window:
                    train(batch, window.is_padding)
    assert not steps.pop() and accelerator.global_step == len(steps)
    return accelerator.unwrap_model(model).weight.detach().clone(), steps


# map-style: 14 samples, a global batch of 4; the epoch's last step is one micro-batch of 2 (the step is taken after
# it, at the loader's end; its mean loss weighs the whole step, not half of it). A stream: 16 samples, a global batch
# of 6; the last step is two micro-batches of 2 and a padding one (the step's first, trained again unless it weighs 0).
@pytest.mark.parametrize(("stream", "count", "accumulation", "steps_per_epoch"), [(False, 14, 2, 4), (True, 16, 3, 3)])
def test_iterating_an_elastic_loader_itself_trains_what_the_windows_train(
        stream: bool, count: int, accumulation: int, steps_per_epoch: int, _fresh_accelerate_state) -> None:
    """A loop over an elastic loader itself (no ``accumulation_windows``) takes the windows' steps, on the same
    samples, to the same weights: every sample of an epoch once, the shorter last step weighed as the windows weigh
    it."""
    import datasets

    values = [float(i) / 4 for i in range(count)]
    data = datasets.Dataset.from_dict({"x": values}).to_iterable_dataset() if stream else values
    windows, window_steps = _linear_run(data, direct=False, accumulation=accumulation)
    _fresh_accelerate_state()
    direct, direct_steps = _linear_run(data, direct=True, accumulation=accumulation)
    assert direct_steps == window_steps and len(window_steps) == 2 * steps_per_epoch
    for epoch in (window_steps[:steps_per_epoch], window_steps[steps_per_epoch:]):
        assert sorted(value for step in epoch for value in step) == values
        assert len(epoch[-1]) == count % (2 * accumulation)  # the last, shorter step
    assert torch.allclose(direct, windows, rtol=1e-6, atol=0), (direct, windows)
