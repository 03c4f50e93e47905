"""The CUDA tier: what only a GPU exercises, each case against an uninterrupted run on the same device.

* ``ResumableTrainer`` SIGKILLed after a checkpoint and rerun with the same command ends bit-identical (every logged
  loss and grad norm, weights, optimizer state, the GradScaler's state) with ``fp16=True`` and with ``bf16=True``,
  dropout on, under the deterministic settings of docs/limits.md. Under fp16 a huge initial loss scale makes the
  first steps overflow: the scaler skips steps before and after the kill, and its scale and skips resume exactly.
* ``ResumableAccelerator`` (``examples/custom_loop.py``) the same with ``mixed_precision="fp16"`` and ``"bf16"``.
* The CUDA generator of every visible device is saved and restored; another device count is refused before
  anything changes.
* A checkpoint saved from CUDA tensors loads on the CPU and back onto the GPU, and onto another device index (with
  2+ GPUs).
* An async save from CUDA tensors stages into pinned host buffers on a side stream: its committed bytes equal a
  blocking save's, and the training stream waits far less than the write takes (CUDA events).
* A world of one process under ``torchrun --nproc-per-node 1`` on NCCL, through both front doors (DDP and FSDP2),
  killed after a commit and rerun, bit for bit.
* Generation streamed onto the GPU (``StreamingModel(device="cuda")``) equals the full model's on the GPU.

Every body also runs on the CPU with ``HFR_GPU_TESTS_DEVICE=cpu`` (the same scripts with ``--device cpu``, gloo for
NCCL): a dry run of the harness, so that the GPU window is not spent on a typo. There, what only a GPU has (a
GradScaler, pinned memory, a side stream, CUDA events, a second device) is checked to be absent instead.
Without CUDA (and without that variable) every test here is skipped with one line saying why. ``make test-gpu``
runs this tier; benchmarks/gpu_check.sh runs it before the GPU benchmarks.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest
import torch

from hf_resumable.checkpoint import load_checkpoint, read_manifest, save_checkpoint, wait_for_pending_saves
from hf_resumable.checkpoint.api import background_saver
from hf_resumable.checkpoint.background import _staging
from hf_resumable.errors import InexactResumeError
from hf_resumable.format.rng import (
    RngState,
    capture_rng_state,
    load_rng_state,
    restore_rng_state,
    save_rng_state,
    visible_cuda_devices,
)

from helpers.accelerate_runs import EXAMPLE, assert_same_run, read_losses, run_example
from helpers.distributed_launch import child_env, run_torchrun
from helpers.engine_runs import (
    ACCELERATE_WORKER,
    TRAINER_WORKER,
    _reference,
    _resume_accelerate_bit_exact,
    _resume_trainer_bit_exact,
)
from helpers.streaming_models import _gpt2, _llama, assert_streams_onto
from helpers.tiny_models import assert_same_optimizer, assert_same_state, tiny_gpt2, train_steps
from helpers.trainer_runs import KILLED, SCRIPT, _run, _start, _wait, assert_identical

DEVICE_ENV = "HFR_GPU_TESTS_DEVICE"
DEVICE = os.environ.get(DEVICE_ENV, "cuda")
ON_GPU = DEVICE == "cuda"
BACKEND = "nccl" if ON_GPU else "gloo"
HUGE_SCALE = str(2.0 ** 40)  # fp16 overflows at once: the first steps are skipped, backing off by 256 each
# Settings a bit-exact GPU run needs (docs/limits.md); the scripts' --deterministic sets the rest.
DETERMINISTIC_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "PYTHONHASHSEED": "0"}

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(ON_GPU and not torch.cuda.is_available(),
                       reason=f"needs a CUDA device, none is visible (make test-gpu on a GPU machine; "
                              f"{DEVICE_ENV}=cpu runs these bodies on the CPU)"),
]


@pytest.fixture(autouse=True)
def _gpu_environment(monkeypatch):
    """Every process a test starts gets the deterministic settings; on a GPU each is a fresh interpreter (a test
    zygote forks processes from one that imported torch, and CUDA must not be set up before a fork)."""
    for name, value in DETERMINISTIC_ENV.items():
        monkeypatch.setenv(name, value)
    if ON_GPU:
        monkeypatch.setenv("HF_RESUMABLE_TEST_ZYGOTE", "0")


def _scaler_skips(output: Path) -> list[int]:
    """Steps an fp16 GradScaler skipped (overflow), from train_tiny.py's result."""
    result = json.loads((output / "result.json").read_text())
    return [entry["step"] for entry in result["scaler_steps"] if entry["skipped"]]


