"""accelerate's checkpointing example (``examples/accelerate_checkpointing.py``: plain ``prepare(DataLoader(...))``,
no ``accumulate()``, ``save_state("step_<n>")``, ``load_state`` + ``skip_first_batches`` on resume) with the
one-line import change, SIGKILLed in a separate process and restarted with the same command: every logged loss,
the final weights and every file of the last checkpoint are bit-identical to an uninterrupted run, with 0 and 2
loader workers, and with 2 processes under torchrun.
"""

from __future__ import annotations

import hashlib
import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hf_resumable.checkpoint import read_manifest, verify_checkpoint

from helpers import zygote
from helpers.distributed_launch import REPO_ROOT, child_env, run_torchrun

EXAMPLE = REPO_ROOT / "examples" / "accelerate_checkpointing.py"
STEPS = 16  # 2 epochs x 64 samples / batch 8 (1 process); 8 with 2 processes


def command_args(output: Path, *, checkpointing_steps: int, num_workers: int = 0) -> list[str]:
    return ["--cpu", "--output_dir", str(output), "--checkpointing_steps", str(checkpointing_steps),
            "--num_workers", str(num_workers), "--resume_from_checkpoint", "latest"]


def run_example(output: Path, *, checkpointing_steps: int = 4, num_workers: int = 0,
                env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, str(EXAMPLE), *command_args(output, checkpointing_steps=checkpointing_steps,
                                                           num_workers=num_workers)]
    return zygote.run(command, env=child_env(env), cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)


def losses(output: Path) -> list[tuple[int, str]]:
    return [(row["step"], row["loss"]) for row in map(json.loads, (output / "losses.jsonl").read_text().splitlines())]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def final_state(output: Path, last_step: int) -> tuple[dict[str, str], dict[str, list[dict]]]:
    """sha256 of the final weights and xxh3-128 of every file of the last checkpoint (optimizer, scheduler, RNG,
    ...), and the loader positions of each rank (parsed)."""
    checkpoint = output / f"step_{last_step}"
    assert verify_checkpoint(checkpoint, full=True).ok
    files = {name: record.xxh3_128 for name, record in read_manifest(checkpoint).files.items()
             if not name.startswith("data/")}
    positions = {path.name: json.loads(path.read_text())["loaders"] for path in (checkpoint / "data").iterdir()}
    return {"final_model": sha256(output / "final_model" / "model.safetensors"), **files}, positions


def assert_same_run(resumed: Path, reference: Path, last_step: int, *, skipped_evaluations: int = 0) -> None:
    want = dict(losses(reference))
    assert sorted(want) == list(range(1, last_step + 1))
    got = losses(resumed)
    assert {step for step, _ in got} == set(want)
    for step, loss in got:  # steps run twice (before the kill and after the restart) included
        assert loss == want[step], (step, float.fromhex(loss), float.fromhex(want[step]))
    (files, positions), (want_files, want_positions) = final_state(resumed, last_step), final_state(reference,
                                                                                                    last_step)
    assert files == want_files
    assert positions.keys() == want_positions.keys()
    for rank, (train, evaluation) in positions.items():
        want_train, want_evaluation = want_positions[rank]
        assert train == want_train  # epoch, batch and seed of the training loader
        # The example's resume logic (accelerate's) starts the next epoch after a checkpoint taken at the end of
        # an epoch, so the evaluation that followed that checkpoint is not run again: one evaluation pass less.
        assert {**evaluation, "epoch": evaluation["epoch"] + skipped_evaluations} == want_evaluation


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    output = tmp_path_factory.mktemp("reference")
    done = run_example(output)
    assert done.returncode == 0, done.stderr[-3000:]
    return output


@pytest.mark.slow
@pytest.mark.parametrize(("kill_after", "num_workers", "resumes_from"), [
    (6, 0, "step_4"),  # between checkpoints, mid-epoch: load_state + skip_first_batches(loader, 4)
    # Right after the checkpoint at the end of epoch 0, with 2 worker processes (the reference had none); loader
    # workers are covered in make test by test_accelerate_integration's (SIGKILL, 4, 2) case.
    pytest.param(8, 2, "step_8", marks=pytest.mark.extended),
])
def test_sigkill_and_restart_with_the_same_command_is_bit_exact(tmp_path, reference, kill_after, num_workers,
                                                                resumes_from):
    killed = run_example(tmp_path, num_workers=num_workers,
                         env={"HF_RESUMABLE_EXAMPLE_KILL_AFTER_STEP": str(kill_after)})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert max(step for step, _ in losses(tmp_path)) == kill_after  # it really stopped there
    resumed = run_example(tmp_path, num_workers=num_workers)  # the same command
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"Resumed from checkpoint: {tmp_path / resumes_from}" in resumed.stdout
    assert_same_run(tmp_path, reference, STEPS, skipped_evaluations=int(resumes_from == "step_8"))


@pytest.mark.distributed
# `make test` covers the example script killed and restarted in one process (above) and a torchrun rank SIGKILLed
# under ResumableAccelerator (test_async_integrations, test_engines); the two together are a `make test-all` variant.
@pytest.mark.extended
def test_two_processes_under_torchrun_sigkill_of_one_rank_and_restart_is_bit_exact(tmp_path_factory):
    reference_dir, run_dir = tmp_path_factory.mktemp("reference2"), tmp_path_factory.mktemp("run2")

    def torchrun(output: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        return run_torchrun(EXAMPLE, command_args(output, checkpointing_steps=2), env=child_env(env), timeout=200)

    done = torchrun(reference_dir)
    assert done.returncode == 0, done.stdout[-5000:]
    killed = torchrun(run_dir, {"HF_RESUMABLE_EXAMPLE_KILL_AFTER_STEP": "3", "HF_RESUMABLE_EXAMPLE_SIGNAL_RANK": "1"})
    # torchrun lists every failed rank ("exitcode  : -9" for the killed one); its one-line summary names only the
    # failure it saw first, which may be the peer that lost its connection
    assert killed.returncode != 0 and re.search(r"exitcode\s*: -9\b", killed.stdout), killed.stdout[-5000:]
    assert read_manifest(run_dir / "step_2").world_size == 2
    resumed = torchrun(run_dir)  # the same command
    assert resumed.returncode == 0, resumed.stdout[-5000:]
    assert f"Resumed from checkpoint: {run_dir / 'step_2'}" in resumed.stdout
    assert_same_run(run_dir, reference_dir, STEPS // 2)
    files, positions = final_state(run_dir, STEPS // 2)
    assert "rng/rank-00001.safetensors" in files and set(positions) == {"rank-00000.json", "rank-00001.json"}
