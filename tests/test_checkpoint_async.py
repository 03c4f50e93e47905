"""Async saves: training continues while the save is in flight; the files equal a blocking save's."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from hf_resumable.checkpoint import (
    api,
    find_latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    read_manifest,
    save_checkpoint,
    wait_for_pending_saves,
)
from hf_resumable.checkpoint.commit import _writer
from hf_resumable.errors import AsyncSaveError

from helpers import zygote
from helpers.tiny_models import tiny_gpt2, train_steps


def _files(directory):
    """Every file's bytes but the manifest's and a blocking save's durability record (a background save fsyncs
    before its commit and has none)."""
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in directory.rglob("*")
            if p.is_file() and p.name not in ("manifest.json", ".durability")}


@pytest.mark.slow
def test_training_runs_during_async_save_and_bytes_equal_blocking(tmp_path, monkeypatch):
    model = tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_steps(model, optimizer, steps=2)
    rng = torch.get_rng_state()
    save_checkpoint(tmp_path / "blocking" / "checkpoint-2", model=model, optimizer=optimizer, step=2,
                    max_shard_size="16KB", rng=False)
    snapshot = {k: v.clone() for k, v in model.state_dict().items()}

    gate = threading.Event()
    started = threading.Event()
    real = _writer.write_safetensors

    def gated(path, tensors, **kwargs):
        started.set()
        assert gate.wait(30), "test gate never opened"
        return real(path, tensors, **kwargs)

    monkeypatch.setattr(_writer, "write_safetensors", gated)
    info = save_checkpoint(tmp_path / "async" / "checkpoint-2", model=model, optimizer=optimizer, step=2,
                           max_shard_size="16KB", rng=False, blocking=False)
    assert info.manifest is None
    assert started.wait(30)
    assert api._ASYNC.in_flight
    train_steps(model, optimizer, steps=3, seed=11)  # mutates parameters and optimizer state in place
    assert not torch.equal(model.transformer.wte.weight, snapshot["transformer.wte.weight"])
    assert not (tmp_path / "async" / "checkpoint-2").exists()
    gate.set()
    wait_for_pending_saves()
    assert _files(tmp_path / "blocking" / "checkpoint-2") == _files(tmp_path / "async" / "checkpoint-2")
    assert read_manifest(tmp_path / "async" / "checkpoint-2").files == \
        read_manifest(tmp_path / "blocking" / "checkpoint-2").files
    fresh = tiny_gpt2(seed=9)
    load_checkpoint(tmp_path / "async" / "checkpoint-2", model=fresh, restore_rng=False)
    for key, value in snapshot.items():
        assert torch.equal(fresh.state_dict()[key], value)
    torch.set_rng_state(rng)


def test_staging_buffers_are_reused_across_saves(tmp_path):
    model = tiny_gpt2()
    save_checkpoint(tmp_path / "checkpoint-1", model=model, step=1, blocking=False, rng=False)
    wait_for_pending_saves()
    first = {key: buf.data_ptr() for key, buf in api._ASYNC._buffers.items() if key[0].startswith("model")}
    save_checkpoint(tmp_path / "checkpoint-2", model=model, step=2, blocking=False, rng=False)
    wait_for_pending_saves()
    second = {key: buf.data_ptr() for key, buf in api._ASYNC._buffers.items() if key[0].startswith("model")}
    assert first and first == second


def test_background_failure_is_raised_at_next_call_and_loses_nothing(tmp_path, monkeypatch):
    model = tiny_gpt2()
    save_checkpoint(tmp_path / "checkpoint-1", model=model, step=1, rng=False)

    failed = threading.Event()

    def broken(path, tensors, **kwargs):
        failed.set()
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_writer, "write_safetensors", broken)
    save_checkpoint(tmp_path / "checkpoint-2", model=model, step=2, blocking=False, rng=False)
    assert failed.wait(30)
    monkeypatch.undo()
    with pytest.raises(AsyncSaveError, match="No space left"):
        save_checkpoint(tmp_path / "checkpoint-3", model=model, step=3, rng=False)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1]
    assert find_latest_checkpoint(tmp_path) == tmp_path / "checkpoint-1"
    save_checkpoint(tmp_path / "checkpoint-3", model=model, step=3, rng=False)  # the error was raised once
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1, 3]


def test_load_waits_for_the_in_flight_save(tmp_path):
    model = tiny_gpt2()
    save_checkpoint(tmp_path / "checkpoint-1", model=model, step=1, blocking=False, rng=False)
    fresh = tiny_gpt2(seed=4)
    load_checkpoint(tmp_path / "checkpoint-1", model=fresh, restore_rng=False)
    assert torch.equal(fresh.transformer.wte.weight, model.transformer.wte.weight)


@pytest.mark.slow
def test_interpreter_exit_waits_for_the_save(tmp_path):
    import sys

    code = (
        "import torch\n"
        "from hf_resumable.checkpoint import save_checkpoint\n"
        f"save_checkpoint(r'{tmp_path}/checkpoint-1', model={{'w': torch.randn(512, 512)}}, step=1, blocking=False)\n"
    )
    zygote.run([sys.executable, "-c", code], check=True)
    assert find_latest_checkpoint(tmp_path, full=True) == tmp_path / "checkpoint-1"


def test_a_forked_child_does_not_wait_for_its_parents_save(tmp_path, monkeypatch):
    """A child forked while a save is in flight (its writer thread stays in the parent) exits without waiting."""
    gate = threading.Event()
    real = _writer.write_safetensors

    def gated(path, tensors, **kwargs):
        assert gate.wait(30), "test gate never opened"
        return real(path, tensors, **kwargs)

    monkeypatch.setattr(_writer, "write_safetensors", gated)
    model = torch.nn.Linear(4, 4)
    save_checkpoint(tmp_path / "checkpoint-1", model=model, step=1, rng=False, blocking=False)
    assert api._ASYNC.in_flight
    pid = os.fork()
    if pid == 0:  # the child: its interpreter exit (atexit waits for pending saves) must not hang
        code = 0 if not api._ASYNC.in_flight else 3
        wait_for_pending_saves()
        os._exit(code)
    deadline = time.monotonic() + 20
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:  # still waiting: it hung on a save it does not own
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    gate.set()
    wait_for_pending_saves()
    assert done[0] == pid and os.waitstatus_to_exitcode(done[1]) == 0
    assert (tmp_path / "checkpoint-1" / "manifest.json").exists()


def test_submit_returns_a_future_of_the_committed_manifest(tmp_path, monkeypatch):
    """The background save's future: not done while the files are written, then the manifest that was committed;
    a failed save's future holds its error, and the next wait raises it as AsyncSaveError."""
    gate = threading.Event()
    real = _writer.write_safetensors
    monkeypatch.setattr(_writer, "write_safetensors", lambda *a, **k: (gate.wait(30), real(*a, **k))[1])
    model = torch.nn.Linear(4, 2)
    save_checkpoint(tmp_path / "checkpoint-1", model=model, step=1, rng=False, blocking=False)
    future = api.background_saver().future
    assert not future.done()
    gate.set()
    assert future.result(timeout=60) == read_manifest(tmp_path / "checkpoint-1")
    wait_for_pending_saves()

    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_writer, "write_safetensors", fail)
    save_checkpoint(tmp_path / "checkpoint-2", model=model, step=2, rng=False, blocking=False)
    failed = api.background_saver().future
    assert failed is not future and isinstance(failed.exception(timeout=60), OSError)
    with pytest.raises(AsyncSaveError, match="checkpoint-2 failed"):
        wait_for_pending_saves()
    assert not (tmp_path / "checkpoint-2").exists()


