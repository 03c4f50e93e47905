"""The tuning switches (``hf_resumable/_tuning.py``): each ``HF_RESUMABLE_*`` switch is validated and turns its
mechanism off; the prefault helper faults in new memory without changing it, and a load gives the same state with it
and without; and the helper that runs a background save's threads below the training thread
(``lower_thread_priority`` and ``restore_thread_priorities``, Linux: nice is per thread): the threads a lowered thread
starts inherit its priority and get the normal one back with it, and a priority that cannot be set never fails a
save: it is logged at debug."""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import resource
import sys
import threading
import time

import pytest
import torch

from hf_resumable import _tuning
from hf_resumable.checkpoint import load_checkpoint, read_manifest, save_checkpoint, wait_for_pending_saves

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's")

INCREMENT = 5


@pytest.mark.parametrize("name", [_tuning.WRITER_PRIORITY_ENV, _tuning.BACKGROUND_DELETES_ENV,
                                  _tuning.SPLIT_REPLICAS_ENV, _tuning.READ_STREAMS_ENV, _tuning.PREFAULT_ENV])
def test_a_switch_refuses_a_value_it_does_not_take_naming_the_variable(monkeypatch, name):
    monkeypatch.setenv(name, "sometimes")
    with pytest.raises(ValueError, match=name):
        _tuning.tuning_options()


def test_the_switches_default_to_on_and_read_the_environment_at_the_call(monkeypatch):
    for name in (_tuning.WRITER_PRIORITY_ENV, _tuning.BACKGROUND_DELETES_ENV, _tuning.SPLIT_REPLICAS_ENV,
                 _tuning.READ_STREAMS_ENV, _tuning.PREFAULT_ENV):
        monkeypatch.delenv(name, raising=False)
    assert _tuning.tuning_options() == _tuning.TuningOptions()
    monkeypatch.setenv(_tuning.BACKGROUND_DELETES_ENV, "0")
    monkeypatch.setenv(_tuning.READ_STREAMS_ENV, "3")
    monkeypatch.setenv(_tuning.PREFAULT_ENV, "off")
    assert _tuning.tuning_options() == _tuning.TuningOptions(background_deletes=False, read_streams=3, prefault=False)
    with pytest.raises(ValueError, match=_tuning.READ_STREAMS_ENV):
        _tuning.TuningOptions(read_streams=0)



