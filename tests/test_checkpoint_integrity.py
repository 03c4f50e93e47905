"""Corruption, malicious files, full disks and retention: nothing bad is ever loaded, nothing good is lost."""

from __future__ import annotations

import json
import os
import pickle
import subprocess

import pytest
import torch

from hf_resumable.checkpoint import (
    apply_retention,
    find_latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    read_manifest,
    save_checkpoint,
    verify_checkpoint,
    wait_for_pending_saves,
)
from hf_resumable.checkpoint.commit import _writer
from hf_resumable.checkpoint.commit._owner import OwnerTag, current_owner, member_name
from hf_resumable.constants import TMP_PREFIX
from hf_resumable.errors import (
    CorruptCheckpointError,
    FormatVersionError,
    IncompleteCheckpointError,
    UnsafeIndexError,
)
from hf_resumable.format.safetensors_io import read_header

from helpers.tiny_models import assert_same_state, tiny_gpt2, train_steps


def _save_two(root):
    model = tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train_steps(model, optimizer, steps=1)
    save_checkpoint(root / "checkpoint-1", model=model, optimizer=optimizer, step=1, max_shard_size="16KB")
    train_steps(model, optimizer, steps=1)
    save_checkpoint(root / "checkpoint-2", model=model, optimizer=optimizer, step=2, max_shard_size="16KB",
                    data_state={"epoch": 0, "position": 4})
    wait_for_pending_saves()  # the deferred fsyncs done: the directories hold their final files
    return model, optimizer


KINDS = {
    "model shard": "model-00002-of-",
    "optimizer shard": "optimizer-00001-of-",
    "model index": "model.safetensors.index.json",
    "optimizer index": "optimizer.safetensors.index.json",
    "training state": "training_state.json",
    "rng": "rng/rank-00000.safetensors",
    "data state": "data/rank-00000.json",
    "config": "config.json",
    "manifest": "manifest.json",
}


def _find(directory, prefix):
    for path in sorted(directory.rglob("*")):
        if path.is_file() and path.relative_to(directory).as_posix().startswith(prefix):
            return path
    raise AssertionError(prefix)


@pytest.mark.parametrize("damage", ["flip", "truncate"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_damage_in_every_kind_of_file_is_detected_and_skipped(tmp_path, kind, damage):
    _save_two(tmp_path)
    target = _find(tmp_path / "checkpoint-2", KINDS[kind])
    data = bytearray(target.read_bytes())
    if damage == "flip":
        position = len(data) - 3 if target.suffix == ".safetensors" else len(data) // 2
        data[position] ^= 0x01
    else:
        data = data[: len(data) * 2 // 3]
    target.write_bytes(bytes(data))

    report = verify_checkpoint(tmp_path / "checkpoint-2", full=True)
    assert not report.ok
    assert any(target.name in f or f == "manifest.json" for f, _ in report.problems), report.problems
    assert find_latest_checkpoint(tmp_path) == tmp_path / "checkpoint-1"
    with pytest.raises((CorruptCheckpointError, IncompleteCheckpointError)):
        load_checkpoint(tmp_path / "checkpoint-2", model=tiny_gpt2(), restore_rng=False)


def test_flip_in_a_large_shard_needs_full_verification_and_is_caught_on_load(tmp_path):
    big = {"w": torch.randn(1536, 1024)}  # 6 MiB, above the quick-hash limit
    save_checkpoint(tmp_path / "checkpoint-1", model={"w": torch.zeros(2)}, step=1, rng=False)
    save_checkpoint(tmp_path / "checkpoint-2", model=big, step=2, rng=False)
    shard = _find(tmp_path / "checkpoint-2", "model.safetensors")
    with open(shard, "r+b") as f:
        f.seek(-100, os.SEEK_END)
        byte = f.read(1)
        f.seek(-100, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0x80]))
    assert verify_checkpoint(tmp_path / "checkpoint-2", full=False).ok
    assert not verify_checkpoint(tmp_path / "checkpoint-2", full=True).ok
    assert find_latest_checkpoint(tmp_path) == tmp_path / "checkpoint-2"
    assert find_latest_checkpoint(tmp_path, full=True) == tmp_path / "checkpoint-1"
    module = torch.nn.Module()
    module.register_buffer("w", torch.zeros(1536, 1024))
    with pytest.raises(CorruptCheckpointError, match="xxh3-128 is"):
        load_checkpoint(tmp_path / "checkpoint-2", model=module, restore_rng=False)


def _flip(path, offset=-100):
    with open(path, "r+b") as f:
        f.seek(offset, os.SEEK_END)
        byte = f.read(1)
        f.seek(offset, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0x80]))


