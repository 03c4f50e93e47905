"""Property-based fuzzing of the checkpoint format (hypothesis, derandomized, bounded).

Each example mutates one file of a small, complete checkpoint (bytes, JSON structure and values, header
fields, sizes, file types, symlinks), optionally resealing the manifest the way an attacker who can write
the directory would, then runs every reader: ``verify_checkpoint``, ``find_latest_checkpoint`` (with a
valid older checkpoint to fall back to), ``load_checkpoint`` into live objects, ``LazyStateDict`` and the
CLI. Each must either succeed or raise an ``hf_resumable.errors`` type, within a time limit; a failed
load leaves model, optimizer, scheduler and RNG bitwise unchanged; an unresealed mutation is never
accepted, so a load that succeeds then restores exactly the saved state.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import random
import shutil
import struct
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_resumable.checkpoint import find_latest_checkpoint, load_checkpoint, save_checkpoint, verify_checkpoint
from hf_resumable.checkpoint.commit.manifest import _checksum
from hf_resumable.cli import main as cli_main
from hf_resumable.errors import HfResumableError
from hf_resumable.lazy import LazyStateDict

EXAMPLES = int(os.environ.get("HF_RESUMABLE_FUZZ_EXAMPLES", "60"))
TIME_LIMIT = 20.0  # seconds for all readers on one example


def _objects(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    return model, optimizer, scheduler


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fuzz") / "base"
    model, optimizer, scheduler = _objects(1)
    for _ in range(3):
        model(torch.randn(4, 6)).sum().backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    save_checkpoint(root, model=model, optimizer=optimizer, scheduler=scheduler, step=3,
                    training_state={"epoch": 1, "seen": 12}, extra={"note": "fuzz", "pair": (1, 2)},
                    data_state={"position": 5, "epoch": 1}, metrics={"loss": 0.5})
    return root


def _state(model, optimizer, scheduler) -> list:
    tensors = [t.detach().clone() for t in model.state_dict().values()]
    for state in optimizer.state.values():
        tensors += [v.clone() if isinstance(v, torch.Tensor) else v for _, v in sorted(state.items())]
    groups = json.dumps([{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups], default=str)
    return [tensors, groups, json.dumps(scheduler.state_dict(), default=str), torch.get_rng_state().clone(),
            random.getstate(), np.random.get_state()[1].copy()]


def _same(a: list, b: list) -> bool:
    tensors_a, tensors_b = a[0], b[0]
    if len(tensors_a) != len(tensors_b):
        return False
    for x, y in zip(tensors_a, tensors_b):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if isinstance(x, torch.Tensor):
            if x.shape != y.shape or x.dtype != y.dtype or not torch.equal(x, y):
                return False
        elif x != y:
            return False
    return a[1] == b[1] and a[2] == b[2] and torch.equal(a[3], b[3]) and a[4] == b[4] and np.array_equal(a[5], b[5])


# ------------------------------------------------------------------------------------------------ mutations
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)
SPECIAL = st.sampled_from([
    "DEEP", "HUGE_INT", "INF", "NEG", "NUL_NAME", "LONG_NAME", "TUPLE_MARKER", "TENSOR_MARKER", "DICT_MARKER",
    "DTYPE_MARKER", "LIST", "EMPTY_OBJECT", "BIG_SHAPE",
])


# Stands for 3000 nested lists, spliced into the serialized text (json.dumps itself cannot nest that deep).
DEEP_MARKER = "<deeply nested>"


def _dumps(document) -> str:
    return json.dumps(document).replace(json.dumps(DEEP_MARKER), "[" * 3000 + "]" * 3000)


def _special(kind: str):
    return {
        "DEEP": DEEP_MARKER, "HUGE_INT": 10**60, "INF": float("inf"), "NEG": -7,
        "NUL_NAME": "a\x00b", "LONG_NAME": "x" * 3000, "TUPLE_MARKER": {"__tuple__": 5},
        "TENSOR_MARKER": {"__tensor__": "nope"}, "DICT_MARKER": {"__dict__": [[1]]},
        "DTYPE_MARKER": {"__dtype__": "__class__"}, "LIST": [1, 2, 3], "EMPTY_OBJECT": {},
        "BIG_SHAPE": [2**62, 0],
    }[kind]


def _paths(document, prefix=()):
    yield prefix
    if isinstance(document, dict):
        for key, value in document.items():
            yield from _paths(value, prefix + (key,))
    elif isinstance(document, list):
        for i, value in enumerate(document):
            yield from _paths(value, prefix + (i,))


def _mutate_json(document, data) -> object:
    paths = list(_paths(document))
    path = data.draw(st.sampled_from(paths), label="json path")
    value = data.draw(JSON_VALUES | SPECIAL.map(_special), label="json value")
    delete = bool(path) and data.draw(st.booleans(), label="delete key")
    if not path:
        return value
    parent = document
    for key in path[:-1]:
        parent = parent[key]
    if delete and isinstance(parent, dict):
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return document


def _header_and_rest(raw: bytes) -> tuple[dict, bytes]:
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + length]), raw[8 + length:]


def _reseal(ckpt: Path, relpath: str) -> None:
    manifest = json.loads((ckpt / "manifest.json").read_text())
    path = ckpt / relpath
    if path.is_file() and not path.is_symlink():
        raw = path.read_bytes()
        manifest["files"][relpath] = {"size": len(raw), "sha256": hashlib.sha256(raw).hexdigest(),
                                      "xxh3_128": xxhash.xxh3_128(raw).hexdigest()}
    _write_manifest(ckpt, manifest)


def _write_manifest(ckpt: Path, manifest: dict) -> None:
    manifest.pop("checksum", None)
    manifest["checksum"] = _checksum(manifest)
    path = ckpt / "manifest.json"
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
    path.write_text(json.dumps(manifest))


def _apply(ckpt: Path, outside: Path, data) -> tuple[str, bool]:
    """Mutate one file of ``ckpt``; returns (description, resealed)."""
    files = sorted(json.loads((ckpt / "manifest.json").read_text())["files"]) + ["manifest.json"]
    relpath = data.draw(st.sampled_from(files), label="file")
    path = ckpt / relpath
    raw = path.read_bytes()
    kinds = ["flip", "truncate", "append", "filetype"]
    if relpath.endswith(".json"):
        kinds += ["json", "json"]
    if relpath.endswith(".safetensors"):
        kinds += ["header", "header"]
    kind = data.draw(st.sampled_from(kinds), label="kind")
    if kind == "flip":
        offset = data.draw(st.integers(0, len(raw) - 1), label="offset")
        mutated = bytearray(raw)
        mutated[offset] ^= data.draw(st.integers(1, 255), label="xor")
        path.write_bytes(bytes(mutated))
    elif kind == "truncate":
        path.write_bytes(raw[:data.draw(st.integers(0, len(raw) - 1), label="length")])
    elif kind == "append":
        path.write_bytes(raw + data.draw(st.binary(min_size=1, max_size=32), label="tail"))
    elif kind == "json":
        path.write_text(_dumps(_mutate_json(json.loads(raw), data)))
    elif kind == "header":
        header, rest = _header_and_rest(raw)
        new = _dumps(_mutate_json(header, data)).encode()
        new += b" " * (-len(new) % 8)
        path.write_bytes(struct.pack("<Q", len(new)) + new + rest)
    else:
        replacement = data.draw(st.sampled_from(["directory", "fifo", "symlink-outside", "symlink-device",
                                                 "delete"]), label="file type")
        kind = f"filetype:{replacement}"
        path.unlink()
        if replacement == "directory":
            path.mkdir()
        elif replacement == "fifo":
            os.mkfifo(path)
        elif replacement == "symlink-outside":
            outside.write_bytes(raw)
            path.symlink_to(outside)
        elif replacement == "symlink-device":
            path.symlink_to("/dev/zero")
    resealed = not kind.startswith("filetype") and data.draw(st.booleans(), label="reseal")
    if resealed:
        if relpath == "manifest.json":
            try:
                _write_manifest(ckpt, json.loads(path.read_text()))
            except (ValueError, UnicodeDecodeError, AttributeError, TypeError, RecursionError):
                resealed = False
        else:
            _reseal(ckpt, relpath)
    return f"{kind} {relpath}", resealed


def _expect_typed(operation, *args, **kwargs):
    """Run one reader: its result, or the HfResumableError it raised. Anything else fails the test."""
    try:
        return operation(*args, **kwargs)
    except HfResumableError as err:
        return err


@pytest.mark.timeout(900)
@settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                 HealthCheck.data_too_large])
@given(data=st.data())
def test_every_reader_either_succeeds_or_raises_a_typed_error(pristine, tmp_path_factory, data):
    root = tmp_path_factory.mktemp("case")
    shutil.copytree(pristine, root / "checkpoint-1")
    ckpt = root / "checkpoint-2"
    shutil.copytree(pristine, ckpt)
    what, resealed = _apply(ckpt, root.parent / f"{root.name}-outside.bin", data)
    started = time.monotonic()

    report = verify_checkpoint(ckpt, full=True)
    if not resealed:
        assert not report.ok, f"{what}: an unresealed mutation verified"

    latest = find_latest_checkpoint(root)
    assert latest in (root / "checkpoint-1", ckpt), what
    if latest == ckpt:
        assert report.ok, f"{what}: find_latest_checkpoint returned a checkpoint that does not verify"

    model, optimizer, scheduler = _objects(2)
    model(torch.randn(2, 6)).sum().backward()
    optimizer.step()
    before = _state(model, optimizer, scheduler)
    loaded = _expect_typed(load_checkpoint, ckpt, model=model, optimizer=optimizer, scheduler=scheduler,
                           verify="quick")
    if isinstance(loaded, HfResumableError):
        assert _same(before, _state(model, optimizer, scheduler)), f"{what}: a failed load changed live state"
    else:
        assert report.ok, f"{what}: load accepted a checkpoint that does not verify"
        if not resealed:
            reference, reference_optimizer, reference_scheduler = _objects(2)
            load_checkpoint(root / "checkpoint-1", model=reference, optimizer=reference_optimizer,
                            scheduler=reference_scheduler)
            assert _same(_state(reference, reference_optimizer, reference_scheduler),
                         _state(model, optimizer, scheduler)), what

    weights = _expect_typed(LazyStateDict.from_pretrained, ckpt)
    if not isinstance(weights, HfResumableError):
        for name in list(weights):
            _expect_typed(weights.__getitem__, name)

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        for command in ("verify", "inspect"):
            assert isinstance(cli_main([command, "--quiet", str(ckpt)]), int), what

    assert time.monotonic() - started < TIME_LIMIT, f"{what}: the readers took too long"
    shutil.rmtree(root, ignore_errors=True)
