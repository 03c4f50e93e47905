"""Validate everything before applying anything (issue 11, section 4).

Each test takes a valid checkpoint, rewrites one file as a buggy writer or an attacker would and reseals
the manifest with consistent hashes (so verification passes), then loads it into live objects that
already hold other state. The load must raise ONE typed ``hf_resumable`` error naming the file and the
field, and leave model, optimizer, scheduler, scaler and every RNG bitwise unchanged.
"""

from __future__ import annotations

import copy
import json
import os
import random

import numpy as np
import pytest
import torch

from hf_resumable.checkpoint import load_checkpoint, open_checkpoint, read_manifest, save_checkpoint
from hf_resumable.checkpoint.commit.manifest import Manifest
from hf_resumable.constants import MODEL_INDEX_FILE, OPTIMIZER_INDEX_FILE, TRAINING_STATE_FILE
from hf_resumable.errors import (
    CheckpointMismatchError,
    CorruptCheckpointError,
    FormatVersionError,
    HfResumableError,
)
from hf_resumable.format.rng import RngState, capture_rng_state, save_rng_state
from hf_resumable.format.safetensors_io import hash_file, read_header, read_safetensors, write_safetensors

from helpers.tiny_models import tiny_gpt2, train_steps

RNG_FILE = "rng/rank-00000.safetensors"
DATA_FILE = "data/rank-00000.json"


def _objects(seed: int):
    model = tiny_gpt2(seed=seed, n_positions=128)  # wpe has the shape of wte (for the aliasing case)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** (seed + 4))
    train_steps(model, optimizer, scheduler, steps=2 + seed, seed=seed)
    return model, optimizer, scheduler, scaler


@pytest.fixture
def checkpoint(tmp_path):
    model, optimizer, scheduler, scaler = _objects(0)
    path = tmp_path / "checkpoint-2"
    save_checkpoint(path, model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler, step=2,
                    training_state={"global_step": 2}, data_state={"kind": "map", "epoch": 0, "step": 4,
                                                                   "num_batches": 8}, max_shard_size="64KB")
    return path


@pytest.fixture
def live():
    """Objects with state of their own (an optimizer that has stepped), so any partial load would show."""
    return _objects(1)


def _snapshot(model, optimizer, scheduler, scaler):
    return (copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict()),
            copy.deepcopy(scheduler.state_dict()), copy.deepcopy(scaler.state_dict()),
            capture_rng_state(), [id(p) for p in model.parameters()],
            {id(p): {k: v.data_ptr() for k, v in s.items() if torch.is_tensor(v)} for p, s in optimizer.state.items()})


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, RngState):
        return a.equals(b)
    return a == b


def assert_refused(path, live, error, *match, **kwargs):
    """Load ``path`` into ``live``: ``error`` (naming every ``match``) and every live object bitwise unchanged."""
    model, optimizer, scheduler, scaler = live
    before = _snapshot(*live)
    with pytest.raises(error) as info:
        load_checkpoint(path, model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler, **kwargs)
    assert isinstance(info.value, HfResumableError)
    for text in match:
        assert text in str(info.value), (text, str(info.value))
    after = _snapshot(*live)
    for part, (a, b) in enumerate(zip(before, after)):
        assert _same(a, b), f"live object {part} changed"
    return info.value


def reseal(path, relpath, content: bytes | None = None):
    """Replace ``relpath`` (if given) and rewrite the manifest with consistent hashes, as an attacker could."""
    if content is not None:
        (path / relpath).unlink()
        (path / relpath).write_bytes(content)
    manifest = read_manifest(path)
    files = {rel: hash_file(path / rel) for rel in manifest.files}
    (path / "manifest.json").write_bytes(Manifest(files=files, step=manifest.step, world_size=manifest.world_size,
                                                  metrics=manifest.metrics).to_json())