def _bn_model() -> torch.nn.Module:
    """Parameters the optimizer steps, and buffers (BatchNorm's running statistics) that every forward changes."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 2))


def _train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    inputs = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))
    model(inputs).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def test_the_next_step_waits_for_the_background_copy_and_the_checkpoint_holds_the_saved_step(tmp_path):
    """The save returns before the parameters and moments are copied; the forward and backward of the next step run
    meanwhile (changing the buffers), and its optimizer step waits at the gate until the copy is over. The checkpoint
    is the state at the save, byte for byte as a blocking save writes it."""
    from hf_resumable.checkpoint.background._step_gate import step_gate

    from helpers.staging_probe import copy_after_next_step

    model = _bn_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train_step(model, optimizer, seed=1)
    save_checkpoint(tmp_path / "blocking" / "checkpoint-1", model=model, optimizer=optimizer, step=1, rng=False)
    with copy_after_next_step(optimizer) as stepping:
        save_checkpoint(tmp_path / "async" / "checkpoint-1", model=model, optimizer=optimizer, step=1, rng=False,
                        blocking=False)
        gate = step_gate(optimizer)
        blocked = gate.blocked
        assert not gate.is_open and not stepping.is_set()  # nothing copied yet: the step is held
        _train_step(model, optimizer, seed=2)  # its forward changes the buffers; its step waits for the copy
    assert stepping.is_set() and gate.blocked == blocked + 1 and gate.is_open
    wait_for_pending_saves()
    assert _files(tmp_path / "blocking" / "checkpoint-1") == _files(tmp_path / "async" / "checkpoint-1")
    fresh = _bn_model()
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    load_checkpoint(tmp_path / "async" / "checkpoint-1", model=fresh, optimizer=fresh_optimizer, restore_rng=False)
    _train_step(fresh, fresh_optimizer, seed=2)  # the resumed run takes the same step as the saving run
    for key, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key


def test_async_saves_every_step_resume_bit_exact(tmp_path):
    """A plain loop saving in the background after every step (each save's copy overlapping the next step):
    resumed from any of them, the run ends with the uninterrupted run's weights and moments."""
    model = _bn_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(1, 6):
        _train_step(model, optimizer, seed=step)
        save_checkpoint(tmp_path / f"checkpoint-{step}", model=model, optimizer=optimizer, step=step, rng=False,
                        blocking=False)
    wait_for_pending_saves()
    for resume_at in (1, 3):
        fresh = _bn_model()
        fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
        load_checkpoint(tmp_path / f"checkpoint-{resume_at}", model=fresh, optimizer=fresh_optimizer,
                        restore_rng=False)
        for step in range(resume_at + 1, 6):
            _train_step(fresh, fresh_optimizer, seed=step)
        for key, value in model.state_dict().items():
            assert torch.equal(fresh.state_dict()[key], value), (resume_at, key)
        for mine, theirs in zip(model.parameters(), fresh.parameters()):
            mine, theirs = optimizer.state[mine], fresh_optimizer.state[theirs]
            assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine), resume_at


def test_a_save_without_an_optimizer_to_hold_copies_everything_before_it_returns(tmp_path):
    """No torch optimizer (a model-only save): nothing can hold the writes, so the call copies every tensor; a
    parameter written in place right after it does not reach the checkpoint."""
    gate = threading.Event()
    model = _bn_model()
    snapshot = {k: v.clone() for k, v in model.state_dict().items()}
    real = _writer.write_safetensors
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_writer, "write_safetensors", lambda *a, **k: (gate.wait(30), real(*a, **k))[1])
        save_checkpoint(tmp_path / "checkpoint-1", model=model, step=1, rng=False, blocking=False)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(1.0)
        gate.set()
        wait_for_pending_saves()
    fresh = _bn_model()
    with torch.no_grad():
        for parameter in fresh.parameters():
            parameter.zero_()
    load_checkpoint(tmp_path / "checkpoint-1", model=fresh, restore_rng=False)
    for key, value in snapshot.items():
        assert torch.equal(fresh.state_dict()[key], value), key