def test_new_records_hold_size_and_xxh3_of_the_bytes_on_disk_and_no_sha256(tmp_path):
    import xxhash

    from hf_resumable.constants import FORMAT_VERSION, MODEL_INDEX_FILE, SHARDS_KEY

    model = tiny_gpt2()
    save_checkpoint(tmp_path / "checkpoint-2", model=model, step=2, max_shard_size="16KB")
    directory = tmp_path / "checkpoint-2"
    document = json.loads((directory / "manifest.json").read_text())
    assert document["format_version"] == FORMAT_VERSION == 3
    for relpath, record in document["files"].items():
        data = (directory / relpath).read_bytes()
        chunks = {}
        if relpath.endswith(".safetensors"):  # format version 3: every 1 MiB chunk's xxh3-64
            size = record["chunk_size"]
            chunks = {"chunk_size": size, "chunk_xxh3_64": "".join(
                xxhash.xxh3_64(data[i : i + size]).hexdigest() for i in range(0, len(data), size))}
        assert record == {"size": len(data), "xxh3_128": xxhash.xxh3_128(data).hexdigest(), **chunks}, relpath
    shards = json.loads((directory / MODEL_INDEX_FILE).read_text())["metadata"][SHARDS_KEY]
    assert len(shards) >= 2 and shards == {name: {k: document["files"][name][k] for k in ("size", "xxh3_128")}
                                           for name in shards}  # whole-file records: no chunk hashes in an index


@pytest.mark.parametrize("size", ["small", "large"])
def test_flipped_byte_in_a_new_checkpoint_is_caught_by_verify_and_load(tmp_path, size):
    # small: below QUICK_HASH_LIMIT, hashed by quick verification too; large: only full verification and the load
    # read every byte.
    weights = {"w": torch.randn(16, 16) if size == "small" else torch.randn(1536, 1024)}
    save_checkpoint(tmp_path / "checkpoint-2", model=weights, step=2, rng=False)
    directory = tmp_path / "checkpoint-2"
    assert verify_checkpoint(directory, full=True).ok
    _flip(_find(directory, "model.safetensors"), offset=-3)
    quick, full = verify_checkpoint(directory, full=False), verify_checkpoint(directory, full=True)
    assert not full.ok and "xxh3-128 is" in full.summary() and "model.safetensors" in full.summary()
    assert quick.ok == (size == "large"), quick.summary()
    module = torch.nn.Module()
    module.register_buffer("w", torch.zeros_like(weights["w"]))
    with pytest.raises(CorruptCheckpointError, match="xxh3-128 is"):
        load_checkpoint(directory, model=module, restore_rng=False)


def _as_version_1_with_sha256_only(directory):
    """Rewrite ``directory``'s manifest as the oldest writers did: format version 1, records of size and sha256."""
    import hashlib

    from hf_resumable.checkpoint.commit.manifest import Manifest
    from hf_resumable.format.safetensors_io import FileRecord

    manifest = read_manifest(directory)
    files = {rel: FileRecord(r.size, sha256=hashlib.sha256((directory / rel).read_bytes()).hexdigest())
             for rel, r in manifest.files.items()}
    old = Manifest(files=files, step=manifest.step, format_version=1)
    (directory / "manifest.json").write_bytes(old.to_json())
    assert "xxh3_128" not in (directory / "manifest.json").read_text()


def test_a_version_1_manifest_with_sha256_only_loads_verifies_full_and_catches_a_flip_by_sha256(tmp_path):
    big = {"w": torch.randn(1536, 1024)}
    save_checkpoint(tmp_path / "checkpoint-2", model=big, step=2, rng=False)
    directory = tmp_path / "checkpoint-2"
    _as_version_1_with_sha256_only(directory)
    assert read_manifest(directory).format_version == 1
    assert verify_checkpoint(directory, full=True).ok
    module = torch.nn.Module()
    module.register_buffer("w", torch.zeros(1536, 1024))
    load_checkpoint(directory, model=module, restore_rng=False)
    assert torch.equal(module.w, big["w"])
    _flip(_find(directory, "model.safetensors"))
    report = verify_checkpoint(directory, full=True)
    assert not report.ok and "sha256 is" in report.summary()
    with pytest.raises(CorruptCheckpointError, match="sha256 is"):
        load_checkpoint(directory, model=module, restore_rng=False)