def _resident_pages(address: int, nbytes: int) -> int:
    """How many pages of the anonymous mapping at ``address`` are in memory (``mincore``)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    vector = (ctypes.c_ubyte * (nbytes // mmap.PAGESIZE))()
    assert libc.mincore(address, nbytes, vector) == 0, ctypes.get_errno()
    return sum(byte & 1 for byte in vector)


@pytest.mark.parametrize("switch", ["1", "0"])
def test_the_prefault_helper_faults_in_new_memory_without_changing_it_and_the_switch_turns_it_off(monkeypatch,
                                                                                                   switch):
    monkeypatch.setenv(_tuning.PREFAULT_ENV, switch)
    nbytes = _tuning.PREFAULT_MIN_BYTES + 4 * mmap.PAGESIZE
    memory = mmap.mmap(-1, nbytes)  # anonymous, page-aligned, untouched
    address = _tuning.view_address(memoryview(memory))
    memory[5 * mmap.PAGESIZE : 5 * mmap.PAGESIZE + 4] = b"kept"  # a page a reader filled before the helper came by
    assert _resident_pages(address, nbytes) == 1
    with _tuning.Prefault.start([(address, nbytes)]):
        deadline = time.monotonic() + 60
        while switch == "1" and _resident_pages(address, nbytes) < nbytes // mmap.PAGESIZE:
            assert time.monotonic() < deadline, "the helper did not fault the memory in"
            time.sleep(0.01)
    assert _resident_pages(address, nbytes) == (nbytes // mmap.PAGESIZE if switch == "1" else 1)
    assert memory[5 * mmap.PAGESIZE : 5 * mmap.PAGESIZE + 4] == b"kept"
    assert bytes(memory).count(0) == nbytes - 4
    assert not _tuning.Prefault._active  # the stopped helper left the registry readers consult



def test_what_a_reader_claimed_the_prefault_helper_leaves_to_it():
    steps = 3
    nbytes = steps * _tuning.PREFAULT_STEP_BYTES
    memory = mmap.mmap(-1, nbytes)
    address = _tuning.view_address(memoryview(memory))
    prefault = _tuning.Prefault([(address, nbytes)])  # not started: its helper's loop runs below, in this thread
    claimed = memoryview(memory)[_tuning.PREFAULT_STEP_BYTES + 10 : _tuning.PREFAULT_STEP_BYTES + 20]
    prefault._claim(_tuning.view_address(claimed), _tuning.view_address(claimed) + len(claimed))
    prefault._run()
    per_step = _tuning.PREFAULT_STEP_BYTES // mmap.PAGESIZE
    assert [_resident_pages(address + i * _tuning.PREFAULT_STEP_BYTES, _tuning.PREFAULT_STEP_BYTES)
            for i in range(steps)] == [per_step, 0, per_step]

def test_a_load_gives_the_same_state_with_the_prefault_helper_and_without(tmp_path, monkeypatch, caplog):
    torch.manual_seed(0)
    model = torch.nn.Linear(4096, 2048)  # its AdamW state (two moments) is just over the helper's threshold
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4096)).sum().backward()
    optimizer.step()
    save_checkpoint(tmp_path / "ckpt", model=model, optimizer=optimizer, step=1)
    states = {}
    for switch in ("1", "0"):
        monkeypatch.setenv(_tuning.PREFAULT_ENV, switch)
        fresh = torch.nn.Linear(4096, 2048)
        fresh_optimizer = torch.optim.AdamW(fresh.parameters())  # no state yet: the load allocates it
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="hf_resumable._tuning"):
            load_checkpoint(tmp_path / "ckpt", model=fresh, optimizer=fresh_optimizer)
        assert any("helper thread" in r.getMessage() for r in caplog.records) == (switch == "1")
        states[switch] = fresh_optimizer.state_dict()["state"]
    for index, fields in optimizer.state_dict()["state"].items():
        for key, value in fields.items():
            assert torch.equal(states["1"][index][key], value) and torch.equal(states["0"][index][key], value)

def test_with_the_writer_priority_switch_off_a_background_write_runs_at_the_training_priority(tmp_path, monkeypatch):
    from hf_resumable.checkpoint.commit import _writer

    base = _nice()
    monkeypatch.setenv(_tuning.WRITER_PRIORITY_ENV, "0")
    seen = []
    real = _writer.write_safetensors

    def observed(path, tensors, **kwargs):
        seen.append((_nice(), os.sched_getscheduler(0)))
        return real(path, tensors, **kwargs)

    monkeypatch.setattr(_writer, "write_safetensors", observed)
    save_checkpoint(tmp_path / "checkpoint-1", model=torch.nn.Linear(4, 2), step=1, rng=False, blocking=False)
    wait_for_pending_saves()
    assert seen and set(seen) == {(base, os.SCHED_OTHER)}
    assert read_manifest(tmp_path / "checkpoint-1").step == 1


def test_a_background_save_refuses_a_bad_switch_before_it_starts(tmp_path, monkeypatch):
    monkeypatch.setenv(_tuning.WRITER_PRIORITY_ENV, "sometimes")
    with pytest.raises(ValueError, match=_tuning.WRITER_PRIORITY_ENV):
        save_checkpoint(tmp_path / "checkpoint-1", model=torch.nn.Linear(4, 2), step=1, rng=False, blocking=False)
    wait_for_pending_saves()
    assert not (tmp_path / "checkpoint-1").exists()
    monkeypatch.delenv(_tuning.WRITER_PRIORITY_ENV)
    save_checkpoint(tmp_path / "checkpoint-1", model=torch.nn.Linear(4, 2), step=1, rng=False, blocking=False)
    wait_for_pending_saves()  # the saver's thread serves the next save
    assert read_manifest(tmp_path / "checkpoint-1").step == 1


def test_with_background_deletes_off_retention_deletes_before_it_returns(tmp_path, monkeypatch):
    from hf_resumable.checkpoint import apply_retention, list_checkpoints

    monkeypatch.setenv(_tuning.BACKGROUND_DELETES_ENV, "0")
    for step in (1, 2):
        save_checkpoint(tmp_path / f"checkpoint-{step}", model=torch.nn.Linear(4, 2), step=step, rng=False)
    removed = apply_retention(tmp_path, keep_last=1, background=True)
    assert removed == [tmp_path / "checkpoint-1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2"]  # no trash left for a thread to delete
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2]


def _nice(tid: int | None = None) -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id() if tid is None else tid)


def _base_and_lowered() -> tuple[int, int]:
    base = os.getpriority(os.PRIO_PROCESS, os.getpid())
    lowered = min(19, base + INCREMENT)
    if lowered == base:
        pytest.skip(f"this process already runs at nice {base}")
    return base, lowered


def _can_raise_again(base: int) -> bool:
    return os.geteuid() == 0 or resource.getrlimit(resource.RLIMIT_NICE)[0] >= 20 - base


def test_threads_a_lowered_thread_starts_inherit_its_priority_and_get_the_normal_one_back_with_it():
    """The writer lowers itself; its I/O and hash threads, started after, run at its priority; restoring gives every
    one of them the main thread's, and leaves the threads that were never lowered alone."""
    base, lowered = _base_and_lowered()
    if not _can_raise_again(base):
        pytest.skip("raising a priority again needs root or RLIMIT_NICE")
    started, restored, seen = threading.Event(), threading.Event(), {}

    def child() -> None:
        seen["child"] = threading.get_native_id()
        seen["child_nice"] = _nice()
        started.set()
        assert restored.wait(30)

    def writer() -> None:
        change = _tuning.lower_thread_priority(INCREMENT)
        seen["change"], seen["writer_nice"] = change, _nice()
        helper = threading.Thread(target=child)
        helper.start()
        assert started.wait(30)
        _tuning.restore_thread_priorities(change)
        seen["after"], seen["child_after"] = _nice(), _nice(seen["child"])
        restored.set()
        helper.join()

    thread = threading.Thread(target=writer)
    thread.start()
    thread.join()
    assert seen["change"] == (base, lowered, None)  # nice values had room: the policy is left alone
    assert (seen["writer_nice"], seen["child_nice"]) == (lowered, lowered)
    assert (seen["after"], seen["child_after"]) == (base, base)
    assert _nice() == base  # the calling (training) thread was never touched


