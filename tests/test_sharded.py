"""Sharded (FSDP2 / DTensor) checkpoints: parallel per-rank writes, resharding loads at another world size.

Real 2-rank gloo groups on CPU (started and stopped here) train tiny GPT-2 / Llama models under FSDP2
``fully_shard`` with AdamW. Every comparison is bitwise against the *consolidated originals* of the
saving run (full weights and full optimizer tensors):

* 2 ranks -> 2 fresh ranks (same world size, RNG restored; the next step equals the uninterrupted run's)
  and 2 ranks -> 1 process (plain model):
  weights, optimizer tensors and param groups equal; ``layout="hf"`` checkpoints and the consolidated
  export loads with ``from_pretrained`` and with ``load_checkpoint``; the elastic data position continues
  with exactly the unseen samples; a rank SIGKILLed inside a later save leaves that checkpoint the latest;
* 1 process (plain model) -> 2 FSDP2 ranks (Llama, unevenly sharded embedding): the same, from a sharded
  and from a regular (``save_checkpoint``) checkpoint.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch

from hf_resumable.checkpoint import (
    Manifest,
    consolidate_checkpoint,
    find_latest_checkpoint,
    load_checkpoint,
    read_manifest,
    save_checkpoint,
    verify_checkpoint,
)
from hf_resumable.checkpoint._types import Box, intersect_boxes
from hf_resumable.checkpoint.pieces._piece_layout import plan_region_reads
from hf_resumable.constants import SHARDS_KEY
from hf_resumable.conversions.stock import reshard_checkpoint
from hf_resumable.data.elastic import ElasticSampler
from hf_resumable.errors import (
    CheckpointMismatchError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    InexactResumeError,
)
from hf_resumable.format.safetensors_io import hash_file

from helpers import sharded_fixtures as fx
from helpers.distributed_launch import launch_ranks

WORKER = str(Path(__file__).parent / "scripts" / "sharded_worker.py")
WORLD_SIZE = 2


def run_ranks(mode: str, root: Path, kind: str, *, step: int = 2, timeout: float = 150.0) -> list:
    results = launch_ranks([WORKER, mode, str(root), kind, str(step)], world_size=WORLD_SIZE, timeout=timeout)
    failed = [r for r in results if r.returncode != 0 or r.killed_by_timeout] if mode != "crash" else []
    assert not failed, "\n".join(r.describe() for r in failed)  # every failed rank: the first to crash among them
    return results


def sampler(world_size: int = 1) -> ElasticSampler:
    return ElasticSampler(fx.DATASET_LEN, seed=fx.SEED, world_size=world_size, batch_size=fx.BATCH_SIZE)


def assert_every_sample_once(*groups: list[int]) -> None:
    everything = [i for group in groups for i in group]
    assert sorted(everything) == list(range(fx.DATASET_LEN)), everything


# --- pure planning ---------------------------------------------------------------------------------


def test_region_reads_assemble_any_box_from_uneven_pieces():
    pieces = {"r0": Box((0, 0), (3, 4)), "r1": Box((3, 0), (2, 4))}  # 5 rows split 3 + 2
    reads = plan_region_reads(Box((2, 1), (2, 2)), pieces, name="w", source="t")
    assert [(r.file, r.source, r.target) for r in reads] == [
        ("r0", (slice(2, 3), slice(1, 3)), (slice(0, 1), slice(0, 2))),
        ("r1", (slice(0, 1), slice(1, 3)), (slice(1, 2), slice(0, 2))),
    ]
    assert intersect_boxes(Box((), ()), Box((), ())) == Box((), ())  # 0-d tensors (AdamW "step")


def test_region_reads_refuse_pieces_that_do_not_cover_the_box():
    with pytest.raises(CorruptCheckpointError, match="cover 3 of the 5"):
        plan_region_reads(Box((0,), (5,)), {"r0": Box((0,), (3,))}, name="w", source="t")


# --- single process --------------------------------------------------------------------------------


@pytest.fixture
def plain_checkpoint(tmp_path) -> Path:
    """A plain (unsharded) Llama trained 2 steps, saved sharded and regular by one process, with its reference."""
    model, optimizer = fx.build("llama")
    data = sampler()
    seen = fx.train(model, optimizer, data, steps=2)
    save_checkpoint(tmp_path / "checkpoint-2", model=model, optimizer=optimizer, step=2,
                    training_state={"sampler": data.state_dict()}, layout="pieces")
    save_checkpoint(tmp_path / "regular-2", model=model, optimizer=optimizer, step=2,
                    training_state={"sampler": data.state_dict()})
    fx.write_reference(tmp_path, model, optimizer, is_main=True)
    (tmp_path / "seen.json").write_text(json.dumps(seen))
    return tmp_path


def test_plain_model_round_trip_and_typed_errors(plain_checkpoint):
    path = plain_checkpoint / "checkpoint-2"
    assert verify_checkpoint(path, full=True).ok
    model, optimizer = fx.build("llama", seed=5)
    load_checkpoint(path, model=model, optimizer=optimizer)
    assert fx.compare_to_reference(plain_checkpoint, model, optimizer) == []

    model, optimizer = fx.build("llama", seed=6)
    load_checkpoint(plain_checkpoint / "regular-2", model=model, optimizer=optimizer)
    assert fx.compare_to_reference(plain_checkpoint, model, optimizer) == []
    with pytest.raises(IncompleteCheckpointError, match="already a regular checkpoint"):
        consolidate_checkpoint(plain_checkpoint / "regular-2", plain_checkpoint / "export")

    wrong, wrong_optimizer = fx.build("gpt2")
    with pytest.raises(CheckpointMismatchError, match="missing from the checkpoint"):
        load_checkpoint(path, model=wrong, optimizer=wrong_optimizer)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(CheckpointMismatchError, match="optimizer was AdamW"):
        load_checkpoint(path, model=model, optimizer=sgd)
    parameters = list(model.parameters())
    split = torch.optim.AdamW([{"params": parameters[:1]}, {"params": parameters[1:]}], lr=0.1)
    with pytest.raises(CheckpointMismatchError, match="1 param group"):
        load_checkpoint(path, model=model, optimizer=split)
    assert not split.state  # refused before anything was read


def resign(path: Path, relpath: str) -> None:
    """Rewrite the manifest after editing ``relpath``, as an attacker or a buggy tool could."""
    manifest = read_manifest(path)
    files = {**manifest.files, relpath: hash_file(path / relpath)}
    (path / "manifest.json").write_bytes(Manifest(files=files, step=manifest.step).to_json())


def test_missing_or_misdescribed_pieces_raise_typed_errors(plain_checkpoint):
    path = plain_checkpoint / "checkpoint-2"
    layout = json.loads((path / "sharded_layout.json").read_text())
    pieces = layout["model"]["pieces"]["sharded/model-rank00000-of-00001.safetensors"]
    pieces["model.norm.weight"]["shape"] = [3]
    (path / "sharded_layout.json").write_text(json.dumps(layout))
    resign(path, "sharded_layout.json")
    model, optimizer = fx.build("llama", seed=5)
    with pytest.raises(CorruptCheckpointError, match="'model.norm.weight' is not stored as"):
        load_checkpoint(path, model=model, optimizer=optimizer)
    (path / "sharded/optimizer-rank00000-of-00001.safetensors").unlink()
    with pytest.raises(IncompleteCheckpointError, match="missing"):
        load_checkpoint(path, model=model, optimizer=optimizer)


def test_optimizer_that_never_stepped_is_saved_and_loaded_without_side_effects(tmp_path):
    model, optimizer = fx.build("gpt2")
    save_checkpoint(tmp_path / "checkpoint-0", model=model, optimizer=optimizer, step=0, layout="pieces")
    assert not optimizer.state, "saving must not initialize the optimizer (AdamW's step count would shift)"
    fresh, fresh_optimizer = fx.build("gpt2", seed=3)
    fresh_optimizer.param_groups[0]["lr"] = 0.5
    load_checkpoint(tmp_path / "checkpoint-0", model=fresh, optimizer=fresh_optimizer)
    assert not fresh_optimizer.state and fresh_optimizer.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, fresh.state_dict()[name]), name


# --- 2 ranks <-> 1 process -----------------------------------------------------------------------


@pytest.mark.distributed
def test_fsdp2_two_ranks_save_load_on_one_process_and_consolidate(tmp_path):
    from transformers import GPT2LMHeadModel

    run_ranks("save", tmp_path, "gpt2")
    path = tmp_path / "checkpoint-2"
    # 2 -> 2: equal state, and the next training step (dropout on) equals the uninterrupted run's, bitwise.
    assert json.loads((tmp_path / "result-same-world.json").read_text()) == {"problems": [], "continued": []}
    manifest = read_manifest(path)
    assert manifest.world_size == WORLD_SIZE and verify_checkpoint(path, full=True).ok
    pieces = sorted(f for f in manifest.files if f.startswith("sharded/"))
    assert pieces == [f"sharded/{kind}-rank0000{r}-of-00002.safetensors" for kind in ("model", "optimizer")
                      for r in range(2)]

    # A world-size change is never silent.
    model, optimizer = fx.build("gpt2", seed=5)
    with pytest.raises(InexactResumeError, match="saved by 2 rank"):
        load_checkpoint(path, model=model, optimizer=optimizer)
    loaded = load_checkpoint(path, model=model, optimizer=optimizer, allow_inexact_resume=True)
    assert fx.compare_to_reference(tmp_path, model, optimizer) == []

    # Elastic data: 2 steps on 2 ranks, then the rest of the epoch on 1 rank.
    rest = sampler(world_size=1)
    rest.load_state_dict(loaded.training_state["sampler"])
    seen = [json.loads((tmp_path / f"seen-rank{r}.json").read_text()) for r in range(WORLD_SIZE)]
    assert_every_sample_once(*seen, [i for batch in rest for i in batch])

    # Resharding a checkpoint of two ranks names the way: consolidate it first.
    with pytest.raises(ValueError, match="consolidate_checkpoint"):
        reshard_checkpoint(path, max_shard_size="1MB", output=tmp_path / "resharded")
    assert not (tmp_path / "resharded").exists()
    # Consolidated export: HF sharded safetensors for from_pretrained, and a regular checkpoint.
    consolidate_checkpoint(path, tmp_path / "export", max_shard_size=40_000)
    index = json.loads((tmp_path / "export" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 2 and "lm_head.weight" not in index["weight_map"]
    hf_model = GPT2LMHeadModel.from_pretrained(tmp_path / "export")
    reference = fx.read_safetensors(tmp_path / fx.REFERENCE_FILE)
    for name, tensor in hf_model.state_dict().items():
        assert torch.equal(tensor, reference[f"model/{name}"]), name
    model, optimizer = fx.build("gpt2", seed=6)
    load_checkpoint(tmp_path / "export", model=model, optimizer=optimizer, allow_inexact_resume=True)
    assert fx.compare_to_reference(tmp_path, model, optimizer) == []

    # layout="hf": the checkpoint directory itself is an HF sharded model, and still reshards on load.
    hf_dir = tmp_path / "hf-2"
    assert not any(f.startswith("sharded/model-") for f in read_manifest(hf_dir).files)
    index = json.loads((hf_dir / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 2 and "lm_head.weight" not in index["weight_map"]
    # each rank wrote its own shards; the index carries every shard's record (what a Hub download checks it against)
    records = index["metadata"][SHARDS_KEY]
    assert set(records) == set(index["weight_map"].values())
    for shard, record in records.items():
        on_disk = hash_file(hf_dir / shard)
        assert (record["size"], record["xxh3_128"]) == (on_disk.size, on_disk.xxh3_128), shard
    for name, tensor in GPT2LMHeadModel.from_pretrained(hf_dir).state_dict().items():
        assert torch.equal(tensor, reference[f"model/{name}"]), name
    model, optimizer = fx.build("gpt2", seed=7)
    load_checkpoint(hf_dir, model=model, optimizer=optimizer, allow_inexact_resume=True)
    assert fx.compare_to_reference(tmp_path, model, optimizer) == []
    # Weights that fit in one shard: one model.safetensors (written by rank 0), no index.
    single = tmp_path / "hf-single-2"
    assert "model.safetensors" in read_manifest(single).files
    assert not (single / "model.safetensors.index.json").exists() and verify_checkpoint(single, full=True).ok
    for name, tensor in GPT2LMHeadModel.from_pretrained(single).state_dict().items():
        assert torch.equal(tensor, reference[f"model/{name}"]), name

    # A rank SIGKILLed while writing its pieces: no checkpoint-3, checkpoint-2 stays the latest valid one.
    crashed = run_ranks("crash", tmp_path, "gpt2", step=3, timeout=60.0)
    assert crashed[1].returncode == -signal.SIGKILL, crashed[1].describe()
    assert crashed[0].returncode != 0 and "rank 0 done" not in crashed[0].stdout, crashed[0].describe()
    assert not (tmp_path / "checkpoint-3").exists()
    assert any(p.name.startswith(".tmp-checkpoint-3") for p in tmp_path.iterdir()), "the kill missed the save"
    assert find_latest_checkpoint(tmp_path) == path and verify_checkpoint(path, full=True).ok


@pytest.mark.distributed
def test_one_process_save_loads_on_two_fsdp2_ranks(plain_checkpoint):
    run_ranks("load", plain_checkpoint, "llama")
    result = json.loads((plain_checkpoint / "result.json").read_text())
    assert result == {"problems": [], "regular_problems": [], "step": 2}
    seen = json.loads((plain_checkpoint / "seen.json").read_text())
    rest = [json.loads((plain_checkpoint / f"rest-rank{r}.json").read_text()) for r in range(WORLD_SIZE)]
    assert rest[0] and rest[1]
    assert_every_sample_once(seen, *rest)
