"""Replicas share the save (``checkpoint/commit/_replicas.py``): under DDP each rank writes a disjoint part of the
model's and optimizer's files, and the checkpoint is byte-identical to the one rank 0 alone writes.

* the pure plan (sizes and world size in, one rank per file out);
* 2 gloo ranks, blocking and async: every file, and the manifest (but its commit time), the same bytes as the
  single-writer plan's (``HF_RESUMABLE_SPLIT_REPLICAS=0``); both ranks wrote replicated files, none twice;
* a failure on the rank writing a replicated file commits nothing, and every rank raises.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hf_resumable.checkpoint import read_manifest
from hf_resumable.checkpoint.commit._replicas import plan_replica_writers, replicas_split
from hf_resumable.checkpoint.commit.manifest import Manifest

from helpers.distributed_launch import launch_ranks

WORKER = str(Path(__file__).parent / "scripts" / "replica_worker.py")


def test_plan_puts_the_largest_file_first_on_the_least_loaded_rank():
    sizes = {"a": 10, "b": 7, "c": 5, "d": 4, "e": 1}
    assert plan_replica_writers(sizes, 2) == {"a": 0, "b": 1, "c": 1, "d": 0, "e": 1}
    assert plan_replica_writers(sizes, 1) == dict.fromkeys(["a", "b", "c", "d", "e"], 0)
    assert plan_replica_writers({}, 4) == {}


def test_plan_is_deterministic_and_independent_of_order():
    sizes = {f"f{i}": (i * 37) % 11 for i in range(20)}
    reversed_sizes = dict(reversed(list(sizes.items())))
    assert plan_replica_writers(sizes, 3) == plan_replica_writers(reversed_sizes, 3)
    loads = [0, 0, 0]
    for name, rank in plan_replica_writers(sizes, 3).items():
        loads[rank] += sizes[name]
    assert max(loads) - min(loads) <= max(sizes.values())


def test_plan_refuses_a_world_size_below_one():
    with pytest.raises(ValueError, match="world_size"):
        plan_replica_writers({"a": 1}, 0)


def test_split_only_when_every_rank_agrees():
    assert replicas_split(["x", "x"])
    assert not replicas_split(["x"])  # one process
    assert not replicas_split(["x", "y"])
    assert not replicas_split(["x", None])
    assert not replicas_split([None, None])


def _save(mode: str, root: Path, *, split: bool):
    root.mkdir(parents=True)
    results = launch_ranks([WORKER, mode, str(root)], world_size=2, timeout=120.0,
                           env={"HF_RESUMABLE_SPLIT_REPLICAS": "1" if split else "0"})
    for result in results:
        assert result.returncode == 0 and not result.killed_by_timeout, result.describe()
    return [json.loads((root / f"written-rank{rank}.json").read_text()) for rank in (0, 1)]


def _without_commit_time(manifest_file: Path) -> bytes:
    manifest = read_manifest(manifest_file.parent)
    return Manifest(files=manifest.files, step=manifest.step, world_size=manifest.world_size,
                    metrics=manifest.metrics, versions=manifest.versions, created=0.0).to_json()


@pytest.mark.distributed
# The async save's bytes equal the blocking save's (test_distributed_async), so one mode proves the split here.
@pytest.mark.parametrize("mode", ["blocking", pytest.param("async", marks=pytest.mark.extended)])
def test_two_ranks_share_the_replicated_files_and_write_the_same_bytes(tmp_path, mode):
    split = _save(mode, tmp_path / "split", split=True)
    single = _save(mode, tmp_path / "single", split=False)
    assert single[1] == [] and len(single[0]) > 4  # the single-writer plan: rank 0 writes every tensor file
    assert split[0] and split[1] and not set(split[0]) & set(split[1])
    assert sorted(split[0] + split[1]) == sorted(single[0])
    a, b = tmp_path / "split" / "checkpoint-1", tmp_path / "single" / "checkpoint-1"
    names = sorted(p.relative_to(a).as_posix() for p in a.rglob("*") if p.is_file())
    assert names == sorted(p.relative_to(b).as_posix() for p in b.rglob("*") if p.is_file())
    assert "optimizer.safetensors.index.json" in names and "model.safetensors.index.json" in names
    for name in names:
        if name != "manifest.json":
            assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert _without_commit_time(a / "manifest.json") == _without_commit_time(b / "manifest.json")


@pytest.mark.distributed
# A failure on one rank commits nothing on any rank: test_distributed_async checks it in `make test`; this variant,
# with the replicated files split between the ranks, runs in `make test-all`.
@pytest.mark.extended
def test_a_failed_write_of_a_replicated_file_commits_nothing(tmp_path):
    tmp_path = tmp_path / "fail"
    _save("fail", tmp_path, split=True)
    assert not (tmp_path / "checkpoint-1").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    errors = [json.loads((tmp_path / f"error-rank{rank}.json").read_text()) for rank in (0, 1)]
    assert errors == [{"type": "OSError", "errno": 28}] * 2, errors