def test_a_priority_that_cannot_be_lowered_is_logged_and_the_background_save_commits(tmp_path, monkeypatch, caplog):
    _base_and_lowered()

    def refuse(*args):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "setpriority", refuse)
    caplog.set_level(logging.DEBUG, logger=_tuning.__name__)
    save_checkpoint(tmp_path / "checkpoint-1", model=torch.nn.Linear(4, 2), step=1, rng=False, blocking=False)
    wait_for_pending_saves()
    assert read_manifest(tmp_path / "checkpoint-1").step == 1
    assert "Could not lower the priority of thread" in caplog.text


def test_a_priority_that_cannot_be_restored_is_logged_and_the_thread_keeps_the_lower_one(monkeypatch, caplog):
    base, lowered = _base_and_lowered()
    caplog.set_level(logging.DEBUG, logger=_tuning.__name__)
    lowered_once, done, seen = threading.Event(), threading.Event(), {}

    def background() -> None:
        seen["change"] = _tuning.lower_thread_priority(INCREMENT)
        seen["tid"] = threading.get_native_id()
        lowered_once.set()
        assert done.wait(30)

    thread = threading.Thread(target=background)
    thread.start()
    assert lowered_once.wait(30)
    real = os.setpriority

    def refuse_raising(which, who, value):  # what an unprivileged process meets without RLIMIT_NICE
        if value < os.getpriority(which, who):
            raise PermissionError(13, "Permission denied")
        real(which, who, value)

    monkeypatch.setattr(os, "setpriority", refuse_raising)
    _tuning.restore_thread_priorities(seen["change"])
    assert _nice(seen["tid"]) == lowered
    assert f"Could not restore the priority of thread {seen['tid']}" in caplog.text
    assert _nice() == base
    done.set()
    thread.join()