def test_full_verification_checks_both_hashes_of_a_record_that_has_both(tmp_path):
    import dataclasses

    from hf_resumable.checkpoint.commit.manifest import Manifest

    save_checkpoint(tmp_path / "checkpoint-2", model={"w": torch.randn(1536, 1024)}, step=2, rng=False)
    directory = tmp_path / "checkpoint-2"
    manifest = read_manifest(directory)
    # A record whose xxh3-128 matches the bytes but whose sha256 does not: only full verification reads the sha256.
    files = {rel: dataclasses.replace(r, sha256="0" * 64) for rel, r in manifest.files.items()}
    (directory / "manifest.json").write_bytes(Manifest(files=files, step=2, format_version=1).to_json())
    assert verify_checkpoint(directory, full=False).ok
    report = verify_checkpoint(directory, full=True)
    assert not report.ok and "sha256 is" in report.summary()


@pytest.mark.parametrize("record", [{"size": 3}, {"size": 3, "sha256": None, "xxh3_128": None}])
def test_a_manifest_record_with_neither_hash_is_a_typed_error_naming_file_and_field(tmp_path, record):
    from hf_resumable.checkpoint.commit.manifest import _checksum

    save_checkpoint(tmp_path / "checkpoint-2", model={"w": torch.zeros(2)}, step=2, rng=False)
    directory = tmp_path / "checkpoint-2"
    document = json.loads((directory / "manifest.json").read_text())
    document["files"]["config.json"] = record
    document.pop("checksum")
    document["checksum"] = _checksum(document)  # resealed: only the record itself is wrong
    (directory / "manifest.json").write_text(json.dumps(document))
    with pytest.raises(CorruptCheckpointError, match=r"files\['config.json'\]\.xxh3_128") as raised:
        read_manifest(directory)
    assert "sha256" in str(raised.value) and str(directory) in str(raised.value)
    assert not verify_checkpoint(directory, full=True).ok
    assert find_latest_checkpoint(tmp_path) is None


@pytest.mark.parametrize("old", [1, 2])
def test_an_older_reader_refuses_a_new_manifest_with_its_typed_error(tmp_path, monkeypatch, old):
    """Readers of version 1 required a sha256 in every record, and readers of version 2 read pieces without checking
    their chunk hashes: a new manifest says version 3, which they refuse by its version (before reading any record)
    with FormatVersionError, rather than call the checkpoint corrupt or load it unchecked."""
    from hf_resumable.checkpoint.commit import manifest as manifest_module

    save_checkpoint(tmp_path / "checkpoint-2", model={"w": torch.zeros(2)}, step=2, rng=False)
    monkeypatch.setattr(manifest_module, "FORMAT_VERSION", old)  # the older reader's bound
    with pytest.raises(FormatVersionError, match=f"version 3; this hf_resumable .* reads versions 1..{old}. Upgrade"):
        read_manifest(tmp_path / "checkpoint-2")


def test_directory_without_manifest_is_never_a_checkpoint(tmp_path):
    _save_two(tmp_path)
    (tmp_path / "checkpoint-2" / "manifest.json").unlink()
    assert find_latest_checkpoint(tmp_path) == tmp_path / "checkpoint-1"
    with pytest.raises(IncompleteCheckpointError, match="not a committed checkpoint"):
        load_checkpoint(tmp_path / "checkpoint-2", model=tiny_gpt2())


def test_missing_shard_is_reported_by_name(tmp_path):
    _save_two(tmp_path)
    shard = _find(tmp_path / "checkpoint-2", "model-00002")
    shard.unlink()
    report = verify_checkpoint(tmp_path / "checkpoint-2", full=False)
    assert (shard.name, "missing") in report.problems
    with pytest.raises(IncompleteCheckpointError, match=shard.name):
        verify_checkpoint(tmp_path / "checkpoint-2", raise_on_error=True)


def _rewrite_manifest(directory, mutate):
    """An attacker who also rewrites the manifest consistently."""
    from hf_resumable.checkpoint.commit.manifest import Manifest
    from hf_resumable.format.safetensors_io import hash_file

    manifest = read_manifest(directory)
    files = dict(manifest.files)
    mutate(files)
    for rel in list(files):
        if (directory / rel).exists():
            files[rel] = hash_file(directory / rel)
    forged = Manifest(files=files, step=manifest.step)
    (directory / "manifest.json").write_bytes(forged.to_json())


