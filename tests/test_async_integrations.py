"""Background saves through the integrations under torchrun: ResumableAccelerator(save_async=True) with 2 processes,
one SIGKILLed after a step, restarted with the same command, ends bit-identical to a run with blocking saves."""

from __future__ import annotations

import re

import pytest

from hf_resumable.checkpoint import find_latest_checkpoint, read_manifest

from helpers.accelerate_runs import EXAMPLE, assert_same_run, two_process_reference  # noqa: F401 - the fixture is used by name
from helpers.distributed_launch import child_env
from helpers.distributed_launch import run_torchrun as launch_torchrun

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _torchrun(output, *, env=None):
    return launch_torchrun(EXAMPLE, ["--output-dir", str(output), "--num-workers", "0", "--save-async"],
                           env=child_env(env), timeout=180)


def test_async_saves_under_torchrun_survive_a_sigkill_and_resume_bit_exact(tmp_path, two_process_reference):
    interrupted = _torchrun(tmp_path, env={"HF_RESUMABLE_EXAMPLE_KILL_AFTER_STEP": "3",
                                           "HF_RESUMABLE_EXAMPLE_SIGNAL_RANK": "1",
                                           "HF_RESUMABLE_EXAMPLE_AWAIT_COMMIT": "1"})
    # torchrun lists every failed rank ("exitcode  : -9" for the killed one); its one-line summary names only the
    # failure it saw first, which may be the peer that lost its connection
    killed = re.search(r"exitcode\s*: -9\b", interrupted.stdout)
    assert interrupted.returncode != 0 and killed, interrupted.stdout[-5000:]
    latest = find_latest_checkpoint(tmp_path / "checkpoints")
    assert latest is not None and latest.name == "checkpoint-2" and read_manifest(latest).world_size == 2
    resumed = _torchrun(tmp_path)
    assert resumed.returncode == 0, resumed.stdout[-5000:]
    assert f"Resumed from {latest}" in resumed.stdout
    assert_same_run(tmp_path, two_process_reference, final_step=4)  # the reference saved blocking