def test_elsewhere_or_with_no_increment_nothing_changes(monkeypatch):
    base, _ = _base_and_lowered()
    assert _tuning.lower_thread_priority(0) is None
    monkeypatch.setattr(_tuning, "_PER_THREAD_NICE", False)
    seen = []
    thread = threading.Thread(target=lambda: seen.append((_tuning.lower_thread_priority(INCREMENT), _nice())))
    thread.start()
    thread.join()
    assert seen == [(None, base)]


def _policies() -> dict[str, set[int]]:
    """Scheduling policy of every live Python thread of this process, by thread name."""
    policies: dict[str, set[int]] = {}
    for thread in threading.enumerate():
        try:
            policies.setdefault(thread.name, set()).add(os.sched_getscheduler(thread.native_id))
        except ProcessLookupError:  # the thread ended meanwhile
            continue
    return policies


def test_the_threads_an_async_save_wakes_never_preempt_the_training_thread(tmp_path):
    """The saver's thread runs under SCHED_BATCH (same CPU share, no wake-up preemption of the running training
    thread); the training thread keeps the normal policy."""
    model = torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.Linear(2048, 2048))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 2048)).sum().backward()
    optimizer.step()
    probe: list[bool] = []  # whether this machine lets a thread take SCHED_BATCH (a seccomp profile may refuse)
    thread = threading.Thread(target=lambda: probe.append(_tuning.defer_to_running_threads()))
    thread.start()
    thread.join()
    expected = os.SCHED_BATCH if probe[0] else os.SCHED_OTHER  # refused: nothing changes, and the save still commits
    save_checkpoint(tmp_path / "checkpoint-1", model=model, optimizer=optimizer, step=1, rng=False, blocking=False)
    wait_for_pending_saves()
    policies = _policies()
    assert policies.get("hf_resumable-save") == {expected}, policies
    assert os.sched_getscheduler(0) == os.SCHED_OTHER
    assert read_manifest(tmp_path / "checkpoint-1").step == 1


def test_a_policy_that_cannot_be_set_is_logged_and_changes_nothing(monkeypatch, caplog):
    def refuse(*args):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "sched_setscheduler", refuse)
    caplog.set_level(logging.DEBUG, logger=_tuning.__name__)
    seen = []
    thread = threading.Thread(target=lambda: seen.append((_tuning.defer_to_running_threads(),
                                                          os.sched_getscheduler(0))))
    thread.start()
    thread.join()
    assert seen == [(False, os.SCHED_OTHER)]
    assert "Could not set the scheduling policy of thread" in caplog.text


def _policy(tid: int | None = None) -> int:
    return os.sched_getscheduler(threading.get_native_id() if tid is None else tid)


def test_where_nice_values_end_too_soon_the_thread_also_runs_under_sched_idle_and_gets_its_policy_back():
    """Where nice values leave a background thread less than half the increment below the training thread (a job
    started with ``nice -n 15`` or more), the thread (and those it starts) also moves to SCHED_IDLE, and gets its own
    policy and nice value back."""
    base = _nice()
    if not _can_raise_again(base):
        pytest.skip("raising a priority again needs root or RLIMIT_NICE")
    increment = 2 * (19 - base) + 1  # nice values give it less than half
    started, restored, seen = threading.Event(), threading.Event(), {}

    def child() -> None:
        seen["child"] = threading.get_native_id()
        seen["child_lowered"] = (_nice(), _policy())
        started.set()
        assert restored.wait(30)

    def writer() -> None:
        _tuning.defer_to_running_threads()  # as the saver's thread does first
        change = _tuning.lower_thread_priority(increment)
        seen["change"], seen["lowered"] = change, (_nice(), _policy())
        helper = threading.Thread(target=child)
        helper.start()
        assert started.wait(30)
        _tuning.restore_thread_priorities(change)
        seen["after"], seen["child_after"] = (_nice(), _policy()), (_nice(seen["child"]), _policy(seen["child"]))
        restored.set()
        helper.join()

    thread = threading.Thread(target=writer)
    thread.start()
    thread.join()
    assert seen["change"] == (base, 19, os.SCHED_BATCH)
    assert seen["lowered"] == seen["child_lowered"] == (19, os.SCHED_IDLE)
    assert seen["after"] == seen["child_after"] == (base, os.SCHED_BATCH)
    assert (_nice(), _policy()) == (base, os.SCHED_OTHER)  # the training thread was never touched


