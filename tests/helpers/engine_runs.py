"""FSDP / DeepSpeed engine jobs (``tests/scripts/fsdp_*_worker.py`` under torchrun, gloo ranks on CPU): the
uninterrupted references, a job SIGKILLed once a checkpoint has committed, and the comparison of every rank's pieces.
The engines' CPU shim itself is :mod:`helpers.engine_fixtures`."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from hf_resumable.checkpoint import read_manifest, verify_checkpoint

from helpers.distributed_launch import child_env, kill_torchrun_after, run_torchrun
from helpers.engine_fixtures import read_local_state

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


ACCELERATE_WORKER = SCRIPTS / "fsdp_accelerate_worker.py"


TRAINER_WORKER = SCRIPTS / "fsdp_trainer_worker.py"


HOLD_STEP = 3  # the job is held after checkpoint-3 committed, then SIGKILLed


def _run_job(worker: Path, output: Path, options: list[str], nproc: int = 2) -> subprocess.CompletedProcess:
    return run_torchrun(worker, ["--output-dir", str(output), *options], env=child_env(), timeout=300, nproc=nproc)


def _kill_after_commit(worker: Path, output: Path, options: list[str], checkpoint: Path, nproc: int = 2) -> None:
    """Run the job (``nproc`` ranks) held after checkpoint ``HOLD_STEP``; once that checkpoint has committed, SIGKILL
    the job."""
    returncode = kill_torchrun_after(worker, ["--output-dir", str(output), *options], nproc=nproc,
                                     marker=checkpoint / "manifest.json",  # renamed into place: committed
                                     log=output.parent / f"{output.name}-held.log",
                                     env=child_env({"HFR_HOLD_AFTER_SAVE": str(HOLD_STEP)}))
    assert returncode == -signal.SIGKILL
    assert verify_checkpoint(checkpoint, full=True).ok
    assert read_manifest(checkpoint).world_size == nproc
    assert not list(output.glob("final-rank*")), "the job ran to its end before it was killed"


def _assert_same_pieces(run: Path, reference: Path, nproc: int = 2) -> None:
    for rank in range(nproc):
        want, got = (read_local_state(path / f"final-rank{rank}.safetensors") for path in (reference, run))
        assert sorted(got) == sorted(want) and any(name.startswith("optim/") for name in want)
        different = [name for name in want if not torch.equal(want[name], got[name])]
        assert not different, (rank, different[:5])


def _losses(path: Path) -> dict[int, str]:
    return {row["step"]: row["loss"] for row in map(json.loads, path.read_text().splitlines())}


def _reference(tmp_path_factory: pytest.TempPathFactory, worker: Path, options: tuple[str, ...] = (),
               nproc: int = 2) -> Path:
    """The uninterrupted run (accelerate's default SHARDED_STATE_DICT; FULL_STATE_DICT runs must equal it too)."""
    output = tmp_path_factory.mktemp(worker.stem) / "reference"
    done = _run_job(worker, output, list(options), nproc)
    assert done.returncode == 0, done.stdout[-5000:]
    return output


@pytest.fixture(scope="module")
def accelerate_reference(tmp_path_factory) -> Path:
    return _reference(tmp_path_factory, ACCELERATE_WORKER)


@pytest.fixture(scope="module")
def trainer_reference(tmp_path_factory) -> Path:
    return _reference(tmp_path_factory, TRAINER_WORKER)


def _resume_accelerate_bit_exact(run: Path, reference: Path, options: list[str], nproc: int = 2) -> None:
    """Kill the accelerate job after checkpoint-3 committed, rerun it, and compare it with ``reference``."""
    checkpoint = run / "checkpoints" / f"checkpoint-{HOLD_STEP}"
    _kill_after_commit(ACCELERATE_WORKER, run, options, checkpoint, nproc)
    assert (checkpoint / "sharded_layout.json").is_file()  # every rank's pieces, not a gathered copy
    resumed = _run_job(ACCELERATE_WORKER, run, options, nproc)  # the same command
    assert resumed.returncode == 0, resumed.stdout[-5000:]
    for rank in range(nproc):
        want = _losses(reference / f"losses-rank{rank}.jsonl")
        lines = (run / f"losses-rank{rank}.jsonl").read_text().splitlines()
        # steps 1-3 before the kill, 4-5 after the resume from checkpoint-3: nothing repeated or skipped
        assert [json.loads(line)["step"] for line in lines] == list(range(1, 6))
        assert _losses(run / f"losses-rank{rank}.jsonl") == want
    _assert_same_pieces(run, reference, nproc)


def _resume_trainer_bit_exact(run: Path, reference: Path, options: list[str], nproc: int = 2) -> None:
    """Kill the Trainer job after checkpoint-3 committed, rerun it, and compare it with ``reference``."""
    checkpoint = run / f"checkpoint-{HOLD_STEP}"
    _kill_after_commit(TRAINER_WORKER, run, options, checkpoint, nproc)
    assert (checkpoint / "sharded_layout.json").is_file() and (checkpoint / "trainer_state.json").is_file()
    resumed = _run_job(TRAINER_WORKER, run, options, nproc)  # the same command
    assert resumed.returncode == 0, resumed.stdout[-5000:]
    for rank in range(nproc):
        want = json.loads((reference / f"result-rank{rank}.json").read_text())
        got = json.loads((run / f"result-rank{rank}.json").read_text())
        assert got["resumed_from"].endswith(f"checkpoint-{HOLD_STEP}")
        assert got["log_history"] == want["log_history"]  # every logged loss, grad norm and learning rate
    _assert_same_pieces(run, reference, nproc)