def edit_json(path, relpath, mutate):
    """Change the JSON document ``relpath`` in place with ``mutate`` (its return value is ignored) and reseal."""
    document = json.loads((path / relpath).read_bytes())
    mutate(document)
    reseal(path, relpath, json.dumps(document).encode())


def edit_tensors(path, relpath, mutate):
    header = read_header(path / relpath)
    tensors = read_safetensors(path / relpath)
    mutate(tensors)
    (path / relpath).unlink()
    write_safetensors(path / relpath, list(tensors.items()), metadata=header.metadata)
    reseal(path, relpath)


def _optimizer_file(path, tensor):
    return json.loads((path / OPTIMIZER_INDEX_FILE).read_text())["weight_map"][tensor]


def test_the_untouched_check_itself_sees_a_partial_load(checkpoint, live):
    # The assertion helper must be able to fail: a valid load changes every part it checks.
    model, optimizer, scheduler, scaler = live
    before = _snapshot(*live)
    load_checkpoint(checkpoint, model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler)
    after = _snapshot(*live)
    assert not any(_same(a, b) for a, b in zip(before[:5], after[:5]))


def test_codec_tuple_marker_with_a_number(checkpoint, live):
    edit_json(checkpoint, TRAINING_STATE_FILE, lambda d: d["scheduler"].update(base_lrs={"__tuple__": 5}))
    assert_refused(checkpoint, live, CorruptCheckpointError, TRAINING_STATE_FILE, "scheduler/base_lrs",
                   '{"__tuple__": [items]}')


@pytest.mark.slow
def test_codec_markers_of_every_kind(checkpoint, live):
    for bad, expected in (({"__dict__": [[1]]}, "[[key, value]"), ({"__tensor__": 3}, '"__tensor__": "<name>"'),
                          ({"__tensor__": "nope"}, "'nope' is referenced but not stored"),
                          ({"__dtype__": "onnx"}, "torch dtype name"), ({"__tuple__": [], "x": 1}, "single-key")):
        edit_json(checkpoint, TRAINING_STATE_FILE, lambda d: d["extra"].update(bad=bad))
        assert_refused(checkpoint, live, CorruptCheckpointError, "extra/bad", expected)


@pytest.mark.slow
def test_training_state_that_is_a_list(checkpoint, live):
    document = json.loads((checkpoint / TRAINING_STATE_FILE).read_bytes())
    reseal(checkpoint, TRAINING_STATE_FILE, json.dumps([document]).encode())
    assert_refused(checkpoint, live, CorruptCheckpointError, TRAINING_STATE_FILE, "a JSON object")


@pytest.mark.slow
def test_training_state_parts_of_the_wrong_type_and_a_newer_format(checkpoint, live):
    edit_json(checkpoint, TRAINING_STATE_FILE, lambda d: d.update(progress=[1, 2]))
    assert_refused(checkpoint, live, CorruptCheckpointError, "progress", "a JSON object")
    edit_json(checkpoint, TRAINING_STATE_FILE, lambda d: d.update(progress={}, format_version=99))
    assert_refused(checkpoint, live, FormatVersionError, "format_version 99")


def test_missing_param_groups(checkpoint, live):
    edit_json(checkpoint, TRAINING_STATE_FILE, lambda d: d["optimizer"].pop("param_groups"))
    assert_refused(checkpoint, live, CorruptCheckpointError, "optimizer/param_groups", "a list of param-group")


@pytest.mark.slow
def test_param_group_params_that_are_not_names_or_repeat(checkpoint, live):
    edit_json(checkpoint, TRAINING_STATE_FILE, lambda d: d["optimizer"]["param_groups"][0].update(params=[0, 1]))
    assert_refused(checkpoint, live, CorruptCheckpointError, "param_groups/0/params", "parameter names")
    edit_json(checkpoint, TRAINING_STATE_FILE,
              lambda d: d["optimizer"]["param_groups"][0].update(params=["transformer.wte.weight"] * 2))
    assert_refused(checkpoint, live, CorruptCheckpointError, "each parameter in one group only")


