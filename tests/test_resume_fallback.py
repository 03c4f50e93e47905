"""A corrupt newest checkpoint costs one interval, never a crash loop (issue 42, item 3).

A checkpoint whose large files fail their hashes only while a resume reads them (quick verification hashes the
small files; the large ones are checked as they are read into the model and optimizer) is moved aside as
``corrupt-<name>`` (kept, never picked again), and the resume loads the one before it instead. In fresh processes,
every logged loss and the final weights and optimizer state equal an uninterrupted run bit for bit:

* ``ResumableTrainer.train(resume_from_checkpoint=True)``, one process, and under DDP with split reads (extended);
* ``ResumableAccelerator.load_state()`` under ``hf-resumable run``, whose first attempt dies right after a disk fault
  (one restart, not a crash loop), and directly (extended);
* 2 gloo ranks whose node-local copies differ (only rank 1's is corrupt): both fall back to the same checkpoint;
* the FSDP2 piece layout, one rank's (small) piece file corrupt (extended);
* FSDP2, FSDP1 and ZeRO-3 (the last two extended), one byte of a piece file above 4 MiB that only rank 1 reads
  flipped: found in the middle of the load, agreed before anything is applied, so no rank waits in (or crosses) a
  collective.

An explicit path still raises and moves nothing; a run directory whose committed checkpoints all fail is a
``CorruptCheckpointError`` listing each, never a fresh start; a newer checkpoint that failed verification is kept
beside the new save of its step.
"""

from __future__ import annotations

import json
import shutil
import struct
import sys
from pathlib import Path

import pytest
import torch
from accelerate.state import AcceleratorState, GradientState
from safetensors.torch import load_file

from hf_resumable.checkpoint import find_latest_checkpoint, save_checkpoint, verify_checkpoint
from hf_resumable.checkpoint.discovery import set_aside_checkpoint
from hf_resumable.errors import CorruptCheckpointError
from hf_resumable.integrations.accelerate import ResumableAccelerator

from helpers import zygote
from helpers.accelerate_runs import _fresh_accelerate_state  # noqa: F401 - autouse: a fresh accelerate state
from helpers.distributed_launch import REPO_ROOT, child_env, launch_ranks, run_torchrun
from helpers.engine_runs import (
    ACCELERATE_WORKER,
    HOLD_STEP,
    _assert_same_pieces,
    _kill_after_commit,
    _reference,
    accelerate_reference,  # noqa: F401 - its uninterrupted FSDP2 run, a module fixture
)
from helpers.trainer_runs import KILLED, SCRIPT, _env, _resumed_from, _run, assert_identical

WORKER = Path(__file__).parent / "scripts" / "fallback_accelerate_worker.py"
# tests/trainer_scripts/train_tiny.py: a GPT-2 whose weights and AdamW state are files above the quick-hash limit
TRAINER_OPTIONS = ["--model", "gpt2", "--width", "256", "--data", "lm", "--max-steps", "6", "--save-steps", "2"]


def flip_tensor_byte(checkpoint: Path) -> Path:
    """Flip one byte in the middle of the tensor data of the checkpoint's largest file; return that file."""
    return flip_tensor_byte_of(max((p for p in checkpoint.rglob("*.safetensors")), key=lambda p: p.stat().st_size))


