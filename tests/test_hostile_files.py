"""Crafted checkpoint files: verify reports each (typed, naming the file), find_latest_checkpoint skips to the
previous valid checkpoint, nothing hangs, and save-side errors keep their builtin type.

One named regression test per case of issue "Nothing lost, nothing unclean", sections 3 and 5 (file side).
Several cases reseal the manifest (recompute the record and the manifest checksum), as an attacker who can
write the directory would, so that the bad bytes reach the parser instead of failing the hash check.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import struct
import subprocess
from pathlib import Path

import pytest
import torch
import xxhash

from hf_resumable.checkpoint import find_latest_checkpoint, load_checkpoint, save_checkpoint, verify_checkpoint
from hf_resumable.checkpoint.commit.manifest import _checksum
from hf_resumable.errors import (
    CheckpointExistsError,
    CorruptCheckpointError,
    HfResumableError,
    UnsafeIndexError,
)

pytestmark = pytest.mark.timeout(60)

SHARD = "model.safetensors"  # a model that fits in one shard, as save_pretrained writes it
RNG = "rng/rank-00000.safetensors"


def _model(value: float = 1.0) -> torch.nn.Module:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.fill_(value)
    return model


@pytest.fixture
def run(tmp_path: Path) -> Path:
    """``run/checkpoint-1`` (valid, the fallback) and ``run/checkpoint-2`` (the victim)."""
    root = tmp_path / "run"
    for step in (1, 2):
        model = _model(float(step))
        optimizer = torch.optim.AdamW(model.parameters())
        model(torch.ones(1, 4)).sum().backward()
        optimizer.step()
        save_checkpoint(root / f"checkpoint-{step}", model=model, optimizer=optimizer, step=step)
    return root


def _manifest(ckpt: Path) -> dict:
    return json.loads((ckpt / "manifest.json").read_text())


def _write_manifest(ckpt: Path, document: dict) -> None:
    document = {k: v for k, v in document.items() if k != "checksum"}
    document["checksum"] = _checksum(document)
    (ckpt / "manifest.json").write_text(json.dumps(document))


def _reseal(ckpt: Path, relpath: str, raw: bytes) -> None:
    """Replace a file and make the manifest agree with it (size and both hashes, and its own checksum)."""
    (ckpt / relpath).write_bytes(raw)
    document = _manifest(ckpt)
    document["files"][relpath] = {"size": len(raw), "sha256": hashlib.sha256(raw).hexdigest(),
                                  "xxh3_128": xxhash.xxh3_128(raw).hexdigest()}
    _write_manifest(ckpt, document)


def _with_header(path: Path, header: bytes) -> bytes:
    """The file at ``path`` with its safetensors header replaced by ``header`` (data section kept)."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return struct.pack("<Q", len(header)) + header + raw[8 + length:]


def _assert_skipped(run: Path, *, file: str | None = None, error: type = HfResumableError) -> None:
    report = verify_checkpoint(run / "checkpoint-2", full=False)
    assert not report.ok
    assert all(issubclass(t, HfResumableError) for t in report.error_types)
    assert any(issubclass(t, error) for t in report.error_types), report.error_types
    if file is not None:
        assert any(file in f or file in why for f, why in report.problems), report.problems
    assert find_latest_checkpoint(run) == run / "checkpoint-1"
    with pytest.raises(HfResumableError):
        load_checkpoint(run / "checkpoint-2", model=_model(0.0))


# ------------------------------------------------------------------------------------------- section 3
DEEP = b"[" * 100_000 + b"]" * 100_000


def test_manifest_with_deeply_nested_json_is_skipped(run):
    (run / "checkpoint-2" / "manifest.json").write_bytes(DEEP)
    _assert_skipped(run, file="manifest.json", error=CorruptCheckpointError)


