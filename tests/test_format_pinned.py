"""The on-disk format is pinned: a committed checkpoint written by hf_resumable 0.1.0 (format version 1) loads
bit-exactly with today's code, and every safetensors file we write is read bit-identically by the
``safetensors`` library itself. The same checkpoint under a manifest of the oldest form (format version 1, records of
size and sha256 only: ``fixtures/golden-v1-manifest-sha256-only.json``) verifies and loads too, checked by sha256.

If ``test_golden_v1_checkpoint_loads_bit_exactly`` fails, a change broke existing users' checkpoints: fix the
reader (or add a migration), never the fixture (tests/fixtures/make_golden_checkpoint.py refuses to rewrite it).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import GPT2Config, GPT2LMHeadModel

from hf_resumable.checkpoint import load_checkpoint, read_manifest, save_checkpoint, verify_checkpoint
from hf_resumable.errors import CorruptCheckpointError
from hf_resumable.format.safetensors_io import read_safetensors

GOLDEN = Path(__file__).parent / "fixtures" / "golden-v1"
SHA256_ONLY_MANIFEST = Path(__file__).parent / "fixtures" / "golden-v1-manifest-sha256-only.json"


def _digest(tensor: torch.Tensor) -> str:
    import hashlib

    flat = tensor.detach().contiguous().reshape(-1)  # 1-d, so viewing as bytes works for 0-d tensors too
    data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return f"{str(tensor.dtype).removeprefix('torch.')}:{list(tensor.shape)}:{hashlib.sha256(data).hexdigest()}"


@pytest.fixture
def golden(tmp_path: Path) -> Path:
    copy = tmp_path / "golden" / "checkpoint-3"
    shutil.copytree(GOLDEN / "checkpoint-3", copy)
    return copy


def _fresh(directory: Path):
    torch.manual_seed(0)  # different initial weights than the fixture's
    model = GPT2LMHeadModel(GPT2Config.from_pretrained(directory))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.5, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=7, gamma=0.9)
    return model, optimizer, scheduler


def test_golden_v1_checkpoint_verifies(golden):
    report = verify_checkpoint(golden, full=True)
    assert report.ok, report.summary()
    assert read_manifest(golden).format_version == 1 and read_manifest(golden).step == 3


def test_golden_v1_checkpoint_loads_bit_exactly(golden):
    expected = json.loads((GOLDEN / "expected.json").read_text())
    model, optimizer, scheduler = _fresh(golden)
    loaded = load_checkpoint(golden, model=model, optimizer=optimizer, scheduler=scheduler)
    _assert_loaded_bit_exactly(expected, loaded, model, optimizer, scheduler)


def _assert_loaded_bit_exactly(expected: dict, loaded, model, optimizer, scheduler) -> None:
    """Every tensor, the param groups, scheduler, training state, extras, data position and RNG are as saved."""
    assert loaded.step == expected["step"]
    assert {n: _digest(t) for n, t in model.state_dict().items()} == expected["model"]
    names = {id(p): n for n, p in model.named_parameters()}
    optimizer_state = {f"{names[id(p)]}/{key}": _digest(value) if isinstance(value, torch.Tensor) else value
                       for p, state in optimizer.state.items() for key, value in sorted(state.items())}
    assert optimizer_state == expected["optimizer"]
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    assert json.loads(json.dumps(groups)) == expected["param_groups"]
    assert json.loads(json.dumps(scheduler.state_dict())) == expected["scheduler"]
    assert loaded.training_state == expected["training_state"]
    assert json.loads(json.dumps(loaded.extra)) == expected["extra"]
    assert loaded.data_state == expected["data_state"]
    assert torch.rand(3).tolist() == expected["rng_probe"]  # the stored RNG state was restored


def test_golden_v1_with_a_sha256_only_manifest_verifies_loads_and_catches_a_flip_by_sha256(golden):
    shutil.copyfile(SHA256_ONLY_MANIFEST, golden / "manifest.json")
    manifest = read_manifest(golden)
    assert manifest.format_version == 1
    assert all(r.sha256 is not None and r.xxh3_128 is None for r in manifest.files.values())
    assert verify_checkpoint(golden, full=True).ok
    expected = json.loads((GOLDEN / "expected.json").read_text())
    model, optimizer, scheduler = _fresh(golden)
    load_checkpoint(golden, model=model, optimizer=optimizer, scheduler=scheduler)
    assert {n: _digest(t) for n, t in model.state_dict().items()} == expected["model"]
    shard = golden / "optimizer-00001-of-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0x10
    shard.write_bytes(bytes(data))
    report = verify_checkpoint(golden, full=True)
    assert not report.ok and "optimizer-00001-of-00001.safetensors: sha256 is" in report.summary()
    model, optimizer, scheduler = _fresh(golden)
    with pytest.raises(CorruptCheckpointError, match="sha256 is"):
        load_checkpoint(golden, model=model, optimizer=optimizer, scheduler=scheduler, verify="quick")


def test_golden_v1_weights_load_with_transformers_from_pretrained(golden):
    expected = json.loads((GOLDEN / "expected.json").read_text())
    model = GPT2LMHeadModel.from_pretrained(golden)
    assert {n: _digest(t) for n, t in model.state_dict().items()} == expected["model"]


def _all_safetensors(directory: Path) -> list[Path]:
    return sorted(directory.rglob("*.safetensors"))


@pytest.mark.parametrize("source", ["golden", "fresh"])
def test_safetensors_library_reads_our_files_bit_identically(golden, tmp_path, source):
    if source == "fresh":
        model, optimizer, scheduler = _fresh(golden)
        model.to(torch.bfloat16)
        ids = torch.arange(16).reshape(2, 8)
        model(ids, labels=ids).loss.backward()
        optimizer.step()
        directory = tmp_path / "fresh"
        save_checkpoint(directory, model=model, optimizer=optimizer, scheduler=scheduler, step=1,
                        extra={"t": torch.arange(5, dtype=torch.int16)}, max_shard_size="8KB")
    else:
        directory = golden
    files = _all_safetensors(directory)
    assert len(files) >= 3
    for path in files:
        theirs = load_file(path)
        ours = read_safetensors(path)
        assert theirs.keys() == ours.keys(), path
        for name in theirs:
            assert theirs[name].dtype == ours[name].dtype and theirs[name].shape == ours[name].shape
            assert _digest(theirs[name]) == _digest(ours[name]), (path, name)
        with safe_open(path, framework="pt") as handle:
            assert handle.metadata() is not None and set(handle.keys()) == set(theirs)


GOLDEN_V2 = Path(__file__).parent / "fixtures" / "golden"


@pytest.fixture(params=["regular", "pieces"])
def golden_v2(request, tmp_path: Path) -> tuple[str, Path]:
    copy = tmp_path / request.param / "checkpoint-3"
    shutil.copytree(GOLDEN_V2 / request.param / "checkpoint-3", copy)
    return request.param, copy


def test_golden_v2_checkpoints_of_both_layouts_verify_and_load_bit_exactly(golden_v2):
    """Format version 2 (file records without chunk hashes), in the regular and in the per-rank piece layout
    (tests/fixtures/golden/make_golden.py): they verify, and load into fresh objects bit-exactly."""
    from hf_resumable.checkpoint import load_checkpoint

    layout, directory = golden_v2
    assert read_manifest(directory).format_version == 2
    assert verify_checkpoint(directory, full=True).ok
    expected = json.loads((GOLDEN_V2 / "expected.json").read_text())
    model, optimizer, scheduler = _fresh(directory)
    load = load_checkpoint
    loaded = load(directory, model=model, optimizer=optimizer, scheduler=scheduler)
    _assert_loaded_bit_exactly(expected, loaded, model, optimizer, scheduler)


def test_golden_v2_piece_checkpoint_refuses_a_flipped_byte_in_its_data(golden_v2):
    """A flipped byte in the data of a version 2 checkpoint of either layout is refused, naming the file (its small
    files are hashed whole by the quick verification; test_verified_reads.py covers a large file of version 2)."""
    from hf_resumable.checkpoint import load_checkpoint

    layout, directory = golden_v2
    relpath = "optimizer-00001-of-00001.safetensors" if layout == "regular" else \
        "sharded/optimizer-rank00000-of-00001.safetensors"
    data = bytearray((directory / relpath).read_bytes())
    data[len(data) // 2] ^= 0x01
    (directory / relpath).write_bytes(bytes(data))
    model, optimizer, scheduler = _fresh(directory)
    load = load_checkpoint
    with pytest.raises(CorruptCheckpointError, match=relpath.replace("/", ".")):
        load(directory, model=model, optimizer=optimizer, scheduler=scheduler)
