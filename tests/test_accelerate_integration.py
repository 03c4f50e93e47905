"""ResumableAccelerator: token-exact accumulation, and kill/restart of a real training process, bit for bit.

* Gradient accumulation: N micro-batches == one batch of all their samples (token mean), short last
  window included, in 1 process and in 2 gloo processes; accelerate's own recipe provably is not.
* Interrupt grid: ``examples/custom_loop.py`` runs in a separate process, is SIGKILLed (or SIGTERMed)
  after step k, and is restarted with the same command; per-step losses, final weights, optimizer,
  scheduler, RNG and data position equal an uninterrupted run bit for bit (sha256 of every file of the
  final checkpoint), with ``num_workers`` 0 and 2, and with 2 processes.
* Resuming with another world size is refused with ConfigDriftError unless the user opts in.
"""

from __future__ import annotations

import importlib.util
import json
import re
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from accelerate.state import AcceleratorState, GradientState

from hf_resumable import save_checkpoint
from hf_resumable.checkpoint import find_latest_checkpoint, read_manifest
from hf_resumable.errors import ConfigDriftError, InexactResumeError
from hf_resumable.integrations.accelerate import ResumableAccelerator, check_accelerate_internals
from hf_resumable.preemption import PREEMPTION_EXIT_CODE

from helpers.accelerate_runs import (
    EXAMPLE,
    _build_small,
    _fresh_accelerate_state,  # noqa: F401 - autouse: a fresh accelerate state
    _train_windows,
    assert_same_run,
    final_files,
    read_losses,
    reference_run,  # noqa: F401 - a module fixture
    run_example,
    two_process_reference,  # noqa: F401 - a module fixture
)
from helpers.distributed_launch import child_env, launch_ranks
from helpers.distributed_launch import run_torchrun as launch_torchrun

SCRIPTS = Path(__file__).parent / "scripts"