# ------------------------------------------------------------------ ResumableTrainer, fp16 and bf16


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_trainer_killed_and_rerun_is_bit_exact_in_mixed_precision(tmp_path, precision):
    kill_after = 2
    options = ["--model", "gpt2", "--data", "lm", "--epochs", "1", "--device", DEVICE, "--precision", precision,
               "--deterministic", "--init-scale", HUGE_SCALE]
    reference = _start(tmp_path / "reference", options)  # uninterrupted, alongside
    run = tmp_path / "run"
    _run(run, options, expected=KILLED, kill_after_save=kill_after)
    _run(run, options)
    _wait(reference, tmp_path / "reference", 0)
    assert_identical(tmp_path / "reference", run)
    want, got = (json.loads((path / "result.json").read_text()) for path in (tmp_path / "reference", run))
    assert got["resumed_from"].endswith(f"checkpoint-{kill_after}")
    assert got["scaler"] == want["scaler"]  # scale, growth tracker, factors
    if ON_GPU and precision == "fp16":
        skipped = _scaler_skips(tmp_path / "reference")
        assert any(s <= kill_after for s in skipped) and any(s > kill_after for s in skipped), (
            f"the GradScaler should skip steps before and after the kill at {kill_after}: skipped {skipped}")
        assert [e for e in got["scaler_steps"]] == [e for e in want["scaler_steps"] if e["step"] > kill_after]
    else:  # bf16, or fp16 on the CPU: accelerate builds no GradScaler
        assert want["scaler"] is None and not want["scaler_steps"]


# ------------------------------------------------------------------ ResumableAccelerator, fp16 and bf16


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_accelerator_killed_and_rerun_is_bit_exact_in_mixed_precision(tmp_path, precision):
    kill_after = 3  # checkpoints every 2 steps: resumes from checkpoint-2 and runs step 3 again
    extra = ("--device", DEVICE, "--mixed-precision", precision, "--deterministic", "--init-scale", HUGE_SCALE)
    reference = run_example(tmp_path / "reference", num_workers=0, extra=extra)
    assert reference.returncode == 0, reference.stderr[-3000:]
    killed = run_example(tmp_path / "run", num_workers=0, extra=extra,
                         env={"HF_RESUMABLE_EXAMPLE_KILL_AFTER_STEP": str(kill_after)})
    assert killed.returncode == KILLED, killed.stderr[-3000:]
    resumed = run_example(tmp_path / "run", num_workers=0, extra=extra)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Resumed from" in resumed.stderr and "checkpoint-2" in resumed.stderr
    assert_same_run(tmp_path / "run", tmp_path / "reference")
    rows = [json.loads(line) for line in (tmp_path / "reference" / "losses.jsonl").read_text().splitlines()]
    skipped = [row["step"] for row in rows if row["skipped"]]
    if ON_GPU and precision == "fp16":
        assert any(s < kill_after for s in skipped) and any(s >= kill_after for s in skipped), skipped
    else:
        assert not skipped
    resumed_rows = [json.loads(line) for line in (tmp_path / "run" / "losses.jsonl").read_text().splitlines()]
    assert {(r["step"], r["skipped"]) for r in resumed_rows} == {(r["step"], r["skipped"]) for r in rows}


# ------------------------------------------------------------------ the CUDA generator of every device


def _draws() -> list[torch.Tensor]:
    """One draw from the CPU generator and from each visible CUDA device's (moved to the CPU to compare)."""
    return [torch.rand(4)] + [torch.rand(4, device=f"cuda:{i}").cpu() for i in range(visible_cuda_devices())]


