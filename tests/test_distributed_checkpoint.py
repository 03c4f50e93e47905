"""The checkpoint format under torch.distributed: 2 real gloo processes per run, started and stopped here.

* every rank gets its *own* RNG stream and data position back, bit for bit, in a fresh pair of processes;
* a rank SIGKILLed inside a save leaves the previous checkpoint the latest valid one, and a restarted
  pair resumes from it and saves again.
"""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import pytest

from hf_resumable.checkpoint import find_latest_checkpoint, read_manifest, verify_checkpoint

from helpers.distributed_launch import launch_ranks

pytestmark = pytest.mark.distributed

WORKER = str(Path(__file__).parent / "scripts" / "dist_checkpoint_worker.py")
WORLD_SIZE = 2


def run_pair(mode: str, root: Path, step: int, *, timeout: float = 90.0):
    return launch_ranks([WORKER, mode, str(root), str(step)], world_size=WORLD_SIZE, timeout=timeout)


def assert_all_ok(results) -> None:
    for result in results:
        assert result.returncode == 0 and not result.killed_by_timeout, result.describe()


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def assert_rank_got_its_own_state(root: Path, step: int) -> None:
    loaded = [read_json(root / f"loaded-rank{rank}.json") for rank in range(WORLD_SIZE)]
    expected = [read_json(root / f"expected-step{step}-rank{rank}.json") for rank in range(WORLD_SIZE)]
    for rank in range(WORLD_SIZE):
        got, want = loaded[rank], expected[rank]
        assert got["step"] == step and got["same_weights"], got
        assert got["data_state"] == want["data_state"], (rank, got["data_state"], want["data_state"])
        # Bit-exact: the floats must be identical, not close.
        for key in ("python", "numpy", "torch"):
            assert got[key] == want[key], (rank, key, got[key], want[key])
    # The ranks' streams really differ, so "each rank got its own" is a meaningful check.
    assert expected[0]["torch"] != expected[1]["torch"]
    assert expected[0]["data_state"] != expected[1]["data_state"]


@pytest.fixture(scope="module")
def saved_by_two_ranks(tmp_path_factory) -> Path:
    """A root holding checkpoint-1, saved by 2 ranks with different RNG and data states (read-only)."""
    root = tmp_path_factory.mktemp("two_ranks")
    assert_all_ok(run_pair("save", root, 1))
    return root


@pytest.fixture
def root_with_checkpoint_1(saved_by_two_ranks, tmp_path) -> Path:
    for entry in saved_by_two_ranks.iterdir():
        (shutil.copytree if entry.is_dir() else shutil.copy2)(entry, tmp_path / entry.name)
    return tmp_path


def test_each_rank_gets_its_own_rng_and_data_state_back(root_with_checkpoint_1):
    tmp_path = root_with_checkpoint_1
    manifest = read_manifest(tmp_path / "checkpoint-1")
    assert manifest.world_size == WORLD_SIZE
    assert {"rng/rank-00000.safetensors", "rng/rank-00001.safetensors", "data/rank-00000.json",
            "data/rank-00001.json"} <= set(manifest.files)

    assert_all_ok(run_pair("resume", tmp_path, 2))
    assert_rank_got_its_own_state(tmp_path, 1)
    assert find_latest_checkpoint(tmp_path) == tmp_path / "checkpoint-2"


def test_sigkill_of_one_rank_during_save_keeps_previous_checkpoint_and_restart_works(root_with_checkpoint_1):
    tmp_path = root_with_checkpoint_1
    # Rank 1 kills itself inside the save (a step-based trigger, not a timer); the timeout only collects a rank 0
    # that hangs in the collective, and is long enough for a slow start on a loaded machine (25 s was not).
    crashed = run_pair("crash", tmp_path, 2, timeout=90.0)
    assert crashed[1].returncode == -signal.SIGKILL, crashed[1].describe()
    # Rank 0 either noticed the dead peer and failed, or hung in the collective until we killed it.
    assert crashed[0].returncode != 0, crashed[0].describe()
    assert "rank 0 done" not in crashed[0].stdout
    assert not (tmp_path / "checkpoint-2").exists()
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    assert leftovers, "the kill did not land inside the save; the test would prove nothing"

    latest = find_latest_checkpoint(tmp_path)
    assert latest == tmp_path / "checkpoint-1"
    report = verify_checkpoint(latest, full=True)
    assert report.ok, report.summary()

    # A fresh pair resumes from checkpoint-1 (each rank its own state) and commits checkpoint-2.
    assert_all_ok(run_pair("resume", tmp_path, 2))
    assert_rank_got_its_own_state(tmp_path, 1)
    assert find_latest_checkpoint(tmp_path) == tmp_path / "checkpoint-2"
    assert verify_checkpoint(tmp_path / "checkpoint-2", full=True).ok
    assert read_manifest(tmp_path / "checkpoint-2").world_size == WORLD_SIZE


def test_single_process_load_of_a_two_rank_checkpoint_is_refused_unless_opted_in(saved_by_two_ranks):
    import torch

    from hf_resumable.checkpoint import load_checkpoint
    from hf_resumable.errors import ConfigDriftError

    with pytest.raises(ConfigDriftError, match="written by 2 process"):
        load_checkpoint(saved_by_two_ranks / "checkpoint-1", restore_rng=True)
    state = torch.get_rng_state()
    loaded = load_checkpoint(saved_by_two_ranks / "checkpoint-1", restore_rng=False, allow_inexact_resume=True)
    assert loaded.manifest.world_size == 2 and torch.equal(torch.get_rng_state(), state)
