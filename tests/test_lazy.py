"""hf_resumable.lazy: LazyStateDict, load_lazily (strictness decided once), and layer streaming."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from hf_resumable.errors import CheckpointMismatchError, CheckpointNotFoundError, IncompleteCheckpointError
from hf_resumable.hub import push_sharded, write_sharded_model
from hf_resumable.lazy import LazyStateDict, StreamingModel, load_lazily, plan_load, stream_forward

from helpers.fakehub import FakeHub
from helpers.hub_fixtures import _hub_server, hub, hub_env, new_repo_id, on_meta, tiny_gpt2, tiny_llama  # noqa: F401
from helpers.streaming_models import _track_populated

IDS = torch.tensor([[5, 17, 3, 99, 42, 7, 1]])


def _save(state: dict, directory: Path, max_shard_size: int | str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    write_sharded_model(state, directory, max_shard_size=max_shard_size)
    return directory


def _logits(model: nn.Module, ids: torch.Tensor = IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def _shard_gets(hub: FakeHub) -> list[str]:
    return sorted({r.path.split("/")[-1] for r in hub.requests("GET", r"\.safetensors$") if not r.range})


# --------------------------------------------------------------------------------------------------- LazyStateDict
def test_lazy_state_dict_local_matches_state_dict(tmp_path: Path) -> None:
    model = tiny_llama()
    folder = _save(model.state_dict(), tmp_path / "m", "20KB")
    weights = LazyStateDict.from_pretrained(folder)
    state = model.state_dict()
    assert set(weights) == set(state) and len(weights.filenames) >= 3
    for name, tensor in state.items():
        assert weights.meta(name).shape == tuple(tensor.shape) and weights.meta(name).dtype == tensor.dtype
        assert torch.equal(weights[name], tensor)
    with pytest.raises(KeyError, match="not stored"):
        weights["nope"]
    single = LazyStateDict.from_pretrained(folder / weights.filenames[0])
    assert set(single) == set(weights.group_by_file(list(weights))[weights.filenames[0]])


def test_lazy_state_dict_errors(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError, match="no model.safetensors.index.json"):
        LazyStateDict.from_pretrained(tmp_path)
    with pytest.raises(CheckpointNotFoundError, match="no such local path"):
        LazyStateDict.from_pretrained(tmp_path / "nope")
    folder = _save(tiny_gpt2().state_dict(), tmp_path / "m", "20KB")
    victim = sorted(folder.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(IncompleteCheckpointError, match=f"names shard '{victim.name}'"):
        LazyStateDict.from_pretrained(folder)


def test_lazy_state_dict_repo_reads_headers_then_touched_shards_only(hub: FakeHub) -> None:
    model = tiny_llama()
    repo_id = new_repo_id("lazy")
    push_sharded(model, repo_id, max_shard_size="20KB")
    hub.clear_log()
    weights = LazyStateDict.from_pretrained(repo_id)
    assert _shard_gets(hub) == []  # only ranged header reads so far
    assert all(r.bytes_sent <= 100_001 for r in hub.requests("GET", r"\.safetensors$"))
    name = "model.layers.1.mlp.down_proj.weight"
    assert weights.meta(name).shape == (32, 64)
    assert torch.equal(weights[name], model.state_dict()[name])
    assert _shard_gets(hub) == [weights.meta(name).filename]


# --------------------------------------------------------------------------------------------------- strictness matrix
class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(64, 64)
        self.b = nn.Linear(64, 64)
        self.register_buffer("scale", torch.ones(4))


def _variant(kind: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    state = {k: v.clone() for k, v in _Net().state_dict().items()}
    if kind == "extra":
        state["c.weight"] = torch.ones(2)
    elif kind == "missing":
        del state["b.bias"]
    return state


@pytest.mark.parametrize("shards", [1, 2])
@pytest.mark.parametrize("kind", ["exact", "extra", "missing"])
@pytest.mark.parametrize("strict", [True, False])
def test_strictness_matrix(tmp_path: Path, strict: bool, kind: str, shards: int) -> None:
    state = _variant(kind)
    folder = _save(state, tmp_path / "ckpt", "1GB" if shards == 1 else 17_000)
    assert len(LazyStateDict.from_pretrained(folder).filenames) == shards
    torch.manual_seed(2)
    model = _Net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    expected_missing = ["b.bias"] if kind == "missing" else []
    expected_unexpected = ["c.weight"] if kind == "extra" else []
    if strict and kind != "exact":
        with pytest.raises(CheckpointMismatchError, match="missing keys" if kind == "missing" else "unexpected keys"):
            load_lazily(model, folder, strict=strict)
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # failed before reading
        return
    assert load_lazily(model, folder, strict=strict) == (expected_missing, expected_unexpected)
    for key, value in model.state_dict().items():
        assert torch.equal(value, state[key] if key in state else before[key])


def test_all_mismatches_reported_at_once_and_shape_errors_even_when_not_strict(tmp_path: Path) -> None:
    state = _variant("missing")
    state["c.weight"] = torch.ones(2)
    state["a.weight"] = torch.ones(3, 3)
    folder = _save(state, tmp_path / "ckpt", 17_000)
    with pytest.raises(CheckpointMismatchError, match=r"missing keys \(1\).*unexpected keys \(1\).*shape mismatch"):
        load_lazily(_Net(), folder)
    with pytest.raises(CheckpointMismatchError, match=r"a.weight: checkpoint \[3, 3\] vs model \[64, 64\]"):
        load_lazily(_Net(), folder, strict=False)


def test_strict_true_loads_meta_model_from_multi_shard_checkpoint(tmp_path: Path) -> None:
    model = tiny_gpt2()
    folder = _save(model.state_dict(), tmp_path / "m", "20KB")
    assert len(LazyStateDict.from_pretrained(folder).filenames) >= 3
    meta = on_meta(model)
    assert load_lazily(meta, folder, strict=True) == ([], [])
    assert meta.lm_head.weight is meta.transformer.wte.weight  # tied, stored once
    assert not any(p.is_meta for p in meta.parameters())
    assert torch.equal(_logits(meta), _logits(model))


def test_alias_fills_untied_model_key(tmp_path: Path) -> None:
    shared = torch.randn(8, 4)
    folder = _save({"x.weight": shared, "y.weight": shared}, tmp_path / "m", "1GB")
    model = nn.ModuleDict({"x": nn.Linear(4, 8, bias=False), "y": nn.Linear(4, 8, bias=False)})
    assert plan_load(model, LazyStateDict.from_pretrained(folder)).sources == {"x.weight": ["x.weight", "y.weight"]}
    assert load_lazily(model, folder) == ([], [])
    assert torch.equal(model.y.weight, shared) and model.y.weight is not model.x.weight


@pytest.mark.slow
def test_load_lazily_llama_from_repo_downloads_each_shard_once(hub: FakeHub) -> None:
    model = tiny_llama(seed=3)
    repo_id = new_repo_id("llama")
    push_sharded(model, repo_id, max_shard_size="20KB")
    hub.clear_log()
    meta = on_meta(model)
    assert load_lazily(meta, repo_id) == ([], [])
    assert torch.equal(_logits(meta), _logits(model))
    gets = [r.path for r in hub.requests("GET", r"\.safetensors$") if not r.range]
    assert len(gets) == len(set(gets)) == len(LazyStateDict.from_pretrained(repo_id).filenames)


# --------------------------------------------------------------------------------------------------- streaming
@pytest.mark.parametrize("factory", [tiny_gpt2, tiny_llama])
def test_stream_forward_equals_full_model(tmp_path: Path, factory, monkeypatch) -> None:
    model = factory(seed=4)
    folder = _save(model.state_dict(), tmp_path / "m", "20KB")
    meta = on_meta(model)
    populated = _track_populated(monkeypatch)
    blocks = meta.transformer.h if hasattr(meta, "transformer") else meta.model.layers
    block_bytes = max(sum(p.numel() * p.element_size() for p in b.parameters()) for b in model.modules()
                      if b.__class__ is blocks[0].__class__)
    out = stream_forward(meta, folder, IDS)
    assert torch.equal(out.logits, _logits(model))
    assert len(populated) >= len(blocks) and max(populated) <= 2 * block_bytes  # the running block and the next
    assert all(p.is_meta for p in blocks.parameters())  # released after the pass


@pytest.mark.slow
def test_streaming_generate_and_from_repo(hub: FakeHub) -> None:
    model = tiny_llama(seed=5)
    repo_id = new_repo_id("stream")
    push_sharded(model, repo_id, max_shard_size="20KB")
    meta = on_meta(model)
    with torch.no_grad():
        expected = model.generate(IDS, max_new_tokens=4, do_sample=False)
    with StreamingModel(meta, repo_id) as streamed, torch.no_grad():
        generated = streamed.generate(IDS, max_new_tokens=4, do_sample=False)
    assert torch.equal(generated, expected)


def test_streaming_strictness_checked_once_on_enter(tmp_path: Path) -> None:
    model = tiny_gpt2()
    state = {k: v for k, v in model.state_dict().items() if k != "transformer.h.1.mlp.c_fc.bias"}
    folder = _save(state, tmp_path / "m", "20KB")
    with pytest.raises(CheckpointMismatchError, match=r"transformer.h.1.mlp.c_fc.bias"):
        with StreamingModel(on_meta(model), folder):
            pass