def test_cuda_generator_of_every_visible_device_is_restored(tmp_path):
    devices = visible_cuda_devices()
    assert devices == (torch.cuda.device_count() if ON_GPU else 0)
    _draws()  # every device's generator moves off its seed
    state = capture_rng_state()
    assert len(state.cuda) == devices
    save_rng_state(tmp_path / "rng.safetensors", state)
    want = _draws()
    _draws()
    restore_rng_state(load_rng_state(tmp_path / "rng.safetensors"))
    assert all(torch.equal(a, b) for a, b in zip(_draws(), want))


def test_another_cuda_device_count_is_refused_before_any_generator_changes(tmp_path):
    state = capture_rng_state()
    devices = len(state.cuda)
    # a checkpoint from a machine with one device fewer (or, with none here, one more)
    other = state.cuda[:-1] if devices else [torch.zeros(16, dtype=torch.uint8)]
    saved = RngState(state.python, state.numpy, state.torch_cpu, other)
    model = tiny_gpt2(seed=0).to(DEVICE)
    save_checkpoint(tmp_path / "checkpoint-1", model=model, step=1, training_state={"global_step": 1}, rng=saved)
    live = tiny_gpt2(seed=1).to(DEVICE)
    before = {k: v.clone() for k, v in live.state_dict().items()}
    _draws()
    generators = capture_rng_state()
    with pytest.raises(InexactResumeError, match=rf"saved with {len(other)} CUDA device\(s\) but {devices} are"):
        load_checkpoint(tmp_path / "checkpoint-1", model=live)
    assert all(torch.equal(v, before[k]) for k, v in live.state_dict().items())
    assert capture_rng_state().equals(generators)


# ------------------------------------------------------------------ placement at load


def _trained(device: str | torch.device) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = tiny_gpt2(seed=0).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train_steps(model, optimizer, steps=2, device=device)
    return model, optimizer


def _fresh(device: str | torch.device) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = tiny_gpt2(seed=1).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train_steps(model, optimizer, steps=1, seed=1, device=device)
    return model, optimizer


def _on(state: dict, device: str | torch.device) -> dict:
    return {k: v.to(device) for k, v in state.items()}


