"""hf_resumable.lazy streaming within a memory budget: residency planning, read-ahead, generate() equivalence."""

from __future__ import annotations

import sys
from pathlib import Path

import datasets
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, DataCollatorForLanguageModeling, TrainingArguments

from hf_resumable.errors import MemoryBudgetError
from hf_resumable.hub import push_sharded
from hf_resumable.lazy import LazyStateDict, StreamingModel, plan_residency
from hf_resumable.lazy._prefetch import BlockPrefetcher

from helpers.fakehub import FakeHub
from helpers.hub_fixtures import _hub_server, hub, hub_env, new_repo_id, on_meta, tiny_gpt2  # noqa: F401
from helpers.streaming_models import (
    IDS,
    NEW,
    _blocks,
    _generate,
    _gpt2,
    _llama,
    _save,
    _sizes,
    _track_populated,
    assert_streams_onto,
)

sys.path.insert(0, str(Path(__file__).parent / "trainer_scripts"))
import train_tiny  # noqa: E402


# --------------------------------------------------------------------------------------------------- planning (pure)
def test_plan_residency_fills_the_budget_after_two_slots_only_when_asked() -> None:
    assert plan_residency(100, [50] * 8) == plan_residency(100, [50] * 8, max_memory=None)
    unbounded = plan_residency(100, [50] * 8)
    assert (unbounded.resident, unbounded.slots, unbounded.budget) == ((), 2, None)
    lean = plan_residency(100, [50] * 8, max_memory=360)
    assert (lean.resident, lean.slots, lean.weight_bytes) == ((), 2, 200)
    plan = plan_residency(100, [50] * 8, max_memory=360, keep_resident=True)
    assert plan.slots == 2 and len(plan.resident) == 3 and plan.weight_bytes == 350 <= 360
    assert set(plan.resident) | set(plan.streamed) == set(range(8)) and not set(plan.resident) & set(plan.streamed)
    assert plan_residency(100, [50] * 8, max_memory="1KB").streamed == ()  # everything fits: nothing streamed
    single = plan_residency(100, [50] * 8, max_memory=160)
    assert (single.slots, single.resident, single.prefetch) == (1, (), False)
    assert plan_residency(100, [50] * 8, max_memory=300, prefetch=False).slots == 1


def test_a_budget_below_one_block_names_the_smallest_budget() -> None:
    with pytest.raises(MemoryBudgetError, match=r"smallest budget that works is 150 bytes") as info:
        plan_residency(100, [40, 50, 40], max_memory=149)
    assert isinstance(info.value, ValueError)
    assert plan_residency(100, [40, 50, 40], max_memory=150).slots == 1


def test_streaming_model_raises_the_budget_error_on_enter(tmp_path: Path) -> None:
    model = _llama()
    folder = _save(model, tmp_path / "m")
    outside, block = _sizes(model)
    streaming = StreamingModel.from_pretrained(folder, max_memory=outside + block - 1)
    with pytest.raises(MemoryBudgetError, match=f"smallest budget that works is {outside + block:,} bytes"):
        with streaming:
            pass
    assert streaming._prefetcher is None  # the failed enter stopped the threads it started
    with StreamingModel.from_pretrained(folder, max_memory=outside + block) as streamed:
        assert torch.equal(_generate(streamed), _generate(model))


# ------------------------------------------------------------------------------------------------- read-ahead thread
def test_prefetcher_restarts_when_asked_out_of_order_and_reraises_read_errors() -> None:
    read: list[int] = []
    discarded: list[int] = []

    def load(index: int) -> dict[str, torch.Tensor]:
        read.append(index)
        if index == 3:
            raise OSError("disk gone")
        return {"w": torch.tensor([index])}

    prefetcher = BlockPrefetcher([0, 1, 2, 3], load, lambda i, b: discarded.append((i, int(b["w"]))), slots=2)
    prefetcher.start()
    assert int(prefetcher.take(0)["w"]) == 0
    prefetcher.done()
    assert int(prefetcher.take(2)["w"]) == 2  # skipped 1: what was read ahead is dropped, reading restarts at 2
    prefetcher.done()
    with pytest.raises(OSError, match="disk gone"):
        prefetcher.take(3)
    prefetcher.close()
    assert read[:2] == [0, 1] and 2 in read
    assert (1, 1) in discarded and all(i == w for i, w in discarded)  # handed back with its own index


