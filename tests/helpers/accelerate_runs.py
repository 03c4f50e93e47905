"""accelerate runs shared by the accelerate tests: ``examples/custom_loop.py`` as a process (:func:`run_example`, on
2 ranks :func:`launch_example`) and its reference runs, the bit-for-bit comparison (:func:`assert_same_run`), a small
in-process ``ResumableAccelerator`` set-up, and the autouse fixture that resets accelerate's process-wide state."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from accelerate.state import AcceleratorState, GradientState

from hf_resumable.checkpoint import read_manifest, verify_checkpoint
from hf_resumable.integrations.accelerate import ResumableAccelerator

from helpers import zygote
from helpers.distributed_launch import REPO_ROOT, child_env, launch_ranks

EXAMPLE = REPO_ROOT / "examples" / "custom_loop.py"


FINAL_STEP = 8  # 2 epochs x ceil(11 batches / GA 3) windows (the last window of each epoch is short)


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    """accelerate keeps process-wide singletons; every test starts from a clean one."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


class Counter:
    """A registered custom object (accelerate's ``register_for_checkpointing``)."""

    def __init__(self) -> None:
        self.count, self.history = 0, torch.zeros(3)

    def state_dict(self) -> dict:
        return {"count": self.count, "history": self.history}

    def load_state_dict(self, state: dict) -> None:
        self.count, self.history = state["count"], state["history"]


def _build_small(tmp_path: Path, *, ga: int = 2, **options):
    accelerator = ResumableAccelerator(gradient_accumulation_steps=ga, cpu=True, checkpoint_dir=tmp_path,
                                       handle_preemption=False, **options)
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = accelerator.prepare_resumable_dataloader([float(i) for i in range(14)], collate_fn=torch.tensor,
                                                      batch_size=2, seed=3)
    model, optimizer = accelerator.prepare(model, optimizer)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    return accelerator, model, optimizer, loader, counter


def _train_windows(accelerator, model, optimizer, windows, count: int) -> list[list[float]]:
    seen = []
    for _ in range(count):
        for batch in next(windows):
            seen.append(batch.tolist())
            with accelerator.accumulate(model):
                accelerator.backward(torch.nn.functional.dropout(model(batch[:, None]), 0.5).pow(2).mean())
                optimizer.step()
                optimizer.zero_grad()
    return seen


def run_example(output: Path, *, num_workers: int, env: dict[str, str] | None = None,
                extra: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    command = [sys.executable, str(EXAMPLE), "--output-dir", str(output), "--num-workers", str(num_workers), *extra]
    return zygote.run(command, env=child_env(env), cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)


def read_losses(output: Path) -> list[tuple[int, str]]:
    return [(row["step"], row["loss"]) for row in map(json.loads, (output / "losses.jsonl").read_text().splitlines())]


def final_files(output: Path, final_step: int = FINAL_STEP) -> dict[str, str]:
    """sha256 of every file of the final checkpoint: weights, optimizer, scheduler, RNG, data position..."""
    path = output / "checkpoints" / f"checkpoint-{final_step}"
    assert verify_checkpoint(path, full=True).ok
    return {name: record.xxh3_128 for name, record in read_manifest(path).files.items()}


def assert_same_run(resumed: Path, reference: Path, final_step: int = FINAL_STEP) -> None:
    want = dict(read_losses(reference))
    assert sorted(want) == list(range(1, final_step + 1))
    got = read_losses(resumed)
    # Every logged loss, including steps run twice (before the kill and again after the restart), is
    # bit-identical to the uninterrupted run's loss of that step.
    assert {step for step, _ in got} == set(want)
    for step, loss in got:
        assert loss == want[step], (step, float.fromhex(loss), float.fromhex(want[step]))
    assert final_files(resumed, final_step) == final_files(reference, final_step)


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory) -> Path:
    output = tmp_path_factory.mktemp("reference")
    done = run_example(output, num_workers=0)
    assert done.returncode == 0, done.stderr[-3000:]
    return output


def launch_example(output: Path, *, env: dict[str, str] | None = None, timeout: float = 240):
    return launch_ranks([str(EXAMPLE), "--output-dir", str(output), "--num-workers", "0"], world_size=2,
                        timeout=timeout, env=env)


@pytest.fixture(scope="module")
def two_process_reference(tmp_path_factory) -> Path:
    output = tmp_path_factory.mktemp("reference2")
    for result in launch_example(output):
        assert result.returncode == 0, result.describe()
    return output


# A stream of 10 examples in micro-batches of 2 with gradient accumulation 2: windows of 2, 2 and 1 per pass, so the
# pass's last step is taken only if the loader marks its last batch (accelerate's end_of_dataloader).
STREAM_VALUES = [float(i) / 4 for i in range(10)]


def stream_accelerator(checkpoints: Path) -> ResumableAccelerator:
    """The ``ResumableAccelerator`` of :func:`stream_accumulate_run` (one process, CPU, accumulation 2)."""
    return ResumableAccelerator(cpu=True, checkpoint_dir=checkpoints, handle_preemption=False,
                                gradient_accumulation_steps=2)


def stream_accumulate_run(accelerator, *, epochs: int = 2, save_after: int | None = None
                          ) -> tuple[list[tuple[bool, bool]], torch.Tensor]:
    """Two passes of a direct ``for batch in loader`` loop inside ``accumulate`` over a ``datasets`` stream (stock
    ``accelerator.prepare(DataLoader(...))``, or ``prepare_resumable_dataloader`` continuing after ``load_state`` in
    the loader's epoch): per batch ``(end_of_dataloader, sync_gradients)``, and the final weights. With
    ``save_after``: ``save_state`` after that many batches of the run, then stop. accelerate's state is reset."""
    import datasets
    from torch.utils.data import DataLoader

    stream = datasets.Dataset.from_dict({"x": STREAM_VALUES}).to_iterable_dataset()
    collate = lambda rows: torch.tensor([row["x"] for row in rows])  # noqa: E731
    if isinstance(accelerator, ResumableAccelerator):
        loader = accelerator.prepare_resumable_dataloader(stream, collate_fn=collate, batch_size=2, seed=0)
    else:
        loader = accelerator.prepare(DataLoader(stream, batch_size=2, collate_fn=collate))
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05))
    first = 0
    if isinstance(accelerator, ResumableAccelerator) and accelerator.load_state() is not None:
        first = loader.epoch
    marks = []
    for _epoch in range(first, epochs):
        for batch in loader:
            with accelerator.accumulate(model):
                accelerator.backward(((model(batch[:, None]) - 2 * batch[:, None]) ** 2).mean())
                optimizer.step()
                optimizer.zero_grad()
            marks.append((accelerator.gradient_state.end_of_dataloader, accelerator.sync_gradients))
            if len(marks) == save_after:
                accelerator.save_state()
                break
        if len(marks) == save_after:
            break
    weight = accelerator.unwrap_model(model).weight.detach().clone()
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return marks, weight
