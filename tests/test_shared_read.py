"""Read once (``checkpoint/_shared_read.py``): a 2-rank DDP resume reads each byte of the checkpoint from storage once
across the ranks and loads bitwise the saved state: by default, on one machine, each rank reads every file through
the shared page cache; split and exchanged over gloo (``HF_RESUMABLE_SHARED_READS=always``, what ranks on different
machines do) each rank reads its share. A corrupted byte is caught on both ranks as ``CorruptCheckpointError``.

Bytes read from storage are each rank's ``/proc/self/io`` read_bytes around the load, with the checkpoint's pages
dropped from the page cache first (``posix_fadvise(DONTNEED)``), so the checkpoint must live on a block device.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers.distributed_launch import launch_ranks

pytestmark = pytest.mark.distributed

WORKER = str(Path(__file__).parent / "scripts" / "shared_read_worker.py")


def _run(mode: str, root: Path, *, shared: str = "always") -> list[dict]:
    results = launch_ranks([WORKER, mode, str(root)], world_size=2, timeout=120.0,
                           env={"HF_RESUMABLE_SHARED_READS": shared})
    for result in results:
        assert result.returncode == 0 and not result.killed_by_timeout, result.describe()
    if mode == "save":
        return []
    return [json.loads((root / f"result-rank{rank}.json").read_text()) for rank in (0, 1)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("shared_read")
    _run("save", root)
    return root


def _size(checkpoint: Path) -> int:
    return sum(p.stat().st_size for p in checkpoint.rglob("*.safetensors"))


def test_a_two_rank_resume_reads_the_checkpoint_once_and_loads_it_bitwise(saved):
    size = _size(saved / "checkpoint-1")
    shared = _run("load", saved)  # forced: the ranks split the files and exchange them (ranks on two machines)
    assert all(result.get("same") for result in shared), shared
    total = sum(r["read_bytes"] for r in shared)
    if total < 0.5 * size:
        pytest.skip(f"{saved} is not on a block device (tmpfs?): read_bytes counts no reads there")
    assert total <= 1.1 * size, (total, size, shared)
    assert all(r["read_bytes"] > 0.25 * size for r in shared), shared  # both ranks read their share
    assert all(r["exchanged"] for r in shared), shared
    # One machine, not said by the launcher: the ranks find they share a page cache, and each reads every file.
    default = _run("load-unhinted", saved, shared="1")
    assert all(result.get("same") for result in default), default
    # The kernel reads a page once for both ranks while it stays cached; other jobs' memory pressure can evict a page
    # between the two ranks' reads (seen once at 1.13x on a loaded machine). Reading every file each would be 2x.
    assert sum(r["read_bytes"] for r in default) <= 1.25 * size, (size, default)
    assert not any(r["exchanged"] for r in default), default


@pytest.mark.extended
def test_without_shared_reads_every_rank_reads_every_file(saved):
    size = _size(saved / "checkpoint-1")
    each = _run("load", saved, shared="0")  # every rank reads every file: the reads the default replaces
    assert all(result.get("same") for result in each), each
    assert not any(r["exchanged"] for r in each), each
    before = sum(r["read_bytes"] for r in each)
    if before < 0.5 * size:
        pytest.skip(f"{saved} is not on a block device (tmpfs?): read_bytes counts no reads there")
    # On one machine the ranks share the page cache, so storage serves each byte about once (buffered reads),
    # but every byte was read from it.
    assert before >= 0.9 * size, (before, size, each)


def test_a_corrupted_byte_is_caught_on_both_ranks(saved, tmp_path):
    checkpoint = tmp_path / "checkpoint-1"
    checkpoint.mkdir()
    for path in (saved / "checkpoint-1").iterdir():
        (checkpoint / path.name).write_bytes(path.read_bytes())
    victim = max(checkpoint.glob("optimizer-*.safetensors"), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[-100] ^= 0x01  # in the tensor data (the headers are checked by the quick verification)
    victim.write_bytes(bytes(data))
    results = _run("load", tmp_path)
    assert [r.get("error") for r in results] == ["CorruptCheckpointError"] * 2, results


def test_runs_group_consecutive_files_by_reader():
    from hf_resumable.checkpoint._shared_read import _runs

    reads = ["a", "b", "c", "d", "e"]
    runs = _runs(reads, [0, 0, 1, 0, 1], rank=0)
    assert [(mine, [r for r, _ in run]) for mine, run in runs] == [
        (True, ["a", "b"]), (False, ["c"]), (True, ["d"]), (False, ["e"])]


def test_ranks_exchange_only_where_they_do_not_share_a_page_cache(tmp_path):
    from hf_resumable.checkpoint._shared_read import one_page_cache, page_cache_identity

    here = page_cache_identity(tmp_path)
    assert here is not None and here == page_cache_identity(tmp_path)
    assert here != page_cache_identity(tmp_path.parent)  # another directory: another inode
    assert page_cache_identity(tmp_path / "missing") is None
    assert one_page_cache([here, here])
    assert not one_page_cache([here, "another-kernel:1:2"])
    assert not one_page_cache([here, None]) and not one_page_cache([])


def test_a_launcher_that_puts_every_rank_on_this_machine_means_per_rank_reads(monkeypatch):
    import hf_resumable.checkpoint._shared_read as shared_read

    monkeypatch.setattr(shared_read, "is_distributed", lambda: True)
    monkeypatch.setattr(shared_read, "rank_and_world_size", lambda: (0, 4))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.delenv("HF_RESUMABLE_SHARED_READS", raising=False)
    assert not shared_read.shares_reads()  # torchrun on one machine: no collective, every rank reads every file
    monkeypatch.setenv("HF_RESUMABLE_SHARED_READS", "always")
    assert shared_read.shares_reads()
    monkeypatch.setenv("HF_RESUMABLE_SHARED_READS", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two machines
    assert shared_read.shares_reads()
    monkeypatch.delenv("LOCAL_WORLD_SIZE")  # not said: read_shared finds out
    assert shared_read.shares_reads()
    monkeypatch.setenv("HF_RESUMABLE_SHARED_READS", "0")
    assert not shared_read.shares_reads()