@pytest.mark.parametrize("factory", [_llama, _gpt2])
def test_streamed_generate_equals_the_full_model(tmp_path: Path, factory, monkeypatch) -> None:
    model = factory(seed=4)
    folder = _save(model, tmp_path / "m")
    outside, block = _sizes(model)
    budget = outside + 4 * block  # two read-ahead slots and two resident blocks
    populated = _track_populated(monkeypatch)
    meta = on_meta(model)
    streaming = StreamingModel(meta, folder, max_memory=budget, keep_resident=True)
    with streaming as streamed:
        plan = streaming.residency
        assert len(plan.resident) == 2 and plan.slots == 2 and plan.weight_bytes <= budget
        assert torch.equal(_generate(streamed), _generate(model))
    # streamed blocks in memory at once: never more than the two slots (the one running and the one read ahead)
    assert len(populated) >= NEW * len(plan.streamed) and block <= max(populated) <= plan.slots * block
    assert all(p.is_meta for p in _blocks(meta).parameters())  # everything released on exit


@pytest.mark.parametrize("factory", [_llama, _gpt2])
def test_streaming_onto_a_device_copies_each_block_there_and_frees_it(tmp_path: Path, factory) -> None:
    """``device=``: blocks are copied onto it before they run and freed after (here the host itself, which takes the
    same copy path; tests/test_gpu.py streams onto a GPU)."""
    assert_streams_onto("cpu", tmp_path, factory)


def test_streaming_from_an_auto_config_without_read_ahead(tmp_path: Path) -> None:
    model = _llama(seed=6)
    folder = _save(model, tmp_path / "m")
    config = AutoConfig.from_pretrained(folder)
    with StreamingModel.from_pretrained(folder, config=config, prefetch=False, max_memory="1GB") as streamed:
        assert torch.equal(_generate(streamed), _generate(model))  # everything fits: all resident
    with StreamingModel.from_pretrained(folder, config=config, prefetch=False) as streamed:
        assert torch.equal(_generate(streamed), _generate(model))


def test_headers_are_parsed_and_blocks_installed_once_however_many_tokens(tmp_path: Path, monkeypatch) -> None:
    import hf_resumable.lazy._mapped as mapped
    import hf_resumable.lazy._stream as stream

    model = _llama(seed=7)
    folder = _save(model, tmp_path / "m")
    parsed: list[str] = []
    installed: list[str] = []
    read_header, materialize = mapped.read_header, stream._materialize
    monkeypatch.setattr(mapped, "read_header", lambda path: parsed.append(Path(path).name) or read_header(path))
    monkeypatch.setattr(stream, "_materialize", lambda m, key, *a: installed.append(key) or materialize(m, key, *a))
    with StreamingModel(on_meta(model), folder) as streamed:
        assert torch.equal(_generate(streamed), _generate(model))  # NEW tokens: every block streamed NEW times
    assert parsed and len(parsed) == len(set(parsed))
    block_keys = [k for k in model.state_dict() if k.startswith("model.layers.")]
    assert sorted(installed) == sorted(block_keys)  # views installed on the first pass, kept for the others