@pytest.mark.slow
def test_hyperparameter_of_the_wrong_kind(checkpoint, live):
    edit_json(checkpoint, TRAINING_STATE_FILE, lambda d: d["optimizer"]["param_groups"][0].update(lr="fast",
                                                                                                 amsgrad=1))
    assert_refused(checkpoint, live, CheckpointMismatchError, "param_groups/0/lr", "param_groups/0/amsgrad")


@pytest.mark.slow
def test_tied_metadata_that_aliases_two_stored_tensors(checkpoint, live):
    def alias(document):
        document["metadata"]["hf_resumable_tied"]["transformer.wpe.weight"] = "transformer.wte.weight"

    edit_json(checkpoint, MODEL_INDEX_FILE, alias)
    error = assert_refused(checkpoint, live, CorruptCheckpointError, MODEL_INDEX_FILE, "transformer.wpe.weight",
                           "two stored tensors would alias")
    assert "hf_resumable_tied" in str(error)


@pytest.mark.slow
def test_tied_metadata_pointing_nowhere_or_malformed(checkpoint, live):
    edit_json(checkpoint, MODEL_INDEX_FILE, lambda d: d["metadata"].update(hf_resumable_tied={"lm_head.weight": "x"}))
    assert_refused(checkpoint, live, CorruptCheckpointError, "'x', which is not a stored tensor")
    edit_json(checkpoint, MODEL_INDEX_FILE, lambda d: d["metadata"].update(hf_resumable_tied=["lm_head.weight"]))
    assert_refused(checkpoint, live, CorruptCheckpointError, "hf_resumable_tied")


@pytest.mark.slow
def test_optimizer_state_of_the_wrong_shape(checkpoint, live):
    name = "state/transformer.h.0.attn.c_attn.weight/exp_avg"
    edit_tensors(checkpoint, _optimizer_file(checkpoint, name), lambda t: t.update({name: t[name].t().contiguous()}))
    assert_refused(checkpoint, live, CheckpointMismatchError, name, "[96, 32]", "[32, 96]")


def test_optimizer_state_of_the_wrong_dtype_or_naming_no_parameter(checkpoint, live):
    name = "state/transformer.h.0.attn.c_attn.weight/exp_avg_sq"
    edit_tensors(checkpoint, _optimizer_file(checkpoint, name), lambda t: t.update({name: t[name].double()}))
    assert_refused(checkpoint, live, CheckpointMismatchError, name, "torch.float64")
    index = json.loads((checkpoint / OPTIMIZER_INDEX_FILE).read_text())
    index["weight_map"].pop(name)
    index["weight_map"]["state/no.such.param/exp_avg"] = shard = _optimizer_file(checkpoint, name)
    reseal(checkpoint, OPTIMIZER_INDEX_FILE, json.dumps(index).encode())
    edit_tensors(checkpoint, shard, lambda t: t.update({"state/no.such.param/exp_avg": t.pop(name).float()}))
    assert_refused(checkpoint, live, CheckpointMismatchError, "state/no.such.param/exp_avg", "names no parameter")


@pytest.mark.slow
def test_scheduler_keys_that_would_become_arbitrary_attributes(checkpoint, live):
    edit_json(checkpoint, TRAINING_STATE_FILE, lambda d: d["scheduler"].update(__class__="int", optimizer=None))
    error = assert_refused(checkpoint, live, CheckpointMismatchError, "scheduler/__class__", "scheduler/optimizer")
    assert "not in the live state_dict()" in str(error)
    model, optimizer, scheduler, scaler = live
    assert type(scheduler) is torch.optim.lr_scheduler.StepLR and scheduler.optimizer is optimizer