def test_safetensors_header_with_deeply_nested_json_is_skipped(run):
    ckpt = run / "checkpoint-2"
    _reseal(ckpt, SHARD, _with_header(ckpt / SHARD, b'{"a":' + DEEP + b"}"))
    _assert_skipped(run, file=SHARD, error=CorruptCheckpointError)


def test_rng_header_with_deeply_nested_json_is_skipped(run):
    ckpt = run / "checkpoint-2"
    _reseal(ckpt, RNG, _with_header(ckpt / RNG, b'{"__metadata__":' + DEEP + b"}"))
    _assert_skipped(run, file=RNG, error=CorruptCheckpointError)


def test_manifest_with_a_5000_digit_integer_is_skipped(run):
    ckpt = run / "checkpoint-2"
    text = (ckpt / "manifest.json").read_text()
    size = _manifest(ckpt)["files"][SHARD]["size"]
    (ckpt / "manifest.json").write_text(text.replace(f'"size": {size}', '"size": ' + "9" * 5000, 1))
    _assert_skipped(run, file="manifest.json", error=CorruptCheckpointError)


@pytest.mark.parametrize("field_name", ["world_size", "step", "size"])
def test_manifest_with_infinity_where_an_int_belongs_is_skipped(run, field_name):
    ckpt = run / "checkpoint-2"
    document = _manifest(ckpt)
    if field_name == "size":
        document["files"][SHARD]["size"] = float("inf")
    else:
        document[field_name] = float("inf")
    _write_manifest(ckpt, document)
    _assert_skipped(run, file="manifest.json", error=CorruptCheckpointError)


@pytest.mark.parametrize("kept", [(), (SHARD,)], ids=["no-files", "no-training-state"])
def test_manifest_that_lists_no_checkpoint_is_skipped(run, kept):
    """An emptied manifest, resealed: it listed nothing to check, so it verified (quick and full) and was picked."""
    ckpt = run / "checkpoint-2"
    document = _manifest(ckpt)
    document["files"] = {name: record for name, record in document["files"].items() if name in kept}
    _write_manifest(ckpt, document)
    for full in (False, True):
        with pytest.raises(CorruptCheckpointError, match=r"manifest\.json.*no training_state\.json"):
            verify_checkpoint(ckpt, full=full, raise_on_error=True)
    _assert_skipped(run, file="manifest.json", error=CorruptCheckpointError)


@pytest.mark.parametrize("content", [b"9" * 5000, DEEP], ids=["5000-digit-integer", "deeply-nested"])
def test_training_state_that_does_not_parse_is_skipped(run, content):
    """Resealed, it passed its hash check; verification parses it (bounded), so the checkpoint is not picked."""
    _reseal(run / "checkpoint-2", "training_state.json", content)
    _assert_skipped(run, file="training_state.json", error=CorruptCheckpointError)


def test_header_with_infinity_in_a_shape_is_skipped(run):
    ckpt = run / "checkpoint-2"
    header = json.loads((ckpt / SHARD).read_bytes()[8:8 + struct.unpack("<Q", (ckpt / SHARD).read_bytes()[:8])[0]])
    name = next(k for k in header if k != "__metadata__")
    header[name]["shape"] = [float("inf")]
    _reseal(ckpt, SHARD, _with_header(ckpt / SHARD, json.dumps(header).encode()))
    _assert_skipped(run, file=SHARD, error=CorruptCheckpointError)


def test_manifest_that_is_a_directory_is_skipped(run):
    ckpt = run / "checkpoint-2"
    (ckpt / "manifest.json").unlink()
    (ckpt / "manifest.json").mkdir()
    _assert_skipped(run, file="manifest.json", error=CorruptCheckpointError)


def test_manifest_that_is_a_fifo_does_not_hang(run):
    ckpt = run / "checkpoint-2"
    (ckpt / "manifest.json").unlink()
    os.mkfifo(ckpt / "manifest.json")
    _assert_skipped(run, file="manifest.json", error=CorruptCheckpointError)


