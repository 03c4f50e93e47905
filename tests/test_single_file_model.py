"""A model that fits in one shard is saved as ``model.safetensors`` (as ``save_pretrained`` and the stock Trainer write
it), not ``model-00001-of-00001.safetensors`` plus an index; larger models keep the HF index layout.

Scripts and tools that open ``<checkpoint>/model.safetensors`` (``safetensors.torch.load_file``, ``from_pretrained``)
read our checkpoints; both layouts load, verify, reshard, consolidate and summarize; damage to the single file and a
crafted header metadata are typed errors. Checkpoints of earlier versions (index + one shard) keep loading bit for
bit: tests/test_format_pinned.py.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import datasets
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, DataCollatorForLanguageModeling, Trainer, TrainingArguments

from hf_resumable.checkpoint import (
    consolidate_checkpoint,
    load_checkpoint,
    open_checkpoint,
    read_manifest,
    save_checkpoint,
    verify_checkpoint,
)
from hf_resumable.checkpoint.commit.manifest import Manifest
from hf_resumable.checkpoint.summary import summarize_checkpoint
from hf_resumable.constants import MODEL_INDEX_FILE, SINGLE_MODEL_FILE
from hf_resumable.conversions.stock import reshard_checkpoint
from hf_resumable.errors import CorruptCheckpointError, IncompleteCheckpointError
from hf_resumable.format.safetensors_io import hash_file, read_safetensors, write_safetensors

from helpers.tiny_models import assert_same_optimizer, assert_same_state, tiny_gpt2, tiny_llama, train_steps

sys.path.insert(0, str(Path(__file__).parent / "trainer_scripts"))
import train_tiny  # noqa: E402

TIED = "hf_resumable_tied"


def _trained(seed: int = 0):
    model = tiny_gpt2(seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train_steps(model, optimizer, steps=2)
    return model, optimizer


def _weight_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("model"))


def _reseal(path: Path) -> None:
    """Rewrite the manifest with hashes consistent with the files on disk (as a buggy writer or an attacker could)."""
    manifest = read_manifest(path)
    files = {rel: hash_file(path / rel) for rel in manifest.files}
    (path / "manifest.json").write_bytes(Manifest(files=files, step=manifest.step, world_size=manifest.world_size,
                                                  metrics=manifest.metrics).to_json())


def _rewrite_metadata(path: Path, metadata: dict[str, str]) -> None:
    relpath = path / SINGLE_MODEL_FILE
    tensors = read_safetensors(relpath)
    relpath.unlink()
    write_safetensors(relpath, list(tensors.items()), metadata=metadata)
    _reseal(path)


# --- the layout -----------------------------------------------------------------------------------------------------


def test_a_small_model_is_one_model_safetensors_that_upstream_tools_read(tmp_path):
    model, optimizer = _trained()
    save_checkpoint(tmp_path / "checkpoint-2", model=model, optimizer=optimizer, step=2)
    path = tmp_path / "checkpoint-2"
    assert _weight_files(path) == [SINGLE_MODEL_FILE]
    assert MODEL_INDEX_FILE not in read_manifest(path).files and SINGLE_MODEL_FILE in read_manifest(path).files
    # safetensors' own reader: the model's state, tied weights stored once (the first name, as save_pretrained).
    state = model.state_dict()
    stored = load_file(path / SINGLE_MODEL_FILE)
    assert set(stored) == set(state) - {"lm_head.weight"}
    assert all(torch.equal(stored[name], state[name]) and stored[name].dtype == state[name].dtype for name in stored)
    with safe_open(path / SINGLE_MODEL_FILE, "pt") as f:
        metadata = f.metadata()
    assert metadata["format"] == "pt"
    assert json.loads(metadata[TIED]) == {"lm_head.weight": "transformer.wte.weight"}
    # The same tensors save_pretrained writes.
    model.save_pretrained(tmp_path / "pretrained")
    assert _weight_files(tmp_path / "pretrained") == [SINGLE_MODEL_FILE]
    assert set(load_file(tmp_path / "pretrained" / SINGLE_MODEL_FILE)) == set(stored)
    # transformers loads the checkpoint directory and re-ties.
    loaded = AutoModelForCausalLM.from_pretrained(path)
    assert_same_state(state, loaded.state_dict())
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()


def test_a_multi_shard_model_keeps_the_index_layout(tmp_path):
    model, optimizer = _trained()
    save_checkpoint(tmp_path / "c", model=model, optimizer=optimizer, max_shard_size="16KB")
    files = _weight_files(tmp_path / "c")
    assert SINGLE_MODEL_FILE not in files and MODEL_INDEX_FILE in files
    shards = [f for f in files if f != MODEL_INDEX_FILE]
    assert len(shards) > 2 and all(re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", f) for f in shards)
    index = json.loads((tmp_path / "c" / MODEL_INDEX_FILE).read_text())
    assert sorted(set(index["weight_map"].values())) == shards
    assert index["metadata"][TIED] == {"lm_head.weight": "transformer.wte.weight"}
    assert_same_state(model.state_dict(), AutoModelForCausalLM.from_pretrained(tmp_path / "c").state_dict())


def _assert_loads_into_a_fresh_gpt2(path, model, optimizer, *, seed):
    """load_checkpoint into a differently initialized GPT-2 + AdamW: same state, tied weights tied again."""
    fresh = tiny_gpt2(seed=seed)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    load_checkpoint(path, model=fresh, optimizer=fresh_optimizer)
    assert_same_state(model.state_dict(), fresh.state_dict())
    assert_same_optimizer(optimizer, fresh_optimizer)
    assert fresh.lm_head.weight.data_ptr() == fresh.transformer.wte.weight.data_ptr()


@pytest.mark.parametrize("shard_size", ["2GB", "16KB"], ids=["single-file", "index"])
def test_both_layouts_load_bit_for_bit_with_tied_aliases_restored(tmp_path, shard_size):
    model, optimizer = _trained()
    save_checkpoint(tmp_path / "c", model=model, optimizer=optimizer, step=2, max_shard_size=shard_size)
    _assert_loads_into_a_fresh_gpt2(tmp_path / "c", model, optimizer, seed=9)
    # An untied copy of the alias receives the kept tensor's bytes.
    untied = tiny_gpt2(seed=3)
    untied.lm_head.weight = torch.nn.Parameter(untied.lm_head.weight.detach().clone())
    opened = open_checkpoint(tmp_path / "c")
    assert opened.step == 2
    opened.load_into(model=untied)
    assert torch.equal(untied.lm_head.weight, model.transformer.wte.weight)
    assert untied.lm_head.weight.data_ptr() != untied.transformer.wte.weight.data_ptr()


def test_a_state_dict_and_an_untied_model_are_single_files_too(tmp_path):
    llama = tiny_llama(tie_word_embeddings=False)
    save_checkpoint(tmp_path / "llama", model=llama, rng=False)
    assert _weight_files(tmp_path / "llama") == [SINGLE_MODEL_FILE]
    with safe_open(tmp_path / "llama" / SINGLE_MODEL_FILE, "pt") as f:
        assert json.loads(f.metadata()[TIED]) == {}
    assert set(load_file(tmp_path / "llama" / SINGLE_MODEL_FILE)) == set(llama.state_dict())
    state = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.zeros(0)}
    save_checkpoint(tmp_path / "dict", model=state, rng=False)
    assert _weight_files(tmp_path / "dict") == [SINGLE_MODEL_FILE]
    module = torch.nn.Module()
    module.register_buffer("w", torch.zeros(2, 3))
    module.register_buffer("b", torch.ones(0))
    load_checkpoint(tmp_path / "dict", model=module, restore_rng=False)
    assert torch.equal(module.w, state["w"])


def test_the_summary_counts_the_parameters_of_a_single_file(tmp_path):
    model, _ = _trained()
    save_checkpoint(tmp_path / "one", model=model, rng=False)
    save_checkpoint(tmp_path / "many", model=model, rng=False, max_shard_size="16KB")
    expected = sum(t.numel() for name, t in model.state_dict().items() if name != "lm_head.weight")
    assert summarize_checkpoint(tmp_path / "one").parameter_count == expected
    assert summarize_checkpoint(tmp_path / "many").parameter_count == expected


# --- verification and hostile files ---------------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["flip", "truncate", "missing"])
def test_damage_to_model_safetensors_is_a_typed_error(tmp_path, damage):
    model, _ = _trained()
    save_checkpoint(tmp_path / "checkpoint-1", model=model, step=1, rng=False)
    save_checkpoint(tmp_path / "checkpoint-2", model=model, step=2, rng=False)
    target = tmp_path / "checkpoint-2" / SINGLE_MODEL_FILE
    data = bytearray(target.read_bytes())
    if damage == "flip":
        data[len(data) - 3] ^= 0x01
        target.write_bytes(bytes(data))
    elif damage == "truncate":
        target.write_bytes(bytes(data[: len(data) * 2 // 3]))
    else:
        target.unlink()
    report = verify_checkpoint(tmp_path / "checkpoint-2", full=True)
    assert not report.ok and [f for f, _ in report.problems] == [SINGLE_MODEL_FILE], report.problems
    expected = IncompleteCheckpointError if damage == "missing" else CorruptCheckpointError
    with pytest.raises(expected, match=SINGLE_MODEL_FILE):
        verify_checkpoint(tmp_path / "checkpoint-2", full=True, raise_on_error=True)
    with pytest.raises(expected, match=SINGLE_MODEL_FILE):
        load_checkpoint(tmp_path / "checkpoint-2", model=tiny_gpt2(seed=1))
    from hf_resumable.checkpoint import find_latest_checkpoint

    assert find_latest_checkpoint(tmp_path, full=True) == tmp_path / "checkpoint-1"


@pytest.mark.parametrize("tied", ["{not json", "[\"lm_head.weight\"]", '{"lm_head.weight": 1}', "[" * 100_000,
                                  '{"lm_head.weight": "x"}', '{"transformer.wpe.weight": "transformer.wte.weight"}'],
                         ids=["invalid-json", "not-an-object", "not-a-name", "too-deep", "alias-of-nothing",
                              "alias-of-a-stored-tensor"])
def test_a_crafted_tied_record_in_the_header_is_a_typed_error(tmp_path, tied):
    model, _ = _trained()
    path = tmp_path / "c"
    save_checkpoint(path, model=model, rng=False)
    _rewrite_metadata(path, {"format": "pt", TIED: tied})
    live = tiny_gpt2(seed=5)
    before = {name: t.clone() for name, t in live.state_dict().items()}
    structural = tied.startswith(("{not", "[")) or tied.endswith("1}")
    if structural:  # verification already sees it: the record is not a JSON object of names
        report = verify_checkpoint(path, full=True)
        assert [f for f, _ in report.problems] == [SINGLE_MODEL_FILE]
        assert report.error_types == [CorruptCheckpointError]
    with pytest.raises(CorruptCheckpointError, match=f"{SINGLE_MODEL_FILE}.*{TIED}|{TIED}.*{SINGLE_MODEL_FILE}"):
        load_checkpoint(path, model=live, restore_rng=False)
    with pytest.raises(CorruptCheckpointError):
        open_checkpoint(path)
    assert_same_state(before, live.state_dict())  # nothing was written into the model


def test_a_model_safetensors_without_our_metadata_loads_as_save_pretrained_wrote_it(tmp_path):
    model, _ = _trained()
    path = tmp_path / "c"
    save_checkpoint(path, model=model, rng=False)
    _rewrite_metadata(path, {"format": "pt"})  # no tied record: no aliases restored, lm_head.weight missing
    assert verify_checkpoint(path, full=True).ok
    fresh = tiny_gpt2(seed=2)
    # lm_head.weight shares wte's storage: it gets its bytes
    load_checkpoint(path, model=fresh, strict=False, restore_rng=False)
    assert_same_state(model.state_dict(), fresh.state_dict())


# --- tools that rewrite weights -------------------------------------------------------------------------------------


def test_reshard_moves_between_the_two_layouts_keeping_every_byte(tmp_path):
    model, optimizer = _trained()
    save_checkpoint(tmp_path / "c", model=model, optimizer=optimizer, step=2)
    reshard_checkpoint(tmp_path / "c", max_shard_size="16KB", output=tmp_path / "many")
    files = _weight_files(tmp_path / "many")
    assert MODEL_INDEX_FILE in files and SINGLE_MODEL_FILE not in files and len(files) > 3
    assert json.loads((tmp_path / "many" / MODEL_INDEX_FILE).read_text())["metadata"][TIED] == {
        "lm_head.weight": "transformer.wte.weight"}
    reshard_checkpoint(tmp_path / "many", max_shard_size="1GB", output=tmp_path / "one")
    assert _weight_files(tmp_path / "one") == [SINGLE_MODEL_FILE]
    original = load_file(tmp_path / "c" / SINGLE_MODEL_FILE)
    round_trip = load_file(tmp_path / "one" / SINGLE_MODEL_FILE)
    assert original.keys() == round_trip.keys() and all(torch.equal(original[k], round_trip[k]) for k in original)
    for directory in ("many", "one"):
        fresh = tiny_gpt2(seed=4)
        fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
        load_checkpoint(tmp_path / directory, model=fresh, optimizer=fresh_optimizer)
        assert_same_state(model.state_dict(), fresh.state_dict())
        assert_same_optimizer(optimizer, fresh_optimizer)
        assert fresh.lm_head.weight.data_ptr() == fresh.transformer.wte.weight.data_ptr()


def test_reshard_writes_a_one_process_checkpoint_of_pieces_whole(tmp_path):
    # Resharding is consolidation's rewrite: pieces come out in the regular layout (they were once copied unchanged).
    model, optimizer = _trained()
    save_checkpoint(tmp_path / "c", model=model, optimizer=optimizer, step=2, layout="pieces")
    reshard_checkpoint(tmp_path / "c", max_shard_size="16KB", output=tmp_path / "r")
    files = read_manifest(tmp_path / "r").files
    assert MODEL_INDEX_FILE in files and not any(f.startswith("sharded") for f in files)
    assert "sharded_layout.json" not in files and verify_checkpoint(tmp_path / "r", full=True).ok
    _assert_loads_into_a_fresh_gpt2(tmp_path / "r", model, optimizer, seed=5)


def test_sharded_checkpoints_write_the_same_layout(tmp_path):
    model, optimizer = _trained()
    # layout="hf" in one process: the weights whole, as one model.safetensors.
    save_checkpoint(tmp_path / "hf", model=model, optimizer=optimizer, step=2, layout="hf")
    assert _weight_files(tmp_path / "hf") == [SINGLE_MODEL_FILE]
    assert verify_checkpoint(tmp_path / "hf", full=True).ok
    assert set(load_file(tmp_path / "hf" / SINGLE_MODEL_FILE)) == set(model.state_dict()) - {"lm_head.weight"}
    assert_same_state(model.state_dict(), AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict())
    fresh = tiny_gpt2(seed=8)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    load_checkpoint(tmp_path / "hf", model=fresh, optimizer=fresh_optimizer)
    assert_same_state(model.state_dict(), fresh.state_dict())
    # A regular single-file checkpoint loads through the resharding path too.
    save_checkpoint(tmp_path / "regular", model=model, optimizer=optimizer, step=2)
    fresh = tiny_gpt2(seed=6)
    load_checkpoint(tmp_path / "regular", model=fresh)
    assert_same_state(model.state_dict(), fresh.state_dict())
    # Consolidating per-rank pieces gives a regular checkpoint in the save_pretrained layout.
    save_checkpoint(tmp_path / "pieces", model=model, optimizer=optimizer, step=2, layout="pieces")
    consolidate_checkpoint(tmp_path / "pieces", tmp_path / "export")
    assert _weight_files(tmp_path / "export") == [SINGLE_MODEL_FILE]
    _assert_loads_into_a_fresh_gpt2(tmp_path / "export", model, optimizer, seed=7)


# --- the Trainer ----------------------------------------------------------------------------------------------------


def _train(trainer_class, output_dir: Path):
    settings = dict(output_dir=str(output_dir), per_device_train_batch_size=4, max_steps=1, save_steps=1,
                    report_to=[], disable_tqdm=True, use_cpu=True, learning_rate=1e-3)
    data = datasets.Dataset.from_dict({"input_ids": train_tiny.token_rows(8)})
    collator = DataCollatorForLanguageModeling(train_tiny.build_tokenizer(), mlm=False)
    trainer = trainer_class(model=train_tiny.build_model("gpt2"), args=TrainingArguments(**settings),
                            train_dataset=data, data_collator=collator)
    trainer.train()
    return trainer


def test_resumable_trainer_checkpoints_hold_model_safetensors_like_the_stock_trainer(tmp_path):
    from hf_resumable.integrations.trainer import ResumableTrainer

    _train(Trainer, tmp_path / "stock")
    ours = _train(ResumableTrainer, tmp_path / "ours")
    stock_dir, our_dir = tmp_path / "stock" / "checkpoint-1", tmp_path / "ours" / "checkpoint-1"
    assert _weight_files(stock_dir) == [SINGLE_MODEL_FILE] == _weight_files(our_dir)
    ours_stored, stock_stored = load_file(our_dir / SINGLE_MODEL_FILE), load_file(stock_dir / SINGLE_MODEL_FILE)
    assert set(ours_stored) == set(stock_stored)
    assert {k: (v.dtype, v.shape) for k, v in ours_stored.items()} == {
        k: (v.dtype, v.shape) for k, v in stock_stored.items()}
    state = ours.model.state_dict()
    assert all(torch.equal(tensor, state[name]) for name, tensor in ours_stored.items())
    assert os.path.isfile(our_dir / "trainer_state.json") and os.path.isfile(our_dir / "config.json")
    assert_same_state(state, AutoModelForCausalLM.from_pretrained(our_dir).state_dict())


# --- names the checkpoint writes itself -----------------------------------------------------------------------------


def test_an_extra_file_named_like_the_model_file_is_refused_before_anything_is_written(tmp_path):
    from hf_resumable.errors import CheckpointExistsError

    model, _ = _trained()
    with pytest.raises(CheckpointExistsError, match="extra_files names 'model.safetensors'"):
        save_checkpoint(tmp_path / "c", model=model, extra_files={SINGLE_MODEL_FILE: b"mine"})
    assert list(tmp_path.iterdir()) == []  # no checkpoint, no temporary directory


def test_a_foreign_model_safetensors_next_to_a_trainable_part_is_not_taken_for_the_model(tmp_path):
    model = tiny_gpt2()
    model.transformer.wpe.weight.requires_grad_(False)  # the checkpoint stores the trainable part only
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    train_steps(model, optimizer, steps=2)
    foreign = tmp_path / "foreign.safetensors"
    write_safetensors(foreign, [("something", torch.ones(3))])
    save_checkpoint(tmp_path / "c", model=model, optimizer=optimizer, rng=False,
                    extra_files={SINGLE_MODEL_FILE: foreign.read_bytes()})
    files = read_manifest(tmp_path / "c").files
    assert "trainable.safetensors.index.json" in files and SINGLE_MODEL_FILE in files
    assert MODEL_INDEX_FILE not in files
    fresh = tiny_gpt2(seed=0)  # the same frozen base
    fresh.transformer.wpe.weight.requires_grad_(False)
    fresh_optimizer = torch.optim.AdamW([p for p in fresh.parameters() if p.requires_grad], lr=1e-3)
    load_checkpoint(tmp_path / "c", model=fresh, optimizer=fresh_optimizer, restore_rng=False)
    assert_same_state(model.state_dict(), fresh.state_dict())
    assert_same_optimizer(optimizer, fresh_optimizer)
