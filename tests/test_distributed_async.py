"""Background saves under torch.distributed: 2 real gloo processes that keep training (with all-reduces on the
default group) while their checkpoints are written and committed over a group of their own.

* async saves commit exactly the bytes a blocking save commits, for DDP-style and FSDP2 (``fully_shard``) models
  (with and without frozen parameters; the layout and the frozen record included), also when the copy of the
  parameters and optimizer state starts only after the next step has begun (that step waits for it), and training
  is not disturbed
  (same losses and final weights); every sharded checkpoint reloads to torch's own full state dicts at its save,
  also after the optimizer gained a param group between two saves;
* a failure on one rank (ENOSPC) leaves no committed checkpoint, the previous one valid, and every rank raises
  ``AsyncSaveError`` at its next save, also when it is rank 0's write of a sharded layout (built from every rank's
  report after every rank's files are durable);
* a rank SIGKILLed inside its background write: the other rank never commits, the previous checkpoint stays
  the newest valid one.
"""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest

from hf_resumable.checkpoint import find_latest_checkpoint, list_checkpoints, read_manifest, verify_checkpoint

from helpers.distributed_launch import launch_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

WORKER = str(Path(__file__).parent / "scripts" / "dist_async_worker.py")


def _run(mode: str, root: Path, *, timeout: float = 150.0):
    root.mkdir(parents=True, exist_ok=True)
    return launch_ranks([WORKER, mode, str(root)], world_size=2, timeout=timeout)


def _ok(results) -> None:
    for result in results:
        assert result.returncode == 0 and not result.killed_by_timeout, result.describe()


PLANNED = ("sharded_layout.json", "frozen_base.json")  # built from every rank's report; off the training thread


def _tensor_records(checkpoint: Path) -> dict:
    """xxh3-128 of every tensor file (model, optimizer, pieces) and of a sharded save's layout and frozen record,
    which must not depend on blocking or not."""
    files = read_manifest(checkpoint).files
    return {name: record.xxh3_128 for name, record in files.items()
            if (name.endswith(".safetensors") and not name.startswith("rng/")) or name in PLANNED}


# FSDP2 with a frozen part is proven once by test_frozen_sharded; its async variant runs in make test-all.
@pytest.mark.parametrize("kind", ["", "sharded-", pytest.param("sharded-frozen-", marks=pytest.mark.extended)],
                         ids=["ddp", "fsdp2", "fsdp2-frozen"])
def test_async_saves_commit_the_same_bytes_as_blocking_saves_while_training_goes_on(tmp_path, kind):
    _ok(_run(f"{kind}blocking", tmp_path / "blocking"))
    _ok(_run(f"{kind}async", tmp_path / "async"))
    for rank in (0, 1):
        blocking = json.loads((tmp_path / "blocking" / f"result-rank{rank}.json").read_text())
        background = json.loads((tmp_path / "async" / f"result-rank{rank}.json").read_text())
        assert background["losses"] == blocking["losses"] and background["digest"] == blocking["digest"]
        assert background["error"] is None
        # the steps after the saves at 2 and 4 began before the copies, and waited for them (staging_probe.py)
        assert background["blocked"] == 2
        # Sharded: each checkpoint, loaded into a fresh model and optimizer (the optimizer gained a param group
        # between the first and the second save), equals torch's own full state dicts at the save.
        expected = {"2": True, "4": True, "6": True} if kind else {}
        assert background["reloaded"] == expected and blocking["reloaded"] == expected
    for step in (2, 4, 6):
        ours, reference = tmp_path / "async" / f"checkpoint-{step}", tmp_path / "blocking" / f"checkpoint-{step}"
        assert verify_checkpoint(ours, full=True).ok
        assert read_manifest(ours).world_size == 2
        records = _tensor_records(ours)
        assert records == _tensor_records(reference) and records
        assert [name for name in PLANNED if name in records] == {"": [], "sharded-": [PLANNED[0]],
                                                                 "sharded-frozen-": list(PLANNED)}[kind]
    leftovers = [p.name for p in (tmp_path / "async").iterdir() if p.name.startswith(".")]
    assert leftovers == []


def test_a_failure_on_one_rank_commits_nothing_and_every_rank_raises_at_its_next_save(tmp_path):
    root = tmp_path / "run"
    _ok(_run("fail", root))
    assert [s for s, _ in list_checkpoints(root)] == [2]
    assert find_latest_checkpoint(root) == root / "checkpoint-2"
    errors = [json.loads((root / f"error-rank{rank}.json").read_text())["error"] for rank in (0, 1)]
    assert all(e is not None and e["type"] == "AsyncSaveError" and e["step"] == 6 for e in errors), errors
    assert errors[1]["cause"] == "OSError" and errors[1]["errno"] == errno.ENOSPC  # the failing rank's own error
    assert "ENOSPC" in errors[0]["message"] or "No space left" in errors[0]["message"]
    assert all("Fix the cause (the disk" in e["message"] for e in errors), errors  # storage's error, storage's fix
    assert [p.name for p in root.iterdir() if p.name.startswith(".tmp-")] == []


def test_a_sharded_save_whose_layout_write_fails_on_rank_0_commits_nothing(tmp_path):
    root = tmp_path / "run"
    _ok(_run("sharded-fail", root))
    assert [s for s, _ in list_checkpoints(root)] == [2]
    assert find_latest_checkpoint(root) == root / "checkpoint-2"
    errors = [json.loads((root / f"error-rank{rank}.json").read_text())["error"] for rank in (0, 1)]
    assert all(e is not None and e["type"] == "AsyncSaveError" and e["step"] == 6 for e in errors), errors
    assert errors[0]["cause"] == "OSError" and errors[0]["errno"] == errno.ENOSPC  # the failing rank's own error
    assert errors[1]["cause"] == "OSError" and errors[1]["errno"] == errno.ENOSPC  # rebuilt from rank 0's
    assert [p.name for p in root.iterdir() if p.name.startswith(".tmp-")] == []


def test_a_rank_killed_inside_its_background_write_leaves_the_previous_checkpoint_newest(tmp_path):
    root = tmp_path / "run"
    results = _run("kill", root, timeout=120)
    assert results[1].returncode == -9, results[1].describe()
    assert results[0].returncode != 0 or results[0].killed_by_timeout  # its peer is gone
    assert not (root / "checkpoint-4").exists()
    assert find_latest_checkpoint(root) == root / "checkpoint-2"
    assert verify_checkpoint(root / "checkpoint-2", full=True).ok
    # The survivor's save error says what to do about a dead peer (not "free disk space"): raised at its next save
    # (recorded by the worker) or, when its training loop's next collective fails first, at interpreter exit.
    advice = "If another rank died or lost its connection"
    recorded = root / "error-rank0.json"
    raised = json.loads(recorded.read_text())["error"] if recorded.exists() else None
    assert advice in results[0].stderr or (raised and advice in raised["message"]), (raised, results[0].describe())
