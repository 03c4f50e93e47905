"""Round trips of the checkpoint format on real tiny transformers models: bit for bit."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from safetensors import safe_open

from hf_resumable.checkpoint import (
    load_checkpoint,
    read_manifest,
    save_checkpoint,
    verify_checkpoint,
    wait_for_pending_saves,
)
from hf_resumable.constants import DURABILITY_FILE, MANIFEST_FILE, MODEL_INDEX_FILE
from hf_resumable.errors import (
    BaseMismatchError,
    CheckpointExistsError,
    CheckpointMismatchError,
    IncompleteCheckpointError,
    InexactResumeError,
    UnsupportedStateError,
)
from hf_resumable.format.safetensors_io import read_header

from helpers.tiny_models import FACTORIES, assert_same_optimizer, assert_same_state, tiny_gpt2, tiny_llama, train_steps


def _setup(kind: str, seed: int, optimizer_cls=torch.optim.AdamW, **opt_kwargs):
    model = FACTORIES[kind](seed=seed)
    optimizer = optimizer_cls(model.parameters(), lr=1e-3, **opt_kwargs)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    return model, optimizer, scheduler


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gpt2", "llama", "bert"])
def test_round_trip_is_bitwise(tmp_path, kind):
    model, optimizer, scheduler = _setup(kind, seed=0)
    if kind == "bert":  # BertForMaskedLM takes labels the same way; train with MLM-style labels
        pass
    train_steps(model, optimizer, scheduler, steps=3)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    random.random()
    np.random.rand()
    save_checkpoint(tmp_path / "checkpoint-3", model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler,
                    step=3, training_state={"global_step": 3, "epoch": 0.5, "cursor": (1, 2)}, max_shard_size="16KB")
    expected_draws = (random.random(), np.random.rand(), torch.rand(3))

    files = sorted(p.name for p in (tmp_path / "checkpoint-3").iterdir())
    assert sum(f.startswith("model-") for f in files) >= 2
    assert sum(f.startswith("optimizer-") for f in files) >= 2
    assert not any(f.endswith((".pt", ".pth", ".bin", ".pkl")) for f in files)

    model2, optimizer2, scheduler2 = _setup(kind, seed=1)
    scaler2 = torch.amp.GradScaler("cpu", init_scale=2.0)
    loaded = load_checkpoint(tmp_path / "checkpoint-3", model=model2, optimizer=optimizer2, scheduler=scheduler2,
                             scaler=scaler2)
    assert (random.random(), np.random.rand()) == expected_draws[:2]
    assert torch.equal(torch.rand(3), expected_draws[2])
    assert loaded.step == 3
    assert loaded.training_state == {"global_step": 3, "epoch": 0.5, "cursor": (1, 2)}
    assert_same_state(model.state_dict(), model2.state_dict())
    assert_same_optimizer(optimizer, optimizer2)
    assert scheduler.state_dict() == scheduler2.state_dict()
    assert scaler.state_dict() == scaler2.state_dict()
    # The restored objects keep training identically (same dropout stream for both).
    rng = torch.get_rng_state()
    train_steps(model, optimizer, scheduler, steps=2, seed=5)
    torch.set_rng_state(rng)
    train_steps(model2, optimizer2, scheduler2, steps=2, seed=5)
    assert_same_state(model.state_dict(), model2.state_dict())


@pytest.mark.slow
@pytest.mark.parametrize(
    "optimizer_cls, kwargs",
    [(torch.optim.SGD, {"momentum": 0.9}), (torch.optim.Adagrad, {}), (torch.optim.Adam, {"amsgrad": True}),
     (torch.optim.RMSprop, {"momentum": 0.5}), (torch.optim.AdamW, {"betas": (0.8, 0.95), "foreach": False})],
)
def test_any_torch_optimizer_round_trips(tmp_path, optimizer_cls, kwargs):
    model, optimizer, _ = _setup("gpt2", 0, optimizer_cls, **kwargs)
    train_steps(model, optimizer, steps=2)
    save_checkpoint(tmp_path / "c", model=model, optimizer=optimizer, max_shard_size="8KB")
    model2, optimizer2, _ = _setup("gpt2", 3, optimizer_cls, **kwargs)
    load_checkpoint(tmp_path / "c", model=model2, optimizer=optimizer2)
    assert_same_optimizer(optimizer, optimizer2)
    rng = torch.get_rng_state()
    train_steps(model, optimizer, steps=2, seed=9)
    torch.set_rng_state(rng)
    train_steps(model2, optimizer2, steps=2, seed=9)
    assert_same_state(model.state_dict(), model2.state_dict())


def test_optimizer_keyed_by_name_survives_param_group_reordering(tmp_path):
    model, optimizer, _ = _setup("gpt2", 0)
    train_steps(model, optimizer, steps=2)
    save_checkpoint(tmp_path / "c", model=model, optimizer=optimizer)
    model2 = tiny_gpt2(seed=4)
    reversed_params = list(reversed(list(model2.parameters())))
    optimizer2 = torch.optim.AdamW(reversed_params, lr=1e-3)
    load_checkpoint(tmp_path / "c", model=model2, optimizer=optimizer2)
    names = {id(p): n for n, p in model2.named_parameters()}
    names1 = {id(p): n for n, p in model.named_parameters()}
    by_name1 = {names1[id(p)]: optimizer.state[p]["exp_avg"] for p in model.parameters()}
    for p in reversed_params:
        assert torch.equal(optimizer2.state[p]["exp_avg"], by_name1[names[id(p)]])


def test_tied_weights_saved_once_and_come_back_tied(tmp_path):
    model = tiny_gpt2()
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    save_checkpoint(tmp_path / "c", model=model, rng=False)
    assert not (tmp_path / "c" / MODEL_INDEX_FILE).exists()  # one shard: model.safetensors, as save_pretrained
    header = read_header(tmp_path / "c" / "model.safetensors")
    assert "lm_head.weight" not in header.tensors and "transformer.wte.weight" in header.tensors
    assert json.loads(header.metadata["hf_resumable_tied"]) == {"lm_head.weight": "transformer.wte.weight"}
    assert header.metadata["format"] == "pt"
    save_checkpoint(tmp_path / "sharded", model=model, rng=False, max_shard_size="10KB")
    index = json.loads((tmp_path / "sharded" / MODEL_INDEX_FILE).read_text())
    assert "lm_head.weight" not in index["weight_map"]
    assert index["metadata"]["hf_resumable_tied"] == {"lm_head.weight": "transformer.wte.weight"}
    model2 = tiny_gpt2(seed=7)
    load_checkpoint(tmp_path / "c", model=model2, restore_rng=False)
    assert model2.lm_head.weight.data_ptr() == model2.transformer.wte.weight.data_ptr()
    assert torch.equal(model2.lm_head.weight, model.lm_head.weight)


def test_from_pretrained_and_hub_loader_read_our_shards(tmp_path):
    from huggingface_hub import load_torch_model
    from transformers import AutoModelForCausalLM

    model = tiny_llama(tie_word_embeddings=False)
    save_checkpoint(tmp_path / "c", model=model, max_shard_size="10KB", rng=False)
    assert len(json.loads((tmp_path / "c" / MODEL_INDEX_FILE).read_text())["weight_map"]) > 2
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "c")
    assert_same_state(model.state_dict(), loaded.state_dict())
    fresh = tiny_llama(seed=3, tie_word_embeddings=False)
    result = load_torch_model(fresh, tmp_path / "c", strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    assert_same_state(model.state_dict(), fresh.state_dict())
    gpt2 = tiny_gpt2()
    save_checkpoint(tmp_path / "g", model=gpt2, max_shard_size="10KB", rng=False)
    assert_same_state(gpt2.state_dict(), AutoModelForCausalLM.from_pretrained(tmp_path / "g").state_dict())


def test_safetensors_library_reads_every_file(tmp_path):
    model, optimizer, _ = _setup("gpt2", 0)
    train_steps(model, optimizer, steps=1)
    save_checkpoint(tmp_path / "c", model=model, optimizer=optimizer, max_shard_size="16KB")
    for path in (tmp_path / "c").rglob("*.safetensors"):
        with safe_open(path, framework="pt") as f:
            assert f.metadata()["format"] == "pt"
            for key in f.keys():
                f.get_tensor(key)


def test_manifest_lists_every_file_with_hashes(tmp_path):
    import xxhash

    model, optimizer, _ = _setup("gpt2", 0)
    save_checkpoint(tmp_path / "c", model=model, optimizer=optimizer, step=7, metrics={"loss": 1.5})
    wait_for_pending_saves()  # the deferred fsyncs: until they are done, the durability marker is there too
    manifest = read_manifest(tmp_path / "c")
    on_disk = {p.relative_to(tmp_path / "c").as_posix() for p in (tmp_path / "c").rglob("*") if p.is_file()}
    assert set(manifest.files) == on_disk - {MANIFEST_FILE, DURABILITY_FILE}  # the durability record: not listed
    for rel, record in manifest.files.items():
        data = (tmp_path / "c" / rel).read_bytes()
        assert record.size == len(data) and record.xxh3_128 == xxhash.xxh3_128(data).hexdigest()
        assert record.sha256 is None  # format version 2: no sha256 on the save path
    assert manifest.step == 7 and manifest.metrics == {"loss": 1.5} and manifest.world_size == 1
    assert "torch" in manifest.versions


def test_existing_checkpoint_is_not_overwritten_unless_asked(tmp_path):
    model = tiny_gpt2()
    save_checkpoint(tmp_path / "c", model=model, step=1)
    before = read_manifest(tmp_path / "c")
    with pytest.raises(CheckpointExistsError):
        save_checkpoint(tmp_path / "c", model=model, step=2)
    assert read_manifest(tmp_path / "c") == before
    save_checkpoint(tmp_path / "c", model=model, step=2, overwrite=True)
    assert read_manifest(tmp_path / "c").step == 2
    assert [p.name for p in tmp_path.iterdir()] == ["c"]


def test_mismatched_model_reports_every_key_at_once(tmp_path):
    save_checkpoint(tmp_path / "c", model=tiny_gpt2(), rng=False)
    other = tiny_gpt2(n_embd=16)
    with pytest.raises(CheckpointMismatchError) as info:
        load_checkpoint(tmp_path / "c", model=other, restore_rng=False)
    message = str(info.value)
    assert "transformer.wte.weight" in message and "transformer.h.1.mlp.c_proj.weight" in message
    deeper = tiny_gpt2(n_layer=3)
    with pytest.raises(CheckpointMismatchError, match=r"transformer\.h\.2\..*missing"):
        load_checkpoint(tmp_path / "c", model=deeper, restore_rng=False)
    load_checkpoint(tmp_path / "c", model=deeper, restore_rng=False, strict=False)
    assert torch.equal(deeper.transformer.h[0].attn.c_attn.weight, tiny_gpt2().transformer.h[0].attn.c_attn.weight)


def test_missing_parts_raise_typed_errors(tmp_path):
    model, optimizer, scheduler = _setup("gpt2", 0)
    save_checkpoint(tmp_path / "c", model=model, rng=False)
    with pytest.raises(IncompleteCheckpointError, match="optimizer"):
        load_checkpoint(tmp_path / "c", model=model, optimizer=optimizer, restore_rng=False)
    with pytest.raises(IncompleteCheckpointError, match="scheduler"):
        load_checkpoint(tmp_path / "c", model=model, scheduler=scheduler, restore_rng=False)
    with pytest.raises(InexactResumeError, match="RNG"):
        load_checkpoint(tmp_path / "c", model=model)
    load_checkpoint(tmp_path / "c", model=model, allow_inexact_resume=True)


def test_unstorable_state_is_refused_at_save_time(tmp_path):
    model = tiny_gpt2()
    with pytest.raises(UnsupportedStateError, match="extra/fn"):
        save_checkpoint(tmp_path / "c", model=model, extra={"fn": object()})
    assert not (tmp_path / "c").exists()
    assert list(tmp_path.iterdir()) == []


def test_training_state_tensors_and_exotic_values_round_trip(tmp_path):
    extra = {"ints": {1: "a", 2: (3, 4)}, "t": torch.arange(4), "nan": float("inf"), "dtype": torch.bfloat16,
             "nested": [{"x": None, "y": True}]}
    save_checkpoint(tmp_path / "c", model=None, extra=extra, rng=False)
    loaded = load_checkpoint(tmp_path / "c", restore_rng=False)
    assert loaded.extra["ints"] == {1: "a", 2: (3, 4)}
    assert torch.equal(loaded.extra["t"], torch.arange(4))
    assert loaded.extra["nan"] == float("inf") and loaded.extra["dtype"] is torch.bfloat16
    assert loaded.extra["nested"] == [{"x": None, "y": True}]


def test_bf16_and_empty_tensors(tmp_path):
    state = {"a": torch.randn(3, 5).to(torch.bfloat16), "empty": torch.zeros(0, 4), "scalar": torch.tensor(3.5),
             "i": torch.arange(7, dtype=torch.int16), "b": torch.tensor([True, False])}
    save_checkpoint(tmp_path / "c", model=state, rng=False)
    module = torch.nn.Module()
    for k, v in state.items():
        module.register_buffer(k, torch.zeros_like(v))
    load_checkpoint(tmp_path / "c", model=module, restore_rng=False)
    for k, v in state.items():
        assert torch.equal(getattr(module, k), v)
    assert verify_checkpoint(tmp_path / "c").ok


def test_peft_checkpoint_also_ships_a_loadable_adapter(tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model

    model = get_peft_model(tiny_gpt2(), LoraConfig(r=4, target_modules=["c_attn"], task_type="CAUSAL_LM"))
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:
                param.add_(0.01)
    save_checkpoint(tmp_path / "c", model=model, rng=False)
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (tmp_path / "c").iterdir()}
    assert verify_checkpoint(tmp_path / "c").ok  # the adapter files are hashed in the manifest too
    adapter = PeftModel.from_pretrained(tiny_gpt2(), tmp_path / "c")
    expected = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    got = {k: v for k, v in adapter.state_dict().items() if "lora_" in k}
    assert expected.keys() == got.keys() and expected
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    # The base is not stored (tests/test_frozen_checkpoints.py): another base is refused, the same one resumes.
    other = get_peft_model(tiny_gpt2(seed=3), LoraConfig(r=4, target_modules=["c_attn"], task_type="CAUSAL_LM"))
    with pytest.raises(BaseMismatchError, match="transformer.h.0.attn.c_attn.base_layer.weight: its bytes differ"):
        load_checkpoint(tmp_path / "c", model=other, restore_rng=False)
    same = get_peft_model(tiny_gpt2(), LoraConfig(r=4, target_modules=["c_attn"], task_type="CAUSAL_LM"))
    load_checkpoint(tmp_path / "c", model=same, restore_rng=False)
    assert_same_state(model.state_dict(), same.state_dict())
    # A standalone checkpoint holds the base too: it loads into any model of that shape.
    save_checkpoint(tmp_path / "standalone", model=model, rng=False, standalone=True)
    load_checkpoint(tmp_path / "standalone", model=other, restore_rng=False)
    assert_same_state(model.state_dict(), other.state_dict())


def test_data_state_with_tensors_is_refused_not_silently_dropped(tmp_path):
    with pytest.raises(UnsupportedStateError, match="data_state holds tensors"):
        save_checkpoint(tmp_path / "c", model=None, data_state={"buffer": torch.arange(3)}, rng=False)
    assert not (tmp_path / "c").exists()


@pytest.mark.slow
def test_load_into_an_optimizer_that_has_state_fills_it_in_place_bit_exactly(tmp_path):
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_steps(model, optimizer, steps=2)
    save_checkpoint(tmp_path / "checkpoint-2", model=model, optimizer=optimizer, max_shard_size="64KB", rng=False)
    expected_model = {k: v.clone() for k, v in model.state_dict().items()}

    other = tiny_llama(seed=1)
    other_optimizer = torch.optim.AdamW(other.parameters(), lr=1e-2)
    train_steps(other, other_optimizer, steps=3, seed=5)  # state exists, with different values
    existing = {id(v): v.data_ptr() for s in other_optimizer.state.values() for v in s.values()
                if isinstance(v, torch.Tensor)}
    load_checkpoint(tmp_path / "checkpoint-2", model=other, optimizer=other_optimizer, restore_rng=False)
    assert_same_state(expected_model, other.state_dict())
    assert_same_optimizer(optimizer, other_optimizer)
    kept = [v for s in other_optimizer.state.values() for v in s.values()
            if isinstance(v, torch.Tensor) and existing.get(id(v)) == v.data_ptr()]
    assert len(kept) == len(existing)  # every state tensor was refilled, none reallocated
    # Training on from the load is identical to training on from the original.
    train_steps(model, optimizer, steps=2, seed=9)
    train_steps(other, other_optimizer, steps=2, seed=9)
    assert_same_state(model.state_dict(), other.state_dict())


def test_a_fresh_optimizer_gets_its_state_allocated_once_and_read_straight_into(tmp_path, monkeypatch):
    """Issue 17: a restarted job's optimizer has no state; the load allocates each state tensor once, in its final
    dtype, device and layout, reads the bytes into it, and ``Optimizer.load_state_dict`` installs that very tensor
    (no second copy)."""
    from hf_resumable.checkpoint.state import _optimizer

    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_steps(model, optimizer, steps=2)
    save_checkpoint(tmp_path / "checkpoint-2", model=model, optimizer=optimizer, rng=False)
    allocated, target = {}, _optimizer._target
    monkeypatch.setattr(_optimizer, "_target", lambda *a, **k: (lambda t: allocated.setdefault(id(t), t))(
        target(*a, **k)))
    fresh = tiny_llama(seed=1)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    load_checkpoint(tmp_path / "checkpoint-2", model=fresh, optimizer=fresh_optimizer, restore_rng=False)
    installed = [v for s in fresh_optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    assert len(installed) == len(allocated) == 3 * len(list(fresh.parameters()))
    assert all(allocated.get(id(v)) is v for v in installed)  # the tensors read into are the ones installed
    for param, state in fresh_optimizer.state.items():
        assert state["exp_avg"].dtype == param.dtype and state["exp_avg"].stride() == param.stride()
    assert_same_optimizer(optimizer, fresh_optimizer)


def test_mismatched_optimizer_with_state_is_refused_before_anything_is_overwritten(tmp_path):
    model = tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_steps(model, optimizer, steps=1)
    save_checkpoint(tmp_path / "checkpoint-1", model=model, optimizer=optimizer, rng=False)
    other = tiny_gpt2(seed=3)
    adam = torch.optim.Adam(other.parameters(), lr=1e-2)  # another class, same state keys and shapes
    train_steps(other, adam, steps=1, seed=4)
    before = {(i, k): v.clone() for i, s in enumerate(adam.state.values()) for k, v in s.items()}
    with pytest.raises(CheckpointMismatchError, match="optimizer was AdamW, now Adam"):
        load_checkpoint(tmp_path / "checkpoint-1", model=other, optimizer=adam, restore_rng=False)
    after = {(i, k): v for i, s in enumerate(adam.state.values()) for k, v in s.items()}
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_existing_state_of_another_shape_is_replaced_not_overwritten(tmp_path):
    model = tiny_gpt2()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    train_steps(model, optimizer, steps=2)
    save_checkpoint(tmp_path / "checkpoint-2", model=model, optimizer=optimizer, rng=False)
    other = tiny_gpt2(seed=2)
    other_optimizer = torch.optim.SGD(other.parameters(), lr=1e-2, momentum=0.9)
    train_steps(other, other_optimizer, steps=1)
    first = next(iter(other_optimizer.state.values()))
    odd = torch.zeros(3, dtype=torch.float64)
    first["momentum_buffer"] = odd  # a stale entry that cannot receive the saved tensor
    load_checkpoint(tmp_path / "checkpoint-2", model=other, optimizer=other_optimizer, restore_rng=False)
    assert torch.equal(odd, torch.zeros(3, dtype=torch.float64))
    assert_same_optimizer(optimizer, other_optimizer)