def test_listed_file_that_is_a_fifo_does_not_hang(run):
    ckpt = run / "checkpoint-2"
    (ckpt / "training_state.json").unlink()
    os.mkfifo(ckpt / "training_state.json")
    _assert_skipped(run, file="training_state.json", error=CorruptCheckpointError)


def test_manifest_entry_naming_a_directory_is_skipped(run):
    ckpt = run / "checkpoint-2"
    document = _manifest(ckpt)
    document["files"]["rng"] = dict(document["files"][RNG])
    _write_manifest(ckpt, document)
    _assert_skipped(run, file="rng", error=CorruptCheckpointError)


@pytest.mark.parametrize("name", ["rng/ra\x00nk.safetensors", "x" * 5000, "a/" * 600 + "b"],
                         ids=["nul-byte", "5000-characters", "1200-characters-deep"])
def test_manifest_entry_with_a_crafted_name_is_skipped(run, name):
    ckpt = run / "checkpoint-2"
    document = _manifest(ckpt)
    document["files"][name] = dict(document["files"][RNG])
    _write_manifest(ckpt, document)
    _assert_skipped(run, file="manifest.json", error=UnsafeIndexError)


def test_zero_size_tensor_with_a_huge_dimension_is_skipped(run):
    ckpt = run / "checkpoint-2"
    raw = (ckpt / SHARD).read_bytes()
    header = json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])
    end = max(entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__")
    header["empty"] = {"dtype": "F32", "shape": [2**63, 0], "data_offsets": [end, end]}
    _reseal(ckpt, SHARD, _with_header(ckpt / SHARD, json.dumps(header).encode()))
    _assert_skipped(run, file=SHARD, error=CorruptCheckpointError)


def test_every_case_of_one_root_is_skipped_in_one_search(tmp_path):
    """Several hostile candidates above a valid one: the search walks past all of them."""
    root = tmp_path / "run"
    save_checkpoint(root / "checkpoint-1", model=_model(), step=1)
    for step, mutate in ((2, "deep"), (3, "fifo"), (4, "dir")):
        ckpt = root / f"checkpoint-{step}"
        save_checkpoint(ckpt, model=_model(), step=step)
        (ckpt / "manifest.json").unlink()
        if mutate == "deep":
            (ckpt / "manifest.json").write_bytes(DEEP)
        elif mutate == "fifo":
            os.mkfifo(ckpt / "manifest.json")
        else:
            (ckpt / "manifest.json").mkdir()
    assert find_latest_checkpoint(root) == root / "checkpoint-1"


# ------------------------------------------------------------------------------------------- section 5
def test_symlink_leading_outside_the_checkpoint_is_refused(run, tmp_path):
    """Same bytes, so every hash matches: only the link itself is wrong."""
    ckpt = run / "checkpoint-2"
    outside = tmp_path / "elsewhere.json"
    outside.write_bytes((ckpt / "training_state.json").read_bytes())
    (ckpt / "training_state.json").unlink()
    (ckpt / "training_state.json").symlink_to(outside)
    _assert_skipped(run, file="training_state.json", error=UnsafeIndexError)


def test_symlinked_shard_directory_leading_outside_is_refused(run, tmp_path):
    ckpt = run / "checkpoint-2"
    outside = tmp_path / "rng-elsewhere"
    (ckpt / "rng").rename(outside)
    (ckpt / "rng").symlink_to(outside, target_is_directory=True)
    _assert_skipped(run, file=RNG, error=UnsafeIndexError)


def test_symlink_to_the_checkpoint_directory_itself_is_fine(run, tmp_path):
    latest = tmp_path / "latest"
    latest.symlink_to(run / "checkpoint-2", target_is_directory=True)
    assert verify_checkpoint(latest, full=True).ok
    load_checkpoint(latest, model=_model(0.0))


def _read_only_mount(tmp_path: Path) -> Path | None:
    mount = tmp_path / "ro"
    mount.mkdir()
    if os.geteuid() != 0:
        return None
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(mount)], capture_output=True)
    return mount if result.returncode == 0 else None