_AT_NICE = """
import os, sys, threading
from hf_resumable import _tuning
os.setpriority(os.PRIO_PROCESS, os.getpid(), int(sys.argv[1]))  # the job was started with nice -n N
seen = {}
def writer():
    change = _tuning.lower_thread_priority(10)
    seen["lowered"] = (os.getpriority(os.PRIO_PROCESS, threading.get_native_id()), os.sched_getscheduler(0))
    _tuning.restore_thread_priorities(change)
    seen["after"] = (os.getpriority(os.PRIO_PROCESS, threading.get_native_id()), os.sched_getscheduler(0))
    seen["change"] = change
thread = threading.Thread(target=writer)
thread.start()
thread.join()
print(seen["change"], seen["lowered"], seen["after"], os.sched_getscheduler(0))
"""


@pytest.mark.parametrize("nice", [10, 19])
def test_in_a_niced_job_the_writer_still_runs_below_the_training_thread(nice):
    """At nice 19 nice values leave no room: SCHED_IDLE alone keeps the writer below the training thread (which keeps
    its policy). At nice 10 the writer's 19 is most of the increment, and the policy is left alone."""
    import subprocess

    if not _can_raise_again(nice):
        pytest.skip("raising a priority again needs root or RLIMIT_NICE")
    out = subprocess.run([sys.executable, "-c", _AT_NICE, str(nice)], capture_output=True, text=True, check=True,
                         timeout=120).stdout.strip()  # (the repository is on PYTHONPATH: tests/conftest.py)
    other, idle = os.SCHED_OTHER, os.SCHED_IDLE
    expected = {19: f"Lowering(base=19, lowered=19, policy={other}) (19, {idle}) (19, {other}) {other}",
                10: f"Lowering(base=10, lowered=19, policy=None) (19, {other}) (10, {other}) {other}"}
    assert out == expected[nice], out


def test_a_policy_that_cannot_be_left_again_is_logged_and_the_thread_stays_idle(monkeypatch, caplog):
    """Without the privilege to leave SCHED_IDLE (an unprivileged process, RLIMIT_NICE 0), the thread keeps it; a
    later lowering does not record SCHED_IDLE as the policy to go back to."""
    base = _nice()
    caplog.set_level(logging.DEBUG, logger=_tuning.__name__)
    lowered_once, done, seen = threading.Event(), threading.Event(), {}

    def background() -> None:
        seen["change"] = _tuning.lower_thread_priority(2 * (19 - base) + 1)
        seen["tid"] = threading.get_native_id()
        lowered_once.set()
        assert done.wait(30)
        seen["again"] = _tuning.lower_thread_priority(2 * (19 - base) + 1)

    thread = threading.Thread(target=background)
    thread.start()
    assert lowered_once.wait(30)
    real = os.sched_setscheduler

    def refuse_leaving_idle(tid, policy, param):  # what an unprivileged thread meets
        if os.sched_getscheduler(tid) == os.SCHED_IDLE and policy != os.SCHED_IDLE:
            raise PermissionError(1, "Operation not permitted")
        real(tid, policy, param)

    monkeypatch.setattr(os, "sched_setscheduler", refuse_leaving_idle)
    _tuning.restore_thread_priorities(seen["change"])
    assert _policy(seen["tid"]) == os.SCHED_IDLE
    assert f"Could not restore the priority of thread {seen['tid']}" in caplog.text
    done.set()
    thread.join()
    assert seen["change"].policy == os.SCHED_OTHER
    assert seen["again"] == (base, 19, None)
