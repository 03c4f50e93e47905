"""Switching in from transformers' distributed checkpoint (issue #43, item 5).

* A tiny Llama loaded with ``from_pretrained(..., distributed_config=DistributedConfig(tp_size=2))`` on 2 gloo ranks,
  trained 3 steps with a two-group AdamW, saved with ``save_pretrained(distributed_checkpoint=True)`` (torch's
  ``HuggingFaceStorageWriter``: per-rank safetensors) and ``save_optimizer_distributed`` (DCP ``.metadata`` +
  ``.distcp``), is converted by ``hf-resumable convert``: every weight and optimizer tensor equals the stock run's
  consolidated state bit for bit, loaded in one process and consolidated; the param groups come back with their
  hyper-parameters. The same checkpoint consolidated loads with ``from_pretrained(..., distributed_config=...)`` at
  tensor parallel, the per-rank one with ``load_checkpoint`` into the tensor-parallel model, and a per-rank
  checkpoint saved there with ``layout="hf"`` with ``from_pretrained(..., distributed_config=...)`` (FSDP2
  through ``DistributedConfig(fsdp_size=2)``: the extended tier).
* Corrupt, truncated and hostile inputs raise typed errors naming the file; an existing output is never touched.
  Those sources are written in one process by the same torch writers (a world size of 1).
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_resumable.checkpoint import consolidate_checkpoint, load_checkpoint, read_manifest, verify_checkpoint
from hf_resumable.conversions.dcp import plan_flat_param_groups
from hf_resumable.conversions.hf_storage import convert_transformers_distributed_checkpoint
from hf_resumable.conversions.switch import convert_stock_checkpoint, detect_stock_kind
from hf_resumable.errors import (
    CheckpointExistsError,
    CheckpointMismatchError,
    CorruptCheckpointError,
    UnsafePickleError,
)

from helpers import zygote
from helpers.distributed_launch import REPO_ROOT, child_env, run_torchrun
from helpers.tiny_models import decay_groups, tiny_gpt2, tiny_llama, train_steps

WORKER = Path(__file__).parent / "scripts" / "dcp_hf_worker.py"
SHARD = "shard-00001-model-00001-of-00001.safetensors"


def _cli(*args: str) -> subprocess.CompletedProcess:
    return zygote.run([sys.executable, "-m", "hf_resumable", *args], cwd=REPO_ROOT, env=child_env(),
                      capture_output=True, text=True, timeout=300)


def _job(*args: str) -> None:
    done = run_torchrun(WORKER, list(args), env=child_env(), timeout=300)
    assert done.returncode == 0, done.stdout[-5000:]


def _unequal(want: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> list[str]:
    assert sorted(got) == sorted(want) and len(want) > 10
    return [name for name in want if want[name].dtype != got[name].dtype or not torch.equal(want[name], got[name])]


def _optimizer_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """``state/<fqn>/<key>``: the optimizer's state tensors by parameter name."""
    by_id = {id(p): name for name, p in model.named_parameters()}
    names = [by_id[id(p)] for group in optimizer.param_groups for p in group["params"]]  # state_dict()'s indexes
    return {f"state/{names[index]}/{key}": value for index, fields in optimizer.state_dict()["state"].items()
            for key, value in fields.items()}


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp", pytest.param("fsdp", marks=pytest.mark.extended)])
def test_transformers_distributed_checkpoint_converts_bit_for_bit(tmp_path, layout):
    from transformers import LlamaForCausalLM

    _job("save", "--output-dir", str(tmp_path), "--layout", layout)
    saved, converted = tmp_path / "saved", tmp_path / "converted" / "checkpoint-3"
    assert detect_stock_kind(saved) == "transformers-dcp"
    # 1. The command: the optimizer found in saved/optimizer, the step from its state, nothing pickled carried.
    done = _cli("convert", str(saved), "--output", str(converted))
    assert done.returncode == 0, done.stderr[-5000:]
    assert "NOT bit-exact" in done.stderr and "weights_only=True" in done.stderr
    assert verify_checkpoint(converted, full=True).ok
    manifest = read_manifest(converted)
    assert (manifest.world_size, manifest.step) == (2, 3)
    assert not [p for p in converted.rglob("*") if p.suffix in (".pt", ".pth", ".bin", ".pkl", ".distcp", ".py")]
    assert (converted / "config.json").read_bytes() == (saved / "config.json").read_bytes()
    # 2. Loaded in one process into a plain model and optimizer: the stock run's consolidated state, bit for bit.
    model = LlamaForCausalLM.from_pretrained(tmp_path / "seed")
    optimizer = torch.optim.AdamW(decay_groups(model), lr=1.0)
    load_checkpoint(converted, model=model, optimizer=optimizer, restore_rng=False,
                    allow_inexact_resume=True)
    expected_weights = load_file(tmp_path / "expected-model.safetensors")
    expected_optimizer = load_file(tmp_path / "expected-optimizer.safetensors")
    assert not _unequal(expected_weights, model.state_dict())
    assert not _unequal(expected_optimizer, _optimizer_tensors(model, optimizer))
    groups = json.loads((tmp_path / "expected-optimizer.json").read_text())
    for want, got in zip(groups, optimizer.param_groups, strict=True):
        assert {k: v for k, v in got.items() if k != "params"} == {**{k: v for k, v in want.items() if k != "params"},
                                                                   "betas": tuple(want["betas"])}
    # 3. Consolidated: the weights as save_pretrained lays them out; from_pretrained at tensor parallel loads them,
    #    and load_checkpoint loads the per-rank checkpoint into the tensor-parallel model.
    regular = tmp_path / "regular"
    consolidate_checkpoint(converted, regular)
    assert not _unequal(expected_weights, load_file(regular / "model.safetensors"))
    _job("load", "--output-dir", str(tmp_path), "--layout", layout, "--regular", str(regular),
         "--pieces", str(converted))
    assert not _unequal(expected_weights, load_file(tmp_path / "loaded-regular.safetensors"))
    assert not _unequal(expected_weights, load_file(tmp_path / "loaded-pieces-model.safetensors"))
    assert not _unequal(expected_optimizer, load_file(tmp_path / "loaded-pieces-optimizer.safetensors"))
    assert not _unequal(expected_weights, load_file(tmp_path / "loaded-hf-weights.safetensors"))