def test_read_only_filesystem_is_an_oserror_with_erofs(tmp_path, monkeypatch):
    mount = _read_only_mount(tmp_path)
    try:
        if mount is None:  # no root / no mount here: make the kernel's answer the same way the VFS would
            mount = tmp_path / "ro"
            real_mkdir = os.mkdir

            def read_only(path, *args, **kwargs):
                if str(path).startswith(str(mount)):
                    raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
                return real_mkdir(path, *args, **kwargs)

            monkeypatch.setattr(os, "mkdir", read_only)
        with pytest.raises(OSError) as raised:
            save_checkpoint(mount / "checkpoint-1", model=_model(), step=1)
        assert raised.value.errno == errno.EROFS and not isinstance(raised.value, RuntimeError)
    finally:
        subprocess.run(["umount", str(tmp_path / "ro")], capture_output=True)


@pytest.mark.parametrize("overwrite", [False, True])
def test_target_that_is_an_existing_file_says_so_and_leaves_nothing_behind(tmp_path, overwrite):
    target = tmp_path / "checkpoint-1"
    target.write_bytes(b"user data")
    with pytest.raises(CheckpointExistsError, match="is a file"):
        save_checkpoint(target, model=_model(), step=1, overwrite=overwrite)
    assert target.read_bytes() == b"user data"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1"]


def test_overwrite_never_replaces_a_directory_we_did_not_write(tmp_path):
    target = tmp_path / "checkpoint-4"
    target.mkdir()
    (target / "optimizer.pt").write_bytes(b"stock Trainer state")
    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in target.iterdir()}
    with pytest.raises(CheckpointExistsError, match="did not write"):
        save_checkpoint(target, model=_model(), step=4, overwrite=True)
    assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in target.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-4"]


def test_overwrite_replaces_an_empty_directory_and_our_own_checkpoint(tmp_path):
    target = tmp_path / "latest"
    target.mkdir()
    save_checkpoint(target, model=_model(1.0), step=1, overwrite=True)
    save_checkpoint(target, model=_model(2.0), step=2, overwrite=True)
    model = _model(0.0)
    assert load_checkpoint(target, model=model).step == 2
    assert all(bool((p == 2.0).all()) for p in model.parameters())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"]


def test_overwrite_never_deletes_files_added_to_a_committed_checkpoint(tmp_path):
    target = tmp_path / "checkpoint-1"
    save_checkpoint(target, model=_model(1.0), step=1)
    (target / "eval_results.json").write_text('{"accuracy": 0.9}')  # an eval watcher's output
    (target / "notes").mkdir()
    with pytest.raises(CheckpointExistsError, match="eval_results.json"):
        save_checkpoint(target, model=_model(2.0), step=1, overwrite=True)
    assert (target / "eval_results.json").read_text() == '{"accuracy": 0.9}' and (target / "notes").is_dir()
    model = _model(0.0)
    load_checkpoint(target, model=model)
    assert all(bool((p == 1.0).all()) for p in model.parameters())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1"]


def test_one_check_decides_where_a_save_may_go(tmp_path):
    """save_refusal is the one "may a save go here" answer: save_checkpoint (check_target) and
    ResumableAccelerator.save_state (explicit output_dir) both ask it."""
    from hf_resumable.checkpoint.commit._writer import check_target, save_refusal

    assert save_refusal(tmp_path / "missing", overwrite=False) is None
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "overwrite=True" in save_refusal(empty, overwrite=False)
    assert save_refusal(empty, overwrite=True) is None and check_target(empty, overwrite=True) is not None
    stock = tmp_path / "stock"
    stock.mkdir()
    (stock / "random_states_0.pkl").write_bytes(b"x")
    assert "stock accelerate (random_states_0.pkl)" in save_refusal(stock, overwrite=True)
    with pytest.raises(CheckpointExistsError, match="stock accelerate"):
        check_target(stock, overwrite=True)