def _rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and /proc are Linux")
def test_a_mapped_block_counts_in_rss_only_between_populate_and_evict(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from hf_resumable.lazy._mapped import ShardMaps

    weight = torch.arange(8 * 2**20, dtype=torch.float32).reshape(2**13, 2**10)  # 32 MiB
    save_file({"w": weight}, tmp_path / "m.safetensors")
    maps = ShardMaps()
    block = maps.view(tmp_path / "m.safetensors", ["w"], {"w": (weight.shape, weight.dtype)})
    before = _rss()
    block.populate()
    populated = _rss()
    assert populated - before > 0.9 * weight.nbytes
    block.evict()
    assert populated - _rss() > 0.9 * weight.nbytes
    assert torch.equal(block.tensors["w"], weight)  # still valid: faulted back in from the page cache
    maps.clear()


def test_streaming_casts_when_the_model_dtype_differs_from_the_stored_one(tmp_path: Path) -> None:
    model = _llama(seed=8)
    folder = _save(model, tmp_path / "m")
    meta = on_meta(model).to(torch.float64)
    with StreamingModel(meta, folder) as streamed:
        assert torch.equal(_generate(streamed), _generate(model.to(torch.float64)))


def test_streaming_recovers_after_a_pass_that_failed_inside_a_block(tmp_path: Path) -> None:
    model = _llama(seed=9)
    folder = _save(model, tmp_path / "m")
    meta = on_meta(model)
    calls = {"n": 0}

    def fail_once(module, args):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("boom")

    handle = meta.model.layers[3].register_forward_pre_hook(fail_once)  # runs after the streaming pre-hook
    with StreamingModel(meta, folder) as streamed:
        with pytest.raises(RuntimeError, match="boom"), torch.no_grad():
            streamed(IDS)
        handle.remove()
        assert torch.equal(_generate(streamed), _generate(model))


def _shard_gets(hub: FakeHub) -> list[str]:
    return [r.path.split("/")[-1] for r in hub.requests("GET", r"\.safetensors$") if not r.range]


def test_streaming_from_hf_url_downloads_each_needed_shard_once(hub: FakeHub) -> None:
    model = _llama(seed=5)
    repo_id = new_repo_id("stream")
    push_sharded(model, repo_id, max_shard_size="20KB")
    hub.clear_log()
    outside, block = _sizes(model)
    with StreamingModel.from_pretrained(f"hf://{repo_id}", max_memory=outside + 3 * block) as streamed:
        assert _generate(streamed).tolist() == _generate(model).tolist()
    gets = _shard_gets(hub)
    assert len(gets) == len(set(gets))  # cached: every token reads the streamed blocks again, from local files
    assert set(gets) == set(LazyStateDict.from_pretrained(repo_id).filenames)


def test_streaming_only_downloads_the_shards_it_reads(hub: FakeHub) -> None:
    model = _llama(seed=5)
    repo_id = new_repo_id("partial")
    push_sharded(model, repo_id, max_shard_size="20KB")
    hub.clear_log()
    weights = LazyStateDict.from_pretrained(repo_id)
    everything = set(weights.filenames)
    streaming = StreamingModel(on_meta(model), weights)
    with streaming, torch.no_grad():
        first_blocks = {weights.meta(n).filename for n in weights if n.startswith("model.layers.0.")}
        streaming.model.model.layers[0](torch.zeros(1, 1, model.config.hidden_size),
                                        position_embeddings=streaming.model.model.rotary_emb(
                                            torch.zeros(1, 1), torch.zeros(1, 1, dtype=torch.long)))
    got = set(_shard_gets(hub))
    assert first_blocks <= got < everything  # the blocks never run were (mostly) never downloaded


def test_streaming_a_resumable_trainer_checkpoint(tmp_path: Path) -> None:
    from hf_resumable.integrations.trainer import ResumableTrainer

    settings = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=1, save_steps=1,
                    report_to=[], disable_tqdm=True, use_cpu=True, learning_rate=1e-3)
    data = datasets.Dataset.from_dict({"input_ids": train_tiny.token_rows(8)})
    collator = DataCollatorForLanguageModeling(train_tiny.build_tokenizer(), mlm=False)
    trainer = ResumableTrainer(model=train_tiny.build_model("gpt2"), args=TrainingArguments(**settings),
                               train_dataset=data, data_collator=collator)
    trainer.train()
    checkpoint = tmp_path / "out" / "checkpoint-1"
    reference = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    outside, block = _sizes(reference)
    with StreamingModel.from_pretrained(checkpoint, max_memory=outside + block) as streamed:
        assert streamed.lm_head.weight is streamed.transformer.wte.weight  # tied, stored once
        assert torch.equal(_generate(streamed), _generate(reference))
