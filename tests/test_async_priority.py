"""Background saves run below the training thread's CPU priority (Linux), and at the normal one once waited for."""

from __future__ import annotations

import os
import resource
import sys
import threading
import time

import pytest
import torch

from hf_resumable import _tuning
from hf_resumable.checkpoint import read_manifest, save_checkpoint, wait_for_pending_saves
from hf_resumable.checkpoint.commit import _writer

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's")


@pytest.mark.parametrize("how", ["wait", "expedite"])
def test_the_background_write_runs_below_the_training_priority_until_waited_for(tmp_path, monkeypatch, how):
    """The write's threads run WRITER_NICE_INCREMENT nice steps below the training thread (so a step is barely
    slower while a save is written), and get the normal priority back once the training loop waits for them, or
    without waiting once it says the write is late (``expedite``: the next save is due)."""
    from hf_resumable.checkpoint.api import background_saver

    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    lowered = min(19, base + _tuning.WRITER_NICE_INCREMENT)
    if lowered == base:
        pytest.skip(f"this process already runs at nice {base}")
    # Raising a priority again needs root or an RLIMIT_NICE that allows it; without either the writer stays lower.
    restored = base if os.geteuid() == 0 or resource.getrlimit(resource.RLIMIT_NICE)[0] >= 20 - base else lowered
    seen, started = [], threading.Event()
    real = _writer.write_safetensors

    def observed(path, tensors, **kwargs):
        tid = threading.get_native_id()
        seen.append(os.getpriority(os.PRIO_PROCESS, tid))
        started.set()
        deadline = time.monotonic() + 30  # until wait() below has restored the priority (an event, polled)
        while os.getpriority(os.PRIO_PROCESS, tid) != restored and time.monotonic() < deadline:
            time.sleep(0.01)
        seen.append(os.getpriority(os.PRIO_PROCESS, tid))
        return real(path, tensors, **kwargs)

    monkeypatch.setattr(_writer, "write_safetensors", observed)
    save_checkpoint(tmp_path / "checkpoint-1", model=torch.nn.Linear(4, 2), step=1, rng=False, blocking=False)
    assert started.wait(30)
    assert seen[0] == lowered
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == base  # the training thread is untouched
    if how == "expedite":
        assert background_saver().expedite()  # in flight: the writer is held until its priority is restored
        deadline = time.monotonic() + 30
        while len(seen) < 2 and time.monotonic() < deadline:  # restored without waiting (the event, polled)
            time.sleep(0.01)
        assert seen[-1] == restored
    wait_for_pending_saves()
    assert seen[-1] == restored
    assert not background_saver().expedite()  # nothing in flight
    assert read_manifest(tmp_path / "checkpoint-1").step == 1


def test_a_thread_is_lowered_relative_to_the_main_thread_once_however_often_asked():
    base = os.getpriority(os.PRIO_PROCESS, os.getpid())
    if base >= 19:
        pytest.skip(f"this process already runs at nice {base}")
    seen = []

    def lower_twice() -> None:
        for _ in range(2):
            _tuning.lower_thread_priority(5)
            seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    thread = threading.Thread(target=lower_twice)
    thread.start()
    thread.join()
    assert seen == [min(19, base + 5)] * 2
    assert _tuning.lower_thread_priority(0) is None