class _Exploit:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_pickle_payload_in_place_of_a_shard_is_rejected_and_never_executed(tmp_path):
    _save_two(tmp_path)
    directory = tmp_path / "checkpoint-2"
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Exploit(marker))
    for rel in ("optimizer-00001-of-", "rng/rank-00000.safetensors"):
        _find(directory, rel).write_bytes(payload)
    (directory / "rng_state.pth").write_bytes(payload)  # a stock-Trainer file name, never opened
    _rewrite_manifest(directory, lambda files: None)
    with pytest.raises(CorruptCheckpointError):
        verify_checkpoint(directory, full=True, raise_on_error=True)
    model = tiny_gpt2()
    with pytest.raises(CorruptCheckpointError):
        load_checkpoint(directory, model=model, optimizer=torch.optim.AdamW(model.parameters()))
    assert not marker.exists()


def test_header_claiming_more_bytes_than_the_file_has(tmp_path):
    _save_two(tmp_path)
    shard = _find(tmp_path / "checkpoint-2", "model-00001")
    data = shard.read_bytes()
    header_len = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + header_len])
    name = next(k for k in header if k != "__metadata__")
    header[name]["data_offsets"][1] += 4096
    header[name]["shape"][0] += 4096  # consistent with itself, not with the file
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    shard.write_bytes(len(raw).to_bytes(8, "little") + raw + data[8 + header_len :])
    with pytest.raises(CorruptCheckpointError, match="header describes|claims"):
        read_header(shard)
    huge = (10**12).to_bytes(8, "little") + b"{}"
    shard.write_bytes(huge)
    with pytest.raises(CorruptCheckpointError, match="exceeds|claims"):
        read_header(shard)


def test_index_with_traversal_is_rejected(tmp_path):
    _save_two(tmp_path)
    directory = tmp_path / "checkpoint-2"
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = "../checkpoint-1/model-00001-of-00004.safetensors"
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    _rewrite_manifest(directory, lambda files: None)
    report = verify_checkpoint(directory, full=True)
    assert any("outside" in why for _, why in report.problems), report.problems
    with pytest.raises(UnsafeIndexError):
        load_checkpoint(directory, model=tiny_gpt2(), restore_rng=False)


def test_a_tensor_its_index_does_not_place_fails_verification_and_is_skipped(tmp_path):
    # A shard holds a tensor the index no longer names: verification refuses it (a load would not know what it is),
    # so a resume falls back to the previous checkpoint instead of failing inside the load.
    _save_two(tmp_path)
    directory = tmp_path / "checkpoint-2"
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    dropped = next(iter(index["weight_map"]))
    del index["weight_map"][dropped]
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    _rewrite_manifest(directory, lambda files: None)
    report = verify_checkpoint(directory, full=False)
    assert any("does not place there" in why and dropped in why for _, why in report.problems), report.problems
    assert find_latest_checkpoint(tmp_path) == tmp_path / "checkpoint-1"
    with pytest.raises(CorruptCheckpointError, match="does not place there"):
        load_checkpoint(directory, model=tiny_gpt2(), restore_rng=False)


def test_manifest_listing_a_path_outside_is_rejected(tmp_path):
    _save_two(tmp_path)
    directory = tmp_path / "checkpoint-2"
    document = json.loads((directory / "manifest.json").read_text())
    document["files"]["../../etc/passwd"] = {"size": 1, "sha256": "0" * 64}
    from hf_resumable.checkpoint.commit.manifest import _checksum

    document.pop("checksum")
    document["checksum"] = _checksum(document)
    (directory / "manifest.json").write_text(json.dumps(document))
    with pytest.raises(UnsafeIndexError, match="outside"):
        read_manifest(directory)


def test_foreign_or_future_manifest(tmp_path):
    _save_two(tmp_path)
    directory = tmp_path / "checkpoint-2"
    from hf_resumable.checkpoint.commit.manifest import _checksum

    document = json.loads((directory / "manifest.json").read_text())
    document.pop("checksum")
    document["format_version"] = 999
    document["checksum"] = _checksum(document)
    (directory / "manifest.json").write_text(json.dumps(document))
    with pytest.raises(FormatVersionError, match="999"):
        read_manifest(directory)
    (directory / "manifest.json").write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(CorruptCheckpointError, match="checksum|not an hf_resumable"):
        read_manifest(directory)