def _assert_placed(model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    assert all(p.device == device for p in model.parameters())
    assert all(v.device == device for s in optimizer.state.values() for k, v in s.items()
               if torch.is_tensor(v) and k != "step")


def test_checkpoint_of_cuda_tensors_loads_on_the_cpu_and_back(tmp_path):
    model, optimizer = _trained(DEVICE)
    save_checkpoint(tmp_path / "from-device", model=model, optimizer=optimizer, step=2, rng=False)
    on_cpu, cpu_optimizer = _fresh("cpu")
    load_checkpoint(tmp_path / "from-device", model=on_cpu, optimizer=cpu_optimizer, restore_rng=False)
    assert_same_state(on_cpu.state_dict(), _on(model.state_dict(), "cpu"))
    _assert_placed(on_cpu, cpu_optimizer, torch.device("cpu"))

    save_checkpoint(tmp_path / "from-cpu", model=on_cpu, optimizer=cpu_optimizer, step=2, rng=False)
    back, back_optimizer = _fresh(DEVICE)
    load_checkpoint(tmp_path / "from-cpu", model=back, optimizer=back_optimizer, restore_rng=False)
    assert_same_state(back.state_dict(), model.state_dict())
    assert_same_optimizer(back_optimizer, optimizer)
    _assert_placed(back, back_optimizer, next(model.parameters()).device)
    # both checkpoints hold the same bytes, whichever device their tensors came from
    assert read_manifest(tmp_path / "from-device").files.keys() == read_manifest(tmp_path / "from-cpu").files.keys()
    for name in read_manifest(tmp_path / "from-device").files:
        if name.endswith(".safetensors"):
            assert (tmp_path / "from-device" / name).read_bytes() == (tmp_path / "from-cpu" / name).read_bytes(), name


@pytest.mark.skipif(not ON_GPU or torch.cuda.device_count() < 2,
                    reason="needs 2 CUDA devices (this machine has fewer): a load onto another device index")
def test_checkpoint_saved_on_one_device_loads_onto_another_index(tmp_path):
    model, optimizer = _trained("cuda:0")
    save_checkpoint(tmp_path / "checkpoint-2", model=model, optimizer=optimizer, step=2, rng=False)
    other, other_optimizer = _fresh("cuda:1")
    load_checkpoint(tmp_path / "checkpoint-2", model=other, optimizer=other_optimizer, restore_rng=False)
    _assert_placed(other, other_optimizer, torch.device("cuda:1"))
    assert_same_state(_on(other.state_dict(), "cuda:0"), model.state_dict())


# ------------------------------------------------------------------ async save: pinned staging, side stream


class _StreamClock:
    """Wall time of the training stream: CUDA events on a GPU (idle gaps, while the host is blocked, count), the
    host's clock on the CPU."""

    def __init__(self) -> None:
        self.start = torch.cuda.Event(enable_timing=True) if ON_GPU else None
        self.end = torch.cuda.Event(enable_timing=True) if ON_GPU else None

    def __enter__(self) -> _StreamClock:
        if ON_GPU:
            torch.cuda.synchronize()
            self.start.record()
        self.began = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if ON_GPU:
            self.end.record()
            self.end.synchronize()
            self.seconds = self.start.elapsed_time(self.end) / 1000
        else:
            self.seconds = time.perf_counter() - self.began


def _train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, ids: torch.Tensor) -> None:
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def test_async_save_stages_into_pinned_memory_on_a_side_stream_without_blocking_training(tmp_path):
    # about 27M parameters and their AdamW moments (about 0.3 GB): a write that takes measurably long
    model = tiny_gpt2(seed=0, n_embd=512, n_layer=6, n_head=8, vocab_size=8192).to(DEVICE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(3, 8192, (2, 32), device=DEVICE)
    for _ in range(2):
        _train_step(model, optimizer, ids)
    rng = capture_rng_state()
    with _StreamClock() as plain:  # a step with no save in flight
        _train_step(model, optimizer, ids)
    save_checkpoint(tmp_path / "warm-up", model=model, optimizer=optimizer, step=3, rng=rng, blocking=False)
    wait_for_pending_saves()  # the first async save allocates (and pins) the staging buffers; later ones reuse them
    save_checkpoint(tmp_path / "blocking", model=model, optimizer=optimizer, step=3, rng=rng)
    wait_for_pending_saves()  # its deferred fsyncs too

    with _StreamClock() as stalled:  # the save call and the next step, which waits for the staging copy
        save_checkpoint(tmp_path / "async", model=model, optimizer=optimizer, step=3, rng=rng, blocking=False)
        returned = time.perf_counter()
        _train_step(model, optimizer, ids)
    wait_for_pending_saves()
    written = time.perf_counter() - returned

    # 1. the committed bytes are the blocking save's of the same state
    tensors = sorted(n for n in read_manifest(tmp_path / "blocking").files if n.endswith(".safetensors"))
    assert tensors and tensors == sorted(n for n in read_manifest(tmp_path / "async").files
                                         if n.endswith(".safetensors"))
    for name in tensors:
        assert (tmp_path / "async" / name).read_bytes() == (tmp_path / "blocking" / name).read_bytes(), name
    # 2. the staging path: pinned host buffers and a side stream on a GPU, plain memory and no stream on the CPU
    buffers = list(background_saver()._buffers.values())
    pinned = sum(buffer.is_pinned() for buffer in buffers)
    side_streams = [device for device in _staging._SIDE_STREAMS if device.type == "cuda"]
    if ON_GPU:
        assert pinned >= len(list(model.parameters())), f"{pinned} of {len(buffers)} staging buffers pinned"
        assert side_streams, "no staging copy ran on a CUDA side stream"
    else:
        assert pinned == 0 and not side_streams
    # 3. the training stream waits for the staging copy, not for the write
    waited = stalled.seconds - plain.seconds
    print(f"training stream waited {waited * 1e3:.1f} ms for an async save whose write took {written * 1e3:.1f} ms "
          f"(a step: {plain.seconds * 1e3:.1f} ms)")
    if ON_GPU:
        assert waited < 0.5 * written, (waited, written)


# ------------------------------------------------------------------ torchrun, one process, NCCL


def _torchrun(script: Path, args: list[str], env: dict[str, str] | None = None):
    return run_torchrun(script, args, env=child_env(env), timeout=300, nproc=1, forked=not ON_GPU)


def test_trainer_under_torchrun_on_one_nccl_process_resumes_bit_exact(tmp_path):
    options = ["--model", "gpt2", "--data", "lm", "--epochs", "1", "--device", DEVICE, "--deterministic"]
    reference = _torchrun(SCRIPT, ["--output-dir", str(tmp_path / "reference"), *options])
    assert reference.returncode == 0, reference.stdout[-5000:]
    killed = _torchrun(SCRIPT, ["--output-dir", str(tmp_path / "run"), *options], {"HFR_KILL_AFTER_SAVE": "3"})
    assert killed.returncode != 0 and not (tmp_path / "run" / "result.json").exists(), killed.stdout[-5000:]
    resumed = _torchrun(SCRIPT, ["--output-dir", str(tmp_path / "run"), *options])
    assert resumed.returncode == 0, resumed.stdout[-5000:]
    assert_identical(tmp_path / "reference", tmp_path / "run")
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert BACKEND in result["backend"], result["backend"]  # also named with its device, e.g. "cuda:nccl,cpu:gloo"
    # under torchrun the Trainer saves in the background: killed in on_save of step 3, checkpoint-3 may be in flight
    assert re.search(r"checkpoint-[23]$", result["resumed_from"]), result["resumed_from"]


def test_accelerator_under_torchrun_on_one_nccl_process_resumes_bit_exact(tmp_path):
    def args(output: Path) -> list[str]:
        return ["--output-dir", str(output), "--num-workers", "0", "--device", DEVICE, "--deterministic"]

    reference = _torchrun(EXAMPLE, args(tmp_path / "reference"))
    assert reference.returncode == 0, reference.stdout[-5000:]
    assert re.search(rf"torch.distributed backend \S*{BACKEND}\S*, 1 process\(es\)", reference.stdout)
    killed = _torchrun(EXAMPLE, args(tmp_path / "run"), {"HF_RESUMABLE_EXAMPLE_KILL_AFTER_STEP": "5"})
    assert killed.returncode != 0 and max(step for step, _ in read_losses(tmp_path / "run")) == 5
    resumed = _torchrun(EXAMPLE, args(tmp_path / "run"))
    assert resumed.returncode == 0 and "checkpoint-4" in resumed.stdout, resumed.stdout[-5000:]
    assert_same_run(tmp_path / "run", tmp_path / "reference")


@pytest.mark.parametrize("front_door", ["accelerate", "trainer"])
def test_fsdp2_on_one_nccl_process_resumes_bit_exact(tmp_path, tmp_path_factory, front_door):
    options = ["--device", DEVICE]
    if front_door == "accelerate":
        reference = _reference(tmp_path_factory, ACCELERATE_WORKER, tuple(options), nproc=1)
        _resume_accelerate_bit_exact(tmp_path / "run", reference, options, nproc=1)
    else:
        reference = _reference(tmp_path_factory, TRAINER_WORKER, tuple(options), nproc=1)
        _resume_trainer_bit_exact(tmp_path / "run", reference, options, nproc=1)
        assert BACKEND in json.loads((tmp_path / "run" / "result-rank0.json").read_text())["backend"]


# ------------------------------------------------------------------ streamed generation onto the device


@pytest.mark.parametrize("factory", [_llama, _gpt2])
def test_generation_streamed_onto_the_device_equals_the_full_model(tmp_path, factory):
    assert_streams_onto(DEVICE, tmp_path, factory)