def flip_tensor_byte_of(path: Path) -> Path:
    data = bytearray(path.read_bytes())
    start = 8 + struct.unpack("<Q", data[:8])[0]
    data[(start + len(data)) // 2] ^= 0x40
    path.write_bytes(bytes(data))
    return path


def flip_byte_of_tensor(path: Path, suffix: str) -> Path:
    """Flip the middle byte of the data of the tensor whose name ends with ``suffix`` in safetensors file ``path``."""
    data = bytearray(path.read_bytes())
    length = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + length])
    (begin, end), = [entry["data_offsets"] for name, entry in header.items() if name.endswith(suffix)]
    data[8 + length + (begin + end) // 2] ^= 0x40
    path.write_bytes(bytes(data))
    return path


def run_worker(root: Path, out: Path, *extra: str) -> None:
    done = zygote.run([sys.executable, str(WORKER), "--root", str(root), "--out", str(out), *extra],
                      env=child_env(), cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return done


def losses(out: Path, rank: int = 0) -> list[tuple[int, str]]:
    return [(row["step"], row["loss"])
            for row in map(json.loads, (out / f"losses-rank{rank}.jsonl").read_text().splitlines())]


def assert_same_run(got: Path, reference: Path, rank: int = 0) -> None:
    want = dict(losses(reference, rank))
    # every logged loss, the steps trained again after the fallback included, equals the uninterrupted run's
    assert {step for step, _ in losses(got, rank)} == set(want)
    for step, loss in losses(got, rank):
        assert loss == want[step], (rank, step)
    ref, final = load_file(str(reference / f"final-rank{rank}.safetensors")), load_file(
        str(got / f"final-rank{rank}.safetensors"))
    assert sorted(final) == sorted(ref) and any(k.startswith("optim/") for k in ref)
    assert [k for k in ref if not torch.equal(ref[k], final[k])] == []


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("reference")
    run_worker(out / "checkpoints", out)
    return out


@pytest.mark.slow
@pytest.mark.extended  # the supervisor test below resumes the same way, in make test
def test_load_state_falls_back_past_a_corrupt_newest_checkpoint(tmp_path, reference):
    root, out = tmp_path / "checkpoints", tmp_path / "out"
    run_worker(root, out, "--stop-after", "5")  # checkpoint-2 and checkpoint-4 committed, step 5 trained
    corrupt = flip_tensor_byte(root / "checkpoint-4")
    assert corrupt.stat().st_size > 4 * 1024 * 1024  # not hashed by quick verification: found by the load
    assert find_latest_checkpoint(root) == root / "checkpoint-4"
    flipped = corrupt.read_bytes()

    done = run_worker(root, out)  # the same command
    assert json.loads((out / "resumed-rank0.json").read_text()) == str(root / "checkpoint-2")
    warning = next(line for line in done.stderr.splitlines() if "failed its hashes while it was loaded" in line)
    assert "WARNING" in warning and corrupt.name in warning and str(root / "checkpoint-2") in warning
    assert_same_run(out, reference)
    # kept for inspection, out of discovery's way (the resumed run saves up to step 4: checkpoint-4 is new)
    kept = root / "corrupt-checkpoint-4"
    assert (kept / corrupt.relative_to(root / "checkpoint-4")).read_bytes() == flipped
    assert not verify_checkpoint(kept, full=True).ok
    assert verify_checkpoint(root / "checkpoint-4", full=True).ok  # written again by the resumed run, beside it


@pytest.mark.slow
def test_trainer_falls_back_past_a_corrupt_newest_checkpoint(tmp_path):
    reference, run = tmp_path / "reference", tmp_path / "run"
    _run(reference, TRAINER_OPTIONS)
    _run(run, TRAINER_OPTIONS, expected=KILLED, kill_after_save=4)  # SIGKILLed once checkpoint-4 committed
    corrupt = flip_tensor_byte(run / "checkpoint-4")
    assert corrupt.stat().st_size > 4 * 1024 * 1024  # found by the load, not by quick verification
    flipped = corrupt.read_bytes()

    _run(run, TRAINER_OPTIONS)  # the same command
    assert _resumed_from(run) == str(run / "checkpoint-2")
    log = (tmp_path / "run.log").read_text()
    assert "failed its hashes while it was loaded" in log and corrupt.name in log
    assert_identical(reference, run)  # every logged loss and lr, the final weights and optimizer state
    assert (run / "corrupt-checkpoint-4" / corrupt.name).read_bytes() == flipped
    assert verify_checkpoint(run / "checkpoint-4", full=True).ok  # saved again by the resumed run


@pytest.mark.slow
def test_a_run_under_the_restart_supervisor_costs_one_interval_not_a_crash_loop(tmp_path, reference):
    """``hf-resumable run``: the first attempt dies (SIGKILL) right after a disk fault corrupted its newest
    checkpoint; the one restart falls back to the checkpoint before it and finishes, bit-identical."""
    root, out = tmp_path / "checkpoints", tmp_path / "out"
    done = zygote.run([sys.executable, "-m", "hf_resumable", "run", "--max-restarts", "3", "--", sys.executable,
                       str(WORKER), "--root", str(root), "--out", str(out)],
                      env=child_env({"HFR_CORRUPT_AND_DIE_AFTER": "5"}), cwd=tmp_path, capture_output=True,
                      text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    attempts = [json.loads(line) for line in (out / "attempts.jsonl").read_text().splitlines()]
    assert attempts == [{"restarts": "0", "resumed": None}, {"restarts": "1", "resumed": str(root / "checkpoint-2")}]
    warning = next(line for line in done.stderr.splitlines() if "failed its hashes while it was loaded" in line)
    assert warning.startswith("WARNING:") and "optimizer-00001-of-00001.safetensors" in warning
    assert f"Resuming from {root / 'checkpoint-2'} instead" in warning
    assert_same_run(out, reference)  # every logged loss (steps 3-5 twice), the final weights and optimizer state
    kept = root / "corrupt-checkpoint-4"  # kept whole for inspection; the restart saved a new checkpoint-4
    assert not verify_checkpoint(kept, full=True).ok and verify_checkpoint(root / "checkpoint-4", full=True).ok


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory) -> tuple[Path, Path]:
    """An uninterrupted 2-rank run, and one stopped after step 5 (checkpoint-2 and checkpoint-4 committed)."""
    reference, first = tmp_path_factory.mktemp("reference2"), tmp_path_factory.mktemp("first2")
    for out, extra in ((reference, []), (first, ["--stop-after", "5"])):
        for result in launch_ranks([str(WORKER), "--root", str(out / "checkpoints"), "--out", str(out), *extra],
                                   world_size=2, timeout=300):
            assert result.returncode == 0, result.describe()
    return reference, first


@pytest.mark.distributed
@pytest.mark.parametrize("found_by", ["load", "verification"])
def test_two_ranks_agree_when_only_one_rank_finds_the_corruption(tmp_path, two_rank_runs, found_by):
    """Node-local copies: rank 1's copy of checkpoint-4 has a flipped byte, rank 0's is intact. In a large file
    only rank 1's load finds it; in a small one only rank 1's verification does. Both ranks resume from
    checkpoint-2."""
    reference, first = two_rank_runs
    nodes = tmp_path / "nodes"
    for rank in (0, 1):
        shutil.copytree(first / "checkpoints", nodes / f"rank{rank}")
    if found_by == "load":
        flip_tensor_byte(nodes / "rank1" / "checkpoint-4")
    else:
        flip_tensor_byte_of(nodes / "rank1" / "checkpoint-4" / "rng" / "rank-00001.safetensors")
    resumed = tmp_path / "resumed"
    shutil.copytree(first, resumed, ignore=shutil.ignore_patterns("checkpoints"))
    # no saves after the resume: the ranks' directories differ here, while real node-local copies share one path
    results = launch_ranks([str(WORKER), "--root", str(nodes / "rank{rank}"), "--out", str(resumed),
                            "--save-until", "0"], world_size=2, timeout=300)
    for result in results:
        assert result.returncode == 0, result.describe()
    for rank in (0, 1):
        assert json.loads((resumed / f"resumed-rank{rank}.json").read_text()) == str(
            nodes / f"rank{rank}" / "checkpoint-2")
        assert_same_run(resumed, reference, rank)
    assert (nodes / "rank1" / "corrupt-checkpoint-4").is_dir()
    if found_by == "load":  # rank 0's own copy loaded fine; the checkpoint failed for the job: both copies set aside
        assert "while it was loaded (rank 1: CorruptCheckpointError" in results[0].stderr
        assert (nodes / "rank0" / "corrupt-checkpoint-4").is_dir()
    else:  # rank 0's copy verifies: it stays; rank 1 skipped its own
        assert "Skipping" in results[1].stderr and "rank-00001.safetensors" in results[1].stderr
        assert verify_checkpoint(nodes / "rank0" / "checkpoint-4", full=True).ok


@pytest.mark.distributed
@pytest.mark.extended
def test_trainer_under_ddp_falls_back_when_one_rank_reads_the_corrupt_file(tmp_path):
    """torchrun, 2 ranks: a flipped byte in the newest checkpoint, which every rank reads; both train again from
    checkpoint-2 (DDP wrapped anew), bit-identical on every rank."""
    env = _env()

    def torchrun(output: Path, **kill: int):
        return run_torchrun(SCRIPT, ["--output-dir", str(output), *TRAINER_OPTIONS],
                            env={**env, **_env(**kill)}, timeout=300)

    reference, run = tmp_path / "reference", tmp_path / "run"
    assert torchrun(reference).returncode == 0
    assert torchrun(run, kill_job_after_save=4).returncode == KILLED
    flip_tensor_byte(run / "checkpoint-4")
    done = torchrun(run)
    assert done.returncode == 0, done.stdout[-5000:]
    assert "failed its hashes while it was loaded" in done.stdout
    for suffix in ("", "-rank1"):
        assert_identical(reference, run, suffix=suffix)
        assert json.loads((run / f"result{suffix}.json").read_text())["resumed_from"] == str(run / "checkpoint-2")
    assert (run / "corrupt-checkpoint-4").is_dir()


@pytest.mark.distributed
@pytest.mark.extended
def test_fsdp2_pieces_fall_back_when_one_rank_piece_file_is_corrupt(tmp_path, accelerate_reference):
    """The per-rank piece layout (FSDP2, 2 ranks): one byte of rank 1's piece file flipped (a small file, which
    quick verification hashes on every rank); both ranks skip that checkpoint, set it aside and resume from the
    one before, bit-identical to the uninterrupted run."""
    run = tmp_path / "run"
    checkpoint = run / "checkpoints" / f"checkpoint-{HOLD_STEP}"
    _kill_after_commit(ACCELERATE_WORKER, run, [], checkpoint)
    pieces = [path for path in checkpoint.rglob("*.safetensors") if "rank-00001" in path.as_posix()]
    assert pieces, sorted(p.name for p in checkpoint.rglob("*"))
    corrupt = flip_tensor_byte_of(max(pieces, key=lambda path: path.stat().st_size))
    resumed = run_torchrun(ACCELERATE_WORKER, ["--output-dir", str(run)], env=child_env(), timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-5000:]
    assert corrupt.name in resumed.stdout and "kept for inspection" in resumed.stdout
    for rank in (0, 1):
        want = dict(losses(accelerate_reference, rank))
        assert {step: loss for step, loss in losses(run, rank)} == want  # steps trained again: the same losses
    _assert_same_pieces(run, accelerate_reference)
    assert (run / "checkpoints" / f"corrupt-checkpoint-{HOLD_STEP}").is_dir()


# ---------------------------------------------------------------- in process: explicit paths, nothing usable


def _build(root: Path):
    accelerator = ResumableAccelerator(cpu=True, checkpoint_dir=root, handle_preemption=False, keep_last=None)
    torch.manual_seed(0)
    model = torch.nn.Linear(1100, 1000)  # 4.4 MB of weights: above the quick-verification hash limit
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    return accelerator, model, optimizer


def _step(accelerator, model, optimizer) -> None:
    accelerator.backward(model(torch.ones(2, 1100)).pow(2).mean())
    optimizer.step()
    optimizer.zero_grad()


def test_an_explicit_path_still_raises_and_is_left_where_it_is(tmp_path):
    accelerator, model, optimizer = _build(tmp_path)
    _step(accelerator, model, optimizer)
    accelerator.save_state()
    corrupt = flip_tensor_byte(tmp_path / "checkpoint-1")
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    resumed, *_ = _build(tmp_path)
    with pytest.raises(CorruptCheckpointError, match=corrupt.name):
        resumed.load_state(tmp_path / "checkpoint-1")
    assert (tmp_path / "checkpoint-1").is_dir() and not (tmp_path / "corrupt-checkpoint-1").exists()


def test_no_checkpoint_that_loads_is_an_error_listing_each_never_a_fresh_start(tmp_path):
    accelerator, model, optimizer = _build(tmp_path)
    for _ in range(2):
        _step(accelerator, model, optimizer)
        accelerator.save_state()
    flip_tensor_byte(tmp_path / "checkpoint-2")  # found while it is loaded
    small = tmp_path / "checkpoint-1" / "training_state.json"  # found by quick verification
    small.write_text(small.read_text().replace("{", "{ ", 1))
    (tmp_path / "checkpoint-3").mkdir()  # an interrupted save: no manifest, not a checkpoint
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    resumed, *_ = _build(tmp_path)
    with pytest.raises(CorruptCheckpointError, match="no checkpoint under") as raised:
        resumed.load_state()
    message = str(raised.value)
    assert "checkpoint-2" in message and "corrupt-checkpoint-2" in message and "checkpoint-1" in message
    assert "training_state.json" in message and "checkpoint-3" not in message and "explicit path" in message
    assert resumed.global_step == 0


def test_set_aside_never_replaces_and_numbers_the_next_one(tmp_path):
    for _ in range(2):
        save_checkpoint(tmp_path / "checkpoint-5", model=torch.nn.Linear(2, 2), step=5)
        assert set_aside_checkpoint(tmp_path / "checkpoint-5").name in ("corrupt-checkpoint-5",
                                                                         "corrupt-checkpoint-5.2")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corrupt-checkpoint-5", "corrupt-checkpoint-5.2"]
    assert find_latest_checkpoint(tmp_path) is None


def test_a_newer_checkpoint_that_fails_verification_is_set_aside_not_replaced_later(tmp_path, caplog):
    accelerator, model, optimizer = _build(tmp_path)
    for _ in range(2):
        _step(accelerator, model, optimizer)
        accelerator.save_state()
    small = tmp_path / "checkpoint-2" / "training_state.json"  # hashed by quick verification
    small.write_text(small.read_text().replace("{", "{ ", 1))
    flipped = small.read_bytes()
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    resumed, model2, optimizer2 = _build(tmp_path)
    with caplog.at_level("WARNING"):
        assert resumed.load_state().path == tmp_path / "checkpoint-1"
    assert "kept for inspection as" in caplog.text and "corrupt-checkpoint-2" in caplog.text
    _step(resumed, model2, optimizer2)
    assert resumed.save_state() == tmp_path / "checkpoint-2"  # a new checkpoint-2, beside the kept one
    assert (tmp_path / "corrupt-checkpoint-2" / "training_state.json").read_bytes() == flipped
    assert verify_checkpoint(tmp_path / "checkpoint-2", full=True).ok


def test_trainer_explicit_path_still_raises_and_is_left_where_it_is(tmp_path):
    from transformers import TrainingArguments

    from hf_resumable.integrations.trainer import ResumableTrainer

    from helpers.tiny_models import tiny_gpt2

    rows = [{"input_ids": list(range(3, 19)), "labels": list(range(3, 19))}] * 8

    def trainer(max_steps: int) -> ResumableTrainer:
        args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, max_steps=max_steps, save_steps=1,
                                 per_device_train_batch_size=2, report_to=[], disable_tqdm=True)
        return ResumableTrainer(model=tiny_gpt2(n_embd=256), args=args, train_dataset=rows)

    trainer(1).train()
    corrupt = flip_tensor_byte(tmp_path / "checkpoint-1")
    assert corrupt.stat().st_size > 4 * 1024 * 1024  # found by the load, not by verification
    with pytest.raises(CorruptCheckpointError, match=corrupt.name):
        trainer(2).train(resume_from_checkpoint=str(tmp_path / "checkpoint-1"))
    assert (tmp_path / "checkpoint-1").is_dir() and not list(tmp_path.glob("corrupt-*"))
    assert not (tmp_path / "checkpoint-2").exists()


RESUME_TIMEOUT = 240  # a hang shows as a failure, with the job's output
WIDE = ["--width", "320"]  # piece files above the quick-verification hash limit: hash-checked only as they are read
ZERO3 = ["--engine", "deepspeed", "--zero-stage", "3"]


def _large_piece_of_rank_1(checkpoint: Path, prefix: str) -> Path:
    """Rank 1's piece file named ``prefix...`` (read by rank 1 alone at the same world size), above 4 MiB."""
    pieces = [path for path in checkpoint.rglob(f"{prefix}-rank00001-of-*.safetensors")]
    assert len(pieces) == 1, sorted(p.relative_to(checkpoint).as_posix() for p in checkpoint.rglob("*"))
    assert pieces[0].stat().st_size > 4 << 20, (pieces[0], pieces[0].stat().st_size)
    return pieces[0]


def _falls_back_past_a_large_corrupt_piece(tmp_path: Path, tmp_path_factory, options: list[str],
                                           prefix: str, tensor: str) -> None:
    """Kill the job after checkpoint-3, flip a byte of rank 1's large piece file (found mid-load by rank 1 only),
    resume with a timeout: both ranks fall back to checkpoint-2, bit-identical to the uninterrupted run."""
    reference = _reference(tmp_path_factory, ACCELERATE_WORKER, tuple(options))
    run = tmp_path / "run"
    checkpoint = run / "checkpoints" / f"checkpoint-{HOLD_STEP}"
    _kill_after_commit(ACCELERATE_WORKER, run, options, checkpoint)
    corrupt = flip_byte_of_tensor(_large_piece_of_rank_1(checkpoint, prefix), tensor)
    assert verify_checkpoint(checkpoint, full=False).ok  # quick verification does not hash it: only the load finds it
    resumed = run_torchrun(ACCELERATE_WORKER, ["--output-dir", str(run), *options], env=child_env(),
                           timeout=RESUME_TIMEOUT)
    assert resumed.returncode == 0, resumed.stdout[-5000:]
    assert "failed its hashes while it was loaded (rank 1: CorruptCheckpointError" in resumed.stdout
    assert corrupt.name in resumed.stdout
    for rank in (0, 1):
        assert {step: loss for step, loss in losses(run, rank)} == dict(losses(reference, rank))
    _assert_same_pieces(run, reference)
    assert (run / "checkpoints" / f"corrupt-checkpoint-{HOLD_STEP}").is_dir()


@pytest.mark.distributed
def test_fsdp2_falls_back_when_one_rank_finds_a_large_piece_corrupt_mid_load(tmp_path, tmp_path_factory):
    _falls_back_past_a_large_corrupt_piece(tmp_path, tmp_path_factory, WIDE, "model", "h.0.attn.c_attn.weight")


@pytest.mark.distributed
@pytest.mark.extended
def test_zero3_falls_back_when_one_rank_finds_a_large_piece_corrupt_mid_load(tmp_path, tmp_path_factory):
    # ZeRO-3's weights are recorded as its fp32 master weights: the one large file per rank is its optimizer's
    _falls_back_past_a_large_corrupt_piece(tmp_path, tmp_path_factory, [*ZERO3, *WIDE], "optimizer", "/fp32")


@pytest.mark.distributed
@pytest.mark.extended  # make test: the FSDP2 case above (the same piece fallback; FSDP1 resumes in test_engines.py)
def test_fsdp1_falls_back_when_one_rank_finds_a_large_piece_corrupt_mid_load(tmp_path, tmp_path_factory):
    """FSDP1 unshards its parameters to load them (a gather): without the agreement before it, rank 0's gather met
    rank 1's report and gloo aborted the job."""
    _falls_back_past_a_large_corrupt_piece(tmp_path, tmp_path_factory, ["--version", "1", *WIDE], "model",
                                           "h.0.attn.c_attn.weight")


AGREED_READS_WORKER = Path(__file__).parent / "scripts" / "agreed_reads_worker.py"


def _agreed_reads_ranks(tmp_path: Path, mode: str, *extra: str) -> list[dict]:
    """Run tests/scripts/agreed_reads_worker.py MODE on 2 gloo ranks; what each rank raised, and when it left."""
    results = launch_ranks([str(AGREED_READS_WORKER), mode, str(tmp_path), *extra], world_size=2, timeout=120)
    for result in results:  # a rank left waiting would be killed at the timeout (the group's own is longer)
        assert result.returncode == 0 and not result.killed_by_timeout, result.describe()
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.distributed
def test_a_rank_whose_read_fails_with_eio_stops_every_rank_none_waits(tmp_path):
    """Rank 1 meets an EIO inside agreed_reads, rank 0 nothing: both leave together, rank 1 with its own OSError,
    rank 0 with ReadFailedOnAnotherRankError naming rank 1 and EIO (no corruption: nothing to fall back for)."""
    zero, one = _agreed_reads_ranks(tmp_path, "eio")
    assert one["raised"]["type"] == "OSError" and "Input/output error" in one["raised"]["message"]
    raised = zero["raised"]
    assert raised["type"] == "ReadFailedOnAnotherRankError" and raised["rank"] == 1
    assert "RuntimeError" in raised["mro"] and "CorruptCheckpointError" not in raised["mro"]
    assert all(word in raised["message"] for word in ("out/checkpoint-8", "rank 1", "OSError (EIO)",
                                                      "Input/output error", "model-00002-of-00002.safetensors"))
    assert zero["after"] == one["after"] == [0, 1]  # their next collective still pairs


@pytest.mark.distributed
def test_a_corrupt_read_on_one_rank_still_raises_corruption_on_every_rank(tmp_path):
    zero, one = _agreed_reads_ranks(tmp_path, "corrupt")
    assert one["raised"]["type"] == "CorruptCheckpointError"
    assert zero["raised"]["type"] == "CorruptOnAnotherRankError" and zero["raised"]["rank"] == 1
    assert "sha256 mismatch" in zero["raised"]["message"] and zero["after"] == one["after"] == [0, 1]


@pytest.mark.distributed
def test_corruption_on_one_rank_and_eio_on_another_stops_both_neither_falls_back(tmp_path):
    zero, one = _agreed_reads_ranks(tmp_path, "mixed")
    assert one["raised"]["type"] == "OSError"
    assert zero["raised"]["type"] == "ReadFailedOnAnotherRankError" and zero["raised"]["rank"] == 1
    assert "CorruptCheckpointError" not in zero["raised"]["mro"]


@pytest.mark.distributed
def test_resume_does_not_fall_back_on_any_rank_when_one_rank_load_fails_with_eio(tmp_path):
    """resume_newest's load (agreed_load) meets EIO on rank 1 only: every rank raises, no rank falls back to the
    older checkpoint, and no checkpoint is set aside."""
    model = torch.nn.Linear(4, 2)
    for step in (4, 8):
        save_checkpoint(tmp_path / "root" / "rank0" / f"checkpoint-{step}", model=model, step=step)
    shutil.copytree(tmp_path / "root" / "rank0", tmp_path / "root" / "rank1")
    zero, one = _agreed_reads_ranks(tmp_path, "resume", str(tmp_path / "root"))
    assert one["raised"]["type"] == "OSError"
    assert zero["raised"]["type"] == "ReadFailedOnAnotherRankError" and "checkpoint-8" in zero["raised"]["message"]
    for rank in (0, 1):
        assert sorted(p.name for p in (tmp_path / "root" / f"rank{rank}").iterdir()) == ["checkpoint-4",
                                                                                         "checkpoint-8"]
