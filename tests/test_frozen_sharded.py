"""Sharded (FSDP2) checkpoints of a model with frozen parameters: the frozen ones are identity, not state.

A real 2-rank gloo FSDP2 run of a tiny Llama whose embedding is frozen (127 rows: the ranks hold 64 + 63)
saves with ``save_checkpoint``: the embedding is not in any piece file, ``frozen_base.json`` records
each rank's piece (dtype, shape, xxh3-128 whole and sampled); ``standalone=True`` stores it as before. Then:

* 2 -> 1 process (plain model): loads bit-exact against the consolidated reference; another embedding raises
  ``BaseMismatchError``; consolidation says the base is not stored;
* 2 -> 2 fresh ranks: resume, one more step equals the uninterrupted run's bitwise; a checkpoint saved by one
  process (one whole piece no rank holds whole) is checked on ``full_tensor()`` and loads bit-exact; a base
  with one element of the embedding changed raises ``BaseMismatchError`` on both ranks.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hf_resumable.checkpoint import (
    consolidate_checkpoint,
    load_checkpoint,
    read_manifest,
    save_checkpoint,
    verify_checkpoint,
)
from hf_resumable.errors import BaseMismatchError, BaseNotStoredError
from hf_resumable.format.safetensors_io import read_safetensors

from helpers import sharded_fixtures as fx
from helpers.distributed_launch import launch_ranks

WORKER = str(Path(__file__).parent / "scripts" / "frozen_sharded_worker.py")
EMBEDDING = "model.embed_tokens.weight"


def run_ranks(mode: str, root: Path) -> None:
    for result in launch_ranks([WORKER, mode, str(root)], world_size=2, timeout=240.0):
        assert result.returncode == 0 and not result.killed_by_timeout, result.describe()


def build_plain(*, embedding_delta: float = 0.0, seed: int = 7) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model, _ = fx.build("llama", seed=seed)
    base, _ = fx.build("llama")  # the base's frozen embedding; every trainable weight from `seed`
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(base.model.embed_tokens.weight)
        model.model.embed_tokens.weight[5, 3] += embedding_delta
    model.model.embed_tokens.weight.requires_grad_(False)
    return model, torch.optim.AdamW(model.parameters(), lr=0.5)


def stored_names(path: Path) -> set[str]:
    names: set[str] = set()
    for relpath in read_manifest(path).files:
        if relpath.startswith("sharded/model-"):
            names |= set(read_safetensors(path / relpath))
    return names


def piece_bytes(path: Path) -> int:
    return sum((path / f).stat().st_size for f in read_manifest(path).files if f.startswith("sharded/model-"))


@pytest.mark.distributed
def test_fsdp2_frozen_embedding_is_recorded_not_stored_and_resumes_exactly(tmp_path: Path):
    run_ranks("save", tmp_path)
    path, standalone = tmp_path / "checkpoint-2", tmp_path / "standalone-2"
    assert verify_checkpoint(path, full=True).ok and verify_checkpoint(standalone, full=True).ok
    # Bytes saved exclude the frozen embedding; the record describes both ranks' pieces of it.
    assert EMBEDDING not in stored_names(path) and EMBEDDING in stored_names(standalone)
    assert "frozen_base.json" in read_manifest(path).files
    assert "frozen_base.json" not in read_manifest(standalone).files
    embedding_bytes = 127 * 32 * 4
    assert piece_bytes(standalone) - piece_bytes(path) >= embedding_bytes
    record = json.loads((path / "frozen_base.json").read_text())
    assert record["version"] == 2 and list(record["tensors"]) == [EMBEDDING]
    pieces = record["tensors"][EMBEDDING]["pieces"]
    assert [(p["offset"], p["shape"]) for p in pieces] == [([0, 0], [64, 32]), ([64, 0], [63, 32])]
    assert EMBEDDING not in json.loads((path / "sharded_layout.json").read_text())["model"]["tensors"]

    # 2 -> 1 (plain model): bit-exact against the consolidated reference, the base checked first.
    model, optimizer = build_plain()
    load_checkpoint(path, model=model, optimizer=optimizer, allow_inexact_resume=True, verify="full")
    assert fx.compare_to_reference(tmp_path, model, optimizer) == []
    other, other_optimizer = build_plain(embedding_delta=1.0, seed=8)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(BaseMismatchError, match=r"model.embed_tokens.weight: the bytes of its box at \[0, 0\]"):
        load_checkpoint(path, model=other, optimizer=other_optimizer, allow_inexact_resume=True)
    assert all(torch.equal(before[k], v) for k, v in other.state_dict().items()), "a refused load wrote"
    with pytest.raises(BaseNotStoredError, match="load_checkpoint"):
        consolidate_checkpoint(path, tmp_path / "export")
    assert not (tmp_path / "export").exists()
    # One process saves the loaded state: one whole piece, which 2 ranks hold only in halves.
    save_checkpoint(tmp_path / "plain-2", model=model, optimizer=optimizer, step=2, layout="pieces")
    assert EMBEDDING not in stored_names(tmp_path / "plain-2")

    # 2 -> 2 fresh ranks: resume exactly; 1 -> 2 exactly; another base refused on both ranks.
    run_ranks("resume", tmp_path)
    results = [json.loads((tmp_path / f"result-resume-rank{r}.json").read_text()) for r in range(2)]
    assert results[0]["problems"] == [] and results[0]["continued"] == [] and results[0]["plain_problems"] == []
    for result in results:
        assert result["mismatch"] is not None and "model.embed_tokens.weight" in result["mismatch"], result


def test_piece_records_are_validated():
    from hf_resumable.checkpoint.pieces import _frozen
    from hf_resumable.errors import CorruptCheckpointError

    hashes = {"xxh3_128": "0" * 32, "sample_xxh3_128": "1" * 32}
    good = {"version": 2, "hash": "xxh3-128", "sample": {"windows": 16, "window_bytes": 4096}, "source": {},
            "tied": {}, "tensors": {"w": {"dtype": "F32", "shape": [5, 2], "pieces": [
                {"offset": [0, 0], "shape": [3, 2], **hashes}, {"offset": [3, 0], "shape": [2, 2], **hashes}]}}}
    record = _frozen.FrozenRecord.from_json(good, source="r")
    assert record.tensors["w"].xxh3_128 is None and len(record.tensors["w"].boxes()) == 2
    assert record.to_json() == good
    for piece, match in [({"offset": [4, 0], "shape": [2, 2], **hashes}, "inside"),  # past the end
                         ({"offset": [3, 0], "shape": [1, 2], **hashes}, "tile"),  # a row missing
                         ({"offset": [3, 0], "shape": [2, 2], "xxh3_128": "x"}, "hex")]:
        bad = json.loads(json.dumps(good))
        bad["tensors"]["w"]["pieces"][1] = piece
        with pytest.raises(CorruptCheckpointError, match=match):
            _frozen.FrozenRecord.from_json(bad, source="r")
    # The regular load path never takes a piece record for a whole-tensor one.
    live = {"w": torch.zeros(5, 2)}
    with pytest.raises(BaseMismatchError, match="recorded piece by piece"):
        _frozen.check_frozen_base(record, live, full=False, strict=True, source="r")