@pytest.mark.slow
def test_scheduler_and_scaler_values_of_the_wrong_kind_or_missing(checkpoint, live):
    edit_json(checkpoint, TRAINING_STATE_FILE, lambda d: d["scheduler"].update(last_epoch=1.5))
    assert_refused(checkpoint, live, CheckpointMismatchError, "scheduler/last_epoch", "an int >= -1")
    edit_json(checkpoint, TRAINING_STATE_FILE, lambda d: d["scheduler"].update(last_epoch=2) or
              d["scaler"].pop("_growth_tracker"))
    assert_refused(checkpoint, live, CheckpointMismatchError, "scaler/_growth_tracker", "not in the checkpoint")


@pytest.mark.slow
def test_data_position_past_the_end(checkpoint, live):
    edit_json(checkpoint, DATA_FILE, lambda d: d.update(step=9))
    assert_refused(checkpoint, live, CorruptCheckpointError, DATA_FILE, "step: 9 is past the end of an epoch of 8")


def test_data_position_counters_that_are_negative_or_not_ints(checkpoint, live):
    # A position of another kind is the caller's own record (checked by its loader) and loads as saved.
    edit_json(checkpoint, DATA_FILE, lambda d: d.update(kind="tape", step=-1))
    assert load_checkpoint(checkpoint, model=live[0]).data_state["step"] == -1
    for field, value in (("epoch", -1), ("step", 2.5), ("num_batches", "8")):
        edit_json(checkpoint, DATA_FILE, lambda d: d.update({"kind": "map", "epoch": 0, "step": 4, "num_batches": 8,
                                                             field: value}))
        assert_refused(checkpoint, live, CorruptCheckpointError, DATA_FILE, field)


def test_bad_python_rng_state_is_refused_before_model_and_optimizer_are_filled(checkpoint, live):
    state = capture_rng_state()
    version, internal, gauss = state.python
    bad = RngState((version, internal[:-1] + (10**6,), gauss), state.numpy, state.torch_cpu)
    (checkpoint / RNG_FILE).unlink()
    save_rng_state(checkpoint / RNG_FILE, bad)
    reseal(checkpoint, RNG_FILE)
    assert_refused(checkpoint, live, CorruptCheckpointError, RNG_FILE, "python")


def test_bad_torch_rng_state_is_refused_before_model_and_optimizer_are_filled(checkpoint, live):
    state = capture_rng_state()
    (checkpoint / RNG_FILE).unlink()
    save_rng_state(checkpoint / RNG_FILE, RngState(state.python, state.numpy, torch.zeros_like(state.torch_cpu)))
    reseal(checkpoint, RNG_FILE)
    assert_refused(checkpoint, live, CorruptCheckpointError, RNG_FILE, "torch_cpu", "Invalid mt19937 state")


def test_numpy_rng_position_out_of_range(checkpoint, live):
    state = capture_rng_state()
    kind, keys, _pos, has_gauss, cached = state.numpy
    (checkpoint / RNG_FILE).unlink()
    save_rng_state(checkpoint / RNG_FILE, RngState(state.python, (kind, keys, 9999, has_gauss, cached),
                                                   state.torch_cpu))
    reseal(checkpoint, RNG_FILE)
    assert_refused(checkpoint, live, CorruptCheckpointError, RNG_FILE, "numpy")


def test_negative_or_non_integer_steps(checkpoint, live):
    edit_json(checkpoint, TRAINING_STATE_FILE, lambda d: d["progress"].update(global_step=-3))
    assert_refused(checkpoint, live, CorruptCheckpointError, "progress/global_step", "non-negative int")
    edit_json(checkpoint, TRAINING_STATE_FILE, lambda d: d["progress"].update(global_step=2.5))
    assert_refused(checkpoint, live, CorruptCheckpointError, "progress/global_step")


def test_negative_manifest_step(checkpoint, live):
    manifest = read_manifest(checkpoint)
    (checkpoint / "manifest.json").write_bytes(Manifest(files=manifest.files, step=-1).to_json())
    assert_refused(checkpoint, live, CorruptCheckpointError, "manifest.json", "step", "-1")