def test_injected_write_failure_loses_nothing(tmp_path, monkeypatch):
    model, optimizer = _save_two(tmp_path)
    before = {p: p.read_bytes() for p in (tmp_path / "checkpoint-2").rglob("*") if p.is_file()}
    calls = {"n": 0}
    real = _writer.write_safetensors

    def failing(path, tensors, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(28, "No space left on device")
        return real(path, tensors, **kwargs)

    monkeypatch.setattr(_writer, "write_safetensors", failing)
    with pytest.raises(OSError, match="No space"):
        save_checkpoint(tmp_path / "checkpoint-3", model=model, optimizer=optimizer, step=3, max_shard_size="16KB")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1", "checkpoint-2"]
    assert before == {p: p.read_bytes() for p in (tmp_path / "checkpoint-2").rglob("*") if p.is_file()}
    assert find_latest_checkpoint(tmp_path) == tmp_path / "checkpoint-2"


def _can_mount() -> bool:
    return os.geteuid() == 0 and subprocess.run(["which", "mount"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _can_mount(), reason="needs root to mount a small tmpfs")
def test_real_full_disk_loses_nothing(tmp_path):
    mount = tmp_path / "small"
    mount.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1200k", "tmpfs", str(mount)], capture_output=True)
    if result.returncode != 0:
        pytest.skip(f"mount refused: {result.stderr.decode().strip()}")
    try:
        small = {"w": torch.randn(64, 1024)}  # 256 KiB
        save_checkpoint(mount / "checkpoint-1", model=small, step=1)
        save_checkpoint(mount / "checkpoint-2", model=small, step=2)
        big = {"w": torch.randn(256, 1024)}  # 1 MiB: cannot fit next to the others
        with pytest.raises(OSError) as info:
            save_checkpoint(mount / "checkpoint-3", model=big, step=3)
        assert info.value.errno == 28 or "No space" in str(info.value)
        assert sorted(p.name for p in mount.iterdir()) == ["checkpoint-1", "checkpoint-2"]
        assert verify_checkpoint(mount / "checkpoint-2", full=True).ok
        module = torch.nn.Module()
        module.register_buffer("w", torch.zeros(64, 1024))
        load_checkpoint(mount / "checkpoint-2", model=module)
        assert torch.equal(module.w, small["w"])
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_retention_keeps_newest_best_and_never_touches_partials(tmp_path):
    model = tiny_gpt2()
    for step, loss in [(10, 3.0), (20, 1.0), (30, 2.0), (40, 2.5), (50, 2.2)]:
        save_checkpoint(tmp_path / f"checkpoint-{step}", model=model, step=step, metrics={"loss": loss}, rng=False)
    (tmp_path / "checkpoint-60").mkdir()  # a save in progress elsewhere: no manifest
    (tmp_path / "checkpoint-60" / "model.safetensors").write_bytes(b"partial")
    deleted = apply_retention(tmp_path, keep_last=2, best_metric="loss")
    assert sorted(p.name for p in deleted) == ["checkpoint-10", "checkpoint-30"]
    assert [p.name for _, p in list_checkpoints(tmp_path)] == ["checkpoint-20", "checkpoint-40", "checkpoint-50",
                                                               "checkpoint-60"]
    with pytest.raises(ValueError, match="keep_last"):
        apply_retention(tmp_path, keep_last=0)
    deleted = apply_retention(tmp_path, keep_last=1, protect=[tmp_path / "checkpoint-40"])
    assert [p.name for p in deleted] == ["checkpoint-20"]


def test_retention_orders_by_step_not_by_name(tmp_path):
    model = {"w": torch.zeros(2)}
    for step in (9000, 10000, 800):
        save_checkpoint(tmp_path / f"checkpoint-{step}", model=model, step=step, rng=False)
    apply_retention(tmp_path, keep_last=2)
    assert [p.name for _, p in list_checkpoints(tmp_path)] == ["checkpoint-9000", "checkpoint-10000"]


def test_retention_after_commit_through_save(tmp_path):
    model = tiny_gpt2()
    for step in range(1, 5):
        save_checkpoint(tmp_path / f"checkpoint-{step}", model=model, step=step, keep_last=2, rng=False)
    wait_for_pending_saves()  # retention follows the deferred fsyncs of each save
    assert [s for s, _ in list_checkpoints(tmp_path)] == [3, 4]


def test_stale_temp_dirs_are_cleaned(tmp_path):
    _save_two(tmp_path)
    me = current_owner()
    stale = tmp_path / member_name(TMP_PREFIX, "checkpoint-3", OwnerTag(me.host, 2**22 + 12345, 1))  # no such pid
    stale.mkdir()
    live = tmp_path / member_name(TMP_PREFIX, "checkpoint-4", me)
    live.mkdir()
    assert find_latest_checkpoint(tmp_path) == tmp_path / "checkpoint-2"
    assert not stale.exists() and live.exists()


def test_loaded_after_fallback_equals_saved(tmp_path):
    model, optimizer = _save_two(tmp_path)
    fresh = tiny_gpt2(seed=5)
    load_checkpoint(find_latest_checkpoint(tmp_path), model=fresh)
    assert_same_state(model.state_dict(), fresh.state_dict())
