"""The one place that lowers a background thread's CPU priority (``_threads.background_priority``): the staging
helpers' copy after an async save's call returned runs below the training thread, gets the normal priority back when
the training loop waits for it, and a priority that cannot be set never fails a copy (Linux; nice is per thread)."""

from __future__ import annotations

import logging
import os
import sys
import threading

import pytest
import torch

from hf_resumable.checkpoint import _staging, _threads

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's")

INCREMENT = 5


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def _base_and_lowered() -> tuple[int, int]:
    base = os.getpriority(os.PRIO_PROCESS, os.getpid())
    lowered = min(19, base + INCREMENT)
    if lowered == base:
        pytest.skip(f"this process already runs at nice {base}")
    return base, lowered


def _can_raise_again(base: int) -> bool:
    import resource

    return os.geteuid() == 0 or resource.getrlimit(resource.RLIMIT_NICE)[0] >= 20 - base


def _pairs(pieces: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    src = torch.arange(pieces * _staging.CHUNK_BYTES // 4, dtype=torch.int32)
    return [(torch.empty_like(src), src)]


class _Recorder:
    """A copier that records each piece's thread and nice value. The first piece a helper copies waits until
    ``hold`` is set (so that the test can look at it while it runs); ``helper_copied`` says one has started."""

    def __init__(self, *, hold_helper: bool) -> None:
        self.seen: list[tuple[int, int]] = []
        self.helper_copied = threading.Event()
        self.hold = threading.Event()
        if not hold_helper:
            self.hold.set()
        self.main = threading.get_native_id()

    def __call__(self, dst: int, src: int, nbytes: int) -> None:
        tid = threading.get_native_id()
        self.seen.append((tid, _nice()))
        if tid != self.main:
            self.helper_copied.set()
            assert self.hold.wait(30)
        else:  # the caller waits for a helper to take part (so that helpers' pieces exist to look at)
            assert self.helper_copied.wait(30)
        _staging.copy_bytes(dst, src, nbytes)


def test_a_background_copy_runs_below_the_main_thread_and_the_next_copy_at_the_normal_priority():
    base, lowered = _base_and_lowered()
    recorder = _Recorder(hold_helper=False)
    pairs = _pairs(8)
    copy = _staging.start_copy(pairs, workers=2, copier=recorder, nice=INCREMENT)
    assert recorder.helper_copied.wait(30)
    copy.join()
    assert torch.equal(pairs[0][0], pairs[0][1])
    helpers = {nice for tid, nice in recorder.seen if tid != recorder.main}
    assert helpers == {lowered}
    assert _nice() == base  # the caller is untouched
    # A copy the caller waits for (copy_into): the same helpers, at the normal priority again.
    recorder = _Recorder(hold_helper=False)
    pairs = _pairs(8)
    _staging.copy_into(pairs, workers=2, copier=recorder)
    assert torch.equal(pairs[0][0], pairs[0][1])
    helpers = {nice for tid, nice in recorder.seen if tid != recorder.main}
    assert helpers == ({base} if _can_raise_again(base) else {lowered})


def test_assist_gives_the_helpers_still_copying_the_normal_priority():
    """What an optimizer step held by a save does when the copy is not over: it takes part, and the helpers it now
    waits for run at its priority."""
    base, lowered = _base_and_lowered()
    if not _can_raise_again(base):
        pytest.skip("raising a priority again needs root or RLIMIT_NICE")
    recorder = _Recorder(hold_helper=True)
    pairs = _pairs(2)
    copy = _staging.start_copy(pairs, workers=2, copier=recorder, nice=INCREMENT)
    assert recorder.helper_copied.wait(30)
    helper = next(tid for tid, _ in recorder.seen if tid != recorder.main)
    assert os.getpriority(os.PRIO_PROCESS, helper) == lowered  # held inside its piece, at the lower priority
    copy.assist()
    assert os.getpriority(os.PRIO_PROCESS, helper) == base
    recorder.hold.set()
    copy.join()
    assert torch.equal(pairs[0][0], pairs[0][1])


def test_a_priority_that_cannot_be_set_is_logged_and_the_copy_runs_at_the_one_it_has(monkeypatch, caplog):
    _base_and_lowered()

    def refuse(*args):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "setpriority", refuse)
    caplog.set_level(logging.DEBUG, logger=_threads.__name__)
    with _threads.background_priority(INCREMENT) as change:
        assert change is None
    assert "Could not lower the priority" in caplog.text
    pairs = _pairs(8)
    copy = _staging.start_copy(pairs, workers=2, nice=INCREMENT)
    copy.join()
    assert torch.equal(pairs[0][0], pairs[0][1])


def test_background_priority_restores_only_the_calling_thread():
    base, lowered = _base_and_lowered()
    if not _can_raise_again(base):
        pytest.skip("raising a priority again needs root or RLIMIT_NICE")
    other_lowered, release_other, seen = threading.Event(), threading.Event(), {}

    def other() -> None:  # lowered the same way, still working when the first thread's block ends
        _threads.lower_thread_priority(INCREMENT)
        seen["other"] = threading.get_native_id()
        other_lowered.set()
        assert release_other.wait(30)

    def caller() -> None:
        with _threads.background_priority(INCREMENT):
            seen["inside"] = _nice()
        seen["after"] = _nice()

    worker = threading.Thread(target=other)
    worker.start()
    assert other_lowered.wait(30)
    thread = threading.Thread(target=caller)
    thread.start()
    thread.join()
    assert (seen["inside"], seen["after"]) == (lowered, base)
    assert os.getpriority(os.PRIO_PROCESS, seen["other"]) == lowered
    release_other.set()
    worker.join()
