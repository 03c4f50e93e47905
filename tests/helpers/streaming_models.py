"""The lazy-streaming tests' models (6-block tiny Llama and GPT-2), their saved folders and sizes, greedy generation,
and :func:`assert_streams_onto` (a model streamed onto a device generates what the full model does)."""

from __future__ import annotations

from pathlib import Path

import torch

from hf_resumable.hub import write_sharded_model
from hf_resumable.lazy import StreamingModel

from helpers import tiny_models
from helpers.hub_fixtures import on_meta

IDS = torch.tensor([[5, 17, 3, 99, 42, 7, 1]])


NEW = 6


def _generate(model: torch.nn.Module, device: str | torch.device = "cpu") -> torch.Tensor:
    ids = (IDS % model.config.vocab_size).to(device)
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False).cpu()


def _llama(seed: int = 0) -> torch.nn.Module:
    """A tiny Llama with 6 blocks (so a budget can keep some resident and stream the rest)."""
    return tiny_models.tiny_llama(seed, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=6).eval()


def _gpt2(seed: int = 0) -> torch.nn.Module:
    """A tiny GPT-2 (lm_head tied to the input embedding) with 6 blocks."""
    return tiny_models.tiny_gpt2(seed, n_layer=6).eval()


# --------------------------------------------------------------------------------------------------- generate()
def _track_populated(monkeypatch) -> list[int]:
    """Bytes of streamed tensors populated and not yet evicted, recorded after every populate (populate and evict
    both run on the read-ahead thread, so the record is exact)."""
    from hf_resumable.lazy._mapped import MappedBlock

    live: dict[int, int] = {}
    peaks: list[int] = []
    populate, evict = MappedBlock.populate, MappedBlock.evict

    def tracked_populate(self: MappedBlock) -> None:
        populate(self)
        live[id(self)] = sum(t.nbytes for t in self.tensors.values())
        peaks.append(sum(live.values()))

    def tracked_evict(self: MappedBlock) -> None:
        live.pop(id(self), None)
        evict(self)

    monkeypatch.setattr(MappedBlock, "populate", tracked_populate)
    monkeypatch.setattr(MappedBlock, "evict", tracked_evict)
    return peaks


def assert_streams_onto(device: str, tmp_path: Path, factory) -> None:
    """Greedy generation of a model streamed onto ``device`` (one block resident, five streamed) equals the full
    model's there, and each streamed block's copy is freed after it runs."""
    model = factory(seed=5).to(device)
    folder = _save(model.cpu(), tmp_path / "m")
    outside, block = _sizes(model)
    meta = on_meta(model)
    streaming = StreamingModel(meta, folder, max_memory=outside + 3 * block, keep_resident=True, device=device)
    with streaming as streamed:
        assert len(streaming.residency.resident) == 1 and len(streaming.residency.streamed) == 5
        assert all(p.device.type == device for p in streamed.parameters() if not p.is_meta)
        assert torch.equal(_generate(streamed, device), _generate(model.to(device), device))
        assert not streaming._fixed  # a copy is freed after each run, never kept installed
        # between passes only the resident block holds weights; every streamed block is back on the meta device
        assert all(p.is_meta for i in streaming.residency.streamed for p in _blocks(meta)[i].parameters())
    assert all(p.is_meta for p in _blocks(meta).parameters())


def _blocks(model: torch.nn.Module) -> torch.nn.ModuleList:
    return model.transformer.h if hasattr(model, "transformer") else model.model.layers


def _save(model: torch.nn.Module, directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(directory)
    write_sharded_model(model.state_dict(), directory, max_shard_size="20KB")
    return directory


def _sizes(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes outside the blocks, bytes of one block)."""
    block = sum(p.numel() * p.element_size() for p in _blocks(model)[0].parameters())
    total = sum(p.numel() * p.element_size() for p in model.parameters())  # tied weights counted once
    return total - block * len(_blocks(model)), block