def load_module(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------ internals and unit behaviour


def test_accelerate_internals_we_rely_on_exist():
    accelerator = ResumableAccelerator(cpu=True, handle_preemption=False)
    assert check_accelerate_internals(accelerator) == []


def test_save_inside_accumulation_window_is_refused(tmp_path):
    accelerator = ResumableAccelerator(gradient_accumulation_steps=2, cpu=True, checkpoint_dir=tmp_path,
                                       handle_preemption=False)
    model = accelerator.prepare(torch.nn.Linear(2, 1))
    with accelerator.accumulate(model):
        accelerator.backward(model(torch.ones(1, 2)).sum())
        with pytest.raises(InexactResumeError, match="inside an accumulation window"):
            accelerator.save_state()
    assert not any(tmp_path.iterdir())


def test_load_state_without_checkpoint_starts_fresh(tmp_path):
    accelerator = ResumableAccelerator(cpu=True, checkpoint_dir=tmp_path, handle_preemption=False)
    accelerator.prepare(torch.nn.Linear(2, 1))
    assert accelerator.load_state() is None
    assert accelerator.global_step == 0


def test_missing_rng_state_fails_loudly(tmp_path):
    accelerator = ResumableAccelerator(cpu=True, checkpoint_dir=tmp_path, handle_preemption=False)
    model = accelerator.prepare(torch.nn.Linear(2, 1))
    save_checkpoint(tmp_path / "checkpoint-3", model=model, step=3, training_state={"global_step": 3}, rng=False)
    with pytest.raises(InexactResumeError, match="no RNG state for rank 0"):
        accelerator.load_state()
    relaxed = ResumableAccelerator(cpu=True, checkpoint_dir=tmp_path, handle_preemption=False,
                                   allow_inexact_resume=True)
    relaxed.prepare(torch.nn.Linear(2, 1))
    assert relaxed.load_state().step == 3 and relaxed.global_step == 3


def test_mean_loss_in_short_last_window_is_divided_by_its_real_length():
    accelerator = ResumableAccelerator(gradient_accumulation_steps=3, cpu=True, handle_preemption=False)
    data = [float(i) for i in range(10)]  # batches of 2: 5 per epoch -> windows of 3 and 2
    loader = accelerator.prepare_resumable_dataloader(data, collate_fn=torch.tensor, batch_size=2, seed=0,
                                                      shuffle=False)
    model = accelerator.prepare(torch.nn.Linear(1, 1, bias=False))
    grads = []
    for window in accelerator.accumulation_windows(loader):
        for batch in window:
            with accelerator.accumulate(model):
                accelerator.backward((model(batch[:, None]) ** 2).mean())
        grads.append(model.weight.grad.clone())
        model.zero_grad()
    with pytest.raises(ValueError, match="already restored"):
        accelerator.skip_first_batches(loader, 1)
    reference = torch.nn.Linear(1, 1, bias=False)
    reference.load_state_dict(accelerator.unwrap_model(model).state_dict())
    for window, got in zip(([0, 1, 2], [3, 4]), grads):
        reference.zero_grad()
        for step in window:
            batch = torch.tensor(data[2 * step:2 * step + 2])[:, None]
            ((reference(batch) ** 2).mean() / len(window)).backward()
        assert torch.allclose(got, reference.weight.grad, rtol=1e-6, atol=0), (window, got, reference.weight.grad)
    assert accelerator.global_step == 2 and loader.epoch == 1


def test_elastic_short_last_step_weighs_each_micro_batch_by_its_samples():
    """elastic=True, 14 samples, micro-batches of 4, global batch 8: the epoch's last step holds 6 samples in
    micro-batches of 4 and 2; with a mean loss each weighs its share (4/6, 2/6), so the step's gradient is the mean
    over its 6 samples (not a mean of the two means)."""
    accelerator = ResumableAccelerator(gradient_accumulation_steps=2, cpu=True, handle_preemption=False, elastic=True)
    data = [float(i) for i in range(14)]
    loader = accelerator.prepare_resumable_dataloader(data, collate_fn=torch.tensor, batch_size=4, seed=0,
                                                      shuffle=False)
    model = accelerator.prepare(torch.nn.Linear(1, 1, bias=False))
    windows, grads = [], []
    for window in accelerator.accumulation_windows(loader):  # no optimizer: the weight stays, gradients per window
        windows.append([batch.tolist() for batch in window])
        for batch in window:
            with accelerator.accumulate(model):
                accelerator.backward((model(batch[:, None]) ** 2).mean())
        grads.append(model.weight.grad.clone())
        model.zero_grad()
    assert windows == [[data[0:4], data[4:8]], [data[8:12], data[12:14]]]  # every sample, the last 6 too
    reference = torch.nn.Linear(1, 1, bias=False)
    reference.load_state_dict(accelerator.unwrap_model(model).state_dict())
    (reference(torch.tensor(data[8:14])[:, None]) ** 2).mean().backward()
    assert torch.allclose(grads[1], reference.weight.grad, rtol=1e-6, atol=0)


def test_save_state_load_state_round_trip_in_process(tmp_path):
    accelerator, model, optimizer, loader, counter = _build_small(tmp_path)
    windows = accelerator.accumulation_windows(loader)
    _train_windows(accelerator, model, optimizer, windows, 2)
    counter.count, counter.history = 5, torch.tensor([1.0, 2.0, 3.0])
    assert accelerator.save_state() == tmp_path / "checkpoint-2"
    rest = _train_windows(accelerator, model, optimizer, windows, 2)  # 4 more batches, dropout draws RNG
    weights = {k: v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    resumed, model2, optimizer2, loader2, counter2 = _build_small(tmp_path)
    assert resumed.load_state().step == 2
    assert (resumed.global_step, loader2.epoch, loader2.consumed) == (2, 0, 4)
    assert counter2.count == 5 and torch.equal(counter2.history, torch.tensor([1.0, 2.0, 3.0]))
    assert _train_windows(resumed, model2, optimizer2, resumed.accumulation_windows(loader2), 2) == rest
    for key, value in resumed.unwrap_model(model2).state_dict().items():
        assert torch.equal(value, weights[key]), key
    assert resumed.global_step == 4


def test_load_state_skips_a_corrupt_newest_checkpoint(tmp_path, caplog):
    accelerator, model, optimizer, loader, _ = _build_small(tmp_path, keep_last=None)
    windows = accelerator.accumulation_windows(loader)
    for _ in range(2):
        _train_windows(accelerator, model, optimizer, windows, 1)
        accelerator.save_state()
    shard = next((tmp_path / "checkpoint-2").glob("model*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:-8])  # truncated, as by a disk fault after the commit
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    resumed, *_ = _build_small(tmp_path)
    with caplog.at_level("WARNING"):
        loaded = resumed.load_state()
    assert loaded.path == tmp_path / "checkpoint-1" and resumed.global_step == 1
    assert "Skipping" in caplog.text and "checkpoint-2" in caplog.text


def test_changed_accumulation_is_refused_before_anything_is_loaded(tmp_path):
    accelerator, model, optimizer, loader, _ = _build_small(tmp_path)
    _train_windows(accelerator, model, optimizer, accelerator.accumulation_windows(loader), 1)
    accelerator.save_state()
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    resumed, model2, *_ = _build_small(tmp_path, ga=3)
    before = {k: v.clone() for k, v in resumed.unwrap_model(model2).state_dict().items()}
    with pytest.raises(ConfigDriftError, match=r"gradient_accumulation_steps: 2 -> 3"):
        resumed.load_state()
    assert resumed.global_step == 0
    assert all(torch.equal(v, before[k]) for k, v in resumed.unwrap_model(model2).state_dict().items())


# ------------------------------------------------------------------ token-exact gradient accumulation


def check_ga_records(records: list[dict], world_size: int) -> None:
    assert [r["size"] for r in records] == [3, 2], records  # a full window, then the short last one
    for record in records:
        assert record["world_size"] == world_size
        assert record["num_items"] == record["tokens"], record  # counted over micro-batches AND ranks
        assert record["syncs"] == [False] * (record["size"] - 1) + [True], record
        assert record["exact_ok"], f"accumulated gradient != full-batch token mean: {record}"
        assert not record["plain_ok"], f"mean-of-means matched too; the data cannot tell them apart: {record}"
    assert records[-1]["global_step"] == len(records)


@pytest.mark.slow
def test_accumulation_equals_full_batch_single_process():
    worker = load_module("accelerate_ga_worker", SCRIPTS / "accelerate_ga_worker.py")
    check_ga_records(worker.run(), world_size=1)


@pytest.mark.distributed
def test_accumulation_equals_full_batch_two_processes(tmp_path):
    out = tmp_path / "ga.json"
    results = launch_ranks([str(SCRIPTS / "accelerate_ga_worker.py"), str(out)], world_size=2, timeout=180)
    for result in results:
        assert result.returncode == 0, result.describe()
    check_ga_records(json.loads(out.read_text()), world_size=2)


# ------------------------------------------------------------------ interrupt grid on the example


@pytest.mark.slow
@pytest.mark.parametrize(("signum", "step", "num_workers", "extra"), [
    # between checkpoints: resume from checkpoint-2, replay step 3 (test_accelerate_example covers this case)
    pytest.param(signal.SIGKILL, 3, 0, (), marks=pytest.mark.extended),
    # On a checkpoint at the end of epoch 0, with 2 worker processes: compared with the reference run
    # (num_workers=0), this also shows that worker processes do not change the run.
    (signal.SIGKILL, 4, 2, ()),
    # Preemption notice after step 5: finish, save checkpoint-5, exit 143. Periodic saves are
    # asynchronous here (the final comparison also checks what the background writer committed).
    (signal.SIGTERM, 5, 0, ("--save-async",)),
])
def test_kill_and_restart_is_bit_exact(tmp_path, reference_run, signum, step, num_workers, extra):
    name = "KILL" if signum == signal.SIGKILL else "TERM"
    interrupted = run_example(tmp_path, num_workers=num_workers, extra=extra,
                              env={f"HF_RESUMABLE_EXAMPLE_{name}_AFTER_STEP": str(step)})
    expected_rc = -signal.SIGKILL if signum == signal.SIGKILL else PREEMPTION_EXIT_CODE
    assert interrupted.returncode == expected_rc, interrupted.stderr[-3000:]
    latest = find_latest_checkpoint(tmp_path / "checkpoints")
    assert latest is not None and latest.name == f"checkpoint-{step if step % 2 == 0 or name == 'TERM' else step - 1}"
    assert max(s for s, _ in read_losses(tmp_path)) == step  # it really stopped there

    resumed = run_example(tmp_path, num_workers=num_workers, extra=extra)  # the same command
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"Resumed from {latest}" in resumed.stderr
    assert_same_run(tmp_path, reference_run)


# ------------------------------------------------------------------ two processes


def run_torchrun(output: Path, *, env: dict[str, str] | None = None,
                 timeout: float = 150) -> subprocess.CompletedProcess:
    """The example under the real ``torchrun`` (2 CPU processes); the whole process group is SIGKILLed on timeout."""
    return launch_torchrun(EXAMPLE, ["--output-dir", str(output), "--num-workers", "0"], env=child_env(env),
                        timeout=timeout)


@pytest.mark.distributed
@pytest.mark.parametrize(("signal_name", "exitcode", "checkpoint"), [
    # a crash: resume from the last periodic checkpoint (test_async_integrations SIGKILLs one rank under torchrun)
    pytest.param("KILL", "-9", "checkpoint-2", marks=pytest.mark.extended),
    # Preemption notice to ONE rank: the flag is combined across ranks, both save step 3 and exit 143.
    ("TERM", str(PREEMPTION_EXIT_CODE), "checkpoint-3"),
])
def test_two_process_interrupt_of_one_rank_and_restart_is_bit_exact(tmp_path, two_process_reference, signal_name,
                                                                    exitcode, checkpoint):
    # Under torchrun: rank 1 gets the signal after step 3; the agent tears the job down.
    interrupted = run_torchrun(tmp_path, env={f"HF_RESUMABLE_EXAMPLE_{signal_name}_AFTER_STEP": "3",
                                              "HF_RESUMABLE_EXAMPLE_SIGNAL_RANK": "1"})
    # torchrun lists every failed rank ("exitcode  : -9"); which one it names first ("exitcode: -9") depends on
    # whether rank 0 saw rank 1's death in a collective before the agent saw it exit
    died = re.search(rf"exitcode\s*:\s*{re.escape(exitcode)}\b", interrupted.stdout)
    assert interrupted.returncode != 0 and died, interrupted.stdout[-5000:]
    latest = find_latest_checkpoint(tmp_path / "checkpoints")
    assert latest is not None and latest.name == checkpoint
    assert read_manifest(latest).world_size == 2

    resumed = run_torchrun(tmp_path)  # the same command
    assert resumed.returncode == 0, resumed.stdout[-5000:]
    assert f"Resumed from {latest}" in resumed.stdout
    # 2 ranks: 6 batches per rank and epoch -> 2 windows per epoch, 4 steps in all. The reference ran
    # without torchrun (plain per-rank processes): the launcher does not change a bit either.
    assert_same_run(tmp_path, two_process_reference, final_step=4)
    files = final_files(tmp_path, 4)
    assert {"rng/rank-00000.safetensors", "rng/rank-00001.safetensors", "data/rank-00001.json"} <= set(files)


@pytest.mark.distributed
def test_resuming_with_another_world_size_is_refused_unless_allowed(two_process_reference, caplog):
    example = load_module("custom_loop", EXAMPLE)
    checkpoints = two_process_reference / "checkpoints"

    def build(**options):
        accelerator = ResumableAccelerator(gradient_accumulation_steps=3, cpu=True, checkpoint_dir=checkpoints,
                                           handle_preemption=False, **options)
        model = example.build_model(0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        accelerator.prepare_resumable_dataloader(example.make_dataset(44, 0), collate_fn=example.collate,
                                                 batch_size=4, seed=0)
        accelerator.prepare(model, optimizer)
        return accelerator, model

    accelerator, model = build()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ConfigDriftError, match=r"world_size: 2 -> 1"):
        accelerator.load_state()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()), "refused, but weights changed"

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    relaxed, model = build(allow_inexact_resume=True)
    with caplog.at_level("WARNING"):
        loaded = relaxed.load_state()
    assert loaded is not None and relaxed.global_step == loaded.step
    assert "NOT continue bit for bit" in caplog.text