@pytest.mark.slow
@pytest.mark.parametrize("value", [-1.0, 2.5, float("nan")])
def test_optimizer_step_that_is_negative_or_not_whole(checkpoint, live, value):
    name = "state/transformer.h.1.mlp.c_fc.bias/step"
    edit_tensors(checkpoint, _optimizer_file(checkpoint, name), lambda t: t.update({name: torch.tensor(value)}))
    assert_refused(checkpoint, live, CorruptCheckpointError, name, "non-negative whole number")


def test_caller_named_counters_are_checked(checkpoint, live):
    edit_json(checkpoint, TRAINING_STATE_FILE, lambda d: d["progress"].update(loop={"initial_global_step": -1}))
    load_checkpoint(checkpoint, model=live[0])  # not a counter unless the caller says so
    with pytest.raises(CorruptCheckpointError, match="progress/loop/initial_global_step"):
        open_checkpoint(checkpoint, counters=["loop/initial_global_step"])


@pytest.mark.slow
def test_header_tensor_that_the_index_does_not_list(checkpoint, live):
    index = json.loads((checkpoint / MODEL_INDEX_FILE).read_text())
    shard = index["weight_map"]["transformer.wte.weight"]
    edit_tensors(checkpoint, shard, lambda t: t.update({"smuggled": torch.zeros(3)}))
    assert_refused(checkpoint, live, CorruptCheckpointError, shard, "smuggled")


def _big_checkpoint(tmp_path):
    """A model whose single file (model.safetensors) is above the quick-verification hash limit (checked while
    read)."""
    model = tiny_gpt2(n_embd=256, n_layer=2, n_head=4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)
    train_steps(model, optimizer, scheduler, steps=1)
    path = tmp_path / "checkpoint-1"
    save_checkpoint(path, model=model, optimizer=optimizer, scheduler=scheduler, step=1)
    assert not (path / MODEL_INDEX_FILE).exists()
    shard = path / "model.safetensors"
    assert shard.stat().st_size > 4 * 2**20
    with open(shard, "r+b") as f:  # flip one byte of the last tensor
        f.seek(-100, os.SEEK_END)
        byte = f.read(1)
        f.seek(-100, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0x01]))
    other = tiny_gpt2(seed=1, n_embd=256, n_layer=2, n_head=4)
    other_optimizer = torch.optim.AdamW(other.parameters(), lr=1e-3)
    return path, other, other_optimizer, torch.optim.lr_scheduler.StepLR(other_optimizer, step_size=2)


@pytest.mark.slow
def test_hash_mismatch_with_full_verification_leaves_everything_untouched(tmp_path):
    path, model, optimizer, scheduler = _big_checkpoint(tmp_path)
    train_steps(model, optimizer, scheduler, steps=1, seed=3)  # live state of its own
    before = _snapshot(model, optimizer, scheduler, torch.amp.GradScaler("cpu"))
    with pytest.raises(CorruptCheckpointError, match="model.safetensors"):
        load_checkpoint(path, model=model, optimizer=optimizer, scheduler=scheduler, verify="full")
    after = _snapshot(model, optimizer, scheduler, torch.amp.GradScaler("cpu"))
    assert all(_same(a, b) for a, b in zip(before, after))


def test_hash_mismatch_found_while_reading_leaves_new_optimizer_state_scheduler_and_rng_untouched(tmp_path):
    # The documented policy of verify="quick": large files are hash-checked while read straight into the model's
    # parameters, so those may hold new bytes; nothing else is applied before every hash has matched.
    path, model, optimizer, scheduler = _big_checkpoint(tmp_path)
    scheduler_before, rng_before = copy.deepcopy(scheduler.state_dict()), capture_rng_state()
    random.random(), np.random.rand()
    rng_before = capture_rng_state()
    with pytest.raises(CorruptCheckpointError, match="model.safetensors.*xxh3-128"):
        load_checkpoint(path, model=model, optimizer=optimizer, scheduler=scheduler)
    assert not optimizer.state  # the optimizer's new state was never installed
    assert scheduler.state_dict() == scheduler_before
    assert capture_rng_state().equals(rng_before)