# ------------------------------------------------------------------ one-process sources: hostile and corrupt inputs


def _write_source(directory: Path, model: torch.nn.Module | None = None, *,
                  optimizer_model: torch.nn.Module | None = None,
                  optimizer_dir: Path | None = None) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A ``save_pretrained(distributed_checkpoint=True)``-shaped directory written by torch's own writers in one
    process (the rank-local files of a world size of 1) and, beside it, a ``save_optimizer_distributed`` directory
    (the optimizer of ``optimizer_model``, default the model's own)."""
    model = model if model is not None else tiny_llama()
    trained = optimizer_model if optimizer_model is not None else model
    optimizer = torch.optim.AdamW(decay_groups(trained), lr=1e-2)
    train_steps(trained, optimizer, steps=2)
    _write_dcp(directory, model, optimizer, trained=trained, optimizer_dir=optimizer_dir)
    return model, optimizer


def _write_dcp(directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
               trained: torch.nn.Module | None = None, optimizer_dir: Path | None = None) -> None:
    """``model``'s config and weights as ``save_pretrained(distributed_checkpoint=True)`` writes them, and the
    optimizer (of ``trained``, default ``model``) as ``save_optimizer_distributed`` does."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    model.config.save_pretrained(directory)
    dcp.save(dict(model.state_dict()), storage_writer=HuggingFaceStorageWriter(str(directory), save_distributed=True))
    flat = get_optimizer_state_dict(trained if trained is not None else model, optimizer,
                                    options=StateDictOptions(flatten_optimizer_state_dict=True))
    dcp.save({"optimizer": flat}, checkpoint_id=str(optimizer_dir or directory / "optimizer"))


@pytest.mark.parametrize("beside", [False, True], ids=["optimizer-subdirectory", "optimizer-beside-the-weights"])
def test_a_one_process_source_converts_and_loads(tmp_path, beside):
    source, converted = tmp_path / "saved", tmp_path / "converted"
    model, optimizer = _write_source(source, optimizer_dir=source if beside else None)
    assert sorted(p.name for p in source.glob("*.safetensors")) == [SHARD]
    assert (source / ".metadata").is_file() == beside
    info = convert_stock_checkpoint(source, converted)
    assert (info.step, info.manifest.world_size) == (2, 1)
    assert sorted(p.name for p in converted.iterdir() if p.is_file()) == [
        "config.json", "manifest.json", "sharded_layout.json", "training_state.json"]  # no DCP file carried over
    fresh = tiny_llama(seed=1)
    loaded = torch.optim.AdamW(decay_groups(fresh), lr=1.0)
    load_checkpoint(converted, model=fresh, optimizer=loaded, restore_rng=False, allow_inexact_resume=True)
    assert not _unequal(model.state_dict(), fresh.state_dict())
    assert not _unequal(_optimizer_tensors(model, optimizer), _optimizer_tensors(fresh, loaded))
    assert [g["weight_decay"] for g in loaded.param_groups] == [0.1, 0.0]


@pytest.mark.slow
def test_the_optimizer_directory_can_be_named(tmp_path):
    source, elsewhere = tmp_path / "saved", tmp_path / "opt-state"
    _write_source(source, optimizer_dir=elsewhere)
    done = _cli("convert", str(source), "--output", str(tmp_path / "out"), "--optimizer-dir", str(elsewhere))
    assert done.returncode == 0, done.stderr[-3000:]
    layout = json.loads((tmp_path / "out" / "sharded_layout.json").read_text())
    assert len(layout["optimizer_document"]["param_groups"]) == 2
    # without it (and none beside the weights) the weights alone are converted, given a step
    with pytest.raises(ValueError, match="pass step="):
        convert_transformers_distributed_checkpoint(source, tmp_path / "weights-only")
    info = convert_transformers_distributed_checkpoint(source, tmp_path / "weights-only", step=5)
    assert info.step == 5 and json.loads((info.path / "sharded_layout.json").read_text())["optimizer"] is None


def test_an_existing_output_is_never_overwritten(tmp_path):
    source, output = tmp_path / "saved", tmp_path / "out"
    _write_source(source)
    output.mkdir()
    (output / "notes.txt").write_text("mine")
    for overwrite in (False, True):  # not a checkpoint of ours: refused even with overwrite
        with pytest.raises(CheckpointExistsError, match=str(output)):
            convert_stock_checkpoint(source, output, overwrite=overwrite)
    assert sorted(p.name for p in output.iterdir()) == ["notes.txt"] and (output / "notes.txt").read_text() == "mine"
    # one of ours is replaced only when asked to
    ours = convert_transformers_distributed_checkpoint(source, tmp_path / "ours").manifest
    with pytest.raises(CheckpointExistsError):
        convert_transformers_distributed_checkpoint(source, tmp_path / "ours")
    assert read_manifest(tmp_path / "ours") == ours


def test_weights_and_state_files_beside_the_pieces_are_not_carried_over(tmp_path):
    source = tmp_path / "saved"
    model, _ = _write_source(source)
    (source / "training_state.json").write_text('{"format_version": 1, "progress": {"global_step": 999}}')
    save_file({"lm_head.weight": torch.zeros(2)}, source / "model.safetensors")
    (source / "tokenizer_config.json").write_text("{}")
    info = convert_transformers_distributed_checkpoint(source, tmp_path / "out")
    assert not (info.path / "model.safetensors").exists()
    assert (info.path / "tokenizer_config.json").read_text() == "{}"
    assert json.loads((info.path / "training_state.json").read_text())["progress"] == {"global_step": 2}


def test_a_truncated_piece_file_is_refused_naming_it(tmp_path):
    source = tmp_path / "saved"
    _write_source(source)
    shard = source / SHARD
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(CorruptCheckpointError, match=SHARD):
        convert_transformers_distributed_checkpoint(source, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def _rewrite_shards(source: Path, offsets: dict[str, dict[str, list[int]]] | None, *, split: str) -> None:
    """Replace the one shard by two ranks' files holding the halves (rows) of ``split``, with ``offsets`` per file
    name as their DCP_SHARDING_INFO (``None``: none at all)."""
    whole = load_file(source / SHARD)
    (source / SHARD).unlink()
    halves = whole[split].chunk(2)
    rest = {name: tensor for name, tensor in whole.items() if name != split}
    for rank, half in enumerate(halves):
        name = f"shard-0000{rank + 1}-model-00001-of-00001.safetensors"
        tensors = {split: half.contiguous(), **(rest if rank == 0 else {})}
        info = {key: {"saved_offsets": [0] * tensors[key].dim()} for key in tensors}
        info.update((offsets or {}).get(name, {}))
        save_file(tensors, source / name, metadata=None if offsets is None else {
            "DCP_SHARDING_INFO": json.dumps({k: v if isinstance(v, dict) else {"saved_offsets": v}
                                             for k, v in info.items()}), "format": "pt"})


W = "model.embed_tokens.weight"


@pytest.mark.parametrize(("offsets", "match"), [
    ({"shard-00002-model-00001-of-00001.safetensors": {W: [64, 0]}}, None),  # the halves as DCP writes them
    (None, "no readable DCP_SHARDING_INFO"),
    ({"shard-00002-model-00001-of-00001.safetensors": {W: [0, 0]}}, "overlap"),
    ({"shard-00002-model-00001-of-00001.safetensors": {W: [96, 0]}}, "uncovered"),
    ({"shard-00002-model-00001-of-00001.safetensors": {W: [64]}}, "not 2 non-negative"),
    ({"shard-00002-model-00001-of-00001.safetensors": {W: [-64, 0]}}, "not 2 non-negative"),
])
def test_piece_offsets_are_checked(tmp_path, offsets, match):
    source = tmp_path / "saved"
    model, _ = _write_source(source)
    _rewrite_shards(source, offsets, split=W)
    if match is None:
        info = convert_transformers_distributed_checkpoint(source, tmp_path / "out")
        assert info.manifest.world_size == 2
        regular = tmp_path / "regular"
        consolidate_checkpoint(info.path, regular)
        assert not _unequal(model.state_dict(), load_file(regular / "model.safetensors"))
        return
    with pytest.raises(CorruptCheckpointError, match=match) as caught:
        convert_transformers_distributed_checkpoint(source, tmp_path / "out")
    assert "shard-0000" in str(caught.value) or str(source) in str(caught.value)
    assert not (tmp_path / "out").exists()


def test_a_fifo_in_place_of_an_optimizer_record_is_refused_not_waited_on(tmp_path):
    source = tmp_path / "saved"
    _write_source(source)
    record = source / "optimizer" / "__0_0.distcp"
    record.unlink()
    os.mkfifo(record)
    with pytest.raises(CorruptCheckpointError, match=r"__0_0\.distcp.*not a regular file"):
        convert_transformers_distributed_checkpoint(source, tmp_path / "out")


def test_an_optimizer_of_another_model_is_refused(tmp_path):
    source = tmp_path / "saved"
    _write_source(source, optimizer_model=tiny_gpt2())
    with pytest.raises(CheckpointMismatchError, match="does not fit the model's weights"):
        convert_transformers_distributed_checkpoint(source, tmp_path / "out")


class _RunsCommand:
    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


@pytest.mark.slow
def test_an_optimizer_metadata_naming_os_system_is_refused(tmp_path):
    source, marker = tmp_path / "saved", tmp_path / "pwned"
    _write_source(source)
    metadata = source / "optimizer" / ".metadata"
    metadata.write_bytes(pickle.dumps(_RunsCommand(f"touch {marker}")))
    with pytest.raises(UnsafePickleError, match=r"optimizer/\.metadata"):
        convert_transformers_distributed_checkpoint(source, tmp_path / "out")
    done = _cli("convert", str(source), "--output", str(tmp_path / "out"))
    assert done.returncode != 0 and str(metadata) in done.stderr, done.stderr[-3000:]
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_a_flattened_optimizer_of_a_model_whose_names_start_with_digits(tmp_path):
    """``nn.Sequential`` parameters are named ``0.weight``: the flattened keys ``optimizer.param_groups.0.weight.lr``
    must not be taken for groups listed by index."""
    source = tmp_path / "saved"
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    model.config = tiny_llama().config  # what save_pretrained would have written beside the weights
    optimizer = torch.optim.AdamW(decay_groups(model), lr=1e-2)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    _write_dcp(source, model, optimizer)
    info = convert_transformers_distributed_checkpoint(source, tmp_path / "out")
    groups = json.loads((info.path / "sharded_layout.json").read_text())["optimizer_document"]["param_groups"]
    assert [(g["weight_decay"], g["params"]) for g in groups] == [(0.1, ["0.weight"]),
                                                                   (0.0, ["0.bias", "1.weight", "1.bias"])]


def test_plan_flat_param_groups():
    per_param = {"a": {"lr": 1.0, "weight_decay": 0.1}, "n": {"lr": 1.0, "weight_decay": 0.0},
                 "b": {"lr": 1.0, "weight_decay": 0.1}, "z": {"lr": 2.0, "weight_decay": 0.0}}
    order = ["optimizer.state.b.step", "optimizer.param_groups.b.lr", "optimizer.param_groups.n.lr",
             "optimizer.param_groups.a.lr"]
    assert plan_flat_param_groups(per_param, order=order) == [
        {"lr": 1.0, "weight_decay": 0.1, "params": ["b", "a"]},
        {"lr": 1.0, "weight_decay": 0.0, "params": ["n"]},
        {"lr": 2.0, "weight_decay": 0.0, "params": ["z"]}]  # not in the order: last
